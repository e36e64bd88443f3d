"""Tiny random targets of the families beyond dense Qwen3 and the Qwen3.5 hybrid (MoE: Qwen3-MoE, Qwen3.5-MoE,
GLM-4.x, gpt-oss with its sliding-window layers; recurrent or latent caches: Qwen3-Next, Nemotron-H, DeepSeek-V3's
MLA and GLM-4.7-Flash's), built from their transformers 5.23 configs: hidden 128, head_dim 64 where it applies, 4
layers mixing the layer kinds each family has (linear and full attention, Mamba-2, MoE and dense MLPs)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from flashdraft.target.model import TargetModel
from tests.conftest import EOS, MASK, PAD, VOCAB, make_tokenizer

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    eos_token_id=EOS,
    pad_token_id=PAD,
    max_position_embeddings=512,
)
# MLA: a query/key head of 32 + 32 (no RoPE | RoPE), values of 64; transformers sets head_dim to the RoPE part
MLA = dict(
    num_key_value_heads=2,
    head_dim=None,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=64,
)
# Gated DeltaNet layers beside MoE MLPs with a shared expert: Qwen3-Next's and the Qwen3.5/3.6 MoE hybrids'
GATED_DELTANET_MOE = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)
FAMILIES = {
    "qwen3_next": GATED_DELTANET_MOE
    | dict(  # three Gated DeltaNet layers and one gated full-attention layer, MoE but layer 1
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_only_layers=[1],
    ),
    "nemotron_h": dict(  # one block of each kind: Mamba-2, MoE, attention, MLP
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        mamba_num_heads=4,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64,
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1]),
    "qwen3_5_moe_text": GATED_DELTANET_MOE
    | dict(  # the Qwen3.5/3.6 MoE hybrids' text model: Gated DeltaNet and gated attention, MoE
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    "glm4_moe": dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1, n_group=1
    ),
    "gpt_oss": dict(  # MoE, sliding-window layers with sinks; a window of 8 so that contexts pass it
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    "deepseek_v3": MLA | dict(first_k_dense_replace=1),  # a dense layer, then MoE
    "deepseek_v2": MLA | dict(first_k_dense_replace=1),
    "glm4_moe_lite": MLA | dict(mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
}


def make_family_model(model_type: str, seed: int = 0, **overrides):
    """A tiny random model of `model_type` with sharpened logits (greedy choices far from ties) and a zero EOS row
    (random targets run to the length limit), as `tests.conftest.make_hf_model`."""
    torch.manual_seed(seed)
    own = (FAMILIES | READ_TYPES | MORE_TYPES)[model_type]
    fields = {k: v for k, v in (COMMON | own | overrides).items() if v is not None}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        model.get_output_embeddings().weight[fields["eos_token_id"]] = 0.0
    return model.float().eval()


def make_family_target(model_type: str, seed: int = 0, **overrides) -> TargetModel:
    return TargetModel(make_family_model(model_type, seed, **overrides), make_tokenizer(), path=None)


# model types whose tokenizer class transformers fixes whatever the files say (its Qwen3.5 byte-level BPE)
BPE_TOKENIZER_TYPES = {"qwen3_5_moe_text", "qwen2"}


def make_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of the test vocabulary's size, as Qwen3.5's tokenizer class reads one: the prompts'
    words t0..t60 are "t" (or "Ġt" after a space) and one token per digit."""
    pieces = ["t", "Ġt", *map(str, range(10))]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    vocab |= {f"x{i}": i for i in range(len(pieces), VOCAB - 3)} | {"<eos>": EOS, "<pad>": PAD, "<mask>": MASK}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", mask_token="<mask>")


def save_family_target(directory: Path, model_type: str, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    make_family_model(model_type, seed).save_pretrained(directory)
    tokenizer = make_bpe_tokenizer() if model_type in BPE_TOKENIZER_TYPES else make_tokenizer()
    tokenizer.save_pretrained(directory)
    return directory


# the model types whose support is read from the model and no family row (issue: every target transformers builds);
# the README pipeline runs on each (tests/target/test_tiny_families.py)
SMALL_EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=64)
READ_TYPES = {
    "qwen2": {},
    "qwen2_moe": SMALL_EXPERTS | dict(num_experts=4, shared_expert_intermediate_size=64),
    "mistral": dict(sliding_window=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(sliding_window=8),
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
    "phi3": {},
    "granite": {},
    "olmo2": {},
    "ernie4_5_moe": SMALL_EXPERTS | dict(moe_num_experts=4, moe_k=2, moe_layer_start_index=1),
    "llama4_text": dict(
        attention_chunk_size=8, num_local_experts=2, intermediate_size_mlp=256, no_rope_layers=[1, 1, 1, 0]
    ),
    "falcon_h1": dict(
        mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16
    ),
}

# model types the pipeline test leaves out (each checked where it once failed): Granite 4.0's layout renames its
# router on load (tests/target/test_weights.py), Gemma 4's layers have head_dims of their own (drafter/test_init.py)
MORE_TYPES = {
    "granitemoehybrid": dict(  # IBM Granite 4.0's layout: Mamba-2 and attention layers, MoE with a shared MLP
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=64,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
    ),
    "gemma4_text": dict(  # full-attention layers with a head_dim of their own (per_layer_config)
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
    ),
}
