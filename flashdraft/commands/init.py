"""`flashdraft init`: a fresh, untrained drafter for a target (or a DFlash2 one from a trained
DFlash drafter); the drafter is built in `flashdraft.drafter.init`."""

from __future__ import annotations

import argparse

from flashdraft.commands.options import (
    ROPE_SCALING_HELP,
    block_size,
    bool_,
    layer_list,
    layer_types,
    positive,
    positive_float,
    rope_scaling,
    target_layer_ids,
)
from flashdraft.drafter.config_spellings import DFLASH2_FIELDS, DSPARK_MARKOV_RANK
from flashdraft.drafter.families import FAMILIES

# --confidence-head: the DSpark confidence head's input, as config fields (enable, with_markov)
CONFIDENCE_HEADS = {"none": (False, False), "hidden": (True, False), "with-markov": (True, True)}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("init", help="write a fresh, untrained drafter for a target")
    p.add_argument("--target-model", required=True, help="local model directory or 'tiny'")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--config",
        default=None,
        metavar="CONFIG_JSON",
        help="start from this drafter's config.json (a config.json, a drafter directory, tiny-drafter or a "
        "training run; e.g. a published one); the flags below override its "
        "fields, and hidden_size, vocab_size and num_target_layers must match the target",
    )
    _shape_args(p)
    _family_args(p)
    p.add_argument(
        "--from-drafter",
        default=None,
        metavar="DRAFTER",
        help="with --family dflash2: start from this trained DFlash drafter (directory, run, "
        "tiny-drafter): its weights, identity convolutions and a neutral selector, so it drafts "
        "exactly as DRAFTER (greedy) until trained",
    )
    return p


def _shape_args(p: argparse.ArgumentParser) -> None:
    """The drafter's layers, block, mask token and sizes (a fresh drafter's; --from-drafter keeps its own)."""
    p.add_argument(
        "--draft-layers", type=positive, default=None, help="default: --config's, else the --layer-types count, else 1"
    )
    p.add_argument(
        "--block-size",
        type=block_size,
        default=None,
        help=f"default: --config's, else the family's ("
        f"{', '.join(f'{f.name} {f.default_block_size}' for f in FAMILIES.values())})",
    )
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--target-layer-ids",
        type=target_layer_ids,
        default=None,
        help="strictly increasing; default: --config's, else the reference spread",
    )
    p.add_argument(
        "--layer-types",
        type=layer_types,
        default=None,
        help="sliding or full (or sliding_attention/full_attention), one per layer or one for all, e.g. "
        "sliding,sliding,sliding,sliding,full; default: --config's, else full",
    )
    p.add_argument(
        "--sliding-window",
        type=positive,
        default=None,
        help="keys a sliding layer sees (needed with sliding layers, e.g. 2048)",
    )
    p.add_argument(
        "--is-causal",
        type=bool_,
        default=None,
        metavar="true|false",
        help="in-block causality of every layer (default: the servers' rule: sliding layers causal, full layers not)",
    )
    for name, type_ in [
        ("intermediate_size", positive),
        ("num_attention_heads", positive),
        ("num_key_value_heads", positive),
        ("head_dim", positive),
        ("rope_theta", positive_float),
        ("max_position_embeddings", positive),
    ]:
        p.add_argument(
            "--" + name.replace("_", "-"), type=type_, default=None, help="default: --config's, else the target's"
        )
    p.add_argument(
        "--rope-scaling", type=rope_scaling, default=None, help=f"{ROPE_SCALING_HELP}; default: --config's, else native"
    )
    p.add_argument(
        "--layers-from-target",
        type=layer_list,
        default=None,
        help="start the drafter's layers from these full-attention layers of the target, one per "
        "drafter layer (e.g. 2,5 for tiny); default: random init",
    )


def _family_args(p: argparse.ArgumentParser) -> None:
    """The architecture and the module sizes of DSpark and DFlash2."""
    p.add_argument(
        "--family",
        choices=list(FAMILIES),
        default=None,
        help="dflash (DFlashDraftModel), dflash2 (DFlash2DraftModel: a grouped dynamic causal "
        "convolution around each sublayer and a candidate selector) or dspark (Qwen3DSparkModel: the "
        "anchor-first block, a Markov head and a confidence head); default: --config's, else "
        "dflash",
    )
    p.add_argument(
        "--markov-rank",
        type=positive,
        default=None,
        help=f"DSpark (--family dspark): rank of the Markov head; default: --config's, else {DSPARK_MARKOV_RANK}",
    )
    p.add_argument(
        "--confidence-head",
        choices=list(CONFIDENCE_HEADS),
        default=None,
        help="DSpark: the confidence head and its input (none; hidden: the hidden state; with-markov: also "
        "the previous draft's Markov embedding); default: --config's, else with-markov",
    )
    for name, published in DFLASH2_FIELDS.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=positive,
            default=None,
            help=f"DFlash2 (--family dflash2); default: --config's, else {published} (as published)",
        )


def run(args: argparse.Namespace) -> None:
    from flashdraft.drafter.init import FRESH_ONLY, SHAPE_FIELDS, DrafterChoices, init_drafter, init_from_drafter

    dflash2 = {name: getattr(args, name) for name in DFLASH2_FIELDS}
    if args.from_drafter:
        cfg = init_from_drafter(
            args.target_model,
            args.from_drafter,
            args.out,
            family=args.family,
            sizes=dflash2,
            block_size=args.block_size,
            seed=args.seed,
            fresh={name: getattr(args, name) for name in FRESH_ONLY},
        ).config
        print(
            f"wrote {cfg.architecture} to {args.out} from {args.from_drafter}: its backbone, identity convolutions "
            f"and a neutral selector (drafts as the drafter does until trained); block size {cfg.block_size}"
        )
        _print_layers(cfg)
        return
    choices = DrafterChoices(
        num_layers=args.draft_layers,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        target_layer_ids=args.target_layer_ids,
        layer_types=args.layer_types,
        sliding_window=args.sliding_window,
        is_causal=args.is_causal,
        shape={name: getattr(args, name) for name in SHAPE_FIELDS},
        family=args.family,
        dflash2=dflash2,
        dspark=_dspark_settings(args),
    )
    drafter, target = init_drafter(
        args.target_model,
        args.out,
        choices,
        config=args.config,
        layers_from_target=args.layers_from_target,
        seed=args.seed,
    )
    cfg = drafter.config
    start = f", layers from target layers {args.layers_from_target}" if args.layers_from_target else ""
    print(
        f"wrote untrained {cfg.architecture}{start} to {args.out}: {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, "
        f"block size {cfg.block_size}, target_layer_ids {cfg.target_layer_ids} of {cfg.num_target_layers}, "
        f"mask token {cfg.mask_token_id} ({target.tokenizer.convert_ids_to_tokens(cfg.mask_token_id)!r})"
    )
    _print_layers(cfg)


def _dspark_settings(args: argparse.Namespace) -> dict:
    """DSpark's init flags as `DrafterChoices.dspark` holds them (None: not given)."""
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
