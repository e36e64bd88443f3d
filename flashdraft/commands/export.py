"""`flashdraft export`: any checkpoint form written in the public format, with its serving
commands and the serving rules checked (`flashdraft.serving.export`, `flashdraft.serving.checks`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from flashdraft.commands.options import block_size, target_layer_ids
from flashdraft.drafter.config import DEFAULT_BLOCK_SIZE


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="write any checkpoint form in the public format, with serving commands")
    p.add_argument("--checkpoint", required=True, help="drafter directory, training run directory or .pt/.safetensors")
    p.add_argument("--out", required=True)
    p.add_argument("--target-model", help="needed for a bare state dict; named in the README's commands")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto", help="auto: as stored")
    p.add_argument(
        "--block-size", type=block_size, default=None, help=f"for a bare state dict (default {DEFAULT_BLOCK_SIZE})"
    )
    p.add_argument("--target-layer-ids", type=target_layer_ids, default=None, help="for a bare state dict")
    p.add_argument("--mask-token-id", type=int, default=None, help="for a bare state dict")
    return p


def run(args: argparse.Namespace) -> None:
    from transformers.utils import logging as hf_logging

    from flashdraft.drafter.config import DrafterConfig
    from flashdraft.serving.checks import print_serving_checks
    from flashdraft.serving.export import export_drafter
    from flashdraft.target.weights import TargetHead

    hf_logging.disable_progress_bar()
    target = TargetHead.load(args.target_model) if args.target_model else None  # shapes and tokenizer only
    loaded = export_drafter(
        args.checkpoint,
        args.out,
        target,
        target_name=args.target_model,
        dtype=args.dtype,
        block_size=args.block_size,
        target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id,
    )
    cfg = DrafterConfig.load(Path(args.out) / "config.json")  # as written: is_causal stated where it can be
    for note in loaded.assumed:
        print(f"assumed: {note}")
    print(
        f"exported {loaded.describe()} to {args.out}: {cfg.num_hidden_layers} layers ({cfg.describe_layers()}), "
        f"target_layer_ids {cfg.target_layer_ids}, block size {cfg.block_size}; serving commands in "
        f"{Path(args.out) / 'README.md'}"
    )
    # the exported directory as the servers will read it: the same block as `doctor OUT --serving`
    print_serving_checks(args.out, target, args.target_model)
