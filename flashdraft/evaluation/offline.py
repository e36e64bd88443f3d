"""Offline τ of a drafter: the acceptance walk over each record's completion, with context features from the
record's cache or one target forward. Needs no target forward when the features come from a cache; training reports
held-out τ with it.

The walk, for a prompt P (P tokens) and the target's completion c[0..M-1]: the anchor index i starts at 0 (c[0]
comes from the prefill); the proposer drafts from prompt + c[..i] and the context features of positions < P + i, fed
as decoding feeds them (only those committed since its last call); a = the leading drafts equal to c[i + 1 ..]
(`decoding.acceptance`, the rule live decoding applies); the step commits n = min(a + 1, M - 1 - i) tokens and
i += n. A proposer that can draft many anchors in one call (the DFlash drafter: each block sees only context before
its own anchor) is asked for all anchors of a stretch at once (`draft_anchors`); the walk uses the drafts it lands on.

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
from dataclasses import dataclass, field, replace

import torch

from flashdraft.decoding.acceptance import committed_length, tau_of
from flashdraft.decoding.generate import SpeculativeConfig
from flashdraft.decoding.proposers import (
    BatchProposer,
    DraftLimit,
    Proposer,
    ProposerFactory,
    as_proposer,
    confident_prefix,
    default_block_size,
)
from flashdraft.decoding.serving_rules import GREEDY, SamplingParams, ServingRule, serving_rule
from flashdraft.decoding.target_samples import target_probs_along
from flashdraft.drafter.families import drafts_per_block, family_of
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.records import EvalRecord, FeatureSource
from flashdraft.evaluation.results import EvalResult, PromptResult
from flashdraft.target.model import TargetModel

# -- the walk ----------------------------------------------------------------------------------


@dataclass
class OfflineSampling:
    """What the offline walk needs at T > 0 (module `evaluation.offline` states what is exact): the target's filtered
    p along the completion and the rule drafts are drawn under. `probs_at(start, end)`: rows [end - start, V], row r
    the target's p of completion[start + r + 1] after completion[.. start + r]."""

    probs_at: Callable[[int, int], torch.Tensor]
    temperature: float
    rule: ServingRule
    generator: torch.Generator | None = None
    # DSpark: verify only the drafts before the first whose confidence is under this (a sampled walk's own cut)
    confidence_threshold: float | None = None
    expected: list[float] = field(default_factory=list)  # per step: the estimate of its expected committed length
    verified: list[int] = field(default_factory=list)  # per step: the drafts it verified
    # every draft position a step reached (all drafts before it accepted): (position, the drafter's confidence
    # there or None, its acceptance probability alpha given the context, whether the walk accepted it)
    reached: list[tuple[int, float | None, float, bool]] = field(default_factory=list)

    def step(self, proposer: Proposer, j: int, rows: torch.Tensor, completion: torch.Tensor, i: int) -> int:
        """The tokens the step at anchor index i commits, drawn from their law given that the target's output is
        `completion` [M] (rows [k, V]: the proposal of block j of the proposer's last call); appends the step's
        expected committed length to `expected`.

        With the drafts' q (sampled: the drafter's along the completion; argmax: one-hot) and the target's p,
        P(draft t accepted | accepted before, output token c_t) = rho_t = min(1, q_t(c_t) / p_t(c_t)), so the walk
        accepts c_t with probability rho_t (one-hot: rho_t = [d_t == c_t], the greedy walk's match). The expected
        length is estimated by importance weighting along the completion: P(a >= t) = E[prod_{s < t} rho_s x
        alpha_t], alpha_t = sum_x min(p_t(x), q_t(x)) (one-hot: p_t(d_t)).

        A DSpark confidence cut of a sampled walk is exact too: a position's confidence reads the draft before it,
        which at a reached position is the completion's token, so the cut along the completion is the live walk's.
        """
        left = completion.shape[0] - 1 - i
        sampled = self.rule.samples_drafts(family_of(proposer))
        k = min(rows.shape[0], left)
        if sampled and self.confidence_threshold is not None:  # `rows` hold the greedy walk's cut: not this walk's
            k = min(proposer.block_drafts(j), left)
        path = completion[i + 1 : i + 1 + k]  # [k]
        confidence = getattr(proposer, "path_confidence", lambda *_: None)(j, path)  # [k] or None
        if sampled and self.confidence_threshold is not None and confidence is not None:
            k = confident_prefix(confidence, self.confidence_threshold)
            path, confidence = path[:k], confidence[:k]
        self.verified.append(k)
        if k == 0:  # nothing verified: the step commits the target's token
            self.expected.append(1.0)
            return 1
        p = self.probs_at(i, i + k)  # [k, V]
        p_path = p.gather(-1, path[:, None])[:, 0]
        if bool((p_path <= 0).any()):
            t = int((p_path <= 0).int().argmax())
            raise FlashdraftError(
                f"completion token {i + 1 + t} ({int(path[t])}) has probability 0 under these sampling settings: the "
                f"completions must be the target's samples at the settings evaluated (flashdraft generate with them)"
            )
        if sampled:
            q = proposer.path_distributions(j, path, self.temperature)[:k]  # [k, V]
            alpha = torch.minimum(p, q).sum(-1)
            rho = (q.gather(-1, path[:, None])[:, 0] / p_path).clamp(max=1.0)
            coins = torch.rand(k, generator=self.generator, device=rho.device) < rho
        else:
            drafts = rows[:k].argmax(-1)
            alpha = p.gather(-1, drafts[:, None])[:, 0]
            rho = coins = (drafts == path).float()
        reach = torch.cat([rho.new_ones(1), rho.double().cumprod(0)[:-1]]) * alpha.double()  # [k] P(a >= t) terms
        self.expected.append(1.0 + float(reach[: max(left - 1, 0)].sum()))
        a = int(coins.int().cumprod(0).sum())
        for t in range(min(a + 1, k)):
            self.reached.append((t, None if confidence is None else float(confidence[t]), float(alpha[t]), t < a))
        return min(a + 1, left)


@torch.no_grad()
def offline_acceptance_lengths(
    proposer: Proposer,
    prompt_ids: list[int],
    completion_ids: list[int],
    block_size: int,
    features: torch.Tensor | None = None,
    max_blocks: int | None = None,
    device: torch.device | str = "cpu",
    anchors_per_call: int | None = None,
    sampling: OfflineSampling | None = None,
    positions: torch.Tensor | None = None,
) -> list[int]:
    """Walk one completion as the target's own output (module docstring), at most `max_blocks`
    steps. features: [P + M, n * H] context features of prompt + completion for the
    proposer's layers (None when it wants none). A proposer with state (a cache) must be a
    fresh one per completion. `anchors_per_call` caps how many anchors a `BatchProposer`
    drafts per call (default: its own choice); the lengths do not depend on it. `sampling`: the walk of a
    sampled completion at T > 0 (`OfflineSampling.step`); None: greedy. More than 8 parameters because it is the
    walk's one primitive, called with the pieces each caller holds (evaluation, the hybrid, benchmarks, tests)."""
    p, m = len(prompt_ids), len(completion_ids)
    tokens = prompt_ids + completion_ids
    completion = torch.tensor(completion_ids, device=device)
    if features is not None:
        features = features.to(device)
    batched = isinstance(proposer, BatchProposer)
    per_call = 1 if not batched else anchors_per_call or proposer.anchors_per_call(block_size)  # 1: `propose`
    drafts: dict[int, tuple[int, torch.Tensor]] = {}  # anchor index -> (its block in the call, rows [k, V])
    lengths: list[int] = []
    i = fed = 0  # anchor index; context positions [0, fed) were given to the proposer
    while i < m - 1 and (max_blocks is None or len(lengths) < max_blocks):
        if i not in drafts:
            # draft every anchor from i on in one call; the walk uses those it lands on, and it
            # lands on at most (steps left) more anchors, so drafting more would be wasted
            k = per_call if max_blocks is None else min(per_call, max_blocks - len(lengths))
            anchors = list(range(i, min(i + k, m - 1)))  # completion indices
            logits, fed = draft_anchors(
                proposer,
                anchors,
                tokens,
                p=p,
                features=features,
                fed=fed,
                block=block_size,
                device=device,
                positions=positions,
            )
            drafts = {a: (j, x) for j, (a, x) in enumerate(zip(anchors, logits, strict=True))}
        j, rows = drafts[i]
        if sampling is None:
            n = committed_length(rows.argmax(-1), completion, i)
        else:
            n = sampling.step(proposer, j, rows, completion, i)
        lengths.append(n)
        i += n
    return lengths


def draft_anchors(
    proposer: Proposer,
    anchors: list[int],
    tokens: list[int],
    p: int,
    features: torch.Tensor | None,
    fed: int,
    block: int,
    device: torch.device | str,
    positions: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], int]:
    """The proposals [k, V] at the completion indices `anchors` of prompt + completion `tokens` (prompt length p), in
    one call (a proposer that is not a `BatchProposer` drafts one anchor per call), given the context features
    [P + M, n * H] of the positions from `fed` to the last anchor (those before `fed` were given before); returns
    them and the new `fed`."""
    end = p + anchors[-1]  # context strictly before the last anchor
    new_context = features[None, fed:end] if features is not None else None
    # the drafter's positions of token indices as served (`positions` [P + M]: M-RoPE's row 0 beside images)
    served = (lambda i: i) if positions is None else (lambda i: int(positions[i]))
    context_positions = torch.arange(fed, end, device=device)[None]
    if positions is not None:
        context_positions = positions[fed:end].to(device)[None]
    if isinstance(proposer, BatchProposer):
        logits = proposer.propose_anchors(
            [tokens[p + a] for a in anchors], [served(p + a) for a in anchors], new_context, context_positions, block
        )
    else:
        logits = [proposer.propose(tokens[: end + 1], served(end), new_context, context_positions, block)]
    return logits, end


# -- offline τ of records ---------------------------------------------------------------------


@dataclass(frozen=True)
class WalkConfig:
    """How records are walked, offline and online alike: the block (None: the drafter's), at most `max_blocks` steps
    per record (None: all), the drafts verified (`limit`; `use_selector` False: a DFlash2 drafter's unary argmax
    path), the server's rule drafting and verifying at T > 0, the request's sampling (seeded per record), the
    buckets of `EvalResult.by_context`, and (online) the dtype live context features are rounded to."""

    block_size: int | None = None
    max_blocks: int | None = None
    limit: DraftLimit | None = None
    use_selector: bool = True
    rule: ServingRule | str | None = None
    sampling: SamplingParams = GREEDY
    context_edges: list[int] | None = None
    round_context_to: torch.dtype | None = None
    # online: verify on the target's static cache, compiled once (`SpeculativeConfig.compile`; None: where it pays)
    compile: bool | None = None

    @property
    def speculative(self) -> SpeculativeConfig:
        """What each live step drafts and verifies."""
        return SpeculativeConfig(self.block_size, self.limit, self.rule, self.round_context_to, compile=self.compile)


DEFAULT_WALK = WalkConfig()  # the whole of each record, greedy, as vLLM serves the drafter


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
    walk: WalkConfig = DEFAULT_WALK,
) -> EvalResult:
    """Offline τ of `drafter` (a DFlash drafter, the hybrid, or a stateless `Proposer` such as
    the n-gram baseline) on `records`, each walked as `walk` says, drafted as its rule's server reads the drafter.
    At temperature > 0: the walk of sampled completions (module docstring), seeded per record."""
    b, layer_ids, context_layers = drafter_shape(drafter, walk.block_size)
    features = features or FeatureSource(target)
    walk = replace(walk, block_size=b, rule=serving_rule(walk.rule))
    per_prompt = []
    for index, record in enumerate(records):
        lengths, sampling = walk_record(drafter, target, record, index, features, walk)
        per_prompt.append(
            PromptResult(
                record.id,
                lengths,
                expected_lengths=sampling.expected if sampling else None,
                prompt_length=len(record.prompt_ids),
            )
        )
    return EvalResult(
        "offline",
        b,
        layer_ids,
        context_layers,
        per_prompt,
        walk.sampling.temperature,
        drafts_per_block=drafts_per_block(drafter, b),
        context_edges=walk.context_edges,
    )


def walk_record(
    drafter: DFlashDrafter | ProposerFactory | Proposer,
    target: TargetModel,
    record: EvalRecord,
    index: int,
    features: FeatureSource,
    walk: WalkConfig,
    probs_at: Callable[[int, int], torch.Tensor] | None = None,
) -> tuple[list[int], OfflineSampling | None]:
    """The offline walk of record `index` (`evaluate_offline`'s): its acceptance lengths and, at temperature > 0,
    what the sampled walk recorded along it (the same draws for the same seed and index). `probs_at`: the record's
    `target_probs_along`, when already computed (one target forward serves many walks)."""
    block, layer_ids, _ = drafter_shape(drafter, walk.block_size)
    f = features(record, layer_ids) if layer_ids else None
    rule = serving_rule(walk.rule)
    proposer = as_proposer(drafter, target, walk.limit, walk.use_selector, rule)
    sampling = None
    params = walk.sampling
    if not params.greedy:
        probs_at = probs_at or target_probs_along(target, record, params.temperature, params.filters)
        sampling = OfflineSampling(
            probs_at,
            params.temperature,
            rule,
            record_generator(params.seed, index, target),
            walk.limit.confidence_threshold if walk.limit is not None else None,
        )
    lengths = offline_acceptance_lengths(
        proposer,
        record.prompt_ids,
        record.completion_ids,
        block_size=block,
        features=f,
        max_blocks=walk.max_blocks,
        device=target.device,
        sampling=sampling,
        positions=record.drafter_positions(),
    )
    return lengths, sampling


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
    unary = evaluate_offline(
        drafter, target, records, features, WalkConfig(block_size=b, max_blocks=max_blocks, use_selector=False)
    )
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
    return {
        "top_k": top_k,
        "tau": walked.tau,
        "unary_tau": unary.tau,
        "gain": walked.tau / unary.tau if unary.tau else None,
        "top_k_coverage": hits / verified if verified else None,
        "verified_positions": verified,
        "unary_per_prompt": [p.acceptance_lengths for p in unary.per_prompt],
    }


def walked_steps(lengths: list[int]) -> list[tuple[int, int]]:
    """(anchor index, tokens committed) of each step of a walk with these acceptance lengths."""
    steps, i = [], 0
    for n in lengths:
        steps.append((i, n))
        i += n
    return steps


def _rows_at_steps(
    drafter: DFlashDrafter,
    target: TargetModel,
    record: EvalRecord,
    features: torch.Tensor,
    steps: list[tuple[int, int]],
    block: int,
    limit: DraftLimit | None = None,
    use_selector: bool = True,
):
    """What a fresh proposer drafts at each step's anchor: (its rows [k, V], the greedy walk's confidence [k] or
    None) per step, the anchors drafted in chunks as the offline walk drafts them (`use_selector` as in
    `as_proposer`)."""
    proposer = as_proposer(drafter, target, limit, use_selector)
    inner = getattr(proposer, "inner", proposer)  # the DFlash proposer under a limit's wrapper
    per_call, fed, out = inner.anchors_per_call(block), 0, []
    for start in range(0, len(steps), per_call):
        anchors = [a for a, _ in steps[start : start + per_call]]
        logits, fed = draft_anchors(
            proposer,
            anchors,
            record.input_ids,
            p=len(record.prompt_ids),
            features=features,
            fed=fed,
            block=block,
            device=target.device,
        )
        confidence = inner.last_confidence
        out += [(rows, None if confidence is None else confidence[j]) for j, rows in enumerate(logits)]
    return out


CONFIDENCE_BINS = 10  # equal-width bins of the estimate for the calibration error
CONFIDENCE_SWEEP = (0.3, 0.5, 0.7, 0.9)  # thresholds whose cut eval reports beside the one asked for


def _calibration_error(reached: list[tuple[int, float, float, bool]]) -> float:
    """The expected calibration error of the estimates c against the acceptance probabilities, over
    CONFIDENCE_BINS equal-width bins (c = 1.0 in the last)."""
    ece = 0.0
    for b in range(CONFIDENCE_BINS):
        inside = [
            (c, alpha)
            for _, c, alpha, _ in reached
            if b / CONFIDENCE_BINS <= c < (b + 1) / CONFIDENCE_BINS or (b == CONFIDENCE_BINS - 1 and c == 1.0)
        ]
        if inside:
            mean_estimate = sum(c for c, _ in inside) / len(inside)
            mean_probability = sum(a for _, a in inside) / len(inside)
            ece += len(inside) / len(reached) * abs(mean_estimate - mean_probability)
    return ece


@torch.no_grad()
def confidence_figures(
    drafter: DFlashDrafter,
    target: TargetModel,
    records: list[EvalRecord],
    walked: EvalResult,
    features: FeatureSource | None = None,
    walk: WalkConfig = DEFAULT_WALK,
    threshold: float | None = None,
) -> dict:
    """A DSpark drafter's confidence head against what happened, beside its evaluation `walked` (without a
    confidence cut; at temperature > 0 only its block size is read: the uncut walk over the target's samples
    `records`, as `walk` says but for its limit, is walked here, seeded as `evaluate_offline`): at every draft
    position a step reached (all drafts before it accepted), the head's estimate c, the draft's acceptance
    probability there (greedy: 1 or 0, whether the draft is the target's token; one-hot rule: p(d); sampled walk:
    sum min(p, q)) and whether it was accepted, per block position (mean estimate against mean probability and
    observed share) and over all (expected calibration error against the probability, over CONFIDENCE_BINS bins);
    then, for each
    threshold of CONFIDENCE_SWEEP and `threshold`, the τ of cutting each block before its first draft with c under
    it (DeepSpec's evaluator's cut; vLLM's adaptive verification budgets by expected accepted tokens instead,
    SGLang's planner is opt-in) and its cost: the drafts verified per step, against the uncut block's."""
    features = features or FeatureSource(target)
    walk = replace(walk, block_size=walked.block_size, limit=None, rule=serving_rule(walk.rule))
    sampled = not walk.sampling.greedy
    k_max = drafts_per_block(drafter, walked.block_size)
    thresholds = sorted({*CONFIDENCE_SWEEP, *([threshold] if threshold else [])})
    if sampled:  # the uncut walk and every cut over each record's one target forward
        walks = _sampled_walks(drafter, target, records, features, walk, [None, *thresholds])
        reached, verified_full, _ = walks[0]
    else:
        reached, verified_full = _greedy_positions(drafter, target, records, features, walked)
    predicted, probability, observed, count = (torch.zeros(k_max) for _ in range(4))
    for j, c, alpha, accepted in reached:
        predicted[j] += c
        probability[j] += alpha
        observed[j] += accepted
        count[j] += 1
    cuts = []
    for n, t in enumerate(thresholds, 1):
        limit = DraftLimit(confidence_threshold=t)
        if sampled:
            _, verified, lengths = walks[n]
            tau, steps = tau_of(lengths), len(lengths)
        else:
            cut = evaluate_offline(drafter, target, records, features, replace(walk, limit=limit))
            verified = _greedy_verified(drafter, target, records, features, cut, limit)
            tau, steps = cut.tau, cut.num_steps
        cuts.append({"threshold": t, "tau": tau, "steps": steps, "drafts_verified_per_step": verified / max(steps, 1)})
    n = count.clamp(min=1)
    # the uncut walk: `walked` greedy; at T > 0 the one whose positions these are (the evaluation's own draws)
    tau, steps = (tau_of(walks[0][2]), len(walks[0][2])) if sampled else (walked.tau, walked.num_steps)
    return {
        "positions_reached": count.int().tolist(),
        "predicted": (predicted / n).tolist(),
        "acceptance_probability": (probability / n).tolist(),
        "observed": (observed / n).tolist(),
        "expected_calibration_error": _calibration_error(reached) if reached else None,
        "uncut": {"tau": tau, "steps": steps, "drafts_verified_per_step": verified_full / max(steps, 1)},
        "cuts": cuts,
    }


def _greedy_positions(
    drafter: DFlashDrafter,
    target: TargetModel,
    records: list[EvalRecord],
    features: FeatureSource,
    walked: EvalResult,
) -> tuple[list[tuple[int, float, float, bool]], int]:
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


def _greedy_verified(
    drafter: DFlashDrafter,
    target: TargetModel,
    records: list[EvalRecord],
    features: FeatureSource,
    walked: EvalResult,
    limit: DraftLimit,
) -> int:
    """The drafts the greedy walk `walked` under a confidence cut verified, over all its steps."""
    verified = 0
    for record, walk in zip(records, walked.per_prompt, strict=True):
        f = features(record, drafter.config.target_layer_ids)
        steps = walked_steps(walk.acceptance_lengths)
        rows_at = _rows_at_steps(drafter, target, record, features=f, steps=steps, block=walked.block_size, limit=limit)
        for (i, _), (rows, _) in zip(steps, rows_at, strict=True):
            verified += min(rows.shape[0], len(record.completion_ids) - 1 - i)
    return verified


def _sampled_walks(
    drafter: DFlashDrafter,
    target: TargetModel,
    records: list[EvalRecord],
    features: FeatureSource,
    walk: WalkConfig,
    thresholds: list[float | None],
) -> list[tuple[list[tuple[int, float, float, bool]], int, list[int]]]:
    """At temperature > 0, per confidence threshold (None: uncut): the draft positions the walk of each record
    reached (drawn with the seed and index `evaluate_offline` draws with, so each walk is that evaluation's), the
    drafts it verified, and its acceptance lengths; one target forward per record serves every threshold."""
    out: list[tuple[list, int, list[int]]] = [([], 0, []) for _ in thresholds]
    for index, record in enumerate(records):
        probs_at = target_probs_along(target, record, walk.sampling.temperature, walk.sampling.filters)
        for n, t in enumerate(thresholds):
            cut = replace(walk, limit=DraftLimit(confidence_threshold=t) if t is not None else None)
            walked, sampling = walk_record(
                drafter, target, record, index=index, features=features, walk=cut, probs_at=probs_at
            )
            reached, verified, lengths = out[n]
            out[n] = (reached + sampling.reached, verified + sum(sampling.verified), lengths + walked)
    return out
