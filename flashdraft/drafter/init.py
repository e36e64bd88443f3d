"""A fresh, untrained drafter shaped for a given target, or a DFlash2 one on a trained DFlash
drafter's backbone (`flashdraft init`)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from flashdraft.drafter.checkpoint import check_drafter_matches_target, drafter_class, save_drafter
from flashdraft.drafter.config import (
    LAYER_ORDER_RULE,
    DrafterConfig,
    default_target_layer_ids,
    strictly_increasing,
)
from flashdraft.drafter.config_spellings import DFLASH2_FIELDS, DSPARK_MARKOV_RANK
from flashdraft.drafter.families import FAMILIES
from flashdraft.drafter.model import DFlashDrafter, is_dflash2_parameter
from flashdraft.drafter.rope import as_scaling, target_theta
from flashdraft.drafter.run_dir import drafter_config_path, load_any_drafter
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel, pick_mask_token
from flashdraft.target.per_layer import common_value
from flashdraft.target.weights import TargetHead

# Layer types as `init --layer-types` accepts them: the short names and the config's own.
LAYER_TYPE_NAMES = {
    "sliding": "sliding_attention",
    "full": "full_attention",
    "sliding_attention": "sliding_attention",
    "full_attention": "full_attention",
}
# Shape fields `init` can set; each defaults to the --config's value, else the target's.
SHAPE_FIELDS = (
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "max_position_embeddings",
    "rope_scaling",
)
# Fields a drafter must share with its target (it borrows the target's embedding and LM head,
# and reads its layers' outputs).
TARGET_FIELDS = ("hidden_size", "vocab_size", "num_target_layers")


def parse_layer_types(value: str) -> list[str]:
    """`sliding,sliding,full` (or the full names) as config layer_types; raises ValueError."""
    names = [x.strip() for x in value.split(",")]
    bad = [x for x in names if x not in LAYER_TYPE_NAMES]
    if not names or bad:
        raise ValueError(
            f"{bad[0] if bad else value!r} is not a layer type; expected sliding, full, "
            f"sliding_attention or full_attention (comma-separated, one per layer or one for all)"
        )
    return [LAYER_TYPE_NAMES[x] for x in names]


def _drafter_head_dim(tc) -> int:
    """A fresh drafter's head_dim: the target's. MLA targets (DeepSeek-V3, GLM-4.7-Flash) have no single one (their
    config's head_dim is the RoPE part of a query, 64 of 192 in DeepSeek-V3): their value heads' width (128 there),
    a width every attention kernel serves. Where head_dim varies by layer (Gemma 4's full-attention layers), the width
    most layers have."""
    if getattr(tc, "kv_lora_rank", None):
        return tc.v_head_dim
    return common_value(tc, "head_dim") or tc.hidden_size // common_value(tc, "num_attention_heads")


def _target_fields(target: TargetModel) -> dict:
    """What a fresh drafter copies from the target (no --config)."""
    tc = target.config
    heads = common_value(tc, "num_attention_heads")
    return dict(
        hidden_size=tc.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=common_value(tc, "num_key_value_heads") or heads,
        head_dim=_drafter_head_dim(tc),
        intermediate_size=common_value(tc, "intermediate_size"),
        vocab_size=target.vocab_size,
        num_target_layers=target.num_layers,
        rms_norm_eps=getattr(tc, "rms_norm_eps", None) or getattr(tc, "layer_norm_epsilon", None) or 1e-6,
        rope_theta=target_theta(tc),
        max_position_embeddings=tc.max_position_embeddings,
        layer_types=[],
        sliding_window=None,
        is_causal=None,
        num_hidden_layers=None,
        block_size=None,
        target_layer_ids=None,
        mask_token_id=None,
        family="dflash",
        **dict.fromkeys(DFLASH2_FIELDS, 0),
        markov_rank=0,
        confidence_head=False,
        confidence_head_with_markov=False,
        draft_top_k=None,
    )


def _config_fields(base: DrafterConfig, source: str, target: TargetModel) -> dict:
    """The fields of a published drafter config (`init --config`), checked against the target."""
    expected = {
        "hidden_size": (target.hidden_size, "the target's hidden size"),
        "vocab_size": (target.vocab_size, "the target's vocabulary"),
        "num_target_layers": (target.num_layers, "the target's decoder layers"),
    }
    for name in TARGET_FIELDS:
        want, what = expected[name]
        if getattr(base, name) != want:
            raise FlashdraftError(
                f"{source}: field '{name}' is {getattr(base, name)}; expected {want} ({what}, {target.path}): "
                f"--config must describe a drafter for this target"
            )
    if base.draft_vocab_size is not None:
        raise FlashdraftError(
            f"{source}: field 'draft_vocab_size' is {base.draft_vocab_size}; expected absent: flashdraft init makes "
            f"drafters that borrow the target's LM head (a reduced vocabulary needs its d2t map from data)"
        )
    # fresh weights are in flashdraft's own conventions whatever the published ones (server_fields: "folded"), and
    # untrained: no trained context
    return {f.name: getattr(base, f.name) for f in fields(DrafterConfig)} | {
        "gemma_norm": False,
        "rope_neox_style": True,
        "trained_context_length": None,
    }


def _resolve_layer_types(n: int, layer_types: list[str] | None, fields_: dict, source: str) -> list[str]:
    """One type per layer: --layer-types (one for all, or one each), else the --config's, else full."""
    if layer_types:
        return layer_types * n if len(layer_types) == 1 else list(layer_types)
    written = fields_["layer_types"]
    if not written or len(set(written)) == 1 and len(written) != n:
        return [written[0] if written else "full_attention"] * n
    if len(written) != n:
        raise FlashdraftError(
            f"--draft-layers {n}: {source} has layer_types {written} for {len(written)} layers; give --layer-types "
            f"for {n} layers"
        )
    return list(written)


def _layers(
    num_layers: int | None, layer_types: list[str] | None, sliding_window: int | None, fields_: dict, source: str
) -> tuple[int, list[str], int | None]:
    """(layer count, layer types, sliding window) from the init flags, else the --config's fields, checked."""
    if layer_types and len(layer_types) > 1 and num_layers is not None and num_layers != len(layer_types):
        raise FlashdraftError(
            f"--layer-types has {len(layer_types)} entries for --draft-layers {num_layers}; expected one per "
            f"drafter layer, or a single type for all"
        )
    n = num_layers or (len(layer_types) if layer_types and len(layer_types) > 1 else None)
    n = n or fields_["num_hidden_layers"] or 1
    types = _resolve_layer_types(n, layer_types, fields_, source)
    sliding = "sliding_attention" in types
    if sliding_window is not None and not sliding:
        raise FlashdraftError(
            f"--sliding-window {sliding_window}: no drafter layer is sliding_attention (layer_types {types}); give "
            f"--layer-types with sliding layers, or leave the window out"
        )
    window = sliding_window if sliding_window is not None else fields_["sliding_window"]
    if sliding and window is None:
        raise FlashdraftError(
            f"--layer-types {','.join(types)}: sliding layers need --sliding-window N (the keys a sliding layer "
            f"sees; the Qwen3.6-27B drafter uses 2048)"
        )
    return n, types, window


def _mask_token(given: int | None, from_config: int | None, target: TargetModel) -> int:
    """--mask-token-id (in the target's vocabulary), else the config's, else one picked from the target's."""
    if given is None:
        return from_config if from_config is not None else pick_mask_token(target)
    if not 0 <= given < target.vocab_size:
        raise FlashdraftError(
            f"--mask-token-id {given} is outside the target's vocabulary (0..{target.vocab_size - 1})"
        )
    return given


@dataclass(frozen=True)
class DrafterChoices:
    """What is chosen of a new drafter (`flashdraft init`'s flags); each None: the base config's, else the target's
    (1 full-attention layer, the target's heads and sizes). `shape` holds overrides of SHAPE_FIELDS;
    `layer_types` is one type for all layers or one per layer (it sets the layer count when `num_layers` is None).
    `family` is "dflash", "dflash2" or "dspark" (default: the base config's, else dflash); `dflash2` overrides
    DFlash2's module sizes (DFLASH2_FIELDS; defaults: the base config's, else the published checkpoint's);
    `dspark` DSpark's (markov_rank, confidence_head, confidence_head_with_markov; defaults: the base config's,
    else rank 256 and a confidence head with the Markov input)."""

    num_layers: int | None = None
    block_size: int | None = None
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    shape: dict | None = None
    family: str | None = None
    dflash2: dict | None = None
    dspark: dict | None = None


DEFAULT_CHOICES = DrafterChoices()


def new_drafter_for_target(
    target: TargetModel,
    choices: DrafterChoices = DEFAULT_CHOICES,
    seed: int = 0,
    base: DrafterConfig | None = None,
    base_source: str = "--config",
) -> DFlashDrafter:
    """A fresh drafter for `target`, as `choices` says. Its fields come from `base` (a published drafter config,
    `init --config`, checked against the target) where given, else from the target; every choice that is not None
    overrides them."""
    c = choices
    fields_ = _config_fields(base, base_source, target) if base is not None else _target_fields(target)
    _set_family(fields_, c.family, c.dflash2 or {}, c.dspark or {})
    source = f"{base_source} with the init flags" if base is not None else "flashdraft init"
    n, types, window = _layers(c.num_layers, c.layer_types, c.sliding_window, fields_, base_source)
    mask_token_id = _mask_token(c.mask_token_id, fields_["mask_token_id"], target)
    block_size = c.block_size or fields_["block_size"] or FAMILIES[fields_["family"]].default_block_size
    if block_size < 2:
        raise FlashdraftError(f"--block-size {block_size}: expected at least 2 (the anchor plus one draft)")
    if c.target_layer_ids is not None and not strictly_increasing(c.target_layer_ids):
        raise FlashdraftError(
            f"--target-layer-ids {','.join(map(str, c.target_layer_ids))}: expected {LAYER_ORDER_RULE} "
            f"(e.g. {','.join(map(str, sorted(set(c.target_layer_ids))))})"
        )
    ids = c.target_layer_ids or fields_["target_layer_ids"] or default_target_layer_ids(target.num_layers, n)
    if target.num_layers - 1 in ids:
        raise FlashdraftError(
            f"target_layer_ids {ids} include the target's final layer {target.num_layers - 1}, whose output "
            f"produces the labels: the drafter would be fed the answer"
        )
    fields_.update({k: v for k, v in (c.shape or {}).items() if v is not None})
    fields_.update(
        num_hidden_layers=n,
        layer_types=types,
        sliding_window=window,
        block_size=block_size,
        target_layer_ids=list(ids),
        mask_token_id=mask_token_id,
    )
    if c.is_causal is not None:
        fields_["is_causal"] = c.is_causal
    try:
        cfg = DrafterConfig(**fields_)
    except FlashdraftError as e:  # a flag made the config invalid: name where the fields came from
        raise FlashdraftError(str(e).replace("config:", f"{source}:", 1)) from None
    # the mask token's string, which SGLang checks the id against (a --config is kept as published)
    if base is None and (token := mask_token_string(cfg, target)) is not None:
        cfg.extra["dflash_config"] = {**cfg.dflash_options, "mask_token": token}
    drafter = drafter_class(cfg)(cfg)
    drafter.init_weights(seed)
    # The drafter's output goes through the target's LM head: start its final norm at the
    # target's, so the first logits have the target's scale (a unit norm over a tied
    # embedding gives logits far too large, and the first hundred steps only shrink them).
    final_norm = target.final_norm_weight()  # [hidden] what the target's norm multiplies by
    if final_norm is not None:
        with torch.no_grad():
            drafter.norm.weight.copy_(final_norm)
    return drafter


def _set_family(fields_: dict, family: str | None, sizes: dict, dspark: dict | None = None) -> None:
    """The family and its module sizes (DFlash2's, DSpark's): a flag's, else the --config's, else the published
    one's (DSpark: rank 256, a confidence head with the Markov input)."""
    family = family or fields_["family"]
    given = {name: value for name, value in sizes.items() if value is not None}
    if family != "dflash2" and given:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise FlashdraftError(f"{flag} {next(iter(given.values()))}: a DFlash2 module size; give --family dflash2")
    for name, published in DFLASH2_FIELDS.items():
        fields_[name] = (given.get(name) or fields_[name] or published) if family == "dflash2" else 0
    given = {name: value for name, value in (dspark or {}).items() if value is not None}
    if family != "dspark" and given:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise FlashdraftError(f"{flag} {next(iter(given.values()))}: a DSpark setting; give --family dspark")
    if family == "dspark":
        was_dspark = fields_["family"] == "dspark"  # a DSpark --config keeps its heads unless a flag changes them
        fields_["markov_rank"] = given.get("markov_rank") or fields_["markov_rank"] or DSPARK_MARKOV_RANK
        for name in ("confidence_head", "confidence_head_with_markov"):
            fields_[name] = given[name] if name in given else (fields_[name] if was_dspark else True)
    else:
        fields_.update(markov_rank=0, confidence_head=False, confidence_head_with_markov=False, draft_top_k=None)
    fields_["family"] = family


def dflash2_from_drafter(
    drafter: DFlashDrafter, sizes: dict | None = None, block_size: int | None = None, seed: int = 0
) -> DFlashDrafter:
    """A DFlash2 drafter on a trained DFlash drafter's backbone (`init --family dflash2 --from-drafter`):
    its weights copied, identity convolutions and a neutral selector added, so at step 0 it drafts
    exactly as `drafter` when greedy. `sizes`: DFlash2 module sizes (default the published ones)."""
    cfg = drafter.config
    if cfg.family != "dflash":
        raise FlashdraftError(f"--from-drafter: the drafter is a {cfg.architecture} already; expected a DFlash one")
    if cfg.draft_vocab_size is not None:
        raise FlashdraftError(
            f"--from-drafter: the drafter has an own LM head (draft_vocab_size {cfg.draft_vocab_size}); a DFlash2 "
            f"drafter drafts over the full target vocabulary (its selector's codebooks cover it)"
        )
    fields_ = {f.name: getattr(cfg, f.name) for f in fields(DrafterConfig)}
    fields_["extra"] = dict(cfg.extra)
    _set_family(fields_, "dflash2", sizes or {})
    if block_size is not None:
        fields_["block_size"] = block_size
    new_cfg = DrafterConfig(**fields_)
    new = drafter_class(new_cfg)(new_cfg)
    new.init_weights(seed)  # DFlash2's parts start neutral; the backbone is then replaced by the drafter's
    missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all(is_dflash2_parameter(k) for k in missing), (missing, unexpected)
    return new.to(next(drafter.parameters()).dtype)


def with_rope_scaling(drafter: DFlashDrafter, scaling: dict | None) -> DFlashDrafter:
    """`drafter`'s weights under the RoPE scaling `scaling` ({"rope_type": "default"} or None: native RoPE), e.g.
    stage 2 of the long-context recipe: YaRN on stage 1's weights (`train --init STAGE1 --rope-scaling ...`)."""
    scaling = as_scaling(scaling)
    if scaling == drafter.config.rope_scaling:
        return drafter
    cfg = drafter.config
    new_cfg = replace(cfg, rope_scaling=scaling, extra=dict(cfg.extra))
    new = drafter_class(new_cfg)(new_cfg)
    new.load_state_dict(drafter.state_dict())  # the rotary tables are buffers of the config, not weights
    return new.to(next(drafter.parameters()))


def mask_token_string(cfg: DrafterConfig, target) -> str | None:
    """The mask token's string in the target's tokenizer, when it names exactly mask_token_id
    (what SGLang checks dflash_config.mask_token against); None when the tokenizer has no
    token of its own at that id."""
    if cfg.mask_token_id >= len(target.tokenizer):
        return None
    token = target.tokenizer.convert_ids_to_tokens(cfg.mask_token_id)
    return token if isinstance(token, str) and target.tokenizer.get_vocab().get(token) == cfg.mask_token_id else None


def copy_target_layers(drafter: DFlashDrafter, target, layer_ids: list[int]) -> None:
    """Start drafter layer j from the target's full-attention layer `layer_ids[j]` (attention,
    MLP and norms; the drafter's fc and norms stay as they are). `target` is a `TargetHead`.
    The drafter layer keeps its own layer type: a sliding drafter layer started from a full
    target layer gets its weights, not its attention pattern. Every tensor must match the
    drafter's shape: a mismatch is an error, never a partial copy."""
    if len(layer_ids) != len(drafter.layers):
        raise FlashdraftError(
            f"--layers-from-target {','.join(map(str, layer_ids))}: {len(layer_ids)} target layers for a drafter "
            f"of {len(drafter.layers)} layers; expected one per drafter layer"
        )
    for j, layer_id in enumerate(layer_ids):
        own = drafter.layers[j].state_dict()
        for name, tensor in target.attention_layer_weights(layer_id).items():
            if name not in own or own[name].shape != tensor.shape:
                found = list(own[name].shape) if name in own else "no such tensor"
                raise FlashdraftError(
                    f"target layer {layer_id} '{name}' is {list(tensor.shape)}; drafter layer {j} has {found}: "
                    f"the drafter cannot start from this target layer"
                )
            with torch.no_grad():
                own[name].copy_(tensor)


def init_drafter(
    target_model: str,
    out: str | Path,
    choices: DrafterChoices,
    *,
    config: str | Path | None = None,
    layers_from_target: list[int] | None = None,
    seed: int = 0,
) -> tuple[DFlashDrafter, TargetHead]:
    """`flashdraft init`: a fresh drafter for `target_model` as `choices` says, written to `out`, and the target's
    head it was shaped from. `config`: a drafter config to start from (read before the target, so a broken one costs
    no model load); `layers_from_target`: target layers to start the drafter's layers from."""
    base = DrafterConfig.load(drafter_config_path(config)) if config else None
    target = TargetHead.load(target_model)  # shapes, tokenizer and final norm (decoder layers only if copied)
    drafter = new_drafter_for_target(target, choices, seed, base, str(config))
    if layers_from_target:
        copy_target_layers(drafter, target, layers_from_target)
    save_drafter(drafter, out)
    return drafter, target


# init flags that shape a fresh drafter; --from-drafter takes its shape from the drafter instead
FRESH_ONLY = (
    "config",
    "draft_layers",
    "mask_token_id",
    "target_layer_ids",
    "layer_types",
    "sliding_window",
    "is_causal",
    "layers_from_target",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "max_position_embeddings",
    "rope_scaling",
)


def init_from_drafter(
    target_model: str,
    source: str,
    out: str | Path,
    *,
    family: str | None,
    sizes: dict,
    block_size: int | None,
    seed: int,
    fresh: dict[str, Any],
) -> DFlashDrafter:
    """`init --family dflash2 --from-drafter SOURCE`: SOURCE's backbone with DFlash2's parts started neutral,
    written to `out`. `fresh`: the FRESH_ONLY options as given (each must be None)."""
    if family != "dflash2":
        raise FlashdraftError(
            f"--from-drafter {source}: expected --family dflash2 (the family to turn "
            f"the drafter into; a DSpark drafter's layout differs: it starts fresh)"
        )
    given = [name for name in FRESH_ONLY if fresh.get(name) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise FlashdraftError(f"{flag}: --from-drafter takes the drafter's shape and layers as they are; leave it out")
    target = TargetHead.load(target_model)
    drafter = load_any_drafter(source, target).drafter
    check_drafter_matches_target(drafter.config, target, str(source))
    new = dflash2_from_drafter(drafter, sizes, block_size, seed)
    save_drafter(new, out)
    return new
