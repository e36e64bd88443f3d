"""Files from elsewhere execute nothing: a trainer.pt or state dict whose pickle would run code
(with a matching checksums.json: whoever wrote the file wrote its checksum too) is refused by
every command that meets it, exit 2 in one line naming the file, and the code never runs (the
marker directory its `__reduce__` would create does not exist); a target's own code and a
dataset's loading script are refused the same way."""

from __future__ import annotations

import builtins
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flashdraft.cli import main
from flashdraft.data.prompts import load_prompts
from flashdraft.drafter.run_dir import latest_checkpoint
from flashdraft.errors import FlashdraftError
from flashdraft.files import sha256_file
from flashdraft.safe_load import to_plain
from flashdraft.target.model import TargetModel
from flashdraft.target.weights import TargetHead
from tests.conftest import make_drafter, run_cli, save_target, write_word_prompts


class RunsCode:
    """Unpickled in full, this creates the directory `marker`: the side effect the tests look for."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def one_line_refusal(capsys, *argv) -> str:
    rc, out, err = run_cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]  # not tqdm's bars
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), f"exit {rc}\n{out[-2000:]}\n{err}"
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("safe-load")
    target = save_target(root / "target", "qwen3")
    prompts = write_word_prompts(root / "p.jsonl", 4)
    assert (
        main(
            [
                "generate",
                "--target-model",
                target,
                "--prompts",
                prompts,
                "--out",
                root / "c.json",
                "--max-new-tokens",
                10,
            ]
        )
        == 0
    )
    train = [
        "train",
        "--target-model",
        target,
        "--completions",
        root / "c.json",
        "--max-steps",
        1,
        "--batch-size",
        2,
        "--num-anchors",
        4,
        "--block-size",
        4,
        "--target-layer-ids",
        "0,2",
    ]
    assert main([*train, "--out", root / "run"]) == 0
    return {"root": root, "target": target, "completions": root / "c.json", "run": root / "run", "train": train}


def plant(run: Path, marker: Path) -> Path:
    """Put code in the newest checkpoint's trainer.pt, beside its real state, and give it a
    matching checksum; returns the file."""
    step = latest_checkpoint(run)
    trainer = step / "trainer.pt"
    torch.save(torch.load(trainer, weights_only=True) | {"payload": RunsCode(marker)}, trainer)
    sums = json.loads((step / "checksums.json").read_text())
    (step / "checksums.json").write_text(json.dumps(sums | {"trainer.pt": sha256_file(trainer)}))
    return trainer


@pytest.mark.parametrize("command", ["train --resume", "doctor", "eval", "export"])
def test_a_trainer_pt_that_would_run_code_is_refused_by_each_command_and_its_code_never_runs(
    files, tmp_path, capsys, command
):
    run, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(files["run"], run)
    trainer = plant(run, marker)
    argv = {
        "train --resume": [*files["train"], "--out", run, "--resume"],
        "doctor": ["doctor", run],
        "eval": [
            "eval",
            "--checkpoint",
            run,
            "--target-model",
            files["target"],
            "--completions",
            files["completions"],
            "--max-blocks",
            2,
        ],
        "export": ["export", "--checkpoint", run, "--out", tmp_path / "out"],
    }[command]
    line = one_line_refusal(capsys, *argv)
    assert str(trainer) in line and "names posix.mkdir" in line and "could run code" in line, line
    assert f"flashdraft convert-run {run}" in line, line
    assert not marker.exists()
    assert command != "export" or not (tmp_path / "out").exists()


def test_a_state_dict_pt_that_would_run_code_is_refused_by_doctor_and_export_and_its_code_never_runs(
    files, tmp_path, capsys
):
    marker, path = tmp_path / "ran", tmp_path / "drafter.pt"
    torch.save(make_drafter().state_dict() | {"payload": RunsCode(marker)}, path)
    for argv in (
        ["doctor", path],
        ["export", "--checkpoint", path, "--out", tmp_path / "out", "--target-model", files["target"]],
    ):
        line = one_line_refusal(capsys, *argv)
        assert str(path) in line and "names posix.mkdir" in line, line
    assert not marker.exists()


def test_a_target_whose_config_names_its_own_code_is_refused_even_when_a_terminal_would_answer_yes(
    files, tmp_path, monkeypatch
):
    target, marker = tmp_path / "custom", tmp_path / "ran"
    shutil.copytree(files["target"], target)
    config = json.loads((target / "config.json").read_text())
    config |= {
        "model_type": "custom_lm",
        "auto_map": {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"},
    }
    (target / "config.json").write_text(json.dumps(config))
    (target / "custom.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    # transformers asks on a terminal whether to run a model's code when not told: a "y" runs it
    monkeypatch.setattr(builtins, "input", lambda *_: "y")
    for load in (TargetModel.load, TargetHead.load):
        with pytest.raises(FlashdraftError, match=r"needs Python code shipped in the model directory \(auto_map\)"):
            load(target)
    assert not marker.exists()


def test_a_prompt_directory_with_a_dataset_loading_script_is_refused_naming_it(tmp_path):
    data = tmp_path / "prompts"
    data.mkdir()
    write_word_prompts(data / "train.jsonl", 2)
    (data / "prompts.py").write_text(f"import os\nos.mkdir({str(tmp_path / 'ran')!r})\n")
    with pytest.raises(FlashdraftError, match=r"prompts\.py: a dataset loading script; flashdraft runs no code"):
        load_prompts(str(data))
    assert not (tmp_path / "ran").exists()
    (data / "prompts.py").unlink()
    assert len(load_prompts(str(data))) == 2  # the data files alone load


def test_to_plain_keeps_what_torch_loads_safely_converts_numpy_when_asked_and_names_anything_else():
    state = {
        "step": 3,
        "rng": torch.arange(4, dtype=torch.uint8),
        "betas": (0.9, 0.95),
        "fn": None,
        "groups": [{"params": [0, 1], "name": "adamw"}],
        7: torch.Size([2, 2]),
    }
    assert to_plain(state, "state") == state
    old = {"step": np.int64(3), "numpy_rng": np.random.RandomState(0).get_state()}
    with pytest.raises(FlashdraftError, match=r"state\['step'\]: a numpy.int64; expected only tensors"):
        to_plain(old, "state")
    plain = to_plain(old, "state", convert=True)
    assert plain["step"] == 3 and type(plain["step"]) is int
    assert torch.equal(plain["numpy_rng"][1], torch.from_numpy(old["numpy_rng"][1]))
    with pytest.raises(FlashdraftError, match=r"state\['f'\]\[0\]: a pathlib.PosixPath"):
        to_plain({"f": [Path("x")]}, "state", convert=True)
