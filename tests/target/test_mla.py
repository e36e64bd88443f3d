import pytest
import torch

from flashdraft.target.mla import MLA_MODEL_TYPES, align_mla_heads, is_mla
from flashdraft.target.model import TargetModel
from tests.conftest import make_tokenizer
from tests.target.tiny_families import make_family_model, make_family_target


@pytest.mark.parametrize("model_type", MLA_MODEL_TYPES)
def test_the_cache_holds_compressed_latents_and_rollback_crops_them_to_the_accepted_prefix(model_type):
    target = make_family_target(model_type)
    ids = torch.randint(0, 60, (1, 28), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache()
    target.forward(ids[:, :20], cache)
    target.forward(ids[:, 20:28], cache)
    layer = cache.kv.layers[0]
    # one "head" of kv_lora_rank (kv_nope) and one of qk_rope_head_dim (k_rot), not [heads, head_dim]
    assert tuple(layer.keys.shape) == (1, 1, 28, 32) and tuple(layer.values.shape) == (1, 1, 28, 32)
    target.rollback(cache, 3)
    reference = target.new_cache()
    target.forward(ids[:, :23], reference)
    for kept, fresh in zip(cache.kv.layers, reference.kv.layers, strict=True):
        assert kept.keys.shape[2] == 23
        torch.testing.assert_close(kept.keys, fresh.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kept.values, fresh.values, rtol=1e-5, atol=1e-5)


def test_fewer_key_value_heads_than_query_heads_verify_a_block_as_the_model_with_equal_counts():
    """MLA expands its latents for every query head, so num_key_value_heads means nothing to the math; transformers
    still repeats the expanded keys by heads / num_key_value_heads on a masked multi-token query (a verified block)
    and fails. With the groups aligned the model equals the same weights under equal counts."""
    equal = make_family_model("deepseek_v3")
    fewer = make_family_model("deepseek_v3", num_key_value_heads=1)
    fewer.load_state_dict(equal.state_dict())  # no weight depends on num_key_value_heads in MLA
    ids = torch.randint(0, 60, (1, 28), generator=torch.Generator().manual_seed(1))
    unaligned = TargetModel(make_family_model("deepseek_v3", num_key_value_heads=1), make_tokenizer(), path=None)
    for module in unaligned.model.modules():  # undo the alignment: transformers' own behaviour
        if is_mla(module):
            module.num_key_value_groups = 2
    kv = unaligned.new_cache()
    unaligned.forward(ids[:, :20], kv)  # a prefill passes (sdpa's enable_gqa)
    with pytest.raises(RuntimeError, match="size of tensor"):
        unaligned.forward(ids[:, 20:], kv)
    outputs = []
    for model in (equal, fewer):
        target = TargetModel(model, make_tokenizer(), path=None)  # aligns the groups
        kv = target.new_cache()
        target.forward(ids[:, :20], kv)
        outputs.append(target.forward(ids[:, 20:], kv).logits)
    torch.testing.assert_close(outputs[1], outputs[0])


def test_aligning_changes_only_mla_modules_whose_counts_differ():
    assert align_mla_heads(make_family_model("deepseek_v3")) == 0  # equal counts: groups already 1
    assert align_mla_heads(make_family_model("glm4_moe_lite", num_key_value_heads=1)) == 4
