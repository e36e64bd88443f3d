"""Run by `make engine` in the engine's Python: vLLM's model-info cache filled for the architectures flashdraft
serves, in this one process.

On its first start with an architecture, vLLM inspects the model class in a subprocess of its own (to keep CUDA out of
the server's process), importing vLLM again: several seconds a server start, for every architecture, on a fresh
machine. Here the classes are inspected in one process and the results written where vLLM reads them
(`VLLM_CACHE_ROOT/modelinfos`, keyed by the model file's hash: a vLLM upgrade makes them stale, never wrong). Only a
speed-up: an architecture this vLLM lacks, or a registry it changed, is said and skipped; the exit code is 0.
"""

from __future__ import annotations

import sys

ARCHITECTURES = (
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "DFlashDraftModel",
    "ExtractHiddenStatesModel",
)


def main() -> None:
    try:
        from vllm.model_executor.models import registry
    except Exception as e:  # noqa: BLE001 - no vLLM here: nothing to warm
        print(f"vLLM model-info cache not warmed: {e}")
        return
    registry._run_in_subprocess = lambda fn: fn()  # this process is the subprocess vLLM would start
    warmed = []
    for arch in ARCHITECTURES:
        try:
            if registry.ModelRegistry._try_inspect_model_cls(arch) is not None:
                warmed.append(arch)
        except Exception as e:  # noqa: BLE001 - a registry vLLM changed: the server inspects at its start
            print(f"vLLM model info for {arch} not cached: {e}")
    print(f"vLLM model-info cache warmed for {len(warmed)} architectures: {', '.join(warmed)}")


if __name__ == "__main__":
    main()
    sys.exit(0)
