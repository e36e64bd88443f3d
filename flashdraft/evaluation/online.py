"""Online τ: real speculative decoding of each record's prompt (`decoding.generate`), timed after a warm-up against
plain decoding of the same prompts, each output checked against plain greedy decoding at temperature 0, and the
speed-up set against the bound τ and the measured step costs imply; and why an offline walk and an online run of the
same records are not the same walk (`consistency_mismatches`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial

import torch

from flashdraft.decoding.acceptance import tau_of
from flashdraft.decoding.generate import (
    autoregressive_generate,
    speculative_generate,
    static_autoregressive_generate,
)
from flashdraft.decoding.hybrid import HybridDrafter
from flashdraft.decoding.proposers import Proposer
from flashdraft.decoding.serving_rules import GREEDY, SamplingParams
from flashdraft.drafter.families import drafts_per_block
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.evaluation.offline import DEFAULT_WALK, WalkConfig, drafter_shape, record_generator
from flashdraft.evaluation.records import EvalRecord
from flashdraft.evaluation.results import EvalResult, PromptResult, first_difference, speedup_bound
from flashdraft.target.model import TargetModel
from flashdraft.target.static_cache import CompileCounts


@dataclass
class GreedyRun:
    output_ids: list[int]
    seconds: float
    step_seconds: list[float]  # each forward after the prefill


def max_new_tokens_of(record: EvalRecord, default: int) -> int:
    """The tokens online decoding generates for `record`: as many as its completion has (so online walks the same
    steps), else `default`."""
    return len(record.completion_ids) if record.completion_ids else default


def _sync(target: TargetModel) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


@torch.no_grad()
def greedy_baseline(
    target: TargetModel,
    records: list[EvalRecord],
    max_new_tokens: int = 256,
    sampling: SamplingParams = GREEDY,
    compile: bool = False,
) -> list[GreedyRun]:
    """Plain decoding of every record's prompt (sampled at temperature > 0), timed after a warm-up; `compile`: on the
    target's static cache, compiled once (what `--compile`'s speculative decoding is set against)."""
    warm_up = record_generator(sampling.seed, -1, target)
    longest = max(len(r.prompt_ids) + max_new_tokens_of(r, max_new_tokens) for r in records)
    decode = autoregressive_generate
    if compile:  # the warm-up compiles, on a static cache that holds the longest record
        decode = partial(static_autoregressive_generate, positions=longest)
    decode(target, records[0].prompt_ids, min(8, max_new_tokens), sampling, warm_up)
    runs = []
    for index, record in enumerate(records):
        _sync(target)
        start = time.perf_counter()
        out = decode(
            target,
            record.prompt_ids,
            max_new_tokens_of(record, max_new_tokens),
            sampling,
            record_generator(sampling.seed, index, target),
        )
        _sync(target)
        runs.append(GreedyRun(out.output_ids, time.perf_counter() - start, out.step_seconds))
    return runs


def _prompt_result(record: EvalRecord, out, lossless: bool | None, max_blocks: int | None) -> PromptResult:
    """One record's speculative decoding, its per-step figures cut to the first `max_blocks` steps."""
    kept = slice(None, max_blocks)
    return PromptResult(
        record.id,
        out.acceptance_lengths[kept],
        out.output_ids,
        lossless,
        prompt_length=len(record.prompt_ids),
        step_seconds=out.step_seconds[kept],
        expected_lengths=out.expected_lengths[kept],
        length_variances=out.length_variances[kept],
    )


def _greedy_steps(records: list[EvalRecord], baseline: list[GreedyRun]) -> list[tuple[int, float]]:
    """(context length, seconds) of every plain decoding step: forward k + 1 after the prefill reads the prompt and
    k generated tokens before its input."""
    return [
        (len(r.prompt_ids) + k, s)
        for r, run in zip(records, baseline, strict=True)
        for k, s in enumerate(run.step_seconds)
    ]


@torch.no_grad()
def evaluate_online(
    drafter: DFlashDrafter | HybridDrafter | Proposer,
    target: TargetModel,
    records: list[EvalRecord],
    baseline: list[GreedyRun],
    walk: WalkConfig = DEFAULT_WALK,
    max_new_tokens: int = 256,
) -> EvalResult:
    """Online τ: real speculative decoding of every record's prompt as `walk` says (its live context features
    rounded to a cache's dtype where it says so), timed after a warm-up, each output checked against plain greedy
    decoding (`baseline`) when temperature is 0, and the speed-up set against its bound. Acceptance lengths are cut
    to the first `walk.max_blocks` steps (the output and the timing are not)."""
    b, layer_ids, context_layers = drafter_shape(drafter, walk.block_size)
    walk = replace(walk, block_size=b)
    sampling = walk.sampling
    # the static cache sized for the longest record, so the graph the warm-up compiles serves every record
    longest = max(len(r.prompt_ids) + max_new_tokens_of(r, max_new_tokens) for r in records)
    speculative = replace(walk.speculative, static_positions=longest)
    warm_up = replace(speculative, round_context_to=None)
    first = records[0].prompt_ids
    warmed = speculative_generate(
        target,
        drafter,
        first,
        max_new_tokens=min(8, max_new_tokens),
        sampling=sampling,
        speculative=warm_up,
        generator=record_generator(sampling.seed, -1, target),
    )
    compiled = CompileCounts(warmed.compiles, warmed.recompiles, warmed.graph_breaks, warmed.compile_seconds)
    per_prompt, all_lengths = [], []
    seconds = draft_s = verify_s = 0.0
    for index, (record, plain) in enumerate(zip(records, baseline, strict=True)):
        _sync(target)
        start = time.perf_counter()
        out = speculative_generate(
            target,
            drafter,
            record.prompt_ids,
            max_new_tokens=max_new_tokens_of(record, max_new_tokens),
            sampling=sampling,
            speculative=speculative,
            generator=record_generator(sampling.seed, index, target),
        )
        _sync(target)
        compiled.add(out)
        seconds += time.perf_counter() - start
        draft_s, verify_s = draft_s + out.draft_seconds, verify_s + out.verify_seconds
        all_lengths += out.acceptance_lengths  # every step: the bound is of what was timed
        lossless = out.output_ids == plain.output_ids if sampling.greedy else None
        per_prompt.append(_prompt_result(record, out, lossless, walk.max_blocks))
    spec_tokens = sum(len(p.output_ids) for p in per_prompt)
    greedy_tokens = sum(len(r.output_ids) for r in baseline)
    greedy_seconds = sum(r.seconds for r in baseline)
    steps = max(len(all_lengths), 1)
    greedy_step = greedy_seconds / max(greedy_tokens, 1)
    return EvalResult(
        "online",
        b,
        layer_ids,
        context_layers,
        per_prompt,
        sampling.temperature,
        speculative_tokens_per_s=spec_tokens / seconds if seconds > 0 else None,
        greedy_tokens_per_s=greedy_tokens / greedy_seconds if greedy_seconds > 0 else None,
        draft_ms=1000 * draft_s / steps,
        verify_ms=1000 * verify_s / steps,
        greedy_step_ms=1000 * greedy_step,
        speedup_bound=speedup_bound(tau_of(all_lengths), greedy_step, draft_s / steps, verify_s / steps),
        drafts_per_block=drafts_per_block(drafter, b),
        context_edges=walk.context_edges,
        greedy_steps=_greedy_steps(records, baseline),
        compile=compiled.as_dict() | {"static": warmed.static, "after_warm_up": compiled.after_warm_up},
    )


def consistency_mismatches(
    records: list[EvalRecord], baseline: list[GreedyRun] | None, offline: EvalResult, online: EvalResult
) -> list[str]:
    """Why offline and online τ are not the same walk, one line per record (empty if they are):
    a completion that is not the target's greedy output, or acceptance lengths that differ. `baseline` None: the
    offline walk went over the online outputs themselves (sampled under a one-hot rule), nothing to compare them to."""
    mismatches = []
    runs = baseline if baseline is not None else [None] * len(records)
    for record, run, off, on in zip(records, runs, offline.per_prompt, online.per_prompt, strict=True):
        k = first_difference(run.output_ids, record.completion_ids) if run is not None else None
        if k is not None:
            mismatches.append(
                f"record {record.id}: its completion is not the target's greedy output (first differs at token "
                f"{k}); the check needs greedy completions"
            )
            continue
        k = first_difference(off.acceptance_lengths, on.acceptance_lengths)
        if k is not None:
            x = off.acceptance_lengths[k] if k < len(off.acceptance_lengths) else "nothing"
            y = on.acceptance_lengths[k] if k < len(on.acceptance_lengths) else "nothing"
            mismatches.append(f"record {record.id} step {k + 1}: offline committed {x}, online {y}")
    return mismatches
