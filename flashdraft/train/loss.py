"""The training loss: hard cross-entropy on block positions 1..B-1 (the paper's recipe),
weighted per position either by the recipe's fixed decay exp(-(k - 1) / gamma) ("decay") or
by D-PACE (arXiv 2605.18810, "dpace": weights from the drafter's own confidence, aimed at the
expected accepted length), optionally mixed with a KL term to the target's stored top-k
distribution (opt-in; weight explicit).

Normalisation never depends on how a batch is split over ranks or micro-batches: the loop
divides the summed weighted loss by `label_weight_total` of the whole global batch, a number
known from the labels alone before any forward (decay: the sum of the position weights; D-PACE,
whose weights depend on predictions: the number of trained blocks)."""

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


LOSS_WEIGHTINGS = ("decay", "dpace")


def label_weight_total(labels: torch.Tensor, block_size: int, gamma: float | None, weighting: str = "decay") -> float:
    """The normaliser of labels [N, K * B]: decay: the sum of the trained positions' weights;
    dpace: the number of blocks with a trained position (a D-PACE block's weights sum to its
    expected accepted length, so the loss is a mean over blocks)."""
    trained = labels != IGNORE
    if weighting == "dpace":
        return float(trained.view(labels.shape[0], -1, block_size).any(-1).sum())
    w = position_weights(block_size, gamma)[torch.arange(labels.shape[1]) % block_size]  # [K * B]
    return float((w * trained).sum())


@torch.no_grad()
def dpace_weights(label_prob: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights, detached: label_prob q and trained mask [..., B] per block.

    q~_k = (1 - alpha) q_k + alpha, P_k = prod_{i <= k} q~_i, weight_k = sum_{m >= k} P_m (over
    trained m): the expected accepted length's sensitivity to position k. Untrained positions
    are 1 inside the products and left out of the sums; their weight is 0."""
    smooth = torch.where(trained, (1 - alpha) * label_prob + alpha, torch.ones_like(label_prob))
    prefix = torch.cumprod(smooth, dim=-1) * trained  # P_k
    suffix = prefix.flip(-1).cumsum(-1).flip(-1)  # sum over m >= k
    return suffix * trained


@dataclass
class LossParts:
    weighted_sum: torch.Tensor  # sum over trained positions of weight * loss (scalar, has grad)
    weight_total: torch.Tensor  # sum of the weights (scalar, no grad)
    correct: torch.Tensor  # [B] argmax == label count per block position
    count: torch.Tensor  # [B] trained positions per block position
    # DFlash2, per block position [B]: the label among the unary top-K; the selector's teacher-forced pick right
    top_k_hits: torch.Tensor | None = None
    selector_correct: torch.Tensor | None = None


SELECTOR_MISSING_LABEL = ("inject", "skip")  # a label outside the unary top-K: put it in the candidate set, or skip


def selector_loss(
    selector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, predecessors: torch.Tensor,
    missing_label: str = "inject",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """DFlash2's candidate-selector cross-entropy at M trained positions, teacher-forced: the true
    predecessor (the anchor for block position 1) chooses among the unary top-K.

    hidden [M, H], logits [M, V] (unary, as served), labels [M], predecessors [M] (IGNORE: unknown,
    the position is left out). The unary scores are detached: the selector learns what to add to
    them, the backbone objective alone trains the unary head. A label outside the top-K is put in
    place of the K-th candidate ("inject", with its own unary score) or the position is left out
    ("skip"). Returns (per-position CE [M], 0 where left out; used [M]; label in the top-K [M];
    selector's argmax == label [M])."""
    unary = logits.detach()
    unary_top, candidates = unary.topk(selector.top_k, dim=-1)  # [M, K]
    in_top_k = (candidates == labels[:, None]).any(-1)  # [M]
    if missing_label == "inject":
        candidates = candidates.clone()
        candidates[:, -1] = torch.where(in_top_k, candidates[:, -1], labels)
        unary_top = unary.gather(1, candidates)
    used = predecessors != IGNORE
    if missing_label == "skip":
        used = used & in_top_k
    projected = selector.hidden_projection(hidden)  # [M, r]
    scores = unary_top + selector.pair_scores(projected, predecessors.clamp(min=0), candidates).float()  # [M, K]
    target = (candidates == labels[:, None]).float().argmax(-1)  # the label's slot (0 when it is not there: unused)
    per_position = torch.where(used, F.cross_entropy(scores, target, reduction="none"), 0.0)
    correct = used & (scores.argmax(-1) == target) & (candidates.gather(1, target[:, None])[:, 0] == labels)
    return per_position, used, in_top_k, correct


def block_predecessors(block_ids: torch.Tensor, labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, K * B] the true token before each block position: the anchor before position 1, the label of
    position k - 1 before position k >= 2 (IGNORE where that label is untrained: unknown here)."""
    previous = labels.roll(1, dims=1)
    first = torch.arange(labels.shape[1], device=labels.device) % block_size == 1
    return torch.where(first, block_ids.roll(1, dims=1), previous)


def block_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head: torch.nn.Module,
    block_size: int,
    gamma: float | None,
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    kl_weight: float = 0.0,
    weighting: str = "decay",
    dpace_alpha: float = 0.5,
    selector=None,
    block_ids: torch.Tensor | None = None,
    selector_loss_weight: float = 0.0,
    selector_missing_label: str = "inject",
) -> LossParts:
    """hidden: [N, K * B, H] drafter output; labels: [N, K * B] (IGNORE where untrained).

    target_topk: (values, indices) [N, K * B, k] the target's top-k logits for each label
    position (aligned with labels), used only when kl_weight > 0. weighting: "decay" (gamma)
    or "dpace" (dpace_alpha); the D-PACE weights come from the hard CE's label probability.
    selector (DFlash2, with block_ids [N, K * B]): its teacher-forced cross-entropy (`selector_loss`),
    weighted per position as the backbone's and scaled by selector_loss_weight, is added; its
    top-K coverage and accuracy are counted either way.
    """
    block_pos = torch.arange(labels.shape[1], device=labels.device) % block_size  # [K * B]
    trained = labels != IGNORE  # [N, K * B]
    # only trained positions go through the LM head: logits of a big vocabulary are the memory peak
    logits = lm_head(hidden[trained]).float()  # [M, V]
    target = labels[trained]  # [M]
    pos = block_pos.expand_as(labels)[trained]  # [M]
    per_token = F.cross_entropy(logits, target, reduction="none")  # [M]
    if weighting == "dpace":
        label_prob = torch.zeros(labels.shape, device=hidden.device)  # [N, K * B]
        label_prob[trained] = torch.exp(-per_token.detach())
        per_block = (labels.shape[0], -1, block_size)
        w = dpace_weights(label_prob.view(per_block), trained.view(per_block), dpace_alpha).view(labels.shape)[trained]
    else:
        w = position_weights(block_size, gamma).to(hidden.device)[pos]  # [M]
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
    weighted_sum = (w * per_token).sum()
    if selector is None:
        return LossParts(weighted_sum, w.sum().detach(), correct, count)
    predecessors = block_predecessors(block_ids, labels, block_size)[trained]  # [M]
    per_selector, _, in_top_k, picked = selector_loss(selector, hidden[trained], logits, target, predecessors,
                                                      selector_missing_label)  # fmt: skip
    if selector_loss_weight > 0:
        weighted_sum = weighted_sum + selector_loss_weight * (w * per_selector).sum()
    top_k_hits, selector_correct = torch.zeros_like(count), torch.zeros_like(count)
    top_k_hits.index_add_(0, pos, in_top_k.float())
    selector_correct.index_add_(0, pos, picked.float())
    return LossParts(weighted_sum, w.sum().detach(), correct, count, top_k_hits, selector_correct)


def estimated_acceptance(correct: torch.Tensor, count: torch.Tensor) -> tuple[list[float], float]:
    """Per-position accuracy (positions 1..B-1) and 1 + sum_k prod_{j<=k} acc_j."""
    acc = (correct[1:] / count[1:].clamp(min=1)).tolist()
    tau, running = 1.0, 1.0
    for a in acc:
        running *= a
        tau += running
    return acc, tau
