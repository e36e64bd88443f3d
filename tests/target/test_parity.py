import inspect
import re

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

from flashdraft.errors import FlashdraftError
from flashdraft.target.parity import force_backend, print_parity, run_parity
from tests.conftest import make_target
from tests.data.conftest import run_cli, save_target

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], list(range(20, 60))]  # the last also continues after a prefill
BOTH = (torch.float32, torch.bfloat16)


def _planted_gate(scale: float):
    """The recurrent kernel with its gate (log decay) scaled: a wrong kernel that is close to right."""
    raw_recurrent = inspect.unwrap(qwen3_5.torch_recurrent_gated_delta_rule)

    def planted(query, key, value, g, beta, *args, **kwargs):
        return raw_recurrent(query, key, value, g * scale, beta, *args, **kwargs)

    return planted


def test_the_torch_recurrent_backend_in_bf16_passes_against_the_fp32_reference_in_both_cases(capsys):
    target = make_target("hybrid")
    result = run_parity(target, PROMPTS, dtypes=BOTH)
    assert result.reference == "torch_chunk" and result.layer_ids == [0, 2]  # the linear layers
    assert result.passed and "fla" in result.skipped and target.dtype == torch.float32  # back in its dtype
    for case in ("prompt", "continuation"):
        fp32, bf16 = result.floors[case]["float32"], result.floors[case]["bfloat16"]
        assert all(f < 1e-5 for f in fp32) and all(1e-3 < f < 2e-2 for f in bf16)  # bf16 rounding is the floor
        errors = result.errors[case]["bfloat16"]["torch_recurrent"]
        assert all(e <= result.allowed(case, "bfloat16", j) for j, e in enumerate(errors))
        assert all(e > 1e-3 for e in errors)  # an fp32 threshold would have failed it: bf16's own error
    print_parity(result, len(PROMPTS), sum(map(len, PROMPTS)))
    out = capsys.readouterr().out
    assert "not compared: fla (" in out and "PASS: every backend" in out and "rule: relative error <= 2 x" in out
    assert len(re.findall(r"^(prompt|continuation) +(float32|bfloat16) +[02] ", out, re.MULTILINE)) == 8


def test_a_gate_off_by_five_percent_fails_in_bf16_and_fp32_for_prompts_and_continuations(monkeypatch):
    monkeypatch.setattr(qwen3_5, "torch_recurrent_gated_delta_rule", _planted_gate(1.05))
    result = run_parity(make_target("hybrid"), PROMPTS, dtypes=BOTH)
    failed = {(case, dtype) for case, dtype, backend, _ in result.failures() if backend == "torch_recurrent"}
    assert failed == {(c, d) for c in ("prompt", "continuation") for d in ("float32", "bfloat16")}
    assert not result.passed


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
    with force_backend(target, "torch_recurrent"):  # a cached block too: not flashdraft's short-block solve
        cache = target.new_cache()
        target.forward(torch.tensor([PROMPTS[0]]), cache)
        target.forward(torch.tensor([PROMPTS[1]]), cache)
    assert calls == [8, 8, 3, 3]
    assert all(mixer.short_block_path for mixer in target.linear_mixers.values())  # restored
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
    words = " ".join(f"t{i}" for i in range(1, 25))  # long enough to continue after a prefill
    prompts.write_text(f'{{"prompt": "t1 t2 t3 t4 t5"}}\n{{"prompt": "{words}"}}\n')
    torch.manual_seed(0)
    assert run_cli(["parity", "--target-model", str(target_dir), "--prompts", str(prompts), "--layers", "1,3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 8 errors over their allowance" in out
    # the linear layers up to layer 3 (0 and 2), each case and dtype, flagged
    flagged = re.findall(r"^(\w+) +\w+ +(\d+) .* <$", out, re.MULTILINE)
    assert flagged == [(case, layer) for case in ("prompt", "continuation") for _ in "ab" for layer in "02"]
    argv = ["parity", "--target-model", str(target_dir), "--prompts", str(prompts), "--dtypes", "fp32"]
    assert run_cli([*argv, "--error-floor", "100"]) == 0
    assert "float32" in capsys.readouterr().out


def test_a_target_without_linear_attention_has_nothing_to_compare(capsys):
    result = run_parity(make_target("qwen3"), PROMPTS)
    assert result.reference is None and result.passed
    print_parity(result, 3, 10)
    assert "no linear-attention layers" in capsys.readouterr().out


def test_mamba_targets_compare_the_chunked_scan_with_the_per_token_recurrence_and_say_mamba_ssm_did_not_run(capsys):
    from tests.target.tiny_families import make_family_target

    result = run_parity(make_family_target("nemotron_h"), PROMPTS)
    assert result.reference == "torch_chunk" and result.passed
    assert list(result.errors["continuation"]["float32"]) == ["torch_recurrent"]
    assert "mamba_ssm" in result.skipped and "not fla's" in result.skipped["mamba_ssm"]
    print_parity(result, len(PROMPTS), sum(map(len, PROMPTS)))
    assert "not compared: mamba_ssm (" in capsys.readouterr().out


def test_prompts_too_short_to_continue_after_a_prefill_leave_the_continuation_case_out_and_say_so(capsys):
    result = run_parity(make_target("hybrid"), PROMPTS[:2])  # 8 and 3 tokens; the target's own dtype
    assert list(result.errors) == ["prompt"] and result.dtypes == ["float32"] and result.passed
    print_parity(result, 2, 11)
    assert "not compared: continuation (no prompt longer than 17 tokens)" in capsys.readouterr().out
