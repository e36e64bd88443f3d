"""`flashdraft parity`: linear-attention backends compared layer by layer with an fp32 reference, in each dtype
(`run_parity_command`, which takes the options as one `ParityConfig`, over `flashdraft.target.parity`); exit 1
when an error is over its allowance. The prompts are rendered here: the target wing knows no prompt sets."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from flashdraft.commands.options import command_options, device_args, layer_list, positive

DTYPES = ("fp32", "bf16", "fp16")


def dtype_list(value: str) -> tuple[str, ...]:
    """'fp32,bf16' -> the dtype names, checked."""
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    if not names or any(n not in DTYPES for n in names):
        raise argparse.ArgumentTypeError(f"{value!r}: expected dtypes from {', '.join(DTYPES)}, comma-separated")
    return names


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("parity", help="compare linear-attention backends (fla, torch chunked/recurrent) layer by layer")
    p.add_argument("--target-model", required=True)
    p.add_argument("--prompts", default="builtin:code:heldout")
    p.add_argument("--num-prompts", type=positive, default=8)
    p.add_argument("--layers", type=layer_list, default=None, help="layers to compare (default: all)")
    p.add_argument("--checkpoint", default=None, help="compare this drafter's target_layer_ids")
    p.add_argument(
        "--dtypes",
        type=dtype_list,
        default=("fp32", "bf16"),
        help="dtypes each backend runs in, against the fp32 reference (default fp32,bf16)",
    )
    p.add_argument(
        "--noise-factor",
        type=float,
        default=None,
        help="fail where a backend's error is over this many times the reference path's own error in that dtype "
        "(default 2) ...",
    )
    p.add_argument("--error-floor", type=float, default=None, help="... plus this relative error (default 3e-3)")
    device_args(p)
    return p


@dataclass(frozen=True)
class ParityConfig:
    """`flashdraft parity`'s settings: one field per option."""

    target_model: str
    prompts: str = "builtin:code:heldout"
    num_prompts: int = 8
    layers: list[int] | None = None  # target layers compared (None: all)
    checkpoint: str | None = None  # compare this drafter's target_layer_ids
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    noise_factor: float | None = None  # None: the library's default
    error_floor: float | None = None  # None: the library's default
    device: str | None = None
    target_dtype: str | None = None


def run(args: argparse.Namespace) -> None:
    if not run_parity_command(ParityConfig(**command_options(args))):
        sys.exit(1)


def run_parity_command(cfg: ParityConfig) -> bool:
    """`flashdraft parity`: prints the table; returns whether every backend passed in every dtype and case."""
    from flashdraft.data.cache_run import drafter_layer_ids
    from flashdraft.data.prompts import encode_text, has_chat_template, load_prompts, render_conversation
    from flashdraft.distributed import Dist, load_dtype, pick_device
    from flashdraft.errors import FlashdraftError
    from flashdraft.target.model import TargetModel
    from flashdraft.target.parity import print_parity, run_parity

    dev = pick_device(Dist(), cfg.device)
    target = TargetModel.load(cfg.target_model, dev, load_dtype(dev, cfg.target_dtype))
    if cfg.layers is not None and cfg.checkpoint is not None:
        raise FlashdraftError("give --layers or --checkpoint, not both")
    layer_ids = drafter_layer_ids(cfg.checkpoint)[0] if cfg.checkpoint else cfg.layers
    use_template = has_chat_template(target.tokenizer)
    token_ids = [
        encode_text(
            target.tokenizer, render_conversation(target.tokenizer, p.conversation([]), use_template), use_template
        )
        for p in load_prompts(cfg.prompts, cfg.num_prompts)
    ]
    rule = {"noise_factor": cfg.noise_factor, "error_floor": cfg.error_floor}  # None: the library's defaults
    result = run_parity(
        target,
        token_ids,
        layer_ids,
        dtypes=tuple(load_dtype(dev, name) for name in cfg.dtypes),
        **{k: v for k, v in rule.items() if v is not None},
    )
    print_parity(result, len(token_ids), sum(map(len, token_ids)))
    return result.passed
