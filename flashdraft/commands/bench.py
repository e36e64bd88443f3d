"""`flashdraft bench`: a drafter's speed-up where it is served, by prompt set and concurrency, beside the speed-up
flashdraft predicts. Each option is a `BenchConfig` field of the same name, passed to `run_bench`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashdraft.commands.options import chat_mode_args, filter_args, long_prompts_arg, positive, temperature
from flashdraft.errors import FlashdraftError


def concurrency_list(value: str) -> list[int]:
    try:
        levels = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"expected distinct positive integers such as 1,4,16; found {value!r}")
    return levels


def prompt_sets(value: str) -> list[str]:
    """Prompt sets separated by commas (a SPEED-Bench spec joins its categories with '+')."""
    from flashdraft.data.speed_bench import misread_category

    sets = [x.strip() for x in value.split(",") if x.strip()]
    if not sets:
        raise argparse.ArgumentTypeError(f"expected one prompt set or several separated by commas; found {value!r}")
    for previous, piece in zip(sets, sets[1:], strict=False):
        problem = misread_category(previous, piece)
        if problem:
            raise argparse.ArgumentTypeError(problem)
    return sets


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="a drafter's served speed-up (vLLM, with and without it) by prompt set and "
        "concurrency, beside the predicted one",
    )
    p.add_argument("--target-model", required=True, help="local model directory")
    p.add_argument("--checkpoint", required=True, help="drafter directory, training run directory or .pt/.safetensors")
    p.add_argument(
        "--prompts",
        type=prompt_sets,
        required=True,
        help="prompt sets, comma-separated (files in the public benchmark formats, dataset directories, "
        "builtin:code[:heldout], builtin:stdlib[:heldout][:N]); reported per set",
    )
    p.add_argument(
        "--concurrency",
        type=concurrency_list,
        default=[1],
        help="requests in flight at once, e.g. 1,4,16 (default 1); each needs that many prompts per set",
    )
    p.add_argument("--num-prompts", type=positive, default=None, help="the first N prompts of each set")
    p.add_argument("--max-new-tokens", type=positive, default=256, help="max_tokens of each request (default 256)")
    p.add_argument("--temperature", type=temperature, default=0.0, help="sampling temperature (0 = greedy)")
    filter_args(p)
    chat_mode_args(p)
    p.add_argument(
        "--repeats",
        type=positive,
        default=3,
        help="timed runs per server, set and concurrency (default 3): the speed-ups' errors",
    )
    p.add_argument("--warmups", type=int, default=2, help="warm-up requests before each timed run (default 2)")
    p.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="a running vLLM serving the target with this drafter, in place of one started for the run "
        "(with --baseline-server)",
    )
    p.add_argument(
        "--baseline-server",
        default=None,
        metavar="URL",
        help="a running vLLM serving the target alone, with --server's other settings",
    )
    p.add_argument(
        "--engine-python",
        default=None,
        metavar="PATH",
        help="the Python of an environment with vLLM: its servers and its benchmark client (default: "
        "$FLASHDRAFT_ENGINE_PYTHON, else the .venv-engine the project's set-up makes)",
    )
    long_prompts_arg(p)
    p.add_argument(
        "--work",
        default=None,
        metavar="DIR",
        help="where the servers' and the client's logs go (default: a new temporary directory, named in the output)",
    )
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--report", default=None, metavar="DIR", help="write report.md and PNG plots into this directory")
    p.add_argument("--device", default=None, help="where flashdraft's target and drafter run (the checks, τ)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    return p


def run(args: argparse.Namespace) -> None:
    from transformers.utils import logging as hf_logging

    from flashdraft.evaluation.bench import BenchConfig, run_bench
    from flashdraft.evaluation.bench_report import format_bench, write_bench_report

    hf_logging.disable_progress_bar()
    if args.warmups < 0:
        raise FlashdraftError(f"--warmups {args.warmups}: expected 0 or more")
    summary = run_bench(BenchConfig(**{name: getattr(args, name) for name in BenchConfig.option_names()}), log=print)
    print()
    print(format_bench(summary))
    if args.json:
        from flashdraft.files import write_json_atomic

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(args.json), summary, what="the bench figures (--json)")
        print(f"wrote {args.json}")
    if args.report:
        print(f"wrote {write_bench_report(summary, args.report)}")
    if not summary["lossless"]:
        print(
            "error: flashdraft bench: the servers' outputs are not the target's (lossless: false): "
            f"{next(p for s in summary['sets'] for p in s['problems'])}",
            file=sys.stderr,
        )
        sys.exit(1)
