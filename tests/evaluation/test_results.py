"""The figures of an evaluation: τ by context length, its buckets and their costs."""

import pytest

from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.records import EvalRecord
from flashdraft.evaluation.results import (
    EvalResult,
    PromptResult,
    default_context_edges,
    parse_context_buckets,
    record_context_edges,
)


def result(mode: str = "offline", **kwargs) -> EvalResult:
    # prompt a: 10 tokens, steps commit 3, 1, 4 (anchors after 10, 13, 14 tokens); prompt b: 100 tokens, 2, 2
    prompts = [PromptResult("a", [3, 1, 4], prompt_length=10), PromptResult("b", [2, 2], prompt_length=100)]
    if mode == "online":
        prompts[0].step_seconds = [(1.0, 2.0), (1.0, 2.0), (3.0, 4.0)]
        prompts[1].step_seconds = [(5.0, 6.0), (5.0, 6.0)]
    return EvalResult(mode, 5, [1], 1, prompts, **kwargs)


def test_each_step_falls_in_the_bucket_of_the_tokens_before_its_anchor():
    assert result().per_prompt[0].step_contexts == [10, 13, 14]
    buckets = result(context_edges=[0, 12, 64, 128]).by_context
    assert [(b["context_from"], b["context_to"], b["steps"]) for b in buckets] == [
        (0, 12, 1),
        (12, 64, 2),
        (64, 128, 2),
    ]
    assert [b["tau"] for b in buckets] == [3.0, 2.5, 2.0]
    assert buckets[0]["position_acceptance"] == [1.0, 1.0, 0.0, 0.0]  # committed 3: drafts 1 and 2 accepted
    assert buckets[1]["position_acceptance"] == [0.5, 0.5, 0.5, 0.0]


def test_bucket_steps_add_up_to_every_step_and_an_empty_bucket_has_no_tau():
    buckets = result(context_edges=[0, 1000, 2000]).by_context
    assert sum(b["steps"] for b in buckets) == result().num_steps
    assert buckets[0]["tau"] == result().tau and buckets[1] == {
        "context_from": 1000,
        "context_to": 2000,
        "steps": 0,
        "tau": None,
        "position_acceptance": None,
    }


def test_online_buckets_carry_their_own_step_costs_and_speedup_bound():
    r = result("online", context_edges=[0, 64, 128], greedy_steps=[(20, 0.5), (30, 1.5), (100, 2.0)])
    low, high = r.by_context
    assert low["draft_ms"] == pytest.approx(1000 * 5 / 3) and low["verify_ms"] == pytest.approx(1000 * 8 / 3)
    assert low["greedy_step_ms"] == pytest.approx(1000.0)
    assert low["speedup_bound"] == pytest.approx(low["tau"] * 1.0 / (5 / 3 + 8 / 3))
    assert high["draft_ms"] == pytest.approx(5000.0) and high["speedup_bound"] == pytest.approx(2.0 * 2.0 / 11.0)


def test_default_edges_are_powers_of_two_spanning_the_contexts():
    assert default_context_edges([130, 3700]) == [128, 256, 512, 1024, 2048, 4096]
    assert default_context_edges([0, 5]) == [0, 2, 4, 8]
    records = [EvalRecord("a", [1] * 128, [2] * 100), EvalRecord("b", [1] * 600, [])]
    assert record_context_edges(records, 50) == [128, 256, 512, 1024]  # b: 600 + 50 new tokens


@pytest.mark.parametrize("spec", ["", "512", "0,512,512", "0,a,9", "-1,4", "8,4"])
def test_a_bucket_spec_that_does_not_parse_is_refused_naming_it(spec):
    with pytest.raises(FlashdraftError, match="--context-buckets"):
        parse_context_buckets(spec)


def test_the_json_holds_by_context_and_each_prompts_length():
    summary = result(context_edges=[0, 64, 128]).to_json()
    assert [b["steps"] for b in summary["by_context"]] == [3, 2]
    assert [p["prompt_length"] for p in summary["per_prompt"]] == [10, 100]
