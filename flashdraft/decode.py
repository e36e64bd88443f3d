"""Speculative decoding with a DFlash drafter (section 3 of the reference doc), and the
plain decoding it must reproduce.

One step: the drafter sees the committed context (features of every token before the
anchor) and drafts a block [anchor, mask, ..., mask] in one pass; the target verifies the
block in one pass; the longest agreeing prefix plus the target's bonus token is committed,
the target cache is rolled back to the committed tokens, and their features become new
drafter context. Greedy is token-identical to `greedy_generate`; with temperature > 0 the
accept/resample rule keeps the target's distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from flashdraft.model import DFlashDrafter
from flashdraft.target import TargetModel


class Proposer(Protocol):
    """What speculative decoding needs of a drafter: logits for the block after the anchor."""

    context_layer_ids: list[int]  # target layers whose features it wants as context (may be empty)

    def propose(
        self, tokens: list[int], anchor_pos: int, new_context: torch.Tensor | None, new_positions: torch.Tensor,
        block: int,
    ) -> torch.Tensor:  # fmt: skip
        """tokens: everything committed, ending with the anchor (at anchor_pos); new_context:
        features [1, C, n * H] of tokens committed since the last call, at new_positions [1, C].
        Returns logits [block - 1, V] (one-hot rows for a deterministic drafter)."""
        ...


@dataclass
class GenerationResult:
    output_ids: list[int]  # generated tokens only (prompt excluded)
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per step (a + 1)
    stop_reason: str = "length"  # "eos" or "length"

    @property
    def tau(self) -> float:
        steps = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / steps if steps else 0.0


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).reshape(probs.shape[:-1])


def _truncate(tokens: list[int], budget: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """Cut new tokens at the budget or just after the first stop token."""
    for i, t in enumerate(tokens[:budget]):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens[:budget], False


@torch.no_grad()
def greedy_generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Plain autoregressive decoding with the target's cache: one token per forward."""
    stop_ids = set(target.stop_token_ids)
    cache = target.new_cache()
    ids = torch.tensor([prompt_ids], device=target.device)
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = target.forward(ids, cache).logits[0, -1]
        token = int(_sample(logits, temperature, generator))
        out.append(token)
        if token in stop_ids:
            return GenerationResult(out, stop_reason="eos")
        ids = torch.tensor([[token]], device=target.device)
    return GenerationResult(out)


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft: [B - 1] drafted tokens; target_logits: [B, V] at [anchor, d1 .. d(B-1)].

    Returns (a, bonus): a = leading positions with d(k+1) == argmax p(k); bonus = argmax p(a).
    """
    predicted = target_logits.argmax(-1)  # [B]
    matches = (draft == predicted[:-1]).int()
    a = int(matches.cumprod(0).sum())
    return a, int(predicted[a])


def accept_sampled(
    draft: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless speculative sampling for one block.

    draft: [B - 1]; draft_probs: [B - 1, V] the drafter's distribution q at each position;
    target_probs: [B, V] the target's p after each block token. Accept d(k+1) with
    probability min(1, p(d) / q(d)); on the first rejection sample from normalize(max(0, p - q)).
    """
    for k in range(draft.shape[0]):
        d = int(draft[k])
        p, q = target_probs[k], draft_probs[k]
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[d] <= p[d]:  # u < p/q without dividing by a zero q
            continue
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        return k, int(torch.multinomial(residual, 1, generator=generator))
    last = target_probs[draft.shape[0]]
    return draft.shape[0], int(torch.multinomial(last, 1, generator=generator))


class DFlashProposer:
    """Drafts a block with a DFlash drafter, keeping committed context in its KV cache."""

    def __init__(self, drafter: DFlashDrafter, target: TargetModel) -> None:
        self.drafter, self.target = drafter, target
        self.context_layer_ids = drafter.config.target_layer_ids
        self.cache = drafter.new_cache()

    def propose(
        self, tokens: list[int], anchor_pos: int, new_context: torch.Tensor, new_positions: torch.Tensor, block: int
    ) -> torch.Tensor:
        """Logits [block - 1, V] for the positions after the anchor (tokens[-1] at anchor_pos)."""
        device = self.target.device
        mask_id = self.drafter.config.mask_token_id
        block_ids = torch.tensor([[tokens[-1]] + [mask_id] * (block - 1)], device=device)  # [1, B]
        hidden = self.drafter(
            self.target.embed(block_ids), torch.tensor([[anchor_pos]], device=device), new_context, new_positions,
            cache=self.cache,
        )  # fmt: skip
        return self.target.lm_head(hidden[0, 1:])


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: DFlashDrafter | Proposer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate with drafter + target; returns the tokens and each step's committed count.

    `drafter` is a DFlash drafter or any `Proposer`. The first token comes from the
    prefill, as in plain decoding; every later token comes from a speculative step. A step
    commits min(a + 1, tokens still allowed), cut after a stop token, so the acceptance
    lengths add up to len(output_ids) - 1.
    """
    if isinstance(drafter, DFlashDrafter):
        block = block_size or drafter.config.block_size
        proposer: Proposer = DFlashProposer(drafter, target)
    else:
        block, proposer = block_size or 16, drafter
    if block < 2:
        raise ValueError(f"block_size {block} < 2")
    target.set_context_layers(proposer.context_layer_ids)
    stop_ids = set(target.stop_token_ids)
    device = target.device
    cache = target.new_cache()

    prefill = target.forward(torch.tensor([prompt_ids], device=device), cache)
    first = int(_sample(prefill.logits[0, -1], temperature, generator))
    result = GenerationResult([first])
    if first in stop_ids:
        result.stop_reason = "eos"
        return result
    # drafter context not yet in its cache: features [1, C, n * H] at positions [1, C]
    new_context = prefill.context_features
    new_positions = torch.arange(len(prompt_ids), device=device)[None]
    anchor_pos = len(prompt_ids)

    while len(result.output_ids) < max_new_tokens:
        tokens = prompt_ids + result.output_ids
        draft_logits = proposer.propose(tokens, anchor_pos, new_context, new_positions, block)  # [B - 1, V]
        draft = _sample(draft_logits, temperature, generator)  # [B - 1]

        verify = target.forward(torch.tensor([tokens[-1:] + draft.tolist()], device=device), cache)
        if temperature <= 0:
            a, bonus = accept_greedy(draft, verify.logits[0])
        else:
            q = torch.softmax(draft_logits.float() / temperature, -1)
            p = torch.softmax(verify.logits[0].float() / temperature, -1)
            a, bonus = accept_sampled(draft, q, p, generator)

        proposed = draft[:a].tolist() + [bonus]
        committed, stopped = _truncate(proposed, max_new_tokens - len(result.output_ids), stop_ids)
        result.output_ids += committed
        result.acceptance_lengths.append(len(committed))
        if stopped:
            result.stop_reason = "eos"
            break
        # the anchor and the accepted drafts stay in the target cache; the bonus is the next anchor
        target.rollback(cache, a + 1)
        new_context = verify.context_features[:, : a + 1] if verify.context_features is not None else None
        new_positions = anchor_pos + torch.arange(a + 1, device=device)[None]
        anchor_pos += a + 1
    return result
