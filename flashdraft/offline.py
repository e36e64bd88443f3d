"""Offline τ of a drafter: the acceptance walk (`flashdraft.acceptance`) over each record's
completion, with context features from the record's cache or one target forward. Needs no
target forward when the features come from a cache; training reports held-out τ with it.

At T > 0 (`evaluate_offline(temperature=...)`) the completions must be the target's own samples at the settings
evaluated (temperature, and the filters the serving rule applies). Then:
- exact (in law): the walk's acceptance lengths. Given the output token c_t, a draft at t is accepted with
  probability rho_t = min(1, q_t(c_t) / p_t(c_t)) (Bayes: P(draft x, accepted) = min(p(x), q(x)), P(output x) =
  p(x)); the walk accepts with that probability, so (output, acceptance lengths) has the law of live decoding's.
  Under a one-hot rule (argmax drafts) rho_t = [d_t == c_t]: the greedy walk's match, no draw at all.
- estimate: `expected_tau`, each step's expected committed length by importance weighting along the completion,
  1 + sum_t prod_{s < t} rho_s x alpha_t with alpha_t = sum_x min(p_t(x), q_t(x)) (one-hot: p_t(d_t)); unbiased
  for the step's expected length given its context, but only the completion's path is weighted, so its error
  shrinks with the number of steps, not per step.
Both need the target's p at every completion position: one target forward per record (a cache's features still
feed the drafter).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashdraft.acceptance import (
    DraftLimit,
    OfflineSampling,
    Proposer,
    ProposerFactory,
    as_proposer,
    default_block_size,
    offline_acceptance_lengths,
    tau_of,
)
from flashdraft.families import drafts_per_block
from flashdraft.model import DFlashDrafter
from flashdraft.records import EvalRecord, FeatureSource
from flashdraft.results import EvalResult, PromptResult
from flashdraft.serving_rules import NO_FILTERS, SamplingFilters, ServingRule, serving_rule, target_probs
from flashdraft.target import TargetModel


def drafter_shape(
    drafter: DFlashDrafter | ProposerFactory | Proposer, block_size: int | None
) -> tuple[int, list[int], int | None]:
    """(block size, target layer ids, context layers) of a DFlash drafter or another Proposer."""
    block_size = block_size or default_block_size(drafter)
    if isinstance(drafter, DFlashDrafter):
        cfg = drafter.config
        return block_size, cfg.target_layer_ids, drafter.fc.weight.shape[1] // cfg.hidden_size
    ids = list(drafter.context_layer_ids)
    return block_size, ids, len(ids) or None


@torch.no_grad()
def evaluate_offline(
    drafter: DFlashDrafter | ProposerFactory | Proposer,
    target: TargetModel,
    records: list[EvalRecord],
    features: FeatureSource | None = None,
    block_size: int | None = None,
    max_blocks: int | None = None,
    limit: DraftLimit | None = None,
    use_selector: bool = True,
    rule: ServingRule | str | None = None,
    temperature: float = 0.0,
    filters: SamplingFilters = NO_FILTERS,
    seed: int = 0,
    context_edges: list[int] | None = None,
) -> EvalResult:
    """Offline τ of `drafter` (a DFlash drafter, the hybrid, or a stateless `Proposer` such as
    the n-gram baseline) on `records`, each walked for at most `max_blocks` steps, verifying the
    drafts `limit` keeps (`use_selector` False: a DFlash2 drafter's unary argmax path), drafted as `rule`'s server
    reads the drafter. temperature > 0: the walk of sampled completions (module docstring), seeded per record.
    `context_edges`: the buckets of `EvalResult.by_context`."""
    b, layer_ids, context_layers = drafter_shape(drafter, block_size)
    features = features or FeatureSource(target)
    rule = serving_rule(rule)
    per_prompt = []
    for index, record in enumerate(records):
        lengths, sampling = walk_record(drafter, target, record, index, features, b, max_blocks, limit, use_selector,
                                        rule, temperature, filters, seed)  # fmt: skip
        per_prompt.append(PromptResult(record.id, lengths, expected_lengths=sampling.expected if sampling else None,
                                       prompt_length=len(record.prompt_ids)))  # fmt: skip
    return EvalResult("offline", b, layer_ids, context_layers, per_prompt, temperature,
                      drafts_per_block=drafts_per_block(drafter, b), context_edges=context_edges)  # fmt: skip


def walk_record(
    drafter: DFlashDrafter | ProposerFactory | Proposer, target: TargetModel, record: EvalRecord, index: int,
    features: FeatureSource, block: int, max_blocks: int | None, limit: DraftLimit | None, use_selector: bool,
    rule: ServingRule, temperature: float, filters: SamplingFilters, seed: int,
    probs_at: Callable[[int, int], torch.Tensor] | None = None,
) -> tuple[list[int], OfflineSampling | None]:  # fmt: skip
    """The offline walk of record `index` (`evaluate_offline`'s arguments): its acceptance lengths and, at
    temperature > 0, what the sampled walk recorded along it (the same draws for the same seed and index).
    `probs_at`: the record's `target_probs_along`, when already computed (one target forward serves many walks)."""
    layer_ids = drafter_shape(drafter, block)[1]
    f = features(record, layer_ids) if layer_ids else None
    proposer = as_proposer(drafter, target, limit, use_selector, rule)
    sampling = None
    if temperature > 0:
        probs_at = probs_at or target_probs_along(target, record, temperature, filters)
        sampling = OfflineSampling(probs_at, temperature, rule, record_generator(seed, index, target),
                                   limit.confidence_threshold if limit is not None else None)  # fmt: skip
    lengths = offline_acceptance_lengths(proposer, record.prompt_ids, record.completion_ids, block, f, max_blocks,
                                         target.device, sampling=sampling)  # fmt: skip
    return lengths, sampling


def target_probs_along(
    target: TargetModel, record: EvalRecord, temperature: float, filters: SamplingFilters
) -> Callable[[int, int], torch.Tensor]:  # fmt: skip
    """The target's filtered p along the record's completion (one forward; rows computed when a walk reads them):
    `probs_at(start, end)` gives [end - start, V], the p of completion[start + 1 .. end]."""
    out = target.forward(torch.tensor([record.input_ids], device=target.device))
    p = len(record.prompt_ids)

    def probs_at(start: int, end: int) -> torch.Tensor:
        return target_probs(out.logits_at(p + start, p + end)[0], temperature, filters)

    return probs_at


def record_generator(seed: int, index: int, target: TargetModel) -> torch.Generator:
    """The generator of record `index`'s draws: its own, so a record's draws do not depend on the others."""
    return torch.Generator(device=target.device).manual_seed(seed * 1_000_003 + index)


@torch.no_grad()
def selector_figures(
    drafter: DFlashDrafter,
    target: TargetModel,
    records: list[EvalRecord],
    walked: EvalResult,
    features: FeatureSource | None = None,
    max_blocks: int | None = None,
) -> dict:
    """What a DFlash2 drafter's candidate selector adds, beside the walk `walked` (its greedy
    evaluation on `records`): τ of the same drafter drafting its unary argmax instead, and how
    often the target's token is among the unary top-K at the positions the walk verified (each
    step's accepted drafts and its first rejected one): the selector can only choose a token in
    its top-K, so coverage bounds what it can fix."""
    b = walked.block_size
    features = features or FeatureSource(target)
    unary = evaluate_offline(drafter, target, records, features, b, max_blocks, use_selector=False)
    top_k, hits, verified = drafter.candidate_selector.top_k, 0, 0
    for record, walk in zip(records, walked.per_prompt, strict=True):
        f = features(record, drafter.config.target_layer_ids)
        steps = walked_steps(walk.acceptance_lengths)
        unary_rows = _rows_at_steps(drafter, target, record, f, steps, b, use_selector=False)
        for (a, n), (rows, _) in zip(steps, unary_rows, strict=True):
            candidates = rows.topk(top_k, dim=-1).indices  # [B - 1, K]
            for j in range(min(n, b - 1)):
                verified += 1
                hits += bool((candidates[j] == record.completion_ids[a + 1 + j]).any())
    return {"top_k": top_k, "tau": walked.tau, "unary_tau": unary.tau, "gain": walked.tau / unary.tau if unary.tau
            else None, "top_k_coverage": hits / verified if verified else None, "verified_positions": verified,
            "unary_per_prompt": [p.acceptance_lengths for p in unary.per_prompt]}  # fmt: skip


def walked_steps(lengths: list[int]) -> list[tuple[int, int]]:
    """(anchor index, tokens committed) of each step of a walk with these acceptance lengths."""
    steps, i = [], 0
    for n in lengths:
        steps.append((i, n))
        i += n
    return steps


def _rows_at_steps(drafter: DFlashDrafter, target: TargetModel, record: EvalRecord, features: torch.Tensor,
                   steps: list[tuple[int, int]], block: int, limit: DraftLimit | None = None,
                   use_selector: bool = True):  # fmt: skip
    """What a fresh proposer drafts at each step's anchor: (its rows [k, V], the greedy walk's confidence [k] or
    None) per step, the anchors drafted in chunks as the offline walk drafts them (`use_selector` as in
    `as_proposer`)."""
    p, completion, b = len(record.prompt_ids), record.completion_ids, block
    proposer = as_proposer(drafter, target, limit, use_selector)
    inner = getattr(proposer, "inner", proposer)  # the DFlash proposer under a limit's wrapper
    per_call, fed, out = inner.anchors_per_call(b), 0, []
    for start in range(0, len(steps), per_call):
        chunk = steps[start : start + per_call]
        end = p + chunk[-1][0]  # context strictly before the chunk's last anchor
        logits = proposer.propose_anchors([completion[a] for a, _ in chunk], [p + a for a, _ in chunk],
                                          features[None, fed:end], torch.arange(fed, end)[None], b)  # fmt: skip
        fed = end
        confidence = inner.last_confidence
        out += [(rows, None if confidence is None else confidence[j]) for j, rows in enumerate(logits)]
    return out


CONFIDENCE_BINS = 10  # equal-width bins of the estimate for the calibration error
CONFIDENCE_SWEEP = (0.3, 0.5, 0.7, 0.9)  # thresholds whose cut eval reports beside the one asked for


@torch.no_grad()
def confidence_figures(
    drafter: DFlashDrafter, target: TargetModel, records: list[EvalRecord], walked: EvalResult,
    features: FeatureSource | None = None, max_blocks: int | None = None, threshold: float | None = None,
    rule: ServingRule | str | None = None, temperature: float = 0.0, filters: SamplingFilters = NO_FILTERS,
    seed: int = 0,
) -> dict:  # fmt: skip
    """A DSpark drafter's confidence head against what happened, beside its evaluation `walked` (without a
    confidence cut; at temperature > 0 only its block size is read: the uncut walk over the target's samples
    `records`, under `rule` with `filters`, is walked here, seeded as `evaluate_offline`): at every draft position
    a step reached (all drafts before it accepted), the head's estimate c, the draft's acceptance probability there
    (greedy: 1 or 0, whether the draft is the target's token; one-hot rule: p(d); sampled walk: sum min(p, q)) and
    whether it was accepted, per block position (mean estimate against mean probability and observed share) and
    over all (expected calibration error against the probability, over CONFIDENCE_BINS bins); then, for each
    threshold of CONFIDENCE_SWEEP and `threshold`, the τ of cutting each block before its first draft with c under
    it (DeepSpec's evaluator's cut; vLLM's adaptive verification budgets by expected accepted tokens instead,
    SGLang's planner is opt-in) and its cost: the drafts verified per step, against the uncut block's."""
    features = features or FeatureSource(target)
    rule = serving_rule(rule)
    k_max = drafts_per_block(drafter, walked.block_size)
    thresholds = sorted({*CONFIDENCE_SWEEP, *([threshold] if threshold else [])})
    if temperature > 0:  # the uncut walk and every cut over each record's one target forward
        walks = _sampled_walks(drafter, target, records, features, walked.block_size, max_blocks,
                               [None, *thresholds], rule, temperature, filters, seed)  # fmt: skip
        reached, verified_full, _ = walks[0]
    else:
        reached, verified_full = _greedy_positions(drafter, target, records, features, walked)
    predicted, probability, observed, count = (torch.zeros(k_max) for _ in range(4))
    for j, c, alpha, accepted in reached:
        predicted[j] += c
        probability[j] += alpha
        observed[j] += accepted
        count[j] += 1
    ece = 0.0
    for b in range(CONFIDENCE_BINS):
        inside = [(c, alpha) for _, c, alpha, _ in reached if b / CONFIDENCE_BINS <= c < (b + 1) / CONFIDENCE_BINS
                  or (b == CONFIDENCE_BINS - 1 and c == 1.0)]  # fmt: skip
        if inside:
            ece += len(inside) / len(reached) * abs(sum(c for c, _ in inside) / len(inside)
                                                    - sum(a for _, a in inside) / len(inside))  # fmt: skip
    cuts = []
    for n, t in enumerate(thresholds, 1):
        limit = DraftLimit(confidence_threshold=t)
        if temperature > 0:
            _, verified, lengths = walks[n]
            tau, steps = tau_of(lengths), len(lengths)
        else:
            cut = evaluate_offline(drafter, target, records, features, walked.block_size, max_blocks, limit)
            verified = _greedy_verified(drafter, target, records, features, cut, limit)
            tau, steps = cut.tau, cut.num_steps
        cuts.append({"threshold": t, "tau": tau, "steps": steps, "drafts_verified_per_step": verified / max(steps, 1)})
    n = count.clamp(min=1)
    # the uncut walk: `walked` greedy; at T > 0 the one whose positions these are (the evaluation's own draws)
    tau, steps = (tau_of(walks[0][2]), len(walks[0][2])) if temperature > 0 else (walked.tau, walked.num_steps)
    return {"positions_reached": count.int().tolist(), "predicted": (predicted / n).tolist(),
            "acceptance_probability": (probability / n).tolist(), "observed": (observed / n).tolist(),
            "expected_calibration_error": ece if reached else None,
            "uncut": {"tau": tau, "steps": steps, "drafts_verified_per_step": verified_full / max(steps, 1)},
            "cuts": cuts}  # fmt: skip


def _greedy_positions(
    drafter: DFlashDrafter, target: TargetModel, records: list[EvalRecord], features: FeatureSource,
    walked: EvalResult,
) -> tuple[list[tuple[int, float, float, bool]], int]:  # fmt: skip
    """(position, confidence, acceptance probability, accepted) of every draft position the greedy walk `walked`
    reached (the probability is 1 or 0: the draft is the target's token or not), and the drafts it verified."""
    reached, verified = [], 0
    for record, walk in zip(records, walked.per_prompt, strict=True):
        f = features(record, drafter.config.target_layer_ids)
        steps = walked_steps(walk.acceptance_lengths)
        rows_at = _rows_at_steps(drafter, target, record, f, steps, walked.block_size)
        for (i, _), (rows, confidence) in zip(steps, rows_at, strict=True):
            drafts, left = rows.argmax(-1).tolist(), len(record.completion_ids) - 1 - i
            verified += min(len(drafts), left)
            for j in range(min(len(drafts), left)):
                accepted = drafts[j] == record.completion_ids[i + 1 + j]
                reached.append((j, float(confidence[j]), float(accepted), accepted))
                if not accepted:
                    break
    return reached, verified


def _greedy_verified(drafter: DFlashDrafter, target: TargetModel, records: list[EvalRecord], features: FeatureSource,
                     walked: EvalResult, limit: DraftLimit) -> int:  # fmt: skip
    """The drafts the greedy walk `walked` under a confidence cut verified, over all its steps."""
    verified = 0
    for record, walk in zip(records, walked.per_prompt, strict=True):
        f = features(record, drafter.config.target_layer_ids)
        steps = walked_steps(walk.acceptance_lengths)
        rows_at = _rows_at_steps(drafter, target, record, f, steps, walked.block_size, limit)
        for (i, _), (rows, _) in zip(steps, rows_at, strict=True):
            verified += min(rows.shape[0], len(record.completion_ids) - 1 - i)
    return verified


def _sampled_walks(
    drafter: DFlashDrafter, target: TargetModel, records: list[EvalRecord], features: FeatureSource, block: int,
    max_blocks: int | None, thresholds: list[float | None], rule: ServingRule, temperature: float,
    filters: SamplingFilters, seed: int,
) -> list[tuple[list[tuple[int, float, float, bool]], int, list[int]]]:  # fmt: skip
    """At temperature > 0, per confidence threshold (None: uncut): the draft positions the walk of each record
    reached (drawn with the seed and index `evaluate_offline` draws with, so each walk is that evaluation's), the
    drafts it verified, and its acceptance lengths; one target forward per record serves every threshold."""
    out: list[tuple[list, int, list[int]]] = [([], 0, []) for _ in thresholds]
    for index, record in enumerate(records):
        probs_at = target_probs_along(target, record, temperature, filters)
        for n, t in enumerate(thresholds):
            limit = DraftLimit(confidence_threshold=t) if t is not None else None
            walk, sampling = walk_record(drafter, target, record, index, features, block, max_blocks, limit, True,
                                         rule, temperature, filters, seed, probs_at)  # fmt: skip
            reached, verified, lengths = out[n]
            out[n] = (reached + sampling.reached, verified + sum(sampling.verified), lengths + walk)
    return out
