import json

import pytest
import torch
from safetensors.torch import save_file

from flashdraft.drafter.checkpoint import expected_shapes, load_drafter, save_drafter
from flashdraft.drafter.config import DFLASH2_FIELDS, DrafterConfig
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.errors import FlashdraftError
from tests.conftest import make_dflash2_drafter, make_drafter, make_reduced_vocab_drafter
from tests.drafter.test_config import PUBLIC_QWEN36_CONFIG, PUBLIC_QWEN38_DFLASH2_CONFIG


def test_state_dict_keys_and_shapes_equal_the_public_table_for_qwen36_27b():
    cfg = DrafterConfig.from_dict(PUBLIC_QWEN36_CONFIG)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == expected_shapes(cfg)
    assert shapes["fc.weight"] == (5120, 25600)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (4096, 5120)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (1024, 5120)
    assert shapes["layers.4.self_attn.o_proj.weight"] == (5120, 4096)
    assert shapes["layers.2.self_attn.q_norm.weight"] == (128,)
    assert shapes["layers.3.mlp.gate_proj.weight"] == (17408, 5120)
    assert shapes["layers.3.mlp.down_proj.weight"] == (5120, 17408)
    assert shapes["hidden_norm.weight"] == shapes["norm.weight"] == (5120,)
    assert len(shapes) == 3 + 5 * 11  # no embedding, no LM head, nothing else


def test_saved_drafter_reloads_identically(tmp_path):
    drafter = make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    save_drafter(drafter, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_drafter(tmp_path)
    assert loaded.config.to_dict() == drafter.config.to_dict() | {"dtype": "float32"}
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    x, anchors = torch.randn(1, 16, 64), torch.tensor([[5, 12]])
    ctx, pos = torch.randn(1, 17, 128), torch.arange(17)[None]
    assert torch.equal(drafter(x, anchors, ctx, pos), loaded(x, anchors, ctx, pos))


def _write(tmp_path, state, cfg_dict):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg_dict))
    save_file(state, str(tmp_path / "model.safetensors"))


def test_public_drafter_directory_written_by_another_tool_loads(tmp_path):
    drafter = make_drafter()
    cfg = drafter.config.to_dict() | {"auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "bos_token_id": 1}
    _write(tmp_path, {k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()}, cfg)
    loaded = load_drafter(tmp_path)
    assert loaded.config.extra["auto_map"] == cfg["auto_map"]
    assert torch.allclose(loaded.fc.weight, drafter.fc.weight, atol=1e-2)


@pytest.mark.parametrize("extra_layers", [-1, 1])
def test_fc_with_other_context_layer_count_is_refused_naming_both_shapes(tmp_path, extra_layers):
    drafter = make_drafter()  # 2 context layers, fc [64, 128]
    state = drafter.state_dict()
    state["fc.weight"] = torch.zeros(64, 64 * (2 + extra_layers))
    _write(tmp_path, state, drafter.config.to_dict())
    with pytest.raises(FlashdraftError) as err:
        load_drafter(tmp_path)
    msg = str(err.value)
    assert "fc.weight" in msg and f"[64, {64 * (2 + extra_layers)}]" in msg and "[64, 128]" in msg
    assert f"{2 + extra_layers} context layers" in msg and "2 context layers" in msg


def test_fc_not_a_multiple_of_hidden_is_refused(tmp_path):
    drafter = make_drafter()
    state = drafter.state_dict() | {"fc.weight": torch.zeros(64, 100)}
    _write(tmp_path, state, drafter.config.to_dict())
    with pytest.raises(FlashdraftError, match="not a multiple of hidden_size 64"):
        load_drafter(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    drafter = make_drafter()
    state = {k: v for k, v in drafter.state_dict().items() if k != "layers.1.mlp.up_proj.weight"}
    _write(tmp_path, state, drafter.config.to_dict())
    with pytest.raises(FlashdraftError, match=r"'layers.1.mlp.up_proj.weight' is missing; expected shape \[128, 64\]"):
        load_drafter(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    drafter = make_drafter()
    state = drafter.state_dict() | {"layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}
    _write(tmp_path, state, drafter.config.to_dict())
    with pytest.raises(FlashdraftError, match="unexpected tensor 'layers.2.mlp.up_proj.weight'"):
        load_drafter(tmp_path)
    # an own embedding is read only over the full vocabulary (DeepSpec's copy of the target's)
    _write(tmp_path, drafter.state_dict() | {"embed_tokens.weight": torch.zeros(32, 64)}, drafter.config.to_dict())
    with pytest.raises(FlashdraftError, match=r"'embed_tokens.weight' has shape \[32, 64\]; expected \[64, 64\]"):
        load_drafter(tmp_path)


def test_wrongly_shaped_tensor_is_named_with_both_shapes(tmp_path):
    drafter = make_drafter()
    state = drafter.state_dict() | {"layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}
    _write(tmp_path, state, drafter.config.to_dict())
    with pytest.raises(
        FlashdraftError, match=r"'layers.0.self_attn.k_proj.weight' has shape \[64, 64\]; expected \[32, 64\]"
    ):
        load_drafter(tmp_path)


def test_truncated_weights_and_missing_weights_are_refused(tmp_path):
    save_drafter(make_drafter(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(FlashdraftError, match="truncated or corrupt"):
        load_drafter(tmp_path)
    weights.unlink()
    with pytest.raises(FlashdraftError, match="no model.safetensors"):
        load_drafter(tmp_path)


REDUCED_IDS = [0, 2, 5, 9, 17, 30, 44, 61, 63]


def test_a_reduced_vocabulary_drafter_saves_its_own_head_and_d2t_and_reloads_identically(tmp_path):
    drafter = make_reduced_vocab_drafter(REDUCED_IDS)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.config.draft_vocab_size == len(REDUCED_IDS)
    assert {"lm_head.weight", "d2t"} <= set(loaded.state_dict())
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert loaded.target_ids().tolist() == REDUCED_IDS and loaded.d2t.dtype == torch.long


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("d2t"), "tensor 'd2t' is missing"),
        (lambda s: s.pop("lm_head.weight"), "tensor 'lm_head.weight' is missing"),
        (lambda s: s["d2t"].__setitem__(-1, 100), "maps draft id 8 to target id 108"),
        (lambda s: s["d2t"].__setitem__(1, -1), "two draft ids to one target id"),
        (lambda s: s.__setitem__("t2d", torch.ones(64, dtype=torch.bool)), "'t2d'"),
    ],
)
def test_a_reduced_vocabulary_with_a_missing_or_inconsistent_map_is_refused_by_name(tmp_path, change, message):
    drafter = make_reduced_vocab_drafter(REDUCED_IDS)
    save_drafter(drafter, tmp_path)
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    change(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(FlashdraftError, match=message):
        load_drafter(tmp_path)


def test_a_consistent_t2d_of_an_eagle3_style_drafter_is_accepted_and_dropped(tmp_path):
    drafter = make_reduced_vocab_drafter(REDUCED_IDS)
    save_drafter(drafter, tmp_path)
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[REDUCED_IDS] = True
    save_file(drafter.state_dict() | {"t2d": t2d}, str(tmp_path / "model.safetensors"))
    assert "t2d" not in load_drafter(tmp_path).state_dict()


def test_dflash2_state_dict_has_the_published_names_and_shapes_for_qwen38_27b():
    cfg = DrafterConfig.from_dict(PUBLIC_QWEN38_DFLASH2_CONFIG)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == expected_shapes(cfg)
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 5120)  # no `.weight`
    assert shapes["layers.4.mlp_conv.kernel_projection.weight"] == (2 * 2 * 5120 // 16, 5120)
    assert shapes["candidate_selector.predecessor_codebook"] == (248320, 256)  # no `.weight`
    assert shapes["candidate_selector.successor_codebook"] == (248320, 256)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 5120)
    assert len(shapes) == 3 + 5 * (11 + 4) + 3


def test_a_dflash2_drafter_saves_the_published_contract_and_reloads_identically(tmp_path):
    drafter = make_dflash2_drafter()
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    written = {k: config["dflash_config"][k] for k in [*DFLASH2_FIELDS, "block_size"]}
    assert written == {
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
        "block_size": 8,
    }
    loaded = load_drafter(tmp_path)
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    x, anchors = torch.randn(1, 16, 64), torch.tensor([[5, 12]])
    ctx, pos = torch.randn(1, 17, 128), torch.arange(17)[None]
    assert torch.equal(drafter(x, anchors, ctx, pos), loaded(x, anchors, ctx, pos))


@pytest.mark.parametrize(
    "key",
    [
        "candidate_selector.successor_codebook",
        "layers.1.mlp_conv.base_kernel",
        "candidate_selector.hidden_projection.weight",
    ],
)
def test_a_dflash2_drafter_missing_a_codebook_or_conv_tensor_is_refused_by_name(tmp_path, key):
    # one trainer's exports silently dropped the codebooks; the servers would serve them random
    drafter = make_dflash2_drafter()
    state = {k: v for k, v in drafter.state_dict().items() if k != key}
    _write(tmp_path, state, drafter.config.to_dict())
    with pytest.raises(FlashdraftError, match=f"'{key}' is missing; expected shape .*random"):
        load_drafter(tmp_path)


def test_dflash2_tensors_under_a_dflash_config_and_misshaped_codebooks_are_refused_by_name(tmp_path):
    drafter = make_dflash2_drafter()
    _write(tmp_path / "a", drafter.state_dict(), make_drafter().config.to_dict())
    with pytest.raises(FlashdraftError, match="unexpected tensor '(candidate_selector|layers).*DFlash2DraftModel"):
        load_drafter(tmp_path / "a")
    state = drafter.state_dict() | {"candidate_selector.predecessor_codebook": torch.zeros(64, 16)}
    _write(tmp_path / "b", state, drafter.config.to_dict())
    with pytest.raises(
        FlashdraftError,
        match=r"'candidate_selector.predecessor_codebook' has shape \[64, 16\]; "
        r"expected \[64, 8\]",
    ):
        load_drafter(tmp_path / "b")


def test_a_dspark_drafter_saves_vllms_tensor_names_and_reloads_identically(tmp_path):
    from tests.conftest import make_dspark_drafter

    drafter = make_dspark_drafter(confidence_head_with_markov=False)
    save_drafter(drafter, tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    # vLLM 0.33.0 qwen3_dspark.py: model.markov_head.markov_w1 (Embedding) / markov_w2 (ParallelLMHead), and
    # confidence_head.proj with bias, over the hidden state alone without confidence_head_with_markov
    assert {k: v for k, v in shapes.items() if k.startswith(("markov_head.", "confidence_head."))} == {
        "markov_head.markov_w1.weight": (64, 8),
        "markov_head.markov_w2.weight": (64, 8),
        "confidence_head.proj.weight": (1, 64),
        "confidence_head.proj.bias": (1,),
    }
    loaded = load_drafter(tmp_path)
    for name, p in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name


def test_a_dspark_checkpoint_read_in_the_fill_in_layout_or_missing_a_head_tensor_is_refused(tmp_path):
    from tests.conftest import make_dspark_drafter

    save_drafter(make_dspark_drafter(), tmp_path / "dspark")
    config = json.loads((tmp_path / "dspark/config.json").read_text())
    # relabelled as a DFlash drafter (decoded fill-in): its Markov tensors are refused by name
    for name in (
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "sample_from_anchor",
    ):
        config.pop(name)
    config["architectures"] = ["DFlashDraftModel"]
    (tmp_path / "dspark/config.json").write_text(json.dumps(config))
    with pytest.raises(FlashdraftError, match="unexpected tensor '(markov|confidence)_head.*a DSpark tensor"):
        load_drafter(tmp_path / "dspark")
    # a DFlash checkpoint relabelled as DSpark (decoded anchor-first): the heads are missing
    save_drafter(make_drafter(block_size=7), tmp_path / "dflash")
    config = json.loads((tmp_path / "dflash/config.json").read_text()) | {
        "architectures": ["Qwen3DSparkModel"],
        "markov_rank": 8,
        "enable_confidence_head": False,
        "confidence_head_with_markov": False,
    }
    (tmp_path / "dflash/config.json").write_text(json.dumps(config))
    with pytest.raises(FlashdraftError, match="tensor 'markov_head.markov_w1.weight' is missing"):
        load_drafter(tmp_path / "dflash")
