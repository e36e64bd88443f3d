"""The resumable writing of a completions file.

Each rank appends finished records to `OUT.part{rank}.jsonl` (header line first, flushed and fsynced per batch);
a re-run reads OUT and every part, skips prompts already answered, and at the end rank 0 merges everything into OUT
through a temporary file and `os.replace`, so OUT is never half written and no record appears twice.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from flashdraft.data.chat_mode import (
    mode_mix,
)
from flashdraft.data.completers import answer_turns, describe_compiled, local_completer, openai_completer
from flashdraft.data.completions import (
    RESUMABLE_CHANGES,
    CompletionRecord,
    GenerationSettings,
    header_problems,
    make_header,
    part_paths,
    record_json,
)
from flashdraft.data.openai_client import OpenAIClient
from flashdraft.data.prompts import (
    Prompt,
    describe_long_prompts,
    prompt_token_limit,
)
from flashdraft.decoding.batched import CompiledBatch
from flashdraft.distributed import Dist, any_rank
from flashdraft.errors import FlashdraftError, Interrupted
from flashdraft.files import DiskFullError, append_whole, write_text_atomic
from flashdraft.progress import Progress as tqdm  # plain lines in logs; the name the generation loop uses
from flashdraft.stop import StopRequests
from flashdraft.target.model import TargetModel


def _check_header(found: dict, expected: dict, where: str) -> None:
    problems = header_problems(found)
    if problems:
        raise FlashdraftError(f"{where}: {problems[0]}; use another --out")
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
    compile: bool = False,
) -> Path:
    """Answer every prompt not yet in `out` (resuming), this rank's share of them, and merge
    all records into `out` on rank 0 (`check_render`: `answer_turns`'; `compile`: local decoding on the static
    cache, compiled once, its counts printed). Returns the path of the completions file."""
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
        complete = local_completer(target, settings, CompiledBatch(width=batch_size) if compile else None)

    long_prompts: dict[str, int] = {}
    part = out.with_name(f"{out.name}.part{dist.rank}.jsonl")
    # SIGTERM/SIGINT: finish the batch in flight (its records appended whole), then stop
    with StopRequests("batch", dist.prefix()) as stop:
        answered = 0
        if mine:

            def answer(batch: list[Prompt]) -> list[CompletionRecord]:
                return answer_turns(target, batch, settings, complete, long_prompts, check_render)

            answered = _answer_into_part(mine, part, header, answer=answer, batch_size=batch_size, dist=dist, stop=stop)
        compiled = getattr(complete, "compiled", None)
        if compiled is not None:
            print(f"{dist.prefix()}{describe_compiled(compiled.counts)}")
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
    mine: list[Prompt],
    part: Path,
    header: dict,
    answer: Callable[[list[Prompt]], list[CompletionRecord]],
    batch_size: int,
    dist: Dist,
    stop: StopRequests,
) -> int:
    """Answer this rank's prompts (`answer`: a batch's records, turn by turn) batch by batch until done or a stop
    is requested, appending each batch's records whole to its part file (after the header line, in a new file);
    returns how many prompts were answered."""
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
                records = answer(batch)
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
