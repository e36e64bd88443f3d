"""Long-context prompts for the built-in target: long standard-library files cut so that a
drafter is measured (and trained) at contexts up to the target's 4,096 positions.

`builtin:long:heldout` (the evaluation set): each long file of the held-out split (the files the
built-in target never trained on, `data/stdlib.py`) is cut once, at the first line end past
HELD_OUT_LENGTHS[-1] tokens, and the same cut is continued after each of HELD_OUT_LENGTHS tokens
of context: the last whole lines before the cut holding at least that many tokens. Every length
bucket continues the same text, so τ by context compares the same continuations with more or
less of the file before them (the target's own continuation still changes with its context).

`builtin:long` (training data): files of the train split, cut at several points each; the
context before a cut takes the lengths of TRAIN_LENGTHS in turn, so a run trains anchors at every
context length the target can serve, short ones included.

Lengths are counted in the built-in target's tokens (its tokenizer.json, read as data); with
another tokenizer the same prompts hold other, still nested, lengths. Codec tables and pydoc's
data module are left out: they are tables, not code.
"""

from __future__ import annotations

import bisect
import hashlib
from functools import cache, lru_cache
from pathlib import Path

from flashdraft.data.stdlib import stdlib_files, stdlib_root

TOKENIZER = Path(__file__).parent.parent / "assets" / "tiny" / "tokenizer.json"
HELD_OUT_LENGTHS = (128, 512, 1024, 2048, 3584)  # 3,584 + 256 new tokens fit the target's 4,096
TRAIN_LENGTHS = (128, 256, 512, 1024, 1536, 2048, 2560, 3072, 3584)
TRAIN_CUTS_EVERY = 1500  # tokens between the cuts of one training file
LEFT_OUT = ("encodings/", "pydoc_data/")


@cache
def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


def _line_token_starts(text: str) -> tuple[list[int], list[int]]:
    """(character offset of each line start, tokens before it) of `text`."""
    lines = text.splitlines(keepends=True)
    char_starts, pos = [], 0
    for line in lines:
        char_starts.append(pos)
        pos += len(line)
    token_ends = [end for _, end in _tokenizer().encode(text).offsets]  # sorted: tokens follow the text
    return char_starts, [bisect.bisect_right(token_ends, c) for c in char_starts]


def _context_before(text: str, char_starts: list[int], tokens_at: list[int], cut: int, length: int) -> str | None:
    """The last whole lines before line `cut` that hold at least `length` tokens (None: not enough lines)."""
    first = None
    for line in range(cut - 1, -1, -1):
        if tokens_at[cut] - tokens_at[line] >= length:
            first = line
            break
    return None if first is None else text[char_starts[first] : char_starts[cut]]


def _usable(path: Path, root: Path) -> bool:
    rel = path.relative_to(root).as_posix()
    return not any(rel.startswith(p) or f"/{p}" in rel for p in LEFT_OUT)


def long_prompts(split: str) -> list[tuple[str, str]]:
    """(id, text) of the `heldout` or `train` long-context prompts, in a fixed order (held out: file by file, each
    file's lengths together; train: by a hash of the id); ids name the file, the cut's line and the context's
    length in tokens (`long/{file}:{line}/{tokens}`)."""
    train, held_out = stdlib_files()
    return list(_long_prompts(split, tuple(sorted(train if split == "train" else held_out)), stdlib_root()))


@lru_cache(maxsize=2)  # a process that asks again (a test suite, several prompt specs) tokenises the files once
def _long_prompts(split: str, files: tuple[Path, ...], root: Path) -> tuple[tuple[str, str], ...]:
    lengths = HELD_OUT_LENGTHS if split == "heldout" else TRAIN_LENGTHS
    out = []
    for path in files:
        if not _usable(path, root):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        char_starts, tokens_at = _line_token_starts(text)
        rel = path.relative_to(root).as_posix()
        if split == "heldout":  # one cut, past the longest context
            cuts = [next((i for i, t in enumerate(tokens_at) if t >= lengths[-1]), None)]
        else:  # a cut every TRAIN_CUTS_EVERY tokens, from where the shortest context fits
            cuts, next_at = [], lengths[0]
            for i, t in enumerate(tokens_at):
                if t >= next_at:
                    cuts.append(i)
                    next_at = t + TRAIN_CUTS_EVERY
        for n, cut in enumerate(c for c in cuts if c is not None):
            if split == "heldout":
                chosen = lengths
            else:  # the lengths that fit before the cut in turn, from an offset fixed by the file's name
                fitting = [length for length in lengths if length <= tokens_at[cut]]
                offset = hashlib.sha256(rel.encode()).digest()[0]
                chosen = (fitting[(offset + n) % len(fitting)],)
            for length in chosen:
                context = _context_before(text, char_starts, tokens_at, cut, length)
                if context is not None and context.strip():
                    out.append((f"long/{rel}:{cut + 1}/{length}", context))
    if split == "train":  # hash order: the first N spread over many files (held out: file by file, all lengths)
        out.sort(key=lambda row: hashlib.sha256(row[0].encode()).digest())
    return tuple(out)
