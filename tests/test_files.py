"""File modes: every file flashdraft writes gets 0666 less the umask, like any program's files, so
a server running as another user (a container) can read the weights. safetensors' `save_file`
alone creates 0600. And one writer per output (`OutputLock`)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from flashdraft.drafter.checkpoint import save_drafter
from flashdraft.drafter.run_dir import save_best, save_checkpoint
from flashdraft.errors import FlashdraftError
from flashdraft.files import OutputLock, current_umask, write_atomic
from tests.conftest import make_drafter, save_target
from tests.data.conftest import run_cli, write_prompts


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("qwen3"), "qwen3")


def test_current_umask_reads_without_changing_it():
    with umask(0o027):
        assert current_umask() == 0o027
        assert current_umask() == 0o027  # reading it left it as it was


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_write_atomic_gives_the_umask_mode_even_when_the_writer_creates_the_file_private(tmp_path, mask, expected):
    def private_writer(tmp: Path) -> None:  # what safetensors' save_file does
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, b"x")
        os.close(fd)

    with umask(mask):
        write_atomic(tmp_path / "f", private_writer)
    assert mode(tmp_path / "f") == expected


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600)])
def test_saved_drafter_and_checkpoint_files_honour_the_umask(tmp_path, mask, expected):
    drafter = make_drafter()
    with umask(mask):
        out = save_drafter(drafter, tmp_path / "drafter")
        ckpt = save_checkpoint(tmp_path / "run", 1, drafter.config, drafter.state_dict(), {"step": 1}, keep=2)
        best = save_best(tmp_path / "run", 1, drafter.config, drafter.state_dict(), "tau", 1.0)
    files = [out / "model.safetensors", out / "config.json"]
    files += [p for p in sorted(ckpt.rglob("*")) + sorted(best.rglob("*")) if p.is_file()]
    assert {f.name for f in files} >= {
        "model.safetensors",
        "config.json",
        "trainer.pt",
        "checksums.json",
        "COMPLETE",
        "best.json",
    }
    assert {str(f.relative_to(tmp_path)): oct(mode(f)) for f in files} == {
        str(f.relative_to(tmp_path)): oct(expected) for f in files
    }


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600)])
def test_completions_cache_and_eval_files_honour_the_umask(qwen3_dir, tmp_path, mask, expected):
    drafter_dir = tmp_path / "drafter"
    save_drafter(make_drafter(), drafter_dir)
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    target, completions, cache = str(qwen3_dir), str(tmp_path / "c.json"), str(tmp_path / "cache")
    with umask(mask):
        assert (
            run_cli(
                [
                    "generate",
                    "--target-model",
                    target,
                    "--prompts",
                    str(prompts),
                    "--out",
                    completions,
                    "--max-new-tokens",
                    "4",
                ]
            )
            == 0
        )
        assert (
            run_cli(
                [
                    "cache",
                    "--target-model",
                    target,
                    "--completions",
                    completions,
                    "--out",
                    cache,
                    "--layers",
                    "0,2",
                    "--with-target-logits",
                    "2",
                ]
            )
            == 0
        )
        assert (
            run_cli(
                [
                    "eval",
                    "--checkpoint",
                    str(drafter_dir),
                    "--target-model",
                    target,
                    "--cached-hidden-states",
                    cache,
                    "--json",
                    str(tmp_path / "e.json"),
                ]
            )
            == 0
        )
    files = [tmp_path / "c.json", tmp_path / "e.json", *sorted((tmp_path / "cache").iterdir())]
    assert {f.name for f in files} >= {"manifest.json", "shard-00000.safetensors", "topk-00000.safetensors"}
    assert json.loads((tmp_path / "e.json").read_text())  # the eval really wrote its figures
    assert {f.name: oct(mode(f)) for f in files} == {f.name: oct(expected) for f in files}


# -- one writer per output ---------------------------------------------------------------------


def test_a_second_writer_of_an_output_is_refused_naming_the_holders_pid_host_and_lock(tmp_path):
    lock, out = tmp_path / "out.lock", tmp_path / "out"
    with OutputLock(lock, out, "flashdraft cache"):
        with pytest.raises(FlashdraftError) as refused:
            OutputLock(lock, out, "flashdraft cache")
    assert str(refused.value) == (
        f"{out}: another flashdraft cache (pid {os.getpid()} on host {socket.gethostname()}) "
        f"is writing it (lock {lock}); wait for it to finish, stop it, or use another --out"
    )
    assert not lock.exists()  # released: removed, so a finished output carries no lock file
    OutputLock(lock, out, "flashdraft cache").release()  # and free for the next writer


def test_the_lock_left_by_a_dead_writer_on_this_host_is_taken_over_with_a_message(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    lock, host = tmp_path / ".lock", socket.gethostname()
    lock.write_text(f"pid {dead.pid}\nhost {host}\n")  # what a killed writer leaves (the kernel dropped its flock)
    with OutputLock(lock, tmp_path, "flashdraft cache"):
        assert lock.read_text() == f"pid {os.getpid()}\nhost {host}\n"
    assert capsys.readouterr().out == (
        f"{tmp_path}: taking over the lock {lock} left by pid {dead.pid} on host {host} (no longer running)\n"
    )
