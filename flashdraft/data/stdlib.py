"""The built-in prompt source at scale: windows of the running interpreter's own standard
library `.py` files (`builtin:stdlib`), which every machine has.

Files are split into train and held-out by a hash of their path relative to the stdlib
root, the same split the built-in `tiny` target was trained on (scripts/train_tiny_target.py
imports `stdlib_files` from here), so no `builtin:stdlib` prompt comes from a file the
target held out, and `builtin:stdlib:heldout` prompts come only from those files.

A prompt is a window of `WINDOW_LINES` consecutive lines that starts at a top-level or
indented statement every `STRIDE_LINES` lines; the target continues it. Windows are ordered
by a hash of their id (a text repeated in another file is kept once), so the first N
(`builtin:stdlib:N`) spread over many files, and the
order is the same on every machine with the same Python version (the standard library's
text differs between versions; prompt ids name the file and line, so a record is traceable).
Windows that share a line with the `builtin:code` prompts are left out, so
`builtin:code:heldout` stays disjoint from any stdlib prompt.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

WINDOW_LINES = 24  # about 150-250 tokens of `tiny`: room for 256 new tokens in short contexts
STRIDE_LINES = 40  # windows do not overlap: every prompt is distinct text
MIN_CHARS = 300  # windows that are mostly blank or a few short lines carry little context
MAX_CHARS = 2000  # a window of very long lines (data tables, long strings) is skipped
HELD_OUT_HASH_BELOW = 8  # first byte of sha256(path) < 8: about 3 % of files are held out
SHARED_LINE_MIN_CHARS = 12  # lines shorter than this ('return x', 'else:') are not "shared text"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """All standard-library .py files (no site-packages), split about 97/3 by path hash."""
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, held_out = [], []
    for p in files:
        digest = hashlib.sha256(str(p.relative_to(root)).encode()).digest()[0]
        (held_out if digest < HELD_OUT_HASH_BELOW else train).append(p)
    return train, held_out


def _windows(path: Path, root: Path) -> list[tuple[str, str]]:
    """(id, text) of every usable window of one file."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    rel = path.relative_to(root).as_posix()
    out = []
    for start in range(0, max(len(lines) - WINDOW_LINES, 0) + 1, STRIDE_LINES):
        window = lines[start : start + WINDOW_LINES]
        text = "".join(window)
        if not window or not window[0].strip() or not (MIN_CHARS <= len(text) <= MAX_CHARS):
            continue
        if not text.endswith("\n"):
            text += "\n"
        out.append((f"stdlib/{rel}:{start + 1}", text))
    return out


def _shares_line(text: str, avoided: set[str]) -> bool:
    return any(line.strip() in avoided for line in text.splitlines())


def stdlib_prompts(split: str, avoid_texts: list[str] = ()) -> list[tuple[str, str]]:
    """(id, text) of every window of the `train` or `heldout` files, in hash order, leaving
    out windows that share a line of at least SHARED_LINE_MIN_CHARS characters with any of
    `avoid_texts`."""
    train, held_out = stdlib_files()
    files = train if split == "train" else held_out
    root = stdlib_root()
    avoided = {
        line.strip() for t in avoid_texts for line in t.splitlines() if len(line.strip()) >= SHARED_LINE_MIN_CHARS
    }
    windows = [w for p in files for w in _windows(p, root) if not _shares_line(w[1], avoided)]
    windows.sort(key=lambda w: hashlib.sha256(w[0].encode()).digest())
    first_id: dict[str, str] = {}  # some files repeat others (test data, vendored copies): one prompt per text
    for pid, text in windows:
        first_id.setdefault(text, pid)
    return [(pid, text) for text, pid in first_id.items()]
