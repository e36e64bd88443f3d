"""Recipe sweep on the built-in target: train drafters that differ in one recipe choice, from the
same init on the same cache for the same steps, and compare their held-out τ (offline, which
equals live decoding). Prints one JSON line per run and a closing JSON summary.

    python benchmarks/recipe.py --work WORKDIR --steps 1500 \
        --runs decay dpace-0.5 [--threads 1]

A run is a shorthand of dash-separated parts, each naming what differs from the published
recipe (decay + AdamW, which `decay` alone names): `dpace-A` (D-PACE, alpha A), `muon` (Muon +
AdamW), `anchors-N` (N anchors per sequence, default 16), `lr-X` (learning rate, default 6e-3),
`vocab-N` (an own LM head over N tokens): e.g. `dpace-0.5-muon` (flashdraft's defaults). Every stage is one
`flashdraft` command and resumes: outputs that exist are reused, so re-running continues.
The validation set (`builtin:stdlib:heldout:64`) and the code set (`builtin:code:heldout`,
never trained on) are both reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

TRAIN_PROMPTS = "builtin:stdlib:1200"  # about 470 k completion tokens of `tiny`
HELD_OUT = {"stdlib": "builtin:stdlib:heldout:64", "code": "builtin:code:heldout"}
MAX_NEW_TOKENS = 256
LAYERS = "1,2,3"
INIT_ARGS = ["--draft-layers", "2", "--block-size", "16", "--target-layer-ids", LAYERS, "--layers-from-target", "2,5"]
BASE_TRAIN_ARGS = ["--lr", "6e-3", "--batch-size", "8", "--epochs", "100", "--save-every", "500", "--log-every", "50"]


def flashdraft(args: list[str], log: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "flashdraft", *args]
    print("$ flashdraft " + " ".join(args), file=sys.stderr, flush=True)
    if log is None:
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    else:
        with open(log, "a") as f:
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)


def run_lanes(work: Path, names: list[str], command, lanes: int) -> None:
    """Train `names`, `lanes` at a time, `command(name)` each (its argv), logging to WORK/train-NAME.log."""
    pending, running = list(names), []
    while pending or running:
        while pending and len(running) < lanes:
            name = pending.pop(0)
            print(f"$ train {name}", file=sys.stderr, flush=True)
            log = open(work / f"train-{name}.log", "a")  # noqa: SIM115 (closed when the run ends)
            running.append((name, subprocess.Popen(command(name), stdout=log, stderr=log), log))
        time.sleep(5)
        for item in list(running):
            name, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                if proc.returncode != 0:
                    raise SystemExit(f"train {name} exited {proc.returncode}; see {work / f'train-{name}.log'}")


def drafting_step_ms(work: Path, names: list[str], repeats: int = 5) -> dict[str, float]:
    """Median milliseconds of one drafting step of each trained WORK/run-NAME drafter (its forward, LM head and
    family walk), interleaved: 40 steps after a 200-token context of a code record, one thread."""
    import statistics

    import torch

    from flashdraft.decoding.proposers import DFlashProposer
    from flashdraft.drafter.run_dir import load_any_drafter
    from flashdraft.evaluation.records import load_eval_records
    from flashdraft.target.model import TargetModel

    torch.set_num_threads(1)
    target = TargetModel.load("tiny")
    drafters = {name: load_any_drafter(work / f"run-{name}").drafter for name in names}
    records, _ = load_eval_records(target, completions=str(work / "code.json"))
    record = next(r for r in records if len(r.input_ids) >= 260)
    target.set_context_layers(drafters[names[0]].config.target_layer_ids)
    with torch.no_grad():
        features = target.forward(torch.tensor([record.input_ids[:240]])).context_features  # [1, 240, 3H]
    times: dict[str, list[float]] = {name: [] for name in drafters}
    with torch.no_grad():
        for _ in range(repeats):
            for name, drafter in drafters.items():
                block = drafter.config.block_size
                proposer = DFlashProposer(drafter, target)
                proposer.propose(record.input_ids[:201], 200, features[:, :200], torch.arange(200)[None], block)
                start = time.perf_counter()
                for i in range(200, 240):
                    proposer.propose(
                        record.input_ids[: i + 2], i + 1, features[:, i : i + 1], torch.tensor([[i]]), block
                    )
                times[name].append((time.perf_counter() - start) / 40)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def run_flags(name: str) -> list[str]:
    """Train flags of a run shorthand (module docstring)."""
    flags, parts = [], name.split("-")
    anchors, weighting, optimizer = "16", ["--loss-weighting", "decay"], ["--optimizer", "adamw"]
    i = 0
    while i < len(parts):
        if parts[i] == "decay":
            weighting = ["--loss-weighting", "decay"]
        elif parts[i] == "dpace":
            weighting = ["--loss-weighting", "dpace", "--dpace-alpha", parts[i + 1]]
            i += 1
        elif parts[i] == "anchors":
            anchors = parts[i + 1]
            i += 1
        elif parts[i] == "muon":
            optimizer = ["--optimizer", "muon"]
        elif parts[i] == "vocab":
            flags += ["--draft-vocab-size", parts[i + 1]]
            i += 1
        elif parts[i] == "lr":
            flags += ["--lr", parts[i + 1]]
            i += 1
        else:
            raise SystemExit(f"unknown run part {parts[i]!r} in {name!r}")
        i += 1
    return [*weighting, *optimizer, *flags, "--num-anchors", anchors]


def prepare(work: Path) -> None:
    """The completions and fp32 caches of the training and held-out sets, and the shared init (reused when there)."""
    work.mkdir(parents=True, exist_ok=True)
    tiny = ["--target-model", "tiny"]
    for name, prompts in {"train": TRAIN_PROMPTS, **HELD_OUT}.items():
        if not (work / f"{name}.json").exists():
            flashdraft(
                [
                    "generate",
                    *tiny,
                    "--prompts",
                    prompts,
                    "--out",
                    str(work / f"{name}.json"),
                    "--max-new-tokens",
                    str(MAX_NEW_TOKENS),
                    "--batch-size",
                    "64",
                ]
            )
        if not (work / f"cache-{name}" / "manifest.json").exists():
            flashdraft(
                [
                    "cache",
                    *tiny,
                    "--completions",
                    str(work / f"{name}.json"),
                    "--out",
                    str(work / f"cache-{name}"),
                    "--layers",
                    LAYERS,
                    "--dtype",
                    "fp32",
                ]
            )
    if not (work / "init" / "model.safetensors").exists():
        flashdraft(["init", *tiny, "--out", str(work / "init"), *INIT_ARGS])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--runs", nargs="+", default=["decay", "dpace-0.5"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-only", action="store_true", help="make completions, caches and the init, then stop")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    work = Path(args.work)
    tiny = ["--target-model", "tiny"]
    prepare(work)
    if args.data_only:
        return
    results = []
    for name in args.runs:
        run_dir = work / f"run-{name}-{args.steps}"
        t0 = time.time()
        flashdraft(
            [
                "train",
                *tiny,
                "--cached-hidden-states",
                str(work / "cache-train"),
                "--out",
                str(run_dir),
                "--init",
                str(work / "init"),
                *BASE_TRAIN_ARGS,
                "--max-steps",
                str(args.steps),
                *run_flags(name),
                "--resume",
            ],
            log=work / f"train-{name}-{args.steps}.log",
        )
        row = {
            "run": name,
            "steps": args.steps,
            "train_flags": run_flags(name),
            "train_wall_s": round(time.time() - t0),
        }
        for set_name in HELD_OUT:
            out = work / f"eval-{name}-{args.steps}-{set_name}.json"
            if not out.exists():
                flashdraft(
                    [
                        "eval",
                        "--checkpoint",
                        str(run_dir),
                        *tiny,
                        "--cached-hidden-states",
                        str(work / f"cache-{set_name}"),
                        "--json",
                        str(out),
                    ]
                )
            figures = json.loads(out.read_text())
            row[f"tau_{set_name}"] = round(figures["tau"], 4)
            row[f"position_acceptance_{set_name}"] = [round(x, 3) for x in figures["position_acceptance"][:6]]
        print(json.dumps(row), flush=True)
        results.append(row)
    base = next((r for r in results if r["run"] == "decay"), None)
    summary = {"machine": platform.machine(), "threads": args.threads, "steps": args.steps, "runs": results}
    if base is not None:
        summary["ratio_to_decay"] = {
            r["run"]: {s: round(r[f"tau_{s}"] / base[f"tau_{s}"], 4) for s in HELD_OUT} for r in results
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
