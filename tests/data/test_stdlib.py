from flashdraft.data.prompts import load_prompts
from flashdraft.data.stdlib import SHARED_LINE_MIN_CHARS, stdlib_files, stdlib_prompts, stdlib_root


def test_split_by_path_hash_is_disjoint_and_about_3_percent_held_out():
    train, held_out = stdlib_files()
    assert not set(train) & set(held_out)
    assert 0.01 < len(held_out) / (len(train) + len(held_out)) < 0.06
    assert all("site-packages" not in p.parts for p in train + held_out)


def test_stdlib_prompts_are_deterministic_thousands_and_come_only_from_their_split():
    first, again = stdlib_prompts("train"), stdlib_prompts("train")
    assert first == again and len(first) >= 5000
    assert len({pid for pid, _ in first}) == len(first) and len({text for _, text in first}) == len(first)
    train, held_out = stdlib_files()
    held_names = {p.relative_to(stdlib_root()).as_posix() for p in held_out}
    held = stdlib_prompts("heldout")
    assert held and all(pid.split("/", 1)[1].rsplit(":", 1)[0] in held_names for pid, _ in held)
    assert not any(pid.split("/", 1)[1].rsplit(":", 1)[0] in held_names for pid, _ in first)
    # the first windows spread over many files (hash order), so builtin:stdlib:N is a sample, not a few files
    assert len({pid.rsplit(":", 1)[0] for pid, _ in first[:200]}) > 150


def test_builtin_stdlib_spec_gives_the_first_n_and_shares_no_line_with_builtin_code_prompts():
    some = load_prompts("builtin:stdlib:50", quiet=True)
    assert len(some) == 50
    everything = load_prompts("builtin:stdlib", quiet=True)
    assert [p.id for p in everything[:50]] == [p.id for p in some]
    code = load_prompts("builtin:code", quiet=True) + load_prompts("builtin:code:heldout", quiet=True)
    code_lines = {line.strip() for p in code for line in p.turns[0].splitlines()}
    code_lines = {line for line in code_lines if len(line) >= SHARED_LINE_MIN_CHARS}
    for p in everything + load_prompts("builtin:stdlib:heldout", quiet=True):
        assert not {line.strip() for line in p.turns[0].splitlines()} & code_lines, p.id
