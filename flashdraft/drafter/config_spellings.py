"""A drafter's config.json as written, in every dialect and spelling the servers read, resolved into
`DrafterConfig`'s fields (`config_fields`; `DrafterConfig.from_dict` builds and validates the config from them).

Dialects: the public DFlash config (its fields in `dflash_config`), DeepSpec's (its fields at the top level) and
SpecForge's DSpark (`projector_type: dspark`). Spellings: a field servers read from dflash_config first, then the top
level (`_draft_value`); DSpark's in four places (`_dspark_value`); the layers' attention as vLLM 0.33.0 resolves it
(`use_swa`, `swa_window_size`, `dflash_config.causal`); the RoPE schemas (`flashdraft.drafter.rope`); the stored weight
conventions (`use_gemma_norm`, `is_neox_style`). Spellings that disagree are refused: the servers would differ."""

from __future__ import annotations

import json
import warnings
from typing import Any

from flashdraft.drafter.families import FAMILIES, by_architectures
from flashdraft.drafter.rope import DEFAULT_MAX_POSITIONS, read_rope
from flashdraft.drafter.server_fields import SGLANG, VLLM, refuse_unsupported
from flashdraft.errors import FlashdraftError

# DFlash2's dflash_config fields (vLLM 0.33.0 `qwen3_dflash2.py`), with the published checkpoint's
# values (z-lab/Qwen3.8-27B-DFlash2): the grouped dynamic causal convolution around each sublayer
# and the candidate selector over the unary top-K
DFLASH2_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# DSpark (DeepSeek, DeepSpec; vLLM 0.33.0 `qwen3_dspark.py`): the Markov head's rank of the DeepSpec configs
DSPARK_MARKOV_RANK = 256
# the config fields of a DSpark drafter as vLLM 0.33.0 reads them (top level), which flashdraft writes
DSPARK_FIELDS = (
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "dspark_draft_topk",
    "sample_from_anchor",
)
# Fields DrafterConfig owns; anything else found in a config.json is kept in `extra` and
# written back unchanged, so a public config survives a load/save round trip.
_OWN = {
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "num_target_layers",
    "block_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "attention_bias",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "hidden_act",
    "dflash_config",
    "architectures",
    "model_type",
    "tie_word_embeddings",
    "is_causal",
    "draft_vocab_size",
    "target_hidden_size",
    *DFLASH2_FIELDS,
    "partial_rotary_factor",
    "use_gemma_norm",
    "is_neox_style",
    "rope_is_neox_style",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
    *DSPARK_FIELDS,
    "target_layer_ids",
    "mask_token_id",
    "projector_type",
    "dspark_config",
    "trained_context_length",
    "trained_positions",
}
# dflash_config fields resolved on load into the fields above (and not written back)
_RESOLVED_DFLASH = (
    "causal",
    "use_swa",
    "swa_window_size",
    "block_size",
    *DFLASH2_FIELDS,
    *DSPARK_FIELDS,
    "projector_type",
)
# dflash_config fields of the z-lab reference that change the drafter's computation, with
# the value that changes nothing
REFERENCE_OPTIONS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def config_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """`DrafterConfig`'s keyword arguments from the config.json `d` (read from `source`, which errors name)."""
    dflash = _dflash_config(d, source)
    rope = read_rope(d, source)  # either schema, as transformers 5 reads it; disagreeing ones refused
    gemma_norm, neox_style = _stored_conventions(d, source)
    layer_types, sliding_window, is_causal = _resolve_attention_spellings(d, dflash, source)
    target_hidden = d.get("target_hidden_size")
    if target_hidden is not None and target_hidden != d["hidden_size"]:
        raise FlashdraftError(
            f"{source}: field 'target_hidden_size' is {target_hidden!r}; expected {d['hidden_size']} "
            f"(hidden_size): a drafter narrower than its target needs its own embeddings, which flashdraft "
            f"does not support"
        )
    family = _family(d, dflash, source)
    dspark = _dspark_fields(d, dflash, family, source)
    dflash2 = {name: _draft_value(d, dflash, name, source) for name in DFLASH2_FIELDS}
    if family == "dflash" and any(v is not None for v in dflash2.values()):
        name = next(n for n, v in dflash2.items() if v is not None)
        raise FlashdraftError(
            f"{source}: field 'dflash_config.{name}' is {dflash2[name]!r} but architectures is "
            f'{d.get("architectures")!r}; expected architectures ["DFlash2DraftModel"] with DFlash2\'s fields, '
            f"or none of them (vLLM builds the DFlash2 modules from architectures and would ignore them)"
        )
    heads = d["num_attention_heads"]
    layer_ids = _draft_value(d, dflash, "target_layer_ids", source)
    block_size = _draft_value(d, dflash, "block_size", source)
    return dict(
        hidden_size=d["hidden_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"],
        vocab_size=d["vocab_size"],
        num_target_layers=d["num_target_layers"],
        target_layer_ids=list(layer_ids) if isinstance(layer_ids, list) else layer_ids,
        mask_token_id=_draft_value(d, dflash, "mask_token_id", source),
        block_size=block_size if block_size is not None else FAMILIES[family].default_block_size,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        max_position_embeddings=d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
        attention_bias=d.get("attention_bias", False),
        layer_types=layer_types,
        sliding_window=sliding_window,
        hidden_act=d.get("hidden_act", "silu"),
        is_causal=is_causal,
        draft_vocab_size=d.get("draft_vocab_size"),
        family=family,
        **{name: value or 0 for name, value in dflash2.items()},
        **dspark,
        partial_rotary_factor=rope.partial_rotary_factor,
        trained_context_length=d.get("trained_context_length"),
        trained_positions=d.get("trained_positions"),
        gemma_norm=gemma_norm,
        rope_neox_style=neox_style,
        extra=_extra(d, dflash, source),
    )


def _dflash_config(d: dict[str, Any], source: str) -> dict[str, Any]:
    """`d`'s dflash_config ({} in DeepSpec's dialect), once the fields every drafter needs are found and the fields
    flashdraft refuses are not."""
    if not isinstance(d, dict):
        raise FlashdraftError(f"{source}: expected a JSON object, found {type(d).__name__}")
    dflash = d.get("dflash_config")
    if dflash is None and "target_layer_ids" in d:  # DeepSpec's dialect: its fields at the top level
        dflash = {}
    if not isinstance(dflash, dict):
        raise FlashdraftError(
            f"{source}: field 'dflash_config' is {dflash!r}; expected an object with "
            f"target_layer_ids and mask_token_id (is this a DFlash drafter?)"
        )
    required = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
        "num_target_layers",
    ]
    for name in required:
        if name not in d:
            raise FlashdraftError(f"{source}: field '{name}' is missing; expected an integer")
    for name in ("target_layer_ids", "mask_token_id"):
        if _draft_value(d, dflash, name, source) is None:
            raise FlashdraftError(f"{source}: field 'dflash_config.{name}' is missing")
    refuse_unsupported(d, source)
    if "sliding_attention" in (d.get("layer_types") or []) and d.get("use_sliding_window") is False:
        warnings.warn(
            f"{source}: layer_types has sliding_attention layers but use_sliding_window is false; "
            f"transformers-based loaders would run them as FULL attention. flashdraft honours "
            f"layer_types (window {d.get('sliding_window')}); check what your server does.",
            stacklevel=4,
        )
    return dflash


def _extra(d: dict[str, Any], dflash: dict[str, Any], source: str) -> dict[str, Any]:
    """What flashdraft keeps without reading it and writes back unchanged: the fields it does not own, and the
    dflash_config fields it does not resolve (the reference's options among them, from either place)."""
    extra_dflash = {
        k: v for k, v in dflash.items() if k not in ("target_layer_ids", "mask_token_id", *_RESOLVED_DFLASH)
    }
    for name in REFERENCE_OPTIONS:  # the reference reads them from dflash_config, then the top level
        value = _draft_value(d, dflash, name, source)
        if value is not None:
            extra_dflash[name] = value
    extra = {k: v for k, v in d.items() if k not in _OWN}
    if extra_dflash:
        extra["dflash_config"] = extra_dflash
    return extra


def _stored_conventions(d: dict[str, Any], source: str) -> tuple[bool, bool]:
    """(gemma_norm, neox_style) of the stored weights: use_gemma_norm (SGLang's (1 + w) RMSNorms) and
    is_neox_style / rope_is_neox_style (false: GPT-J rotation); the two rotation spellings must agree."""
    gemma = d.get("use_gemma_norm")
    if gemma is not None and not isinstance(gemma, bool):
        raise FlashdraftError(f"{source}: field 'use_gemma_norm' is {gemma!r}; expected true, false or absent")
    styles = {name: d[name] for name in ("is_neox_style", "rope_is_neox_style") if d.get(name) is not None}
    for name, value in styles.items():
        if not isinstance(value, bool):
            raise FlashdraftError(f"{source}: field '{name}' is {value!r}; expected true, false or absent")
    if len(set(styles.values())) > 1:
        raise FlashdraftError(
            f"{source}: fields 'is_neox_style' and 'rope_is_neox_style' disagree ({styles}); "
            f"expected one rotation style"
        )
    return bool(gemma), next(iter(styles.values()), True)


def _family(d: dict[str, Any], dflash: dict[str, Any], source: str) -> str:
    """The drafter family a config names: its `architectures` list (`families.by_architectures`), or SpecForge's
    `projector_type: dspark` in dflash_config."""
    architectures_ = d.get("architectures")
    name = by_architectures(architectures_, source)
    projector = _draft_value(d, dflash, "projector_type", source)
    if projector == "dspark" and name != "dflash2":  # SpecForge writes its DSpark drafters as DFlash + projector
        name = "dspark"
    elif projector is not None:
        raise FlashdraftError(
            f"{source}: field 'projector_type' is {projector!r} with architectures "
            f"{architectures_!r}; expected absent, or 'dspark' (SpecForge's DSpark)"
        )
    return name


def _dspark_value(d: dict[str, Any], dflash: dict[str, Any], name: str, source: str) -> Any:
    """A DSpark field in every spelling SGLang 0.5.23 `parse_dspark_draft_config` reads: the top level (vLLM 0.33.0,
    DeepSpec), dflash_config (SpecForge), dspark_config, and the prefixed `dspark_<name>`; spellings that disagree
    are refused (the servers would build different drafters)."""
    short = name.removeprefix("dspark_")
    nested = d.get("dspark_config") if isinstance(d.get("dspark_config"), dict) else {}
    spellings = {
        name: d.get(name),
        f"dflash_config.{name}": dflash.get(name),
        f"dspark_config.{name}": nested.get(name),
        f"dspark_{short}": d.get(f"dspark_{short}"),
    }
    found = {where: value for where, value in spellings.items() if value is not None}
    if len({json.dumps(v, sort_keys=True) for v in found.values()}) > 1:
        raise FlashdraftError(f"{source}: fields {', '.join(found)} disagree ({found}); expected one value")
    return next(iter(found.values()), None)


def _dspark_fields(d: dict[str, Any], dflash: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """The DSpark fields of a config, as DrafterConfig keywords ({} outside the family, where they are refused)."""
    values = {name: _dspark_value(d, dflash, name, source) for name in DSPARK_FIELDS}
    # the refused values in the spellings `refuse_unsupported` (the top level) does not see
    if values["markov_head_type"] not in (None, "vanilla") or values["sample_from_anchor"] is False:
        name = "markov_head_type" if values["markov_head_type"] not in (None, "vanilla") else "sample_from_anchor"
        raise FlashdraftError(
            f"{source}: field '{name}' (nested or prefixed) is {values[name]!r}; expected "
            f"{'vanilla' if name == 'markov_head_type' else 'true'} or absent (see the top-level "
            f"field in flashdraft's table of server fields)"
        )
    if family != "dspark":
        switches = ("markov_rank", "enable_confidence_head", "confidence_head_with_markov", "dspark_draft_topk")
        name = next((n for n in switches if values[n] is not None), None)
        if name is not None:
            raise FlashdraftError(
                f"{source}: field '{name}' is {values[name]!r} but architectures is {d.get('architectures')!r}; "
                f'expected architectures ["Qwen3DSparkModel"] with DSpark\'s fields, or none of them'
            )
        return {}
    confidence = values["enable_confidence_head"]
    with_markov = values["confidence_head_with_markov"]
    if confidence and with_markov is None:
        raise FlashdraftError(
            f"{source}: field 'confidence_head_with_markov' is missing with enable_confidence_head true; expected true "
            f"or false (absent, {VLLM} reads false and {SGLANG} true: the servers would build other heads)"
        )
    return {
        "markov_rank": values["markov_rank"] if values["markov_rank"] is not None else 0,
        "confidence_head": bool(confidence) if isinstance(confidence, bool | None) else confidence,
        "confidence_head_with_markov": bool(with_markov) if isinstance(with_markov, bool | None) else with_markov,
        "draft_top_k": values["dspark_draft_topk"],
    }


def _draft_value(d: dict[str, Any], dflash: dict[str, Any], name: str, source: str) -> Any:
    """A field servers read from dflash_config first, then the top level (vLLM 0.33.0
    `qwen3_dflash2.py` `_draft_value`); both present and different is refused."""
    nested, top = dflash.get(name), d.get(name)
    if nested is not None and top is not None and nested != top:
        raise FlashdraftError(
            f"{source}: field 'dflash_config.{name}' is {nested!r} but the top-level '{name}' is {top!r}; expected "
            f"one value (servers read dflash_config's, other loaders the top level's)"
        )
    return nested if nested is not None else top


def _resolve_attention_spellings(
    d: dict[str, Any], dflash: dict[str, Any], source: str
) -> tuple[list[str], int | None, bool | None]:
    """(layer_types, sliding_window, is_causal) from every spelling servers read, resolved as
    vLLM 0.33.0 does (`_resolve_layer_attention`, `_dflash_layer_causal`): `use_swa` makes every
    layer sliding when layer_types has none (those layers stay non-causal: causality comes from
    the layer types as written); `swa_window_size` overrides `sliding_window`; causality is the
    top-level `is_causal`, else `dflash_config.causal`, else the layer types' default."""
    written = d.get("layer_types")
    layer_types = list(written) if isinstance(written, list) else []
    if written is not None and not isinstance(written, list):
        raise FlashdraftError(f"{source}: field 'layer_types' is {written!r}; expected a list, one entry per layer")
    use_swa = dflash.get("use_swa", False)
    if not isinstance(use_swa, bool):
        raise FlashdraftError(f"{source}: field 'dflash_config.use_swa' is {use_swa!r}; expected true or false")
    is_causal = d.get("is_causal")
    if is_causal is None:
        is_causal = dflash.get("causal")
        if is_causal is not None and not isinstance(is_causal, bool):
            raise FlashdraftError(f"{source}: field 'dflash_config.causal' is {is_causal!r}; expected true or false")
    num_layers = d["num_hidden_layers"]
    if use_swa and "sliding_attention" not in layer_types and isinstance(num_layers, int):
        if is_causal is None:
            is_causal = False  # the layers written as full (or untyped) keep their non-causal default
        layer_types = ["sliding_attention"] * num_layers
    window = d.get("sliding_window")
    if dflash.get("swa_window_size") is not None and "sliding_attention" in layer_types:
        window = dflash["swa_window_size"]
    return layer_types, window, is_causal
