"""`eval --compare-target`: a drafter's τ against the served (quantised) target and the reference side by side, each
on its own records, offline and online, with the drop and the share of positions where the targets' greedy tokens
differ."""

from __future__ import annotations

import json

import pytest

from flashdraft.evaluation.compare_targets import disagreement, greedy_tokens
from tests.conftest import run_cli, write_word_prompts
from tests.target.quantised_targets import save_quantised_target
from tests.target.tiny_families import make_family_target, save_family_target

pytest.importorskip("compressed_tensors")


def test_the_drafter_is_evaluated_against_both_targets_side_by_side_online_and_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    source = save_family_target(tmp_path / "bf16", "qwen2")
    save_quantised_target(source, tmp_path / "w8a8", "W8A8")
    write_word_prompts(tmp_path / "prompts.jsonl", 2)
    for name in ("w8a8", "bf16"):
        argv = ["generate", "--target-model", name, "--prompts", "prompts.jsonl", "--out", f"{name}.json"]
        assert run_cli(capsys, *argv, "--max-new-tokens", "8")[0] == 0
    assert (
        run_cli(capsys, "init", "--target-model", "bf16", "--out", "d", "--draft-layers", "1", "--block-size", 4)[0]
        == 0
    )
    rc, out, err = run_cli(
        capsys, "eval", "--checkpoint", "d", "--target-model", "w8a8", "--completions", "w8a8.json",
        "--compare-target", "bf16", "--compare-completions", "bf16.json", "--online", "--check-consistency",
        "--json", "eval.json",
    )  # fmt: skip
    assert rc == 0, err
    figures = json.loads((tmp_path / "eval.json").read_text())["compare_target"]
    assert figures["served_quantisation"].startswith("int8 W8A8") and figures["reference_quantisation"].startswith(
        "not"
    )
    assert figures["served_lossless"] and figures["reference_lossless"]  # each against its own greedy output
    assert all(c["identical"] for c in figures["offline_online"].values())  # offline == online, each target
    assert figures["drop"] == pytest.approx(figures["reference_tau"] - figures["served_tau"])
    served = json.loads((tmp_path / "w8a8.json").read_text())
    completion_tokens = sum(len(r["completion_ids"]) for r in served["records"])
    assert figures["greedy_disagreement"]["positions"] == completion_tokens
    assert [b["served_steps"] for b in figures["by_context"]] and figures["by_dataset"][0]["dataset"]
    assert "τ against the served and the reference target (online):" in out and "greedy disagreement:" in out
    # the served target's completions without the reference's own: one line saying what to give
    rc, _, err = run_cli(
        capsys, "eval", "--checkpoint", "d", "--target-model", "w8a8", "--completions", "w8a8.json",
        "--compare-target", "bf16",
    )  # fmt: skip
    assert rc == 2 and "give the reference's own with --compare-completions" in err


def test_greedy_disagreement_counts_the_positions_where_two_targets_choose_differently():
    a, b = make_family_target("qwen2", seed=0), make_family_target("qwen2", seed=1)
    sequences = [("r0", [1, 2, 3], [4, 5, 6, 7, 8]), ("r1", [9, 10], [11, 12, 13])]
    same = disagreement(greedy_tokens(a, sequences), greedy_tokens(a, sequences), ["r0", "r1"])
    assert (same["differ"], same["positions"], same["share"], same["records_agreeing_throughout"]) == (0, 8, 0.0, 2)
    other = disagreement(greedy_tokens(a, sequences), greedy_tokens(b, sequences), ["r0", "r1"])
    assert other["positions"] == 8 and other["differ"] > 4  # two random targets rarely agree
    assert disagreement([[1, 2, 3]], [[1, 5, 3]], ["x"])["per_record"] == [{"id": "x", "positions": 3, "differ": 1}]
