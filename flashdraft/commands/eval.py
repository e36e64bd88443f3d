"""`flashdraft eval`: τ of a drafter offline or online, against a reference. Each option is an
`EvalConfig` field of the same name (`EvalConfig.option_names`), passed to `evaluate_drafter`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashdraft.commands.options import (
    block_size,
    chat_mode_args,
    compile_option,
    context_buckets,
    long_prompts_arg,
    positive,
    positive_list,
    probability,
    sampling_args,
    target_layer_ids,
    temperature,
)
from flashdraft.drafter.config import DEFAULT_BLOCK_SIZE
from flashdraft.errors import FlashdraftError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="τ of a drafter offline (target completions) or online, vs a reference")
    _drafter_args(p)
    _record_args(p)
    _step_args(p)
    _output_args(p)
    _loading_args(p)
    return p


def _drafter_args(p: argparse.ArgumentParser) -> None:
    """What drafts: a drafter, the n-gram baseline or both (the hybrid)."""
    p.add_argument("--checkpoint", help="drafter directory, training run directory or .pt/.safetensors")
    p.add_argument(
        "--drafter",
        choices=["dflash", "ngram", "hybrid"],
        default="dflash",
        help="ngram: the training-free n-gram prompt-lookup baseline (no --checkpoint); hybrid: the "
        "--checkpoint drafter and the lookup, choosing per step (docs/tiny.md)",
    )
    p.add_argument(
        "--hybrid-min-match",
        type=int,
        default=None,
        help="hybrid: propose the n-gram draft without running the drafter when it matched this many "
        "tokens (default: the tuned rule's, docs/benchmarks.md)",
    )
    p.add_argument(
        "--hybrid-ngram-prior",
        type=float,
        default=None,
        help="hybrid: floor of the drafter's probability of n-gram tokens when comparing the drafts "
        "(default: the tuned rule's)",
    )
    p.add_argument("--ngram-max", type=positive, default=3, help="longest n-gram the baseline looks up")
    p.add_argument("--ngram-min", type=positive, default=1, help="shortest n-gram the baseline looks up")


def _record_args(p: argparse.ArgumentParser) -> None:
    """The target, the records and how far each is walked."""
    p.add_argument("--target-model", required=True, help="local model directory or 'tiny'")
    p.add_argument("--cached-hidden-states", help="hidden-state cache directory (offline: no target forward)")
    p.add_argument("--completions", help="completions file from flashdraft generate")
    p.add_argument("--prompts", help="prompt file or builtin:code[:heldout]; completions are decoded greedily")
    p.add_argument("--num-prompts", type=positive, default=None)
    chat_mode_args(p)
    p.add_argument("--max-blocks", type=positive, default=None, help="steps per prompt (default: whole completion)")
    p.add_argument(
        "--max-new-tokens",
        type=positive,
        default=None,
        help="tokens to decode per prompt without completions (default: max-blocks x B + 1, else 256)",
    )
    p.add_argument(
        "--block-size",
        type=block_size,
        default=None,
        help=f"default: the drafter's (n-gram: {DEFAULT_BLOCK_SIZE}, or the drafter's)",
    )


def _step_args(p: argparse.ArgumentParser) -> None:
    """Which drafts a step verifies, live or offline, greedy or sampled."""
    p.add_argument(
        "--num-speculative-tokens",
        type=positive,
        default=None,
        metavar="K",
        help="verify only the first K of the B - 1 drafts each step (vLLM's name; default all)",
    )
    p.add_argument(
        "--adaptive-threshold",
        type=probability,
        default=None,
        metavar="P",
        help="verify drafts only up to the first whose top drafter probability is under P "
        "(none if the first is: a plain greedy step; lossless; with --num-speculative-tokens, "
        "at most K)",
    )
    p.add_argument(
        "--confidence-threshold",
        type=probability,
        default=None,
        metavar="C",
        help="DSpark: verify drafts only up to the first whose confidence-head estimate is under C "
        "(DeepSpec's evaluator's threshold cut, not the servers' adaptive verification; lossless); "
        "eval always reports the head's calibration and the tau and cost of cutting at "
        "0.3/0.5/0.7/0.9 and C",
    )
    _tree_args(p)
    p.add_argument("--online", action="store_true", help="real speculative decoding with the target, timed")
    compile_option(p)
    p.add_argument(
        "--temperature",
        type=temperature,
        default=0.0,
        help="sampling temperature (0 = greedy); offline at T > 0 the completions must be the target's "
        "samples at the settings (--prompts: eval samples them)",
    )
    sampling_args(p)


def _tree_args(p: argparse.ArgumentParser) -> None:
    """Draft trees: the servers' tree rules, offline and online (docs/evaluation.md)."""
    p.add_argument(
        "--tree",
        choices=["ddtree", "topk", "beam"],
        default=None,
        help="also evaluate tree verification (greedy): ddtree (DDTree, vLLM #42910), topk (SGLang #31069's "
        "top-k tree), beam (SGLang #36196's DFlash2 selector beam); per budget tau, nodes per step and the "
        "predicted speed-up, the best budget named",
    )
    p.add_argument(
        "--tree-budget",
        type=positive_list,
        default=None,
        metavar="N[,N...]",
        help="nodes each tree verifies beside the root (the target verifies N + 1 tokens per step)",
    )
    p.add_argument(
        "--tree-width",
        type=positive,
        default=None,
        metavar="W",
        help="topk and beam: nodes kept per depth (default 4; 1 is the chain)",
    )


def _output_args(p: argparse.ArgumentParser) -> None:
    """What is compared and written."""
    p.add_argument(
        "--check-consistency",
        action="store_true",
        help="run offline and online and require identical acceptance lengths",
    )
    p.add_argument(
        "--reference", help="a second drafter, evaluated on the same records and steps ('ngram': the n-gram baseline)"
    )
    p.add_argument(
        "--compare-target",
        default=None,
        metavar="DIR",
        help="also evaluate against this reference target (e.g. the bf16 one when --target-model is quantised), each "
        "on its own records, and print τ side by side, the drop and the share of positions where the two targets' "
        "greedy tokens differ (docs/quantised.md)",
    )
    p.add_argument(
        "--compare-completions", default=None, metavar="FILE", help="with --compare-target: its own completions"
    )
    p.add_argument(
        "--compare-cached-hidden-states",
        default=None,
        metavar="DIR",
        help="with --compare-target: its own hidden-state cache",
    )
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument("--report", help="write report.md and PNG plots into this directory")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="a line per record while evaluating, and the per-position, "
        "per-prompt and per-context-length tables in the summary",
    )
    p.add_argument(
        "--served",
        choices=["vllm"],
        default=None,
        help="also serve the drafter in vLLM (started on 127.0.0.1 for this run, or --server), read the "
        "engine's spec-decode counters per request and set them beside flashdraft's walk of the same "
        "outputs (the `served` figures)",
    )
    p.add_argument(
        "--check-served",
        action="store_true",
        help="with --served: exit 1 unless the engine served as flashdraft computes (T = 0: each "
        "request's output, steps and per-position acceptance equal; T > 0: served τ within the "
        "error of the expected τ, outputs samples of the target's p)",
    )
    p.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="with --served: a running vLLM serving this drafter (e.g. http://127.0.0.1:8000), in place "
        "of one started for the run",
    )
    p.add_argument(
        "--engine-python",
        default=None,
        metavar="PATH",
        help="with --served: the Python of an environment with vLLM (default: "
        "$FLASHDRAFT_ENGINE_PYTHON, else the .venv-engine the project's set-up makes)",
    )
    p.add_argument(
        "--context-buckets",
        type=context_buckets,
        default=None,
        metavar="EDGES",
        help="context-length buckets of the by-context figures, e.g. 0,512,2048,8192 (tokens before a "
        "step's anchor; default: powers of two spanning the records)",
    )


def _loading_args(p: argparse.ArgumentParser) -> None:
    """How the drafter, the records and the target are loaded."""
    p.add_argument(
        "--target-layer-ids",
        type=target_layer_ids,
        default=None,
        help="for a bare state dict: the target layers its fc was trained on (e.g. 1,6,11)",
    )
    p.add_argument("--mask-token-id", type=int, default=None, help="for a bare state dict")
    p.add_argument(
        "--allow-foreign-completions",
        dest="allow_foreign",
        action="store_true",
        help="accept completions made by another target",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the sha256 check of a cache or training checkpoint (sizes still checked)",
    )
    long_prompts_arg(p)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    from flashdraft.api import evaluate_drafter
    from flashdraft.evaluation.config import EvalConfig
    from flashdraft.evaluation.report import format_summary, write_report
    from flashdraft.evaluation.run import require_consistent

    hf_logging.disable_progress_bar()  # eval prints what it loaded itself; an error stays one line
    if (args.drafter == "ngram") == (args.checkpoint is not None):
        raise FlashdraftError(
            "give --checkpoint for a DFlash drafter (alone or --drafter hybrid), or --drafter ngram (which takes none)"
        )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype)
    options = {name: getattr(args, name) for name in EvalConfig.option_names()}
    if args.compare_target:
        from flashdraft.evaluation.compare_targets import CompareTarget, evaluate_against_both

        if args.drafter == "hybrid":
            raise FlashdraftError("--compare-target evaluates a --checkpoint drafter or ngram, not --drafter hybrid")
        compare = CompareTarget(args.compare_target, args.compare_completions, args.compare_cached_hidden_states)
        summary = evaluate_against_both(
            args.checkpoint or "ngram",
            args.target_model,
            compare,
            device=args.device,
            dtype=dtype,
            log=print,
            options=options,
        )
    else:
        summary = evaluate_drafter(
            args.checkpoint or "ngram",
            args.target_model,
            hybrid=args.drafter == "hybrid",
            device=args.device,
            dtype=dtype,
            log=print,
            **options,
        )
    print()
    print(format_summary(summary, verbose=args.verbose))
    if summary.get("compare_target"):
        from flashdraft.evaluation.compare_targets import format_comparison

        print()
        print(format_comparison(summary["compare_target"]))
    if args.json:
        from flashdraft.files import write_json_atomic

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(args.json), summary, what="the evaluation figures (--json)")
        print(f"wrote {args.json}")
    if args.report:
        if Path(args.report).exists():
            print(f"{args.report} exists: its report.md and plots are replaced")
        print(f"wrote {write_report(summary, args.report)}")
    require_consistent(summary)
    if summary.get("compare_target"):
        require_consistent(summary["compare_target"]["reference_summary"])
    served = summary.get("served")
    if args.check_served and served is not None and not served["check"]["passed"]:
        print(
            f"error: flashdraft eval: {served['engine']} did not serve the drafter as flashdraft computes it: "
            f"{served['check']['problems'][0]}",
            file=sys.stderr,
        )
        sys.exit(1)
