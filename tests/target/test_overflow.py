"""fp16's range: captured hidden states beyond it are refused before they are cached or trained on, naming the layer
and the largest value; a healthy target passes."""

from __future__ import annotations

import torch

from flashdraft.target.overflow import FP16_MAX, Overflow, fp16_overflow
from tests.conftest import run_cli, write_word_prompts
from tests.target.tiny_families import make_bpe_tokenizer, make_family_model


def test_the_first_layer_beyond_fp16s_range_is_named_with_its_largest_value_and_token():
    features = torch.randn(5, 3 * 4)  # [T, layers x hidden]: layers 1, 4, 7 of hidden 4
    assert fp16_overflow(features, [1, 4, 7], 4) is None
    features[3, 4 + 2] = -1.5e5  # layer 4, token 3
    features[1, 8] = float("inf")  # layer 7: the target itself overflowed
    assert fp16_overflow(features, [1, 4, 7], 4) == Overflow(layer=4, value=1.5e5, token=3)
    features[3, 6] = 0.0
    assert fp16_overflow(features, [1, 4, 7], 4) == Overflow(layer=7, value=float("inf"), token=1)
    assert fp16_overflow(torch.full((2, 4), FP16_MAX), [0], 4) is None  # fp16's largest value still fits


def test_caching_in_fp16_refuses_a_planted_outlier_naming_the_layer_and_passes_a_healthy_target(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    write_word_prompts(tmp_path / "prompts.jsonl", 2)
    for name, scale in [("healthy", 1.0), ("outlier", 1e6)]:
        model = make_family_model("qwen2")
        with torch.no_grad():  # layer 1's attention output scaled: its residual stream leaves fp16's range
            model.model.layers[1].self_attn.o_proj.weight.mul_(scale)
        model.save_pretrained(tmp_path / name)
        make_bpe_tokenizer().save_pretrained(tmp_path / name)  # the tokenizer qwen2 reads
    t = ["--completions", "train.json", "--layers", "0,1", "--dtype", "fp16"]
    rc, _, err = run_cli(
        capsys,
        "generate",
        "--target-model",
        "healthy",
        "--prompts",
        "prompts.jsonl",
        "--out",
        "train.json",
        "--max-new-tokens",
        "6",
    )
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "cache", "--target-model", "healthy", *t, "--out", "healthy-cache")
    assert rc == 0, err
    rc, _, err = run_cli(
        capsys, "cache", "--target-model", "outlier", *t, "--out", "outlier-cache", "--allow-foreign-completions"
    )
    lines = [line for line in err.splitlines() if line.startswith("error")]  # not the progress bars
    assert rc == 2 and len(lines) == 1, err
    assert (
        "hidden states of target layer 1 reach" in lines[0]
        and "beyond fp16's range" in lines[0]
        and "store bf16" in lines[0]
    )
    # the same target computing in fp16 and training online: refused before the first step
    rc, _, err = run_cli(
        capsys,
        "train",
        "--target-model",
        "outlier",
        "--completions",
        "train.json",
        "--allow-foreign-completions",
        "--target-dtype",
        "fp16",
        "--out",
        "run",
        "--draft-layers",
        "1",
        "--block-size",
        "4",
        "--max-steps",
        "1",
    )
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert rc == 2 and len(lines) == 1, err
    # its forward overflows to Inf in fp16 (NaN logits): refused as it loads, naming the layer
    assert "outlier: hidden states of target layer 1 reach inf" in lines[0] and "--target-dtype bf16" in lines[0]
