"""bench's figures: the speed-ups and their errors over repeats, τ and acceptance per position from the engine's
counters pooled over runs, the predicted speed-up and break-even τ, and the first difference of two outputs."""

from __future__ import annotations

import math

import pytest

from flashdraft.evaluation.bench_figures import (
    concurrency_figures,
    first_difference,
    predicted_speedup,
    ratio_with_error,
)
from flashdraft.serving.engine import SpecCounters
from flashdraft.serving.load import LoadRun, RequestTiming


def _run(step_s: float, tokens_per_step: int, tok_s: float, drafts: int | None = None, per_pos=None) -> LoadRun:
    """Two requests of 9 tokens: TTFT 0.1 s, then one chunk of `tokens_per_step` tokens every `step_s`."""
    gaps = [step_s] * (8 // tokens_per_step)
    requests = [RequestTiming(f"r{i}", 0.1, gaps, 0.1 + sum(gaps), list(range(9)), "length") for i in range(2)]
    counters = None if drafts is None else SpecCounters(drafts, 7 * drafts, sum(per_pos), per_pos)
    return LoadRun(
        1, requests, {"output_throughput": tok_s, "request_throughput": tok_s / 9, "duration": 1.0}, counters
    )


def test_a_speedup_carries_the_error_of_both_means_and_none_without_repeats():
    s = ratio_with_error([20.0, 22.0], [10.0, 10.0])
    assert s["value"] == pytest.approx(2.1)
    assert s["error"] == pytest.approx(2.1 * (1.0 / 21.0))  # stderr of [20, 22] is 1; [10, 10] adds nothing
    assert ratio_with_error([20.0], [10.0]) == {"value": 2.0, "error": None}


def test_the_prediction_breaks_even_where_tau_pays_for_the_dearer_step():
    # a plain step 10 ms, a speculative step 25 ms: τ 2.5 gives the same time per token, τ 5 twice the speed
    even = predicted_speedup(2.5, 0.010, 0.025, 0.0, 0.0, 101)
    assert even["break_even_tau"] == pytest.approx(2.5)
    assert even["tpot"] == pytest.approx(1.0) and even["output_tok_s"] == pytest.approx(1.0)
    twice = predicted_speedup(5.0, 0.010, 0.025, 0.0, 0.0, 101)
    assert twice["tpot"] == pytest.approx(2.0) and twice["output_tok_s"] == pytest.approx(2.0)
    # the time to the first token is not sped up: it pulls the tok/s speed-up below the per-token one
    with_prefill = predicted_speedup(5.0, 0.010, 0.025, 0.5, 0.5, 101)
    assert with_prefill["output_tok_s"] == pytest.approx((0.5 + 1.0) / (0.5 + 0.5))
    assert with_prefill["output_tok_s"] < twice["tpot"]
    assert predicted_speedup(0.0, 0.01, 0.02, 0.0, 0.0, 10)["output_tok_s"] is None


def test_concurrency_figures_pool_the_counters_over_repeats_and_predict_from_the_step_costs():
    base = [_run(0.010, 1, 100.0), _run(0.010, 1, 100.0)]
    spec = [_run(0.020, 4, 190.0, 2, [2, 2, 1]), _run(0.020, 4, 210.0, 2, [2, 1, 1])]
    row = concurrency_figures(1, base, spec, flashdraft_tau=4.0)
    assert row["speedup_output_tok_s"]["value"] == pytest.approx(2.0)
    assert row["speedup_output_tok_s"]["error"] == pytest.approx(0.1)  # stderr 10 of the mean 200
    # TPOT: 8 gaps of 10 ms over 8 tokens against 2 gaps of 20 ms over 8 tokens
    assert row["speedup_tpot"]["value"] == pytest.approx(2.0) and row["speedup_tpot"]["error"] == 0
    assert row["counters"]["accepted_per_position"] == [4, 3, 2]
    assert row["tau"] == pytest.approx(1 + 9 / 4) and row["position_acceptance"] == [1.0, 0.75, 0.5]
    assert row["step_costs_ms"] == {"plain_step": pytest.approx(10.0), "speculative_step": pytest.approx(20.0)}
    p = row["predicted"]
    assert p["break_even_tau"] == pytest.approx(2.0) and p["tpot"] == pytest.approx(2.0)
    assert p["output_tok_s"] == pytest.approx((0.1 + 8 * 0.010) / (0.1 + 8 * 0.020 / 4.0))
    assert row["repeats"] == 2 and len(row["runs"]["baseline"]) == 2
    assert math.isclose(row["baseline"]["output_tok_s"], 100.0) and row["baseline"]["output_tok_s_error"] == 0


def test_the_first_difference_names_the_request_the_token_and_both_values():
    assert first_difference({"a": [1, 2, 3]}, {"a": [1, 2, 3]}) is None
    diff = first_difference({"a": [1, 2, 3], "b": [4, 5, 6]}, {"a": [1, 2, 3], "b": [4, 9, 6]})
    assert diff == {
        "request": "b",
        "token": 1,
        "baseline": 5,
        "speculative": 9,
        "baseline_tokens": 3,
        "speculative_tokens": 3,
    }
    shorter = first_difference({"a": [1, 2, 3]}, {"a": [1, 2]})
    assert shorter["token"] == 2 and shorter["baseline"] == 3 and shorter["speculative"] is None
