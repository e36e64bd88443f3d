import pytest
import torch
from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule

from flashdraft.decoding.generate import SpeculativeConfig, autoregressive_generate, speculative_generate
from flashdraft.target.linear_attention import (
    BlockRecord,
    causal_conv_window,
    gated_delta_rule_block,
    install_short_block_path,
    state_after,
)
from flashdraft.target.model import TargetModel
from tests.conftest import EOS, PAD, make_hf_model, make_tokenizer
from tests.decoding.test_generate import PROMPT, OracleProposer


def random_rule_inputs(seq_len: int, heads: int = 3, dk: int = 8, dv: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, seq_len, heads, dk, generator=gen)  # [B, T, H, dk] each
    v = torch.randn(1, seq_len, heads, dv, generator=gen)
    g = -torch.rand(1, seq_len, heads, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(1, seq_len, heads, generator=gen)
    state = torch.randn(1, heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def direct_block(q, k, v, g, beta, state):
    """gated_delta_rule_block on transformers' layout, with its L2 norm and query scaling."""
    q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    out, final, _, _ = gated_delta_rule_block(*(x.transpose(1, 2) for x in (q, k, v, g, beta)), state)
    return out.transpose(1, 2), final


@pytest.mark.parametrize("seq_len", [1, 2, 5, 17, 64])
def test_direct_block_equals_transformers_chunked_and_recurrent_rules(seq_len):
    q, k, v, g, beta, state = random_rule_inputs(seq_len)
    out, final = direct_block(q, k, v, g, beta, state)
    for rule in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        ref_out, ref_final = rule(
            q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)


def test_direct_block_from_a_zero_state_equals_the_chunked_prefill():
    q, k, v, g, beta, state = random_rule_inputs(9, seed=1)
    out, final = direct_block(q, k, v, g, beta, torch.zeros_like(state))
    ref_out, ref_final = torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_len", [1, 7])
def test_state_after_a_prefix_of_the_block_equals_running_only_that_prefix(seq_len):
    """Rollback takes the states after the accepted prefix from the block's record: they must be
    those of a forward over the prefix alone (the solve is causal), conv window included."""
    q, k, v, g, beta, state = random_rule_inputs(seq_len, seed=2)
    q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    args = [x.transpose(1, 2) for x in (q, k, v, g, beta)]  # [B, H, T, ...]
    _, _, v_new, cum = gated_delta_rule_block(*args, state)
    window = torch.randn(1, 5, 4 + seq_len, generator=torch.Generator().manual_seed(3))  # [B, C, K + T]
    record = BlockRecord(args[1], v_new, cum, window)
    for kept in range(1, seq_len + 1):
        _, prefix_state, _, _ = gated_delta_rule_block(*(x[:, :, :kept] for x in args), state)
        conv, recurrent = state_after(record, state, kept)
        torch.testing.assert_close(recurrent, prefix_state, rtol=1e-5, atol=1e-5)
        assert torch.equal(conv, window[..., kept : kept + 4])


@pytest.mark.parametrize("seq_len", [1, 6])
def test_causal_conv_window_equals_conv1d(seq_len):
    gen = torch.Generator().manual_seed(0)
    channels, kernel = 12, 4
    x = torch.randn(1, channels, kernel + seq_len, generator=gen)  # [cached K | new T]
    weight = torch.randn(channels, kernel, generator=gen)
    padded = torch.nn.functional.conv1d(x, weight[:, None], padding=kernel - 1, groups=channels)
    expected = padded[:, :, : kernel + seq_len][:, :, -seq_len:]  # as transformers slices it
    torch.testing.assert_close(causal_conv_window(x[..., -(seq_len + kernel - 1) :], weight), expected)


def gqa_hybrid_model(seed: int = 0) -> Qwen3_5ForCausalLM:
    """A Qwen3.5/3.6-shaped hybrid: two value heads per key head, as the released models have."""
    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        eos_token_id=EOS,
        pad_token_id=PAD,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    return Qwen3_5ForCausalLM(cfg).float().eval()


def with_short_blocks(model):
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            install_short_block_path(layer.linear_attn)
    return model


@pytest.mark.parametrize("make_model", [lambda: make_hf_model("hybrid"), gqa_hybrid_model], ids=["hybrid", "gqa"])
@pytest.mark.parametrize(("prefix", "seq_len"), [(20, 1), (20, 17), (9, 5), (0, 17), (0, 2)])
def test_short_block_path_equals_transformers_path_and_leaves_the_same_cache(make_model, prefix, seq_len):
    reference, model = make_model(), with_short_blocks(make_model())
    ids = torch.randint(0, 60, (1, prefix + seq_len), generator=torch.Generator().manual_seed(2))
    caches = [DynamicCache(config=m.config) for m in (reference, model)]
    outs = []
    for m, cache in zip((reference, model), caches, strict=True):
        if prefix:
            m(ids[:, :prefix], past_key_values=cache, use_cache=True)
        outs.append(m(ids[:, prefix:], past_key_values=cache, use_cache=True, output_hidden_states=True))
    for ref_h, h in zip(outs[0].hidden_states, outs[1].hidden_states, strict=True):
        torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[0].logits.argmax(-1), outs[1].logits.argmax(-1))
    for i, layer in enumerate(reference.model.layers):
        if hasattr(layer, "linear_attn"):
            ref_layer, cache_layer = caches[0].layers[i], caches[1].layers[i]
            torch.testing.assert_close(cache_layer.conv_states[0], ref_layer.conv_states[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache_layer.recurrent_states[0], ref_layer.recurrent_states[0])


def test_long_inputs_and_uncached_forwards_keep_the_transformers_path(monkeypatch):
    import flashdraft.target.linear_attention as linear_attention

    model = with_short_blocks(make_hf_model("hybrid"))
    calls = []
    monkeypatch.setattr(linear_attention, "short_block_forward", lambda *a: calls.append(a) or None)
    ids = torch.randint(0, 60, (1, linear_attention.SHORT_BLOCK_MAX + 1), generator=torch.Generator().manual_seed(3))
    model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)  # a long prefill
    model(ids[:, :8], use_cache=False)
    assert calls == []


@pytest.mark.parametrize("mode", ["recompute", "deferred"])
def test_gqa_hybrid_target_speculative_equals_transformers_greedy_with_partial_acceptance(mode):
    target = TargetModel(gqa_hybrid_model(), make_tokenizer(), path=None)
    assert target.linear_backend == "torch" and "forward" in vars(target.layers[0].linear_attn)
    target.rollback_mode = mode
    # the reference decodes with transformers' own Gated DeltaNet path, one token at a time
    reference = gqa_hybrid_model()
    ids, cache, expected = torch.tensor([PROMPT]), DynamicCache(config=reference.config), []
    for _ in range(40):
        token = int(reference(ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
        expected.append(token)
        ids = torch.tensor([[token]])
    assert autoregressive_generate(target, PROMPT, 40).output_ids == expected
    spec = speculative_generate(
        target, OracleProposer(PROMPT + expected), PROMPT, 40, speculative=SpeculativeConfig(block_size=8)
    )
    assert spec.output_ids == expected
    assert max(spec.acceptance_lengths) > 1 and min(spec.acceptance_lengths) == 1


def test_tiny_target_greedy_equals_transformers_path():
    target = TargetModel.load("tiny")
    assert target.linear_backend == "torch"
    reference = TargetModel.load("tiny")
    for i in reference.linear_layers:
        del reference.layers[i].linear_attn.forward  # back to the class's forward: transformers' path
    prompt = list(range(5, 45))
    assert (
        autoregressive_generate(target, prompt, 24).output_ids
        == autoregressive_generate(reference, prompt, 24).output_ids
    )
    ids = torch.tensor([prompt])
    caches = [target.new_cache(), reference.new_cache()]
    target.forward(ids[:, :-17], caches[0])
    reference.forward(ids[:, :-17], caches[1])
    target.set_context_layers([1, 3])
    reference.set_context_layers([1, 3])
    new, ref = target.forward(ids[:, -17:], caches[0]), reference.forward(ids[:, -17:], caches[1])
    torch.testing.assert_close(new.context_features, ref.context_features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new.logits, ref.logits, rtol=1e-4, atol=1e-4)


def test_fla_backend_keeps_transformers_forward(monkeypatch):
    monkeypatch.setattr(TargetModel, "linear_backend", property(lambda self: "fla"))
    target = TargetModel(make_hf_model("hybrid"), make_tokenizer(), path=None)
    assert all("forward" not in vars(target.layers[i].linear_attn) for i in target.linear_layers)
