"""τ by category counted each peer's way: the per-request mean (Model Optimizer) and the step-weighted ratio (the
servers' 1 + accepted / drafts) computed by hand on a fixed walk equal the summary's and the report's; and SPEED-Bench
files in both layouts evaluated offline and online, every turn of a request asked after the target's own answer."""

import json

import pytest

from flashdraft.drafter.checkpoint import save_drafter
from flashdraft.evaluation.categories import TurnCounts, by_category, result_by_category
from flashdraft.evaluation.category_report import CATEGORY_PLOTS, category_text
from flashdraft.evaluation.config import EvalConfig
from flashdraft.evaluation.records import EvalRecord
from flashdraft.evaluation.report import write_report
from flashdraft.evaluation.results import EvalResult, PromptResult
from tests.conftest import make_drafter, run_cli, save_chat_target
from tests.data.speed_bench_files import speed_bench_rows, write_model_optimizer, write_nemo_skills

# a fixed walk, block 4 (3 drafts a step): tokens committed per step of each turn
WALK = {
    ("A", 0, "coding"): [3, 1, 2],
    ("A", 1, "coding"): [4, 1],
    ("B", 0, "coding"): [1, 1],
    ("C", 0, "math"): [2, 2, 3],
}


def walked() -> tuple[list[EvalRecord], EvalResult]:
    records = [
        EvalRecord(
            f"{rid}/turn{turn + 1}",
            [1],
            [2, 3],
            meta={"category": c, "split": "qualitative"},
            request_id=rid,
            turn=turn,
        )
        for rid, turn, c in WALK
    ]
    result = EvalResult(
        "offline", 4, [1], 1, [PromptResult(r.id, lengths) for r, lengths in zip(records, WALK.values(), strict=True)]
    )
    return records, result


def test_both_aggregations_by_hand_equal_the_summary_and_the_report(tmp_path):
    records, result = walked()
    figures = result_by_category(result, records, EvalConfig(checkpoint="d", target_model="t"))
    coding, math = figures["categories"]
    # per request (Model Optimizer): A commits 3+1+2+4+1 = 11 tokens in 5 steps over its two turns, B 2 in 2
    assert coding["tau_request_mean"] == pytest.approx((11 / 5 + 2 / 2) / 2)  # 1.6
    # step-weighted (vLLM, aiperf): 13 tokens in 7 steps = 1 + 6 accepted / 7 drafts
    assert coding["tau_step_weighted"] == pytest.approx(13 / 7) == pytest.approx(1 + 6 / 7)
    assert (coding["rows"], coding["turns"], coding["steps"], coding["accepted"]) == (2, 3, 7, 6)
    assert coding["acceptance_rate"] == pytest.approx(6 / (7 * 3))  # llama.cpp: accepted / drafted tokens
    assert coding["position_acceptance"] == pytest.approx([3 / 7, 2 / 7, 1 / 7])  # accepted 2,0,1,3,0,0,0
    assert coding["first_turn"]["tau_step_weighted"] == pytest.approx(8 / 5)  # A's first turn and B
    assert coding["first_turn"]["tau_request_mean"] == pytest.approx((6 / 3 + 1) / 2)
    assert math["tau_request_mean"] == math["tau_step_weighted"] == pytest.approx(7 / 3)
    overall = figures["overall"]
    assert overall["tau_request_mean"] == pytest.approx((11 / 5 + 1 + 7 / 3) / 3)
    assert overall["tau_step_weighted"] == pytest.approx(20 / 10) == pytest.approx(result.tau)
    assert (overall["rows"], overall["turns"], overall["steps"]) == (3, 4, 10)
    # the report shows the same numbers, side by side
    summary = result.to_json() | {"checkpoint": "d", "target": "t", "records_source": "s", "by_category": figures}
    table = category_text(summary["by_category"])
    row = next(line.split() for line in table.splitlines() if line.startswith("coding"))
    assert row[1:8] == ["2", "3", "7", f"{1.6:.3f}", f"{13 / 7:.3f}", f"{8 / 5:.3f}", f"{6 / 21:.3f}"]
    report = write_report(summary, tmp_path / "r").read_text()
    assert f"| coding | 2 | 3 | 7 | 1.600 | {13 / 7:.3f} | 1.600 |" in report
    assert all((tmp_path / "r" / name).is_file() for name in CATEGORY_PLOTS.values())


def test_records_without_a_category_have_no_figures_and_an_adaptive_cut_no_rate():
    records, result = walked()
    plain = [EvalRecord(r.id, r.prompt_ids, r.completion_ids) for r in records]
    counts = [TurnCounts.of_lengths(p.acceptance_lengths, 3) for p in result.per_prompt]
    assert by_category(plain, counts, 3) is None
    cut = EvalConfig(checkpoint="d", target_model="t", adaptive_threshold=0.5)
    assert result_by_category(result, records, cut)["overall"]["acceptance_rate"] is None


@pytest.fixture(scope="module")
def speed_bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("speed")
    rows = speed_bench_rows(("coding", "math"), per_category=2)
    target = save_chat_target(root / "target")
    save_drafter(make_drafter(), root / "drafter")
    return {
        "nemo": write_nemo_skills(root / "nemo", {"qualitative": rows}),
        "modelopt": write_model_optimizer(root / "modelopt", {"qualitative": rows}),
        "target": target,
        "drafter": root / "drafter",
        "rows": rows,
    }


@pytest.mark.parametrize("layout,mode", [("nemo", "offline"), ("modelopt", "online")])  # offline with trees
def test_speed_bench_in_either_layout_evaluates_every_turn_with_figures_by_category(
    capsys, tmp_path, speed_bench, layout, mode
):
    argv = [
        "eval",
        "--checkpoint",
        speed_bench["drafter"],
        "--target-model",
        speed_bench["target"],
        "--prompts",
        f"speed-bench:{speed_bench[layout]}",
        "--max-new-tokens",
        8,
        "--json",
        tmp_path / "s.json",
        "--report",
        tmp_path / "r",
        "--disable-thinking",
        *(["--online"] if mode == "online" else ["--tree", "ddtree", "--tree-budget", 4]),
    ]
    status, out, err = run_cli(capsys, *argv)
    assert status == 0, err
    summary = json.loads((tmp_path / "s.json").read_text())
    rows = speed_bench["rows"]
    turns = [(r["question_id"], len(r["messages"])) for r in rows]
    expected = [qid if n == 1 else f"{qid}/turn{t + 1}" for qid, n in turns for t in range(n)]
    assert [p["id"] for p in summary["per_prompt"]] == expected  # each request's turns in order
    figures = summary["by_category"]
    assert [c["category"] for c in figures["categories"]] == ["coding", "math"]
    assert [(c["rows"], c["turns"]) for c in figures["categories"]] == [(2, 3), (2, 3)]
    assert figures["overall"]["steps"] == summary["num_steps"]
    assert figures["overall"]["tau_step_weighted"] == pytest.approx(summary["tau"])
    if mode == "offline":  # each tree budget's walk by category, its rate over the nodes it verified
        tree = summary["trees"]["budgets"][0]
        assert tree["by_category"]["overall"]["steps"] == tree["num_steps"]
        assert tree["by_category"]["overall"]["tau_step_weighted"] == pytest.approx(tree["tau"])
        assert "tree ddtree budget 4 by category" in out
    assert (
        "by category of SPEED-Bench qualitative" in out and "## By category" in (tmp_path / "r/report.md").read_text()
    )
