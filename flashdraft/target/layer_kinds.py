"""Whether flashdraft supports a target, read from what the model is: its decoder layers' kinds, as its config names
them (transformers' own `layer_types` vocabulary: `get_layer_types_and_kwargs`, the table `DynamicCache` builds its
layers by) and as its modules are built (which recurrent mixer a linear layer holds, whether attention caches MLA
latents), each mapped to an exact rollback rule (`ROLLBACK`, reference doc sections 6 and 15).

A causal LM whose kinds all have a rule works through every stage; anything else is refused before its weights load,
in one line naming the model type and the layer kind (`read_support` builds the model on the meta device: modules,
no weights). The family table (`families.py`) adds only what cannot be read: reasoning markers and notes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashdraft.errors import FlashdraftError
from flashdraft.target.mamba import is_mamba
from flashdraft.target.mla import is_mla

# how each kind of layer's cache rolls back after partial acceptance
ROLLBACK = {
    "attention": "KV cropped (DynamicLayer.crop)",
    "sliding": "window layers record their past until the next crop, which cuts the rejected block and the excess",
    "chunked": "chunked-attention layers record their past as sliding ones and are cut back the same way",
    "mla": "the compressed latents (kv_nope, k_rot) cropped on the sequence axis, as KV",
    "gated_deltanet": "conv and recurrent states copied before the forward; the accepted prefix recomputed",
    "mamba2": "conv and SSM states copied before the forward; the Mamba-2 mixers re-run over the accepted prefix",
    "mamba2+attention": "KV cropped, and the Mamba-2 mixer beside it restored and re-run over the accepted prefix",
    "mlp": "no cache (an MLP or MoE block alone)",
}
RECURRENT = ("gated_deltanet", "mamba2", "mamba2+attention")  # kinds whose states are copied and recomputed
# transformers' layer types (its cache table) read as a kind here without looking at the module
BY_LAYER_TYPE = {"sliding_attention": "sliding", "chunked_attention": "chunked"}


@dataclass(frozen=True)
class TargetSupport:
    """What flashdraft read of a target: its model type, each decoder layer's kind (ROLLBACK's keys), MoE or not."""

    model_type: str
    layer_kinds: tuple[str, ...]
    moe: bool

    @property
    def kinds(self) -> list[str]:
        return list(dict.fromkeys(self.layer_kinds))

    def rollback(self) -> list[str]:
        return [f"{kind}: {ROLLBACK[kind]}" for kind in self.kinds]

    def describe(self) -> str:
        counts = ", ".join(f"{self.layer_kinds.count(k)} {k}" for k in self.kinds)
        return f"{self.model_type}: {counts}{' (MoE)' if self.moe else ''}"


def refuse(where: str, model_type: str, what: str) -> FlashdraftError:
    return FlashdraftError(
        f"{where}: model type {model_type!r}: {what}; flashdraft rolls back only {', '.join(ROLLBACK)} layers "
        f"(docs/targets.md)"
    )


def recurrent_kind(mixer: nn.Module) -> str | None:
    """gated_deltanet, mamba2, or None for a recurrent mixer flashdraft has no rule for (Mamba-1, short convolutions,
    lightning attention): Mamba-2 mixers (Nemotron-H's, Falcon-H1's, Bamba's) share `n_groups` and `ssm_state_size`."""
    if type(mixer).__name__.endswith("GatedDeltaNet"):  # in Qwen3.5's projections or Qwen3-Next's (qwen3_next.py)
        return "gated_deltanet" if hasattr(mixer, "in_proj_qkv") or hasattr(mixer, "in_proj_qkvz") else None
    if is_mamba(mixer):
        return "mamba2"
    return None


def mixer_of(layer: nn.Module) -> nn.Module | None:
    """The recurrent token mixer of a layer: Qwen3.5's `linear_attn`, Nemotron-H's `mixer`, Falcon-H1's `mamba`."""
    for name in ("linear_attn", "mixer", "mamba"):
        if isinstance(getattr(layer, name, None), nn.Module):
            return getattr(layer, name)
    return None


def attention_of(layer: nn.Module) -> nn.Module | None:
    for name in ("self_attn", "attention", "mixer"):
        if isinstance(getattr(layer, name, None), nn.Module):
            return getattr(layer, name)
    return None


def layer_kind(layer_type: str, layer: nn.Module) -> tuple[str | None, str]:
    """(kind, what it is called) of one decoder layer; kind None when no rule fits."""
    cross = [name for name in ("encoder_attn", "cross_attn") if hasattr(layer, name)]
    if cross or "CrossAttention" in type(layer).__name__:  # a decoder reading an encoder's or an image's states
        return None, f"cross-attention ({type(layer).__name__})"
    if layer_type in BY_LAYER_TYPE:
        return BY_LAYER_TYPE[layer_type], layer_type
    mixer = mixer_of(layer)
    if layer_type == "full_attention":
        attention = attention_of(layer)
        return ("mla" if attention is not None and is_mla(attention) else "attention"), layer_type
    if layer_type == "linear_attention":
        found = None if mixer is None else recurrent_kind(mixer)
        return found, f"linear_attention ({type(mixer).__name__ if mixer is not None else type(layer).__name__})"
    if layer_type == "hybrid":  # a recurrent mixer and attention side by side in one layer (Falcon-H1)
        fits = mixer is not None and recurrent_kind(mixer) == "mamba2" and hasattr(layer, "self_attn")
        return ("mamba2+attention" if fits else None), f"hybrid ({type(layer).__name__})"
    if layer_type == "dummy":  # no cache of its own: an MLP/MoE block (KV shared between layers refused before)
        return "mlp", layer_type
    return None, layer_type


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder: `get_decoder()`, or the `model` inside a causal LM whose `get_decoder` finds only itself
    (Llama 4's text model)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if decoder is model and isinstance(getattr(model, "model", None), nn.Module):
        decoder = model.model
    return decoder


def support_of_model(model: nn.Module, where: str = "the target") -> TargetSupport:
    """The support decision on a built model (on the meta device or loaded); refused in one line (FlashdraftError)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = model.config
    text = config.get_text_config(decoder=True)
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        raise refuse(where, model_type, "the decoder of an encoder-decoder model (it attends to an encoder's states)")
    if getattr(text, "kv_sharing_modes", None) and "reuse" in text.kv_sharing_modes:
        raise refuse(where, model_type, "layer kind 'KV shared between layers' has no rollback rule")
    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise refuse(where, model_type, f"its decoder ({type(decoder_of(model)).__name__}) has no `layers` list")
    try:
        layer_types, _ = get_layer_types_and_kwargs(text)
    except (AttributeError, ValueError, KeyError, TypeError) as e:
        raise refuse(where, model_type, f"its layer kinds cannot be read ({' '.join(str(e).split())[:200]})") from None
    crossing = next((layer for layer in layers if layer_kind("full_attention", layer)[0] is None), None)
    if crossing is not None:  # said before any count, which an encoder-decoder config does not keep
        raise refuse(where, model_type, f"its layers read another model's states ({layer_kind('', crossing)[1]})")
    if len(layer_types) != len(layers):
        raise refuse(
            where,
            model_type,
            f"{len(layer_types)} layer kinds for {len(layers)} decoder layers (caches within a layer)",
        )
    kinds = []
    for i, (layer_type, layer) in enumerate(zip(layer_types, layers, strict=True)):
        kind, called = layer_kind(layer_type, layer)
        if kind is None:
            raise refuse(where, model_type, f"layer {i} is of kind {called!r}, which has no rollback rule")
        kinds.append(kind)
    if all(kind in ("gated_deltanet", "mamba2", "mlp") for kind in kinds):
        raise refuse(where, model_type, f"every layer is {'/'.join(dict.fromkeys(kinds))}: no attention layer")
    moe = any(name.rsplit(".", 1)[-1] == "experts" for name, _ in model.named_modules())
    return TargetSupport(model_type, tuple(kinds), moe)


def read_support(config, where: str = "the target") -> TargetSupport:
    """The support decision before any weight loads: the model built from its config on the meta device."""
    from transformers import AutoModelForCausalLM

    model_type = getattr(config.get_text_config(decoder=True), "model_type", None) or config.model_type
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises building it, said in one line
        raise refuse(
            where,
            model_type,
            f"transformers cannot build it as a causal LM ({type(e).__name__}: {' '.join(str(e).split())[:200]})",
        ) from None
    return support_of_model(model, where)


def _scaled(factor: float):
    return lambda logits: logits * factor


def _capped(cap: float):
    return lambda logits: torch.tanh(logits / cap) * cap


def logit_candidates(config) -> list[tuple[str, object]]:
    """The transforms a causal LM may apply to its LM head's output, named by the config fields that set them
    (Cohere's `logit_scale` times; Granite's `logits_scaling` divides, HyperCLOVA X's multiplies, MiniCPM3's divides
    the hidden state; Gemma's and nanochat's `final_logit_softcapping`), then none."""
    found = []
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale not in (0, 1):
        found.append((f"logit_scale x{scale}", _scaled(scale)))
    scaling = getattr(config, "logits_scaling", None)
    if isinstance(scaling, (int, float)) and scaling not in (0, 1):
        found += [
            (f"logits_scaling /{scaling}", _scaled(1 / scaling)),
            (f"logits_scaling x{scaling}", _scaled(scaling)),
        ]
    cap = getattr(config, "final_logit_softcapping", None)
    if isinstance(cap, (int, float)) and cap > 0:
        found.append((f"final_logit_softcapping {cap}", _capped(cap)))
    return [*found, ("none", lambda logits: logits)]


@torch.no_grad()
def read_logit_transform(model: nn.Module, decoder: nn.Module, where: str = "the target"):
    """(name, function) turning the LM head's output into the model's own logits, read by running the model once on
    8 tokens both ways (the causal LM, and the LM head on the decoder's output); a model whose logits no known
    transform gives is refused in one line."""
    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    ids = (torch.arange(8, device=device) % max(2, config.vocab_size - 1) + 1)[None]
    own = model(input_ids=ids).logits.float()
    if not torch.isfinite(own).all():  # an fp16 target whose residual stream overflows: named, layer and value
        from flashdraft.target.overflow import overflow_in_forward

        overflow = overflow_in_forward(decoder, ids)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        if overflow is not None:
            raise FlashdraftError(overflow.line(where, dtype))
        raise FlashdraftError(f"{where}: its logits on a probe of 8 tokens are not finite (computing in {dtype})")
    head = model.get_output_embeddings()(decoder(input_ids=ids).last_hidden_state).float()
    tolerance = 1e-4 if own.dtype == torch.float32 and head.dtype == torch.float32 else 2e-2
    size = own.abs().max().clamp_min(1e-6)
    candidates = logit_candidates(config)
    for name, transform in candidates:
        if float((transform(head) - own).abs().max() / size) < tolerance:
            return name, transform
    raise refuse(
        where,
        getattr(config, "model_type", "?"),
        f"its logits are not its LM head's output under any transform it configures "
        f"({', '.join(n for n, _ in candidates)})",
    )
