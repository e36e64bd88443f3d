"""Kill `flashdraft generate`, `cache` and `train` with SIGKILL at a random (seeded) moment and show
that nothing is lost: what was finished is intact and loads, no partial file is read as
complete, and a restart ends with exactly what an uninterrupted run writes (byte-identical
completions and cache, bit-identical drafter weights on CPU).

The killed runs are subprocesses slowed by a fixed delay per unit of work (tests/fault_runner.py)
so that a one-second window holds many records or steps; the uninterrupted reference runs and
the restarts run in this process, unslowed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.checkpoint import load_drafter
from flashdraft.cli import main
from flashdraft.data.cache import MANIFEST, PROGRESS, HiddenStateCache
from flashdraft.data.completions import load_completions
from flashdraft.errors import FlashdraftError
from flashdraft.files import sha256_file
from flashdraft.run_dir import complete_checkpoints, latest_checkpoint, verify_checkpoint
from tests.conftest import save_target

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    """A saved tiny target, 30 prompts, and the uninterrupted generate -> cache -> train runs."""
    root = tmp_path_factory.mktemp("faults")
    save_target(root / "target", "qwen3")
    rows = [{"id": f"p{i:02d}", "prompt": " ".join(f"t{(7 * i + k) % 60}" for k in range(3 + i % 5))}
            for i in range(30)]  # fmt: skip
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {
        "generate": ["generate", "--target-model", root / "target", "--prompts", root / "prompts.jsonl",
                     "--max-new-tokens", 16, "--batch-size", 2],
        "cache": ["cache", "--target-model", root / "target", "--completions", root / "c.json", "--layers", "0,2",
                  "--dtype", "fp32", "--records-per-shard", 2],
        "train": ["train", "--target-model", root / "target", "--cached-hidden-states", root / "cache",
                  "--epochs", 2, "--max-steps", 30, "--batch-size", 2, "--num-anchors", 8, "--block-size", 4,
                  "--draft-layers", 1, "--target-layer-ids", "0,2", "--save-every", 1, "--log-every", 1],
    }  # fmt: skip
    args = {k: [str(a) for a in v] for k, v in args.items()}
    assert main(args["generate"] + ["--out", str(root / "c.json")]) == 0
    assert main(args["cache"] + ["--out", str(root / "cache")]) == 0
    assert main(args["train"] + ["--out", str(root / "run")]) == 0
    return {"root": root, "args": args}


def kill_at_random_moment(argv: list[str], started, seed: int, delay: float = 0.08) -> None:
    """Run `flashdraft ARGV` slowed, wait until `started()` is true (its first finished unit is
    on disk), then SIGKILL it a random 0.2-1.2 s later, while it is still running."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.Popen([sys.executable, "-m", "tests.fault_runner", str(delay), *argv], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not started():
            assert proc.poll() is None, f"exited {proc.returncode} before its first unit: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no progress in 120 s"
            time.sleep(0.02)
        time.sleep(random.Random(seed).uniform(0.2, 1.2))
        assert proc.poll() is None, "the run finished before the kill; give it more work"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def test_generate_killed_then_rerun_gives_the_same_file(ref, tmp_path):
    out = tmp_path / "c.json"
    part = tmp_path / "c.json.part0.jsonl"
    argv = ref["args"]["generate"] + ["--out", str(out)]
    kill_at_random_moment(argv, lambda: part.exists() and part.read_text().count("\n") >= 2, seed=1, delay=0.2)

    assert not out.exists()  # the merge never happened
    lines = part.read_text().split("\n")
    rows = [json.loads(line) for line in lines[:-1]]  # every complete line is a whole record
    assert rows[0]["format"] == "flashdraft.completions" and 1 <= len(rows) - 1 < 30
    with pytest.raises(FlashdraftError, match="an unfinished flashdraft generate run"):
        load_completions(out)
    with open(part, "a") as f:  # as if the kill had landed in the middle of a write
        f.write('{"id": "p29", "prompt": "t1')

    assert main(argv) == 0
    assert out.read_bytes() == (ref["root"] / "c.json").read_bytes()
    assert not list(tmp_path.glob("c.json.*"))


def test_cache_killed_then_rerun_gives_the_same_bytes(ref, tmp_path):
    out = tmp_path / "cache"
    argv = ref["args"]["cache"] + ["--out", str(out)]
    kill_at_random_moment(argv, lambda: (out / PROGRESS / "shard-00000.json").exists(), seed=2)

    assert not (out / MANIFEST).exists()
    with pytest.raises(FlashdraftError, match="an unfinished run: re-run flashdraft cache"):
        HiddenStateCache(out)
    done = [json.loads(p.read_text()) for p in sorted((out / PROGRESS).glob("shard-*.json"))]
    assert 1 <= len(done) < 15
    for meta in done:  # every shard recorded as finished is whole
        assert sha256_file(out / meta["file"]) == meta["sha256"]
        assert load_file(out / meta["file"])["input_ids"].shape == (meta["num_tokens"],)
    # as if the kill had landed while the next shard was written, or just after its rename
    following = f"shard-{len(done):05d}.safetensors"
    (out / (following + ".tmp")).write_bytes(b"partial")
    (out / following).write_bytes((out / done[0]["file"]).read_bytes())

    assert main(argv) == 0
    reference = ref["root"] / "cache"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for p in reference.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert len(HiddenStateCache(out)) == 30


def test_train_killed_then_resumed_ends_with_the_same_weights(ref, tmp_path):
    out = tmp_path / "run"
    argv = ref["args"]["train"] + ["--out", str(out)]
    kill_at_random_moment(argv, lambda: bool(list((out / "checkpoints").glob("step-*"))), seed=3)

    last = latest_checkpoint(out)
    assert last is not None and last.name != "step-0000030"
    for step in complete_checkpoints(out):  # every checkpoint that looks complete is
        verify_checkpoint(step)
    load_drafter(last / "drafter")
    # as if killed while writing the next checkpoint, after logging a step past the last one,
    # in the middle of the next metrics row
    step = int(last.name.removeprefix("step-"))
    junk = out / "checkpoints" / f".tmp-step-{step + 1:07d}"
    (junk / "drafter").mkdir(parents=True, exist_ok=True)
    (junk / "drafter" / "model.safetensors").write_bytes(b"partial")
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step + 1, "loss": 99.0}) + '\n{"step": ')

    assert main(argv + ["--resume"]) == 0
    reference = ref["root"] / "run"
    assert [p.name for p in complete_checkpoints(out)] == [p.name for p in complete_checkpoints(reference)]
    assert not junk.exists()
    mine, theirs = (load_drafter(r / "checkpoints/step-0000030/drafter") for r in (out, reference))
    for key, value in theirs.state_dict().items():
        assert torch.equal(mine.state_dict()[key], value), key
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reference_rows = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))  # each step once, none cut short
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference_rows]
