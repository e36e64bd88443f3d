"""The family recipes judged where they are served: each family's default against its alternatives (DFlash's
objective, DFlash2's selector weight, DSpark's paper loss against hard CE and its position weighting), held-out τ
greedy and at the Qwen3 chat settings (temperature 0.6, top-p 0.95, top-k 20) under vLLM's default rule and under
SGLang's. Prints one JSON line per run and a closing JSON summary.

    python benchmarks/served_sampling.py --work WORKDIR --steps 800 [--lanes 2]

The data, caches and inits are `benchmarks/dspark.py`'s (the same WORKDIR serves both; 7 drafts per step: DFlash
and DFlash2 blocks of 8, a DSpark block of 7), plus the target's sampled completions of each held-out set at the
chat settings (`generate --temperature 0.6 --top-p 0.95 --top-k 20`, seed 0) and their caches. At T > 0 τ is
offline over those samples (exact in law; under a one-hot rule the argmax walk's match, no draw), one seed, the same
samples for every drafter, with `expected_tau` (each step's expected committed length given its drafts) beside it.
Runs (800 steps each by default; two at a time, one thread each): `dspark.py`'s `dflash`, `dflash2`, `dspark`,
`dspark-ce` (and, on request, `dspark-decay`, `dflash-b16`), and
- `dflash-published`: DFlash B = 8 on the published recipe (position decay + AdamW) instead of D-PACE + Muon;
- `dflash2-sel1`: DFlash2 with selector loss weight 1 instead of 0.3.
Every stage resumes: outputs that exist are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from dspark import RUNS, TINY, prepare_families, train_command
from recipe import HELD_OUT, LAYERS, MAX_NEW_TOKENS, flashdraft, run_lanes

RUNS = RUNS | {
    "dflash-published": ("init-dflash-b8", "cache-train", ["--loss-weighting", "decay", "--optimizer", "adamw"]),
    "dflash2-sel1": ("init-dflash2-b8", "cache-train", ["--selector-loss-weight", "1"]),
}
DEFAULT_RUNS = ["dflash", "dflash-published", "dflash2", "dflash2-sel1", "dspark", "dspark-ce"]
SAMPLING = ["--temperature", "0.6", "--top-p", "0.95", "--top-k", "20"]  # Qwen3's generation_config.json
RULES = ("vllm", "sglang")
# each run against its family's default
BASELINE = {
    "dflash-published": "dflash",
    "dflash2-sel1": "dflash2",
    "dspark-ce": "dspark",
    "dspark-decay": "dspark",
    "dflash2": "dflash",
    "dspark": "dflash",
}


def prepare_sampled(work: Path) -> None:
    """The target's completions of each held-out set at the chat settings, and their fp32 caches."""
    for set_name, prompts in HELD_OUT.items():
        out = work / f"{set_name}-t0.6.json"
        if not out.exists():
            flashdraft(
                [
                    "generate",
                    *TINY,
                    "--prompts",
                    prompts,
                    "--out",
                    str(out),
                    "--max-new-tokens",
                    str(MAX_NEW_TOKENS),
                    "--batch-size",
                    "64",
                    "--seed",
                    "0",
                    *SAMPLING,
                ]
            )
        cache = work / f"cache-{set_name}-t0.6"
        if not (cache / "manifest.json").exists():
            flashdraft(
                ["cache", *TINY, "--completions", str(out), "--out", str(cache), "--layers", LAYERS, "--dtype", "fp32"]
            )


def evaluate(work: Path, name: str) -> dict:
    """Greedy τ and, per rule, sampled τ and expected_tau on each held-out set (eval --json files, reused)."""
    row = {"run": name}
    for set_name in HELD_OUT:
        settings = {"greedy": (f"cache-{set_name}", [])}
        settings |= {rule: (f"cache-{set_name}-t0.6", [*SAMPLING, "--serving-rule", rule]) for rule in RULES}
        for label, (cache, flags) in settings.items():
            out = work / f"eval-{name}-{set_name}-{label}.json"
            if not out.exists():
                flashdraft(
                    [
                        "eval",
                        "--checkpoint",
                        str(work / f"run-{name}"),
                        *TINY,
                        "--cached-hidden-states",
                        str(work / cache),
                        *flags,
                        "--json",
                        str(out),
                    ]
                )
            figures = json.loads(out.read_text())
            row[f"tau_{set_name}_{label}"] = round(figures["tau"], 4)
            if label != "greedy":
                row[f"expected_tau_{set_name}_{label}"] = round(figures["expected_tau"], 4)
                row[f"expected_tau_stderr_{set_name}_{label}"] = round(figures["expected_tau_stderr"], 4)
            confidence = figures.get("confidence")
            if confidence and confidence.get("expected_calibration_error") is not None:
                row[f"calibration_error_{set_name}_{label}"] = round(confidence["expected_calibration_error"], 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS))
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(args.work)
    prepare_families(work)

    run_lanes(work, args.runs, lambda name: train_command(work, name, args.steps, RUNS), args.lanes)
    prepare_sampled(work)
    rows = [evaluate(work, name) for name in args.runs]
    for row in rows:
        print(json.dumps(row), flush=True)
    by = {r["run"]: r for r in rows}
    ratios = {}
    for name, base in BASELINE.items():
        if name in by and base in by:
            ratios[f"{name} / {base}"] = {
                key.removeprefix("tau_"): round(by[name][key] / by[base][key], 4)
                for key in by[name]
                if key.startswith("tau_")
            }
    summary = {
        "machine": platform.machine(),
        "threads": 1,
        "lanes": args.lanes,
        "steps": args.steps,
        "sampling": SAMPLING,
        "ratios": ratios,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
