"""`flashdraft eval`: how good is a drafter. τ offline (the acceptance walk over the target's
own completions, `flashdraft.evaluation.offline`) and online (real speculative decoding, timed, its
speed-up set against the bound τ and the measured step costs imply, and checked lossless
against plain decoding, `flashdraft.evaluation.online`), optionally both (`--check-consistency`: the same
acceptance lengths, step for step) and against a reference drafter on the same records.

Any `Proposer` is evaluated alike, as `EvalConfig.proposer` names it: a DFlash drafter ("dflash"), the n-gram
baseline ("ngram", `flashdraft.decoding.ngram`, no checkpoint), or the hybrid of a DFlash drafter and the n-gram
lookup ("hybrid", `flashdraft.decoding.hybrid`). A drafter the caller loaded (`flashdraft.api`) comes in as
`given`; each one evaluated is a `Candidate`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.decoding.hybrid import HybridDrafter, HybridRule
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.decoding.proposers import DraftLimit, Proposer
from flashdraft.decoding.serving_rules import (
    GREEDY,
    NO_FILTERS,
    SamplingFilters,
    SamplingParams,
    serving_rule,
)
from flashdraft.decoding.verification import resolve_compile
from flashdraft.drafter.checkpoint import check_drafter_matches_target
from flashdraft.drafter.config import DEFAULT_BLOCK_SIZE
from flashdraft.drafter.families import drafts_per_block, family_of
from flashdraft.drafter.long_context import eval_guards
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.drafter.run_dir import LoadedDrafter, load_any_drafter
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.categories import result_by_category
from flashdraft.evaluation.config import NGRAM, Candidate, EvalConfig
from flashdraft.evaluation.modes import by_segment, mode_figures
from flashdraft.evaluation.offline import (
    WalkConfig,
    confidence_figures,
    drafter_shape,
    evaluate_offline,
    selector_figures,
)
from flashdraft.evaluation.online import (
    GreedyRun,
    consistency_mismatches,
    evaluate_online,
    greedy_baseline,
    max_new_tokens_of,
)
from flashdraft.evaluation.records import (
    EvalRecord,
    FeatureSource,
    Log,
    fit_prompts,
    invalid_reason,
    later_turn,
    load_eval_records,
    quiet,
)
from flashdraft.evaluation.results import (
    EvalResult,
    difference,
    record_context_edges,
)
from flashdraft.evaluation.sampling import (
    check_sampled_completions,
    check_sampling,
    sampling_figures,
    sampling_settings,
)
from flashdraft.evaluation.served import run_served
from flashdraft.evaluation.trees import evaluate_trees, require_tree_consistent
from flashdraft.target.model import TargetModel


def records_from_prompts(
    target: TargetModel, prompts: list[tuple[str, list[int]]], max_new_tokens: int
) -> list[EvalRecord]:
    """Records whose completions are the target's greedy output for each (id, prompt_ids)."""
    return [
        EvalRecord(pid, ids, autoregressive_generate(target, ids, max_new_tokens).output_ids) for pid, ids in prompts
    ]


# -- the eval command -----------------------------------------------------------------------


def _describe_drafter(label: str, loaded, block_size: int, target: TargetModel) -> list[str]:
    cfg, fc = loaded.drafter.config, list(loaded.drafter.fc.weight.shape)
    mask = target.tokenizer.convert_ids_to_tokens(cfg.mask_token_id)
    lines = [
        f"{label} {loaded.describe()}: {cfg.num_hidden_layers} layers "
        f"({cfg.describe_layers()}), {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} "
        f"kv heads x {cfg.head_dim}, intermediate {cfg.intermediate_size}; fc.weight {fc} holds "
        f"{fc[1] // cfg.hidden_size} context layers, target_layer_ids {cfg.target_layer_ids} of "
        f"{cfg.num_target_layers}; block size {cfg.block_size} (evaluating with {block_size}); "
        f"mask token {cfg.mask_token_id} {mask!r}",
        f"  {cfg.describe_family()}; layout {cfg.describe_layout()}",
    ]
    return lines + [f"  assumed: {note}" for note in loaded.assumed]


def require_consistent(summary: dict[str, Any]) -> None:
    """Refuse a `--check-consistency` summary (the drafter's, then the reference's) whose offline and online
    acceptance lengths differ."""
    require_tree_consistent(summary)
    for result in [summary] + ([summary["reference"]] if summary.get("reference") else []):
        consistency = result.get("consistency")
        if consistency and not consistency["identical"]:
            raise FlashdraftError(
                f"{result['checkpoint']}: offline and online acceptance lengths differ on "
                f"{len(consistency['mismatches'])} records; first: {consistency['mismatches'][0]}"
            )


def _load_candidates(
    cfg: EvalConfig, target: TargetModel, log: Log, given: LoadedDrafter | None = None
) -> list[Candidate]:
    """The drafter (`given`: the one the caller loaded) and the reference, loaded and described;
    the n-gram baseline drafts blocks as long as the DFlash drafter's it is set against."""
    compared = cfg.compared()
    loaded_by_role = {}
    for role, proposer, checkpoint in compared:
        if role == "drafter" and given is not None:
            check_drafter_matches_target(given.drafter.config, target, str(given.path))
            loaded_by_role[role] = given
        elif proposer != "ngram":
            loaded = load_any_drafter(
                checkpoint,
                target,
                block_size=cfg.block_size,
                target_layer_ids=cfg.target_layer_ids,
                mask_token_id=cfg.mask_token_id,
                device=cfg.device,
                dtype=cfg.dtype,
                verify=cfg.verify,
            )
            check_drafter_matches_target(loaded.drafter.config, target, str(loaded.path))
            loaded_by_role[role] = loaded
    ngram_block = cfg.block_size or next(
        (x.drafter.config.block_size for x in loaded_by_role.values()), DEFAULT_BLOCK_SIZE
    )
    candidates: list[Candidate] = []
    for role, proposer, checkpoint in compared:
        if proposer == "ngram":
            ngram = NGramProposer(target.vocab_size, cfg.ngram_max, cfg.ngram_min)
            log(f"{role} {ngram!r}: no model, no context features; block size {ngram_block}")
            candidates.append(Candidate(NGRAM, ngram, ngram_block, repr(ngram), None))
            continue
        loaded = loaded_by_role[role]
        b = cfg.block_size or loaded.drafter.config.block_size
        for line in _describe_drafter(role, loaded, b, target):
            log(line)
        drafter, form = loaded.drafter, loaded.form
        if role == "drafter" and cfg.proposer == "hybrid":
            drafter = _hybrid(cfg, drafter, target)
            form = f"{form}, {drafter!r}"
            log(f"{role} evaluated as {drafter!r}")
        candidates.append(Candidate(str(checkpoint), drafter, b, form, str(loaded.path)))
    return candidates


def _hybrid(cfg: EvalConfig, drafter: DFlashDrafter, target: TargetModel) -> HybridDrafter:
    default = HybridRule()
    rule = HybridRule(
        default.min_match if cfg.hybrid_min_match is None else cfg.hybrid_min_match,
        default.ngram_prior if cfg.hybrid_ngram_prior is None else cfg.hybrid_ngram_prior,
    )
    if rule.min_match < 0 or not 0.0 <= rule.ngram_prior <= 1.0:
        raise FlashdraftError(
            f"--hybrid-min-match {rule.min_match}, --hybrid-ngram-prior {rule.ngram_prior}: expected min_match >= 0 "
            f"and 0 <= ngram_prior <= 1"
        )
    return HybridDrafter(drafter, NGramProposer(target.vocab_size, cfg.ngram_max, cfg.ngram_min), rule)


def _drafter_type(drafter: DFlashDrafter | HybridDrafter | Proposer) -> str:
    return "dflash" if isinstance(drafter, DFlashDrafter) else "hybrid" if isinstance(drafter, HybridDrafter) else NGRAM


def _prepare_records(
    cfg: EvalConfig, target: TargetModel, max_new_tokens: int, log: Log, filters: SamplingFilters = NO_FILTERS
) -> tuple[list[EvalRecord], list[GreedyRun] | None, str]:
    """The records to evaluate (completions decoded where a prompt source gave none: greedily, or offline at
    T > 0 sampled with the settings), their plain-decoding baseline when online, and where they came from."""
    records, source = load_eval_records(
        target,
        cached_hidden_states=cfg.cached_hidden_states,
        completions=cfg.completions,
        prompts=cfg.prompts,
        num_prompts=cfg.num_prompts,
        verify=cfg.verify,
        allow_foreign=cfg.allow_foreign,
        chat_template_kwargs=cfg.chat_template_kwargs,
        enable_thinking=cfg.enable_thinking,
        log=log,
    )
    if not records:
        raise FlashdraftError(f"{source}: no records")
    records = fit_prompts(records, target, max_new_tokens, cfg.long_prompts, str(cfg.prompts), log)
    baseline = None
    if cfg.online or cfg.check_consistency or not records[0].completion_ids:
        sampling = SamplingParams(temperature=cfg.temperature, filters=filters, seed=cfg.seed)
        compiled = cfg.online and resolve_compile(cfg.compile, target)  # compiled against compiled
        baseline = greedy_baseline(target, records, max_new_tokens, sampling=sampling, compile=compiled)
        records, baseline = _with_later_turns(cfg, target, records, baseline, max_new_tokens, sampling, log)
        for record, run in zip(records, baseline, strict=True):
            if not record.completion_ids and (cfg.temperature <= 0 or not cfg.online):
                record.completion_ids = list(run.output_ids)  # the target's output: greedy, or sampled (offline)
    valid, valid_baseline = [], []
    for index, record in enumerate(records):
        reason = invalid_reason(record, target.vocab_size)
        if reason is not None and not (cfg.online and cfg.temperature > 0 and not record.completion_ids):
            log(f"  skipped record {record.id}: {reason}")
            continue
        valid.append(record)
        if baseline is not None:
            valid_baseline.append(baseline[index])
    steps = f"at most {cfg.max_blocks} steps each" if cfg.max_blocks else "every step of each completion"
    log(f"records: {len(valid)} valid of {len(records)} from {source}; {steps}")
    if not valid:
        raise FlashdraftError(f"{source}: none of the {len(records)} records can be evaluated")
    return valid, valid_baseline if baseline is not None else None, source


def _with_later_turns(
    cfg: EvalConfig,
    target: TargetModel,
    records: list[EvalRecord],
    baseline: list[GreedyRun],
    max_new_tokens: int,
    sampling: SamplingParams,
    log: Log,
) -> tuple[list[EvalRecord], list[GreedyRun]]:
    """Every turn of a benchmark's multi-turn requests (SPEED-Bench): turn k + 1 asked after the target's own answer
    to turn k (its plain decoding's output), as Model Optimizer and aiperf ask them; each request's turns together,
    in order."""
    pairs = list(zip(records, baseline, strict=True))
    asked = pairs
    while asked:
        later = [(r, nxt) for r, run in asked if (nxt := later_turn(r, run.output_ids, target.tokenizer)) is not None]
        kept = fit_prompts([nxt for _, nxt in later], target, max_new_tokens, cfg.long_prompts, str(cfg.prompts), log)
        compiled = cfg.online and resolve_compile(cfg.compile, target)
        runs = greedy_baseline(target, kept, max_new_tokens, sampling=sampling, compile=compiled) if kept else []
        asked = list(zip(kept, runs, strict=True))
        pairs += asked
    if len(pairs) > len(records):
        log(f"{len(pairs) - len(records)} later turns asked after the target's own answers ({len(pairs)} turns)")
    order = {r.request_id or r.id: k for k, r in enumerate(records)}
    pairs.sort(key=lambda pair: (order[pair[0].request_id or pair[0].id], pair[0].turn))
    return [r for r, _ in pairs], [run for _, run in pairs]


def _check_cache_layers(cfg: EvalConfig, candidates: list[Candidate], records: list[EvalRecord], log: Log) -> None:
    """The drafter must find its layers in the cache; a reference without them reads fresh
    target features."""
    for c in candidates:
        ids = drafter_shape(c.drafter, c.block_size)[1]
        if not set(ids) <= set(records[0].layer_ids):
            if c is candidates[0]:
                raise FlashdraftError(
                    f"{cfg.cached_hidden_states}: the cache holds target layers {records[0].layer_ids}; the drafter "
                    f"needs target_layer_ids {ids} (re-run flashdraft cache with these layers)"
                )
            log(
                f"reference target_layer_ids {ids} are not all in the cache: its features come from a "
                f"fresh target forward"
            )


def _draft_limit(cfg: EvalConfig, c: Candidate) -> DraftLimit | None:
    """The drafts a step verifies, checked against the candidate's block (None: all of its drafts). A confidence
    threshold applies to a DSpark drafter with a confidence head (the others have no estimate: they verify all)."""
    k, p, c_min = cfg.num_speculative_tokens, cfg.adaptive_threshold, cfg.confidence_threshold
    drafts = drafts_per_block(c.drafter, c.block_size)  # a hybrid's: its drafter's
    if k is not None and k > drafts:
        raise FlashdraftError(
            f"--num-speculative-tokens {k}: {c.label} drafts blocks of {c.block_size} ({drafts} drafts); expected at "
            f"most {drafts}"
        )
    if k is not None and k < drafts and family_of(c.drafter) == "dspark":
        raise FlashdraftError(
            f"--num-speculative-tokens {k}: {c.label} is a DSpark drafter, which servers draft with a block of "
            f"num_speculative_tokens positions (its non-causal layers then see a shorter block, not the first {k} "
            f"drafts of this one); expected --block-size {k} to evaluate that block"
        )
    if c_min is not None and c.label == cfg.checkpoint and not _has_confidence_head(c.drafter):
        raise FlashdraftError(
            f"--confidence-threshold {c_min}: {c.label} has no confidence head; expected a DSpark "
            f"drafter made with one (init --family dspark --confidence-head ...)"
        )
    return DraftLimit(k, p, c_min) if k is not None or p is not None or c_min is not None else None


def _has_confidence_head(drafter) -> bool:
    return isinstance(drafter, DFlashDrafter) and drafter.confidence_head is not None


def _lower_precision(stored: torch.dtype, computed: torch.dtype) -> bool:
    """Whether storing features computed in `computed` as `stored` rounds them (fewer mantissa bits)."""
    return torch.finfo(stored).eps > torch.finfo(computed).eps


def _consistency_rounding(cfg: EvalConfig, c: Candidate, records: list[EvalRecord]) -> torch.dtype | None:
    """The dtype live features are rounded to under --check-consistency: the cache's, for a
    drafter whose offline features come from a cache that rounded them (so both walks read the
    same features); None otherwise (no check, no cache, a cache that rounded nothing, or the
    offline walk reads a fresh target forward)."""
    layer_ids = drafter_shape(c.drafter, c.block_size)[1]
    dtype = records[0].feature_dtype
    if not cfg.check_consistency or dtype is None or not layer_ids or not set(layer_ids) <= set(records[0].layer_ids):
        return None
    # storing in the compute dtype, or in fp32 (which holds bf16 and fp16 exactly), rounds nothing
    return None if dtype in (cfg.dtype, torch.float32) else dtype


def _cache_precision_note(cfg: EvalConfig, records: list[EvalRecord]) -> str | None:
    """One line when the cache rounded the features below the precision live decoding computes
    them in: then offline τ is only within rounding of live τ."""
    stored = records[0].feature_dtype
    if stored is None or not _lower_precision(stored, cfg.dtype):
        return None
    name, computed = (str(d).removeprefix("torch.") for d in (stored, cfg.dtype))
    check = (
        f"; --check-consistency rounds the live features to {name} as the cache did, so its comparison stays exact"
        if cfg.check_consistency
        else ""
    )
    return (
        f"note: the cache stores context features in {name}, the target computes them in "
        f"{computed}: offline τ is within rounding of live τ, not step for step (a cache "
        f"built with --dtype auto keeps them exact){check}"
    )


def _evaluate_candidate(
    cfg: EvalConfig,
    c: Candidate,
    target: TargetModel,
    records: list[EvalRecord],
    baseline: list[GreedyRun] | None,
    features: FeatureSource,
    max_new_tokens: int,
    filters: SamplingFilters = NO_FILTERS,
) -> dict[str, Any]:
    """One drafter's summary: offline, online, or both with the consistency check (at T > 0: the offline walk over
    the online outputs, which under a one-hot rule commits what live decoding committed, step for step)."""
    offline = online = None
    rule = serving_rule(cfg.serving_rule)
    walk = WalkConfig(
        block_size=c.block_size,
        max_blocks=cfg.max_blocks,
        limit=_draft_limit(cfg, c),
        rule=rule,
        sampling=SamplingParams(cfg.temperature, filters, cfg.seed),
        context_edges=cfg.context_buckets,
        compile=cfg.compile,
    )
    sampled_check = cfg.check_consistency and cfg.temperature > 0
    rounding = _consistency_rounding(cfg, c, records) if not sampled_check else None
    if (not cfg.online or cfg.check_consistency) and not sampled_check:
        offline = evaluate_offline(c.drafter, target, records, features, walk)
    if cfg.online or cfg.check_consistency:
        online_walk = replace(walk, round_context_to=rounding)
        online = evaluate_online(c.drafter, target, records, baseline, online_walk, max_new_tokens)
    if sampled_check:  # the online outputs walked offline as greedy completions under the one-hot rule
        outputs = [
            EvalRecord(r.id, r.prompt_ids, o.output_ids) for r, o in zip(records, online.per_prompt, strict=True)
        ]
        offline = evaluate_offline(c.drafter, target, outputs, FeatureSource(target), replace(walk, sampling=GREEDY))
    evaluated = online if cfg.online else offline
    summary = evaluated.to_json()
    summary |= sampling_figures(cfg, rule, filters, evaluated)
    summary["by_segment"] = by_segment(evaluated, records, target.tokenizer)
    summary["by_category"] = result_by_category(evaluated, records, cfg)
    if isinstance(c.drafter, DFlashDrafter) and c.drafter.candidate_selector is not None and cfg.temperature <= 0:
        summary["selector"] = selector_figures(c.drafter, target, records, evaluated, features, cfg.max_blocks)
    if _has_confidence_head(c.drafter):
        summary["confidence"] = _confidence(
            cfg, c, target, records=records, offline=offline, online=online, features=features, walk=walk
        )
    summary |= _what_was_evaluated(cfg, c)
    if cfg.check_consistency:
        summary["consistency"] = _consistency(
            records, baseline if not sampled_check else None, offline, online, rounding
        )
    return summary


def _what_was_evaluated(cfg: EvalConfig, c: Candidate) -> dict[str, Any]:
    return {
        "checkpoint": c.label,
        "checkpoint_form": c.form,
        "drafter_path": c.path,
        "drafter_type": _drafter_type(c.drafter),
        "num_speculative_tokens": cfg.num_speculative_tokens,
        "adaptive_threshold": cfg.adaptive_threshold,
        "confidence_threshold": cfg.confidence_threshold,
    }


def _consistency(
    records: list[EvalRecord],
    baseline: list[GreedyRun] | None,
    offline: EvalResult,
    online: EvalResult,
    rounding: torch.dtype | None,
) -> dict[str, Any]:
    """Whether the offline and the online walk are one (`--check-consistency`), and where not."""
    mismatches = consistency_mismatches(records, baseline, offline, online)
    return {
        "identical": not mismatches,
        "mismatches": mismatches,
        "offline_tau": offline.tau,
        "online_tau": online.tau,
        "by_context_identical": _bucket_figures(offline) == _bucket_figures(online),
        # live features rounded to the cache's dtype (None: as computed)
        "live_features_rounded_to": str(rounding).removeprefix("torch.") if rounding else None,
    }


def _confidence(
    cfg: EvalConfig,
    c: Candidate,
    target: TargetModel,
    records: list[EvalRecord],
    offline: EvalResult | None,
    online: EvalResult | None,
    features: FeatureSource,
    walk: WalkConfig,
) -> dict[str, Any]:
    """A DSpark drafter's confidence figures (`confidence_figures`) of the uncut walk at the temperature and rule
    evaluated; at T > 0 online, over the online outputs (the target's samples) walked offline."""
    uncut_walk = replace(walk, limit=None, context_edges=None)
    if walk.sampling.greedy:
        uncut = online if cfg.online else offline
        if cfg.confidence_threshold or uncut is None:  # the figures are of the uncut walk
            uncut = evaluate_offline(c.drafter, target, records, features, uncut_walk)
        return confidence_figures(
            c.drafter,
            target,
            records,
            walked=uncut,
            features=features,
            walk=uncut_walk,
            threshold=cfg.confidence_threshold,
        )
    walked = online if cfg.online else offline  # at T > 0 confidence_figures walks the uncut walk itself
    if cfg.online:
        records = [
            EvalRecord(r.id, r.prompt_ids, o.output_ids) for r, o in zip(records, online.per_prompt, strict=True)
        ]
        features = FeatureSource(target)
    return confidence_figures(
        c.drafter,
        target,
        records,
        walked=walked,
        features=features,
        walk=uncut_walk,
        threshold=cfg.confidence_threshold,
    )


def _bucket_figures(result: EvalResult) -> list[tuple]:
    """What offline and online must share per context bucket (not the online-only timings)."""
    return [
        (b["context_from"], b["context_to"], b["steps"], b["tau"], b["position_acceptance"]) for b in result.by_context
    ]


def _load_target(cfg: EvalConfig) -> TargetModel:
    """The target, whole where the evaluation runs it; offline from a cache (greedy, nothing served) only its
    tokenizer, config, embeddings and LM head: no target forward is needed."""
    from flashdraft.target.weights import TargetHead

    offline_only = cfg.cached_hidden_states is not None and not (cfg.online or cfg.check_consistency)
    offline_only = offline_only and cfg.temperature <= 0 and not cfg.served  # at T > 0 the walk reads the target's p
    offline_only = offline_only and cfg.tree is None  # trees: the verify forwards are timed on the target
    return (TargetHead if offline_only else TargetModel).load(cfg.target_model, device=cfg.device, dtype=cfg.dtype)


def _log_records(records: list[EvalRecord], max_new_tokens: int, log: Log) -> None:
    for record in records:
        log(
            f"record {record.id}: {len(record.prompt_ids)} prompt tokens, "
            f"{max_new_tokens_of(record, max_new_tokens)} new tokens to decode"
        )


def run_eval(
    cfg: EvalConfig, log: Log = print, target: TargetModel | None = None, given: LoadedDrafter | None = None
) -> dict[str, Any]:
    """`flashdraft eval`: load, print what was loaded, evaluate (and the reference on the same
    records and step budget), and return the summary that `--json` writes. `target` and
    `given`: already loaded (`flashdraft.api`), used in place of cfg.target_model and
    cfg.checkpoint."""
    serving_rule(cfg.serving_rule)  # an unknown name fails before anything loads
    check_served_options(cfg)
    target = target or _load_target(cfg)
    tok = target.tokenizer
    log(
        f"target {target.path}: {target.num_layers} layers, hidden {target.hidden_size}; tokenizer "
        f"{type(tok).__name__} with {len(tok)} tokens, LM head vocabulary {target.vocab_size}"
    )
    candidates = _load_candidates(cfg, target, log, given)
    for c in candidates:
        _draft_limit(cfg, c)  # a k past the block fails before any decoding
    check_sampling(cfg, candidates)
    filters = sampling_settings(cfg, target, log)
    check_sampled_completions(cfg, filters)
    max_new_tokens = cfg.max_new_tokens
    if max_new_tokens is None:  # enough for max_blocks steps of the largest block
        max_new_tokens = cfg.max_blocks * max(c.block_size for c in candidates) + 1 if cfg.max_blocks else 256
    records, baseline, source = _prepare_records(cfg, target, max_new_tokens, log, filters)
    for line in eval_guards([(c.label, c.drafter) for c in candidates], target, records, max_new_tokens):
        log(line)  # evaluated past the trained context, RoPE unlike the target's, context read per step
    note = _cache_precision_note(cfg, records)
    if note:
        log(note)
    modes = mode_figures(candidates[0].drafter, records, tok, log)
    record_log = log if cfg.verbose else quiet
    features = FeatureSource(target, record_log)  # each record's tokens and feature statistics offline
    if cfg.online and not cfg.check_consistency and cfg.verbose:
        _log_records(records, max_new_tokens, log)
    if cfg.cached_hidden_states is not None:
        _check_cache_layers(cfg, candidates, records, log)
    if cfg.context_buckets is None:  # one set of buckets for drafter and reference alike
        cfg = replace(cfg, context_buckets=record_context_edges(records, max_new_tokens))
    results = [
        _evaluate_candidate(
            cfg,
            c,
            target,
            records=records,
            baseline=baseline,
            features=features,
            max_new_tokens=max_new_tokens,
            filters=filters,
        )
        for c in candidates
    ]
    main = results[0] | {
        "target": str(cfg.target_model),
        "records_source": source,
        "max_blocks": cfg.max_blocks,
        "max_new_tokens": max_new_tokens if cfg.online else None,
        "target_forwards_offline": features.target_forwards,
        **modes,
    }
    if cfg.tree is not None:  # draft trees per budget beside the chain (`evaluation.trees`)
        main["trees"] = evaluate_trees(cfg, candidates[0], target, records, features, results[0], baseline, log)
    if cfg.reference:
        main["reference"] = results[1]
        main["difference"] = difference(results[0], results[1])
    if cfg.served:
        limits = [max_new_tokens_of(r, max_new_tokens) for r in records]
        sampling = SamplingParams(cfg.temperature, filters, cfg.seed)
        main["served"] = run_served(
            candidates[0],
            target,
            records,
            max_tokens=limits,
            sampling=sampling,
            engine_python_path=cfg.engine_python,
            server_url=cfg.server,
            log=log,
        )
    return main


def check_served_options(cfg: EvalConfig) -> None:
    """--served's options, and what it can serve: one DFlash-family drafter (the engine knows no n-gram or hybrid)."""
    if not cfg.served:
        given = [
            flag
            for flag, value in (
                ("--check-served", cfg.check_served),
                ("--server", cfg.server),
                ("--engine-python", cfg.engine_python),
            )
            if value
        ]
        if given:
            raise FlashdraftError(f"{', '.join(given)}: options of --served vllm, which this run does not ask for")
        return
    if cfg.proposer != "dflash":
        raise FlashdraftError(
            "--served vllm serves a DFlash-family drafter (--checkpoint); the n-gram baseline and "
            "the hybrid are flashdraft's, not the engine's"
        )
    if cfg.server and cfg.engine_python:
        raise FlashdraftError("--server URL uses a running engine; --engine-python starts one: give one of them")
