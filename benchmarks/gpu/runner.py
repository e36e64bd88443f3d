"""The run: each check of `registry.CHECKS` in order, every case announced with its cap ("# name (case): cap N s"),
stopped past it (`time_cap`), one JSON line per row as it finishes (a case that raises gives an error row and the
run goes on), then a closing table; exit 1 when a check fails or raises."""

from __future__ import annotations

import argparse
import json
import platform
import signal
import time
import traceback
from contextlib import contextmanager

import torch

from . import registry
from .registry import Case, Run
from .shapes import DRY, GPU

DESCRIPTION = "GPU readiness: one command that runs every CUDA path of flashdraft once and measures it."


class OverCap(Exception):
    """A check ran past its cap (`CAPS`)."""


@contextmanager
def time_cap(seconds: int):
    """Stop the block with OverCap after `seconds` (SIGALRM: the main thread of a POSIX process; elsewhere uncapped)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def over(signum, frame):
        raise OverCap(f"over its {seconds} s cap")

    previous = signal.signal(signal.SIGALRM, over)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def summary(row: dict) -> str:
    """The row's figure, for the closing table: its error, why it was skipped, or its check's summary."""
    if "error" in row:
        return row["error"][:70]
    if isinstance(row.get("skipped"), str):  # (parity's "skipped" names the backends that did not run)
        return row["skipped"]
    return next(c for c in registry.CHECKS if c.name == row["check"]).summary(row)


def status(row: dict) -> str:
    if "error" in row:
        return "ERROR"
    if "passed" in row:
        return "PASS" if row["passed"] else "FAIL"
    return "skipped" if "skipped" in row else "ok"


def run_case(name: str, case: Case, rows: list[dict]) -> None:
    """Announce the case with its cap, run it under the cap, and print and keep its rows."""
    cap = registry.CAPS[name]
    print(f"# {name} ({case.label}): cap {cap} s", flush=True)
    t0 = time.perf_counter()
    try:
        with time_cap(cap):
            produced = case.run()
    except Exception as e:  # a broken CUDA path is a finding: record it and go on to the next check
        traceback.print_exc()
        produced = {"check": name, "case": case.label, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    for row in produced if isinstance(produced, list) else [produced]:
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--dry-run", action="store_true", help="tiny widths on CPU: the same code paths, < 1 minute")
    ap.add_argument("--checks", default="all", help="comma-separated check names to run (default: all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    wanted = None if args.checks == "all" else set(args.checks.split(","))
    run = Run(device, DRY if args.dry_run else GPU, args.dry_run, wanted)
    rows: list[dict] = []
    t_start = time.perf_counter()
    print(
        json.dumps(
            {
                "machine": torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else platform.processor() or platform.machine(),
                "devices": torch.cuda.device_count(),
                "torch": torch.__version__,
                "dry_run": args.dry_run,
            }
        ),
        flush=True,
    )
    slice_used = False
    for check in registry.CHECKS:
        if slice_used and not check.uses_slice:  # free the slice before the checks that build their own models
            run.release_slice()
        slice_used = check.uses_slice
        if wanted is None or check.name in wanted:
            for case in check.cases(run):
                run_case(check.name, case, rows)

    print(f"\n{'check':<24} {'case':<28} {'status':<8} result")
    for row in rows:
        print(f"{row['check']:<24} {row['case']:<28} {status(row):<8} {summary(row)}")
    failed = [r for r in rows if status(r) in ("FAIL", "ERROR")]
    print(
        f"{len(rows)} results in {time.perf_counter() - t_start:.0f} s on {device}; "
        + (f"{len(failed)} failed" if failed else "all passed")
    )
    return 1 if failed else 0
