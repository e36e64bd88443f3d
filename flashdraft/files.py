"""Durable files: every file flashdraft writes is whole or absent after a crash, and can be
checked against a sha256 later (checkpoints, cache shards, manifests)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: a rename survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask. Linux reports it in /proc (a read, no change); elsewhere it is set
    and restored at once, the only portable way to read it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)` writes the content to a temporary name; it is fsynced and renamed onto
    `path`, so readers see the old file or the whole new one, never a part. The file gets
    the mode a plain `open` would give it (0666 less the umask): safetensors' `save_file`
    creates files 0600, which a server running as another user cannot read."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.chmod(tmp, 0o666 & ~current_umask())
    fsync_path(tmp)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any, indent: int = 2) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=indent) + "\n"))
