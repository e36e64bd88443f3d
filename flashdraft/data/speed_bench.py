"""NVIDIA's SPEED-Bench as users hold it, read as prompts: `speed-bench:PATH[:SPLIT[:CATEGORY[+CATEGORY...]]]`.

The data cannot be shipped (NVIDIA's evaluation licence; several sources are fetched by the user), so it is read
where the peers' prepare steps wrote it, in either layout:

- NeMo-Skills' `prepare.py`: `qualitative.jsonl` and `throughput_{1k,2k,8k,16k,32k}.jsonl` in one directory, each
  row `question_id`, `category`, `sub_category`, `source`, `src_id`, `difficulty`, `multiturn` and `messages` (the
  user turns only);
- Model Optimizer's `specdec_bench`: `data/speed/<config>/test.parquet`, each row keeping the dataset's `turns` (a
  list of strings).

PATH is the directory (either layout; SPLIT chooses the file, `qualitative` when not given) or one split's file.
Each row is one request whose user turns are answered in order, each after the target's own answer to the turn
before (Model Optimizer's and aiperf's way; `vllm bench serve` sends the first turn only, which the reports give
beside). Its `category`, as the dataset holds it (neither prepare step writes or renames it; on the throughput
splits the dataset's description makes it the entropy tier), and the split travel with the prompt (`Prompt.meta`)
so the evaluation reports figures per category.

Refused, one line each (exit 2): rows still holding the placeholder of a source that was not fetched (counted, with
the command that fetches them; they are never evaluated as text), a row without a `category`, a split or category
the data does not have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.errors import FlashdraftError
from flashdraft.files import read_jsonl

PREFIX = "speed-bench:"
SPEC = "speed-bench:PATH[:SPLIT[:CATEGORY[+CATEGORY...]]]"
# categories are joined with '+' (bench's --prompts separates prompt sets with commas); ',' is still read where
# --prompts holds one spec (generate, eval)
CATEGORY_SEPARATORS = "+,"
QUALITATIVE = "qualitative"
SPLITS = (QUALITATIVE, "throughput_1k", "throughput_2k", "throughput_8k", "throughput_16k", "throughput_32k")
CATEGORIES = (
    "coding",
    "humanities",
    "math",
    "multilingual",
    "qa",
    "rag",
    "reasoning",
    "roleplay",
    "stem",
    "summarization",
    "writing",
)
ENTROPY_TIERS = ("low_entropy", "mixed", "high_entropy")
# what a row holds in place of a source's text when the user has not fetched it (aiperf refuses such rows too)
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"


def fetch_command(split: str) -> str:
    """The peers' commands that fetch every source of `split` and write it in their layout (as their code does:
    NeMo-Skills' `nemo_skills/dataset/speed-bench/prepare.py`, which `ns prepare_data` runs with its extra
    arguments; Model Optimizer's `examples/specdec_bench/prepare_data.py`)."""
    return (
        f"NeMo-Skills' `ns prepare_data speed-bench --config {split}` (writes {split}.jsonl) or, in Model "
        f"Optimizer's examples/specdec_bench, `python3 prepare_data.py --dataset speed --config {split}` (writes "
        f"data/speed/{split}/test.parquet)"
    )


META_FIELDS = ("category", "sub_category", "source", "src_id", "difficulty", "multiturn")


def is_speed_bench(spec: str) -> bool:
    return spec.startswith(PREFIX)


def input_length(split: str) -> str | None:
    """A throughput split's nominal input length ('1k' of `throughput_1k`); None for the qualitative split."""
    return split.removeprefix("throughput_") if split.startswith("throughput_") else None


def parse_spec(spec: str) -> tuple[Path, str | None, list[str] | None]:
    """(path, split or None, categories or None) of `speed-bench:PATH[:SPLIT[:CATEGORY+...]]`."""
    parts = spec[len(PREFIX) :].split(":")
    if not parts[0] or len(parts) > 3:
        raise FlashdraftError(
            f"--prompts {spec}: expected {SPEC}, e.g. speed-bench:data/speed-bench:qualitative:math+coding"
        )
    split = parts[1] if len(parts) > 1 and parts[1] else None
    categories = None
    if len(parts) > 2:
        named = parts[2].replace(",", "+").split("+")
        categories = list(dict.fromkeys(c.strip() for c in named if c.strip()))
    if categories is not None and not categories:
        raise FlashdraftError(f"--prompts {spec}: no category after the split; expected {SPEC}")
    return Path(parts[0]), split, categories


def split_file(spec: str, path: Path, split: str | None) -> tuple[Path, str]:
    """The file holding `split` under `path` (either layout), and the split's name."""
    if not path.exists():
        raise FlashdraftError(f"--prompts {spec}: {path}: no such file or directory; expected a prepared SPEED-Bench")
    if path.is_file():
        name = path.stem if path.suffix == ".jsonl" else path.parent.name
        if path.suffix not in (".jsonl", ".parquet"):
            raise FlashdraftError(f"--prompts {spec}: {path} is a {path.suffix!r} file; expected .jsonl or .parquet")
        if split is not None and split != name:
            raise FlashdraftError(f"--prompts {spec}: {path} is the split {name!r}, not {split!r}; give the directory")
        return path, name
    if (path / "test.parquet").is_file():  # one split's directory, as Model Optimizer's --dataset_path names it
        return split_file(spec, path / "test.parquet", split)
    split = split or QUALITATIVE
    candidates = [
        path / f"{split}.jsonl",  # NeMo-Skills
        path / "data" / "speed" / split / "test.parquet",  # Model Optimizer's repository root
        path / "speed" / split / "test.parquet",
        path / split / "test.parquet",  # its data/speed directory
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate, split
    found = sorted(_splits_in(path))
    raise FlashdraftError(
        f"--prompts {spec}: no split {split!r} in {path} (looked for {split}.jsonl and "
        f"data/speed/{split}/test.parquet); "
        f"found {', '.join(found) if found else 'no split'}; expected one of {', '.join(SPLITS)}"
    )


def _splits_in(path: Path) -> set[str]:
    found = {p.stem for p in path.glob("*.jsonl")}
    for root in (path / "data" / "speed", path / "speed", path):
        found |= {p.parent.name for p in root.glob("*/test.parquet")}
    return found


@dataclass
class Request:
    """One row: its id, the system messages before its first turn, its user turns, its labels (category, split)."""

    id: str
    prefix: list[dict[str, Any]]
    turns: list[str]
    meta: dict[str, Any]


def speed_bench_requests(spec: str) -> tuple[list[Request], str]:
    """The requests of a SPEED-Bench spec and a description of the source (`data.prompts.load_prompts` makes them
    prompts)."""
    path, split, wanted = parse_spec(spec)
    file, split = split_file(spec, path, split)
    rows = _read_rows(file)
    placeholders = [loc for loc, row in rows if any(PLACEHOLDER in t for t in _texts(row))]
    if placeholders:
        raise FlashdraftError(
            f"{file}: {len(placeholders)} of {len(rows)} rows hold the placeholder {PLACEHOLDER!r} (their source was "
            f"not fetched; first: {placeholders[0]}); fetch them with {fetch_command(split)}, then read what it writes"
        )
    requests, seen = [], {}
    for index, (loc, row) in enumerate(rows):
        category = row.get("category")
        if not isinstance(category, str) or not category:
            raise FlashdraftError(
                f"{loc}: field 'category' is {category!r}; expected a SPEED-Bench category "
                f"({', '.join(CATEGORIES)}; on the throughput splits {', '.join(ENTROPY_TIERS)})"
            )
        raw_id = row.get("question_id", row.get("id"))
        pid = str(raw_id) if raw_id is not None else f"p{index:06d}"
        if pid in seen:
            raise FlashdraftError(f"{loc}: question_id {pid!r} repeats the id of {seen[pid]}; ids must be unique")
        seen[pid] = loc
        meta = {k: row[k] for k in META_FIELDS if row.get(k) is not None} | {"split": split}
        requests.append(Request(pid, *_turns(row, loc), meta))
    present = sorted({r.meta["category"] for r in requests})
    if wanted is not None:
        unknown = [c for c in wanted if c not in present]
        if unknown:
            raise FlashdraftError(
                f"--prompts {spec}: no category {', '.join(map(repr, unknown))} in {file}; found {', '.join(present)}"
            )
        requests = [r for r in requests if r.meta["category"] in wanted]
    chosen = f", categories {','.join(wanted)}" if wanted else f", {len(present)} categories"
    return requests, f"SPEED-Bench {split} ({file}{chosen})"


def _read_rows(file: Path) -> list[tuple[str, dict[str, Any]]]:
    """(location, row) of every row of a split's file: JSON lines, or a Parquet table (read with pyarrow: no code
    runs)."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(file)
        except Exception as e:  # pyarrow raises several types; name the file and the cause
            raise FlashdraftError(f"{file}: cannot read as Parquet ({type(e).__name__}: {e})") from None
        return [(f"{file} row {k}", row) for k, row in enumerate(table.to_pylist())]
    return list(read_jsonl(file))


def _texts(row: dict[str, Any]) -> list[str]:
    turns = row.get("turns") if row.get("turns") is not None else row.get("messages") or []
    return [t if isinstance(t, str) else str(t.get("content", "")) if isinstance(t, dict) else "" for t in turns]


def _turns(row: dict[str, Any], loc: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(system messages before the first turn, the user turns) of a row: `turns` (Model Optimizer) or `messages`
    (NeMo-Skills, user turns only; an assistant message in it is the dataset's, which the target answers anew)."""
    if row.get("turns") is not None:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise FlashdraftError(f"{loc}: field 'turns' is {str(turns)[:80]}; expected a list of non-empty strings")
        return [], list(turns)
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FlashdraftError(
            f"{loc}: no 'messages' (NeMo-Skills) or 'turns' (Model Optimizer) field (found {sorted(row)}); expected "
            f"one of them"
        )
    prefix, turns = [], []
    for k, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role == "system" and not turns and isinstance(content, str):
            prefix.append({"role": "system", "content": content})
        elif role == "user" and isinstance(content, str) and content:
            turns.append(content)
        elif role != "assistant":
            raise FlashdraftError(
                f"{loc}: messages[{k}] is {str(m)[:80]}; expected {{'role': 'user', 'content': a non-empty string}}"
            )
    if not turns:
        raise FlashdraftError(f"{loc}: field 'messages' has no user turn; expected at least one")
    return prefix, turns


def per_category_specs(spec: str) -> list[str]:
    """A SPEED-Bench spec as one spec per category it names, or without categories per category it holds (on a
    throughput split: per entropy tier), so a served run measures each apart, as the servers' counters count a
    whole run. `bench` runs each as a prompt set."""
    path, split, wanted = parse_spec(spec)
    requests, _ = speed_bench_requests(spec)  # refuses a category the split does not hold
    named = split if split is not None and path.is_dir() else ""
    categories = wanted if wanted is not None else sorted({r.meta["category"] for r in requests})
    return [f"{PREFIX}{path}:{named}:{c}" for c in categories]


def misread_category(previous: str, piece: str) -> str | None:
    """Why `piece`, following the prompt set `previous` in a comma-separated list (`bench --prompts`), is a
    SPEED-Bench category cut from it rather than a prompt set of its own, or None: a bare category name right after
    a spec that names categories."""
    if not is_speed_bench(previous) or previous.count(":") < 3 or ":" in piece or "/" in piece:
        return None
    if piece not in CATEGORIES + ENTROPY_TIERS or Path(piece).exists():
        return None
    return (
        f"{piece!r} after {previous!r} reads as a prompt set of its own (commas separate prompt sets); join "
        f"SPEED-Bench categories with '+': {previous}+{piece}"
    )


def labels(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """A request's split, input length (throughput splits) and category, as bench reports them."""
    if not meta:
        return None
    split = meta.get("split", "")
    return {"split": split, "input_length": input_length(split), "category": meta.get("category")}
