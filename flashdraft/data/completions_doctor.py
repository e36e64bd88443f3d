"""`flashdraft doctor` on a completions file: its header, every record, an unfinished run's parts, and against a
target its fingerprint and vocabulary (and a drafter's vocabulary). The format's facts are `data/completions.py`'s;
the report is `flashdraft.drafter.doctor_report.Checks`."""

from __future__ import annotations

import json
from pathlib import Path

from flashdraft.data.completions import VERSION, header_problems, part_paths, record_problem
from flashdraft.drafter.doctor_report import Checks
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel

REGENERATE = "re-run flashdraft generate into a new --out"
FINISH = "re-run the same flashdraft generate command to finish and merge them"


def doctor_completions(path: Path, target: TargetModel | None, drafter_cfg, checks: Checks) -> None:
    """Every check of a completions file, into `checks`."""
    parts = part_paths(path)
    if not path.exists():
        names = ", ".join(p.name for p in parts)
        checks.fail(f"{path}: not written yet, but {names} exist (an unfinished run)", FINISH)
        return
    data = _read(path)
    records = data.get("records") if isinstance(data.get("records"), list) else []
    _check_header(path, data, records, parts, checks)
    vocab = (data.get("target") if isinstance(data.get("target"), dict) else {}).get("vocab_size")
    temperature = (data.get("generation") if isinstance(data.get("generation"), dict) else {}).get("temperature")
    vocab_size = target.vocab_size if target else vocab if isinstance(vocab, int) else 1 << 62
    _check_records(records, vocab_size, temperature, checks)
    if target is not None:
        _check_against_target(
            data["target"].get("fingerprint") if isinstance(data.get("target"), dict) else None, vocab, target, checks
        )
    if drafter_cfg is not None:
        checks.check(
            drafter_cfg.vocab_size == vocab,
            f"vocab_size {vocab} "
            + ("equals" if drafter_cfg.vocab_size == vocab else "differs from")
            + f" the drafter's {drafter_cfg.vocab_size}",
            "the drafter and the completions come from different targets",
        )


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FlashdraftError(f"{path}: not valid JSON ({getattr(e, 'msg', e)}); not a completions file") from None
    problems = header_problems(data)
    if problems and problems[0].startswith("field 'format'"):  # not a completions file at all: nothing to check
        raise FlashdraftError(f"{path}: {problems[0]}")
    return data


def _check_header(path: Path, data: dict, records: list, parts: list[Path], checks: Checks) -> None:
    head = data.get("target") if isinstance(data.get("target"), dict) else {}
    gen = data.get("generation") if isinstance(data.get("generation"), dict) else {}
    checks.about(f"completions file {path}: {len(records)} records, token ids from {data.get('token_ids')}")
    checks.about(f"fingerprints: target {head.get('fingerprint')} ({head.get('path')}), vocab {head.get('vocab_size')}")
    checks.about("generation: " + ", ".join(f"{k} {v}" for k, v in gen.items()))
    checks.check(
        not parts,
        "no unfinished generate run" + (f": {', '.join(p.name for p in parts)} exist" if parts else ""),
        FINISH,
    )
    version = [p for p in header_problems(data) if p.startswith("field 'version'")]
    checks.check(
        not version, f"version {data.get('version')!r}", f"this flashdraft reads version {VERSION}; {REGENERATE}"
    )
    checks.check(
        isinstance(head.get("vocab_size"), int) and isinstance(data.get("records"), list),
        "header has target.vocab_size and a records list",
        f"the file is damaged or not from flashdraft generate; {REGENERATE}",
    )
    checks.check(
        data.get("num_records") == len(records),
        f"num_records {data.get('num_records')} equals the {len(records)} records",
        f"the file was edited or cut; {REGENERATE}",
    )


def _check_records(records: list, vocab_size: int, temperature, checks: Checks) -> None:
    problems, seen, stops = [], set(), {}
    for k, r in enumerate(records):
        problem = record_problem(r, vocab_size)
        rid = r.get("id") if isinstance(r, dict) else f"#{k}"
        if problem is None and rid in seen:
            problem = "duplicate id"
        if problem is None:
            seen.add(rid)
            stops[r["stop_reason"]] = stops.get(r["stop_reason"], 0) + 1
        else:
            problems.append(f"{rid}: {problem}")
    checks.check(
        not problems,
        f"{len(records) - len(problems)} of {len(records)} records valid"
        + (f"; {'; '.join(problems[:3])}" if problems else ""),
        f"invalid records are skipped when the file is read; {REGENERATE} to have them",
    )
    checks.about(
        f"stop reasons: {stops}; temperature {temperature}"
        + (" (sampled: offline τ equals online τ only for greedy completions)" if temperature else "")
    )


def _check_against_target(fingerprint: str | None, vocab, target: TargetModel, checks: Checks) -> None:
    fp = target.fingerprint()
    checks.check(
        fingerprint == fp,
        f"made by target fingerprint {fingerprint}, "
        + ("the same as" if fingerprint == fp else "not")
        + f" {target.path} ({fp})",
        "generate completions with this target (pass --allow-foreign-completions only if you mean "
        "to use another model's outputs)",
    )
    checks.check(
        vocab == target.vocab_size,
        f"vocab_size {vocab} "
        + ("equals" if vocab == target.vocab_size else "differs from")
        + f" the target's {target.vocab_size}",
        REGENERATE,
    )
