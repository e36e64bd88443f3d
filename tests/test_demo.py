"""The demo pipeline end to end on a saved tiny random target (the real demo runs on `tiny`)."""

import dataclasses
import json

import torch

from flashdraft.demo import DemoSettings, run_demo
from tests.conftest import save_target


def test_demo_runs_every_stage_reports_lossless_and_offline_equal_online_and_reuses_stages(
    tmp_path, capsys, monkeypatch
):
    save_target(tmp_path / "target", "hybrid", num_layers=6)
    gen = torch.Generator().manual_seed(0)
    for name, n in (("train", 8), ("heldout", 3)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(n):
                words = " ".join(f"t{int(t)}" for t in torch.randint(0, 60, (6,), generator=gen))
                f.write(json.dumps({"id": f"{name}{i}", "prompt": words}) + "\n")
    settings = DemoSettings(
        target_model=str(tmp_path / "target"),
        train_prompts=str(tmp_path / "train.jsonl"),
        heldout_prompts=str(tmp_path / "heldout.jsonl"),
        num_heldout_prompts=3,
        max_new_tokens=24,
        target_layer_ids=(1, 2),
        num_anchors=8,
        batch_size=2,
    )
    out = tmp_path / "demo"
    report = run_demo(out, minutes=0.3, settings=settings)
    for key in ("tau_offline", "tau_online", "lossless", "speedup", "tau_untrained", "tau_ngram", "train_seconds"):
        assert key in report, key
    assert report["lossless"] is True and report["lossless_ngram"] is True and report["lossless_hybrid"] is True
    assert report["tau_offline"] == report["tau_online"] and report["offline_equals_online"]
    assert report["tau_hybrid"] == report["tau_hybrid_online"] and report["offline_equals_online_hybrid"]
    assert 0 < report["best_step"] <= report["train_steps"] and report["drafter"] == str(out / "run" / "best")
    assert json.loads((out / "report.json").read_text()) == report
    for name in ("report.md", "training_curve.png", "eval/histogram.png", "eval/position_acceptance.png"):
        assert (out / name).is_file(), name
    capsys.readouterr()
    # again with --compile (Dynamo's eager backend: the graphs, not inductor's compile): the stages reused, the
    # trained drafter also decoded compiled against compiled greedy, lossless, nothing compiled after the warm-up
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **(kw | {"backend": "eager"})))
    again = run_demo(out, minutes=0.3, settings=dataclasses.replace(settings, compile=True))
    assert "reusing the finished training run" in capsys.readouterr().out
    assert again["train_steps"] == report["train_steps"] and again["tau_offline"] == report["tau_offline"]
    compiled = again["compiled"]
    assert compiled["lossless"] is True and compiled["tau"] == report["tau_online"]
    assert compiled["compile"]["after_warm_up"] == 0 and compiled["compile"]["graph_breaks"] == 0
    assert "| trained DFlash, compiled (against compiled greedy) |" in (out / "report.md").read_text()


def test_demo_directory_from_another_target_is_refused_up_front_with_the_way_out(tmp_path, capsys):
    from flashdraft.cli import main

    out = tmp_path / "demo"
    out.mkdir()
    (out / "completions-train.json").write_text(json.dumps({"target": {"fingerprint": "0123456789abcdef"}}))
    assert main(["demo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds a demo run on another target" in err and f"remove {out}" in err
    assert sorted(p.name for p in out.iterdir()) == ["completions-train.json"]  # nothing else was started


def test_training_curve_loss_axis_fits_the_steps_after_the_first_fall_not_the_random_init_loss():
    from flashdraft.demo import training_curve_figure

    # the demo's shape: 39 at the first logged step, then 4-6
    losses = [39.0] + [6.0 - 2.0 * i / 98 for i in range(99)]
    rows = [{"step": 5 * (i + 1), "loss": loss, "estimated_acceptance": 1.2} for i, loss in enumerate(losses)]
    ax = training_curve_figure(rows + [{"step": 500, "eval_tau": 1.5}]).axes[0]
    low, high = ax.get_ylim()
    after = [r["loss"] for r in rows if r["step"] > 50]  # after the first tenth of the 500 steps
    assert low <= min(after) and max(after) <= high < 6.5  # the later steps fill the axis; 39 is left above it
    last_cut = max(r["step"] for r in rows if r["loss"] > high)
    assert f"above the axis until step {last_cut} (up to 39)" in ax.texts[0].get_text()
    # a curve without such a start keeps matplotlib's own limits
    flat = training_curve_figure(rows[1:]).axes[0]
    assert flat.get_ylim()[0] < 4.0 < 6.0 < flat.get_ylim()[1] and not flat.texts
