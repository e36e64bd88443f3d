import pytest

from flashdraft.config import DrafterConfig, default_target_layer_ids
from flashdraft.errors import FlashdraftError
from tests.conftest import make_drafter_config

# Abridged from the public z-lab Qwen3.6-27B drafter's config.json.
PUBLIC_QWEN36_CONFIG = {
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "attention_bias": False, "attention_dropout": 0.0, "block_size": 16, "bos_token_id": None,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "dtype": "bfloat16", "eos_token_id": 248046, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "intermediate_size": 17408, "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "max_position_embeddings": 262144, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5,
    "num_key_value_heads": 8, "num_target_layers": 64, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000, "sliding_window": 2048, "tie_word_embeddings": False, "use_sliding_window": True,
    "vocab_size": 248320,
}  # fmt: skip


def test_default_layer_ids_match_the_published_examples():
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    assert default_target_layer_ids(36, 1) == [18]


def test_public_config_round_trips_with_unknown_fields_kept():
    cfg = DrafterConfig.from_dict(PUBLIC_QWEN36_CONFIG)
    assert cfg.num_context_layers == 5 and cfg.sliding_window == 2048
    out = cfg.to_dict()
    for key, value in PUBLIC_QWEN36_CONFIG.items():
        if key != "dtype":
            assert out[key] == value, key


def test_transformers5_rope_parameters_are_read():
    d = dict(PUBLIC_QWEN36_CONFIG)
    del d["rope_theta"], d["rope_scaling"]
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5e6, "factor": 4.0}
    cfg = DrafterConfig.from_dict(d)
    assert cfg.rope_theta == 5e6 and cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0}


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"block_size": 1}, "block_size"),
        ({"layer_types": ["full_attention", "banded"]}, "layer_types"),
        ({"mask_token_id": 64}, "mask_token_id"),
        ({"target_layer_ids": [0, 4]}, "target_layer_ids"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_invalid_config_field_is_named_in_the_error(overrides, field):
    with pytest.raises(FlashdraftError, match=field):
        make_drafter_config(**overrides)


def test_sliding_layers_disabled_by_use_sliding_window_are_flagged_loudly():
    d = dict(PUBLIC_QWEN36_CONFIG, use_sliding_window=False)
    with pytest.warns(UserWarning, match="FULL attention"):
        cfg = DrafterConfig.from_dict(d)
    assert cfg.layer_types[0] == "sliding_attention"


def test_config_that_is_not_a_dflash_drafter_is_refused():
    d = {k: v for k, v in PUBLIC_QWEN36_CONFIG.items() if k != "dflash_config"}
    with pytest.raises(FlashdraftError, match="dflash_config"):
        DrafterConfig.from_dict(d, source="x/config.json")
