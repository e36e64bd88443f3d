"""Sampling at T > 0 in `flashdraft eval`: the request's filters resolved, the drafters and completions that can be
evaluated at it checked, and the figures of the serving rule walked (`flashdraft.decoding.serving_rules`)."""

from __future__ import annotations

from flashdraft.decoding.serving_rules import (
    NO_FILTERS,
    SamplingFilters,
    ServingRule,
    greedy_filters_note,
    greedy_in_effect_note,
    request_filters,
    serving_rule,
)
from flashdraft.drafter.families import family_of
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.config import Candidate, EvalConfig
from flashdraft.evaluation.records import (
    Log,
)
from flashdraft.evaluation.results import (
    EvalResult,
    expected_tau_figures,
)
from flashdraft.target.model import TargetModel


def sampling_settings(cfg: EvalConfig, target: TargetModel, log: Log) -> SamplingFilters:
    """The filters the requests get at T > 0 (the given ones, else the target's generation_config.json values),
    without those the rule's server does not apply; logged with the rule. Greedy: none."""
    if cfg.temperature <= 0:
        note = greedy_filters_note(cfg.top_k, cfg.top_p, cfg.min_p)
        if note:
            log(note)
        return NO_FILTERS
    rule = serving_rule(cfg.serving_rule)
    filters, dropped = request_filters(
        target.path,
        cfg.temperature,
        cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p,
        rule=rule,
        use_generation_config=cfg.use_generation_config,
    )
    settings = ", ".join(f"{k} {v} ({filters.source.get(k)})" for k, v in filters.active().items()) or "no filters"
    log(
        f"sampling: temperature {cfg.temperature}, {settings}"
        + (
            f"; {', '.join(dropped)} from the generation config dropped: {rule.server} does not apply it"
            if dropped
            else ""
        )
    )
    log(f"serving rule {rule.describe()}")
    if greedy_in_effect_note(cfg.temperature, filters):
        log(greedy_in_effect_note(cfg.temperature, filters))
    return filters


def check_sampling(cfg: EvalConfig, candidates: list[Candidate]) -> None:
    """What eval cannot do at T > 0, refused by name before any decoding."""
    if cfg.temperature <= 0:
        return
    rule = serving_rule(cfg.serving_rule)
    for c in candidates:
        family = family_of(c.drafter)
        sampled = rule.samples_drafts(family)
        if cfg.check_consistency and sampled:
            raise FlashdraftError(
                f"--check-consistency at --temperature {cfg.temperature}: {c.label} is a {family} drafter, whose "
                f"drafts {rule.name} samples; offline and online are then equal in law, not step for step (the "
                f"check holds where drafts are the argmax walk: --serving-rule vllm, or sglang for DFlash)"
            )


def check_sampled_completions(cfg: EvalConfig, filters: SamplingFilters) -> None:
    """Offline at T > 0 the completions must be the target's samples at the settings evaluated: those eval samples
    itself from --prompts, or a file (or a cache of one) generated at this temperature with the same filters
    (`flashdraft generate --temperature T --top-k K ...`)."""
    if cfg.temperature <= 0 or cfg.online or cfg.check_consistency or cfg.prompts is not None:
        return
    generation = _source_generation(cfg) or {}
    made_at = generation.get("temperature")
    made_with = SamplingFilters(generation.get("top_k"), generation.get("top_p"), generation.get("min_p")).active()
    if made_at != cfg.temperature or made_with != filters.active():

        def settings(t, active):
            return f"temperature {t}" + "".join(f", {k} {v}" for k, v in active.items())

        from_config = filters.source and any(v != "given" for v in filters.source.values())
        raise FlashdraftError(
            f"{cfg.completions or cfg.cached_hidden_states}: completions made at {settings(made_at, made_with)}; "
            f"offline τ at {settings(cfg.temperature, filters.active())} needs the target's samples at those "
            f"settings (generate them with these settings, or give --prompts: eval samples them itself"
            + (", or --no-generation-config" if from_config else "")
            + ")"
        )


def _source_generation(cfg: EvalConfig) -> dict | None:
    """The generation settings a completions file (or the file a cache was built from) records."""
    import json
    from pathlib import Path

    if cfg.completions is not None:
        return json.loads(Path(cfg.completions).read_text()).get("generation")
    from flashdraft.data.cache_reader import HiddenStateCache

    completions = HiddenStateCache(cfg.cached_hidden_states, verify=False).manifest.get("completions") or {}
    return completions.get("generation")


def sampling_figures(cfg: EvalConfig, rule: ServingRule, filters: SamplingFilters, result: EvalResult) -> dict:
    """The summary's sampling fields: the rule and settings evaluated, and τ beside its expected value."""
    return {
        "serving_rule": rule.name,
        "sampling": {"temperature": cfg.temperature, **filters.to_json()},
    } | expected_tau_figures(result)
