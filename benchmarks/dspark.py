"""DSpark against DFlash and DFlash2 on the built-in target: the same data, backbone init and steps, with the
same number of drafts per step (7: DFlash and DFlash2 blocks of 8 in the fill-in layout, a DSpark block of 7
anchor-first, the paper's setting), held-out τ offline (equal to live decoding), DSpark's confidence head's
calibration, and the drafting step's cost. Prints one JSON line per run and a closing JSON summary.

    python benchmarks/dspark.py --work WORKDIR --steps 800 [--lanes 2]
    python benchmarks/dspark.py --work WORKDIR --step-cost   # quiet machine: timing only

Data and caches are `benchmarks/recipe.py`'s (the same WORKDIR serves both), plus a training cache with the
target's top-64 logits (`cache --with-target-logits 64`), which DSpark's loss needs. Inits: 2 layers copied
from `tiny`'s layers 2 and 5, context layers 1,2,3, seed 0 (the backbone draws do not depend on the family),
flashdraft's default recipe (D-PACE + Muon), batch 8, 16 anchors, lr 6e-3. Runs, each N steps:
- `dflash` (B = 8), `dflash2` (B = 8, selector loss 0.3), `dspark` (B = 7, the paper's loss: 0.1 CE + 0.9 L1
  + 1.0 confidence BCE, decay gamma 4 where decay applies);
- `dspark-ce`: the DSpark drafter on hard CE alone (what the distribution terms add);
- `dflash-b16`: flashdraft's default DFlash block, for scale;
- `dspark-decay`: the paper's position decay exp(-k / 4) in place of D-PACE.
`--lanes 2` trains two runs at a time (one thread each). Every stage resumes: outputs that exist are reused.
`--step-cost` times one drafting step (drafter forward + LM head + the family's walk) of the trained
`dflash`, `dflash2` and `dspark` drafters, interleaved, after a 200-token context.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from recipe import BASE_TRAIN_ARGS, HELD_OUT, INIT_ARGS, LAYERS, drafting_step_ms, flashdraft, prepare, run_lanes

TINY = ["--target-model", "tiny"]
RECIPE = ["--num-anchors", "16"]  # flashdraft's defaults otherwise: D-PACE + Muon
INITS = {  # init directory: (block size, extra init flags)
    "init-dflash-b8": (8, []),
    "init-dflash2-b8": (8, ["--family", "dflash2"]),
    "init-dspark-b7": (7, ["--family", "dspark"]),
    "init-dflash-b16": (16, []),
}
RUNS = {  # name: (init, cache, extra train flags)
    "dflash": ("init-dflash-b8", "cache-train", []),
    "dflash2": ("init-dflash2-b8", "cache-train", []),
    "dspark": ("init-dspark-b7", "cache-train-logits", []),
    "dspark-ce": (
        "init-dspark-b7",
        "cache-train",
        ["--dspark-ce-weight", "1", "--dspark-tv-weight", "0", "--confidence-loss-weight", "0"],
    ),
    "dflash-b16": ("init-dflash-b16", "cache-train", []),
    "dspark-decay": ("init-dspark-b7", "cache-train-logits", ["--loss-weighting", "decay"]),
}


def init_args(block: int) -> list[str]:
    args = list(INIT_ARGS)
    args[args.index("--block-size") + 1] = str(block)
    return args


def train_command(work: Path, name: str, steps: int, runs: dict = RUNS) -> list[str]:
    init, cache, extra = runs[name]
    return [
        sys.executable,
        "-m",
        "flashdraft",
        "train",
        *TINY,
        "--cached-hidden-states",
        str(work / cache),
        "--out",
        str(work / f"run-{name}"),
        "--init",
        str(work / init),
        *BASE_TRAIN_ARGS,
        *RECIPE,
        "--max-steps",
        str(steps),
        *extra,
        "--resume",
    ]


def evaluate(work: Path, name: str) -> dict:
    row = {"run": name}
    for set_name in HELD_OUT:
        out = work / f"eval-{name}-{set_name}.json"
        if not out.exists():
            flashdraft(
                [
                    "eval",
                    "--checkpoint",
                    str(work / f"run-{name}"),
                    *TINY,
                    "--cached-hidden-states",
                    str(work / f"cache-{set_name}"),
                    "--json",
                    str(out),
                ]
            )
        figures = json.loads(out.read_text())
        row[f"tau_{set_name}"] = round(figures["tau"], 4)
        confidence = figures.get("confidence")
        if confidence:  # DSpark: the head's calibration and the cuts' tau and cost
            row[f"calibration_error_{set_name}"] = round(confidence["expected_calibration_error"], 4)
            row[f"cuts_{set_name}"] = [
                {
                    "threshold": c["threshold"],
                    "tau": round(c["tau"], 4),
                    "drafts_verified": round(c["drafts_verified_per_step"], 3),
                }
                for c in confidence["cuts"]
            ]
    return row


def prepare_families(work: Path) -> None:
    """`recipe.prepare`'s data and caches, the training cache with the target's top-64 logits, and the inits."""
    prepare(work)
    if not (work / "cache-train-logits" / "manifest.json").exists():
        flashdraft(
            [
                "cache",
                *TINY,
                "--completions",
                str(work / "train.json"),
                "--out",
                str(work / "cache-train-logits"),
                "--layers",
                LAYERS,
                "--dtype",
                "fp32",
                "--with-target-logits",
                "64",
            ]
        )
    for init, (block, extra) in INITS.items():
        if not (work / init / "model.safetensors").exists():
            flashdraft(["init", *TINY, "--out", str(work / init), *init_args(block), *extra])


def step_cost(work: Path, repeats: int = 5) -> dict:
    """Median milliseconds of one drafting step per trained drafter (`recipe.drafting_step_ms`) and their ratios."""
    ms = drafting_step_ms(work, ["dflash", "dflash2", "dspark"], repeats)
    return {
        "step_ms": {k: round(v, 3) for k, v in ms.items()},
        "dspark_over_dflash": round(ms["dspark"] / ms["dflash"], 4),
        "dflash2_over_dflash": round(ms["dflash2"] / ms["dflash"], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--step-cost", action="store_true", help="only time the drafting step of the trained drafters")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(args.work)
    if args.step_cost:
        print(json.dumps({"machine": platform.machine(), "threads": 1, **step_cost(work)}))
        return
    prepare_families(work)
    run_lanes(work, args.runs, lambda n: train_command(work, n, args.steps), args.lanes)
    rows = [evaluate(work, name) for name in args.runs]
    for row in rows:
        print(json.dumps(row), flush=True)
    by = {r["run"]: r for r in rows}
    ratios = {
        f"{a} / {b}": (a, b)
        for a, b in [
            ("dspark", "dflash"),
            ("dspark", "dflash2"),
            ("dflash2", "dflash"),
            ("dspark", "dspark-ce"),
            ("dspark-decay", "dspark"),
        ]
        if a in by and b in by
    }
    summary = {
        "machine": platform.machine(),
        "threads": 1,
        "lanes": args.lanes,
        "steps": args.steps,
        "ratios": {
            label: {s: round(by[a][f"tau_{s}"] / by[b][f"tau_{s}"], 4) for s in HELD_OUT}
            for label, (a, b) in ratios.items()
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
