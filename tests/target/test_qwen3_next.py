import pytest
import torch
from transformers import DynamicCache

from flashdraft.target.linear_attention import install_short_block_path
from flashdraft.target.qwen3_next import qwen3_next_projections
from tests.target.tiny_families import make_family_model


def test_regrouped_projections_are_what_the_layers_own_ordering_gives():
    layer = make_family_model("qwen3_next").model.layers[0].linear_attn
    hidden = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(0))
    mixed_qkv, z, b, a = qwen3_next_projections(layer, hidden)
    query, key, value, z_ref, b_ref, a_ref = layer.fix_query_key_value_ordering(
        layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden)
    )
    assert mixed_qkv.shape == (1, 5, layer.conv_dim)  # query | key | value: the conv's channels
    assert torch.equal(mixed_qkv[..., : layer.key_dim], query.reshape(1, 5, -1))
    assert torch.equal(mixed_qkv[..., layer.key_dim : 2 * layer.key_dim], key.reshape(1, 5, -1))
    assert torch.equal(mixed_qkv[..., 2 * layer.key_dim :], value.reshape(1, 5, -1))
    assert torch.equal(z, z_ref) and torch.equal(b, b_ref) and torch.equal(a, a_ref)
    assert b.shape == (1, 5, layer.num_v_heads)  # two value heads per key head, as the released model


@pytest.mark.parametrize(("prefix", "seq_len"), [(20, 1), (20, 8), (0, 8)])
def test_short_block_path_equals_transformers_path_on_qwen3_next_and_leaves_the_same_states(prefix, seq_len):
    reference, model = make_family_model("qwen3_next"), make_family_model("qwen3_next")
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            install_short_block_path(layer.linear_attn)
    ids = torch.randint(0, 60, (1, prefix + seq_len), generator=torch.Generator().manual_seed(2))
    caches = [DynamicCache(config=m.config) for m in (reference, model)]
    outs = []
    for m, cache in zip((reference, model), caches, strict=True):
        if prefix:
            m(ids[:, :prefix], past_key_values=cache, use_cache=True)
        outs.append(m(ids[:, prefix:], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    for i in (0, 1, 3):  # the Gated DeltaNet layers
        torch.testing.assert_close(caches[1].layers[i].conv_states[0], caches[0].layers[i].conv_states[0])
        torch.testing.assert_close(
            caches[1].layers[i].recurrent_states[0], caches[0].layers[i].recurrent_states[0], rtol=1e-5, atol=1e-5
        )


def test_a_layer_whose_conv_activation_is_not_silu_keeps_transformers_forward():
    layer = make_family_model("qwen3_next", hidden_act="gelu").model.layers[0].linear_attn
    install_short_block_path(layer)
    assert "forward" not in vars(layer)
