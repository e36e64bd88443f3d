"""`flashdraft train`: a drafter trained with the DFlash recipe (`flashdraft.api.train_drafter`).
Each option that decides what a run computes is a `TrainConfig` field of the same name, its
default taken from the dataclass; `--config FILE` is read in `flashdraft.commands.config_file.train_options`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields

from flashdraft.commands.options import ROPE_SCALING_HELP, block_size, positive, rope_scaling, stops, target_layer_ids
from flashdraft.drafter.config import DEFAULT_BLOCK_SIZE
from flashdraft.errors import FlashdraftError


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


def _one_of(names) -> Callable[[str], str]:
    """A type taking one of `names` (a loss weighting, an optimizer, ...)."""

    def parse(value: str) -> str:
        if value not in names:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)}, found {value}")
        return value

    return parse


def _train_option_adder(p: argparse.ArgumentParser):
    """Adds `--name` for a `TrainConfig` field, its default taken from the dataclass (one
    default per knob); a bool field becomes a switch with its --no- form, so that a flag can
    turn off what a --config file turned on."""
    from flashdraft.train.config import TrainConfig

    defaults = {f.name: f.default for f in fields(TrainConfig)}

    def add(name: str, type_, help: str | None = None) -> None:
        flag = "--" + name.replace("_", "-")
        if type_ is None:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=defaults[name], help=help)
        else:
            p.add_argument(flag, type=type_, default=defaults[name], help=help)

    return add


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train a drafter with the DFlash recipe (offline cache or online target)",
        description="Options come from flags, or from a --config YAML/JSON file whose keys are the "
        "flag names below without the leading dashes (e.g. configs/tiny.yaml); flags given as well "
        "override the file.",
        epilog=stops("step", "its checkpoint is written, --resume continues from it", "the same command with --resume"),
    )
    _run_args(p)
    knob = _train_option_adder(p)
    _optimizer_args(knob)
    _loss_args(knob)
    p.add_argument(
        "--draft-vocab-size",
        type=positive,
        default=None,
        help="give the drafter its own LM head over the N most frequent tokens of the training "
        "completions (mask and stop tokens always in), initialised from the target's rows; "
        "stored as draft_vocab_size + d2t, served by vLLM",
    )
    _checkpoint_args(p, knob)
    _runtime_args(p, knob)
    return p


def _run_args(p: argparse.ArgumentParser) -> None:
    """The target, the data, the run directory and the drafter trained."""
    _engine_args(p)
    p.add_argument(
        "--config",
        default=None,
        metavar="RUN_YAML",
        help="a .yaml/.yml/.json file of these options (keys: the flag names, e.g. target-model, lr, "
        "target-layer-ids); an unknown key is refused",
    )
    p.add_argument("--target-model", help="local model directory or 'tiny' (required: flag or --config)")
    source = p.add_mutually_exclusive_group()  # one is required: checked after --config is read
    source.add_argument("--cached-hidden-states", help="cache directory (offline mode)")
    source.add_argument("--completions", help="completions file (online mode: the target runs in the loop)")
    p.add_argument("--out", help="run directory (checkpoints, metrics.jsonl, run_config.json; required)")
    p.add_argument(
        "--init",
        help="start from this drafter (directory, tiny-drafter, training run or "
        ".pt/.safetensors) instead of a fresh one",
    )
    p.add_argument("--draft-layers", type=positive, default=None, help="default 1 (with --init/--resume: its own)")
    p.add_argument(
        "--block-size",
        type=block_size,
        default=None,
        help=f"default {DEFAULT_BLOCK_SIZE} (with --init/--resume: its own)",
    )
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--target-layer-ids", type=target_layer_ids, default=None, help="default: the reference spread")


def _optimizer_args(knob) -> None:
    """The optimizer, its schedule and the batches."""
    from flashdraft.train.optim import OPTIMIZERS

    knob("epochs", positive, "whole epochs when no --max-steps is given (default 1; on tiny: 1000 steps)")
    knob("max_steps", positive, "the steps run, over as many epochs as they take (overrides --epochs)")
    knob("lr", _nonnegative_float, "default 6e-4, the published recipe's; 6e-3 on the built-in tiny target")
    knob("warmup_fraction", _nonnegative_float)
    knob("min_lr_fraction", _nonnegative_float, "final learning rate as a fraction of --lr")
    knob("weight_decay", _nonnegative_float)
    knob(
        "optimizer",
        _one_of(OPTIMIZERS),
        "muon (the default): Muon on the decoder layers' and fc's matrices, "
        "AdamW (--lr) on the rest; or adamw (the published recipe; needed with --fsdp)",
    )
    knob("muon_lr", _nonnegative_float, "Muon's lr (default --lr: its update is scaled to AdamW's RMS)")
    knob("grad_clip", _nonnegative_float)
    knob("batch_size", positive, "sequences per micro-batch per rank")
    knob("grad_accum", positive)
    knob(
        "num_anchors",
        positive,
        "anchors (blocks) per record, packed or not (default 512, the published recipe's; 8 on tiny)",
    )
    knob("max_length", positive)
    knob(
        "pack_length",
        positive,
        "pack records into rows of exactly L context tokens, each record its own document (positions from 0, "
        "no attention across documents; one batch shape; cache, online or --engine fed alike); --batch-size then "
        "counts rows. Off by default: it changes what --batch-size and an epoch's steps mean; use it where records' "
        "lengths vary (docs/pipeline.md)",
    )


def _loss_args(knob) -> None:
    """The loss terms and their weights, per family."""
    from flashdraft.train.loss import LOSS_WEIGHTINGS, SELECTOR_MISSING_LABEL

    knob(
        "loss_weighting",
        _one_of(LOSS_WEIGHTINGS),
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
    knob(
        "selector_loss_weight",
        _nonnegative_float,
        "DFlash2: weight of the candidate selector's cross-entropy over "
        "the unary top-K, teacher-forced on the true predecessor, added to the backbone loss",
    )
    knob("dspark_ce_weight", _nonnegative_float, "DSpark: weight of the cross-entropy (the paper's 0.1)")
    knob(
        "dspark_tv_weight",
        _nonnegative_float,
        "DSpark: weight of the L1 distance |p_draft - p_target|_1 to the "
        "target's distribution (the paper's 0.9; needs a cache with --with-target-logits, or online training)",
    )
    knob(
        "confidence_loss_weight",
        _nonnegative_float,
        "DSpark: weight of the confidence head's BCE against the "
        "acceptance probability 1 - |p_draft - p_target|_1 / 2 (the paper's 1.0)",
    )
    knob(
        "selector_missing_label",
        _one_of(SELECTOR_MISSING_LABEL),
        "DFlash2: a label outside the unary top-K is "
        "put in the candidate set (inject, the default) or its position is left out of the selector loss (skip)",
    )


def _checkpoint_args(p: argparse.ArgumentParser, knob) -> None:
    """The seed, what the run writes and keeps, held-out evaluation and resuming."""
    knob("seed", int)
    knob("save_every", positive)
    knob("keep_checkpoints", positive)
    knob("log_every", positive)
    knob("eval_every", int, "held-out loss and real τ every N steps (0: never)")
    knob("eval_max_blocks", positive, "speculative steps per held-out record")
    knob("keep_best", None, "also keep RUN/best/: the drafter of the best held-out τ (held-out loss without τ)")
    p.add_argument("--eval-cached-hidden-states", default=None, help="held-out cache for periodic evaluation")
    p.add_argument("--eval-completions", default=None, help="held-out completions for periodic evaluation")
    p.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="continue from the newest complete checkpoint (after a crash, a full disk, or a stop by "
        "SIGTERM/SIGINT, which checkpoints the step in flight and exits 143/130)",
    )


def _runtime_args(p: argparse.ArgumentParser, knob) -> None:
    """Parallelism, long context, logging, checks and devices."""
    knob("fsdp", None, "FSDP2 instead of DDP under torchrun")
    knob(
        "compile",
        None,
        "the step's forward and loss compiled, one graph per batch shape (default: on CUDA only; on CPU the "
        "compile outweighs the gain)",
    )
    knob(
        "rope_scaling",
        rope_scaling,
        f"{ROPE_SCALING_HELP}; default: the drafter's own. Stage 2 of the "
        "long-context recipe: --init STAGE1 (its weights only: a fresh optimizer and schedule) with YaRN on long data",
    )
    p.add_argument("--report-to", nargs="*", default=[], choices=["wandb"])
    p.add_argument("--allow-foreign-completions", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the sha256 check of caches and of the checkpoint resumed from (faster)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--target-dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="dtype of the target's weights (default: fp32 on CPU, bf16 on GPU); offline only its "
        "embeddings and LM head are read",
    )


def run(args: argparse.Namespace) -> None:
    from flashdraft.api import TrainConfig, train_drafter

    cfg = TrainConfig(**{name: getattr(args, name) for name in TrainConfig.option_names()})
    train_drafter(
        cfg,
        args.target_model,
        args.out,
        cached_hidden_states=args.cached_hidden_states,
        completions=args.completions,
        init=args.init,
        draft_layers=args.draft_layers,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        target_layer_ids=args.target_layer_ids,
        eval_cached_hidden_states=args.eval_cached_hidden_states,
        eval_completions=args.eval_completions,
        resume=args.resume,
        report_to=tuple(args.report_to),
        allow_foreign=args.allow_foreign_completions,
        device=args.device,
        verify=not args.no_verify,
        target_dtype=args.target_dtype,
        draft_vocab_size=args.draft_vocab_size,
        engine_feed=_engine_feed(args),
    )


def _engine_feed(args: argparse.Namespace):
    """--engine vllm's settings, or None; its options refused without it."""
    from flashdraft.train.engine_feed import EngineFeedConfig

    given = [
        flag for flag, value in (("--engine-server", args.engine_server), ("--engine-fp8", args.engine_fp8)) if value
    ]
    if args.engine is None:
        if given:
            raise FlashdraftError(f"{given[0]} is an option of --engine vllm; expected --engine vllm with it")
        return None
    servers = tuple(url for url in (args.engine_server or "").split(",") if url)
    return EngineFeedConfig(
        servers=servers,
        prefetch=args.engine_prefetch,
        fp8=args.engine_fp8,
        verify_share=args.verify_share,
        python=args.engine_python,
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Training fed by the serving engine (`train/engine_feed.py`)."""
    from flashdraft.train.engine_feed import DEFAULT_PREFETCH

    p.add_argument(
        "--engine",
        choices=["vllm"],
        default=None,
        help="with --completions: vLLM prefills each sequence and hands its states over (hs-connectors), no cache "
        "written; the target's decoder layers are not held by the trainer",
    )
    p.add_argument(
        "--engine-server",
        default=None,
        metavar="URL[,URL...]",
        help="running engines to use (default: start one on 127.0.0.1)",
    )
    p.add_argument(
        "--engine-prefetch",
        type=positive,
        default=DEFAULT_PREFETCH,
        help="samples the engines run ahead of the trainer",
    )
    p.add_argument("--engine-fp8", action="store_true", help="FP8 states on the wire (hs-connectors' FP8 connector)")
    p.add_argument("--engine-python", default=None, help="the engine's Python (default: .venv-engine)")
    p.add_argument(
        "--verify-share", type=float, default=0.05, help="share of samples recomputed by the target before training"
    )
