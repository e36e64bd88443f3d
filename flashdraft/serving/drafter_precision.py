"""In which precision the servers run a drafter beside a quantised or fp16 target (`doctor --serving`).

Read from vLLM 0.32/0.33 (`vllm/config/speculative.py`) and SGLang 0.5.x (`sglang/srt/server_args.py`):
- vLLM builds the drafter's model config with `quantization=speculative_config["quantization"]` (unset: None, so
  only a `quantization_config` in the drafter's own config.json quantises it; MTP and DSpark heads shipped inside
  the target's checkpoint take the target's) and `dtype=` the target's: an fp16 target runs the drafter in fp16.
- SGLang sets `speculative_draft_model_quantization` to the target's `--quantization` when it is not given, so a
  target quantised on the command line (`--quantization fp8` on a bf16 checkpoint) quantises the drafter too;
  `--speculative-draft-model-quantization unquant` keeps it unquantised (sglang #35629). A checkpoint quantised on
  disk is detected per model, from each one's config.json.
"""

from __future__ import annotations

from typing import Any

UNQUANT_FLAG = "--speculative-draft-model-quantization unquant"


def check_drafter_precision(raw: dict[str, Any], target, checks) -> None:
    """The drafter's dtype as exported, whether its config would make a server quantise it, and what each server
    does beside this target (quantised, or fp16)."""
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    checks.check(
        dtype is not None,
        f"precision: config.json dtype {dtype!r} (the drafter's weights as exported)",
        "re-export with flashdraft export (it writes the weights' dtype)",
    )
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        checks.warn(
            f"precision: config.json carries a quantization_config ({method}): both servers quantise the drafter by it",
            "re-export with flashdraft export (a drafter trained unquantised is served unquantised)",
        )
    quantisation = getattr(target, "quantisation", None)
    if quantisation is not None and quantisation.quantised:
        checks.about(
            f"precision: the target is quantised {quantisation.scheme} ({quantisation.method}); vLLM loads this "
            f"drafter unquantised (speculative_config quantization unset: the drafter's own config.json decides, and "
            f"it has no quantization_config), in the target's --dtype"
        )
        checks.warn(
            "precision: SGLang quantises the drafter with the target's --quantization when the command gives one "
            "(speculative_draft_model_quantization defaults to it, sglang #35629); a drafter trained unquantised "
            "then loses τ",
            f"leave --quantization off for a checkpoint quantised on disk (SGLang detects it from the target's "
            f"config.json), or add {UNQUANT_FLAG}",
        )
    target_dtype = getattr(getattr(target, "config", None), "dtype", None) or getattr(
        getattr(target, "config", None), "torch_dtype", None
    )
    if str(target_dtype).removeprefix("torch.") in ("float16", "fp16"):
        checks.warn(
            "precision: the target is stored in float16: vLLM runs the drafter in the target's dtype, and hidden "
            "states past fp16's range (65504) overflow it (lmdeploy #4789)",
            "serve with --dtype bfloat16 (or check the states: flashdraft cache --dtype fp16 refuses an overflow)",
        )
