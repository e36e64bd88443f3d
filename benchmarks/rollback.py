"""Rollback of a hybrid target after partial acceptance: flashdraft's way (restore the
linear layers' states, re-run only their token mixers over the accepted prefix, crop KV)
against re-running the whole target over the accepted tokens from a saved cache.

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

from flashdraft.target import TargetModel


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


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
    for keep in sorted({1, 2, args.block // 4, args.block // 2, args.block}):
        ours_ms, rerun_ms = [], []
        for _ in range(args.repeats):
            cache = copy.deepcopy(base)
            target.forward(block, cache)
            t0 = time.perf_counter()
            target.rollback(cache, keep)
            ours_ms.append((time.perf_counter() - t0) * 1000)
            saved = copy.deepcopy(base)  # the alternative: keep a whole copy, re-run the accepted tokens
            t0 = time.perf_counter()
            target.forward(block[:, :keep], saved)
            rerun_ms.append((time.perf_counter() - t0) * 1000)
        ours, rerun = statistics.median(ours_ms), statistics.median(rerun_ms)
        print(json.dumps({
            "benchmark": "rollback", "target": str(target.path), "machine": platform.processor() or platform.machine(),
            "threads": args.threads, "block": args.block, "accepted_tokens": keep, "rollback_ms": round(ours, 3),
            "rerun_ms": round(rerun, 3), "rerun_over_rollback": round(rerun / ours, 2),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
