"""τ against the tree budget for each tree rule, and the budget the step-cost model predicts to pay, on the built-in
target: `flashdraft eval --tree RULE --tree-budget ...` offline (exact, greedy) over held-out code prompts.

    .venv/bin/python benchmarks/trees.py [--checkpoint DIR ...] [--num-prompts 8] [--max-new-tokens 128]
        [--budgets 1,2,4,8,16,32,64] [--width 4] [--threads 1]

Drafters: the shipped tiny drafter (default) and any `--checkpoint`; "ddtree" and "topk" on each, "beam" on each
turned DFlash2 by `init --family dflash2 --from-drafter` (a neutral selector: its scores are the unary logits, so the
beam is the unary top-K beam until the selector is trained). Prints one JSON line per drafter and rule: the chain's τ
and predicted speed-up, per budget τ, nodes verified per step and predicted speed-up (τ x t(plain step) / (t(draft)
+ t(build) + t(verify of N + 1 tokens)), each cost timed on the target at the first record's context), and the best
budget.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch

from flashdraft.api import evaluate_drafter
from flashdraft.drafter.checkpoint import save_drafter
from flashdraft.drafter.init import dflash2_from_drafter
from flashdraft.drafter.run_dir import load_any_drafter
from flashdraft.target.model import TargetModel

TINY_DRAFTER = Path(__file__).parents[1] / "flashdraft" / "assets" / "tiny-drafter"


def _row(label: str, rule: str, trees: dict, seconds: dict) -> dict:
    return {
        "drafter": label,
        "rule": rule,
        "width": trees["width"],
        "chain_tau": round(trees["chain"]["tau"], 3),
        "chain_predicted_speedup": trees["chain"]["predicted_speedup"],
        "budgets": [
            {
                "budget": r["budget"],
                "tau": round(r["tau"], 3),
                "nodes_per_step": round(r["nodes_per_step"], 2),
                "predicted_speedup": r.get("predicted_speedup"),
            }
            for r in trees["budgets"]
        ],
        "best_budget": trees["best_budget"],
        "best_beats_chain": trees["best_beats_chain"],
        "step_costs_ms": {k: round(1e3 * v, 3) for k, v in seconds.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", action="append", default=None)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="1,2,4,8,16,32,64")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load("tiny")
    budgets = [int(x) for x in args.budgets.split(",")]
    print(json.dumps({"machine": platform.machine(), "threads": args.threads, "budgets": budgets}))
    with tempfile.TemporaryDirectory() as work:
        for k, checkpoint in enumerate(args.checkpoint or [str(TINY_DRAFTER)]):
            dflash2 = Path(work) / f"dflash2-{k}"
            save_drafter(dflash2_from_drafter(load_any_drafter(checkpoint, target).drafter), dflash2)
            for rule, drafter in (("ddtree", checkpoint), ("topk", checkpoint), ("beam", str(dflash2))):
                summary = evaluate_drafter(
                    drafter,
                    target,
                    prompts="builtin:code:heldout",
                    num_prompts=args.num_prompts,
                    max_new_tokens=args.max_new_tokens,
                    tree=rule,
                    tree_budget=budgets,
                    tree_width=None if rule == "ddtree" else args.width,
                )
                trees = summary["trees"]
                costs = trees["step_costs"]
                seconds = {"plain_step": costs["plain_step_s"], "draft": costs["draft_s"]}
                seconds |= {"chain_verify": costs["chain_verify_s"]}
                seconds |= {f"verify_{n + 1}": c["verify_s"] for n, c in costs["budgets"].items()}
                print(json.dumps(_row(Path(checkpoint).name, rule, trees, seconds)), flush=True)


if __name__ == "__main__":
    main()
