"""`flashdraft cache`: the target's context features of completions, cached for offline training
and eval (`flashdraft.api.cache_hidden_states`, which takes each option by name)."""

from __future__ import annotations

import argparse

from flashdraft.commands.options import (
    command_options,
    device_args,
    engine_args,
    positive,
    stops,
    target_layer_ids,
    verify_share_arg,
)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "cache",
        help="cache the target's context features of completions (resumable, torchrun-able)",
        epilog=stops("record", "re-running the same command keeps the finished shards"),
    )
    p.add_argument("--target-model", required=True)
    p.add_argument("--completions", required=True, help="completions file from flashdraft generate")
    p.add_argument("--out", required=True, help="cache directory (a re-run resumes it)")
    p.add_argument("--layers", type=target_layer_ids, default=None, help="target layer ids, e.g. 1,6,11")
    p.add_argument(
        "--draft-config",
        default=None,
        help="take the layer ids from this drafter (directory, tiny-drafter, training run or config.json)",
    )
    p.add_argument("--num-prompts", type=positive, default=None, help="cache only the first N records")
    p.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="storage dtype of the features; auto (default): the dtype the target computes them in "
        "(fp32 on CPU, bf16 on GPU; see --target-dtype), so offline τ equals live τ step for step; "
        "bf16 halves an fp32 cache, offline τ then within rounding of live τ",
    )
    p.add_argument(
        "--with-target-logits",
        type=int,
        default=None,
        metavar="K",
        help="also store the target's top-K logits per token (separate files); default none, 64 for a "
        "--draft-config DSpark drafter (its loss reads them)",
    )
    p.add_argument("--records-per-shard", type=positive, default=64)
    p.add_argument(
        "--allow-foreign-completions",
        "--allow-foreign",
        dest="allow_foreign",
        action="store_true",
        help="accept completions made by another target",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write even when the size estimate (tokens x layers x hidden x dtype bytes) exceeds the "
        "free space of --out's filesystem (refused by default, before any forward)",
    )
    engine_args(p, "capture the hidden states (vLLM's extract_hidden_states)")
    verify_share_arg(p, 0.05, "samples (besides a known-answer probe every run recomputes)")
    p.add_argument("--tensor-parallel-size", type=positive, default=1, help="with --engine: the engine's TP size")
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="with --engine: capture with the engine's prefix caching on (off by default: it has "
        "returned fewer states than tokens, vLLM #44485; each sample's length is checked)",
    )
    p.add_argument("--verbose", action="store_true", help="a line per record: its tokens and feature statistics")
    device_args(p)
    return p


def run(args: argparse.Namespace) -> None:
    from flashdraft.api import cache_hidden_states

    cache_hidden_states(**command_options(args))
