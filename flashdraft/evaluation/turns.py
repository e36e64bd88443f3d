"""The later turns of a benchmark's multi-turn requests (SPEED-Bench), asked as the peers ask them: turn k + 1 after
the target's own answer to turn k."""

from __future__ import annotations

from flashdraft.decoding.serving_rules import SamplingParams
from flashdraft.decoding.verification import resolve_compile
from flashdraft.evaluation.config import EvalConfig
from flashdraft.evaluation.online import GreedyRun, greedy_baseline
from flashdraft.evaluation.records import EvalRecord, Log, fit_prompts, later_turn
from flashdraft.target.model import TargetModel


def with_later_turns(
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
