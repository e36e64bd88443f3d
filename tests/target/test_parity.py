import inspect
import re

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

from flashdraft.errors import FlashdraftError
from flashdraft.target.parity import force_backend, print_parity, run_parity
from tests.conftest import make_target
from tests.data.conftest import run_cli, save_target

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], list(range(20, 60))]


def test_torch_chunked_and_recurrent_agree_and_fla_is_reported_as_not_run(capsys):
    target = make_target("hybrid")
    result = run_parity(target, PROMPTS)
    assert result.reference == "torch_chunk" and result.layer_ids == [0, 1, 2, 3]
    assert list(result.min_cosine) == ["torch_recurrent"] and result.passed
    assert all(c > 0.99999 for c in result.min_cosine["torch_recurrent"])
    assert "fla" in result.skipped  # not installed, or no GPU here
    print_parity(result, len(PROMPTS), sum(map(len, PROMPTS)))
    out = capsys.readouterr().out
    assert "not compared: fla (" in out and "PASS: minimum cosine" in out and "torch_chunk vs torch_recurrent" in out


def test_force_backend_routes_prompt_forwards_through_the_chosen_function_and_restores(monkeypatch):
    target = make_target("hybrid")
    calls = []
    raw_recurrent = inspect.unwrap(qwen3_5.torch_recurrent_gated_delta_rule)

    def spy(*args, **kwargs):
        calls.append(args[0].shape[1])  # sequence length
        return raw_recurrent(*args, **kwargs)

    saved = (qwen3_5.torch_chunk_gated_delta_rule, qwen3_5.torch_recurrent_gated_delta_rule)
    monkeypatch.setattr(qwen3_5, "torch_recurrent_gated_delta_rule", spy)  # unwrap() stops at the spy
    with force_backend(target, "torch_recurrent"):
        target.forward(torch.tensor([PROMPTS[0]]))
    assert calls == [8, 8]  # both linear layers ran the whole prompt through the recurrent function
    calls.clear()
    with force_backend(target, "torch_chunk"):
        target.forward(torch.tensor([PROMPTS[0]]))
    assert calls == []
    assert (qwen3_5.torch_chunk_gated_delta_rule, qwen3_5.torch_recurrent_gated_delta_rule) == (saved[0], spy)
    with pytest.raises(FlashdraftError, match="backend fla: fla"):
        with force_backend(target, "fla"):
            pass


def test_drift_below_the_threshold_fails_with_exit_1(tmp_path, monkeypatch, capsys):
    raw_recurrent = inspect.unwrap(qwen3_5.torch_recurrent_gated_delta_rule)

    def drifting(*args, **kwargs):
        out, state = raw_recurrent(*args, **kwargs)
        return out + 0.05 * torch.randn_like(out), state

    monkeypatch.setattr(qwen3_5, "torch_recurrent_gated_delta_rule", drifting)
    target_dir = save_target(tmp_path / "t", "hybrid")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t1 t2 t3 t4 t5"}\n{"prompt": "t9 t8 t7"}\n')
    torch.manual_seed(0)
    assert run_cli(["parity", "--target-model", str(target_dir), "--prompts", str(prompts), "--layers", "1,3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: minimum cosine" in out and "threshold 0.9999" in out
    assert re.findall(r"^ +(\d+) +[\d.]+ <$", out, re.MULTILINE) == ["1", "3"]  # one row per layer, flagged
    assert run_cli(["parity", "--target-model", str(target_dir), "--prompts", str(prompts), "--threshold", "0.5"]) == 0


def test_a_target_without_linear_attention_has_nothing_to_compare(capsys):
    result = run_parity(make_target("qwen3"), PROMPTS)
    assert result.reference is None and result.passed
    print_parity(result, 3, 10)
    assert "no linear-attention layers" in capsys.readouterr().out


def test_mamba_targets_compare_the_chunked_scan_with_the_per_token_recurrence_and_say_mamba_ssm_did_not_run(capsys):
    from tests.target.tiny_families import make_family_target

    result = run_parity(make_family_target("nemotron_h"), PROMPTS)
    assert result.reference == "torch_chunk" and list(result.min_cosine) == ["torch_recurrent"] and result.passed
    assert "mamba_ssm" in result.skipped and "not fla's" in result.skipped["mamba_ssm"]
    print_parity(result, len(PROMPTS), sum(map(len, PROMPTS)))
    assert "not compared: mamba_ssm (" in capsys.readouterr().out
