"""`flashdraft doctor`: what a cache, drafter, run, state dict or completions file is, and what is
wrong with it (`flashdraft.doctor.run_doctor`); exit 1 when a check fails."""

from __future__ import annotations

import argparse
import sys

from flashdraft.commands.options import positive
from flashdraft.drafter.server_fields import SGLANG, VLLM
from flashdraft.errors import FlashdraftError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "doctor",
        help="what a cache, drafter, run, state dict or completions file is, and what is "
        "wrong with it (exit 0 clean, 1 problems found, 2 unusable)",
        description="Exit code: 0 when no check fails (warnings included), 1 when a check or serving "
        "rule fails, 2 when PATH cannot be checked at all.",
    )
    p.add_argument(
        "path",
        help="cache dir, drafter dir (or tiny-drafter), training run or checkpoint dir, .pt/.safetensors, or .json",
    )
    p.add_argument(
        "--target-model",
        default=None,
        help="check against this target (fingerprint, shapes, vocabulary, cache alignment)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="check a cache or completions file against this drafter (layer ids, vocabulary)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip sha256 checks (sizes and layout still checked)")
    p.add_argument(
        "--serving",
        action="store_true",
        help=f"a drafter directory: also each serving rule of {VLLM} and {SGLANG} (format, layer "
        "ids, causality per layer, mask token, file modes, V2 runner, reduced vocabulary, block size) as "
        "ok/warn/FAIL, and the exact vLLM and SGLang command lines; exit 1 when a rule fails (warnings "
        "do not)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive,
        default=None,
        help="with --serving: the context the drafter is served at (vLLM --max-model-len); default the "
        "target's max_position_embeddings; warned past the drafter's trained context",
    )
    p.add_argument(
        "--serving-command",
        default=None,
        metavar="CMD",
        help="with --serving: the sampling rule this vllm/sglang command line implies at T > 0 (the "
        "--serving-rule eval takes), in place of the rules of the commands doctor prints",
    )
    p.add_argument("--samples", type=positive, default=4, help="records re-run through the target")
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max relative error per layer (default: bf16 1e-2, fp16 2e-3, fp32 1e-4)",
    )
    return p


def run(args: argparse.Namespace) -> None:
    from flashdraft.doctor import ServingQuery, load_target_for, run_doctor

    serving = None
    if args.serving or args.serving_command is not None:
        name = args.target_model if args.target_model != "tiny" else None
        serving = ServingQuery(name, args.max_model_len, args.serving_command)
    elif args.max_model_len is not None:
        raise FlashdraftError(
            f"--max-model-len {args.max_model_len}: the context a drafter is served at; expected --serving with it"
        )
    target = load_target_for(args.path, args.target_model)
    if not run_doctor(
        args.path,
        target,
        args.checkpoint,
        samples=args.samples,
        tolerance=args.tolerance,
        verify=not args.no_verify,
        serving=serving,
    ):
        sys.exit(1)
