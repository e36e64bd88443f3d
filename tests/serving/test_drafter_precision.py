"""doctor --serving's precision lines: the drafter's exported dtype, a quantization_config that would make a server
quantise it, SGLang's rule beside a quantised target and vLLM's beside an fp16 one."""

from __future__ import annotations

from types import SimpleNamespace

from flashdraft.drafter.doctor_report import Checks
from flashdraft.serving.drafter_precision import UNQUANT_FLAG, check_drafter_precision
from flashdraft.target.quantisation import Quantisation

W8A8 = Quantisation("compressed-tensors", "int8 W8A8", "int-quantized", "int8 channel", "int8 token", 28, (), "bf16")
NONE = Quantisation("none", "none", "", "bf16", "none", 0, (), "bf16")


def precision(raw, target) -> Checks:
    checks = Checks(held=True)
    check_drafter_precision(raw, target, checks)
    return checks


def test_a_quantised_target_warns_of_sglangs_rule_and_names_the_flag_that_keeps_the_drafter_unquantised():
    checks = precision({"dtype": "bfloat16"}, SimpleNamespace(quantisation=W8A8, config=SimpleNamespace()))
    assert checks.passed == 1 and len(checks.warnings) == 1 and not checks.failures
    text = "\n".join(checks.held)
    assert (
        "SGLang quantises the drafter" in text
        and UNQUANT_FLAG in text
        and "vLLM loads this drafter unquantised" in text
    )


def test_an_unquantised_bf16_target_and_a_dtyped_drafter_pass_without_warnings():
    checks = precision(
        {"dtype": "bfloat16"}, SimpleNamespace(quantisation=NONE, config=SimpleNamespace(dtype="bfloat16"))
    )
    assert (checks.passed, checks.warnings, checks.failures) == (1, [], [])


def test_a_drafter_config_without_dtype_or_with_a_quantization_config_is_flagged():
    checks = precision({"quantization_config": {"quant_method": "fp8"}}, None)
    assert len(checks.failures) == 1 and "dtype None" in checks.failures[0]
    assert len(checks.warnings) == 1 and "both servers quantise the drafter" in checks.warnings[0]


def test_an_fp16_target_warns_that_vllm_runs_the_drafter_in_fp16():
    checks = precision(
        {"dtype": "bfloat16"}, SimpleNamespace(quantisation=NONE, config=SimpleNamespace(dtype="float16"))
    )
    assert len(checks.warnings) == 1 and "runs the drafter in the target's dtype" in checks.warnings[0]
