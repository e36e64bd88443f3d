"""`flashdraft speculate`: one prompt decoded speculatively, checked against greedy
(`flashdraft.decoding.generate.compare_with_greedy`)."""

from __future__ import annotations

import argparse

from flashdraft.commands.options import block_size, compile_option, positive


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("speculate", help="speculative decoding of one prompt, checked against greedy")
    p.add_argument("--target-model", required=True)
    p.add_argument(
        "--checkpoint",
        required=True,
        help="drafter directory (or tiny-drafter), training run directory or .pt/.safetensors",
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive, default=64)
    p.add_argument("--block-size", type=block_size, default=None, help="default: the drafter's")
    compile_option(p)
    return p


def run(args: argparse.Namespace) -> None:
    from flashdraft.api import Drafter, Target
    from flashdraft.decoding.generate import compare_with_greedy

    target = Target.from_pretrained(args.target_model)
    drafter = Drafter.from_pretrained(args.checkpoint, target)
    prompt_ids = target.encode(args.prompt)
    print(f"target {target.path} ({target.num_layers} layers, linear-attention backend: {target.linear_backend})")
    result = compare_with_greedy(
        target, drafter.model, prompt_ids, args.max_new_tokens, args.block_size, compile=args.compile
    )
    print(args.prompt + target.tokenizer.decode(result.speculative.output_ids))
    print(result.summary())
    result.check_lossless()
