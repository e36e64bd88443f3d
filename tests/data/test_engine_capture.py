"""States captured by the engine are checked before they are cached: the planted faults of the field (all-zero
states, a layer off by one, short states, NaN, other tokens) are each refused in one line naming sample and layer,
and good states pass. The engine itself is stood in for by files written as its connector writes them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from flashdraft.data.completions import CompletionRecord
from flashdraft.data.engine_capture import PROBE, aux_layer_ids, probe_tokens, verify_capture
from flashdraft.errors import FlashdraftError
from tests.conftest import make_target

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


@pytest.mark.parametrize("fault, message", [
    ("zeros", r"sample r0 layer 2: captured states are all zero"),
    ("short", r"sample r0: 7 captured states for 8 tokens"),
    ("nan", r"sample r0 layer 0: captured states are NaN/Inf"),
    ("tokens", r"sample r0: the engine's token ids differ from the sample's at position 0"),
    ("shifted", r"sample known-answer-probe layer 0: the captured states are layer 1's .*off by one"),
])  # fmt: skip
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
