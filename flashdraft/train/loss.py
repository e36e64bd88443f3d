"""The training loss: hard cross-entropy on block positions 1..B-1 (the paper's recipe),
optionally weighted by exp(-(k - 1) / gamma) and optionally mixed with a KL term to the
target's stored top-k distribution (opt-in; weight explicit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashdraft.train.blocks import IGNORE

# the decay the published drafters use per block size (reference doc, section 4)
RECIPE_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def recipe_decay_gamma(block_size: int) -> float:
    """The recipe's gamma for this block size; 0 (no decay) where the recipe gives none."""
    return RECIPE_DECAY_GAMMA.get(block_size, 0.0)


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """[B] weight per block position: 0 at the anchor, exp(-(k - 1) / gamma) after (1 without decay:
    gamma None or 0)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.ones(block_size) if not gamma else torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def label_weight_total(labels: torch.Tensor, block_size: int, gamma: float | None) -> float:
    """Sum of the loss weights of the trained positions of labels [N, K * B]."""
    w = position_weights(block_size, gamma)[torch.arange(labels.shape[1]) % block_size]  # [K * B]
    return float((w * (labels != IGNORE)).sum())


@dataclass
class LossParts:
    weighted_sum: torch.Tensor  # sum over trained positions of weight * loss (scalar, has grad)
    weight_total: torch.Tensor  # sum of the weights (scalar, no grad)
    correct: torch.Tensor  # [B] argmax == label count per block position
    count: torch.Tensor  # [B] trained positions per block position


def block_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head: torch.nn.Module,
    block_size: int,
    gamma: float | None,
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    kl_weight: float = 0.0,
) -> LossParts:
    """hidden: [N, K * B, H] drafter output; labels: [N, K * B] (IGNORE where untrained).

    target_topk: (values, indices) [N, K * B, k] the target's top-k logits for each label
    position (aligned with labels), used only when kl_weight > 0.
    """
    block_pos = torch.arange(labels.shape[1], device=labels.device) % block_size  # [K * B]
    trained = labels != IGNORE  # [N, K * B]
    # only trained positions go through the LM head: logits of a big vocabulary are the memory peak
    logits = lm_head(hidden[trained]).float()  # [M, V]
    target = labels[trained]  # [M]
    pos = block_pos.expand_as(labels)[trained]  # [M]
    w = position_weights(block_size, gamma).to(hidden.device)[pos]  # [M]
    per_token = F.cross_entropy(logits, target, reduction="none")
    if kl_weight > 0:
        if target_topk is None:
            raise ValueError("kl_weight > 0 needs the target's top-k logits (cache made with --with-target-logits)")
        values, indices = target_topk[0][trained].float(), target_topk[1][trained]
        teacher = torch.softmax(values, -1)  # [M, k], renormalised over the stored top-k
        student = torch.log_softmax(logits, -1).gather(1, indices)  # [M, k]
        kl = (teacher * (teacher.clamp_min(1e-12).log() - student)).sum(-1)
        per_token = (1 - kl_weight) * per_token + kl_weight * kl
    correct = torch.zeros(block_size, device=hidden.device)
    count = torch.zeros(block_size, device=hidden.device)
    correct.index_add_(0, pos, (logits.argmax(-1) == target).float())
    count.index_add_(0, pos, torch.ones_like(w))
    return LossParts((w * per_token).sum(), w.sum().detach(), correct, count)


def estimated_acceptance(correct: torch.Tensor, count: torch.Tensor) -> tuple[list[float], float]:
    """Per-position accuracy (positions 1..B-1) and 1 + sum_k prod_{j<=k} acc_j."""
    acc = (correct[1:] / count[1:].clamp(min=1)).tolist()
    tau, running = 1.0, 1.0
    for a in acc:
        running *= a
        tau += running
    return acc, tau
