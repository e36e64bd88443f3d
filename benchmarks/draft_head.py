"""What a reduced drafter vocabulary saves: one drafting step (drafter forward over one block
after a cached context + its LM head) with the target's full head against an own head over
the N most frequent tokens (`train --draft-vocab-size N`), same weights otherwise, measured
in one run, interleaved; and the same count on paper for Qwen3.6-27B (248,320 -> 32,000).

    .venv/bin/python benchmarks/draft_head.py [--checkpoint tiny-drafter] [--draft-vocab-size 1024]
        [--context 200] [--repeats 200] [--threads 1]

Prints one JSON object: median ms per step for each head, their ratio, and the multiply-adds
per drafted token of the head against the drafter's layers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from flashdraft.decoding.proposers import DFlashProposer
from flashdraft.drafter.run_dir import load_any_drafter
from flashdraft.target.weights import TargetHead
from flashdraft.train.vocab import with_draft_vocabulary


def step_ms(proposer_of, drafter, target, context: int, repeats: int) -> list[float]:
    """Median-able times of propose() for one block after `context` cached positions."""
    h = drafter.config.num_context_layers * drafter.config.hidden_size
    features = torch.randn(1, context, h, generator=torch.Generator().manual_seed(0))
    proposer = proposer_of(drafter, target)
    proposer.propose([5] * (context + 1), context, features, torch.arange(context)[None], drafter.block_size)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        proposer.propose(
            [5] * (context + 2), context + 1, features[:, :1], torch.tensor([[context]]), drafter.block_size
        )
        times.append((time.perf_counter() - t0) * 1e3)
        proposer.cache.positions = proposer.cache.positions[:, :context]  # keep the context length fixed
        for layer in range(len(proposer.cache.keys)):
            proposer.cache.keys[layer] = proposer.cache.keys[layer][:, :, :context]
            proposer.cache.values[layer] = proposer.cache.values[layer][:, :, :context]
    return times


def head_macs(
    vocab: int, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
) -> dict:
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v projections per token
    mlp = 3 * hidden * intermediate
    return {"head": vocab * hidden, "layers": layers * (attn + mlp)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="tiny-drafter")
    ap.add_argument("--target-model", default="tiny")
    ap.add_argument("--draft-vocab-size", type=int, default=1024)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetHead.load(args.target_model)
    full = load_any_drafter(args.checkpoint).drafter
    ids = list(range(args.draft_vocab_size))  # which rows does not change the cost
    reduced = with_draft_vocabulary(full, ids, target.lm_head_weight)
    times = {"full": [], "reduced": []}
    with torch.no_grad():
        for _ in range(5):  # interleaved rounds: a slow-down of the machine hits both alike
            times["full"] += step_ms(DFlashProposer, full, target, args.context, args.repeats // 5)
            times["reduced"] += step_ms(DFlashProposer, reduced, target, args.context, args.repeats // 5)
    c = full.config
    tiny = head_macs(
        c.vocab_size,
        c.hidden_size,
        c.num_hidden_layers,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    )
    qwen36 = head_macs(248320, 5120, 5, 17408, 32, 8, 128)
    out = {
        "machine": platform.machine(),
        "threads": args.threads,
        "checkpoint": args.checkpoint,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": args.draft_vocab_size,
        "context": args.context,
        "step_ms_full_head": round(statistics.median(times["full"]), 3),
        "step_ms_reduced_head": round(statistics.median(times["reduced"]), 3),
        "tiny_head_share_of_macs_full": round(tiny["head"] / (tiny["head"] + tiny["layers"]), 3),
        "qwen36_27b_head_macs_per_token": {"full_248320": 248320 * 5120, "reduced_32000": 32000 * 5120},
        "qwen36_27b_head_share_of_macs": {
            "full": round(qwen36["head"] / (qwen36["head"] + qwen36["layers"]), 3),
            "reduced_32000": round(32000 * 5120 / (32000 * 5120 + qwen36["layers"]), 3),
        },
    }
    out["step_ratio_full_over_reduced"] = round(out["step_ms_full_head"] / out["step_ms_reduced_head"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
