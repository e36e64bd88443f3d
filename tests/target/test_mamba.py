import pytest
import torch
from torch import nn

from flashdraft.errors import FlashdraftError
from flashdraft.target.mamba import is_mamba, mamba_backend, recurrent_mixer
from tests.target.tiny_families import make_family_target


@pytest.fixture(scope="module")
def nemotron():
    return make_family_target("nemotron_h")


def test_nemotron_h_mamba_blocks_are_the_targets_linear_layers_and_their_mixers_are_found(nemotron):
    assert nemotron.layer_types == ["linear_attention", "moe", "full_attention", "mlp"]
    assert nemotron.linear_layers == [0] and is_mamba(nemotron.linear_mixers[0])
    assert nemotron.is_hybrid and nemotron.linear_backend == "torch" == mamba_backend("cpu")


def test_a_linear_layer_without_a_known_mixer_is_refused_in_one_line():
    with pytest.raises(FlashdraftError, match=r"target layer 3 \(Linear\): a linear_attention layer with neither"):
        recurrent_mixer(nn.Linear(2, 2), 3)


@pytest.mark.parametrize("keep", [0, 1, 3, 8])
def test_rollback_restores_the_mamba_conv_and_ssm_states_of_the_accepted_prefix(nemotron, keep):
    nemotron.rollback_mode = "recompute"  # exact right after rollback (deferred: after the next forward)
    ids = torch.randint(0, 60, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = nemotron.new_cache()
    nemotron.forward(ids[:, :20], cache)
    nemotron.forward(ids[:, 20:28], cache)
    after_block = cache.kv.layers[0].recurrent_states[0].clone()
    nemotron.rollback(cache, keep)
    reference = nemotron.new_cache()
    nemotron.forward(ids[:, : 20 + keep], reference)
    layer, ref_layer = cache.kv.layers[0], reference.kv.layers[0]
    torch.testing.assert_close(layer.conv_states[0], ref_layer.conv_states[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.recurrent_states[0], ref_layer.recurrent_states[0], rtol=1e-4, atol=1e-5)
    assert cache.length == reference.length == 20 + keep
    if keep < 8:
        assert not torch.allclose(after_block, ref_layer.recurrent_states[0])
