"""`flashdraft init` makes the published drafter shapes: layer types, sliding window, causality
and the other shape fields, from flags or from a published config.json (`--config`)."""

from __future__ import annotations

import json

import pytest
import torch

from flashdraft.drafter.checkpoint import load_drafter
from tests.conftest import MASK, run_cli, save_target
from tests.drafter.test_config import PUBLIC_QWEN36_CONFIG


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    # 8 layers (linear and full attention alternating): the default ids of a 3-layer drafter
    # are distinct ([1, 3, 5]), and layers 1, 3, 5, 7 are full attention (--layers-from-target)
    return save_target(tmp_path_factory.mktemp("target"), "hybrid", num_layers=8)


def init(capsys, target_dir, out, *flags) -> tuple[int, str, str]:
    return run_cli(capsys, "init", "--target-model", target_dir, "--out", out, "--block-size", 4, *flags)


def one_line_error(rc: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]  # not tqdm's bars
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_layer_types_and_window_are_written_and_sliding_layers_load_causal(target_dir, tmp_path, capsys):
    rc, out, err = init(
        capsys, target_dir, tmp_path / "d", "--layer-types", "sliding,sliding,full", "--sliding-window", 6
    )
    assert rc == 0, err
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert written["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert written["num_hidden_layers"] == 3 and written["sliding_window"] == 6 and written["use_sliding_window"]
    assert "is_causal" not in written  # mixed causality: the servers' default says it per layer
    cfg = load_drafter(tmp_path / "d").config
    assert [(a.causal, a.window) for a in cfg.layer_attention] == [(True, 6), (True, 6), (False, None)]
    assert "layer 0: sliding window 6, causal within the block" in out


def test_full_layer_type_names_and_one_type_for_all_layers(target_dir, tmp_path, capsys):
    rc, _, err = init(
        capsys,
        target_dir,
        tmp_path / "d",
        "--draft-layers",
        2,
        "--layer-types",
        "sliding_attention",
        "--sliding-window",
        3,
        "--is-causal",
        "false",
    )
    assert rc == 0, err
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert written["layer_types"] == ["sliding_attention"] * 2 and written["is_causal"] is False
    assert [a.causal for a in load_drafter(tmp_path / "d").config.layer_attention] == [False, False]


def test_shape_flags_override_what_init_copies_from_the_target(target_dir, tmp_path, capsys):
    rc, _, err = init(
        capsys,
        target_dir,
        tmp_path / "d",
        "--intermediate-size",
        96,
        "--num-attention-heads",
        8,
        "--num-key-value-heads",
        4,
        "--head-dim",
        8,
        "--rope-theta",
        5e5,
        "--max-position-embeddings",
        1024,
    )
    assert rc == 0, err
    cfg = load_drafter(tmp_path / "d").config
    assert (cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (96, 8, 4, 8)
    assert cfg.rope_theta == 5e5 and cfg.max_position_embeddings == 1024
    rc, _, err = init(capsys, target_dir, tmp_path / "e")  # no flags: the target's shapes, as before
    cfg = load_drafter(tmp_path / "e").config
    assert rc == 0 and (cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 4, 2)
    assert cfg.layer_types == ["full_attention"] and cfg.sliding_window is None


def test_layers_from_target_work_with_sliding_layer_types(target_dir, tmp_path, capsys):
    from flashdraft.target.weights import TargetHead

    rc, _, err = init(
        capsys,
        target_dir,
        tmp_path / "d",
        "--layer-types",
        "sliding,full",
        "--sliding-window",
        4,
        "--layers-from-target",
        "3,5",
    )
    assert rc == 0, err
    drafter = load_drafter(tmp_path / "d")
    assert drafter.config.layer_types == ["sliding_attention", "full_attention"]
    head = TargetHead.load(target_dir)
    for j, layer_id in enumerate([3, 5]):
        own = drafter.layers[j].state_dict()
        for name, tensor in head.attention_layer_weights(layer_id).items():
            assert torch.equal(own[name], tensor), (j, name)


BAD_SHAPES = {
    "sliding layers without a window": (["--layer-types", "sliding,full"], "sliding layers need --sliding-window N"),
    "a window without sliding layers": (
        ["--sliding-window", 6],
        "--sliding-window 6: no drafter layer is sliding_attention",
    ),
    "one type per layer, but not as many": (
        ["--draft-layers", 3, "--layer-types", "sliding,full", "--sliding-window", 2],
        "--layer-types has 2 entries for --draft-layers 3; expected one per drafter layer",
    ),
    "an unknown layer type": (
        ["--layer-types", "sliding,banded"],
        "argument --layer-types: 'banded' is not a layer type; expected sliding, full",
    ),
    "is-causal not a boolean": (["--is-causal", "yes"], "argument --is-causal: expected true or false"),
    "kv heads not dividing heads": (
        ["--num-attention-heads", 5],
        "flashdraft init: field 'num_key_value_heads' is 2; expected a divisor of num_attention_heads (5)",
    ),
}


@pytest.mark.parametrize("case", BAD_SHAPES)
def test_a_shape_init_cannot_make_is_one_line_exit_2(target_dir, tmp_path, capsys, case):
    flags, expected = BAD_SHAPES[case]
    try:
        rc, _, err = init(capsys, target_dir, tmp_path / "d", *flags)
    except SystemExit as e:  # argparse
        rc, err = e.code, capsys.readouterr().err
    assert expected in one_line_error(rc, err)
    assert not (tmp_path / "d").exists()


def published_for_tiny(**changes) -> dict:
    """The Qwen3.6-27B drafter's config.json (4 sliding layers, window 2048, 1 full, every field
    it has) with the sizes a drafter of the tiny 8-layer target must have."""
    d = json.loads(json.dumps(PUBLIC_QWEN36_CONFIG))
    d.update(
        hidden_size=64,
        vocab_size=64,
        num_target_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        max_position_embeddings=512,
        block_size=8,
        dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 2, 3, 4, 5]},
    )
    d.update(changes)
    return d


def test_init_config_round_trips_a_published_config_field_by_field(target_dir, tmp_path, capsys):
    published = published_for_tiny()
    (tmp_path / "config.json").write_text(json.dumps(published))
    rc, _, err = run_cli(
        capsys, "init", "--target-model", target_dir, "--out", tmp_path / "d", "--config", tmp_path / "config.json"
    )
    assert rc == 0, err
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert written["dtype"] == "float32"  # the weights as written; the only field flashdraft changes here
    # and the RoPE in transformers 5's schema beside the legacy one, saying the same
    assert written.pop("rope_parameters") == {"rope_type": "default", "rope_theta": published["rope_theta"]}
    assert {k: v for k, v in written.items() if k != "dtype"} == {k: v for k, v in published.items() if k != "dtype"}
    load_drafter(tmp_path / "d")


def test_init_rope_scaling_writes_both_schemas_and_a_published_trained_context_is_not_carried(
    target_dir, tmp_path, capsys
):
    yarn = {"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(published_for_tiny(trained_context_length=32768)))
    rc, _, err = run_cli(
        capsys,
        "init",
        "--target-model",
        target_dir,
        "--out",
        tmp_path / "d",
        "--config",
        tmp_path / "config.json",
        "--rope-scaling",
        json.dumps(yarn),
    )
    assert rc == 0, err
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert written["rope_scaling"] == yarn and written["rope_parameters"] == yarn | {"rope_theta": 10000000}
    assert "trained_context_length" not in written  # untrained: its weights are fresh
    # native RoPE given explicitly removes the --config's scaling
    (tmp_path / "yarn.json").write_text(json.dumps(published_for_tiny(rope_scaling=yarn)))
    rc, _, err = run_cli(
        capsys,
        "init",
        "--target-model",
        target_dir,
        "--out",
        tmp_path / "n",
        "--config",
        tmp_path / "yarn.json",
        "--rope-scaling",
        '{"rope_type": "default"}',
    )
    assert rc == 0, err
    assert load_drafter(tmp_path / "n").config.rope_scaling is None


def test_init_config_flags_override_its_fields_and_keep_the_rest(target_dir, tmp_path, capsys):
    published = published_for_tiny()
    (tmp_path / "config.json").write_text(json.dumps(published))
    rc, _, err = run_cli(
        capsys,
        "init",
        "--target-model",
        target_dir,
        "--out",
        tmp_path / "d",
        "--config",
        tmp_path / "config.json",
        "--block-size",
        4,
        "--sliding-window",
        6,
        "--layer-types",
        "sliding",
        "--target-layer-ids",
        "1,3,5",
        "--intermediate-size",
        64,
    )
    assert rc == 0, err
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    overridden = {
        "block_size": 4,
        "sliding_window": 6,
        "layer_types": ["sliding_attention"] * 5,
        "intermediate_size": 64,
        "is_causal": True,  # uniform now: said explicitly
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5]},
    }
    for key, value in overridden.items():
        assert written[key] == value, key
    for key, value in published.items():
        if key not in overridden and key != "dtype":
            assert written[key] == value, key


CONFIG_PROBLEMS = {
    "another target's hidden size": (
        dict(PUBLIC_QWEN36_CONFIG),
        "field 'hidden_size' is 5120; expected 64 (the target's hidden size",
    ),
    "another target's vocabulary": (
        published_for_tiny(vocab_size=128),
        "field 'vocab_size' is 128; expected 64 (the target's vocabulary",
    ),
    "another target's depth": (
        published_for_tiny(num_target_layers=64),
        "field 'num_target_layers' is 64; expected 8 (the target's decoder layers",
    ),
    "unsorted ids": (
        published_for_tiny(dflash_config={"mask_token_id": MASK, "target_layer_ids": [3, 1]}),
        "field 'dflash_config.target_layer_ids' is [3, 1]; expected unique, strictly increasing",
    ),
}


@pytest.mark.parametrize("case", CONFIG_PROBLEMS)
def test_init_config_that_does_not_fit_the_target_is_refused_naming_the_field(target_dir, tmp_path, capsys, case):
    config, expected = CONFIG_PROBLEMS[case]
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, _, err = run_cli(
        capsys, "init", "--target-model", target_dir, "--out", tmp_path / "d", "--config", tmp_path / "config.json"
    )
    line = one_line_error(rc, err)
    assert str(tmp_path / "config.json") in line and expected in line, line
    assert not (tmp_path / "d").exists()


def test_init_config_with_fewer_layers_needs_layer_types_when_its_types_are_mixed(target_dir, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(published_for_tiny()))
    argv = [
        "init",
        "--target-model",
        target_dir,
        "--out",
        tmp_path / "d",
        "--config",
        tmp_path / "config.json",
        "--draft-layers",
        2,
    ]
    line = one_line_error(*run_cli(capsys, *argv)[::2])
    assert "--draft-layers 2:" in line and "for 5 layers; give --layer-types for 2 layers" in line, line
    rc, _, err = run_cli(capsys, *argv, "--layer-types", "sliding,full")
    assert rc == 0, err
    assert load_drafter(tmp_path / "d").config.layer_types == ["sliding_attention", "full_attention"]


def test_init_writes_the_mask_token_string_so_sglang_accepts_the_drafter_before_export(target_dir, tmp_path, capsys):
    rc, _, err = init(capsys, target_dir, tmp_path / "d")
    assert rc == 0, err
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert written["dflash_config"]["mask_token"] == "<mask>" and written["dflash_config"]["mask_token_id"] == MASK
    rc, out, err = run_cli(capsys, "doctor", tmp_path / "d", "--serving", "--target-model", target_dir)
    assert "mask token: dflash_config.mask_token absent" not in out + err


# -- DFlash2 --------------------------------------------------------------------------------------


def test_init_family_dflash2_takes_the_published_module_sizes_and_block_8_unless_given(target_dir, tmp_path, capsys):
    rc, out, err = run_cli(
        capsys,
        "init",
        "--target-model",
        target_dir,
        "--out",
        tmp_path / "d",
        "--family",
        "dflash2",
        "--draft-layers",
        1,
    )
    assert rc == 0, err
    cfg = load_drafter(tmp_path / "d").config
    assert (
        cfg.architecture,
        cfg.block_size,
        cfg.conv_kernel_size,
        cfg.conv_group_size,
        cfg.selector_rank,
        cfg.selector_top_k,
    ) == ("DFlash2DraftModel", 8, 2, 16, 256, 16)
    assert "architecture: DFlash2DraftModel (conv kernel 2, group 16; selector rank 256, top-16)" in out
    rc, _, err = init(
        capsys,
        target_dir,
        tmp_path / "e",
        "--family",
        "dflash2",
        "--conv-kernel-size",
        3,
        "--conv-group-size",
        8,
        "--selector-rank",
        12,
        "--selector-top-k",
        5,
    )
    assert rc == 0, err
    cfg = load_drafter(tmp_path / "e").config
    assert (cfg.block_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (
        4,
        3,
        8,
        12,
        5,
    )


def test_a_dflash2_size_without_family_dflash2_and_from_drafter_with_shape_flags_are_one_line_errors(
    target_dir, tmp_path, capsys
):
    rc, _, err = init(capsys, target_dir, tmp_path / "d", "--selector-rank", 8)
    assert "--selector-rank 8: a DFlash2 module size; give --family dflash2" in one_line_error(rc, err)
    assert init(capsys, target_dir, tmp_path / "base", "--draft-layers", 1)[0] == 0
    rc, _, err = init(
        capsys,
        target_dir,
        tmp_path / "d",
        "--family",
        "dflash2",
        "--from-drafter",
        tmp_path / "base",
        "--draft-layers",
        2,
    )
    assert "--draft-layers: --from-drafter takes the drafter's shape" in one_line_error(rc, err)
    rc, _, err = run_cli(
        capsys, "init", "--target-model", target_dir, "--out", tmp_path / "d", "--from-drafter", tmp_path / "base"
    )
    assert "expected --family dflash2" in one_line_error(rc, err)
    assert not (tmp_path / "d").exists()


def test_init_config_of_the_published_dflash2_drafter_round_trips_field_by_field(target_dir, tmp_path, capsys):
    published = published_for_tiny(
        architectures=["DFlash2DraftModel"],
        layer_types=["sliding_attention"] * 5,
        is_causal=False,
        dflash_config={
            "mask_token_id": MASK,
            "target_layer_ids": [1, 2, 3, 4, 5],
            "block_size": 8,
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 256,
            "selector_top_k": 16,
        },
    )
    del published["block_size"], published["auto_map"]
    (tmp_path / "config.json").write_text(json.dumps(published))
    rc, _, err = run_cli(
        capsys, "init", "--target-model", target_dir, "--out", tmp_path / "d", "--config", tmp_path / "config.json"
    )
    assert rc == 0, err
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    for key, value in published.items():
        if key != "dtype":
            assert written[key] == value, key
    assert load_drafter(tmp_path / "d").candidate_selector is not None


# -- DSpark ---------------------------------------------------------------------------------------


def test_init_family_dspark_takes_rank_256_a_confidence_head_with_markov_input_and_block_7_unless_given(
    target_dir, tmp_path, capsys
):
    rc, out, err = run_cli(
        capsys, "init", "--target-model", target_dir, "--out", tmp_path / "d", "--family", "dspark", "--draft-layers", 1
    )
    assert rc == 0, err
    cfg = load_drafter(tmp_path / "d").config
    assert (
        cfg.architecture,
        cfg.block_size,
        cfg.markov_rank,
        cfg.confidence_head,
        cfg.confidence_head_with_markov,
        cfg.first_draft_position,
    ) == ("Qwen3DSparkModel", 7, 256, True, True, 0)
    assert "layout: anchor-first (DSpark)" in out and "Markov head rank 256" in out
    rc, _, err = init(
        capsys, target_dir, tmp_path / "e", "--family", "dspark", "--markov-rank", 16, "--confidence-head", "hidden"
    )
    assert rc == 0, err
    cfg = load_drafter(tmp_path / "e").config
    assert (cfg.block_size, cfg.markov_rank, cfg.confidence_head, cfg.confidence_head_with_markov) == (
        4,
        16,
        True,
        False,
    )
    assert init(capsys, target_dir, tmp_path / "f", "--family", "dspark", "--confidence-head", "none")[0] == 0
    assert load_drafter(tmp_path / "f").confidence_head is None


def test_a_dspark_setting_without_family_dspark_is_a_one_line_error(target_dir, tmp_path, capsys):
    rc, _, err = init(capsys, target_dir, tmp_path / "d", "--markov-rank", 8)
    assert "--markov-rank 8: a DSpark setting; give --family dspark" in one_line_error(rc, err)
    assert not (tmp_path / "d").exists()


def test_a_drafter_turned_dflash2_or_rescaled_keeps_its_trained_context_and_weights():
    from flashdraft.drafter.init import dflash2_from_drafter, with_rope_scaling
    from tests.conftest import make_drafter

    drafter = make_drafter(trained_context_length=77)
    assert dflash2_from_drafter(drafter).config.trained_context_length == 77  # init --from-drafter
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    scaled = with_rope_scaling(drafter, yarn)
    assert scaled.config.rope_scaling == yarn and scaled.config.trained_context_length == 77
    assert all(torch.equal(v, scaled.state_dict()[k]) for k, v in drafter.state_dict().items())
    assert with_rope_scaling(scaled, {"rope_type": "default"}).config.rope_scaling is None


def test_a_fresh_drafter_for_mla_takes_the_value_width_and_for_nemotron_h_its_layer_norm_epsilon(tmp_path, capsys):
    """MLA targets have no single head_dim (their config's is the RoPE part of a query): a drafter takes the value
    heads' width; Nemotron-H names its norm epsilon layer_norm_epsilon."""
    from tests.target.tiny_families import save_family_target

    for model_type in ("deepseek_v3", "nemotron_h"):
        target = save_family_target(tmp_path / model_type, model_type)
        rc, _, err = run_cli(capsys, "init", "--target-model", target, "--out", tmp_path / f"d-{model_type}")
        assert rc == 0, err
    mla = load_drafter(tmp_path / "d-deepseek_v3").config
    assert mla.head_dim == 64 and mla.num_attention_heads == 2  # v_head_dim 64; the config's head_dim is 32
    assert load_drafter(tmp_path / "d-nemotron_h").config.rms_norm_eps == 1e-5  # its layer_norm_epsilon


def test_a_target_whose_head_dim_varies_by_layer_gets_the_width_most_layers_have(tmp_path, capsys):
    """Gemma 4's full-attention layers have a head_dim of their own (transformers' per_layer_config): reading the
    config's head_dim raises; init reads it per layer and takes the width of most layers."""
    from tests.target.tiny_families import save_family_target

    target = save_family_target(tmp_path / "gemma4", "gemma4_text")
    rc, out, err = init(capsys, target, tmp_path / "d", "--draft-layers", "1")
    assert rc == 0, err
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert written["head_dim"] == 64  # the sliding layers' (two of four; the full ones' 512 is the larger tie)
