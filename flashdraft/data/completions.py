"""The target's own completions of a prompt set (`flashdraft generate`; the command's run is `data/generate.py`), and
their loader.

A completions file is one JSON object: a header (format, version, target fingerprint,
generation settings, where the token ids came from) and `records`, one per answered user
turn, written one record per line (see docs/data-formats.md).

Resumable: each rank appends finished records to `OUT.part{rank}.jsonl` (header line
first, flushed and fsynced per batch); a re-run reads OUT and every part, skips prompts
already answered, and at the end rank 0 merges everything into OUT through a temporary
file and `os.replace`, so OUT is never half written and no record appears twice.

Generation runs the target locally in batches (left padding with an attention mask;
greedy output equals `flashdraft.decoding.generate.autoregressive_generate` token for token), or calls an
OpenAI-compatible server (vLLM, SGLang) with the prompt's token ids.

The module is over 600 lines because it is the one owner of the completions format (docs/design.md): its records,
their generation and resumable writing, and their loader.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.data.chat_mode import (
    check_reasoning_end,
    merged,
    mode_mix,
    reasoning_end,
    reasoning_markers,
    template_sha256,
)
from flashdraft.data.openai_client import OpenAIClient
from flashdraft.data.prompts import (
    Prompt,
    describe_long_prompts,
    encode_text,
    fit_prompt,
    prompt_token_limit,
    render_conversation,
)
from flashdraft.decoding.serving_rules import NO_FILTERS, SamplingFilters, target_probs
from flashdraft.distributed import Dist, any_rank
from flashdraft.errors import FlashdraftError, Interrupted
from flashdraft.files import DiskFullError, append_whole, write_text_atomic
from flashdraft.progress import Progress as tqdm  # plain lines in logs; the name the generation loop uses
from flashdraft.stop import StopRequests
from flashdraft.target.model import TargetModel

FORMAT = "flashdraft.completions"
VERSION = 1
STOP_REASONS = ("eos", "length")
TOKEN_SOURCES = ("target", "server", "retokenized")


@dataclass
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


OPTIONAL_FIELDS = ("prompt_truncated_from", "messages", "chat_template_kwargs", "chat_template_sha256", "reasoning_end")


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


# -- local batched generation -----------------------------------------------------------


@torch.no_grad()
def generate_batch(
    target: TargetModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    generators: list[torch.Generator] | None = None,
    filters: SamplingFilters = NO_FILTERS,
) -> list[tuple[list[int], str]]:
    """Decode every prompt with the target's cache (at temperature > 0 sampled from the target's p with `filters`,
    as the servers sample); returns (completion ids, stop reason) each.

    Prompts are left-padded to one width; the attention mask hides the padding and position
    ids count only real tokens, so each row decodes as it would alone. Rows that stopped
    keep being fed (their output is frozen) until every row has stopped.
    """
    from transformers import DynamicCache

    device, n = target.device, len(prompts)
    width = max(len(p) for p in prompts)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    ids = torch.full((n, width), pad, dtype=torch.long, device=device)  # [N, W]
    mask = torch.zeros((n, width), dtype=torch.long, device=device)  # [N, W]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, W]
    padded = bool((mask == 0).any())
    stop_ids = set(target.stop_token_ids)
    cache = DynamicCache(config=target.config)
    outputs: list[list[int]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    for _ in range(max_new_tokens):
        logits = target.model(
            input_ids=ids,
            attention_mask=mask if padded else None,  # no mask without padding: the same kernels as one prompt
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the prompt's other positions need no [W, V] logits
        ).logits[:, -1]  # [N, V]
        if temperature <= 0:
            tokens = logits.argmax(-1).tolist()
        else:
            probs = target_probs(logits, temperature, filters)  # [N, V]
            tokens = [int(torch.multinomial(probs[i], 1, generator=generators[i])) for i in range(n)]
        for i, token in enumerate(tokens):
            if reasons[i] == "length" and len(outputs[i]) < max_new_tokens:
                outputs[i].append(token)
                if token in stop_ids:
                    reasons[i] = "eos"
        if all(r == "eos" for r in reasons):
            break
        ids = torch.tensor(tokens, device=device)[:, None]  # [N, 1]
        mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
        positions = positions[:, -1:] + 1
    return list(zip(outputs, reasons, strict=True))


def _answer_turns(
    target: TargetModel,
    batch: list[Prompt],
    settings: GenerationSettings,
    complete: Callable[[list[tuple[str, list[int]]]], list[tuple[list[int], str, str]]],
    long_prompt_stats: dict[str, int] | None = None,
    check_render: Callable[[str, list, dict, list[int]], None] | None = None,
) -> list[CompletionRecord]:
    """Answer every turn of every prompt in the batch: turn k of all prompts that have it is
    one call of `complete` ([(record id, prompt ids)] -> [(completion ids, stop reason, source)]).
    A turn longer than the context (minus max_new_tokens) is refused, skipped with the prompt's
    later turns, or truncated, by `settings.long_prompts`; `long_prompt_stats` counts them. With a template, each
    turn is rendered with the prompt's kwargs and, when `check_render` is given (an engine), checked by it (record
    id, messages, kwargs, prompt ids) before it is sent."""
    tok, use_template = target.tokenizer, settings.chat_template
    markers, sha = (reasoning_markers(tok), template_sha256(tok)) if use_template else (None, None)
    limit = prompt_token_limit(target.context_length, settings.max_new_tokens)
    stats = long_prompt_stats if long_prompt_stats is not None else {}
    answers: dict[str, list[str]] = {p.id: [] for p in batch}
    records: dict[str, list[CompletionRecord]] = {p.id: [] for p in batch}
    dropped: set[str] = set()
    short: set[str] = set()  # record ids under settings.min_prompt_tokens: answered for context, not kept
    truncated_from: dict[str, int] = {}
    for turn in range(max(len(p.turns) for p in batch)):
        active, texts, prompt_ids = [], [], []
        for p in batch:
            if len(p.turns) <= turn or p.id in dropped:
                continue
            kwargs = merged(settings.chat_template_kwargs, p.chat_template_kwargs) if use_template else None
            text = render_conversation(tok, p.conversation(answers[p.id]), use_template, kwargs)
            ids = encode_text(tok, text, use_template)
            if not ids:
                raise FlashdraftError(
                    f"prompt {p.record_id(turn)!r}: encodes to no tokens; expected a non-empty prompt"
                )
            if len(ids) < settings.min_prompt_tokens:
                short.add(p.record_id(turn))
                if turn == len(p.turns) - 1:  # no later turn reads its answer: not answered at all
                    stats["shorter"] = stats.get("shorter", 0) + 1
                    continue
            fitted = fit_prompt(p.record_id(turn), ids, limit, settings.long_prompts, stats, settings.prompts)
            if fitted is None:
                dropped.add(p.id)
                continue
            if len(fitted) < len(ids):  # the record's text is what the target saw: the kept tokens
                text = tok.decode(fitted)
                truncated_from[p.record_id(turn)] = len(ids)
            elif check_render is not None and use_template:
                check_render(p.record_id(turn), p.conversation(answers[p.id]), kwargs, fitted)
            active.append(p)
            texts.append(text)
            prompt_ids.append(fitted)
        if not active:
            continue
        results = complete([(p.record_id(turn), ids) for p, ids in zip(active, prompt_ids, strict=True)])
        for p, text, ids, (out, reason, source) in zip(active, texts, prompt_ids, results, strict=True):
            completion = tok.decode(out, skip_special_tokens=True)
            rid = p.record_id(turn)
            mode = (
                {}
                if not use_template
                else {
                    "messages": p.conversation(answers[p.id]),
                    "chat_template_sha256": sha,
                    "chat_template_kwargs": merged(settings.chat_template_kwargs, p.chat_template_kwargs),
                    "reasoning_end": reasoning_end(ids, out, markers),
                }
            )
            records[p.id].append(
                CompletionRecord(rid, text, ids, out, completion, reason, source, truncated_from.get(rid), **mode)
            )
            answers[p.id].append(completion)
    stats["shorter"] = stats.get("shorter", 0) + sum(r.id in short for p in batch for r in records[p.id])
    return [r for p in batch for r in records[p.id] if r.id not in short]


def settings_filters(settings: GenerationSettings) -> SamplingFilters:
    """The target-side filters a generate run samples with."""
    return SamplingFilters(settings.top_k, settings.top_p, settings.min_p)


def local_completer(target: TargetModel, settings: GenerationSettings):
    def complete(items: list[tuple[str, list[int]]]) -> list[tuple[list[int], str, str]]:
        generators = None
        if settings.temperature > 0:
            generators = [
                torch.Generator(device=target.device).manual_seed(record_seed(settings.seed, rid)) for rid, _ in items
            ]
        outs = generate_batch(
            target,
            [ids for _, ids in items],
            settings.max_new_tokens,
            settings.temperature,
            generators,
            settings_filters(settings),
        )
        return [(ids, reason, "target") for ids, reason in outs]

    return complete


# -- OpenAI-compatible server ------------------------------------------------------------


def openai_completer(target: TargetModel, settings: GenerationSettings, client: OpenAIClient, workers: int):
    stop_ids = target.stop_token_ids

    def one(item: tuple[str, list[int]]) -> tuple[list[int], str, str]:
        rid, prompt_ids = item
        choice = client.complete(
            prompt_ids,
            settings.max_new_tokens,
            settings.temperature,
            record_seed(settings.seed, rid),
            settings_filters(settings).active(),
        )
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise FlashdraftError(f"record {rid!r}: server finish_reason is {finish!r}; expected 'stop' or 'length'")
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            source = "server"
        else:
            ids = list(target.tokenizer(choice.get("text") or "", add_special_tokens=False)["input_ids"])
            source = "retokenized"
        if finish == "stop" and stop_ids and (not ids or ids[-1] not in stop_ids):
            # servers leave the stop token out of the text: put it back, as local generation keeps it
            ids = ids + [stop_ids[0]]
        return ids, "eos" if finish == "stop" else "length", source

    def complete(items):
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(one, items))

    return complete


# -- the resumable run ---------------------------------------------------------------------


def part_paths(out: Path) -> list[Path]:
    """The per-rank part files of an unfinished (or unmerged) generate run writing `out`."""
    return sorted(out.parent.glob(out.name + ".part*.jsonl"))


def _check_header(found: dict, expected: dict, where: str) -> None:
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        raise FlashdraftError(
            f"{where}: not a flashdraft completions file (format {found.get('format')!r}); use another --out"
        )
    fp, want = found.get("target", {}).get("fingerprint"), expected["target"]["fingerprint"]
    if fp != want:
        raise FlashdraftError(f"{where}: made by target fingerprint {fp}, this target is {want}; use another --out")
    defaults = asdict(GenerationSettings(prompts=""))  # a setting added since a file was written: its default
    for key, value in expected["generation"].items():
        stored = found.get("generation", {}).get(key, defaults.get(key))
        if key not in RESUMABLE_CHANGES and stored != value:
            raise FlashdraftError(
                f"{where}: generation setting '{key}' is {stored!r}, this run uses {value!r}; resume with the same "
                f"settings or use another --out"
            )


def _read_existing(out: Path, header: dict) -> dict[str, dict]:
    """Records already generated (final file and parts), keyed by id; later parts win."""
    done: dict[str, dict] = {}
    if out.exists():
        try:
            data = json.loads(out.read_text())
        except json.JSONDecodeError as e:
            raise FlashdraftError(f"{out}: not valid JSON ({e.msg}); remove it or use another --out") from None
        _check_header(data, header, str(out))
        for r in data.get("records", []):
            done[r["id"]] = r
    for part in part_paths(out):
        lines = part.read_text().split("\n")
        if lines and lines[-1]:
            print(f"{part}: discarding an incomplete last line (the run was killed while writing)")
        lines = [line for line in lines[:-1] if line]
        if not lines:
            continue
        rows = []
        for number, line in enumerate(lines, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise FlashdraftError(f"{part}:{number}: not valid JSON ({e.msg}); remove that line") from None
        _check_header(rows[0], header, str(part))
        for r in rows[1:]:
            done[r["id"]] = r
    return done


def _cut_incomplete_line(part: Path) -> None:
    """Drop a line cut short by a kill, so appended records start on a line of their own."""
    if part.exists():
        data = part.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            with open(part, "r+b") as f:
                f.truncate(end)


def _write_final(out: Path, header: dict, records: list[dict]) -> None:
    """OUT as one JSON object, one record per line; written to a temporary file first."""
    sources = sorted({r.get("token_source", "target") for r in records})
    head = dict(
        header,
        token_ids=sources[0] if len(sources) == 1 else "mixed",
        num_records=len(records),
        chat_mode=mode_mix(records),
    )
    text = json.dumps(head, indent=1)[:-2] + ',\n "records": [\n'
    text += ",\n".join(json.dumps(r, ensure_ascii=False) for r in records)
    text += "\n ]\n}\n"
    write_text_atomic(out, text, f"the {len(records)} merged completion records")


def _prompt_chars(prompt: Prompt) -> int:
    return sum(len(m["content"]) for m in prompt.prefix) + sum(len(t) for t in prompt.turns)


def generate_completions(
    target: TargetModel,
    prompts: list[Prompt],
    out: str | Path,
    settings: GenerationSettings,
    batch_size: int = 8,
    dist: Dist | None = None,
    client: OpenAIClient | None = None,
    check_render: Callable[[str, list, dict, list[int]], None] | None = None,
) -> Path:
    """Answer every prompt not yet in `out` (resuming), this rank's share of them, and merge
    all records into `out` on rank 0 (`check_render`: `_answer_turns`'). Returns the path of the completions
    file."""
    dist = dist or Dist()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = make_header(target, settings)
    done = _read_existing(out, header)
    dist.barrier()  # every rank has read the same state before anyone appends to it

    todo = [p for p in prompts if not all(p.record_id(t) in done for t in range(len(p.turns)))]
    # Length bucketing: a batch of similar lengths wastes little on left padding; the merged
    # file keeps the prompts' order whatever order they were answered in.
    mine = sorted(todo[dist.rank :: dist.world], key=_prompt_chars)
    if dist.is_main:
        print(
            f"{len(done)} records already in {out}; {len(todo)} prompts to answer"
            + (f" over {dist.world} ranks" if dist.world > 1 else "")
        )
    if settings.backend in ("openai", "vllm"):
        complete = openai_completer(target, settings, client, workers=batch_size)
    else:
        complete = local_completer(target, settings)

    long_prompts: dict[str, int] = {}
    part = out.with_name(f"{out.name}.part{dist.rank}.jsonl")
    # SIGTERM/SIGINT: finish the batch in flight (its records appended whole), then stop
    with StopRequests("batch", dist.prefix()) as stop:
        answered = 0
        if mine:
            answered = _answer_into_part(
                target, mine, part, header, settings, complete, batch_size, dist, stop, long_prompts, check_render
            )
        note = describe_long_prompts(long_prompts, prompt_token_limit(target.context_length, settings.max_new_tokens))
        if note:
            print(f"{dist.prefix()}{note} (--long-prompts {settings.long_prompts})")
        if long_prompts.get("shorter"):
            print(
                f"{dist.prefix()}{long_prompts['shorter']} turns shorter than --min-prompt-tokens "
                f"{settings.min_prompt_tokens} left out"
            )
        # every rank has finished or stopped (its part complete) before rank 0 merges; all stop together
        if any_rank(stop.requested):
            signum = stop.signum or signal.SIGTERM  # a rank that got no signal stops with its peers
            told = f"{answered} of {len(mine)} prompts answered" + (" by rank 0" if dist.world > 1 else "")
            raise Interrupted(
                signum,
                f"{signal.Signals(signum).name}: {told}, their records kept in {part} (not merged into {out} yet)"
                if dist.is_main
                else "",
            )
    if dist.is_main and (todo or part_paths(out)):
        _merge(out, header, prompts)
    return out


def _answer_into_part(
    target: TargetModel,
    mine: list[Prompt],
    part: Path,
    header: dict,
    settings: GenerationSettings,
    complete,
    batch_size: int,
    dist: Dist,
    stop: StopRequests,
    long_prompts: dict[str, int],
    check_render=None,
) -> int:
    """Answer this rank's prompts batch by batch until done or a stop is requested, appending each batch's records
    whole to its part file (after the header line, in a new file); returns how many prompts were answered."""
    answered = 0
    _cut_incomplete_line(part)
    fd = os.open(part, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        with tqdm(total=len(mine), desc=f"{dist.prefix()}generate", unit="prompt") as bar:
            if os.fstat(fd).st_size == 0:
                append_whole(fd, (json.dumps(header) + "\n").encode(), part, "the part file's header")
            for start in range(0, len(mine), batch_size):
                if stop.requested:
                    break
                batch = mine[start : start + batch_size]
                records = _answer_turns(target, batch, settings, complete, long_prompts, check_render)
                # a batch's records are appended whole or not at all: a full disk loses only them
                append_whole(
                    fd,
                    "".join(record_json(r) + "\n" for r in records).encode(),
                    part,
                    f"the completions of {len(batch)} prompts",
                )
                answered += len(batch)
                bar.update(len(batch))
    except DiskFullError as e:
        e.then = (
            f"free space and re-run the same command: the records already in {part.name} are kept, "
            f"{len(mine) - answered} prompts{' of this rank' if dist.world > 1 else ''} "
            f"remain"
        )
        raise
    finally:
        os.close(fd)
    return answered


def _merge(out: Path, header: dict, prompts: list[Prompt]) -> None:
    """Rank 0, once every rank's part is complete: every record (earlier runs' included) into OUT in the prompts'
    order, then the parts removed."""
    done = _read_existing(out, header)
    order = [p.record_id(t) for p in prompts for t in range(len(p.turns))]
    records = [done.pop(rid) for rid in order if rid in done]
    if done:
        print(f"keeping {len(done)} records of earlier runs whose prompts are not in this run")
    records += list(done.values())
    _write_final(out, header, records)
    for part in part_paths(out):
        part.unlink()
    print(f"wrote {len(records)} records to {out}")


# -- loading -------------------------------------------------------------------------------


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
    return check_reasoning_end(r.get("reasoning_end"), len(r["completion_ids"]))


def load_completions(
    path: str | Path, target: TargetModel | None = None, allow_foreign: bool = False, quiet: bool = False
) -> Completions:
    """Read and validate a completions file. Prints how many records are valid and why each
    invalid one was skipped. With a target: a file made by another target (fingerprint) is
    refused unless allow_foreign, and token ids are checked against its vocabulary."""
    path = Path(path)
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
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise FlashdraftError(
            f"{path}: field 'format' is {found!r}; expected {FORMAT!r} (a flashdraft completions file)"
        )
    if data.get("version") != VERSION:
        raise FlashdraftError(f"{path}: field 'version' is {data.get('version')!r}; expected {VERSION}")
    header = {k: v for k, v in data.items() if k != "records"}
    if not isinstance(header.get("target"), dict):
        raise FlashdraftError(
            f"{path}: field 'target' is {header.get('target')!r}; expected an object with fingerprint and vocab_size"
        )
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
