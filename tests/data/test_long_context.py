"""The long-context prompt sets of the built-in target."""

import flashdraft.data.long_context as long_context
from flashdraft.data.long_context import HELD_OUT_LENGTHS, TRAIN_LENGTHS, long_prompts
from flashdraft.data.prompts import load_prompts
from flashdraft.data.stdlib import stdlib_files, stdlib_root


def tokens(text: str) -> int:
    return len(long_context._tokenizer().encode(text).ids)


def test_every_held_out_file_continues_one_cut_after_each_context_length():
    prompts = long_prompts("heldout")
    by_cut: dict[str, list[tuple[int, str]]] = {}
    for pid, text in prompts:
        cut, length = pid.rsplit("/", 1)
        by_cut.setdefault(cut, []).append((int(length), text))
    assert len(by_cut) >= 12 and len(prompts) == len(by_cut) * len(HELD_OUT_LENGTHS)
    for cut, rows in by_cut.items():
        assert [length for length, _ in rows] == list(HELD_OUT_LENGTHS), cut
        for (length, text), (_, longer) in zip(rows, rows[1:] + [rows[-1]], strict=True):
            assert longer.endswith(text), cut  # the same text before the same cut, more of it
            assert length <= tokens(text) < length + 64, (cut, length)  # whole lines: a few tokens over


def test_held_out_long_prompts_come_only_from_files_the_target_never_trained_on():
    train, _ = stdlib_files()
    train_files = {p.relative_to(stdlib_root()).as_posix() for p in train}
    held_files = {pid.split(":")[0].removeprefix("long/") for pid, _ in long_prompts("heldout")}
    assert held_files and not held_files & train_files


def test_training_cuts_spread_over_every_context_length(monkeypatch):
    train, held_out = stdlib_files()
    some = sorted(train, key=lambda p: -p.stat().st_size)[:40]  # a few long files keep the test fast
    monkeypatch.setattr(long_context, "stdlib_files", lambda: (some, held_out))
    prompts = long_prompts("train")
    lengths = {int(pid.rsplit("/", 1)[1]) for pid, _ in prompts}
    assert lengths == set(TRAIN_LENGTHS) and len({pid for pid, _ in prompts}) == len(prompts)


def test_builtin_long_specs_load_as_prompts():
    prompts = load_prompts("builtin:long:heldout:10", quiet=True)
    assert len(prompts) == 10 and prompts[0].id.startswith("long/") and prompts[0].turns[0]
