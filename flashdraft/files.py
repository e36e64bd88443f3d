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


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)` writes the content to a temporary name; it is fsynced and renamed onto
    `path`, so readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    fsync_path(tmp)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any, indent: int = 2) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=indent) + "\n"))
