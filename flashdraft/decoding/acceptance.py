"""Acceptance: what a speculative step commits, for live decoding and for the offline walk.

One rule decides every step. A proposer (`decoding.proposers`) drafts k tokens after the anchor (k is its choice:
B - 1 for a full DFlash block, B for a DSpark one; fewer when it verifies only the first drafts); the target
scores [anchor, d1 .. dk]; the leading drafts it agrees with are accepted (greedy: equal to
its argmax; sampled: the lossless accept/resample rule, `decoding.serving_rules.verify`), and its next token is
the bonus. `flashdraft.decoding.generate` applies the rule to the target's logits while decoding; the offline
walk (`evaluation.offline`) applies the same rule to a completion the target already wrote, where its argmax is
the next completion token. So with greedy completions offline and online acceptance
lengths are the same lists, step for step, for any proposer that drafts the same tokens
from the same inputs.

τ = committed tokens / steps.
"""

from __future__ import annotations

import torch

# -- the rule -----------------------------------------------------------------------------


def accepted_prefix(draft: torch.Tensor, target_tokens: torch.Tensor) -> int:
    """How many leading drafts [k] equal the target's tokens at the same places [>= k]."""
    k = min(draft.shape[0], target_tokens.shape[0])
    return int((draft[:k] == target_tokens[:k]).int().cumprod(0).sum())


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft: [k] drafted tokens; target_logits: [k + 1, V] at [anchor, d1 .. dk].

    Returns (a, bonus): a = leading positions with d(j+1) == argmax p(j); bonus = argmax p(a).
    """
    predicted = target_logits.argmax(-1)  # [k + 1]
    a = accepted_prefix(draft, predicted[:-1])
    return a, int(predicted[a])


def greedy_verdict(draft: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """accept_greedy without reading the device: draft [k], target_logits [k + 1, V] at [anchor, d1 .. dk] ->
    [k + 2] on the device: a, then the target's argmax after each block token. The step commits the first a + 1 of
    those (the accepted drafts equal them; the bonus follows), so one read of this tensor is all a greedy step
    needs on the host (`flashdraft.decoding.host_transfers`)."""
    predicted = target_logits.argmax(-1)  # [k + 1]
    a = (draft == predicted[:-1]).int().cumprod(0).sum()  # [] on the device
    return torch.cat([a[None].to(predicted.dtype), predicted])


def sample_drafts(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts [k] from logits [k, V] and their distribution q [k, V]: the argmax (q None) at temperature 0,
    else one draw per position from softmax(logits / T), independently (a proposer's own `draw` may differ)."""
    if temperature <= 0 or logits.shape[0] == 0:  # no drafts: nothing to draw
        return logits.argmax(-1), None
    q = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(q, 1, generator=generator)[:, 0], q


def committed_length(draft: torch.Tensor, completion: torch.Tensor, i: int) -> int:
    """What the step at anchor index i commits when the target's output is `completion` [M]:
    the drafts [k] agreeing with completion[i + 1 ..] plus the bonus token, no more than the
    M - 1 - i tokens left (decoding stops at the same length)."""
    left = completion.shape[0] - 1 - i
    a = accepted_prefix(draft[:left], completion[i + 1 :])
    return min(a + 1, left)


def tau_of(acceptance_lengths: list[int]) -> float:
    """Mean tokens committed per step (0 without steps)."""
    return sum(acceptance_lengths) / len(acceptance_lengths) if acceptance_lengths else 0.0
