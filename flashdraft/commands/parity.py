"""`flashdraft parity`: linear-attention backends compared layer by layer
(`flashdraft.target.parity.run_parity_command`, which takes each option by name); exit 1 below the threshold."""

from __future__ import annotations

import argparse
import sys

from flashdraft.commands.options import command_options, device_args, layer_list, positive


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("parity", help="compare linear-attention backends (fla, torch chunked/recurrent) layer by layer")
    p.add_argument("--target-model", required=True)
    p.add_argument("--prompts", default="builtin:code:heldout")
    p.add_argument("--num-prompts", type=positive, default=8)
    p.add_argument("--layers", type=layer_list, default=None, help="layers to compare (default: all)")
    p.add_argument("--checkpoint", default=None, help="compare this drafter's target_layer_ids")
    p.add_argument("--threshold", type=float, default=0.9999, help="fail below this minimum cosine similarity")
    device_args(p)
    return p


def run(args: argparse.Namespace) -> None:
    from flashdraft.target.parity import run_parity_command

    if not run_parity_command(**command_options(args)):
        sys.exit(1)
