"""`flashdraft generate`: the target's own completions of a prompt set
(`flashdraft.api.generate_completions`, which takes each option by name)."""

from __future__ import annotations

import argparse

from flashdraft.commands.options import (
    chat_mode_args,
    command_options,
    device_args,
    engine_args,
    filter_args,
    long_prompts_arg,
    positive,
    stops,
    temperature,
    verify_share_arg,
)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate",
        help="the target's own completions of a prompt set (resumable, torchrun-able)",
        epilog=stops("batch", "re-running the same command finishes it"),
    )
    p.add_argument("--target-model", required=True, help="local model directory or 'tiny'")
    p.add_argument(
        "--prompts",
        required=True,
        help=".jsonl/.parquet, dataset dir, builtin:code[:heldout], builtin:stdlib[:heldout][:N]",
    )
    p.add_argument("--out", required=True, help="completions file to write (a re-run resumes it)")
    p.add_argument("--num-prompts", type=positive, default=None)
    p.add_argument("--max-new-tokens", type=positive, default=256)
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per record, independent of batching)")
    filter_args(p)
    p.add_argument("--batch-size", type=positive, default=8, help="prompts per forward (or concurrent requests)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="decode locally on a static cache, every token after the prefill one 1-token step at the --batch-size "
        "width compiled once (torch.compile; CUDA graphs on CUDA); off by default: on CPU the first compile costs "
        "more than it saves on small runs",
    )
    p.add_argument("--backend", choices=["local", "openai"], default="local")
    p.add_argument("--base-url", help="OpenAI-compatible server for --backend openai, e.g. http://localhost:8000/v1")
    p.add_argument("--server-model", help="model name on the server (default: the first it lists)")
    p.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template (default: where the target has one)",
    )
    chat_mode_args(p)
    long_prompts_arg(p)
    p.add_argument(
        "--min-prompt-tokens",
        type=positive,
        default=0,
        metavar="N",
        help="leave out turns whose prompt (template applied, earlier turns included) has fewer than N "
        "tokens: long-context rows from any dataset",
    )
    engine_args(p, "generate")
    verify_share_arg(p, 0.05, "completions")
    device_args(p)
    return p


def run(args: argparse.Namespace) -> None:
    from flashdraft.api import generate_completions

    generate_completions(**command_options(args))
