"""Quantised targets: compressed-tensors checkpoints (int8 W8A8, FP8 dynamic) made here from a tiny random target
load and run on a CPU, their fingerprint read from the files equals the loaded model's, their quantisation is
recorded and said; a scheme that cannot run here is refused in one line naming it."""

from __future__ import annotations

import json

import pytest
import torch

from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from flashdraft.target.quantisation import Quantisation, dequantised_sample, mismatch
from flashdraft.target.weights import TargetHead
from tests.conftest import run_cli, write_word_prompts
from tests.target.quantised_targets import SCHEMES, save_quantised_target
from tests.target.tiny_families import save_family_target

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantised")
    source = save_family_target(root / "bf16", "qwen2")
    return {"bf16": source} | {s: save_quantised_target(source, root / s, s) for s in SCHEMES}


@pytest.mark.parametrize(
    "scheme, name, stored, dtype",
    [("W8A8", "int8 W8A8", "int8", torch.float32), ("FP8_DYNAMIC", "FP8 dynamic", "fp8", torch.bfloat16)],
)
def test_a_quantised_checkpoint_loads_runs_and_fingerprints_alike_from_files_and_loaded(
    targets, scheme, name, stored, dtype
):
    loaded = TargetModel.load(targets[scheme], dtype=dtype)
    head = TargetHead.load(targets[scheme], dtype=dtype)
    # the files hold int8/fp8 values and scales, the loaded model the dequantised weights: the same identity
    assert head.fingerprint() == loaded.fingerprint()
    assert loaded.fingerprint() != TargetModel.load(targets["bf16"], dtype=dtype).fingerprint()
    assert loaded.quantisation == head.quantisation
    q = loaded.quantisation
    # 4 layers x (q, k, v, o, gate, up, down); the LM head left in bf16
    assert (q.scheme, q.quantised_layers, q.lm_head_dtype, q.ignore) == (name, 28, "bf16", ("lm_head",))
    assert q.weights.startswith(stored) and "dynamic" in q.activations
    logits = loaded.forward(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert logits.shape == (1, 5, loaded.vocab_size) and torch.isfinite(logits).all()


def test_a_quantised_lm_head_is_read_from_the_files_dequantised_as_the_loaded_model_holds_it(targets, tmp_path):
    quantised_head = save_quantised_target(targets["bf16"], tmp_path / "w8a8-head", "W8A8", ignore=())
    head, loaded = TargetHead.load(quantised_head), TargetModel.load(quantised_head)
    assert head.quantisation.lm_head_dtype == "int8 (quantised)" and head.quantisation.quantised_layers == 29
    assert torch.equal(head.lm_head_weight, loaded.lm_head_weight)
    assert head.fingerprint() == loaded.fingerprint()


def test_a_scheme_that_cannot_run_here_is_refused_in_one_line_naming_it(targets, tmp_path, capsys):
    """GPTQ needs packages this machine lacks: transformers' ImportError becomes one line with the scheme."""
    import shutil

    gptq = shutil.copytree(targets["bf16"], tmp_path / "gptq")
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlashdraftError, match=r"quantised target \(GPTQ int4, gptq\) cannot run here: ImportError"):
        TargetModel.load(gptq)
    write_word_prompts(tmp_path / "p.jsonl", 1)
    rc, _, err = run_cli(capsys, "generate", "--target-model", gptq, "--prompts", tmp_path / "p.jsonl", "--out", "x")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "GPTQ int4" in lines[0], err


def test_dequantised_samples_equal_the_whole_weight_dequantised_for_group_and_zero_point_layouts():
    """(q - zero_point) * scale at strided positions, scales per group of 4 columns, per channel, per tensor."""
    torch.manual_seed(0)
    q = torch.randint(-128, 128, (6, 8), dtype=torch.int8)
    indices = torch.arange(0, 48, 5)
    for scale, zero in [
        (torch.rand(6, 2), torch.randint(-3, 3, (6, 2))),
        (torch.rand(6, 1), None),
        (torch.rand(1), None),
    ]:
        columns = scale.shape[1] if scale.dim() == 2 else 1
        whole = q.float() - (zero.repeat_interleave(8 // columns, 1) if zero is not None else 0)
        whole = whole * (scale.repeat_interleave(8 // columns, 1) if scale.dim() == 2 else scale)
        parameters = {"weight_scale": scale} | ({"weight_zero_point": zero} if zero is not None else {})
        sample = dequantised_sample(q.reshape(-1)[indices], (6, 8), indices, parameters, "int-quantized")
        torch.testing.assert_close(sample, whole.reshape(-1)[indices], rtol=0, atol=0)
    # packed int4 is not computed sample by sample (the fingerprint then loads the model)
    assert dequantised_sample(q.reshape(-1), (6, 8), indices, {"weight_scale": scale}, "pack-quantized") is None


def test_the_pipeline_runs_against_a_quantised_target_and_a_cache_of_another_quantisation_is_named(
    targets, tmp_path, monkeypatch, capsys
):
    """generate, cache, init, train from the cache, eval offline and online (lossless, offline == online) against
    the W8A8 target; the cache records the scheme, doctor says it, and names it against the bf16 target."""
    monkeypatch.chdir(tmp_path)
    write_word_prompts(tmp_path / "prompts.jsonl", 3)
    t = ["--target-model", targets["W8A8"]]
    stages = [
        ["generate", *t, "--prompts", "prompts.jsonl", "--out", "train.json", "--max-new-tokens", "12"],
        ["cache", *t, "--completions", "train.json", "--out", "cache", "--layers", "2"],
        ["init", *t, "--out", "init", "--draft-layers", "1", "--block-size", "4"],
        [
            "train",
            *t,
            "--cached-hidden-states",
            "cache",
            "--out",
            "run",
            "--init",
            "init",
            "--max-steps",
            "2",
            "--batch-size",
            "2",
        ],
        ["eval", "--checkpoint", "run", *t, "--completions", "train.json", "--online", "--check-consistency"],
        ["export", "--checkpoint", "run", "--out", "drafter", *t],
        ["doctor", "drafter", "--serving", *t],
    ]
    for argv in stages:
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 0, (argv[0], err[-400:])
        if argv[0] == "eval":
            assert "offline vs online: identical acceptance lengths" in out
    # the exported drafter says its dtype; beside the quantised target, SGLang's rule is named with its flag
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["dtype"] == "float32"
    assert "SGLang quantises the drafter" in out and "--speculative-draft-model-quantization unquant" in out
    recorded = json.loads((tmp_path / "cache" / "manifest.json").read_text())["target"]["quantisation"]
    assert Quantisation.from_record(recorded).scheme == "int8 W8A8"
    run_config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert run_config["target_quantisation"]["scheme"] == "int8 W8A8"

    rc, out, err = run_cli(capsys, "doctor", "cache", "--target-model", targets["W8A8"], "--samples", "1")
    assert rc == 0, err
    assert "target quantisation: int8 W8A8 (compressed-tensors, int-quantized" in out
    rc, out, err = run_cli(capsys, "doctor", "cache", "--target-model", targets["bf16"], "--samples", "1")
    assert rc == 1
    assert "captured from a target quantised int8 W8A8 (compressed-tensors), this target is quantised none" in out
    bf16 = [
        "--target-model",
        targets["bf16"],
        "--cached-hidden-states",
        "cache",
        "--init",
        "init",
        "--out",
        "run2",
        "--batch-size",
        "2",
    ]
    rc, out, err = run_cli(capsys, "train", *bf16)
    assert rc == 2 and "int8 W8A8 (compressed-tensors), this target is quantised none (fp32)" in err


def test_a_mismatch_is_said_only_when_both_quantisations_are_known_and_differ():
    w8a8 = Quantisation("compressed-tensors", "int8 W8A8", "int-quantized", "int8 channel", "int8", 28, (), "bf16")
    none = Quantisation("none", "none", "", "bf16", "none", 0, (), "bf16")
    assert mismatch(w8a8, w8a8) is None and mismatch(None, none) is None and mismatch(w8a8, None) is None
    said = "captured from a target quantised int8 W8A8 (compressed-tensors), this target is quantised none (bf16)"
    assert mismatch(w8a8, none) == said
    assert Quantisation.from_record(w8a8.record()) == w8a8
