"""Multi-head latent attention (MLA: DeepSeek-V3, GLM-4.7-Flash's `glm4_moe_lite`, DeepSeek-V2) in transformers 5.23.

MLA caches compressed latents, not per-head keys and values: each layer's cache holds `kv_nope`
[B, 1, S, kv_lora_rank] (after `kv_a_layernorm`) and `k_rot` [B, 1, S, qk_rope_head_dim] (after RoPE) as one
"head" each, and `expand_kv` turns them into keys [B, heads, S, qk_nope + qk_rope] and values [B, heads, S,
v_head_dim] after the cache, on every forward. The sequence axis is still axis -2, so `DynamicLayer.crop` cuts
the latents back exactly: rollback needs nothing more than for full attention.

One trap: the keys `expand_kv` returns already have one head per query head, but the attention module keeps
`num_key_value_groups = heads / num_key_value_heads` from the config, and transformers' sdpa path repeats the
keys that many times more whenever it cannot pass `enable_gqa` (a multi-token query with a mask, as every
verified block after a cache has, or keys wider than values). A config with num_key_value_heads below
num_attention_heads then fails in `scaled_dot_product_attention` (size mismatch) on a verification, while with
keys as wide as values prefill and one-token decoding (all transformers' own `generate` runs) pass: transformers'
generate runs the model, flashdraft's verification did not. MLA has no key/value heads of
its own (`kv_b_proj` expands the latent for every query head) and published checkpoints set both counts equal:
`align_mla_heads` sets the groups to 1, which is the model as defined and changes nothing where they are equal.
"""

from __future__ import annotations

from torch import nn

# model types whose attention caches the latents as DeepseekV3Attention does: glm4_moe_lite's is its class body line
# by line (names aside); deepseek_v2's differs only in how RoPE is applied to k_rot before the cache
MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite", "deepseek_v2")


def is_mla(module: nn.Module) -> bool:
    return hasattr(module, "kv_b_proj") and hasattr(module, "expand_kv")


def align_mla_heads(model: nn.Module) -> int:
    """Give every MLA attention module of `model` one key/value group per query head (see the module doc);
    returns how many modules it changed."""
    changed = 0
    for module in model.modules():
        if is_mla(module) and getattr(module, "num_key_value_groups", 1) != 1:
            module.num_key_value_groups = 1
            changed += 1
    return changed
