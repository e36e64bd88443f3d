"""Training for a quantised target: the built-in tiny target (Qwen3.5 layout, bf16) quantised data-free with
compressed-tensors' W8A8 and FP8_DYNAMIC schemes (`tests/target/quantised_targets.py`, LM head left in bf16), and
for each scheme two drafters trained the same way on the same prompts, one from the bf16 target's states and
completions, one from the quantised target's, each evaluated on held-out prompts against the quantised target and
against the bf16 one (`eval --compare-target`: each target's own completions and states).

    .venv/bin/python benchmarks/quantised.py --work WORKDIR [--schemes W8A8,FP8_DYNAMIC] [--steps 300]

Prints one JSON line per (scheme, trained on): held-out τ against the quantised target and the bf16 one, the drop,
and the share of held-out positions where the two targets' greedy tokens differ (the same for both drafters of a
scheme). Figures: docs/quantised.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from flashdraft.target.model import TINY_DIR
from tests.target.quantised_targets import save_quantised_target

PROMPTS = "--prompts builtin:code --num-prompts 24 --max-new-tokens 48"
HELDOUT = "--prompts builtin:code:heldout --num-prompts 8 --max-new-tokens 48"


def flashdraft(work: Path, line: str) -> None:
    argv = [sys.executable, "-m", "flashdraft", *line.split()]
    done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"flashdraft {line}: exit {done.returncode}\n{done.stderr[-2000:]}")


def data(work: Path, name: str, target: Path) -> None:
    """The target's own completions (train and held out) and its states of them."""
    t = f"--target-model {target}"
    flashdraft(work, f"generate {t} {PROMPTS} --out {name}-train.json")
    flashdraft(work, f"generate {t} {HELDOUT} --out {name}-heldout.json")
    flashdraft(work, f"cache {t} --completions {name}-train.json --out {name}-cache --layers 0,2,4")
    flashdraft(work, f"cache {t} --completions {name}-heldout.json --out {name}-heldout-cache --layers 0,2,4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--schemes", default="W8A8,FP8_DYNAMIC")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    bf16 = work / "bf16"
    if not bf16.exists():
        bf16.symlink_to(TINY_DIR)
    data(work, "bf16", bf16)
    flashdraft(work, f"init --target-model {bf16} --out init --draft-layers 1 --block-size 8 --target-layer-ids 0,2,4")
    train = f"--init init --max-steps {args.steps} --lr 0.006 --num-anchors 8 --seed 0"
    for scheme in args.schemes.split(","):
        quantised = work / scheme.lower()
        if not quantised.exists():
            save_quantised_target(TINY_DIR, quantised, scheme)
        name = scheme.lower()
        data(work, name, quantised)
        disagreement = None
        for trained_on, cache, target in (("bf16", "bf16-cache", bf16), ("quantised", f"{name}-cache", quantised)):
            run = f"run-{name}-from-{trained_on}"
            flashdraft(work, f"train --target-model {target} --cached-hidden-states {cache} --out {run} {train}")
            out = f"eval-{name}-from-{trained_on}.json"
            flashdraft(
                work,
                f"eval --checkpoint {run} --target-model {quantised} --cached-hidden-states {name}-heldout-cache "
                f"--compare-target {bf16} --compare-cached-hidden-states bf16-heldout-cache --json {out}",
            )
            figures = json.loads((work / out).read_text())["compare_target"]
            disagreement = figures["greedy_disagreement"]["share"]
            row = {
                "scheme": scheme,
                "trained_on": trained_on,
                "steps": args.steps,
                "tau_vs_quantised": round(figures["served_tau"], 4),
                "tau_vs_bf16": round(figures["reference_tau"], 4),
                "drop": round(figures["drop"], 4),
                "greedy_disagreement": None if disagreement is None else round(disagreement, 4),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
