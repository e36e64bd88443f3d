"""`flashdraft doctor RUN`: the checks of `flashdraft.train.run_doctor`,
each finding with its fix, and the exit code: 0 clean, 1 problems found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import doctor, fail_lines

# -- training runs -------------------------------------------------------------------------------------


def _learned_copy(run: Path, to: Path) -> Path:
    """A copy of the fixture's two-step run, its metrics as if its held-out τ had been measured at 1.8."""
    copy = shutil.copytree(run, to)
    with (copy / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "eval_tau": 1.8}) + "\n")
    return copy


def test_a_training_run_checks_its_newest_checkpoint_and_run_config(doctor_files, tmp_path, capsys):
    run = _learned_copy(doctor_files["run"], tmp_path / "run")
    rc, out, err = doctor(capsys, run, "--target-model", doctor_files["target"])
    assert rc == 0, out
    assert "ok   held-out τ 1.800 at step 2 (metrics.jsonl): the drafter accepts drafts" in out
    assert "complete checkpoints ['step-0000001', 'step-0000002']" in out
    assert "newest complete checkpoint: step-0000002" in out and "every file matches checksums.json" in out
    assert "trainer.pt: step 2, 4 records, world size 1" in out
    assert "fc.weight [64, 128] holds 2 context layers" in out
    assert "run_config.json block_size 4 equals the checkpoint drafter's 4" in out
    assert "run's target fingerprint" in out and "all checks passed" in out


def test_a_run_whose_drafter_accepts_nothing_is_a_problem_with_its_likely_cause(doctor_files, capsys):
    rc, out, err = doctor(capsys, doctor_files["run"])  # two steps: its τ is an untrained drafter's
    assert rc == 1 and "all checks passed" not in out
    assert fail_lines(out) == [
        "FAIL estimated τ (training batches) at step 2 1.000 is within 0.05 of 1.0: the "
        "drafter accepts (almost) nothing, like an untrained one (likely: only 2 optimizer "
        "steps); fix: train again with --max-steps 1000"
    ]


def test_a_damaged_or_mismatched_run_fails_naming_the_file(doctor_files, tmp_path, capsys):
    run = _learned_copy(doctor_files["run"], tmp_path / "run")
    weights = run / "checkpoints/step-0000002/drafter/model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # a flipped bit in the last weight
    rc, out, err = doctor(capsys, run)
    assert rc == 1 and "model.safetensors: sha256" in fail_lines(out)[0] and "differs from checksums.json" in out
    rc, out, err = doctor(capsys, run, "--no-verify")
    assert rc == 0 and "checksums not checked (--no-verify)" in out
    config = json.loads((run / "run_config.json").read_text())
    (run / "run_config.json").write_text(json.dumps(config | {"block_size": 16}))
    rc, out, err = doctor(capsys, run, "--no-verify", "--target-model", doctor_files["other"])
    fails = fail_lines(out)
    assert rc == 1 and any("run_config.json block_size 16 differs from the checkpoint drafter's 4" in f for f in fails)
    assert any("run's target fingerprint" in f and "differs from" in f for f in fails)


def test_a_copied_checkpoint_directory_is_verified_on_its_own(doctor_files, tmp_path, capsys):
    step = shutil.copytree(doctor_files["run"] / "checkpoints/step-0000001", tmp_path / "step-0000001")
    rc, out, err = doctor(capsys, step)
    assert rc == 0 and "training checkpoint" in out and "every file matches checksums.json" in out
    (step / "trainer.pt").unlink()
    rc, out, err = doctor(capsys, step)
    assert rc == 1 and "trainer.pt: missing" in out


def test_a_run_without_a_complete_checkpoint_fails(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints" / ".tmp-step-0000001").mkdir(parents=True)
    (tmp_path / "run" / "run_config.json").write_text("{}")
    rc, out, err = doctor(capsys, tmp_path / "run")
    assert rc == 1 and "no complete checkpoint" in fail_lines(out)[0] and ".tmp-step-0000001" in out
