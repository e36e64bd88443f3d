import json

import pytest

from flashdraft.drafter.config import DrafterConfig, default_target_layer_ids
from flashdraft.errors import FlashdraftError
from tests.conftest import make_drafter_config

# Abridged from the public z-lab Qwen3.6-27B drafter's config.json.
PUBLIC_QWEN36_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 16,
    "bos_token_id": None,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "dtype": "bfloat16",
    "eos_token_id": 248046,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "max_position_embeddings": 262144,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "sliding_window": 2048,
    "tie_word_embeddings": False,
    "use_sliding_window": True,
    "vocab_size": 248320,
}


# The published DFlash2 drafter's layout (z-lab/Qwen3.8-27B-DFlash2, reference doc section 8).
PUBLIC_QWEN38_DFLASH2_CONFIG = PUBLIC_QWEN36_CONFIG | {
    "architectures": ["DFlash2DraftModel"],
    "layer_types": ["sliding_attention"] * 5,
    "is_causal": False,
    "dflash_config": {
        "mask_token_id": 248070,
        "target_layer_ids": [5, 19, 33, 47, 61],
        "block_size": 8,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 16,
    },
}
del PUBLIC_QWEN38_DFLASH2_CONFIG["block_size"], PUBLIC_QWEN38_DFLASH2_CONFIG["auto_map"]


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
    # original_max_position_embeddings filled from max_position_embeddings, as transformers 5.23 fills it
    assert cfg.rope_theta == 5e6
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}


YARN = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096}


def test_rope_parameters_beside_a_top_level_rope_theta_load_their_scaling_as_transformers_reads_it():
    from transformers import Qwen3Config

    d = PUBLIC_QWEN36_CONFIG | {"rope_parameters": YARN}  # rope_theta at the top level, rope_scaling null
    cfg = DrafterConfig.from_dict(d)
    expected = Qwen3Config.from_dict(json.loads(json.dumps(d))).rope_parameters  # a copy: transformers edits it
    assert cfg.rope_scaling == YARN and cfg.rope_theta == expected["rope_theta"] == 1e7
    assert {k: v for k, v in expected.items() if k != "rope_theta"} == YARN


@pytest.mark.parametrize(
    "legacy, params, named",
    [
        ({"rope_type": "linear", "factor": 4}, YARN, "original_max_position_embeddings, rope_type"),
        (YARN | {"factor": 8}, YARN, "factor"),
        (YARN | {"original_max_position_embeddings": 1024}, YARN, "original_max_position_embeddings"),
        (YARN, YARN | {"beta_fast": 16}, "beta_fast"),
        ({"rope_type": "default"}, YARN, "factor, original_max_position_embeddings, rope_type"),
    ],
)
def test_rope_scaling_and_rope_parameters_that_disagree_are_refused_naming_both(legacy, params, named):
    d = PUBLIC_QWEN36_CONFIG | {"rope_scaling": legacy, "rope_parameters": params}
    with pytest.raises(
        FlashdraftError,
        match=rf"x/config.json: fields 'rope_scaling' .* and 'rope_parameters' .* "
        rf"disagree on {named};",
    ):
        DrafterConfig.from_dict(d, source="x/config.json")


def test_rope_theta_beside_a_different_nested_rope_theta_is_refused_naming_both():
    d = PUBLIC_QWEN36_CONFIG | {"rope_parameters": YARN | {"rope_theta": 5e5}}
    with pytest.raises(
        FlashdraftError,
        match=r"'rope_parameters.rope_theta' \(500000.0\) and 'rope_theta' "
        r"\(10000000\) disagree",
    ):
        DrafterConfig.from_dict(d, source="x/config.json")


def test_both_schemas_saying_the_same_load_and_the_legacy_type_spelling_is_read():
    legacy = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    d = PUBLIC_QWEN36_CONFIG | {"rope_scaling": legacy, "rope_parameters": YARN | {"rope_theta": 10000000}}
    assert DrafterConfig.from_dict(d).rope_scaling == YARN


@pytest.mark.parametrize(
    "scaling, expected",
    [
        ({"rope_type": "ntk-by-parts", "factor": 2}, "rope_type 'ntk-by-parts'; expected one of default, linear"),
        ({"rope_type": "linear"}, "expected factor too"),
        ({"rope_type": "linear", "factor": "4"}, "factor '4'; expected a positive number"),
    ],
)
def test_a_rope_scaling_flashdraft_cannot_compute_is_refused_naming_the_field(scaling, expected):
    with pytest.raises(FlashdraftError, match=rf"x/config.json: field 'rope_scaling' is .*{expected}"):
        DrafterConfig.from_dict(PUBLIC_QWEN36_CONFIG | {"rope_scaling": scaling}, source="x/config.json")


def test_the_config_is_written_in_both_rope_schemas_with_partial_rotary_inside_rope_parameters():
    cfg = make_drafter_config(rope_scaling=YARN, rope_theta=1e4, partial_rotary_factor=0.5)
    d = cfg.to_dict()
    assert d["rope_theta"] == 1e4 and d["rope_scaling"] == YARN and d["partial_rotary_factor"] == 0.5
    assert d["rope_parameters"] == YARN | {"rope_theta": 1e4, "partial_rotary_factor": 0.5}
    reread = DrafterConfig.from_dict(d)
    assert (reread.rope_theta, reread.rope_scaling, reread.partial_rotary_factor) == (1e4, YARN, 0.5)
    native = make_drafter_config().to_dict()
    assert native["rope_scaling"] is None and native["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}


def test_trained_context_length_is_kept_absent_when_unknown_and_refused_when_not_a_count():
    assert "trained_context_length" not in make_drafter_config().to_dict()
    cfg = DrafterConfig.from_dict(make_drafter_config(trained_context_length=3000).to_dict())
    assert cfg.trained_context_length == 3000 and cfg.to_dict()["trained_context_length"] == 3000
    with pytest.raises(FlashdraftError, match="'trained_context_length' is -1; expected a positive integer"):
        DrafterConfig.from_dict(PUBLIC_QWEN36_CONFIG | {"trained_context_length": -1}, source="x/config.json")


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


def _public(**top) -> dict:
    return {**PUBLIC_QWEN36_CONFIG, **top}


def _with_dflash(d: dict, **fields) -> dict:
    return {**d, "dflash_config": {**d["dflash_config"], **fields}}


def test_published_qwen36_layout_serves_sliding_layers_causally_and_the_full_layer_non_causally():
    cfg = DrafterConfig.from_dict(PUBLIC_QWEN36_CONFIG)
    assert [(a.causal, a.window) for a in cfg.layer_attention] == [(True, 2048)] * 4 + [(False, None)]
    assert "is_causal" not in cfg.to_dict()  # mixed: the servers' default says it, nothing to add


@pytest.mark.parametrize("is_causal", [False, True])
def test_top_level_is_causal_sets_every_layer_and_wins_over_dflash_config_causal(is_causal):
    d = _with_dflash(_public(is_causal=is_causal), causal=not is_causal)
    cfg = DrafterConfig.from_dict(d)
    assert [a.causal for a in cfg.layer_attention] == [is_causal] * 5
    out = cfg.to_dict()
    assert out["is_causal"] is is_causal and "causal" not in out["dflash_config"]


def test_dflash_config_causal_is_read_as_vllm_reads_it_and_written_as_is_causal_for_sglang():
    cfg = DrafterConfig.from_dict(_with_dflash(PUBLIC_QWEN36_CONFIG, causal=False))
    assert [a.causal for a in cfg.layer_attention] == [False] * 5
    assert cfg.to_dict()["is_causal"] is False  # SGLang reads only the top-level field


def test_use_swa_makes_all_full_layers_sliding_and_non_causal_with_swa_window_size():
    d = _with_dflash(
        _public(layer_types=["full_attention"] * 5, sliding_window=None), use_swa=True, swa_window_size=512
    )
    cfg = DrafterConfig.from_dict(d)
    assert [(a.causal, a.window) for a in cfg.layer_attention] == [(False, 512)] * 5
    out = cfg.to_dict()
    assert out["layer_types"] == ["sliding_attention"] * 5 and out["sliding_window"] == 512
    assert out["is_causal"] is False and not {"use_swa", "swa_window_size"} & set(out["dflash_config"])
    assert [(a.causal, a.window) for a in DrafterConfig.from_dict(out).layer_attention] == [(False, 512)] * 5


def test_use_swa_leaves_layer_types_that_already_have_sliding_layers_alone():
    cfg = DrafterConfig.from_dict(_with_dflash(PUBLIC_QWEN36_CONFIG, use_swa=True))
    assert cfg.layer_types == PUBLIC_QWEN36_CONFIG["layer_types"] and cfg.is_causal is None


def test_swa_window_size_overrides_sliding_window():
    cfg = DrafterConfig.from_dict(_with_dflash(PUBLIC_QWEN36_CONFIG, swa_window_size=1024))
    assert cfg.sliding_window == 1024 and cfg.to_dict()["sliding_window"] == 1024


def test_mask_token_string_is_kept_and_written_back():
    cfg = DrafterConfig.from_dict(_with_dflash(PUBLIC_QWEN36_CONFIG, mask_token="<|MASK|>"))
    assert cfg.mask_token == "<|MASK|>" and cfg.to_dict()["dflash_config"]["mask_token"] == "<|MASK|>"


def test_target_hidden_size_equal_to_hidden_size_is_read_and_another_is_refused():
    assert DrafterConfig.from_dict(_public(target_hidden_size=5120)).hidden_size == 5120
    with pytest.raises(FlashdraftError, match="'target_hidden_size' is 4096; expected 5120"):
        DrafterConfig.from_dict(_public(target_hidden_size=4096), source="x/config.json")


def test_draft_vocab_size_round_trips_and_must_fit_the_vocabulary():
    cfg = DrafterConfig.from_dict(_public(draft_vocab_size=32000))
    assert cfg.draft_vocab_size == 32000 and cfg.to_dict()["draft_vocab_size"] == 32000
    assert "draft_vocab_size" not in DrafterConfig.from_dict(PUBLIC_QWEN36_CONFIG).to_dict()
    with pytest.raises(FlashdraftError, match="draft_vocab_size"):
        DrafterConfig.from_dict(_public(draft_vocab_size=300000))


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"input_embedding_scale": 0.0}, "input_embedding_scale"),
        ({"output_multiplier": -1.0}, "output_multiplier"),
        ({"final_logit_softcapping": "30"}, "final_logit_softcapping"),
        ({"mask_token": 7}, "mask_token"),
        ({"causal": "yes"}, "dflash_config.causal"),
        ({"use_swa": 1}, "dflash_config.use_swa"),
        ({"conv_kernel_size": 2, "conv_group_size": 16}, "conv_kernel_size"),
        ({"selector_rank": 256}, "selector_rank"),
    ],
)
def test_dflash_config_spellings_with_bad_values_or_unsupported_modules_are_refused_by_name(fields, name):
    with pytest.raises(FlashdraftError, match=name):
        DrafterConfig.from_dict(_with_dflash(PUBLIC_QWEN36_CONFIG, **fields), source="x/config.json")


def test_reference_output_options_default_to_no_change():
    cfg = DrafterConfig.from_dict(_with_dflash(PUBLIC_QWEN36_CONFIG, output_multiplier=2.0))
    assert cfg.reference_option("output_multiplier") == 2.0
    assert cfg.reference_option("input_embedding_scale") == 1.0
    assert cfg.reference_option("final_logit_softcapping") is None


def test_unsorted_or_repeated_target_layer_ids_are_refused_with_the_servers_rule():
    for ids in ([3, 1, 2], [1, 1, 2]):
        with pytest.raises(FlashdraftError, match="strictly increasing"):
            DrafterConfig.from_dict(_with_dflash(PUBLIC_QWEN36_CONFIG, target_layer_ids=ids))


def test_published_dflash2_config_is_read_as_dflash2_and_round_trips_field_by_field():
    cfg = DrafterConfig.from_dict(PUBLIC_QWEN38_DFLASH2_CONFIG)
    assert (
        cfg.family,
        cfg.block_size,
        cfg.conv_kernel_size,
        cfg.conv_group_size,
        cfg.selector_rank,
        cfg.selector_top_k,
    ) == ("dflash2", 8, 2, 16, 256, 16)
    assert all(a.window == 2048 and not a.causal for a in cfg.layer_attention)
    out = cfg.to_dict()
    for key, value in PUBLIC_QWEN38_DFLASH2_CONFIG.items():
        if key != "dtype":
            assert out[key] == value, key
    assert DrafterConfig.from_dict(out) == DrafterConfig.from_dict(PUBLIC_QWEN38_DFLASH2_CONFIG)


def test_dflash2_fields_and_block_size_are_read_from_the_top_level_too_and_a_conflict_is_refused():
    nested = PUBLIC_QWEN38_DFLASH2_CONFIG["dflash_config"]
    flat = PUBLIC_QWEN38_DFLASH2_CONFIG | {
        k: v for k, v in nested.items() if k not in ("mask_token_id", "target_layer_ids")
    }
    flat["dflash_config"] = {"mask_token_id": 248070, "target_layer_ids": [5, 19, 33, 47, 61]}
    assert DrafterConfig.from_dict(flat) == DrafterConfig.from_dict(PUBLIC_QWEN38_DFLASH2_CONFIG)
    for name, other in (("block_size", 16), ("selector_top_k", 8)):
        conflict = f"'dflash_config.{name}' is .* but the top-level '{name}' is {other}"
        with pytest.raises(FlashdraftError, match=conflict):
            DrafterConfig.from_dict(PUBLIC_QWEN38_DFLASH2_CONFIG | {name: other}, source="x/config.json")


@pytest.mark.parametrize(
    "change, name",
    [
        (
            {"architectures": ["DFlash2DraftModel"], "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1]}},
            "dflash_config.conv_kernel_size",
        ),
        (
            {"dflash_config": PUBLIC_QWEN38_DFLASH2_CONFIG["dflash_config"] | {"conv_group_size": 48}},
            "dflash_config.conv_group_size",
        ),
        (
            {"dflash_config": PUBLIC_QWEN38_DFLASH2_CONFIG["dflash_config"] | {"selector_top_k": 0}},
            "dflash_config.selector_top_k",
        ),
        ({"draft_vocab_size": 32000}, "draft_vocab_size"),
        ({"architectures": ["LlamaForCausalLMEagle3"]}, "architectures"),
    ],
)
def test_a_dflash2_config_without_its_fields_or_with_bad_ones_is_refused_by_name(change, name):
    with pytest.raises(FlashdraftError, match=name):
        DrafterConfig.from_dict(PUBLIC_QWEN38_DFLASH2_CONFIG | change, source="x/config.json")


# -- DSpark ---------------------------------------------------------------------------------------


def _dspark_dict(**changes):
    d = make_drafter_config(
        family="dspark", markov_rank=8, confidence_head=True, confidence_head_with_markov=True, block_size=7
    ).to_dict()
    d.update(changes)
    return d


def test_a_dspark_config_is_written_in_vllms_flat_fields_and_round_trips():
    d = _dspark_dict()
    assert d["architectures"] == ["Qwen3DSparkModel"]
    assert {
        k: d[k]
        for k in (
            "markov_rank",
            "markov_head_type",
            "enable_confidence_head",
            "confidence_head_with_markov",
            "sample_from_anchor",
            "block_size",
        )
    } == {
        "markov_rank": 8,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sample_from_anchor": True,
        "block_size": 7,
    }
    # DeepSpec reads target_layer_ids and mask_token_id at the top level, the DFlash loaders in dflash_config
    assert d["target_layer_ids"] == d["dflash_config"]["target_layer_ids"] == [0, 2]
    cfg = DrafterConfig.from_dict(d)
    assert cfg.to_dict() == d and cfg.first_draft_position == 0 and cfg.drafts_per_block == 7


def test_deepspec_and_specforge_dialects_of_a_dspark_config_read_as_the_same_drafter():
    cfg = DrafterConfig.from_dict(_dspark_dict())
    deepspec = {k: v for k, v in _dspark_dict().items() if k != "dflash_config"}  # Qwen3DSparkModel, top level
    assert DrafterConfig.from_dict(deepspec).to_dict() == cfg.to_dict()
    specforge = {
        k: v
        for k, v in _dspark_dict(architectures=["DSparkDraftModel"]).items()
        if k not in ("markov_rank", "enable_confidence_head", "confidence_head_with_markov")
    }
    specforge["dflash_config"] = {
        **specforge["dflash_config"],
        "markov_rank": 8,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "projector_type": "dspark",
    }
    assert DrafterConfig.from_dict(specforge).to_dict() == cfg.to_dict()
    specforge["architectures"] = ["DFlashDraftModel"]  # projector_type alone names the family
    assert DrafterConfig.from_dict(specforge).family == "dspark"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"markov_rank": 0}, "'markov_rank' is 0; expected a positive integer"),
        ({"confidence_head_with_markov": None}, "'confidence_head_with_markov' is missing"),
        (
            {"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 63, "markov_rank": 16}},
            "fields markov_rank, dflash_config.markov_rank disagree",
        ),
        (
            {"markov_head_type": None, "dspark_markov_head_type": "rnn"},
            "'markov_head_type' \\(nested or prefixed\\) is 'rnn'",
        ),
        ({"markov_head_type": "gated"}, "'markov_head_type' is 'gated'; read by"),
        ({"sample_from_anchor": False}, "'sample_from_anchor' is False; read by"),
        ({"speculators_model_type": "dspark"}, "'speculators_model_type' is 'dspark'; read by"),
        ({"draft_vocab_size": 32}, "'draft_vocab_size' is 32; expected absent in a DSpark drafter"),
        ({"dspark_draft_topk": 0}, "'dspark_draft_topk' is 0"),
        ({"architectures": ["DFlashDraftModel"]}, "'markov_rank' is 8 but architectures is \\['DFlashDraftModel'\\]"),
    ],
)
def test_a_dspark_config_with_a_bad_ambiguous_or_unbuilt_field_is_refused_by_name(changes, message):
    d = _dspark_dict(**changes)
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(FlashdraftError, match=message):
        DrafterConfig.from_dict(d, source="x/config.json")


def test_a_dspark_config_without_block_size_gets_the_papers_7():
    d = _dspark_dict()
    del d["block_size"], d["dflash_config"]["block_size"]
    assert DrafterConfig.from_dict(d).block_size == 7
