"""flashdraft: train and evaluate DFlash drafters for speculative decoding.

The Python API (the command-line tool `flashdraft` is built on the same functions):

    import flashdraft
    from flashdraft import Drafter, Target, TrainConfig

    target = Target.from_pretrained("tiny")             # the built-in target, or a local HF directory
    drafter = Drafter.from_pretrained("tiny-drafter")   # a name, drafter directory, training run or .pt
    out = drafter.generate(target, "def add(a, b):", max_new_tokens=64)
    out.output_ids, out.acceptance_lengths, out.tau     # speculative decoding, lossless
    flashdraft.evaluate_drafter(drafter, target, prompts="builtin:code:heldout")  # eval --json's dict
    flashdraft.train_drafter(TrainConfig(max_steps=100), "tiny", "run", completions="train.json")

Target               a frozen target LM: from_pretrained, encode, generate (plain decoding)
Drafter              a DFlash drafter from any form: from_pretrained, generate (speculative)
GenerationResult     output ids and per-step acceptance lengths of one generation
TrainConfig          every training setting (the fields of `flashdraft train --config`)
evaluate_drafter     τ offline or online: the figures of `flashdraft eval --json`
train_drafter        `flashdraft train` from a TrainConfig
generate_completions `flashdraft generate`: the target's own completions of prompts
cache_hidden_states  `flashdraft cache`: the target's context features of completions
FlashdraftError      the one error type of user mistakes (the CLI exits 2 on it)

The names load on first use (`flashdraft.api`), so `import flashdraft` and the CLI stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "Drafter",
    "FlashdraftError",
    "GenerationResult",
    "Target",
    "TrainConfig",
    "cache_hidden_states",
    "evaluate_drafter",
    "generate_completions",
    "train_drafter",
]

if TYPE_CHECKING:
    from flashdraft.api import (
        Drafter,
        FlashdraftError,
        GenerationResult,
        Target,
        TrainConfig,
        cache_hidden_states,
        evaluate_drafter,
        generate_completions,
        train_drafter,
    )


def __getattr__(name: str) -> Any:
    # torch and transformers load with the first API name used, not with the package
    if name in __all__:
        from flashdraft import api

        return getattr(api, name)
    raise AttributeError(f"module 'flashdraft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
