"""The ways a run ends on a cluster, each as a user meets it, and that nothing is lost:

- SIGKILL at a random (seeded) moment during `generate`, `cache` and `train`: what was finished is
  intact and loads, no partial file is read as complete, and a restart ends with exactly what an
  uninterrupted run writes (byte-identical completions and cache, bit-identical drafter weights
  on CPU);
- SIGTERM / SIGINT (preemption, Ctrl-C): the run finishes the unit in flight, writes its resumable
  state, says how to resume and exits 143 / 130; the resumed run equals the uninterrupted one, on one
  process and on two gloo ranks, one of which alone got the signal;
- a full disk in every writer: exit 2 with one line naming the file, what it held and the bytes it
  needed, nothing partial that looks complete, and the same command after space is freed gives
  the uninterrupted result. The disk is a file-size limit (RLIMIT_FSIZE: EFBIG, on any machine);
  where the tests may mount one, also a small tmpfs (ENOSPC);
- two `cache` runs on one output: the second is refused, naming the first.

The interrupted runs are subprocesses slowed by a fixed delay per unit of work (tests/fault_runner.py)
so that a one-second window holds many records or steps; the uninterrupted reference runs and
the restarts run in this process, unslowed."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.cli import main
from flashdraft.data.cache import MANIFEST, PROGRESS
from flashdraft.data.cache_reader import HiddenStateCache
from flashdraft.data.completions import load_completions
from flashdraft.drafter.checkpoint import load_drafter
from flashdraft.drafter.run_dir import complete_checkpoints, latest_checkpoint, verify_checkpoint
from flashdraft.errors import FlashdraftError
from flashdraft.files import sha256_file
from tests.conftest import save_target

ROOT = Path(__file__).resolve().parents[1]
# subprocesses at this process's thread count (conftest's): their results are compared bit for bit with
# runs in this process, and a kernel's summation order depends on its thread count
ENV = dict(
    os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error"
)
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's lines on stderr are progress, not messages


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    """A saved tiny target, 30 prompts, and the uninterrupted generate -> cache -> train runs."""
    root = tmp_path_factory.mktemp("faults")
    save_target(root / "target", "qwen3")
    rows = [
        {"id": f"p{i:02d}", "prompt": " ".join(f"t{(7 * i + k) % 60}" for k in range(3 + i % 5))} for i in range(30)
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {
        "generate": [
            "generate",
            "--target-model",
            root / "target",
            "--prompts",
            root / "prompts.jsonl",
            "--max-new-tokens",
            16,
            "--batch-size",
            2,
        ],
        "cache": [
            "cache",
            "--target-model",
            root / "target",
            "--completions",
            root / "c.json",
            "--layers",
            "0,2",
            "--dtype",
            "fp32",
            "--records-per-shard",
            2,
        ],
        "train": [
            "train",
            "--target-model",
            root / "target",
            "--cached-hidden-states",
            root / "cache",
            "--epochs",
            2,
            "--batch-size",
            2,
            "--num-anchors",
            8,
            "--block-size",
            4,
            "--draft-layers",
            1,
            "--target-layer-ids",
            "0,2",
            "--save-every",
            1,
            "--log-every",
            1,
            # AdamW's two moments make trainer.pt larger than the weights: the full-disk test fits one, not both
            "--optimizer",
            "adamw",
        ],
    }
    args = {k: [str(a) for a in v] for k, v in args.items()}
    assert main(args["generate"] + ["--out", str(root / "c.json")]) == 0
    assert main(args["cache"] + ["--out", str(root / "cache")]) == 0
    assert main(args["train"] + ["--out", str(root / "run")]) == 0
    return {"root": root, "args": args}


def kill_at_random_moment(argv: list[str], started, seed: int, delay: float = 0.08) -> None:
    """Run `flashdraft ARGV` slowed, wait until `started()` is true (its first finished unit is
    on disk), then SIGKILL it a random 0.2-1.2 s later, while it is still running."""
    env = dict(ENV)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fault_runner", str(delay), *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
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


# -- SIGTERM and SIGINT: a graceful stop ------------------------------------------------------


def start_slowed(argv: list[str], delay: float, stderr: Path, env: dict | None = None) -> subprocess.Popen:
    """`flashdraft ARGV` slowed (tests/fault_runner.py), its stderr into a file; SIGINT is set back
    to its default in case this test process ignores it (a background job), as a terminal's is."""
    with open(stderr, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.fault_runner", str(delay), *argv],
            cwd=ROOT,
            env=env or ENV,
            stdout=subprocess.DEVNULL,
            stderr=log,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def wait_until(proc: subprocess.Popen, condition, what: str, stderr: Path) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}: {stderr.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"not {what} in 120 s"
        time.sleep(0.02)


def rows_of(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def stop_line(stderr: Path) -> str:
    return [line for line in stderr.read_text().splitlines() if line.startswith("stopped: ")][-1]


def final_weights_equal(run: Path, reference: Path) -> None:
    mine, theirs = (load_drafter(latest_checkpoint(r) / "drafter").state_dict() for r in (run, reference))
    assert latest_checkpoint(run).name == latest_checkpoint(reference).name
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_sigterm_during_train_checkpoints_the_step_in_flight_exits_143_and_resume_is_bit_identical(ref, tmp_path):
    out, err = tmp_path / "run", tmp_path / "stderr"
    argv = ref["args"]["train"] + ["--save-every", "1000", "--out", str(out)]  # no periodic save: the stop's own
    proc = start_slowed(argv, 0.1, err)
    try:
        wait_until(proc, lambda: rows_of(out / "metrics.jsonl") >= 3, "its third step", err)
        proc.send_signal(signal.SIGTERM)
        # a second SIGTERM while the checkpoint is written (the runner sleeps inside the save) changes nothing
        wait_until(proc, lambda: bool(list(out.glob("checkpoints/.tmp-step-*"))), "the stop's checkpoint", err)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, err.read_text()[-2000:]
    finally:
        proc.kill()
    last = latest_checkpoint(out)
    step = int(last.name.removeprefix("step-"))
    assert 3 <= step < 30 and [p.name for p in complete_checkpoints(out)] == [last.name]
    verify_checkpoint(last)  # whole, though a second signal came while it was written
    assert not list(out.glob("checkpoints/.tmp-*")) and not (out / ".lock").exists()
    assert stop_line(err) == (
        f"stopped: SIGTERM after step {step} of 30: checkpoint {last}; resume with: flashdraft "
        f"{' '.join(argv)} --resume"
    )

    assert main(argv + ["--resume"]) == 0
    final_weights_equal(out, ref["root"] / "run")
    assert losses(out) == losses(ref["root"] / "run")


def free_ports(n: int) -> list[int]:
    """n distinct free ports (all held open while chosen, so no two are the same)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_ranks(argv: list[str], delay: float, logs: Path, port: int) -> list[subprocess.Popen]:
    """Two gloo ranks of `flashdraft ARGV`, set up as torchrun sets them (RANK, WORLD_SIZE, ...)."""
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(ENV, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return [start_slowed(argv, delay, logs / f"rank{r}", dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]


def wait_all(procs: list[subprocess.Popen]) -> list[int]:
    """The exit statuses of all ranks (killed if one hangs: the test then fails, nothing lingers)."""
    try:
        return [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_sigterm_on_one_of_two_gloo_ranks_stops_both_after_one_step_exits_143_and_resume_is_bit_identical(
    ref, tmp_path
):
    argv = ref["args"]["train"] + ["--save-every", "1000"]
    ports = free_ports(3)
    # the uninterrupted two-rank run, in parallel with the one that is stopped
    reference = start_ranks(argv + ["--out", str(tmp_path / "reference")], 0.0, tmp_path / "reference-logs", ports[0])
    out, logs = tmp_path / "run", tmp_path / "logs"
    ranks = start_ranks(argv + ["--out", str(out)], 0.2, logs, ports[1])
    try:
        wait_until(ranks[0], lambda: rows_of(out / "metrics.jsonl") >= 2, "its second step", logs / "rank0")
        ranks[1].send_signal(signal.SIGTERM)  # rank 0 gets none: it must stop at the same step, not hang
    finally:
        statuses = wait_all(ranks)
    assert statuses == [143, 143], [(logs / f"rank{r}").read_text()[-2000:] for r in range(2)]
    last = latest_checkpoint(out)
    step = int(last.name.removeprefix("step-"))
    verify_checkpoint(last)
    assert 2 <= step < 14 and stop_line(logs / "rank0").startswith(
        f"stopped: SIGTERM after step {step} of 14: checkpoint {last}; resume with: flashdraft "
    )
    assert not [line for line in (logs / "rank1").read_text().splitlines() if line.startswith("stopped")]
    assert wait_all(reference) == [0, 0]

    resumed = start_ranks(argv + ["--out", str(out), "--resume"], 0.0, tmp_path / "resume-logs", ports[2])
    assert wait_all(resumed) == [0, 0]
    final_weights_equal(out, tmp_path / "reference")
    assert losses(out) == losses(tmp_path / "reference")


def test_sigint_during_generate_exits_130_after_the_batch_in_flight_and_rerun_gives_the_same_file(ref, tmp_path):
    out, part, err = tmp_path / "c.json", tmp_path / "c.json.part0.jsonl", tmp_path / "stderr"
    argv = ref["args"]["generate"] + ["--out", str(out)]
    proc = start_slowed(argv, 0.2, err)
    try:
        wait_until(proc, lambda: rows_of(part) >= 3, "its first batch", err)  # header and a batch of 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, err.read_text()[-2000:]
    finally:
        proc.kill()
    text = part.read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    assert text.endswith("\n") and (len(rows) - 1) % 2 == 0 and 2 <= len(rows) - 1 < 30  # whole batches only
    assert not out.exists() and not (tmp_path / "c.json.lock").exists()
    assert stop_line(err) == (
        f"stopped: SIGINT: {len(rows) - 1} of 30 prompts answered, their records kept in "
        f"{part} (not merged into {out} yet); finish with: flashdraft "
        f"{' '.join(argv)}"
    )

    assert main(argv) == 0
    assert out.read_bytes() == (ref["root"] / "c.json").read_bytes()
    assert not list(tmp_path.glob("c.json.*"))


def same_cache(out: Path, reference: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for p in reference.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


def test_sigterm_during_cache_exits_143_after_the_record_in_flight_and_rerun_gives_the_same_bytes(ref, tmp_path):
    out, err = tmp_path / "cache", tmp_path / "stderr"
    argv = ref["args"]["cache"] + ["--out", str(out)]
    proc = start_slowed(argv, 0.1, err)
    try:
        wait_until(proc, lambda: (out / PROGRESS / "shard-00001.json").exists(), "its second shard", err)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, err.read_text()[-2000:]
    finally:
        proc.kill()
    done = [json.loads(p.read_text()) for p in sorted((out / PROGRESS).glob("shard-*.json"))]
    assert 2 <= len(done) < 15 and not (out / MANIFEST).exists() and not (out / ".lock").exists()
    for meta in done:  # every shard recorded as finished is whole; the one in flight left nothing
        assert sha256_file(out / meta["file"]) == meta["sha256"]
    assert sorted(p.name for p in out.glob("*.safetensors*")) == [meta["file"] for meta in done]
    assert stop_line(err) == (
        f"stopped: SIGTERM: {len(done)} of 15 shards finished in {out} (the one in flight is "
        f"computed again); finish with: flashdraft {' '.join(argv)}"
    )

    assert main(argv) == 0
    same_cache(out, ref["root"] / "cache")


# -- one writer per output ---------------------------------------------------------------------


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not PROGRESS_BAR.search(line)]


def test_a_second_cache_on_the_same_output_is_refused_naming_the_first_and_its_lock(ref, tmp_path):
    out, err = tmp_path / "cache", tmp_path / "stderr"
    argv = ref["args"]["cache"] + ["--out", str(out)]
    first = start_slowed(argv, 1.0, err)  # 30 s of work: it outlives the second's start (killed below)
    try:
        holder = f"pid {first.pid}\n"
        wait_until(
            first, lambda: (out / ".lock").exists() and (out / ".lock").read_text().startswith(holder), "its lock", err
        )
        second = subprocess.run(
            [sys.executable, "-m", "flashdraft", *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
        )
        lock_after = (out / ".lock").read_text()
        assert first.poll() is None, "the first cache finished before the second started; give it more work"
        assert second.returncode == 2, second.stderr[-2000:]
        assert error_lines(second.stderr) == [
            f"error: {out}: another flashdraft cache (pid {first.pid} on host {socket.gethostname()}) is writing it "
            f"(lock {out / '.lock'}); wait for it to finish, stop it, or use another --out"
        ]
        assert lock_after.startswith(holder)  # the refused run left the lock as it was
    finally:
        first.kill()
        first.wait()


# -- a full disk -------------------------------------------------------------------------------

EFBIG_LINE = re.compile(
    r"^error: (\S+): file too large for the filesystem or the process's file-size limit \(EFBIG\) "
    r"while writing (.+) \((about|at least) [\d.]+ (bytes|KB|MB) needed; "
    r"[\d.]+ (bytes|KB|MB|GB|TB) free\); (.+)$"
)


@pytest.fixture(scope="module")
def full_disk(ref, tmp_path_factory) -> dict:
    """Each writer run once under a file-size limit below the largest file it writes (all in one
    subprocess, tests/full_disk_runner.py): {writer: (output, rc, stdout, stderr)}."""
    root, args = tmp_path_factory.mktemp("full-disk"), ref["args"]
    smallest_shard = min(p.stat().st_size for p in (ref["root"] / "cache").glob("shard-*"))
    run = str(ref["root"] / "run")
    evaluate = [
        "eval",
        "--checkpoint",
        run,
        "--target-model",
        str(ref["root"] / "target"),
        "--cached-hidden-states",
        str(ref["root"] / "cache"),
    ]
    plan = {  # writer: (argv up to its output, output, file-size limit)
        "generate": (args["generate"] + ["--out"], "c.json", 3000),  # the part file: a few batches fit
        "cache": (args["cache"] + ["--out"], "cache", smallest_shard),  # the shards of the shortest records fit
        "train-checkpoint": (args["train"] + ["--out"], "run", 200_000),  # a checkpoint's weights fit, trainer.pt not
        "train-metrics": (args["train"] + ["--save-every", "1000", "--out"], "run", 3000),  # a dozen rows fit
        "export": (["export", "--checkpoint", run, "--out"], "export", 100_000),  # the weights do not fit
        "eval-json": (evaluate + ["--json"], "e.json", 1000),
        "eval-report": (evaluate + ["--report"], "report", 5000),  # a plot does not fit
    }
    commands = [
        {"name": name, "argv": argv + [str(root / name / out)], "limit": limit}
        for name, (argv, out, limit) in plan.items()
    ]
    for c in commands:
        (root / c["name"]).mkdir()
    (root / "plan.json").write_text(json.dumps(commands))
    # matplotlib writes its font cache on first use: under the runner's file-size limit that write fails and says so,
    # a second line beside the one under test; build the cache here first (a fresh machine has none)
    import matplotlib.font_manager  # noqa: F401

    runner = [sys.executable, "-m", "tests.full_disk_runner", str(root / "plan.json"), str(root / "results.json")]
    subprocess.run(runner, cwd=ROOT, env=ENV, check=True, timeout=300)
    results = json.loads((root / "results.json").read_text())
    return {c["name"]: (Path(c["argv"][-1]), c["argv"], results[c["name"]]) for c in commands}


def one_disk_full_line(result: dict, path: Path, what: str) -> re.Match:
    """The run ended with exit 2 and one line: the file, EFBIG, what it held, the bytes, the fix."""
    lines = error_lines(result["stderr"])
    assert result["rc"] == 2 and len(lines) == 1 and "Traceback" not in result["stderr"], result["stderr"][-3000:]
    match = EFBIG_LINE.match(lines[0])
    assert match, lines[0]
    assert Path(match[1]).is_relative_to(path) and what in match[2], lines[0]
    return match


def no_temporary_files(directory: Path) -> None:
    assert not [p for p in directory.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".tmp")]


def test_a_full_disk_in_generate_exits_2_in_one_line_keeps_whole_records_and_rerun_gives_the_same_file(full_disk, ref):
    out, argv, result = full_disk["generate"]
    match = one_disk_full_line(result, out.parent / "c.json.part0.jsonl", "the completions of 2 prompts")
    assert "the records already in c.json.part0.jsonl are kept" in match[6]
    text = (out.parent / "c.json.part0.jsonl").read_text()
    assert text.endswith("\n") and 2 <= text.count("\n") < 16  # whole batches, the one that did not fit cut off
    assert not out.exists() and not (out.parent / "c.json.lock").exists()
    no_temporary_files(out.parent)

    assert main(argv) == 0
    assert out.read_bytes() == (ref["root"] / "c.json").read_bytes()


def test_a_full_disk_in_cache_exits_2_in_one_line_keeps_finished_shards_and_rerun_gives_the_same_bytes(full_disk, ref):
    out, argv, result = full_disk["cache"]
    match = one_disk_full_line(result, out, "cache shard")
    assert re.match(r"free about [\d.]+ KB for the \d+ shards still to write and re-run the same command", match[6])
    done = [json.loads(p.read_text()) for p in sorted((out / PROGRESS).glob("shard-*.json"))]
    assert 1 <= len(done) < 15 and not (out / MANIFEST).exists()
    assert sorted(p.name for p in out.glob("*.safetensors*")) == [meta["file"] for meta in done]
    no_temporary_files(out)

    assert main(argv) == 0
    same_cache(out, ref["root"] / "cache")


def test_a_full_disk_in_a_train_checkpoint_exits_2_in_one_line_leaves_no_partial_checkpoint_and_resume_is_identical(
    full_disk, ref
):
    out, argv, result = full_disk["train-checkpoint"]
    match = one_disk_full_line(result, out / "checkpoints" / "step-0000001" / "trainer.pt", "the trainer state")
    assert "re-run the same command with --resume" in match[6]
    assert complete_checkpoints(out) == [] and not list((out / "checkpoints").iterdir())  # its drafter/ removed too
    assert not (out / ".lock").exists()

    assert main(argv + ["--resume"]) == 0
    final_weights_equal(out, ref["root"] / "run")
    assert losses(out) == losses(ref["root"] / "run")


def test_a_full_disk_in_train_metrics_exits_2_in_one_line_keeps_whole_rows_and_resume_is_identical(full_disk, ref):
    out, argv, result = full_disk["train-metrics"]
    one_disk_full_line(result, out / "metrics.jsonl", "the metrics row of step")
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and 3 <= len(losses(out)) < 30  # whole rows only

    assert main(argv + ["--resume"]) == 0
    final_weights_equal(out, ref["root"] / "run")
    assert losses(out) == losses(ref["root"] / "run")


def test_a_full_disk_in_export_exits_2_in_one_line_leaves_no_drafter_and_rerun_gives_the_same_files(
    full_disk, ref, tmp_path
):
    out, argv, result = full_disk["export"]
    one_disk_full_line(result, out / "model.safetensors", "the drafter's weights")
    assert not out.exists() or not list(out.iterdir())  # no config.json without its weights, no .tmp

    assert main(argv) == 0
    assert main(argv[:-1] + [str(tmp_path / "reference")]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        p.name: p.read_bytes().replace(str(tmp_path / "reference").encode(), str(out).encode())
        for p in (tmp_path / "reference").iterdir()
    }


@pytest.mark.parametrize(
    "writer, written", [("eval-json", "the evaluation figures (--json)"), ("eval-report", "a report plot")]
)
def test_a_full_disk_in_eval_output_exits_2_in_one_line_writes_nothing_partial_and_rerun_gives_the_same_output(
    full_disk, tmp_path, writer, written
):
    out, argv, result = full_disk[writer]
    one_disk_full_line(result, out, written)
    if writer == "eval-json":
        assert not out.exists() and not list(out.parent.iterdir())
    else:
        assert not (out / "report.md").exists()  # the report comes last, after its plots
        no_temporary_files(out)

    assert main(argv) == 0
    assert main(argv[:-1] + [str(tmp_path / "reference")]) == 0
    name = "" if writer == "eval-json" else "report.md"
    assert (out / name).read_text() == (tmp_path / "reference" / name).read_text()


@pytest.fixture
def tmpfs(tmp_path):
    """(a small tmpfs at tmp_path/small, resize(bytes)) where this process may mount one (root with
    CAP_SYS_ADMIN); skipped elsewhere, the file-size-limit tests above covering every writer."""
    mount = tmp_path / "small"
    mount.mkdir()
    if (
        not shutil.which("mount")
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here")

    def resize(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True, capture_output=True)

    try:
        yield mount, resize
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def run_here(capsys, argv: list[str]) -> tuple[int, list[str]]:
    rc = main(argv)
    return rc, error_lines(capsys.readouterr().err)


def test_cache_on_a_small_tmpfs_is_refused_up_front_fails_cleanly_when_forced_and_resumes_to_the_same_bytes(
    ref, tmpfs, capsys
):
    mount, resize = tmpfs
    resize(128 * 1024)
    out = mount / "cache"
    argv = ref["args"]["cache"] + ["--out", str(out)]
    rc, lines = run_here(capsys, argv)
    assert (
        rc == 2
        and len(lines) == 1
        and re.match(
            rf"error: {out}: the cache still to write needs about [\d.]+ KB \(\d+ tokens of 30 records x 2 layers x 64 "
            r"hidden x 4 bytes \(float32\)\), its filesystem has [\d.]+ KB free; free space, choose another --out, or "
            r"give --force to try anyway$",
            lines[0],
        )
    ), lines
    assert not list(out.glob("*.safetensors*"))  # refused before any forward

    rc, lines = run_here(capsys, argv + ["--force"])
    assert (
        rc == 2
        and len(lines) == 1
        and re.match(
            rf"error: {out}/shard-\d+.safetensors: no space left on the device \(ENOSPC\) while writing cache shard",
            lines[0],
        )
    ), lines
    done = [json.loads(p.read_text()) for p in sorted((out / PROGRESS).glob("shard-*.json"))]
    assert 1 <= len(done) < 15 and not (out / MANIFEST).exists()
    assert sorted(p.name for p in out.glob("*.safetensors*")) == [meta["file"] for meta in done]

    resize(4 * 1024 * 1024)  # space freed
    assert main(argv) == 0
    same_cache(out, ref["root"] / "cache")


def test_train_on_a_small_tmpfs_fails_cleanly_mid_run_keeping_complete_checkpoints_and_resumes_identically(
    ref, tmpfs, capsys
):
    mount, resize = tmpfs
    resize(1536 * 1024)  # two checkpoints (570 KB each) and the metrics fit, a third not
    out = mount / "run"
    argv = ref["args"]["train"] + ["--out", str(out)]
    rc, lines = run_here(capsys, argv)
    assert (
        rc == 2
        and len(lines) == 1
        and re.match(
            rf"error: {out}/checkpoints/step-\d+/\S+: no space left on the device \(ENOSPC\) while writing .*re-run "
            r"the same command with --resume",
            lines[0],
        )
    ), lines
    kept = complete_checkpoints(out)
    # no partial checkpoint next to the complete ones
    assert len(kept) >= 1 and sorted(p.name for p in (out / "checkpoints").iterdir()) == [p.name for p in kept]
    for checkpoint in kept:  # what looks complete is
        verify_checkpoint(checkpoint)

    resize(8 * 1024 * 1024)
    assert main(argv + ["--resume"]) == 0
    final_weights_equal(out, ref["root"] / "run")
    assert losses(out) == losses(ref["root"] / "run")
