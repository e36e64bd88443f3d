"""Batched greedy generation: completion tokens/s of `generate_batch` (left padding, one
batched KV/recurrent cache) at several batch sizes, on the same prompts, and whether each
batch's output equals batch-1 greedy decoding of the same prompts.

    .venv/bin/python benchmarks/generate.py [--target-model tiny] [--prompts builtin:stdlib:64]
        [--batch-sizes 1,8,32,64] [--max-new-tokens 128] [--threads 1]

Batch 1 runs on `--batch1-prompts` prompts only (it is the slow one), spread evenly over the
lengths; every larger batch size runs on all prompts in batches of that size, prompts sorted by
length as `flashdraft generate` does (give a few hundred prompts: with only as many prompts as the
batch, one batch pads every row to the longest prompt, which `generate` over a large set does not).
Prints one JSON line per batch size, then a summary line with the best batch's speed-up over
batch 1 and the minutes 1 M completion tokens would take.

`--compile both` (`generate --compile`): every batch size above 1 also decoded on the target's static cache, each
token after the prefill one 1-token step at the batch's width compiled once by inductor (`CompiledBatch`); a warm-up
batch of the longest prompts compiles first (its seconds: `compile_s`), then the same prompts are timed, compiled
and eager interleaved by batch. Its line adds `compiled_tokens_per_s`, `compiled_over_eager`, `equals_eager` and
what compiled after the warm-up (`compiles_after_warm_up`, `recompiles`, `graph_breaks`: 0 when one graph served
every batch).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace

import torch

from flashdraft.data.prompts import encode_text, load_prompts
from flashdraft.decoding.batched import CompiledBatch, generate_batch
from flashdraft.target.model import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-model", default="tiny")
    ap.add_argument("--prompts", default="builtin:stdlib:64")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch1-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", choices=["eager", "both"], default="eager")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = TargetModel.load(args.target_model)
    prompts = [encode_text(target.tokenizer, p.turns[0], False) for p in load_prompts(args.prompts, quiet=True)]
    prompts.sort(key=len)
    batch1_outputs: dict[int, list[int]] = {}
    rates = {}
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        todo = list(range(len(prompts)))
        if batch_size == 1:  # evenly spread over the sorted lengths: the shortest would flatter batch 1
            todo = todo[:: max(1, len(prompts) // args.batch1_prompts)][: args.batch1_prompts]
        compiled = CompiledBatch(width=batch_size) if args.compile == "both" and batch_size > 1 else None
        compile_s = 0.0
        if compiled is not None:  # the warm-up: its compile, untimed
            start = time.perf_counter()
            # the longest prompts: the static cache sized for every batch after (a larger one would compile again)
            generate_batch(target, [prompts[i] for i in todo[-batch_size:]], args.max_new_tokens, compiled=compiled)
            compile_s, warm = time.perf_counter() - start, replace(compiled.counts)
        tokens, same, same_compiled, seconds, compiled_seconds = 0, True, True, 0.0, 0.0
        for first in range(0, len(todo), batch_size):
            rows = todo[first : first + batch_size]
            start = time.perf_counter()
            outputs = generate_batch(target, [prompts[i] for i in rows], args.max_new_tokens)
            seconds += time.perf_counter() - start
            if compiled is not None:
                start = time.perf_counter()
                same_compiled &= outputs == generate_batch(
                    target, [prompts[i] for i in rows], args.max_new_tokens, compiled=compiled
                )
                compiled_seconds += time.perf_counter() - start
            for i, (ids, _) in zip(rows, outputs, strict=True):
                tokens += len(ids)
                if batch_size == 1:
                    batch1_outputs[i] = ids
                elif i in batch1_outputs:
                    same &= batch1_outputs[i] == ids
        rates[batch_size] = tokens / seconds
        line = {
            "batch_size": batch_size,
            "prompts": len(todo),
            "completion_tokens": tokens,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(rates[batch_size], 1),
            "equals_batch_1": same if batch_size > 1 else None,
        }
        if compiled is not None:
            line |= {
                "compiled_tokens_per_s": round(tokens / compiled_seconds, 1),
                "compiled_over_eager": round(seconds / compiled_seconds, 2),
                "equals_eager": same_compiled,
                "compile_s": round(compile_s, 1),
                "compiles_after_warm_up": compiled.counts.compiles - warm.compiles,
                "recompiles": compiled.counts.recompiles,
                "graph_breaks": compiled.counts.graph_breaks,
            }
        print(json.dumps(line), flush=True)
    best = max(rates, key=rates.get)
    print(
        json.dumps(
            {
                "summary": True,
                "target": args.target_model,
                "threads": args.threads,
                "machine": platform.machine(),
                "best_batch_size": best,
                "best_over_batch_1": round(rates[best] / rates[1], 2) if 1 in rates else None,
                "minutes_per_million_tokens": round(1e6 / rates[best] / 60, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
