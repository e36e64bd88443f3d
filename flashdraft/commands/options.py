"""What several commands share: argument types (each a one-line error on a bad value) and
option groups (sampling filters, long prompts, device, a long command's exit statuses)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flashdraft.errors import FlashdraftError

ROPE_SCALING_HELP = (
    'the drafter\'s RoPE scaling as JSON, e.g. \'{"rope_type": "yarn", "factor": 4, '
    '"original_max_position_embeddings": 1024}\' (YaRN: original = the context trained at before); '
    '\'{"rope_type": "default"}\' for native RoPE; written as rope_scaling and rope_parameters'
)


def positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value}")
    return n


def positive_list(value: str) -> list[int]:
    """Positive integers separated by commas, e.g. 4,8,16."""
    return [positive(x) for x in value.split(",")]


def block_size(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 (the anchor and at least one draft), found {value}")
    return n


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return float("nan")


def temperature(value: str) -> float:
    t = _number(value)
    if not 0 <= t < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 = greedy), found {value}")
    return t


def probability(value: str) -> float:
    x = _number(value)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"expected a probability in (0, 1], found {value}")
    return x


def positive_float(value: str) -> float:
    x = _number(value)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, found {value}")
    return x


def bool_(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, found {value!r}")
    return value.lower() == "true"


def _ints(value: str) -> list[int]:
    """Comma-separated integers (empty when one is not an integer)."""
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        return []


def layer_list(value: str) -> list[int]:
    """Comma-separated target layer ids, e.g. 1,6,11: non-empty, non-negative, distinct."""
    ids = _ints(value)
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct layer ids >= 0 such as 1,6,11; found {value!r}")
    return ids


def target_layer_ids(value: str) -> list[int]:
    """Target layer ids a drafter or cache reads, e.g. 1,6,11: unique and strictly increasing, the
    order vLLM and SGLang capture them in (else they reach the drafter permuted, or are refused)."""
    from flashdraft.drafter.config import LAYER_ORDER_RULE, strictly_increasing

    ids = _ints(value)
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected layer ids >= 0 such as 1,6,11; found {value!r}")
    if not strictly_increasing(ids):
        raise argparse.ArgumentTypeError(
            f"expected {LAYER_ORDER_RULE} (e.g. {','.join(map(str, sorted(set(ids))))}); found {value!r}"
        )
    return ids


def context_buckets(value: str) -> list[int]:
    from flashdraft.evaluation.results import parse_context_buckets

    try:
        return parse_context_buckets(value)
    except FlashdraftError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None


def layer_types(value: str) -> list[str]:
    from flashdraft.drafter.init import parse_layer_types

    try:
        return parse_layer_types(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def rope_scaling(value: str) -> dict:
    from flashdraft.drafter.rope import parse_rope_scaling

    try:
        return parse_rope_scaling(value)
    except FlashdraftError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def command_options(args: argparse.Namespace) -> dict[str, Any]:
    """A command's options by name (what the library function it calls takes), without those `main` reads."""
    return {name: value for name, value in vars(args).items() if name not in ("command", "func", "debug")}


def stops(unit: str, then: str, rerun: str = "the same command") -> str:
    """The exit statuses of a long command, for its --help."""
    return (
        f"SIGTERM (preemption) or SIGINT (Ctrl-C): stops after the {unit} in flight and exits 143 or 130; {then} "
        f"(the last line prints the command). A full disk: exit 2 and one line naming the file; nothing partial "
        f"is left, and {rerun} resumes once space is freed. A second process writing the same --out is refused "
        f"(exit 2)."
    )


def long_prompts_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--long-prompts",
        choices=["error", "skip", "truncate"],
        default="error",
        help="a prompt longer than the target's context minus --max-new-tokens: stop with an error "
        "(default), skip it, or keep its last tokens; skips and truncations are counted",
    )


def device_args(p: argparse.ArgumentParser) -> None:
    """Where the target runs (generate, cache, parity)."""
    p.add_argument("--device", default=None, help="default: cuda (this rank's GPU) when available, else cpu")
    p.add_argument(
        "--target-dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="dtype the target runs in (default: fp32 on CPU, bf16 on GPU)",
    )


def compile_option(p: argparse.ArgumentParser) -> None:
    """--compile / --no-compile: speculative decoding verifies on the target's static cache with one compiled graph
    (CUDA graphs on CUDA), or on the eager path (the default: `decoding.verification.compile_by_default`)."""
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="verify drafts on a static cache compiled once (torch.compile; CUDA graphs on CUDA), or eagerly "
        "(--no-compile, the default until a GPU run has measured it)",
    )


def sampling_args(p: argparse.ArgumentParser) -> None:
    """The server's rule at T > 0 and the request's filters (eval)."""
    from flashdraft.decoding.serving_rules import DEFAULT_RULE, RULES

    p.add_argument(
        "--serving-rule",
        choices=list(RULES),
        default=DEFAULT_RULE,
        help=f"how the server drafts and verifies at T > 0 (default {DEFAULT_RULE}: vLLM's default, "
        "argmax drafts accepted with p(d); vllm-probabilistic: sampled drafts, min(1, p/q); sglang: "
        "DFlash argmax, DFlash2/DSpark sampled walks; flashdraft doctor DIR --serving prints each)",
    )
    filter_args(p)


def filter_args(p: argparse.ArgumentParser) -> None:
    """The target-side sampling filters of a request at T > 0 (generate and eval)."""
    p.add_argument(
        "--top-k",
        type=positive,
        default=None,
        help="T > 0: keep the K likeliest target tokens (default: the target's generation_config.json)",
    )
    p.add_argument(
        "--top-p",
        type=probability,
        default=None,
        help="T > 0: keep the likeliest target tokens holding P of the mass (default: generation config)",
    )
    p.add_argument(
        "--min-p",
        type=probability,
        default=None,
        help="T > 0, vLLM rules: drop target tokens under P x the top probability (default: generation config)",
    )
    p.add_argument(
        "--no-generation-config",
        dest="use_generation_config",
        action="store_false",
        help="ignore the target's generation_config.json sampling defaults (top_k, top_p, min_p)",
    )


def engine_args(p: argparse.ArgumentParser, what: str) -> None:
    """The serving engine a command runs `what` with (flashdraft.serving.engine): vLLM, in its own environment."""
    p.add_argument(
        "--engine",
        choices=["vllm"],
        default=None,
        help=f"{what} with the serving engine: vLLM started on 127.0.0.1 for this run and stopped after "
        f"it (its environment: `make engine`), its output checked against the target",
    )
    p.add_argument(
        "--engine-python",
        default=None,
        metavar="PATH",
        help="the Python of an environment with vLLM (default: $FLASHDRAFT_ENGINE_PYTHON, else the "
        ".venv-engine the project's set-up makes)",
    )


def verify_share_arg(p: argparse.ArgumentParser, default: float, what: str) -> None:
    p.add_argument(
        "--verify-share",
        type=float,
        default=default,
        metavar="S",
        help=f"with --engine: the share of {what} recomputed by the transformers forward to check the "
        f"engine's (at least one; default {default:g})",
    )


# options naming an input that must exist (a built-in drafter's name aside): checked before any model loads
INPUT_PATHS = (
    "checkpoint",
    "init",
    "cached_hidden_states",
    "completions",
    "eval_cached_hidden_states",
    "eval_completions",
)


def require_inputs(args: argparse.Namespace) -> None:
    """An input option naming no file or directory is one line, before the command loads anything."""
    from flashdraft.drafter.run_dir import BUILTIN_DRAFTERS

    for name in INPUT_PATHS:
        value = getattr(args, name, None)
        if value is not None and str(value) not in BUILTIN_DRAFTERS and not Path(value).exists():
            raise FlashdraftError(f"--{name.replace('_', '-')} {value}: no such file or directory")


def chat_template_kwargs(value: str) -> dict:
    from flashdraft.data.chat_mode import parse_kwargs

    try:
        return parse_kwargs(value, "--chat-template-kwargs")
    except FlashdraftError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None


def chat_mode_args(p: argparse.ArgumentParser) -> None:
    """The chat template's mode a command renders prompts in (generate, eval): `data/chat_mode.py`."""
    p.add_argument(
        "--chat-template-kwargs",
        type=chat_template_kwargs,
        default=None,
        metavar="JSON",
        help="keyword arguments of the chat template, as the servers' request field of the name, e.g. "
        "'{\"enable_thinking\": false}' (default: the template's own; a prompt row's "
        "chat_template_kwargs over them); recorded per record with the template's hash",
    )
    thinking = p.add_mutually_exclusive_group()
    thinking.add_argument(
        "--enable-thinking",
        dest="enable_thinking",
        action="store_const",
        const=True,
        default=None,
        help="shorthand of enable_thinking true (Qwen3-style thinking templates)",
    )
    thinking.add_argument(
        "--disable-thinking",
        dest="enable_thinking",
        action="store_const",
        const=False,
        help="shorthand of enable_thinking false: the template writes an empty think block",
    )
