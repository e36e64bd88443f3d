import pytest
import torch

from flashdraft.decoding.generate import SpeculativeConfig
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from tests.conftest import make_hf_model, make_target, make_tokenizer


def test_context_features_are_hidden_states_at_l_plus_one(any_target):
    any_target.set_context_layers([0, 2])
    ids = torch.randint(0, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    out = any_target.forward(ids)
    hidden_states = any_target.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.context_features, torch.cat([hidden_states[1], hidden_states[3]], dim=-1))
    # and not the off-by-one neighbours
    assert not torch.allclose(out.context_features[..., :64], hidden_states[0])


@pytest.mark.parametrize("mode", ["recompute", "deferred"])
@pytest.mark.parametrize("keep", [1, 3, 8])
def test_rollback_after_partial_acceptance_equals_a_fresh_forward(any_target, keep, mode):
    any_target.rollback_mode = mode
    any_target.set_context_layers([1])
    ids = torch.randint(0, 60, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = any_target.new_cache()
    any_target.forward(ids[:, :20], cache)
    any_target.forward(ids[:, 20:28], cache)  # verify a block of 8, keep a prefix
    any_target.rollback(cache, keep)
    resumed = any_target.forward(ids[:, 20 + keep : 36], cache)
    assert cache.length == 36
    fresh = any_target.forward(ids[:, :36])
    torch.testing.assert_close(resumed.logits, fresh.logits[:, 20 + keep :], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(resumed.context_features, fresh.context_features[:, 20 + keep :], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["recompute", "deferred"])
def test_rollback_after_many_partial_acceptances_stays_exact_and_each_forward_stays_block_sized(any_target, mode):
    any_target.rollback_mode = mode
    any_target.set_context_layers([1])
    ids = torch.randint(0, 60, (1, 80), generator=torch.Generator().manual_seed(3))
    cache = any_target.new_cache()
    any_target.forward(ids[:, :20], cache)
    committed = 20
    for keep in [2, 1, 3, 1, 2, 1, 1, 2]:  # verify 8 tokens, accept a few, again and again
        out = any_target.forward(ids[:, committed : committed + 8], cache)
        assert cache.last_input_ids.shape[1] <= 8 + 3  # at most the last step's kept tokens are re-fed
        fresh = any_target.forward(ids[:, : committed + 8])
        torch.testing.assert_close(out.logits, fresh.logits[:, committed:], rtol=1e-4, atol=1e-4)
        any_target.rollback(cache, keep)
        committed += keep
    assert cache.length + (0 if cache.pending is None else cache.pending.shape[1]) == committed


def test_hybrid_rollback_restores_linear_states_not_just_kv(hybrid_target):
    hybrid_target.rollback_mode = (
        "recompute"  # the state is exact right after rollback (deferred: after the next forward)
    )
    ids = torch.randint(0, 60, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = hybrid_target.new_cache()
    hybrid_target.forward(ids[:, :20], cache)
    hybrid_target.forward(ids[:, 20:28], cache)
    layer = cache.kv.layers[hybrid_target.linear_layers[0]]
    after_block = layer.recurrent_states[0].clone()
    hybrid_target.rollback(cache, 2)
    reference = hybrid_target.new_cache()
    hybrid_target.forward(ids[:, :22], reference)
    ref_layer = reference.kv.layers[hybrid_target.linear_layers[0]]
    torch.testing.assert_close(layer.recurrent_states[0], ref_layer.recurrent_states[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.conv_states[0], ref_layer.conv_states[0])
    assert not torch.allclose(after_block, ref_layer.recurrent_states[0])


def test_hybrid_target_reports_its_linear_attention_backend(hybrid_target):
    assert hybrid_target.is_hybrid and hybrid_target.linear_backend == "torch"
    assert make_target("qwen3").linear_backend == "none"


def test_local_directory_loads_and_fingerprint_is_stable(tmp_path):
    make_hf_model("hybrid").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    a, b = TargetModel.load(tmp_path), TargetModel.load(tmp_path)
    assert a.num_layers == 4 and a.hidden_size == 64 and a.vocab_size == 64 and a.stop_token_ids == [61]
    assert a.fingerprint() == b.fingerprint()
    assert make_target("hybrid", seed=1).fingerprint() != make_target("hybrid", seed=2).fingerprint()


def test_missing_target_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FlashdraftError, match="not a local model directory"):
        TargetModel.load(tmp_path / "nope")


def test_context_layer_outside_target_is_refused(hybrid_target):
    with pytest.raises(FlashdraftError, match="outside the target's 4 layers"):
        hybrid_target.set_context_layers([1, 4])


def test_fingerprint_does_not_depend_on_directory_or_load_dtype(tmp_path):
    for d in ("a", "b"):
        make_hf_model("hybrid").to(torch.bfloat16).save_pretrained(tmp_path / d)
        make_tokenizer().save_pretrained(tmp_path / d)
    a = TargetModel.load(tmp_path / "a")
    assert a.fingerprint() == TargetModel.load(tmp_path / "b").fingerprint()
    assert a.fingerprint() == TargetModel.load(tmp_path / "a", dtype=torch.bfloat16).fingerprint()


def test_with_fla_installed_cpu_calls_reach_the_torch_fallback_and_cuda_calls_the_kernel(monkeypatch):
    import functools
    import types

    import flashdraft.target.model as target_module

    calls = []

    def torch_fallback(query, key, **kwargs):
        calls.append("torch")
        return query

    @functools.wraps(torch_fallback)  # how transformers wraps the torch function when fla imports
    def fla_kernel(query, key, **kwargs):
        calls.append("fla")
        return query

    class FakeCudaTensor:
        is_cuda = True

    modeling = types.SimpleNamespace(torch_chunk_gated_delta_rule=fla_kernel)
    monkeypatch.setattr(target_module, "find_spec", lambda name: object())  # as if fla were installed
    target_module._route_linear_attention_by_device(modeling)
    target_module._route_linear_attention_by_device(modeling)  # idempotent: wrapped once
    modeling.torch_chunk_gated_delta_rule(torch.zeros(1), None, g=None)
    modeling.torch_chunk_gated_delta_rule(FakeCudaTensor(), None, g=None)
    assert calls == ["torch", "fla"]
    assert modeling.torch_chunk_gated_delta_rule.__wrapped__ is fla_kernel  # parity still unwraps to torch


# -- the families with recurrent or latent caches: Qwen3-Next, Nemotron-H (Mamba-2), MLA ----------------------


@pytest.fixture(
    scope="module",
    params=[
        "qwen3_moe",
        "qwen3_5_moe_text",
        "glm4_moe",
        "gpt_oss",
        "qwen3_next",
        "nemotron_h",
        "deepseek_v3",
        "glm4_moe_lite",
        "deepseek_v2",
    ],
)
def family_target(request) -> TargetModel:
    from tests.target.tiny_families import make_family_target

    return make_family_target(request.param)


def transformers_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding through the model's own cache path, one token per forward (the reference)."""
    from transformers import DynamicCache

    ids, cache, out = torch.tensor([prompt]), DynamicCache(config=model.config), []
    for _ in range(num_tokens):
        out.append(int(model(ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("mode", ["recompute", "deferred"])
def test_family_speculative_decoding_equals_the_models_own_greedy_decoding(family_target, mode):
    from flashdraft.decoding.generate import autoregressive_generate, speculative_generate
    from tests.decoding.test_generate import PROMPT, OracleProposer

    family_target.rollback_mode = mode
    expected = transformers_greedy(family_target.model, PROMPT, 40)
    assert autoregressive_generate(family_target, PROMPT, 40).output_ids == expected
    spec = speculative_generate(
        family_target, OracleProposer(PROMPT + expected), PROMPT, 40, speculative=SpeculativeConfig(block_size=8)
    )
    assert spec.output_ids == expected
    assert max(spec.acceptance_lengths) > 1 and min(spec.acceptance_lengths) == 1  # rollback exercised


@pytest.mark.parametrize("keep", [1, 5])
def test_family_rollback_after_partial_acceptance_equals_a_fresh_forward(family_target, keep):
    family_target.rollback_mode = "recompute"
    family_target.set_context_layers([0, 2])
    ids = torch.randint(0, 60, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = family_target.new_cache()
    family_target.forward(ids[:, :20], cache)
    family_target.forward(ids[:, 20:28], cache)
    family_target.rollback(cache, keep)
    resumed = family_target.forward(ids[:, 20 + keep : 36], cache)
    fresh = family_target.forward(ids[:, :36])
    torch.testing.assert_close(resumed.logits, fresh.logits[:, 20 + keep :], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(resumed.context_features, fresh.context_features[:, 20 + keep :], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe_text", "glm4_moe", "gpt_oss"])
def test_a_verified_block_routes_each_token_as_one_token_decoding_does(model_type):
    """MoE routing is per token: a block verified in one forward gives the logits of decoding its tokens one by one
    (argmaxes equal away from near-ties)."""
    from tests.target.tiny_families import make_family_target

    target = make_family_target(model_type)
    prompt, block = [3, 9, 14, 27, 5], [8, 1, 40, 22, 17, 30, 2, 11]
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), cache)
    verified = target.forward(torch.tensor([block]), cache).logits[0]  # [8, vocab]
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), cache)
    one_by_one = torch.cat([target.forward(torch.tensor([[t]]), cache).logits[0] for t in block])  # [8, vocab]
    top2 = one_by_one.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # near-ties aside
    assert clear.sum() >= len(block) - 1
    assert torch.equal(verified.argmax(-1)[clear], one_by_one.argmax(-1)[clear])
    torch.testing.assert_close(verified, one_by_one, atol=1e-4, rtol=1e-4)


def test_decoding_attention_leaves_out_cudnn_on_cuda_and_changes_nothing_on_cpu():
    from flashdraft.target.model import decoding_attention

    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    with decoding_attention(torch.device("cpu")):
        assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before
    with decoding_attention(torch.device("cuda")):  # the flags it sets, readable without a GPU
        assert not cuda.cudnn_sdp_enabled() and cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled()
        assert cuda.math_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before
