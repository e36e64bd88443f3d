"""TargetHead: offline training and evaluation read only tokenizer, config, embeddings and LM
head from the target's files, with the same results and the same fingerprint as the loaded model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from flashdraft.cli import main
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TINY_DIR, TargetModel
from flashdraft.target.weights import TargetHead
from tests.conftest import EOS, PAD, VOCAB, make_hf_model, make_tokenizer, save_target, write_word_prompts
from tests.target.tiny_families import FAMILIES, MORE_TYPES, save_family_target


def save_qwen36_layout(directory, seed: int = 0, moe: bool = False):
    """A tiny random target as Qwen3.5/3.6 checkpoints are published: a vision-language config
    with the language model's in text_config, weights under model.language_model., a vision tower;
    `moe`: the MoE hybrids' (Qwen3.5-35B-A3B, ...: Qwen3_5MoeForConditionalGeneration, experts per tensor)."""
    torch.manual_seed(seed)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_position_embeddings=512,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    if moe:
        text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        Qwen3_5MoeForConditionalGeneration(config).save_pretrained(directory)
    else:
        config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
        Qwen3_5ForConditionalGeneration(config).save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory


def save_sharded(directory, kind: str = "hybrid"):
    """A target split into several safetensors files listed by model.safetensors.index.json."""
    make_hf_model(kind).save_pretrained(directory, max_shard_size="40KB")
    make_tokenizer().save_pretrained(directory)
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


def drop_tensors(directory, keep) -> None:
    """Rewrite model.safetensors with only the tensors `keep(name)` accepts (config unchanged)."""
    file = directory / "model.safetensors"
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if keep(k)}, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    dirs = {
        "tiny": TINY_DIR,
        "qwen3.6 layout": save_qwen36_layout(root / "qwen36"),
        "qwen3.6 moe layout": save_qwen36_layout(root / "qwen36-moe", moe=True),
        "sharded": save_sharded(root / "sharded"),
    }
    for kind in ("qwen3", "hybrid", "llama"):
        dirs[kind] = save_target(root / kind, kind)
    return dirs


KINDS = ["tiny", "qwen3", "hybrid", "llama", "qwen3.6 layout", "qwen3.6 moe layout", "sharded"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_fingerprint_from_the_files_equals_the_loaded_models(targets, kind, dtype):
    head = TargetHead.load(targets[kind], dtype=dtype)
    assert head.fingerprint() == TargetModel.load(targets[kind], dtype=dtype).fingerprint()


@pytest.mark.parametrize("kind", KINDS)
def test_head_pieces_and_facts_equal_the_loaded_models(targets, kind):
    head, model = TargetHead.load(targets[kind]), TargetModel.load(targets[kind])
    ids = torch.randint(0, model.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 7, model.hidden_size, generator=torch.Generator().manual_seed(1))
    assert torch.equal(head.embed(ids), model.embed(ids)) and torch.equal(head.lm_head(hidden), model.lm_head(hidden))
    assert torch.equal(head.final_norm_weight(), model.final_norm_weight())
    for fact in ("num_layers", "hidden_size", "vocab_size", "context_length", "is_hybrid", "stop_token_ids", "dtype"):
        assert getattr(head, fact) == getattr(model, fact), fact


def test_tied_config_with_an_lm_head_of_its_own_in_the_file_reads_as_transformers_loads_it(tmp_path):
    shutil.copytree(TINY_DIR, tmp_path / "t")
    tensors = load_file(tmp_path / "t" / "model.safetensors")
    assert "lm_head.weight" not in tensors  # the built-in target ties its LM head to the embedding
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"].float()).bfloat16()
    save_file(tensors, tmp_path / "t" / "model.safetensors", metadata={"format": "pt"})
    head, model = TargetHead.load(tmp_path / "t"), TargetModel.load(tmp_path / "t")
    hidden = torch.randn(3, model.hidden_size)
    assert torch.equal(head.lm_head(hidden), model.lm_head(hidden))
    assert not torch.equal(head.lm_head_weight, head.embed_weight)  # transformers unties differing values
    assert head.fingerprint() == model.fingerprint()


def test_weights_are_read_in_the_requested_dtype_and_only_when_used(targets):
    head = TargetHead.load(targets["hybrid"], dtype=torch.bfloat16)
    assert "embed_weight" not in vars(head) and "lm_head_weight" not in vars(head)  # shapes came from the headers
    assert head.vocab_size == VOCAB and head.embed(torch.tensor([[1, 2]])).dtype == torch.bfloat16
    assert TargetHead.load(targets["hybrid"]).dtype == torch.float32  # CPU default


def test_decoder_layers_absent_from_the_files_are_never_needed(tmp_path, targets):
    shutil.copytree(targets["hybrid"], tmp_path / "t")
    drop_tensors(tmp_path / "t", keep=lambda name: ".layers." not in name)  # config still says 4 layers
    head, full = TargetHead.load(tmp_path / "t"), TargetHead.load(targets["hybrid"])
    ids, hidden = torch.tensor([[3, 5, 8]]), torch.randn(1, 3, 64)
    assert head.num_layers == 4 and torch.equal(head.embed(ids), full.embed(ids))
    assert torch.equal(head.lm_head(hidden), full.lm_head(hidden))
    assert head.fingerprint() != full.fingerprint()  # what is stored identifies it; the layers are not


@pytest.mark.parametrize(
    "drop, named",
    [
        ("model.embed_tokens.weight", "model.embed_tokens.weight' (the input embedding)"),
        ("lm_head.weight", "lm_head.weight' (the LM head)"),
    ],
)
def test_missing_embedding_or_lm_head_is_a_one_line_error_naming_file_and_tensor(
    capsys, tmp_path, targets, drop, named
):
    shutil.copytree(targets["qwen3"], tmp_path / "t")
    drop_tensors(tmp_path / "t", keep=lambda name: name != drop)
    with pytest.raises(FlashdraftError, match="holds no tensor"):
        TargetHead.load(tmp_path / "t")
    (tmp_path / "d").mkdir(), (tmp_path / "cache").mkdir()  # inputs that exist: the target is read first
    rc = main(
        [
            "eval",
            "--checkpoint",
            str(tmp_path / "d"),
            "--target-model",
            str(tmp_path / "t"),
            "--cached-hidden-states",
            str(tmp_path / "cache"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert f"{tmp_path / 't' / 'model.safetensors'} holds no tensor '{named}" in err[0]


def test_a_missing_shard_is_named_with_the_index_that_lists_it(tmp_path, targets):
    shutil.copytree(targets["sharded"], tmp_path / "t")
    index = json.loads((tmp_path / "t" / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["lm_head.weight"]
    (tmp_path / "t" / shard).unlink()
    with pytest.raises(
        FlashdraftError,
        match=f"{shard} \\(named by .*model.safetensors.index.json\\) is missing 'lm_head.weight' \\(the LM head\\)",
    ):
        TargetHead.load(tmp_path / "t")


# -- offline train and eval: the head gives what the whole model gives ----------------------------


@pytest.fixture(scope="module")
def offline_data(tmp_path_factory, targets):
    """Per target kind: completions and a cache (fp32) of its context layers."""
    data = {}
    for kind, layers in (("hybrid", "0,2"), ("tiny", "1,3")):
        root = tmp_path_factory.mktemp(kind)
        prompts = write_word_prompts(root / "prompts.jsonl", 4) if kind != "tiny" else "builtin:code:heldout"
        assert (
            main(
                [
                    "generate",
                    "--target-model",
                    str(targets[kind]),
                    "--prompts",
                    str(prompts),
                    "--num-prompts",
                    "4",
                    "--out",
                    str(root / "c.json"),
                    "--max-new-tokens",
                    "24",
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "cache",
                    "--target-model",
                    str(targets[kind]),
                    "--completions",
                    str(root / "c.json"),
                    "--out",
                    str(root / "cache"),
                    "--layers",
                    layers,
                    "--dtype",
                    "fp32",
                ]
            )
            == 0
        )
        data[kind] = (targets[kind], root, layers)
    return data


def _whole_model_instead_of_head(monkeypatch):
    monkeypatch.setattr(TargetHead, "load", staticmethod(lambda path, **kw: TargetModel.load(path, **kw)))


def _refuse_whole_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("offline training or evaluation loaded the whole target")

    monkeypatch.setattr(TargetModel, "load", staticmethod(refuse))


@pytest.mark.parametrize("kind", ["hybrid", "tiny"])
def test_offline_train_and_eval_through_the_head_equal_the_whole_model_path(monkeypatch, capsys, offline_data, kind):
    target, root, layers = offline_data[kind]
    results = {}
    for path in ("whole", "head"):
        with monkeypatch.context() as m:
            (_whole_model_instead_of_head if path == "whole" else _refuse_whole_model)(m)
            out = root / f"run-{path}"
            assert (
                main(
                    [
                        "train",
                        "--target-model",
                        str(target),
                        "--cached-hidden-states",
                        str(root / "cache"),
                        "--out",
                        str(out),
                        "--draft-layers",
                        "1",
                        "--target-layer-ids",
                        layers,
                        "--block-size",
                        "4",
                        "--batch-size",
                        "2",
                        "--num-anchors",
                        "8",
                        "--lr",
                        "3e-3",
                        "--epochs",
                        "2",
                        "--log-every",
                        "1",
                        "--eval-every",
                        "4",
                        "--eval-cached-hidden-states",
                        str(root / "cache"),
                    ]
                )
                == 0
            ), capsys.readouterr().err
            drafter = out / "checkpoints" / "step-0000004" / "drafter"
            assert (
                main(
                    [
                        "eval",
                        "--checkpoint",
                        str(drafter),
                        "--target-model",
                        str(target),
                        "--cached-hidden-states",
                        str(root / "cache"),
                        "--max-blocks",
                        "6",
                        "--json",
                        str(root / f"eval-{path}.json"),
                    ]
                )
                == 0
            ), capsys.readouterr().err
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        results[path] = (
            load_file(drafter / "model.safetensors"),
            [{k: v for k, v in m.items() if "loss" in k or "tau" in k or "accura" in k} for m in metrics],
            json.loads((root / f"eval-{path}.json").read_text()),
        )
    (weights_w, metrics_w, eval_w), (weights_h, metrics_h, eval_h) = results["whole"], results["head"]
    assert weights_w.keys() == weights_h.keys() and all(torch.equal(weights_w[k], weights_h[k]) for k in weights_w)
    assert metrics_w == metrics_h and any("eval_tau" in m for m in metrics_h)
    assert eval_w["per_prompt"] == eval_h["per_prompt"] and eval_w["tau"] == eval_h["tau"]


def test_train_target_dtype_sets_how_the_target_is_read(monkeypatch, capsys, offline_data):
    # the built-in target's weights are stored in bf16: its fingerprint is the same read in either dtype
    target, root, layers = offline_data["tiny"]
    seen = []
    real = TargetHead.load.__func__

    def spy(cls, path, device="cpu", dtype=None):
        head = real(cls, path, device, dtype)
        seen.append(head.dtype)
        return head

    monkeypatch.setattr(TargetHead, "load", classmethod(spy))
    common = [
        "train",
        "--target-model",
        str(target),
        "--cached-hidden-states",
        str(root / "cache"),
        "--draft-layers",
        "1",
        "--target-layer-ids",
        layers,
        "--block-size",
        "4",
        "--batch-size",
        "2",
        "--num-anchors",
        "8",
        "--max-steps",
        "2",
        "--log-every",
        "1",
    ]
    assert main([*common, "--out", str(root / "dtype-default")]) == 0, capsys.readouterr().err
    assert main([*common, "--out", str(root / "dtype-bf16"), "--target-dtype", "bf16"]) == 0, capsys.readouterr().err
    assert seen == [torch.float32, torch.bfloat16]  # CPU default, then as asked
    last = json.loads((root / "dtype-bf16" / "metrics.jsonl").read_text().splitlines()[-1])
    assert torch.isfinite(torch.tensor(last["loss"]))


@pytest.mark.parametrize("kind", ["tiny", "qwen3.6 layout", "qwen3"])
def test_attention_layer_weights_compute_what_the_target_layer_computes(targets, kind):
    """The weights a drafter layer starts from reproduce the target layer's norms, MLP and
    (gated Qwen3.5 projections: the query half of every head) query projection."""
    head, model = TargetHead.load(targets[kind]), TargetModel.load(targets[kind])
    layer_id = head.layer_types.index("full_attention")
    weights = head.attention_layer_weights(layer_id)
    layer = model.model.get_decoder().layers[layer_id]
    x = torch.randn(3, head.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for norm in ("input_layernorm", "post_attention_layernorm"):
            torch.testing.assert_close(
                torch.nn.functional.rms_norm(
                    x, (x.shape[-1],), weights[f"{norm}.weight"], eps=head.config.rms_norm_eps
                ),
                getattr(layer, norm)(x),
            )
        mlp = layer.mlp
        w = {n: weights[f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")}
        ours = (torch.nn.functional.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
        torch.testing.assert_close(ours, mlp(x))
        attn, head_dim = layer.self_attn, attn_head_dim(head)
        full_q = attn.q_proj(x).view(3, head.config.num_attention_heads, -1)  # [tokens, heads, head_dim (x2 gated)]
        ours_q = (x @ weights["self_attn.q_proj.weight"].T).view(3, head.config.num_attention_heads, head_dim)
        torch.testing.assert_close(ours_q, full_q[..., :head_dim])
        torch.testing.assert_close(weights["self_attn.k_proj.weight"], attn.k_proj.weight.float())


def attn_head_dim(head: TargetHead) -> int:
    return getattr(head.config, "head_dim", None) or head.hidden_size // head.config.num_attention_heads


def test_attention_layer_weights_refuse_a_linear_attention_layer(targets):
    head = TargetHead.load(targets["tiny"])
    with pytest.raises(FlashdraftError, match=r"target layer 0 is linear_attention; expected a full_attention"):
        head.attention_layer_weights(0)


@pytest.mark.parametrize("model_type", list(FAMILIES) + list(MORE_TYPES))
def test_families_with_fused_experts_or_renamed_prefixes_fingerprint_alike_from_files_and_loaded(tmp_path, model_type):
    """Their checkpoints store routed experts one by one (the model fuses them on load), Nemotron-H its
    decoder under backbone. (loaded as model.), Granite 4.0 its router as router.layer (transformers renames it on
    load); the files still give the loaded model's fingerprint, embeddings, LM head and final norm. (The types
    without a family row are held to it by tests/target/test_tiny_families.py: its offline train compares the
    cache's fingerprint, from the loaded model, with the one read from the files.)"""
    directory = save_family_target(tmp_path / model_type, model_type)
    head, loaded = TargetHead.load(directory), TargetModel.load(directory)
    assert head.fingerprint() == loaded.fingerprint()
    assert torch.equal(head.embed_weight, loaded.model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head_weight, loaded.lm_head_weight)
    torch.testing.assert_close(head.final_norm_weight(), loaded.final_norm_weight())


def test_a_layer_not_of_qwen3s_form_cannot_start_a_drafter_layer(tmp_path):
    head = TargetHead.load(save_family_target(tmp_path / "t", "deepseek_v3"))
    with pytest.raises(FlashdraftError, match=r"target layer 2 \(deepseek_v3\) has no model.layers.2.self_attn.q_proj"):
        head.attention_layer_weights(2)
