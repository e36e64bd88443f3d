"""Run by the engine's Python (vLLM's own environment), never imported by flashdraft: which architectures of vLLM's
registry that generate text (its own text models, its multimodal ones, those it serves through transformers)
implement `SupportsEagle3`, the aux hidden-state capture a DFlash drafter reads.

    python flashdraft_vllm_support.py OUT.json

Writes {"version": vLLM's version, "architectures": {ARCH: true | false | "not loadable: ..."}}: each model class
loaded from the registry as vLLM loads it and asked `supports_eagle3`, as vLLM asks before serving a drafter.
"""

import json
import sys

import vllm
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.registry import (
    _MULTIMODAL_MODELS,
    _TEXT_GENERATION_MODELS,
    _TRANSFORMERS_SUPPORTED_MODELS,
    ModelRegistry,
)


def main() -> None:
    found = {}
    for arch in sorted({*_TEXT_GENERATION_MODELS, *_MULTIMODAL_MODELS, *_TRANSFORMERS_SUPPORTED_MODELS}):
        if arch not in ModelRegistry.models:
            continue
        try:
            model_cls = ModelRegistry.models[arch].load_model_cls()
            found[arch] = bool(supports_eagle3(model_cls))
        except Exception as e:  # a model whose module needs what this build lacks
            found[arch] = f"not loadable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    with open(sys.argv[1], "w") as f:
        json.dump({"version": vllm.__version__, "architectures": found}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
