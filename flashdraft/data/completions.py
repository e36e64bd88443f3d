"""The completions file (`flashdraft generate`'s output): its format, records and loader.

A completions file is one JSON object: a header (format, version, target fingerprint,
generation settings, where the token ids came from) and `records`, one per answered user
turn, written one record per line (see docs/data-formats.md). It is written by
`data/completions_writer.py` (resumable, per-rank part files merged at the end) from the answers of
`data/completers.py` (the target locally in batches, or an OpenAI-compatible server).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flashdraft.data.chat_mode import (
    check_reasoning_end,
)
from flashdraft.data.reasoning import check_tool_call_spans
from flashdraft.decoding.serving_rules import SamplingFilters, SamplingParams
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel

FORMAT = "flashdraft.completions"
VERSION = 1
STOP_REASONS = ("eos", "length")
TOKEN_SOURCES = ("target", "server", "retokenized")


@dataclass(frozen=True)
class GenerationSettings:
    """Everything that decides the completions; a resumed run must use the same."""

    prompts: str
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    chat_template: bool = False  # whether the tokenizer's chat template was applied
    chat_template_kwargs: dict[str, Any] | None = None  # the run's (a prompt row's own over them); None: defaults
    backend: str = "local"  # "local", "openai" (a server given by its URL) or "vllm" (a server this run started)
    base_url: str | None = None
    server_model: str | None = None
    long_prompts: str = "error"  # prompts longer than the context minus max_new_tokens: error, skip, truncate
    # turns whose prompt has fewer tokens are left out (selects long-context rows from any dataset); a
    # multi-turn prompt's short turns are still answered when a later turn needs their answer as context
    min_prompt_tokens: int = 0
    # T > 0: the filters applied to the target's p, in vLLM's order (`serving_rules.target_probs`); None: off
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    engine_version: str | None = None  # backend "vllm": the engine's distribution and version

    @property
    def sampling(self) -> SamplingParams:
        """The sampling the target's completions are drawn with (each record's draws from `record_seed`)."""
        return SamplingParams(self.temperature, SamplingFilters(self.top_k, self.top_p, self.min_p), self.seed)


# settings a resumed run may change: they decide nothing about records that fit the context
# (a truncated record says so itself, in `prompt_truncated_from`)
RESUMABLE_CHANGES = {"long_prompts"}


@dataclass
class CompletionRecord:
    id: str
    prompt: str  # the rendered text the target saw (chat template applied where used)
    prompt_ids: list[int]
    completion_ids: list[int]  # generated tokens, ending with the stop token when stop_reason is "eos"
    completion: str  # completion_ids decoded without special tokens
    stop_reason: str  # "eos" or "length"
    token_source: str = "target"  # "target" (local), "server" (ids returned) or "retokenized" (text re-encoded)
    prompt_truncated_from: int | None = None  # the prompt's token count before --long-prompts truncate
    # with a chat template (`data/chat_mode.py`): the messages rendered, the kwargs and the template's hash
    messages: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # {}: the template's defaults
    chat_template_sha256: str | None = None
    reasoning_end: int | str | None = None  # index of the completion's `</think>`, "not closed", None: no reasoning
    tools: list[dict[str, Any]] | None = None  # the row's tool schemas, rendered with its messages
    # [start, end) spans of completion_ids inside tool calls, where the template's markers are known (Qwen3's
    # <tool_call>, gpt-oss's commentary channel) and the completion calls a tool
    tool_call_spans: list[list[int]] | None = None
    # a benchmark row's labels (SPEED-Bench, `data/speed_bench.py`): its category, sub_category, split, ...,
    # `question_id` (the request) and `turn` (0: its first), so evaluations from this file report by category
    meta: dict[str, Any] | None = None


OPTIONAL_FIELDS = (
    "prompt_truncated_from",
    "messages",
    "chat_template_kwargs",
    "chat_template_sha256",
    "reasoning_end",
    "tools",
    "tool_call_spans",
    "meta",
)


def record_json(record: CompletionRecord) -> str:
    """One record as a line of the completions file (the optional fields only where set)."""
    row = asdict(record)
    for name in OPTIONAL_FIELDS:
        if row[name] is None:
            del row[name]
    return json.dumps(row, ensure_ascii=False)


@dataclass
class Completions:
    path: Path
    header: dict[str, Any]
    records: list[CompletionRecord]
    skipped: list[tuple[str, str]]  # (record id, why it was skipped)

    @property
    def target_fingerprint(self) -> str:
        return self.header["target"]["fingerprint"]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def __getitem__(self, i):  # an index or a slice, as on the records list
        return self.records[i]


def record_seed(seed: int, record_id: str) -> int:
    """A per-record sampling seed, so sampled outputs do not depend on batching or ranks."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{record_id}".encode()).digest()[:4], "little")


def make_header(target: TargetModel, settings: GenerationSettings) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "target": {
            "fingerprint": target.fingerprint(),
            "path": str(target.path) if target.path is not None else None,
            "vocab_size": target.vocab_size,
        },
        "generation": asdict(settings),
    }


def part_paths(out: Path) -> list[Path]:
    """The per-rank part files of an unfinished (or unmerged) generate run writing `out`."""
    return sorted(out.parent.glob(out.name + ".part*.jsonl"))


def record_problem(r: Any, vocab_size: int) -> str | None:
    """Why a record is unusable, or None if it is fine."""
    if not isinstance(r, dict):
        return f"not an object ({type(r).__name__})"
    for name, kind in (
        ("id", str),
        ("prompt", str),
        ("prompt_ids", list),
        ("completion_ids", list),
        ("completion", str),
        ("stop_reason", str),
    ):
        if not isinstance(r.get(name), kind):
            return f"field '{name}' is {type(r.get(name)).__name__}; expected {kind.__name__}"
    if not r["prompt_ids"]:
        return "empty prompt_ids"
    if not r["completion_ids"]:
        return "empty completion"
    for name in ("prompt_ids", "completion_ids"):
        bad = [t for t in r[name] if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            return f"{name} has {len(bad)} ids outside the vocabulary 0..{vocab_size - 1} (first: {bad[0]!r})"
    if r["stop_reason"] not in STOP_REASONS:
        return f"stop_reason is {r['stop_reason']!r}; expected one of {', '.join(STOP_REASONS)}"
    if r.get("token_source", "target") not in TOKEN_SOURCES:
        return f"token_source is {r.get('token_source')!r}; expected one of {', '.join(TOKEN_SOURCES)}"
    if r.get("chat_template_kwargs") is not None and not isinstance(r["chat_template_kwargs"], dict):
        return f"chat_template_kwargs is {type(r['chat_template_kwargs']).__name__}; expected an object"
    if r.get("meta") is not None:
        problem = meta_problem(r["meta"])
        if problem:
            return problem
    return check_reasoning_end(r.get("reasoning_end"), len(r["completion_ids"])) or check_tool_call_spans(
        r.get("tool_call_spans"), len(r["completion_ids"])
    )


def request_meta(meta: dict[str, Any] | None, question_id: str, turn: int) -> dict[str, Any] | None:
    """A record's `meta`: its benchmark row's labels with the request it belongs to and which turn it is (None: a
    prompt of no benchmark)."""
    return None if meta is None else {**meta, "question_id": question_id, "turn": turn}


def meta_problem(meta: Any) -> str | None:
    """Why a record's `meta` (a completions record's, a cache record's) is unusable, or None."""
    if not isinstance(meta, dict):
        return f"field 'meta' is {type(meta).__name__}; expected an object"
    for name, kind in (("category", str), ("split", str), ("question_id", str)):
        if name in meta and not isinstance(meta[name], kind):
            return f"field 'meta.{name}' is {meta[name]!r}; expected a string"
    turn = meta.get("turn", 0)
    if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
        return f"field 'meta.turn' is {turn!r}; expected an integer >= 0"
    return None


def _read_json(path: Path) -> Any:
    """The file's JSON, or one line saying why there is none (a run not merged yet, not a file, cut short)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        if part_paths(path):  # a generate run was killed before it merged its records
            raise FlashdraftError(
                f"{path}: not written yet, but {part_paths(path)[0].name} exists (an unfinished flashdraft "
                f"generate run); re-run the same generate command to finish it"
            ) from None
        raise FlashdraftError(f"{path}: no such completions file; make one with flashdraft generate") from None
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise FlashdraftError(f"{path}: not a completions file ({type(e).__name__}); expected a JSON file") from None
    if not text.strip():
        raise FlashdraftError(f"{path}: empty file; expected a completions file from flashdraft generate")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise FlashdraftError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); was it cut short?") from None
    return data


def header_problems(data: Any) -> list[str]:
    """What makes a completions file's header (or a part file's header line) unusable, first the one that makes it
    no completions file at all; [] when it is fine. The loader, the resumable writer and the doctor all read it."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        return [f"field 'format' is {found!r}; expected {FORMAT!r} (a flashdraft completions file)"]
    problems = []
    if data.get("version") != VERSION:
        problems.append(f"field 'version' is {data.get('version')!r}; expected {VERSION}")
    if not isinstance(data.get("target"), dict):
        problems.append(f"field 'target' is {data.get('target')!r}; expected an object with fingerprint and vocab_size")
    return problems


def load_completions(
    path: str | Path, target: TargetModel | None = None, allow_foreign: bool = False, quiet: bool = False
) -> Completions:
    """Read and validate a completions file. Prints how many records are valid and why each
    invalid one was skipped. With a target: a file made by another target (fingerprint) is
    refused unless allow_foreign, and token ids are checked against its vocabulary."""
    path = Path(path)
    data = _read_json(path)
    problems = header_problems(data)
    if problems:
        raise FlashdraftError(f"{path}: {problems[0]}")
    header = {k: v for k, v in data.items() if k != "records"}
    fingerprint = header["target"].get("fingerprint")
    vocab_size = header["target"].get("vocab_size")
    if target is not None:
        vocab_size = target.vocab_size
        if fingerprint != target.fingerprint():
            if not allow_foreign:
                raise FlashdraftError(
                    f"{path}: made by target fingerprint {fingerprint}, but {target.path} has fingerprint "
                    f"{target.fingerprint()} (another model, or other weights); completions must come from the "
                    f"target itself (pass --allow-foreign-completions to use them anyway)"
                )
            if not quiet:
                print(f"{path}: made by another target ({fingerprint}); used anyway (--allow-foreign-completions)")
    if not isinstance(vocab_size, int):
        raise FlashdraftError(f"{path}: field 'target.vocab_size' is {vocab_size!r}; expected an integer")
    raw = data.get("records")
    if not isinstance(raw, list):
        raise FlashdraftError(f"{path}: field 'records' is {type(raw).__name__}; expected a list")
    records, skipped, seen = [], [], set()
    for k, r in enumerate(raw):
        problem = record_problem(r, vocab_size)
        rid = r.get("id") if isinstance(r, dict) and isinstance(r.get("id"), str) else f"#{k}"
        if problem is None and rid in seen:
            problem = "duplicate id"
        if problem is not None:
            skipped.append((rid, problem))
            continue
        seen.add(rid)
        fields = {
            name: r[name] for name in ("id", "prompt", "prompt_ids", "completion_ids", "completion", "stop_reason")
        }
        records.append(
            CompletionRecord(
                **fields,
                token_source=r.get("token_source", "target"),
                **{name: r.get(name) for name in OPTIONAL_FIELDS},
            )
        )
    if not quiet:
        print(f"{path}: {len(records)} of {len(raw)} records valid")
        for rid, problem in skipped:
            print(f"  skipped {rid}: {problem}")
    if not records:
        raise FlashdraftError(f"{path}: no valid records (of {len(raw)})")
    return Completions(path, header, records, skipped)
