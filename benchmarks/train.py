"""Drafter training throughput and peak memory at several drafter sizes, from the tiny
target's drafter up to the Qwen3.6-27B drafter shape (the large ones on GPU only).

    .venv/bin/python benchmarks/train.py [--sizes tiny,small] [--steps 5] [--seq-len 512]

Each size runs in its own process (so peak memory is that size's alone) and prints one JSON
line: context tokens/s, block positions/s and peak memory (GPU: max allocated; CPU: peak RSS).
Synthetic features and tokens; the step is the real one (drafter forward with the training
mask, LM head on trained positions, hard CE, backward, AdamW).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

SIZES = {  # hidden, layers, heads, kv heads, head_dim, intermediate, vocab, context layers, GPU only
    "tiny": (256, 1, 4, 2, 64, 768, 4096, 1, False),
    "small": (1024, 2, 16, 8, 64, 3072, 32000, 3, False),
    "qwen3-8b-drafter": (4096, 5, 32, 8, 128, 12288, 151936, 5, True),
    "qwen3.6-27b-drafter": (5120, 5, 32, 8, 128, 17408, 248320, 5, True),
}


def run_one(name: str, steps: int, seq_len: int, num_anchors: int, block: int) -> dict:
    from flashdraft.drafter.config import DrafterConfig
    from flashdraft.drafter.model import DFlashDrafter
    from flashdraft.train.blocks import build_blocks, sample_anchors
    from flashdraft.train.loss import BlockLabels, DraftHeads, LossSpec, block_loss

    hidden, layers, heads, kv, hd, inter, vocab, n_ctx, _ = SIZES[name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = DrafterConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        intermediate_size=inter,
        vocab_size=vocab,
        num_target_layers=64,
        target_layer_ids=list(range(1, 1 + n_ctx)),
        mask_token_id=vocab - 1,
        block_size=block,
    )
    drafter = DFlashDrafter(cfg).to(device)
    drafter.init_weights()
    embed = torch.nn.Embedding(vocab, hidden).to(device).requires_grad_(False)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(device).requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 1, (seq_len,), generator=gen)
    loss_mask = torch.arange(seq_len) >= seq_len // 8
    anchors = sample_anchors(loss_mask, num_anchors, gen)
    block_ids, labels = build_blocks(ids, loss_mask, anchors, block, cfg.mask_token_id)
    features = torch.randn(1, seq_len, n_ctx * hidden, generator=gen).to(device)
    positions = torch.arange(seq_len)[None].to(device)
    block_ids, labels, anchors = block_ids[None].to(device), labels[None].to(device), anchors[None].to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            out = drafter(embed(block_ids), anchors, features, positions)
            parts = block_loss(out, BlockLabels(labels), DraftHeads(head), LossSpec(block, gamma=7.0))
        (parts.weighted_sum / parts.weight_total).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "benchmark": "train",
        "size": name,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "parameters_m": round(sum(p.numel() for p in drafter.parameters()) / 1e6, 2),
        "seq_len": seq_len,
        "anchors": len(anchors[0]),
        "block_size": block,
        "steps": steps,
        "context_tokens_per_s": round(steps * seq_len / elapsed, 1),
        "block_positions_per_s": round(steps * block_ids.shape[1] / elapsed, 1),
        "peak_memory_mb": round(peak / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-anchors", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.steps, args.seq_len, args.num_anchors, args.block_size)))
        return
    for name in args.sizes.split(","):
        if SIZES[name][-1] and not torch.cuda.is_available():
            print(json.dumps({"benchmark": "train", "size": name, "skipped": "GPU only (no CUDA device here)"}))
            continue
        cmd = [
            sys.executable,
            __file__,
            "--one",
            name,
            "--steps",
            str(args.steps),
            "--seq-len",
            str(args.seq_len),
            "--num-anchors",
            str(args.num_anchors),
            "--block-size",
            str(args.block_size),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        print(out.stdout.strip() if out.returncode == 0 else json.dumps({"size": name, "error": out.stderr[-300:]}))


if __name__ == "__main__":
    main()
