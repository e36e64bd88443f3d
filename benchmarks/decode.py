"""Speculative against plain greedy decoding on the built-in target: tokens/s, speed-up and τ
for trained drafters (`--checkpoint`, repeatable), each also as the hybrid with prompt lookup
(`flashdraft.decoding.hybrid`, drafter "hybrid:DIR"), and the n-gram prompt-lookup baseline.

    .venv/bin/python benchmarks/decode.py [--target-model tiny] [--checkpoint DIR ...] [--num-prompts 8]
        [--max-new-tokens 256] [--block-size B] [--threads 1] [--num-speculative-tokens 1,2,4,8,15]
        [--adaptive-threshold 0.3,0.5,0.8] [--hybrid-min-match M --hybrid-ngram-prior P]

Prompts: the first N of builtin:code:heldout, encoded as `flashdraft eval --prompts` does.
After a warm-up, each prompt is decoded plainly and then by every drafter in turn (so a
slow-down of a shared machine hits all of them alike); every speculative output is checked
token for token against the plain one. Each drafter runs verifying all B - 1 drafts, then
once per `--num-speculative-tokens` k (the first k drafts) and per `--adaptive-threshold` p
(drafts up to the first with top probability under p; DFlash drafters only: an n-gram draft
has probability 1). Prints one JSON line per drafter and setting: τ, speed-up, the bound
τ x t(greedy step) / (t(draft) + t(verify)) with the per-step costs measured inside the decode
loop, and speed-up / bound; each step's time split into drafting, verification and the
bookkeeping around them, and the device-to-host reads per step (`flashdraft.decoding.host_transfers`);
then per drafter its best setting. The plain greedy figures are the same in each line. On a CPU
the tiny target runs fastest on one thread.
A last line ("verify_cost") gives what a speculative step pays the target: t_step_1, one
token after a 200-token cached prefix, t_verify_17, a 17-token block there, and their ratio
(median ms of interleaved runs); a drafter with τ below the ratio cannot speed decoding up.

Compiled (`--compile both`, the default; `eager` or `compiled` alone): every line is run twice, eagerly and with the
target's verify on its static cache compiled once by inductor (`SpeculativeConfig(compile=True)`), the greedy
baseline likewise (plain decoding as a 1-token static verify, compiled); each line says which ("compiled"), with the
compiles, recompiles and graph breaks of its runs after the warm-up (0 when the graph held) and the warm-up's compile
seconds. A line "decode_compiled_vs_greedy" then sets each drafter's best compiled speculative tokens/s against
compiled greedy decoding (and the eager pair beside it). "verify_cost" then also gives the compiled 1- and 17-token
steps on the static cache, their ratio and the eager / compiled step-time ratios, all four interleaved in one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from functools import partial

import torch

from flashdraft.decoding.generate import (
    SpeculativeConfig,
    autoregressive_generate,
    speculative_generate,
    static_autoregressive_generate,
)
from flashdraft.decoding.hybrid import HybridDrafter, HybridRule
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.decoding.proposers import DraftLimit
from flashdraft.drafter.run_dir import load_any_drafter
from flashdraft.evaluation.records import load_eval_records
from flashdraft.evaluation.results import speedup_bound
from flashdraft.target.model import TargetModel
from flashdraft.target.static_cache import static_verifier


def verify_cost(target: TargetModel, prefix_ids: list[int], repeats: int = 40, compiled: bool = False) -> dict:
    """Median ms of the target's forward over 1 and over 17 new tokens after a cached prefix; `compiled`: also the
    compiled static verify of 1 and of 17 tokens there (never committed), all four interleaved, so a slow-down of a
    shared machine hits every one alike."""
    mode, target.rollback_mode = target.rollback_mode, "recompute"  # keep=0 below: just restore the cache
    cache = target.new_cache()
    target.forward(torch.tensor([prefix_ids]), cache)
    blocks = {n: torch.tensor([prefix_ids[:n]]) for n in (1, 17)}

    def eager(n: int) -> None:
        target.forward(blocks[n], cache)
        target.rollback(cache, 0)

    steps = {("eager", n): partial(eager, n) for n in blocks}
    if compiled:
        for n in blocks:
            verifier = static_verifier(target, n, len(prefix_ids) + n, backend="inductor")
            prefilled = target.new_cache()
            target.forward(torch.tensor([prefix_ids]), prefilled)
            verifier.start(prefilled, len(prefix_ids))
            verifier.verify(blocks[n])  # the compile (none when the decoding runs compiled it)
            steps["compiled", n] = partial(lambda v, ids: v.verify(ids).logits.sum().item(), verifier, blocks[n])
    ms = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            t0 = time.perf_counter()
            step()
            ms[key].append((time.perf_counter() - t0) * 1000)
    target.rollback_mode = mode
    m = {key: statistics.median(v) for key, v in ms.items()}
    costs = {
        "t_step_1": round(m["eager", 1], 3),
        "t_verify_17": round(m["eager", 17], 3),
        "verify_cost_ratio": round(m["eager", 17] / m["eager", 1], 3),
    }
    if compiled:  # eager / compiled is what compiling saves
        costs |= {
            "t_step_1_compiled": round(m["compiled", 1], 3),
            "t_verify_17_compiled": round(m["compiled", 17], 3),
            "verify_cost_ratio_compiled": round(m["compiled", 17] / m["compiled", 1], 3),
            "step_1_eager_over_compiled": round(m["eager", 1] / m["compiled", 1], 3),
            "verify_17_eager_over_compiled": round(m["eager", 17] / m["compiled", 17], 3),
        }
    return costs


def settings(drafter, block: int, ks: list[int], thresholds: list[float]) -> list[DraftLimit | None]:
    """All B - 1 drafts, each k that fits the block, each threshold (for a drafter with confidences)."""
    limits = [None] + [DraftLimit(num_speculative_tokens=k) for k in ks if k < block - 1]
    if not isinstance(drafter, NGramProposer):  # one-hot n-gram drafts: every threshold keeps them all
        limits += [DraftLimit(adaptive_threshold=p) for p in thresholds]
    return limits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-model", default="tiny")
    ap.add_argument("--checkpoint", action="append", default=[], help="a drafter (repeatable); n-gram always runs")
    ap.add_argument("--prompts", default="builtin:code:heldout")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=None, help="default: each drafter's own (n-gram: 16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hybrid-min-match", type=int, default=HybridRule.min_match)
    ap.add_argument("--hybrid-ngram-prior", type=float, default=HybridRule.ngram_prior)
    ap.add_argument(
        "--num-speculative-tokens",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[],
        help="k values to sweep, e.g. 1,2,3,4,6,8,15",
    )
    ap.add_argument(
        "--adaptive-threshold",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[],
        help="thresholds to sweep, e.g. 0.3,0.5,0.8",
    )
    ap.add_argument(
        "--compile",
        choices=("both", "eager", "compiled"),
        default="both",
        help="run each line eagerly, compiled (static cache, inductor), or both (default)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.target_model)
    records, _ = load_eval_records(target, prompts=args.prompts, num_prompts=args.num_prompts)
    drafters = {}  # name -> (drafter or proposer, block size)
    for path in args.checkpoint:
        drafter = load_any_drafter(path, target).drafter
        drafters[path] = (drafter, args.block_size or drafter.config.block_size)
        hybrid = HybridDrafter(
            drafter, NGramProposer(target.vocab_size), HybridRule(args.hybrid_min_match, args.hybrid_ngram_prior)
        )
        drafters[f"hybrid:{path}"] = (hybrid, drafters[path][1])
    drafters["ngram"] = (NGramProposer(target.vocab_size), args.block_size or 16)

    modes = {"both": [False, True], "eager": [False], "compiled": [True]}[args.compile]
    runs = [
        (name, drafter, block, limit, compiled)
        for compiled in modes
        for name, (drafter, block) in drafters.items()
        for limit in settings(drafter, block, args.num_speculative_tokens, args.adaptive_threshold)
    ]

    # the warm-up: every graph compiled here, on the longest generation any record asks for (one static cache)
    warm = records[0].prompt_ids
    longest = max(len(r.prompt_ids) for r in records) + args.max_new_tokens
    autoregressive_generate(target, warm, 16)
    warm_up = {}  # each line's setting -> its warm-up (a limit of k drafts verifies k + 1 tokens: graphs of its own)
    for name, drafter, block, limit, compiled in runs:
        config = SpeculativeConfig(block_size=block, limit=limit, compile=compiled, static_positions=longest)
        warm_up[name, limit, compiled] = speculative_generate(target, drafter, warm, 16, speculative=config)
    if True in modes:
        t0 = time.perf_counter()
        # on the longest record: the static cache the timed records need, compiled once
        static_autoregressive_generate(target, max((r.prompt_ids for r in records), key=len), args.max_new_tokens)
        greedy_compile_s = time.perf_counter() - t0

    greedy = {compiled: {"tokens": 0, "seconds": 0.0} for compiled in modes}
    stats = [
        {
            "tokens": 0,
            "seconds": 0.0,
            "draft": 0.0,
            "verify": 0.0,
            "steps_s": 0.0,
            "reads": 0,
            "lengths": [],
            "lossless": True,
            "compiles": 0,
            "recompiles": 0,
            "graph_breaks": 0,
        }
        for _ in runs
    ]
    for record in records:
        plain = None
        for compiled in modes:
            t0 = time.perf_counter()
            if compiled:
                output_ids = static_autoregressive_generate(target, record.prompt_ids, args.max_new_tokens).output_ids
            else:
                output_ids = autoregressive_generate(target, record.prompt_ids, args.max_new_tokens).output_ids
            greedy[compiled]["seconds"] += time.perf_counter() - t0
            greedy[compiled]["tokens"] += len(output_ids)
            plain = plain or output_ids
        for s, (_, drafter, block, limit, compiled) in zip(stats, runs, strict=True):
            t0 = time.perf_counter()
            config = SpeculativeConfig(block_size=block, limit=limit, compile=compiled, static_positions=longest)
            spec = speculative_generate(target, drafter, record.prompt_ids, args.max_new_tokens, speculative=config)
            s["seconds"] += time.perf_counter() - t0
            s["tokens"] += len(spec.output_ids)
            s["draft"], s["verify"] = s["draft"] + spec.draft_seconds, s["verify"] + spec.verify_seconds
            s["steps_s"], s["reads"] = s["steps_s"] + spec.decode_seconds, s["reads"] + spec.host_transfers
            s["lengths"] += spec.acceptance_lengths
            s["lossless"] &= spec.output_ids == plain
            for key in ("compiles", "recompiles", "graph_breaks"):
                s[key] += getattr(spec, key)

    best = {}  # (drafter, compiled) -> its fastest line
    for s, (name, _, block, limit, compiled) in zip(stats, runs, strict=True):
        greedy_tokens, greedy_seconds = greedy[compiled]["tokens"], greedy[compiled]["seconds"]
        greedy_tps, greedy_step = greedy_tokens / greedy_seconds, greedy_seconds / greedy_tokens
        steps = max(len(s["lengths"]), 1)
        tau = sum(s["lengths"]) / steps
        speedup = s["tokens"] / s["seconds"] / greedy_tps
        bound = speedup_bound(tau, greedy_step, s["draft"] / steps, s["verify"] / steps)
        line = {
            "benchmark": "decode",
            "target": str(target.path),
            "drafter": name,
            "block_size": block,
            "num_speculative_tokens": limit.num_speculative_tokens if limit else block - 1,
            "adaptive_threshold": limit.adaptive_threshold if limit else None,
            "machine": platform.processor() or platform.machine(),
            "threads": args.threads,
            "prompts": len(records),
            "max_new_tokens": args.max_new_tokens,
            "tokens": s["tokens"],
            "tau": round(tau, 3),
            "spec_tokens_per_s": round(s["tokens"] / s["seconds"], 1),
            "greedy_tokens_per_s": round(greedy_tps, 1),
            "speedup": round(speedup, 3),
            "speedup_bound": round(bound, 3),
            "speedup_of_bound": round(speedup / bound, 3),
            "step_ms": round(1000 * s["steps_s"] / steps, 3),
            "draft_ms": round(1000 * s["draft"] / steps, 3),
            "verify_ms": round(1000 * s["verify"] / steps, 3),
            # the rest of a step: acceptance, rollback, the drafter's context, the loop's own Python
            "bookkeeping_ms": round(1000 * (s["steps_s"] - s["draft"] - s["verify"]) / steps, 3),
            "host_transfers_per_step": round(s["reads"] / steps, 3),
            "greedy_step_ms": round(1000 * greedy_step, 3),
            "lossless": s["lossless"],
            # compiled: the target's verify on its static cache, compiled by inductor, and so the greedy baseline
            "compiled": compiled,
            "compiles_after_warm_up": s["compiles"],
            "recompiles": s["recompiles"],
            "graph_breaks": s["graph_breaks"],
            "warm_up_compile_seconds": round(warm_up[name, limit, compiled].compile_seconds, 1) if compiled else None,
            "greedy_warm_up_seconds": round(greedy_compile_s, 1) if compiled else None,
        }
        print(json.dumps(line))
        if (name, compiled) not in best or speedup > best[name, compiled]["speedup"]:
            best[name, compiled] = line
    for (name, compiled), line in best.items():
        keys = ("num_speculative_tokens", "adaptive_threshold", "tau", "speedup", "speedup_bound", "speedup_of_bound")
        keys += ("spec_tokens_per_s", "greedy_tokens_per_s")
        print(
            json.dumps({"benchmark": "decode_best", "drafter": name, "compiled": compiled} | {k: line[k] for k in keys})
        )
    if True in modes:  # one line: each drafter's best, speculative against greedy with both compiled (and eagerly)
        summary = {
            "benchmark": "decode_compiled_vs_greedy",
            "target": str(target.path),
            "threads": args.threads,
            "greedy_tokens_per_s": {
                ("compiled" if c else "eager"): round(greedy[c]["tokens"] / greedy[c]["seconds"], 1) for c in modes
            },
        }
        for name in drafters:
            summary[name] = {
                ("compiled" if c else "eager"): {
                    k: best[name, c][k] for k in ("tau", "spec_tokens_per_s", "speedup", "num_speculative_tokens")
                }
                for c in modes
            }
        print(json.dumps(summary))
    prefix = [t for r in records for t in r.prompt_ids] * 200  # 200 tokens of real prompts
    costs = verify_cost(target, prefix[:200], compiled=True in modes)
    print(
        json.dumps(
            {
                "benchmark": "verify_cost",
                "target": str(target.path),
                "linear_backend": target.linear_backend,
                "machine": platform.processor() or platform.machine(),
                "threads": args.threads,
                "prefix_tokens": 200,
                **costs,
            }
        )
    )


if __name__ == "__main__":
    main()
