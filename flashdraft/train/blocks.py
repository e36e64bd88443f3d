"""Anchors and blocks: which positions of a sequence are trained, and on what.

Each anchor makes one block: position 0 is the anchor token (a real, committed token),
positions 1..B-1 are the mask token, and the label of position k is the token at
anchor + k. Anchors are drawn among positions where the anchor token and the token after
it are both supervised (completion tokens), as at inference the anchor is always a token
the target produced. The attention rule itself (context strictly before the anchor, own
block bidirectional, never another block) lives in `flashdraft.model.attention_mask`.
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
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block inputs and labels for the given anchors.

    input_ids, loss_mask: [T]; anchors: [K]. Returns block_ids [K * B] (anchor, mask, ...)
    and labels [K * B]: the token at anchor + k for k >= 1 where that position exists and
    is supervised, IGNORE elsewhere (always at k = 0: the anchor is not a prediction).
    """
    seq_len = input_ids.shape[0]
    offsets = torch.arange(block_size)
    positions = anchors[:, None] + offsets[None, :]  # [K, B]
    inside = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1)
    labels = torch.where(inside & loss_mask[clamped], input_ids[clamped], IGNORE)
    labels[:, 0] = IGNORE
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = input_ids[anchors]
    return block_ids.reshape(-1), labels.reshape(-1)
