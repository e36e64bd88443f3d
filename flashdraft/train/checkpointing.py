"""Training checkpoints: written atomically, verified on load, the newest K kept.

Layout: RUN/checkpoints/step-0000123/
    drafter/            the drafter in the public format (vLLM/SGLang load it as is)
    trainer.pt          optimizer, scheduler, RNG and data-order state
    checksums.json      sha256 of every file above
    COMPLETE            written last, before the directory is renamed into place

A checkpoint is first written under a temporary name, every file fsynced, then renamed:
a killed run leaves either a complete checkpoint or a temporary directory that is ignored
and cleaned up, never a partial checkpoint that looks complete.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import torch

from flashdraft.checkpoint import save_drafter_state
from flashdraft.config import DrafterConfig
from flashdraft.errors import FlashdraftError
from flashdraft.files import fsync_path, sha256_file

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"


def save_checkpoint(
    run_dir: Path,
    step: int,
    drafter_config: DrafterConfig,
    drafter_state: dict[str, torch.Tensor],
    trainer_state: dict,
    keep: int,
) -> Path:
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter_state(drafter_config, drafter_state, tmp / "drafter")
    torch.save(trainer_state, tmp / "trainer.pt")
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    sums = {str(p.relative_to(tmp)): sha256_file(p) for p in files}
    (tmp / "checksums.json").write_text(json.dumps(sums, indent=2))
    (tmp / COMPLETE).write_text(f"step {step}\n")
    for p in [*files, tmp / "checksums.json", tmp / COMPLETE, tmp / "drafter", tmp]:
        fsync_path(p)
    if final.exists():  # a re-run of the same step replaces it
        _remove(final)
    os.rename(tmp, final)
    fsync_path(root)
    for old in complete_checkpoints(run_dir)[:-keep]:
        _remove(old)
    return final


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint so that a kill midway never leaves a COMPLETE marker beside missing
    files: first rename it out of the step-* namespace (atomic), then delete."""
    doomed = checkpoint.with_name(".del-" + checkpoint.name)
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(checkpoint, doomed)
    shutil.rmtree(doomed)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first; temporary directories of killed writes are removed."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    for stale in [*root.glob(".tmp-step-*"), *root.glob(".del-step-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    return sorted(p for p in root.glob("step-*") if (p / COMPLETE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def verify_checkpoint(path: Path, only: str = "") -> None:
    """Raise FlashdraftError if any file (under `only`, e.g. "drafter/") differs from checksums.json."""
    problems = checkpoint_problems(path, only)
    if problems:
        raise FlashdraftError(problems[0])


def checkpoint_problems(path: Path, only: str = "") -> list[str]:
    """Every file of a checkpoint (under `only`) that is missing or differs from checksums.json,
    each with the fix; empty when all verify."""
    fix = ("copy it again, or delete this checkpoint directory so that --resume and eval take the one "
           "before it")  # fmt: skip
    sums_path = path / "checksums.json"
    if not sums_path.is_file():
        return [f"{path}: no checksums.json; expected a complete flashdraft checkpoint ({fix})"]
    try:
        sums = json.loads(sums_path.read_text())
    except json.JSONDecodeError as e:
        return [f"{sums_path}: not valid JSON ({e.msg}); {fix}"]
    problems = []
    for name, expected in sorted(sums.items()):
        if not name.startswith(only):
            continue
        f = path / name
        if not f.is_file():
            problems.append(f"{f}: missing; checksums.json lists it ({fix})")
            continue
        found = sha256_file(f)
        if found != expected:
            problems.append(f"{f}: sha256 {found[:12]}... differs from checksums.json {expected[:12]}... "
                            f"(truncated or corrupted; {fix})")  # fmt: skip
    return problems


def load_trainer_state(path: Path, verify: bool = True) -> dict:
    if verify:
        verify_checkpoint(path)
    return torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)


class RunLock:
    """An exclusive lock on a run directory: a second trainer on the same run is refused.
    flock is released by the kernel when the process dies, so a crash leaves no stale lock."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / ".lock"
        self._file = open(self.path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise FlashdraftError(
                f"{run_dir}: another trainer holds this run directory (lock {self.path}); "
                f"wait for it or use another --out"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
