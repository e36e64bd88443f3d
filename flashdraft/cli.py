"""Command-line interface: argument parsing only; the work lives in the modules."""

from __future__ import annotations

import argparse
import sys
import time

from flashdraft.errors import FlashdraftError


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value}")
    return n


def cmd_init(args: argparse.Namespace) -> None:
    from flashdraft.checkpoint import save_drafter
    from flashdraft.drafter_init import new_drafter_for_target
    from flashdraft.target import TargetModel

    target = TargetModel.load(args.target_model)
    drafter = new_drafter_for_target(
        target, num_layers=args.draft_layers, block_size=args.block_size, mask_token_id=args.mask_token_id,
        seed=args.seed,
    )  # fmt: skip
    save_drafter(drafter, args.out)
    cfg = drafter.config
    print(
        f"wrote untrained drafter to {args.out}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"block size {cfg.block_size}, target_layer_ids {cfg.target_layer_ids} of {cfg.num_target_layers}, "
        f"mask token {cfg.mask_token_id} ({target.tokenizer.convert_ids_to_tokens(cfg.mask_token_id)!r})"
    )


def cmd_speculate(args: argparse.Namespace) -> None:
    from flashdraft.checkpoint import load_drafter
    from flashdraft.decode import greedy_generate, speculative_generate
    from flashdraft.target import TargetModel

    target = TargetModel.load(args.target_model)
    drafter = load_drafter(args.checkpoint)
    prompt_ids = target.tokenizer(args.prompt)["input_ids"]
    print(f"target {target.path} ({target.num_layers} layers, linear-attention backend: {target.linear_backend})")
    t0 = time.perf_counter()
    spec = speculative_generate(target, drafter, prompt_ids, args.max_new_tokens, block_size=args.block_size)
    t_spec = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain = greedy_generate(target, prompt_ids, args.max_new_tokens)
    t_plain = time.perf_counter() - t0
    print(args.prompt + target.tokenizer.decode(spec.output_ids))
    print(
        f"tokens {len(spec.output_ids)}, steps {len(spec.acceptance_lengths)}, tau {spec.tau:.2f}, "
        f"lossless {spec.output_ids == plain.output_ids}, "
        f"speculative {len(spec.output_ids) / t_spec:.1f} tok/s, greedy {len(plain.output_ids) / t_plain:.1f} tok/s"
    )
    if spec.output_ids != plain.output_ids:
        raise FlashdraftError("speculative output differs from greedy decoding (not lossless)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft", description="Train and evaluate DFlash drafters.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="write a fresh, untrained drafter for a target")
    p.add_argument("--target-model", required=True, help="local model directory or 'tiny'")
    p.add_argument("--out", required=True)
    p.add_argument("--draft-layers", type=_positive, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("speculate", help="speculative decoding of one prompt, checked against greedy")
    p.add_argument("--target-model", required=True)
    p.add_argument("--checkpoint", required=True, help="drafter directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=_positive, default=64)
    p.add_argument("--block-size", type=int, default=None)
    p.set_defaults(func=cmd_speculate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except FlashdraftError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
