"""DFlash2 against DFlash on the built-in target: the same data, backbone init and steps, held-out
τ offline (equal to live decoding), from scratch and from a trained DFlash drafter
(`init --from-drafter`), the selector's missing-label rule (inject / skip), and the drafting
step's cost. Prints one JSON line per run and a closing JSON summary.

    python benchmarks/dflash2.py --work WORKDIR --steps 800 [--lanes 2]
    python benchmarks/dflash2.py --work WORKDIR --steps 800 --step-cost   # quiet machine: timing only

Data, caches and the DFlash init are `benchmarks/recipe.py`'s (the same WORKDIR can serve both):
2 layers copied from `tiny`'s layers 2 and 5, context layers 1,2,3, B = 16, flashdraft's default
recipe (D-PACE + Muon), batch 8, 16 anchors, lr 6e-3. The DFlash2 init is the same backbone
(`init --family dflash2`, same seed and copied layers) with identity convolutions and a neutral
selector. Runs, each N steps:
- `dflash`, `dflash2` (selector loss, missing label injected), `dflash2-skip` (... skipped): from
  the shared init;
- `dflash-more` (the trained `dflash` drafter, N more steps) and `dflash2-from` (`init --family
  dflash2 --from-drafter` of it, N steps): what DFlash2 adds to a trained drafter; with the
  selector loss weighted 0.1, 0.3 and 3 instead of 1 (`dflash2-from-sel0.1`, ...); and from the
  shared init with 0.3 (`dflash2-sel0.3`).
`--lanes 2` trains two runs at a time (one thread each). Every stage resumes: outputs that exist
are reused. `--step-cost` times one drafting step (drafter forward + LM head + the selector's
walk) of the trained `dflash` and `dflash2` drafters, interleaved, after a 200-token context.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from recipe import BASE_TRAIN_ARGS, HELD_OUT, INIT_ARGS, drafting_step_ms, flashdraft, prepare, run_lanes

TINY = ["--target-model", "tiny"]
RECIPE = ["--num-anchors", "16"]  # flashdraft's defaults otherwise: D-PACE + Muon
RUNS = {  # name: (init, extra train flags)
    "dflash": ("init", []),
    "dflash2": ("init-dflash2", ["--selector-missing-label", "inject"]),
    "dflash2-skip": ("init-dflash2", ["--selector-missing-label", "skip"]),
    "dflash2-sel0.3": ("init-dflash2", ["--selector-loss-weight", "0.3"]),
    "dflash-more": ("run-dflash", []),  # its newest checkpoint's drafter
    "dflash2-from": ("init-dflash2-from", []),
    "dflash2-from-sel0.1": ("init-dflash2-from", ["--selector-loss-weight", "0.1"]),
    "dflash2-from-sel0.3": ("init-dflash2-from", ["--selector-loss-weight", "0.3"]),
    "dflash2-from-sel3": ("init-dflash2-from", ["--selector-loss-weight", "3"]),
}
SECOND_PHASE = (
    "dflash-more",
    "dflash2-from",
    "dflash2-from-sel0.1",
    "dflash2-from-sel0.3",
    "dflash2-from-sel3",
)  # start from the trained `dflash`


def train_command(work: Path, name: str, steps: int) -> list[str]:
    from flashdraft.drafter.run_dir import latest_checkpoint

    init, extra = RUNS[name]
    init_dir = work / init
    if init.startswith("run-"):
        init_dir = latest_checkpoint(init_dir) / "drafter"
    return [
        sys.executable,
        "-m",
        "flashdraft",
        "train",
        *TINY,
        "--cached-hidden-states",
        str(work / "cache-train"),
        "--out",
        str(work / f"run-{name}"),
        "--init",
        str(init_dir),
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
        selector = figures.get("selector")
        if selector:  # DFlash2: the unary argmax path's tau and how often the label is in the top-K
            row[f"unary_tau_{set_name}"] = round(selector["unary_tau"], 4)
            row[f"top_k_coverage_{set_name}"] = round(selector["top_k_coverage"], 4)
    return row


def step_cost(work: Path, repeats: int = 5) -> dict:
    """Median milliseconds of one drafting step per trained drafter (`recipe.drafting_step_ms`) and their ratios."""
    ms = drafting_step_ms(work, ["dflash", "dflash2"], repeats)
    return {
        "step_ms": {k: round(v, 3) for k, v in ms.items()},
        "dflash2_over_dflash": round(ms["dflash2"] / ms["dflash"], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--step-cost", action="store_true", help="only time the drafting step of the trained drafters")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(args.work)
    if args.step_cost:
        print(json.dumps({"machine": platform.machine(), "threads": 1, **step_cost(work)}))
        return
    prepare(work)
    if not (work / "init-dflash2" / "model.safetensors").exists():
        flashdraft(["init", *TINY, "--out", str(work / "init-dflash2"), *INIT_ARGS, "--family", "dflash2"])
    command = lambda n: train_command(work, n, args.steps)  # noqa: E731
    run_lanes(work, [n for n in RUNS if n not in SECOND_PHASE], command, args.lanes)
    if not (work / "init-dflash2-from" / "model.safetensors").exists():
        flashdraft(
            [
                "init",
                *TINY,
                "--out",
                str(work / "init-dflash2-from"),
                "--family",
                "dflash2",
                "--from-drafter",
                str(work / "run-dflash"),
            ]
        )
    run_lanes(work, list(SECOND_PHASE), command, args.lanes)
    rows = [evaluate(work, name) for name in RUNS]
    for row in rows:
        print(json.dumps(row), flush=True)
    by = {r["run"]: r for r in rows}
    base = {name: "dflash-more" if name in SECOND_PHASE else "dflash" for name in RUNS if name.startswith("dflash2")}
    ratios = {f"{name} / {base[name]}": name for name in base}
    summary = {
        "machine": platform.machine(),
        "threads": 1,
        "lanes": args.lanes,
        "steps": args.steps,
        "ratios": {
            label: {s: round(by[run][f"tau_{s}"] / by[base[run]][f"tau_{s}"], 4) for s in HELD_OUT}
            for label, run in ratios.items()
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
