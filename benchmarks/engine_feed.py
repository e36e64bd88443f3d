"""The three ways to feed training, measured on this machine: samples/s of `flashdraft train` fed by the serving
engine (`--engine vllm`, states through hs-connectors' file backend), by a hidden-state cache
(`--cached-hidden-states`), and by the target in the training process (`--completions`).

    .venv/bin/python benchmarks/engine_feed.py [--records 32] [--new-tokens 96] [--steps 12] [--batch-size 2]
        [--prefetch 8] [--fp8]

On a CPU (the figures are a CPU's: the engine, the target and the trainer share its cores) the engine pays an HTTP
round trip and a safetensors file per sample; on a GPU node the engine runs on its own GPU and the trainer waits
only when it outruns the prefetch. Per mode one JSON line: samples/s over the steps (batch size / (wait + compute)
per step, from the run's metrics), seconds per step waiting for states and computing, and the disk each mode
writes per token. The engine is started once, before the timings (its start-up is not counted).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from flashdraft.cli import main as cli  # noqa: E402
from flashdraft.serving.engine import engine_python  # noqa: E402
from flashdraft.train import engine_feed  # noqa: E402

LAYERS = [0, 2]


def _run(*argv) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = cli([str(a) for a in argv])
    if rc != 0:
        raise SystemExit(f"flashdraft {argv[0]} failed (exit {rc}): {' '.join(map(str, argv))}")


def _data(work: Path, records: int, new_tokens: int) -> tuple[Path, Path, Path]:
    """The CPU engine's tiny target (tests' `save_engine_target`), its greedy completions and their cache."""
    from tests.conftest import save_engine_target, write_word_prompts

    target = save_engine_target(work / "target")
    write_word_prompts(work / "prompts.jsonl", records)
    common = ["--target-model", target]
    _run(
        "generate",
        *common,
        "--prompts",
        work / "prompts.jsonl",
        "--out",
        work / "c.json",
        "--max-new-tokens",
        new_tokens,
    )
    layers = ",".join(map(str, LAYERS))
    _run("cache", *common, "--completions", work / "c.json", "--out", work / "cache", "--layers", layers)
    return target, work / "c.json", work / "cache"


def _figures(run_dir: Path, batch_size: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    rows = rows[1:] or rows  # the first step warms up
    wait = sum(r["wait_s"] for r in rows) / len(rows)
    compute = sum(r["compute_s"] for r in rows) / len(rows)
    return {"samples_per_s": batch_size / (wait + compute), "wait_s_per_step": wait, "compute_s_per_step": compute}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=engine_feed.DEFAULT_PREFETCH)
    ap.add_argument("--fp8", action="store_true", help="FP8 states on the wire")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target, completions, cache = _data(work, args.records, args.new_tokens)
        train = ["train", "--target-model", target, "--target-layer-ids", "0,2", "--draft-layers", "1"]
        train += ["--block-size", "8", "--max-steps", args.steps, "--batch-size", args.batch_size, "--log-every", 1]
        staging = work / "served" / engine_feed.STAGING_DIR
        staging.mkdir(parents=True)
        server = engine_feed.engine_server(engine_python(), str(target), "float32", LAYERS, staging, args.fp8)
        modes = {
            "cached": ["--cached-hidden-states", cache],
            "target_in_process": ["--completions", completions],
        }
        with server:
            feed = ["--completions", completions, "--engine", "vllm", "--engine-server", server.base_url]
            feed += ["--engine-prefetch", args.prefetch, "--verify-share", 0] + (["--engine-fp8"] if args.fp8 else [])
            modes = {"engine_fed": feed} | modes
            for mode, source in modes.items():
                _run(*train, *source, "--out", work / mode)
                row = {"mode": mode, **_figures(work / mode, args.batch_size)}
                cache_bytes = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
                row["disk_written"] = {
                    "engine_fed": "the prefetch buffer only (files deleted as read)",
                    "cached": f"the cache, {cache_bytes} bytes",
                    "target_in_process": "none",
                }[mode]
                row |= {"records": args.records, "steps": args.steps, "batch_size": args.batch_size}
                row |= {"machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "fp8": args.fp8}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
