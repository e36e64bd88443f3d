"""The draft-tree loop eager against compiled on the built-in target: `tree_generate` with the tree verified on the
target's growing cache, then on its static cache (`SpeculativeConfig(compile=True)`: the tree padded to the budget,
one verify and one commit graph, the drafter's two graphs, inductor), on the same prompts, interleaved by prompt.

    .venv/bin/python benchmarks/tree_decode.py [--checkpoint DIR] [--num-prompts 4] [--max-new-tokens 64]
        [--rule ddtree] [--budget 8] [--threads 1]

A warm-up generation of the longest prompt compiles first (its seconds: `compile_s`; the static cache is sized for
the longest generation, so one graph serves every prompt). Prints one JSON line: eager and compiled tokens/s and
their ratio, τ, whether both wrote the same tokens and the greedy output, and what compiled after the warm-up
(`compiles_after_warm_up`, `recompiles`, `graph_breaks`: 0 when the graphs held).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from flashdraft.decoding.generate import SpeculativeConfig, autoregressive_generate
from flashdraft.decoding.tree import TreeRule, tree_generate
from flashdraft.drafter.run_dir import load_any_drafter
from flashdraft.evaluation.records import load_eval_records
from flashdraft.target.model import TargetModel

TINY_DRAFTER = Path(__file__).parents[1] / "flashdraft" / "assets" / "tiny-drafter"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(TINY_DRAFTER))
    ap.add_argument("--prompts", default="builtin:code:heldout")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rule", choices=("ddtree", "topk"), default="ddtree")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load("tiny")
    records, _ = load_eval_records(target, prompts=args.prompts, num_prompts=args.num_prompts)
    prompts = [r.prompt_ids for r in records]
    drafter = load_any_drafter(args.checkpoint, target).drafter
    rule = TreeRule(args.rule, args.budget)
    positions = max(len(p) for p in prompts) + args.max_new_tokens
    eager = SpeculativeConfig(compile=False)
    compiled = SpeculativeConfig(compile=True, static_positions=positions)
    start = time.perf_counter()
    warm = tree_generate(target, drafter, max(prompts, key=len), args.max_new_tokens, rule, compiled)
    compile_s = time.perf_counter() - start
    seconds = {"eager": 0.0, "compiled": 0.0}
    tokens, steps, same, lossless = 0, 0, True, True
    compiles = recompiles = breaks = 0
    for prompt in prompts:
        plain = autoregressive_generate(target, prompt, args.max_new_tokens).output_ids
        outs = {}
        for name, config in (("eager", eager), ("compiled", compiled)):
            start = time.perf_counter()
            outs[name] = tree_generate(target, drafter, prompt, args.max_new_tokens, rule, config)
            seconds[name] += time.perf_counter() - start
        run = outs["compiled"]
        compiles, recompiles, breaks = compiles + run.compiles, recompiles + run.recompiles, breaks + run.graph_breaks
        same &= run.output_ids == outs["eager"].output_ids
        lossless &= run.output_ids == plain
        tokens += len(run.output_ids)
        steps += len(run.acceptance_lengths)
    print(
        json.dumps(
            {
                "rule": args.rule,
                "budget": args.budget,
                "prompts": len(prompts),
                "tokens": tokens,
                "tau": round((tokens - len(prompts)) / max(steps, 1), 3),
                "eager_tokens_per_s": round(tokens / seconds["eager"], 1),
                "compiled_tokens_per_s": round(tokens / seconds["compiled"], 1),
                "compiled_over_eager": round(seconds["eager"] / seconds["compiled"], 2),
                "same_tokens": same,
                "lossless": lossless,
                "compile_s": round(compile_s, 1),
                "warm_up_compiles": warm.compiles,
                "compiles_after_warm_up": compiles,
                "recompiles": recompiles,
                "graph_breaks": breaks,
                "threads": args.threads,
                "machine": platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
