"""Whether outputs are the target's own (`decoding.target_samples`), what `generate --engine` and `eval --served`
check an engine with: the target's greedy outputs and its samples pass; outputs of another law, or tokens its
filters exclude, fail naming the record and the token."""

from __future__ import annotations

import re

import torch

from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.decoding.serving_rules import NO_FILTERS, SamplingFilters, SamplingParams
from flashdraft.decoding.target_samples import Z_LIMIT, greedy_agreement, sampling_fidelity
from flashdraft.evaluation.records import EvalRecord
from tests.conftest import make_target

PROMPTS = [[5, 9, 17, 3, 22, 40], [1, 2, 3, 4, 5, 6], [44, 12, 7, 33, 19, 50], [8, 21, 9, 30, 2, 14]]


def outputs(target, temperature: float, seed: int = 0, filters: SamplingFilters = NO_FILTERS) -> list[EvalRecord]:
    """The target's completions of PROMPTS (40 tokens each), sampled at `temperature` (0: greedy), seeded."""
    gen = torch.Generator().manual_seed(seed)
    return [
        EvalRecord(
            f"r{i}",
            p,
            autoregressive_generate(
                target, p, 40, sampling=SamplingParams(temperature=temperature, filters=filters), generator=gen
            ).output_ids,
        )
        for i, p in enumerate(PROMPTS)
    ]


def test_the_targets_own_samples_score_within_the_limit_at_several_seeds():
    target = make_target("qwen3")
    for seed in range(3):
        records = outputs(target, 0.8, seed)
        found = sampling_fidelity(target, records, 0.8, NO_FILTERS)
        assert found["tokens"] == sum(len(r.completion_ids) for r in records) and found["problems"] == [], found
        assert abs(found["log_likelihood_z"]) < Z_LIMIT


def test_samples_of_another_temperature_fail_the_score_on_the_side_they_lean():
    # too likely (sampled colder, or greedy) scores far above 0; too unlikely (hotter, or uniform tokens) far below
    target = make_target("qwen3")
    colder = sampling_fidelity(target, outputs(target, 0.3), 0.8, NO_FILTERS)
    greedy = sampling_fidelity(target, outputs(target, 0.0), 0.8, NO_FILTERS)
    hotter = sampling_fidelity(target, outputs(target, 2.0), 0.8, NO_FILTERS)
    gen = torch.Generator().manual_seed(0)
    uniform = [
        EvalRecord(r.id, r.prompt_ids, torch.randint(0, 61, (40,), generator=gen).tolist())
        for r in outputs(target, 0.8)
    ]
    uniform = sampling_fidelity(target, uniform, 0.8, NO_FILTERS)
    assert colder["log_likelihood_z"] > Z_LIMIT and greedy["log_likelihood_z"] > Z_LIMIT
    assert hotter["log_likelihood_z"] < -Z_LIMIT and uniform["log_likelihood_z"] < -Z_LIMIT
    assert re.fullmatch(r"log-likelihood score z = \+\d+\.\d over \d+ tokens, past 3", colder["problems"][0])


def test_a_token_the_filters_exclude_is_named_by_record_and_position():
    target = make_target("qwen3")
    records = outputs(target, 0.8, filters=SamplingFilters(top_k=4))
    assert sampling_fidelity(target, records, 0.8, SamplingFilters(top_k=4))["problems"] == []
    top1 = SamplingFilters(top_k=1)  # only the argmax keeps mass: the first non-argmax token is impossible
    found = sampling_fidelity(target, records, 0.8, top1)
    greedy_check = greedy_agreement(target, records)
    assert any(
        p.startswith("record r0 token ") and "probability 0 under the target's filtered p" in p
        for p in found["problems"]
    )
    first_wrong = greedy_check["problems"][0]  # the same token, seen by the greedy check
    assert first_wrong.startswith("record r0 token ") and "not the target's argmax" in first_wrong
    assert first_wrong.split(":")[0] in [p.split(":")[0] for p in found["problems"]]


def test_the_targets_greedy_outputs_agree_and_a_changed_token_is_named():
    target = make_target("qwen3")
    records = outputs(target, 0.0)
    assert greedy_agreement(target, records) == {
        "records": 4,
        "greedy": 4,
        "near_ties": 0,
        "tie_margin": 1e-3,
        "problems": [],
    }
    changed = records[2].completion_ids.copy()
    changed[7] = (changed[7] + 1) % 61
    records[2] = EvalRecord("r2", records[2].prompt_ids, changed)
    found = greedy_agreement(target, records)
    assert found["greedy"] == 3 and len(found["problems"]) == 1
    assert found["problems"][0].startswith("record r2 token 7: not the target's argmax (logit ")
