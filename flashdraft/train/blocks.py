"""Anchors and blocks: which positions of a sequence are trained, and on what.

Each anchor makes one block: position 0 is the anchor token (a real, committed token),
positions 1..B-1 are the mask token. In the fill-in layout (DFlash, DFlash2) the label of
position k >= 1 is the token at anchor + k; in the anchor-first layout (DSpark) every
position is trained, position k on the token at anchor + k + 1. Anchors are drawn among
positions where the anchor token and the token after it are both supervised (completion
tokens), as at inference the anchor is always a token the target produced. The attention
rule itself (context strictly before the anchor, own block bidirectional, never another
block) lives in `flashdraft.drafter.model.attention_mask`.
"""

from __future__ import annotations

import torch

IGNORE = -100  # label of a position that is not trained


def candidate_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions t with loss_mask[t] and loss_mask[t + 1]: [num_candidates] long."""
    ok = loss_mask[:-1] & loss_mask[1:]
    return ok.nonzero().squeeze(1)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Up to num_anchors distinct candidate anchors, sorted: [K] long."""
    candidates = candidate_anchors(loss_mask)
    if len(candidates) > num_anchors:
        pick = torch.randperm(len(candidates), generator=generator)[:num_anchors]
        candidates = candidates[pick.sort().values]
    return candidates


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    first_draft: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block inputs and labels for the given anchors.

    input_ids, loss_mask: [T]; anchors: [K]; first_draft: the layout's first drafting position
    (`DrafterConfig.first_draft_position`: 1 fill-in, 0 anchor-first). Returns block_ids [K * B]
    (anchor, mask, ...) and labels [K * B]: position k >= first_draft is labelled with the token at
    anchor + k + 1 - first_draft where that position exists and is supervised, IGNORE elsewhere
    (fill-in: always at k = 0, the anchor is not a prediction).
    """
    seq_len = input_ids.shape[0]
    offsets = torch.arange(block_size)
    positions = anchors[:, None] + offsets[None, :] + (1 - first_draft)  # [K, B]: where each label sits
    inside = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1)
    labels = torch.where(inside & loss_mask[clamped], input_ids[clamped], IGNORE)
    labels[:, :first_draft] = IGNORE
    if first_draft == 0:  # anchor-first: a position is trained only after its predecessor (the Markov input) is known
        labels = torch.where((labels != IGNORE).int().cumprod(1).bool(), labels, IGNORE)
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = input_ids[anchors]
    return block_ids.reshape(-1), labels.reshape(-1)
