"""`flashdraft bench`'s figures from its load runs: per run what vLLM's client measured, per set and concurrency
the speed-up with and without the drafter (its error over repeats), τ and acceptance per position from the
engine's counters, the speed-up predicted from flashdraft's own τ and the step costs, and where the two servers'
outputs first differ.

The prediction (docs/benchmarks.md#served-speed-up): a request of N output tokens takes TTFT + (N - 1) x t_plain
on the target alone and TTFT' + (N - 1) / τ x t_step with the drafter, t_plain being one decoding step and t_step
one drafting step plus one verification of k + 1 tokens at that concurrency (the median gap between streamed
chunks of each run). With every slot busy, output tok/s scales as the inverse of a request's time, so

    predicted output tok/s speed-up = (TTFT + (N - 1) t_plain) / (TTFT' + (N - 1) t_step / τ),
    predicted time-per-output-token speed-up = τ t_plain / t_step (`results.speedup_bound`),
    break-even τ = t_step / t_plain.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from flashdraft.evaluation.results import speedup_bound
from flashdraft.serving.engine import SpecCounters
from flashdraft.serving.load import LoadRun


def mean_stderr(values: list[float]) -> tuple[float, float | None]:
    """The mean and its standard error (None from one value: no error without repeats)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)


def ratio_with_error(numerators: list[float], denominators: list[float]) -> dict[str, float | None]:
    """mean(numerators) / mean(denominators), its error propagated from both means' standard errors."""
    a, sa = mean_stderr(numerators)
    b, sb = mean_stderr(denominators)
    value = a / b
    error = value * math.hypot(sa / a, sb / b) if sa is not None and sb is not None else None
    return {"value": value, "error": error}


def run_figures(run: LoadRun) -> dict[str, Any]:
    """One run's figures: vLLM's throughputs, the per-request medians (ms), the step's cost, the counters."""
    tpots = [r.tpot for r in run.requests if r.tpot is not None]
    figures = {
        "output_tok_s": run.output_throughput,
        "request_throughput": run.request_throughput,
        "duration_s": float(run.metrics["duration"]),
        "output_tokens": sum(len(r.output_ids) for r in run.requests),
        "ttft_ms": 1e3 * statistics.median(r.ttft for r in run.requests),
        "tpot_ms": 1e3 * statistics.median(tpots) if tpots else None,
        "step_ms": 1e3 * run.step_seconds,
        "requests": [
            {
                "id": r.id,
                "ttft_ms": 1e3 * r.ttft,
                "tpot_ms": None if r.tpot is None else 1e3 * r.tpot,
                "output_tokens": len(r.output_ids),
            }
            for r in run.requests
        ],
    }
    if run.counters is not None:
        figures["counters"] = counter_figures(run.counters)
    return figures


def counter_figures(c: SpecCounters) -> dict[str, Any]:
    """τ = 1 + accepted / drafts (as vLLM's client and the peers read the counters) and acceptance per position."""
    return {
        "drafts": c.drafts,
        "draft_tokens": c.draft_tokens,
        "accepted_tokens": c.accepted,
        "accepted_per_position": c.accepted_per_position,
        "tau": 1 + c.accepted / c.drafts if c.drafts else None,
        "position_acceptance": [a / c.drafts for a in c.accepted_per_position] if c.drafts else [],
    }


def pooled_counters(runs: list[LoadRun]) -> SpecCounters:
    """The counters' differences of several runs summed (position by position)."""
    counters = [run.counters for run in runs if run.counters is not None]
    width = max((len(c.accepted_per_position) for c in counters), default=0)
    per_pos = [
        sum(c.accepted_per_position[k] for c in counters if k < len(c.accepted_per_position)) for k in range(width)
    ]
    return SpecCounters(
        sum(c.drafts for c in counters),
        sum(c.draft_tokens for c in counters),
        sum(c.accepted for c in counters),
        per_pos,
    )


def predicted_speedup(
    tau: float, plain_step_s: float, spec_step_s: float, ttft_s: float, spec_ttft_s: float, output_tokens: float
) -> dict[str, float | None]:
    """The model above: the speed-up in output tok/s and in time per output token a drafter of τ gives where a
    plain step costs `plain_step_s` and a speculative step (drafting + verifying k + 1 tokens) `spec_step_s`."""
    if not (plain_step_s > 0 and spec_step_s > 0 and tau > 0):
        return {"output_tok_s": None, "tpot": None, "break_even_tau": None}
    decode = max(output_tokens - 1, 0.0)
    return {
        "output_tok_s": (ttft_s + decode * plain_step_s) / (spec_ttft_s + decode * spec_step_s / tau),
        "tpot": speedup_bound(tau, plain_step_s, 0.0, spec_step_s),  # the engine's step: drafting and verifying
        "break_even_tau": spec_step_s / plain_step_s,
    }


def concurrency_figures(
    concurrency: int, baseline: list[LoadRun], speculative: list[LoadRun], flashdraft_tau: float | None
) -> dict[str, Any]:
    """One set at one concurrency: both servers' runs (one per repeat), the speed-ups with their errors over the
    repeats, τ and acceptance per position from the counters, and the predicted speed-up beside them."""
    base = [run_figures(r) for r in baseline]
    spec = [run_figures(r) for r in speculative]
    pick = lambda runs, key: [r[key] for r in runs if r[key] is not None]  # noqa: E731
    served = counter_figures(pooled_counters(speculative))
    row = {
        "concurrency": concurrency,
        "repeats": len(base),
        "baseline": _summary(base),
        "speculative": _summary(spec),
        "speedup_output_tok_s": ratio_with_error(pick(spec, "output_tok_s"), pick(base, "output_tok_s")),
        "speedup_tpot": ratio_with_error(pick(base, "tpot_ms"), pick(spec, "tpot_ms")),
        "tau": served["tau"],
        "tau_delivered": _delivered(speculative, served["drafts"]),
        "position_acceptance": served["position_acceptance"],
        "counters": served,
        "runs": {"baseline": base, "speculative": spec},
    }
    tokens = statistics.fmean(len(r.output_ids) for run in baseline for r in run.requests)
    step = lambda runs: statistics.median(run.step_seconds for run in runs)  # noqa: E731
    ttft = lambda runs: statistics.median(r.ttft for run in runs for r in run.requests)  # noqa: E731
    row["step_costs_ms"] = {"plain_step": 1e3 * step(baseline), "speculative_step": 1e3 * step(speculative)}
    row["predicted"] = {
        "tau": flashdraft_tau,
        **predicted_speedup(
            flashdraft_tau or 0.0, step(baseline), step(speculative), ttft(baseline), ttft(speculative), tokens
        ),
    }
    return row


def _delivered(runs: list[LoadRun], drafts: int) -> float | None:
    """Tokens delivered per drafting step (the first token of each request is the prefill's): flashdraft's τ."""
    return sum(len(r.output_ids) - 1 for run in runs for r in run.requests) / drafts if drafts else None


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A server's figures over the repeats: mean and standard error of each."""
    out = {}
    for key in ("output_tok_s", "request_throughput", "ttft_ms", "tpot_ms", "step_ms"):
        values = [r[key] for r in runs if r[key] is not None]
        mean, err = mean_stderr(values) if values else (None, None)
        out[key] = mean
        out[key + "_error"] = err
    return out


def first_difference(baseline: dict[str, list[int]], speculative: dict[str, list[int]]) -> dict[str, Any] | None:
    """Where the two servers' outputs for the same request first differ (request id, token index, both tokens);
    None when every output is the same."""
    for rid, a in baseline.items():
        b = speculative.get(rid)
        if b is None or a == b:
            continue
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return {
            "request": rid,
            "token": k,
            "baseline": a[k] if k < len(a) else None,
            "speculative": b[k] if k < len(b) else None,
            "baseline_tokens": len(a),
            "speculative_tokens": len(b),
        }
    return None
