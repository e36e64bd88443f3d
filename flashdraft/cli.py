"""Command-line interface: argument parsing only; the work lives in the modules."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path

from flashdraft.config import ARCHITECTURES, DEFAULT_BLOCK_SIZE, DFLASH2_FIELDS, DSPARK_MARKOV_RANK
from flashdraft.errors import FlashdraftError


class _Parser(argparse.ArgumentParser):
    """argparse with a user error on one line (what flashdraft promises for every user error),
    not the usage block: `flashdraft CMD --help` shows that."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value}")
    return n


def _block_size(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 (the anchor and at least one draft), found {value}")
    return n


def _temperature(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        t = float("nan")
    if not 0 <= t < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 = greedy), found {value}")
    return t


def _probability(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"expected a probability in (0, 1], found {value}")
    return x


def _layer_list(value: str) -> list[int]:
    """Comma-separated target layer ids, e.g. 1,6,11: non-empty, non-negative, distinct."""
    try:
        ids = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct layer ids >= 0 such as 1,6,11; found {value!r}")
    return ids


def _target_layer_ids(value: str) -> list[int]:
    """Target layer ids a drafter or cache reads, e.g. 1,6,11: unique and strictly increasing, the
    order vLLM and SGLang capture them in (else they reach the drafter permuted, or are refused)."""
    from flashdraft.config import LAYER_ORDER_RULE, strictly_increasing

    try:
        ids = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected layer ids >= 0 such as 1,6,11; found {value!r}")
    if not strictly_increasing(ids):
        raise argparse.ArgumentTypeError(
            f"expected {LAYER_ORDER_RULE} (e.g. {','.join(map(str, sorted(set(ids))))}); found {value!r}"
        )
    return ids


def _context_buckets(value: str) -> list[int]:
    from flashdraft.results import parse_context_buckets

    try:
        return parse_context_buckets(value)
    except FlashdraftError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None


def _layer_types(value: str) -> list[str]:
    from flashdraft.drafter_init import parse_layer_types

    try:
        return parse_layer_types(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bool(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, found {value!r}")
    return value.lower() == "true"


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, found {value}")
    return x


def _rope_scaling(value: str) -> dict:
    from flashdraft.rope import parse_rope_scaling

    try:
        return parse_rope_scaling(value)
    except FlashdraftError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


ROPE_SCALING_HELP = ("the drafter's RoPE scaling as JSON, e.g. '{\"rope_type\": \"yarn\", \"factor\": 4, "
                     "\"original_max_position_embeddings\": 1024}' (YaRN: original = the context trained at before); "
                     "'{\"rope_type\": \"default\"}' for native RoPE; written as rope_scaling and rope_parameters")


def cmd_init(args: argparse.Namespace) -> None:
    from flashdraft.checkpoint import save_drafter
    from flashdraft.config import DrafterConfig
    from flashdraft.drafter_init import SHAPE_FIELDS, copy_target_layers, new_drafter_for_target
    from flashdraft.run_dir import drafter_config_path
    from flashdraft.target_weights import TargetHead

    dflash2 = {name: getattr(args, name) for name in DFLASH2_FIELDS}
    if args.from_drafter:
        return _init_from_drafter(args, dflash2)
    # a published config is read before the target, so a broken one costs no model load
    base = DrafterConfig.load(drafter_config_path(args.config)) if args.config else None
    target = TargetHead.load(args.target_model)  # shapes, tokenizer and final norm (decoder layers only if copied)
    drafter = new_drafter_for_target(
        target, num_layers=args.draft_layers, block_size=args.block_size, mask_token_id=args.mask_token_id,
        target_layer_ids=args.target_layer_ids, seed=args.seed, layer_types=args.layer_types,
        sliding_window=args.sliding_window, is_causal=args.is_causal,
        shape={name: getattr(args, name) for name in SHAPE_FIELDS}, base=base, base_source=str(args.config),
        family=args.family, dflash2=dflash2, dspark=_dspark_settings(args),
    )  # fmt: skip
    if args.layers_from_target:
        copy_target_layers(drafter, target, args.layers_from_target)
    save_drafter(drafter, args.out)
    cfg = drafter.config
    start = f", layers from target layers {args.layers_from_target}" if args.layers_from_target else ""
    print(
        f"wrote untrained {cfg.architecture}{start} to {args.out}: {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, "
        f"block size {cfg.block_size}, target_layer_ids {cfg.target_layer_ids} of {cfg.num_target_layers}, "
        f"mask token {cfg.mask_token_id} ({target.tokenizer.convert_ids_to_tokens(cfg.mask_token_id)!r})"
    )
    _print_layers(cfg)


# --confidence-head: the DSpark confidence head's input, as config fields (enable, with_markov)
CONFIDENCE_HEADS = {"none": (False, False), "hidden": (True, False), "with-markov": (True, True)}


def _dspark_settings(args: argparse.Namespace) -> dict:
    """DSpark's init flags as `new_drafter_for_target(dspark=...)` takes them (None: not given)."""
    settings = {"markov_rank": args.markov_rank}
    if args.confidence_head is not None:
        settings["confidence_head"], settings["confidence_head_with_markov"] = CONFIDENCE_HEADS[args.confidence_head]
    return settings


def _print_layers(cfg) -> None:
    for i, attention in enumerate(cfg.layer_attention):
        print(f"  layer {i}: {attention.describe()}")
    print(f"  causality: {cfg.causality_source}")
    print(f"  architecture: {cfg.describe_family()}")
    print(f"  layout: {cfg.describe_layout()}")


# init flags that shape a fresh drafter; --from-drafter takes its shape from the drafter instead
_FRESH_ONLY = ("config", "draft_layers", "mask_token_id", "target_layer_ids", "layer_types", "sliding_window",
               "is_causal", "layers_from_target", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rope_theta", "max_position_embeddings", "rope_scaling")  # fmt: skip


def _init_from_drafter(args: argparse.Namespace, dflash2: dict) -> None:
    """`init --family dflash2 --from-drafter D`: D's backbone with DFlash2's parts started neutral."""
    from flashdraft.checkpoint import check_drafter_matches_target, save_drafter
    from flashdraft.drafter_init import dflash2_from_drafter
    from flashdraft.run_dir import load_any_drafter
    from flashdraft.target_weights import TargetHead

    if args.family != "dflash2":
        raise FlashdraftError(f"--from-drafter {args.from_drafter}: expected --family dflash2 (the family to turn "
                              f"the drafter into; a DSpark drafter's layout differs: it starts fresh)")  # fmt: skip
    given = [name for name in _FRESH_ONLY if getattr(args, name) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise FlashdraftError(f"{flag}: --from-drafter takes the drafter's shape and layers as they are; leave it out")
    target = TargetHead.load(args.target_model)
    drafter = load_any_drafter(args.from_drafter, target).drafter
    check_drafter_matches_target(drafter.config, target, str(args.from_drafter))
    new = dflash2_from_drafter(drafter, dflash2, args.block_size, args.seed)
    save_drafter(new, args.out)
    cfg = new.config
    print(f"wrote {cfg.architecture} to {args.out} from {args.from_drafter}: its backbone, identity convolutions "
          f"and a neutral selector (drafts as the drafter does until trained); block size {cfg.block_size}")
    _print_layers(cfg)


def cmd_speculate(args: argparse.Namespace) -> None:
    from flashdraft.api import Drafter, Target

    target = Target.from_pretrained(args.target_model)
    drafter = Drafter.from_pretrained(args.checkpoint, target)
    prompt_ids = target.encode(args.prompt)
    print(f"target {target.path} ({target.num_layers} layers, linear-attention backend: {target.linear_backend})")
    t0 = time.perf_counter()
    spec = drafter.generate(target, prompt_ids, args.max_new_tokens, block_size=args.block_size)
    t_spec = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain = target.generate(prompt_ids, args.max_new_tokens)
    t_plain = time.perf_counter() - t0
    print(args.prompt + target.tokenizer.decode(spec.output_ids))
    print(
        f"tokens {len(spec.output_ids)}, steps {len(spec.acceptance_lengths)}, tau {spec.tau:.2f}, "
        f"lossless {spec.output_ids == plain.output_ids}, "
        f"speculative {len(spec.output_ids) / t_spec:.1f} tok/s, greedy {len(plain.output_ids) / t_plain:.1f} tok/s"
    )
    if spec.output_ids != plain.output_ids:
        raise FlashdraftError("speculative output differs from greedy decoding (not lossless)")


EXIT_STATUSES = (
    "exit status: 0 done; 1 a check failed (doctor, parity); 2 a user error, a full disk (ENOSPC, EDQUOT, EFBIG) "
    "or an output another flashdraft process is writing, said on one line; 143 (SIGTERM) or 130 (SIGINT): train, "
    "generate and cache stopped gracefully after the unit in flight, their state on disk (the line says how to "
    "resume)"
)


def _stops(unit: str, then: str, rerun: str = "the same command") -> str:
    """The exit statuses of a long command, for its --help."""
    return (f"SIGTERM (preemption) or SIGINT (Ctrl-C): stops after the {unit} in flight and exits 143 or 130; {then} "
            f"(the last line prints the command). A full disk: exit 2 and one line naming the file; nothing partial "
            f"is left, and {rerun} resumes once space is freed. A second process writing the same --out is refused "
            f"(exit 2).")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flashdraft", description="Train and evaluate DFlash drafters.", epilog=EXIT_STATUSES)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices  # each command's parser (train reads --config into its own)

    p = sub.add_parser("init", help="write a fresh, untrained drafter for a target")
    p.add_argument("--target-model", required=True, help="local model directory or 'tiny'")
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=None, metavar="CONFIG_JSON",
                   help="start from this drafter's config.json (a config.json, a drafter directory, tiny-drafter or a "
                        "training run; e.g. a published one); the flags below override its "
                        "fields, and hidden_size, vocab_size and num_target_layers must match the target")  # fmt: skip
    p.add_argument("--draft-layers", type=_positive, default=None,
                   help="default: --config's, else the --layer-types count, else 1")  # fmt: skip
    p.add_argument("--block-size", type=_block_size, default=None,
                   help=f"default: --config's, else {DEFAULT_BLOCK_SIZE}")  # fmt: skip
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-layer-ids", type=_target_layer_ids, default=None,
                   help="strictly increasing; default: --config's, else the reference spread")  # fmt: skip
    p.add_argument("--layer-types", type=_layer_types, default=None,
                   help="sliding or full (or sliding_attention/full_attention), one per layer or one for all, e.g. "
                        "sliding,sliding,sliding,sliding,full; default: --config's, else full")  # fmt: skip
    p.add_argument("--sliding-window", type=_positive, default=None, help="keys a sliding layer sees (needed with "
                   "sliding layers, e.g. 2048)")  # fmt: skip
    p.add_argument("--is-causal", type=_bool, default=None, metavar="true|false",
                   help="in-block causality of every layer (default: the servers' rule: sliding layers causal, "
                        "full layers not)")  # fmt: skip
    for name, type_ in [("intermediate_size", _positive), ("num_attention_heads", _positive),
                        ("num_key_value_heads", _positive), ("head_dim", _positive), ("rope_theta", _positive_float),
                        ("max_position_embeddings", _positive)]:  # fmt: skip
        p.add_argument("--" + name.replace("_", "-"), type=type_, default=None, help="default: --config's, else the "
                       "target's")  # fmt: skip
    p.add_argument("--rope-scaling", type=_rope_scaling, default=None,
                   help=f"{ROPE_SCALING_HELP}; default: --config's, else native")  # fmt: skip
    p.add_argument("--layers-from-target", type=_layer_list, default=None,
                   help="start the drafter's layers from these full-attention layers of the target, one per "
                        "drafter layer (e.g. 2,5 for tiny); default: random init")  # fmt: skip
    p.add_argument("--family", choices=list(ARCHITECTURES), default=None,
                   help="dflash (DFlashDraftModel), dflash2 (DFlash2DraftModel: a grouped dynamic causal "
                        "convolution around each sublayer and a candidate selector; block size 8 by default) or "
                        "dspark (Qwen3DSparkModel: the anchor-first block, a Markov head and a confidence head; block "
                        "size 7 by default); default: --config's, else dflash")  # fmt: skip
    p.add_argument("--markov-rank", type=_positive, default=None,
                   help=f"DSpark (--family dspark): rank of the Markov head; default: --config's, else "
                        f"{DSPARK_MARKOV_RANK}")  # fmt: skip
    p.add_argument("--confidence-head", choices=list(CONFIDENCE_HEADS), default=None,
                   help="DSpark: the confidence head and its input (none; hidden: the hidden state; with-markov: also "
                        "the previous draft's Markov embedding); default: --config's, else with-markov")  # fmt: skip
    for name, published in DFLASH2_FIELDS.items():
        p.add_argument("--" + name.replace("_", "-"), type=_positive, default=None,
                       help=f"DFlash2 (--family dflash2); default: --config's, else {published} (as published)")
    p.add_argument("--from-drafter", default=None, metavar="DRAFTER",
                   help="with --family dflash2: start from this trained DFlash drafter (directory, run, "
                        "tiny-drafter): its weights, identity convolutions and a neutral selector, so it drafts "
                        "exactly as DRAFTER (greedy) until trained")  # fmt: skip
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("speculate", help="speculative decoding of one prompt, checked against greedy")
    p.add_argument("--target-model", required=True)
    p.add_argument("--checkpoint", required=True,
                   help="drafter directory (or tiny-drafter), training run directory or .pt/.safetensors")  # fmt: skip
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=_positive, default=64)
    p.add_argument("--block-size", type=_block_size, default=None, help="default: the drafter's")
    p.set_defaults(func=cmd_speculate)

    _add_data_commands(sub)
    _add_eval_commands(sub)
    _add_train_command(sub)
    _add_demo_command(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> None:
    from flashdraft.api import generate_completions

    generate_completions(
        args.target_model, args.prompts, args.out, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, seed=args.seed, batch_size=args.batch_size, backend=args.backend,
        base_url=args.base_url, server_model=args.server_model, chat_template=args.chat_template, device=args.device,
        target_dtype=args.target_dtype, long_prompts=args.long_prompts, min_prompt_tokens=args.min_prompt_tokens,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, use_generation_config=not args.no_generation_config,
    )  # fmt: skip


def cmd_cache(args: argparse.Namespace) -> None:
    from flashdraft.api import cache_hidden_states

    cache_hidden_states(
        args.target_model, args.completions, args.out, layers=args.layers, draft_config=args.draft_config,
        num_prompts=args.num_prompts, dtype=args.dtype, with_target_logits=args.with_target_logits,
        records_per_shard=args.records_per_shard, allow_foreign=args.allow_foreign, device=args.device,
        target_dtype=args.target_dtype, force=args.force,
    )  # fmt: skip


def cmd_doctor(args: argparse.Namespace) -> None:
    from flashdraft.doctor import kind_of, run_doctor
    from flashdraft.target import TargetModel
    from flashdraft.target_weights import TargetHead

    kind = kind_of(Path(args.path))  # an unusable PATH is an error before the target is loaded
    # a cache is re-run through the target; everything else needs only its shapes, tokenizer and fingerprint
    load = TargetModel.load if kind == "cache" else TargetHead.load
    target = load(args.target_model) if args.target_model else None
    if not run_doctor(args.path, target, args.checkpoint, samples=args.samples, tolerance=args.tolerance,
                      verify=not args.no_verify, serving=args.serving or args.serving_command is not None,
                      max_model_len=args.max_model_len,
                      target_name=args.target_model if args.target_model != "tiny" else None,
                      serving_command=args.serving_command):  # fmt: skip
        sys.exit(1)


def cmd_parity(args: argparse.Namespace) -> None:
    from flashdraft.parity import run_parity_command

    passed = run_parity_command(
        args.target_model, args.prompts, args.num_prompts, layers=args.layers, checkpoint=args.checkpoint,
        threshold=args.threshold, device=args.device, target_dtype=args.target_dtype,
    )  # fmt: skip
    if not passed:
        sys.exit(1)


def _long_prompts_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--long-prompts", choices=["error", "skip", "truncate"], default="error",
                   help="a prompt longer than the target's context minus --max-new-tokens: stop with an error "
                        "(default), skip it, or keep its last tokens; skips and truncations are counted")  # fmt: skip


def _add_data_commands(sub) -> None:
    """generate, cache, doctor, parity (flashdraft.data, flashdraft.doctor, flashdraft.parity)."""

    def device_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default=None, help="default: cuda (this rank's GPU) when available, else cpu")
        p.add_argument("--target-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                       help="dtype the target runs in (default: fp32 on CPU, bf16 on GPU)")  # fmt: skip

    p = sub.add_parser("generate", help="the target's own completions of a prompt set (resumable, torchrun-able)",
                       epilog=_stops("batch", "re-running the same command finishes it"))  # fmt: skip
    p.add_argument("--target-model", required=True, help="local model directory or 'tiny'")
    p.add_argument(
        "--prompts",
        required=True,
        help=".jsonl/.parquet, dataset dir, builtin:code[:heldout], builtin:stdlib[:heldout][:N]",
    )
    p.add_argument("--out", required=True, help="completions file to write (a re-run resumes it)")
    p.add_argument("--num-prompts", type=_positive, default=None)
    p.add_argument("--max-new-tokens", type=_positive, default=256)
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per record, independent of batching)")
    _filter_args(p)
    p.add_argument("--batch-size", type=_positive, default=8, help="prompts per forward (or concurrent requests)")
    p.add_argument("--backend", choices=["local", "openai"], default="local")
    p.add_argument("--base-url", help="OpenAI-compatible server for --backend openai, e.g. http://localhost:8000/v1")
    p.add_argument("--server-model", help="model name on the server (default: the first it lists)")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template (default: where the target has one)")  # fmt: skip
    _long_prompts_arg(p)
    p.add_argument("--min-prompt-tokens", type=_positive, default=0, metavar="N",
                   help="leave out turns whose prompt (template applied, earlier turns included) has fewer than N "
                        "tokens: long-context rows from any dataset")  # fmt: skip
    device_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("cache", help="cache the target's context features of completions (resumable, torchrun-able)",
                       epilog=_stops("record", "re-running the same command keeps the finished shards"))  # fmt: skip
    p.add_argument("--target-model", required=True)
    p.add_argument("--completions", required=True, help="completions file from flashdraft generate")
    p.add_argument("--out", required=True, help="cache directory (a re-run resumes it)")
    p.add_argument("--layers", type=_target_layer_ids, default=None, help="target layer ids, e.g. 1,6,11")
    p.add_argument("--draft-config", default=None,
                   help="take the layer ids from this drafter (directory, tiny-drafter, training run or config.json)")
    p.add_argument("--num-prompts", type=_positive, default=None, help="cache only the first N records")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="storage dtype of the features; auto (default): the dtype the target computes them in "
                        "(fp32 on CPU, bf16 on GPU; see --target-dtype), so offline τ equals live τ step for step; "
                        "bf16 halves an fp32 cache, offline τ then within rounding of live τ")  # fmt: skip
    p.add_argument("--with-target-logits", type=int, default=None, metavar="K",
                   help="also store the target's top-K logits per token (separate files); default none, 64 for a "
                        "--draft-config DSpark drafter (its loss reads them)")  # fmt: skip
    p.add_argument("--records-per-shard", type=_positive, default=64)
    p.add_argument("--allow-foreign-completions", "--allow-foreign", dest="allow_foreign", action="store_true",
                   help="accept completions made by another target")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="write even when the size estimate (tokens x layers x hidden x dtype bytes) exceeds the "
                        "free space of --out's filesystem (refused by default, before any forward)")  # fmt: skip
    device_args(p)
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("doctor", help="what a cache, drafter, run, state dict or completions file is, and what is "
                       "wrong with it (exit 0 clean, 1 problems found, 2 unusable)",
                       description="Exit code: 0 when no check fails (warnings included), 1 when a check or serving "
                       "rule fails, 2 when PATH cannot be checked at all.")  # fmt: skip
    p.add_argument("path", help="cache dir, drafter dir (or tiny-drafter), training run or checkpoint dir, "
                   ".pt/.safetensors, or .json")  # fmt: skip
    p.add_argument("--target-model", default=None,
                   help="check against this target (fingerprint, shapes, vocabulary, cache alignment)")  # fmt: skip
    p.add_argument("--checkpoint", default=None,
                   help="check a cache or completions file against this drafter (layer ids, vocabulary)")  # fmt: skip
    p.add_argument("--no-verify", action="store_true", help="skip sha256 checks (sizes and layout still checked)")
    p.add_argument("--serving", action="store_true",
                   help="a drafter directory: also each serving rule of vLLM 0.33.0 and SGLang 0.5.23 (format, layer "
                   "ids, causality per layer, mask token, file modes, V2 runner, reduced vocabulary, block size) as "
                   "ok/warn/FAIL, and the exact vLLM and SGLang command lines; exit 1 when a rule fails (warnings "
                   "do not)")  # fmt: skip
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="with --serving: the context the drafter is served at (vLLM --max-model-len); default the "
                        "target's max_position_embeddings; warned past the drafter's trained context")  # fmt: skip
    p.add_argument("--serving-command", default=None, metavar="CMD",
                   help="with --serving: the sampling rule this vllm/sglang command line implies at T > 0 (the "
                        "--serving-rule eval takes), in place of the rules of the commands doctor prints")
    p.add_argument("--samples", type=_positive, default=4, help="records re-run through the target")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative error per layer (default: bf16 1e-2, fp16 2e-3, fp32 1e-4)")  # fmt: skip
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("parity", help="compare linear-attention backends (fla, torch chunked/recurrent) layer by layer")
    p.add_argument("--target-model", required=True)
    p.add_argument("--prompts", default="builtin:code:heldout")
    p.add_argument("--num-prompts", type=_positive, default=8)
    p.add_argument("--layers", type=_layer_list, default=None, help="layers to compare (default: all)")
    p.add_argument("--checkpoint", default=None, help="compare this drafter's target_layer_ids")
    p.add_argument("--threshold", type=float, default=0.9999, help="fail below this minimum cosine similarity")
    device_args(p)
    p.set_defaults(func=cmd_parity)


# -- eval and export ------------------------------------------------------------------
def cmd_eval(args: argparse.Namespace) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    from flashdraft.api import evaluate_drafter
    from flashdraft.report import format_summary, write_report

    hf_logging.disable_progress_bar()  # eval prints what it loaded itself; an error stays one line
    if (args.drafter == "ngram") == (args.checkpoint is not None):
        raise FlashdraftError("give --checkpoint for a DFlash drafter (alone or --drafter hybrid), or --drafter ngram "
                              "(which takes none)")  # fmt: skip
    summary = evaluate_drafter(
        args.checkpoint or "ngram", args.target_model, hybrid=args.drafter == "hybrid", device=args.device,
        dtype={"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype), log=print,
        cached_hidden_states=args.cached_hidden_states, hybrid_min_match=args.hybrid_min_match,
        hybrid_ngram_prior=args.hybrid_ngram_prior, completions=args.completions, prompts=args.prompts,
        num_prompts=args.num_prompts, max_blocks=args.max_blocks, max_new_tokens=args.max_new_tokens,
        block_size=args.block_size, online=args.online, temperature=args.temperature,
        serving_rule=args.serving_rule, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        use_generation_config=not args.no_generation_config, check_consistency=args.check_consistency,
        reference=args.reference, target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id, num_speculative_tokens=args.num_speculative_tokens,
        adaptive_threshold=args.adaptive_threshold, confidence_threshold=args.confidence_threshold,
        ngram_max=args.ngram_max, ngram_min=args.ngram_min,
        seed=args.seed, verify=not args.no_verify, allow_foreign=args.allow_foreign_completions,
        long_prompts=args.long_prompts, context_buckets=args.context_buckets,
    )  # fmt: skip
    print()
    print(format_summary(summary))
    if args.json:
        from flashdraft.files import write_json_atomic

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(args.json), summary, what="the evaluation figures (--json)")
        print(f"wrote {args.json}")
    if args.report:
        print(f"wrote {write_report(summary, args.report)}")
    for result in [summary] + ([summary["reference"]] if args.reference else []):
        consistency = result.get("consistency")
        if consistency and not consistency["identical"]:
            raise FlashdraftError(
                f"{result['checkpoint']}: offline and online acceptance lengths differ on "
                f"{len(consistency['mismatches'])} records; first: {consistency['mismatches'][0]}"
            )


def cmd_export(args: argparse.Namespace) -> None:
    from transformers.utils import logging as hf_logging

    from flashdraft.export import export_drafter
    from flashdraft.target_weights import TargetHead

    hf_logging.disable_progress_bar()
    target = TargetHead.load(args.target_model) if args.target_model else None  # shapes and tokenizer only
    loaded = export_drafter(
        args.checkpoint, args.out, target, target_name=args.target_model, dtype=args.dtype,
        block_size=args.block_size, target_layer_ids=args.target_layer_ids, mask_token_id=args.mask_token_id,
    )  # fmt: skip
    from flashdraft.config import DrafterConfig

    cfg = DrafterConfig.load(Path(args.out) / "config.json")  # as written: is_causal stated where it can be
    for note in loaded.assumed:
        print(f"assumed: {note}")
    print(
        f"exported {loaded.describe()} to {args.out}: {cfg.num_hidden_layers} layers ({cfg.describe_layers()}), "
        f"target_layer_ids {cfg.target_layer_ids}, block size {cfg.block_size}; serving commands in "
        f"{Path(args.out) / 'README.md'}"
    )
    # the exported directory as the servers will read it: the same block as `doctor OUT --serving`
    from flashdraft.checks import Checks
    from flashdraft.serving import check_serving

    print(f"serving rules (flashdraft doctor {args.out} --serving):")
    checks = Checks()
    check_serving(Path(args.out), target, checks, target_name=args.target_model)
    checks.summary()


def _sampling_args(p: argparse.ArgumentParser) -> None:
    from flashdraft.serving_rules import DEFAULT_RULE, RULES

    p.add_argument("--serving-rule", choices=list(RULES), default=DEFAULT_RULE,
                   help=f"how the server drafts and verifies at T > 0 (default {DEFAULT_RULE}: vLLM's default, "
                        "argmax drafts accepted with p(d); vllm-probabilistic: sampled drafts, min(1, p/q); sglang: "
                        "DFlash argmax, DFlash2/DSpark sampled walks; flashdraft doctor DIR --serving prints each)")
    _filter_args(p)


def _filter_args(p: argparse.ArgumentParser) -> None:
    """The target-side sampling filters of a request at T > 0 (generate and eval)."""
    p.add_argument("--top-k", type=_positive, default=None,
                   help="T > 0: keep the K likeliest target tokens (default: the target's generation_config.json)")
    p.add_argument("--top-p", type=_probability, default=None,
                   help="T > 0: keep the likeliest target tokens holding P of the mass (default: generation config)")
    p.add_argument("--min-p", type=_probability, default=None,
                   help="T > 0, vLLM rules: drop target tokens under P x the top probability (default: generation "
                        "config)")  # fmt: skip
    p.add_argument("--no-generation-config", action="store_true",
                   help="ignore the target's generation_config.json sampling defaults (top_k, top_p, min_p)")


def _add_eval_commands(sub) -> None:
    p = sub.add_parser("eval", help="τ of a drafter offline (target completions) or online, vs a reference")
    p.add_argument("--checkpoint", help="drafter directory, training run directory or .pt/.safetensors")
    p.add_argument("--drafter", choices=["dflash", "ngram", "hybrid"], default="dflash",
                   help="ngram: the training-free n-gram prompt-lookup baseline (no --checkpoint); hybrid: the "
                   "--checkpoint drafter and the lookup, choosing per step (docs/tiny.md)")  # fmt: skip
    p.add_argument("--hybrid-min-match", type=int, default=None,
                   help="hybrid: propose the n-gram draft without running the drafter when it matched this many "
                   "tokens (default: the tuned rule's, docs/benchmarks.md)")  # fmt: skip
    p.add_argument("--hybrid-ngram-prior", type=float, default=None,
                   help="hybrid: floor of the drafter's probability of n-gram tokens when comparing the drafts "
                   "(default: the tuned rule's)")  # fmt: skip
    p.add_argument("--ngram-max", type=_positive, default=3, help="longest n-gram the baseline looks up")
    p.add_argument("--ngram-min", type=_positive, default=1, help="shortest n-gram the baseline looks up")
    p.add_argument("--target-model", required=True, help="local model directory or 'tiny'")
    p.add_argument("--cached-hidden-states", help="hidden-state cache directory (offline: no target forward)")
    p.add_argument("--completions", help="completions file from flashdraft generate")
    p.add_argument("--prompts", help="prompt file or builtin:code[:heldout]; completions are decoded greedily")
    p.add_argument("--num-prompts", type=_positive, default=None)
    p.add_argument("--max-blocks", type=_positive, default=None, help="steps per prompt (default: whole completion)")
    p.add_argument(
        "--max-new-tokens",
        type=_positive,
        default=None,
        help="tokens to decode per prompt without completions (default: max-blocks x B + 1, else 256)",
    )
    p.add_argument("--block-size", type=_block_size, default=None,
                   help=f"default: the drafter's (n-gram: {DEFAULT_BLOCK_SIZE}, or the drafter's)")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=_positive, default=None, metavar="K",
                   help="verify only the first K of the B - 1 drafts each step (vLLM's name; default all)")  # fmt: skip
    p.add_argument("--adaptive-threshold", type=_probability, default=None, metavar="P",
                   help="verify drafts only up to the first whose top drafter probability is under P "
                        "(none if the first is: a plain greedy step; lossless; with --num-speculative-tokens, "
                        "at most K)")  # fmt: skip
    p.add_argument("--confidence-threshold", type=_probability, default=None, metavar="C",
                   help="DSpark: verify drafts only up to the first whose confidence-head estimate is under C "
                        "(DeepSpec's evaluator's threshold cut, not the servers' adaptive verification; lossless); "
                        "eval always reports the head's calibration and the tau and cost of cutting at "
                        "0.3/0.5/0.7/0.9 and C")  # fmt: skip
    p.add_argument("--online", action="store_true", help="real speculative decoding with the target, timed")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sampling temperature (0 = greedy); offline at T > 0 the completions must be the target's "
                        "samples at the settings (--prompts: eval samples them)")  # fmt: skip
    _sampling_args(p)
    p.add_argument(
        "--check-consistency",
        action="store_true",
        help="run offline and online and require identical acceptance lengths",
    )
    p.add_argument("--reference", help="a second drafter, evaluated on the same records and steps ('ngram': the "
                   "n-gram baseline)")  # fmt: skip
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument("--report", help="write report.md and PNG plots into this directory")
    p.add_argument("--context-buckets", type=_context_buckets, default=None, metavar="EDGES",
                   help="context-length buckets of the by-context figures, e.g. 0,512,2048,8192 (tokens before a "
                        "step's anchor; default: powers of two spanning the records)")  # fmt: skip
    p.add_argument(
        "--target-layer-ids",
        type=_target_layer_ids,
        default=None,
        help="for a bare state dict: the target layers its fc was trained on (e.g. 1,6,11)",
    )
    p.add_argument("--mask-token-id", type=int, default=None, help="for a bare state dict")
    p.add_argument("--allow-foreign-completions", action="store_true",
                   help="accept completions made by another target")  # fmt: skip
    p.add_argument("--no-verify", action="store_true",
                   help="skip the sha256 check of a cache or training checkpoint (sizes still checked)")  # fmt: skip
    _long_prompts_arg(p)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write any checkpoint form in the public format, with serving commands")
    p.add_argument("--checkpoint", required=True, help="drafter directory, training run directory or .pt/.safetensors")
    p.add_argument("--out", required=True)
    p.add_argument("--target-model", help="needed for a bare state dict; named in the README's commands")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto", help="auto: as stored")
    p.add_argument(
        "--block-size", type=_block_size, default=None, help=f"for a bare state dict (default {DEFAULT_BLOCK_SIZE})"
    )
    p.add_argument("--target-layer-ids", type=_target_layer_ids, default=None, help="for a bare state dict")
    p.add_argument("--mask-token-id", type=int, default=None, help="for a bare state dict")
    p.set_defaults(func=cmd_export)


def _train_args(parser: _Parser, argv: list[str] | None, args: argparse.Namespace) -> argparse.Namespace:
    """train's options: --config's file under the flags given (which override it); then what
    is required, wherever it was given."""
    from flashdraft.config_file import options_from_file

    train = parser.commands["train"]
    if args.config:
        values = options_from_file(args.config, train, exclude=("config",))
        sources = [k for k in ("cached_hidden_states", "completions") if values.get(k) is not None]
        if len(sources) > 1:
            raise FlashdraftError(f"{args.config}: keys 'cached-hidden-states' and 'completions' are both given; "
                                  f"expected one (offline or online)")  # fmt: skip
        train.set_defaults(**values)
        args = parser.parse_args(argv)
        other = {"cached_hidden_states": "completions", "completions": "cached_hidden_states"}
        if sources and getattr(args, other[sources[0]]) is not None:
            setattr(args, sources[0], None)  # the command line's data source replaces the file's
    missing = [flag for flag in ("--target-model", "--out") if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        train.error(f"the following arguments are required: {', '.join(missing)}, as flags or --config keys")
    if args.cached_hidden_states is None and args.completions is None:
        train.error("one of the arguments --cached-hidden-states --completions is required, as a flag or a "
                    "--config key")  # fmt: skip
    return args


def _resume_command(argv: list[str], flag: str) -> str:
    """The command line that continues a stopped run: this one (plus `flag`, e.g. --resume)."""
    import os
    import shlex

    args = list(argv) + ([flag] if flag and flag not in argv else [])
    line = "flashdraft " + shlex.join(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        line += " (under torchrun, with the same torchrun options)"
    return line


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 1 a check failed (doctor, parity); 2 a user error, a full disk or a
    held output, on one line; 143 (SIGTERM) or 130 (SIGINT): stopped gracefully, resumable."""
    from flashdraft.errors import Interrupted
    from flashdraft.files import DISK_FULL, disk_full_errno

    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            args = _train_args(parser, argv, args)
        args.func(args)
    except FlashdraftError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        if str(e):
            verb = "resume" if e.resume_flag else "finish"
            print(f"stopped: {e}; {verb} with: {_resume_command(argv, e.resume_flag)}", file=sys.stderr, flush=True)
        return e.status
    except Exception as e:
        # a full disk in a writer that does not name its file itself: still one line
        code = disk_full_errno(e)
        if code is None or args.debug:
            raise
        where = getattr(e, "filename", None) or "a file being written"
        print(f"error: {where}: {DISK_FULL[code]}; free space and re-run the same command", file=sys.stderr)
        return 2
    return 0


def cmd_train(args: argparse.Namespace) -> None:
    from flashdraft.api import TrainConfig, train_drafter

    cfg = TrainConfig(**{name: getattr(args, name) for name in TrainConfig.option_names()})
    train_drafter(
        cfg, args.target_model, args.out, cached_hidden_states=args.cached_hidden_states,
        completions=args.completions, init=args.init, draft_layers=args.draft_layers, block_size=args.block_size,
        mask_token_id=args.mask_token_id, target_layer_ids=args.target_layer_ids,
        eval_cached_hidden_states=args.eval_cached_hidden_states,
        eval_completions=args.eval_completions, resume=args.resume, report_to=tuple(args.report_to),
        allow_foreign=args.allow_foreign_completions, device=args.device, verify=not args.no_verify,
        target_dtype=args.target_dtype, draft_vocab_size=args.draft_vocab_size,
    )  # fmt: skip


def _nonnegative_float(value: str) -> float:
    x = float(value)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, found {value}")
    return x


def _unit_float(value: str) -> float:
    x = float(value)
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], found {value}")
    return x


def _loss_weighting(value: str) -> str:
    from flashdraft.train.loss import LOSS_WEIGHTINGS

    if value not in LOSS_WEIGHTINGS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOSS_WEIGHTINGS)}, found {value}")
    return value


def _selector_missing_label(value: str) -> str:
    from flashdraft.train.loss import SELECTOR_MISSING_LABEL

    if value not in SELECTOR_MISSING_LABEL:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(SELECTOR_MISSING_LABEL)}, found {value}")
    return value


def _optimizer(value: str) -> str:
    from flashdraft.train.optim import OPTIMIZERS

    if value not in OPTIMIZERS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(OPTIMIZERS)}, found {value}")
    return value


def _train_option_adder(p: argparse.ArgumentParser):
    """Adds `--name` for a `TrainConfig` field, its default taken from the dataclass (one
    default per knob); a bool field becomes a switch with its --no- form, so that a flag can
    turn off what a --config file turned on."""
    from flashdraft.train.loop import TrainConfig

    defaults = {f.name: f.default for f in fields(TrainConfig)}

    def add(name: str, type_, help: str | None = None) -> None:
        flag = "--" + name.replace("_", "-")
        if type_ is None:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=defaults[name], help=help)
        else:
            p.add_argument(flag, type=type_, default=defaults[name], help=help)

    return add


def _add_train_command(sub) -> None:
    p = sub.add_parser("train", help="train a drafter with the DFlash recipe (offline cache or online target)",
                       description="Options come from flags, or from a --config YAML/JSON file whose keys are the "
                       "flag names below without the leading dashes (e.g. configs/tiny.yaml); flags given as well "
                       "override the file.",
                       epilog=_stops("step", "its checkpoint is written, --resume continues from it",
                                     "the same command with --resume"))  # fmt: skip
    p.add_argument("--config", default=None, metavar="RUN_YAML",
                   help="a .yaml/.yml/.json file of these options (keys: the flag names, e.g. target-model, lr, "
                        "target-layer-ids); an unknown key is refused")  # fmt: skip
    p.add_argument("--target-model", help="local model directory or 'tiny' (required: flag or --config)")
    source = p.add_mutually_exclusive_group()  # one is required: checked after --config is read
    source.add_argument("--cached-hidden-states", help="cache directory (offline mode)")
    source.add_argument("--completions", help="completions file (online mode: the target runs in the loop)")
    p.add_argument("--out", help="run directory (checkpoints, metrics.jsonl, run_config.json; required)")
    p.add_argument("--init", help="start from this drafter (directory, tiny-drafter, training run or "
                   ".pt/.safetensors) instead of a fresh one")
    p.add_argument("--draft-layers", type=_positive, default=None, help="default 1 (with --init/--resume: its own)")
    p.add_argument(
        "--block-size",
        type=_block_size,
        default=None,
        help=f"default {DEFAULT_BLOCK_SIZE} (with --init/--resume: its own)",
    )
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--target-layer-ids", type=_target_layer_ids, default=None, help="default: the reference spread")
    knob = _train_option_adder(p)
    knob("epochs", _positive)
    knob("max_steps", _positive)
    knob("lr", _nonnegative_float)
    knob("warmup_fraction", _nonnegative_float)
    knob("min_lr_fraction", _nonnegative_float, "final learning rate as a fraction of --lr")
    knob("weight_decay", _nonnegative_float)
    knob("optimizer", _optimizer, "muon (the default): Muon on the decoder layers' and fc's matrices, AdamW (--lr) on "
         "the rest; or adamw (the published recipe; needed with --fsdp)")
    knob("muon_lr", _nonnegative_float, "Muon's lr (default --lr: its update is scaled to AdamW's RMS)")
    knob("grad_clip", _nonnegative_float)
    knob("batch_size", _positive, "sequences per micro-batch per rank")
    knob("grad_accum", _positive)
    knob("num_anchors", _positive)
    knob("max_length", _positive)
    knob(
        "loss_weighting",
        _loss_weighting,
        "per-position loss weights: dpace (the default; D-PACE, arXiv 2605.18810: from the drafter's own "
        "confidence, aimed at the expected accepted length) or decay (the published recipe's exp(-(k-1)/gamma))",
    )
    knob(
        "loss_decay_gamma",
        _nonnegative_float,
        "position decay of --loss-weighting decay; default the recipe's: 7 for B=16, 5 for 10, 4 for 8 (0 = none)",
    )
    knob("dpace_alpha", _unit_float, "D-PACE smoothing of the label probability: (1 - alpha) q + alpha")
    knob(
        "kl_weight",
        _nonnegative_float,
        "opt-in: weight of KL to the cached target top-k logits (hard CE is the recipe)",
    )
    knob("noise_std", _nonnegative_float, "noise on context features only")
    knob("selector_loss_weight", _nonnegative_float, "DFlash2: weight of the candidate selector's cross-entropy over "
         "the unary top-K, teacher-forced on the true predecessor, added to the backbone loss")
    knob("dspark_ce_weight", _nonnegative_float, "DSpark: weight of the cross-entropy (the paper's 0.1)")
    knob("dspark_tv_weight", _nonnegative_float, "DSpark: weight of the L1 distance |p_draft - p_target|_1 to the "
         "target's distribution (the paper's 0.9; needs a cache with --with-target-logits, or online training)")
    knob("confidence_loss_weight", _nonnegative_float, "DSpark: weight of the confidence head's BCE against the "
         "acceptance probability 1 - |p_draft - p_target|_1 / 2 (the paper's 1.0)")
    knob("selector_missing_label", _selector_missing_label, "DFlash2: a label outside the unary top-K is put in the "
         "candidate set (inject, the default) or its position is left out of the selector loss (skip)")
    p.add_argument("--draft-vocab-size", type=_positive, default=None,
                   help="give the drafter its own LM head over the N most frequent tokens of the training "
                        "completions (mask and stop tokens always in), initialised from the target's rows; "
                        "stored as draft_vocab_size + d2t, served by vLLM")  # fmt: skip
    knob("seed", int)
    knob("save_every", _positive)
    knob("keep_checkpoints", _positive)
    knob("log_every", _positive)
    knob("eval_every", int, "held-out loss and real τ every N steps (0: never)")
    knob("eval_max_blocks", _positive, "speculative steps per held-out record")
    knob("keep_best", None, "also keep RUN/best/: the drafter of the best held-out τ (held-out loss without τ)")
    p.add_argument("--eval-cached-hidden-states", default=None, help="held-out cache for periodic evaluation")
    p.add_argument("--eval-completions", default=None, help="held-out completions for periodic evaluation")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=False,
                   help="continue from the newest complete checkpoint (after a crash, a full disk, or a stop by "
                        "SIGTERM/SIGINT, which checkpoints the step in flight and exits 143/130)")  # fmt: skip
    knob("fsdp", None, "FSDP2 instead of DDP under torchrun")
    knob("rope_scaling", _rope_scaling, f"{ROPE_SCALING_HELP}; default: the drafter's own. Stage 2 of the "
         "long-context recipe: --init STAGE1 (its weights only: a fresh optimizer and schedule) with YaRN on long data")
    p.add_argument("--report-to", nargs="*", default=[], choices=["wandb"])
    p.add_argument("--allow-foreign-completions", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--no-verify", action="store_true",
                   help="skip the sha256 check of caches and of the checkpoint resumed from (faster)")  # fmt: skip
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--target-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="dtype of the target's weights (default: fp32 on CPU, bf16 on GPU); offline only its "
                        "embeddings and LM head are read")  # fmt: skip
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("convert-run", help="rewrite an older run's trainer.pt files as tensors alone, so that "
                       "--resume reads them without running code (only for a run you trust)",
                       description="flashdraft loads a trainer.pt only as tensors and plain containers: a pickle of "
                       "other objects could run any code its maker put in it, so such a run is refused. If you "
                       "trust the run (you made it, or know who did), this unpickles each checkpoint's trainer.pt "
                       "in full, which runs whatever the file carries, and rewrites it as tensors and plain "
                       "containers (numpy values become tensors), updating checksums.json.")  # fmt: skip
    p.add_argument("run", help="training run directory, or one of its checkpoints/step-NNNNNNN directories")
    p.set_defaults(func=cmd_convert_run)


def cmd_convert_run(args: argparse.Namespace) -> None:
    from flashdraft.run_dir import convert_run

    for line in convert_run(args.run):
        print(line)


def cmd_demo(args: argparse.Namespace) -> None:
    from flashdraft.demo import run_demo

    run_demo(args.out, args.minutes)


def _add_demo_command(sub) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on the built-in tiny target, in minutes on a CPU")
    p.add_argument("--out", default="demo-out", help="output directory (re-running reuses finished stages)")
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget for the whole demo")
    p.set_defaults(func=cmd_demo)


if __name__ == "__main__":
    sys.exit(main())
