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

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flashdraft.train.blocks import IGNORE

# the decay the published drafters use per block size (reference doc, section 4)
RECIPE_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
DSPARK_DECAY_GAMMA = 4.0  # the DSpark paper's exp(-k / 4) over its anchor-first block, whatever its size


def recipe_decay_gamma(block_size: int, family: str = "dflash") -> float:
    """The recipe's gamma for this block size (DSpark: its paper's 4); 0 (no decay) where the recipe gives none."""
    return DSPARK_DECAY_GAMMA if family == "dspark" else RECIPE_DECAY_GAMMA.get(block_size, 0.0)


def position_weights(block_size: int, gamma: float | None, first_draft: int = 1) -> torch.Tensor:
    """[B] weight per block position: 0 before the layout's first draft (the anchor, fill-in), exp(-j / gamma)
    at its j-th draft (1 without decay: gamma None or 0)."""
    j = torch.arange(block_size, dtype=torch.float32) - first_draft
    w = torch.ones(block_size) if not gamma else torch.exp(-j / gamma)
    w[:first_draft] = 0.0
    return w


LOSS_WEIGHTINGS = ("decay", "dpace")


def label_weight_total(
    labels: torch.Tensor, block_size: int, gamma: float | None, weighting: str = "decay", first_draft: int = 1
) -> float:
    """The normaliser of labels [N, K * B]: decay: the sum of the trained positions' weights;
    dpace: the number of blocks with a trained position (a D-PACE block's weights sum to its
    expected accepted length, so the loss is a mean over blocks)."""
    trained = labels != IGNORE
    if weighting == "dpace":
        return float(trained.view(labels.shape[0], -1, block_size).any(-1).sum())
    w = position_weights(block_size, gamma, first_draft)[torch.arange(labels.shape[1]) % block_size]  # [K * B]
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
class LossFigures:
    """What the loss counts beside itself, per block position [B]; summed over micro-batches, steps and ranks in one
    place (`+`), the family's own figures only where the family has them."""

    correct: torch.Tensor  # argmax == label count
    count: torch.Tensor  # trained positions
    # DFlash2: the label among the unary top-K; the selector's teacher-forced pick right
    top_k_hits: torch.Tensor | None = None
    selector_correct: torch.Tensor | None = None
    # DSpark: the probability of acceptance 1 - |p_draft - p_target|_1 / 2 (needs the target's distribution) and the
    # confidence head's estimate of it, summed over trained positions
    accept_rate: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    def __add__(self, other: LossFigures) -> LossFigures:
        def plus(a, b):
            return b if a is None else a if b is None else a + b

        return LossFigures(*(plus(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))

    def map(self, fn) -> LossFigures:
        """Each figure through `fn` (e.g. detached to the CPU, or summed over ranks)."""
        return LossFigures(*(None if (v := getattr(self, f.name)) is None else fn(v) for f in fields(self)))


@dataclass
class LossParts:
    weighted_sum: torch.Tensor  # sum over trained positions of weight * loss (scalar, has grad)
    weight_total: torch.Tensor  # sum of the weights (scalar, no grad)
    figures: LossFigures


@dataclass(frozen=True)
class DSparkLoss:
    """DSpark's loss terms (the paper, DeepSpec `compute_dspark_loss`): per position, ce x cross-entropy + tv x the
    L1 distance |p_draft - p_target|_1 (twice the total variation; DeepSpec's "l1_loss") + confidence x the binary
    cross-entropy of the confidence head against the acceptance probability 1 - |p_draft - p_target|_1 / 2
    (detached), all with the position weights of the run. p_draft carries the Markov bias, teacher-forced."""

    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0

    @property
    def needs_target(self) -> bool:
        return self.tv > 0 or self.confidence > 0


def target_distribution_terms(logits: torch.Tensor, target_topk: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """|p_draft - p_target|_1 per position [M] from the drafter's logits [M, V] and the target's top-k (values,
    indices) [M, k], its distribution renormalised over them (zero elsewhere, so the draft's mass outside them
    counts in full)."""
    values, indices = target_topk
    p_target = torch.softmax(values.float(), -1)  # [M, k]
    p_draft = torch.softmax(logits.float(), -1)  # [M, V]
    on_top = p_draft.gather(1, indices)  # [M, k]
    return (on_top - p_target).abs().sum(-1) + (1 - on_top.sum(-1)).clamp(min=0)


SELECTOR_MISSING_LABEL = ("inject", "skip")  # a label outside the unary top-K: put it in the candidate set, or skip


def selector_candidates(
    unary: torch.Tensor, labels: torch.Tensor, top_k: int, missing_label: str = "inject"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selector's candidates at M positions from the unary logits [M, V] (detached): (their unary scores [M, K],
    their ids [M, K], the label among the unary top-K [M]); a label outside the top-K takes the K-th slot with its
    own unary score ("inject") or is left as it is ("skip")."""
    unary_top, candidates = unary.topk(top_k, dim=-1)  # [M, K]
    in_top_k = (candidates == labels[:, None]).any(-1)  # [M]
    if missing_label == "inject":
        candidates = candidates.clone()
        candidates[:, -1] = torch.where(in_top_k, candidates[:, -1], labels)
        unary_top = unary.gather(1, candidates)
    return unary_top, candidates, in_top_k


def selector_loss(
    selector,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    predecessors: torch.Tensor,
    missing_label: str = "inject",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DFlash2's candidate-selector cross-entropy at M trained positions, teacher-forced: the true
    predecessor (the anchor for block position 1) chooses among the unary top-K.

    hidden [M, H], logits [M, V] (unary, as served), labels [M], predecessors [M] (IGNORE: unknown,
    the position is left out). The unary scores are detached: the selector learns what to add to
    them, the backbone objective alone trains the unary head. A label outside the top-K is put in
    place of the K-th candidate ("inject", with its own unary score) or the position is left out
    ("skip"). Returns (per-position CE [M], 0 where left out; used [M]; label in the top-K [M];
    selector's argmax == label [M])."""
    chosen = selector_candidates(logits.detach(), labels, selector.top_k, missing_label)
    return selector_loss_over(selector, hidden, chosen, labels, predecessors, missing_label)


def selector_loss_over(
    selector,
    hidden: torch.Tensor,
    chosen: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    labels: torch.Tensor,
    predecessors: torch.Tensor,
    missing_label: str = "inject",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`selector_loss` from the candidates `selector_candidates` chose (the chunked loss keeps them, not the
    logits)."""
    unary_top, candidates, in_top_k = chosen
    used = predecessors != IGNORE
    if missing_label == "skip":
        used = used & in_top_k
    projected = selector.hidden_projection(hidden)  # [M, r]
    scores = unary_top + selector.pair_scores(projected, predecessors.clamp(min=0), candidates).float()  # [M, K]
    target = (candidates == labels[:, None]).float().argmax(-1)  # the label's slot (0 when it is not there: unused)
    per_position = torch.where(used, F.cross_entropy(scores, target, reduction="none"), 0.0)
    correct = used & (scores.argmax(-1) == target) & (candidates.gather(1, target[:, None])[:, 0] == labels)
    return per_position, used, in_top_k, correct


def block_predecessors(
    block_ids: torch.Tensor, labels: torch.Tensor, block_size: int, first_draft: int = 1
) -> torch.Tensor:
    """[N, K * B] the true token before each block position's label: the anchor before the first draft (position
    1 fill-in, 0 anchor-first), the label of position k - 1 after it (IGNORE where that label is untrained:
    unknown here)."""
    previous = labels.roll(1, dims=1)
    first = torch.arange(labels.shape[1], device=labels.device) % block_size == first_draft
    anchors = block_ids.view(block_ids.shape[0], -1, block_size)[:, :, :1].expand(-1, -1, block_size)
    return torch.where(first, anchors.reshape(block_ids.shape), previous)


@dataclass(frozen=True)
class LossSpec:
    """How the loss weighs each position and which terms it adds, built once for a run (`train.step.loss_spec`)."""

    block_size: int
    gamma: float | None = None  # the decay's (None or 0: no decay)
    weighting: str = "decay"  # "decay" (gamma) or "dpace" (dpace_alpha), see LOSS_WEIGHTINGS
    dpace_alpha: float = 0.5
    kl_weight: float = 0.0  # > 0: mixed with KL to the target's stored top-k
    first_draft: int = 1  # the layout's first drafting position (0: anchor-first)
    # DFlash2: the selector's cross-entropy, weighted as the backbone's and scaled by this (its figures count anyway)
    selector_loss_weight: float = 0.0
    selector_missing_label: str = "inject"
    dspark: DSparkLoss | None = None  # DSpark: its paper's terms in place of the hard CE


@dataclass(frozen=True)
class DraftHeads:
    """What turns the drafter's output into its loss: the LM head (the target's, as served, or the drafter's own
    reduced one), and the family's heads where it has them."""

    lm_head: Callable[[torch.Tensor], torch.Tensor]  # [M, H] -> [M, V]
    selector: torch.nn.Module | None = None  # DFlash2's candidate selector
    markov_head: torch.nn.Module | None = None  # DSpark's
    confidence_head: torch.nn.Module | None = None  # DSpark's, optional

    @classmethod
    def of(cls, drafter, target_lm_head: torch.nn.Module) -> DraftHeads:
        return cls(
            partial(drafter.logits, target_lm_head=target_lm_head),
            drafter.candidate_selector,
            drafter.markov_head,
            drafter.confidence_head,
        )


class LabelledBlocks(Protocol):
    """The blocks a loss is computed on (a training `Batch`, or `BlockLabels`)."""

    labels: torch.Tensor  # [N, K * B]; IGNORE where untrained
    block_ids: torch.Tensor | None  # [N, K * B]: the anchor, then mask tokens (DFlash2, DSpark read it)
    target_topk: tuple[torch.Tensor, torch.Tensor] | None  # ([N, K * B, k], ...): the target's top-k per label


@dataclass
class BlockLabels:
    labels: torch.Tensor
    block_ids: torch.Tensor | None = None
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None


# Rows of full-vocabulary logits alive at once: the LM head, the cross-entropy and every term that reads the whole
# distribution run a chunk of trained positions at a time, and backward recomputes each chunk's logits
# (`torch.utils.checkpoint`), so memory holds [LOGIT_CHUNK_ROWS, V] fp32 logits in place of [M, V] (about 12-14 GB of
# a 45 GB Qwen3-8B-shaped step). torch has no fused linear cross-entropy; Liger-Kernel's and cut-cross-entropy's are
# Triton kernels for CUDA only and would leave the CPU path (and every family term beside the CE) to this one anyway.
LOGIT_CHUNK_ROWS = 1024


@dataclass
class TrainedPositions:
    """The M trained positions of a batch, flattened, and the per-position terms of their logits (the logits
    themselves are never kept whole: `logit_terms`)."""

    hidden: torch.Tensor  # [M, H] the drafter's output
    labels: torch.Tensor  # [M]
    block_position: torch.Tensor  # [M]
    predecessors: torch.Tensor | None  # [M] the true token before each label (DFlash2, DSpark; IGNORE: unknown)
    target_topk: tuple[torch.Tensor, torch.Tensor] | None  # ([M, k], [M, k]) where a term reads them


@dataclass
class LogitTerms:
    """What the loss reads from the logits (DSpark: with the Markov bias of the true previous token), per trained
    position [M]; None where the run has no such term."""

    ce: torch.Tensor  # the hard cross-entropy (has grad)
    correct: torch.Tensor  # argmax == label
    l1: torch.Tensor | None = None  # DSpark: |p_draft - p_target|_1 (has grad)
    kl: torch.Tensor | None = None  # KL(target || draft) over the stored top-k (has grad)
    selector: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # DFlash2: `selector_candidates`


def chunk_terms(heads: DraftHeads, spec: LossSpec, hidden, labels, predecessors, topk_values, topk_indices):
    """The logit terms of one chunk of rows (hidden [m, H]), as a tuple of tensors (what checkpoint recomputes)."""
    logits = heads.lm_head(hidden).float()  # [m, V]
    if spec.dspark is not None:  # teacher-forced: the Markov bias of the true token before each label, never a later
        logits = logits + heads.markov_head.bias(predecessors).float()
    topk = None if topk_values is None else (topk_values, topk_indices)
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = logits.argmax(-1) == labels
    l1 = target_distribution_terms(logits, topk) if spec.dspark is not None and topk is not None else None
    kl = _kl_to_target(logits, topk) if spec.kl_weight > 0 else None
    chosen = ()
    if heads.selector is not None:
        chosen = selector_candidates(logits.detach(), labels, heads.selector.top_k, spec.selector_missing_label)
    return (ce, correct, l1, kl, *chosen)


def _full_chunk(args: list, chunk_rows: int) -> list:
    """A chunk's arguments padded with zero rows (label 0: any id) to `chunk_rows` rows: one shape for a compiled
    chunk; the padding's terms are dropped after."""
    missing = chunk_rows - args[0].shape[0]
    if not missing:
        return args
    return [None if t is None else torch.cat([t, t.new_zeros(missing, *t.shape[1:])]) for t in args]


def logit_terms(
    at: TrainedPositions, heads: DraftHeads, spec: LossSpec, chunk_rows: int = 0, chunk_fn=None
) -> LogitTerms:
    """The logit terms of every trained position, `chunk_rows` rows (0: LOGIT_CHUNK_ROWS) at a time; with grad, each
    chunk's logits are recomputed in backward rather than kept. Equal to the whole-batch terms (per row, nothing
    crosses rows). `chunk_fn(*args)`: a compiled `chunk_terms` of (heads, spec), handed full chunks only."""
    chunk_rows = chunk_rows or LOGIT_CHUNK_ROWS
    keep = torch.is_grad_enabled() and at.hidden.requires_grad
    values, indices = at.target_topk if at.target_topk is not None else (None, None)
    terms = chunk_fn or partial(chunk_terms, heads, spec)
    parts = []
    for lo in range(0, max(1, at.hidden.shape[0]), chunk_rows):  # no trained position: the terms of an empty chunk
        rows = slice(lo, lo + chunk_rows)
        args = [at.hidden[rows], at.labels[rows]]
        args += [None if t is None else t[rows] for t in (at.predecessors, values, indices)]
        real = args[0].shape[0]
        if chunk_fn is not None:
            args = _full_chunk(args, chunk_rows)
        part = checkpoint(terms, *args, use_reentrant=False) if keep else terms(*args)
        parts.append([None if t is None else t[:real] for t in part])
    joined = [None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True)]
    return LogitTerms(*joined[:4], selector=tuple(joined[4:]) or None)


def block_loss(
    hidden: torch.Tensor,
    blocks: LabelledBlocks,
    heads: DraftHeads,
    spec: LossSpec,
    chunk_rows: int = 0,
    chunk_fn=None,
) -> LossParts:
    """The loss of the drafter's output hidden [N, K * B, H] on `blocks`: the hard cross-entropy of each trained
    position weighted as `spec` says (the D-PACE weights from its label probability), with the family's terms:
    DSpark's in place of it (`_dspark_terms`), KL to the target's top-k mixed in (`kl_weight`), DFlash2's selector
    added (`_selector_terms`). The logits are made `chunk_rows` trained positions at a time (`logit_terms`; by
    `chunk_fn`, the compiled chunk, where given)."""
    labels = blocks.labels
    trained = labels != IGNORE  # [N, K * B]
    pos = (torch.arange(labels.shape[1], device=labels.device) % spec.block_size).expand_as(labels)[trained]  # [M]
    # only trained positions go through the LM head: logits of a big vocabulary are the memory peak
    at = TrainedPositions(hidden[trained], labels[trained], pos, None, None)
    if blocks.target_topk is not None and (spec.dspark is not None or spec.kl_weight > 0):
        at.target_topk = (blocks.target_topk[0][trained], blocks.target_topk[1][trained])
    if spec.dspark is not None or heads.selector is not None:
        at.predecessors = block_predecessors(blocks.block_ids, labels, spec.block_size, spec.first_draft)[trained]
    if spec.kl_weight > 0 and at.target_topk is None:
        raise ValueError("kl_weight > 0 needs the target's top-k logits (cache made with --with-target-logits)")
    terms = logit_terms(at, heads, spec, chunk_rows, chunk_fn)
    per_token = terms.ce  # [M]
    w = _label_weights(per_token, labels, trained, pos, spec)
    correct = torch.zeros(spec.block_size, device=hidden.device).index_add_(0, pos, terms.correct.float())
    count = torch.zeros(spec.block_size, device=hidden.device).index_add_(0, pos, torch.ones_like(w))
    figures = LossFigures(correct, count)
    if spec.dspark is not None:
        per_token = _dspark_terms(per_token, terms.l1, at, heads, spec, figures)
    if spec.kl_weight > 0:
        per_token = (1 - spec.kl_weight) * per_token + spec.kl_weight * terms.kl
    weighted_sum = (w * per_token).sum()
    if heads.selector is not None:
        selector_term = _selector_terms(at, terms.selector, w, heads, spec, figures)
        if selector_term is not None:
            weighted_sum = weighted_sum + selector_term
    return LossParts(weighted_sum, w.sum().detach(), figures)


def _selector_terms(
    at: TrainedPositions, chosen: tuple, w: torch.Tensor, heads: DraftHeads, spec: LossSpec, figures: LossFigures
) -> torch.Tensor | None:
    """DFlash2's selector loss weighted as the backbone's (`w` [M]; None at weight 0), its top-K coverage and
    accuracy counted into `figures` either way."""
    per_selector, _, in_top_k, picked = selector_loss_over(
        heads.selector, at.hidden, chosen, at.labels, at.predecessors, spec.selector_missing_label
    )
    pos = at.block_position
    figures.top_k_hits = torch.zeros_like(figures.count).index_add_(0, pos, in_top_k.float())
    figures.selector_correct = torch.zeros_like(figures.count).index_add_(0, pos, picked.float())
    if spec.selector_loss_weight > 0:
        return spec.selector_loss_weight * (w * per_selector).sum()
    return None


def _label_weights(
    per_token: torch.Tensor, labels: torch.Tensor, trained: torch.Tensor, pos: torch.Tensor, spec: LossSpec
) -> torch.Tensor:
    """Each trained position's weight [M]: D-PACE's from the hard CE's label probability (per_token [M]), or the
    decay by block position (pos [M])."""
    if spec.weighting == "dpace":
        label_prob = torch.zeros(labels.shape, device=per_token.device)  # [N, K * B]
        label_prob[trained] = torch.exp(-per_token.detach())
        per_block = (labels.shape[0], -1, spec.block_size)
        weights = dpace_weights(label_prob.view(per_block), trained.view(per_block), spec.dpace_alpha)
        return weights.view(labels.shape)[trained]
    return position_weights(spec.block_size, spec.gamma, spec.first_draft).to(per_token.device)[pos]  # [M]


def _dspark_terms(
    per_token: torch.Tensor,
    l1: torch.Tensor | None,
    at: TrainedPositions,
    heads: DraftHeads,
    spec: LossSpec,
    figures: LossFigures,
) -> torch.Tensor:
    """DSpark's loss per trained position [M] from the hard CE per_token [M]: its CE share, the |p_draft -
    p_target|_1 term where the target's top-k is known, the confidence head's BCE to the acceptance probability;
    the acceptance probabilities and confidence estimates summed per block position into `figures` (where
    computed). l1 [M]: |p_draft - p_target|_1 where the target's top-k is known (`logit_terms`)."""
    dspark = spec.dspark
    per_token = dspark.ce * per_token
    if l1 is None and dspark.needs_target:
        raise ValueError(
            "DSpark's distribution terms need the target's top-k logits (a cache made with "
            "--with-target-logits K, or online training)"
        )
    if l1 is not None:
        per_token = per_token + dspark.tv * l1
        accept = (1 - l1 / 2).clamp(0, 1)  # [M]: the probability a draft sampled from p_draft is accepted
        figures.accept_rate = torch.zeros_like(figures.count).index_add_(0, at.block_position, accept.detach())
    if heads.confidence_head is not None and l1 is not None:
        embedding = heads.markov_head.embed(at.predecessors) if heads.confidence_head.with_markov else None
        confidence_logit = heads.confidence_head(at.hidden, embedding)  # [M]
        bce = F.binary_cross_entropy_with_logits(confidence_logit, accept.detach(), reduction="none")
        per_token = per_token + dspark.confidence * bce
        figures.confidence = torch.zeros_like(figures.count)
        figures.confidence.index_add_(0, at.block_position, torch.sigmoid(confidence_logit).detach())
    return per_token


def _kl_to_target(logits: torch.Tensor, topk: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """KL(target || draft) per trained position [M], the target's distribution renormalised over its stored top-k."""
    if topk is None:
        raise ValueError("kl_weight > 0 needs the target's top-k logits (cache made with --with-target-logits)")
    values, indices = topk[0].float(), topk[1]
    teacher = torch.softmax(values, -1)  # [M, k], renormalised over the stored top-k
    student = torch.log_softmax(logits, -1).gather(1, indices)  # [M, k]
    return (teacher * (teacher.clamp_min(1e-12).log() - student)).sum(-1)


def estimated_acceptance(correct: torch.Tensor, count: torch.Tensor, first_draft: int = 1) -> tuple[list[float], float]:
    """Per-position accuracy (the drafting positions: 1..B-1 fill-in, 0..B-1 anchor-first) and
    1 + sum_k prod_{j<=k} acc_j."""
    acc = (correct[first_draft:] / count[first_draft:].clamp(min=1)).tolist()
    tau, running = 1.0, 1.0
    for a in acc:
        running *= a
        tau += running
    return acc, tau
