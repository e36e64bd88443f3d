"""Rollback of a hybrid target after partial acceptance, as the cost of a speculative step's
"put the cache back, then run the next block": flashdraft's two exact ways (`recompute`:
restore the linear layers' states and re-run only their token mixers over the accepted
prefix; `deferred`: restore, and re-feed the accepted tokens in front of the next block)
against re-running the whole target over the accepted tokens from a saved copy.

    .venv/bin/python benchmarks/rollback.py [--target-model tiny] [--block 16] [--repeats 30]

Prints one JSON line per accepted length. Times are medians in ms on this machine; compare
the ratio, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

from flashdraft.target.model import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-model", default="tiny")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.target_model)
    assert target.is_hybrid, "rollback only differs from cropping on a hybrid target"
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (1, args.prompt_tokens), generator=gen)
    block = torch.randint(0, target.vocab_size, (1, args.block), generator=gen)
    base = target.new_cache()
    target.forward(prompt, base)
    for keep in sorted({1, 2, args.block // 4, args.block // 2, args.block - 1}):
        # what a speculative step pays after verifying a block: put the cache back to the
        # accepted tokens, then run the next block
        costs = {"recompute": [], "deferred": [], "rerun": []}
        for _ in range(args.repeats):
            for mode in ("recompute", "deferred"):
                target.rollback_mode = mode
                cache = copy.deepcopy(base)
                target.forward(block, cache)
                t0 = time.perf_counter()
                target.rollback(cache, keep)
                target.forward(block, cache)
                costs[mode].append((time.perf_counter() - t0) * 1000)
            saved = copy.deepcopy(base)  # the plain way: a whole copy, re-run the accepted tokens
            t0 = time.perf_counter()
            target.forward(block[:, :keep], saved)
            target.forward(block, saved)
            costs["rerun"].append((time.perf_counter() - t0) * 1000)
        ms = {mode: statistics.median(v) for mode, v in costs.items()}
        print(
            json.dumps(
                {
                    "benchmark": "rollback",
                    "target": str(target.path),
                    "machine": platform.machine(),
                    "threads": args.threads,
                    "block": args.block,
                    "accepted_tokens": keep,
                    "recompute_then_next_block_ms": round(ms["recompute"], 3),
                    "deferred_then_next_block_ms": round(ms["deferred"], 3),
                    "rerun_then_next_block_ms": round(ms["rerun"], 3),
                    "rerun_over_recompute": round(ms["rerun"] / ms["recompute"], 2),
                    "rerun_over_deferred": round(ms["rerun"] / ms["deferred"], 2),
                }
            )
        )


if __name__ == "__main__":
    main()
