"""Long-context guards: the context a drafter is evaluated or served at, against the longest context it was
trained at (`trained_context_length`, which training records), its RoPE against the target's, and the context
tokens each of its layers reads per step there (reference doc section 10). `doctor --serving` and `eval` print
them.

Why the RoPE comparison warns only one way: the drafter rotates its own queries and keys by the target's absolute
positions, and nothing of the target's RoPE enters its attention. A target with rope scaling says it is served past
its original context, where a drafter without the same scaling sees positions its RoPE was never trained at. A
drafter with its own YaRN on a native long-context target is the two-stage recipe itself (SpecForge: YaRN on the
drafter, the target's addressable range as max_position_embeddings): a fact, not a warning. A different rope_theta
is allowed for the same reason (the drafter was trained with its own): said, not warned."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flashdraft.drafter.config import DrafterConfig
from flashdraft.drafter.positions import position_lines
from flashdraft.drafter.rope import describe_scaling, scaling_key, target_rope

RECIPE = (
    "train it further on long data: stage 2 of the long-context recipe, flashdraft train --init DRAFTER "
    '--rope-scaling \'{"rope_type": "yarn", ...}\' (docs/pipeline.md)'
)


@dataclass(frozen=True)
class Guard:
    """One line: "ok" (holds), "warn" (with its fix) or "note" (a fact)."""

    level: str
    line: str
    fix: str = ""

    def text(self) -> str:
        """The line as eval logs it."""
        return f"warning: {self.line}; fix: {self.fix}" if self.level == "warn" else self.line


def layer_reads(cfg: DrafterConfig, length: int) -> list[int]:
    """Context tokens each drafter layer reads per step at `length` tokens of context: all of them in a
    full-attention layer, at most its window in a sliding one."""
    return [length if a.window is None else min(a.window, length) for a in cfg.layer_attention]


def describe_layer_reads(cfg: DrafterConfig, length: int) -> str:
    """e.g. 'layers 0-3 (sliding 2048) 2048 each, layer 4 (full) 32768: 10240 per step in all'."""
    reads = layer_reads(cfg, length)
    runs: list[list[int]] = []  # [first, last, tokens, window]
    for i, (n, a) in enumerate(zip(reads, cfg.layer_attention, strict=True)):
        window = a.window or 0
        if runs and runs[-1][2:] == [n, window]:
            runs[-1][1] = i
        else:
            runs.append([i, i, n, window])
    parts = [
        (f"layer {first}" if first == last else f"layers {first}-{last}")
        + f" ({f'sliding {window}' if window else 'full'}) {n}"
        + (" each" if last > first else "")
        for first, last, n, window in runs
    ]
    return f"{', '.join(parts)}: {sum(reads)} per step in all"


def context_guards(cfg: DrafterConfig, length: int, what: str, target_config: Any = None) -> list[Guard]:
    """The guards for `cfg` used at `length` tokens of context (`what` says whose length it is), and with the
    target's transformers config its RoPE against the target's."""
    trained = cfg.trained_context_length
    if trained is None:
        guards = [
            Guard(
                "note",
                f"trained context: unknown (config.json has no trained_context_length: trained before "
                f"flashdraft recorded it, or elsewhere); {what}: {length} tokens",
            )
        ]
    elif length > trained:
        guards = [
            Guard(
                "warn",
                f"trained context: {what} is {length} tokens, past the {trained} tokens the drafter "
                f"was trained at (trained_context_length); acceptance falls past a drafter's trained "
                f"positions",
                f"{RECIPE}, or keep the context within {trained} tokens",
            )
        ]
    else:
        guards = [
            Guard("ok", f"trained context: {trained} tokens (trained_context_length) covers {what}, {length} tokens")
        ]
    if target_config is not None:
        guards += _rope_guards(cfg, target_config)
    guards.append(
        Guard(
            "note",
            f"context read per step at {length} tokens: {describe_layer_reads(cfg, length)} "
            f"(full-attention layers read all of it every step, sliding ones their window)",
        )
    )
    return guards


def _rope_guards(cfg: DrafterConfig, target_config: Any) -> list[Guard]:
    theta, scaling = target_rope(target_config)
    ours, theirs = describe_scaling(cfg.rope_scaling), describe_scaling(scaling)
    guards = []
    if scaling_key(cfg.rope_scaling) == scaling_key(scaling):
        guards.append(Guard("ok", f"rope scaling: the drafter's {ours} is the target's"))
    elif scaling is None:  # the recipe's stage 2: the drafter's own scaling on a native target
        guards.append(
            Guard(
                "note",
                f"rope scaling: the drafter's {ours}, the target's {theirs}: the drafter's own "
                f"scaling (stage 2 of the long-context recipe)",
            )
        )
    else:
        want = json.dumps(scaling)
        guards.append(
            Guard(
                "warn",
                f"rope scaling: the drafter's {ours} differs from the target's {theirs}: the "
                f"drafter rotates by the target's absolute positions, which its scaling was not "
                f"trained to cover",
                f"train stage 2 with --rope-scaling '{want}' on long data (docs/pipeline.md)",
            )
        )
    if theta is not None and theta != cfg.rope_theta:
        guards.append(
            Guard(
                "note",
                f"rope_theta: the drafter's {cfg.rope_theta:g}, the target's {theta:g}: allowed "
                f"(the drafter rotates its own queries and keys, as it was trained)",
            )
        )
    return guards


def serving_guards(cfg: DrafterConfig, target: Any = None, max_model_len: int | None = None) -> list[Guard]:
    """The guards at the context a server gives the drafter: `max_model_len` (vLLM --max-model-len, SGLang
    --context-length) when given, else the target's max_position_embeddings (the servers' default), else the
    drafter's own."""
    if max_model_len is not None:
        length, what = max_model_len, "the served context (--max-model-len)"
    elif target is not None and target.context_length is not None:
        length, what = target.context_length, "the served context (the target's max_position_embeddings)"
    else:
        length, what = cfg.max_position_embeddings, "the served context (the drafter's max_position_embeddings)"
    return context_guards(cfg, length, what, target.config if target is not None else None)


def eval_guards(drafters: list[tuple[str, Any]], target: Any, records: list, max_new_tokens: int | None) -> list[str]:
    """The guards' lines for each (label, drafter) of an eval at its longest record: prompt + completion (or
    `max_new_tokens` online where a record has none); the n-gram baseline has none."""
    if not records:
        return []
    length = max(len(r.prompt_ids) + (len(r.completion_ids) or max_new_tokens or 0) for r in records)
    lines = []
    for label, drafter in drafters:
        cfg = getattr(drafter, "config", None) or getattr(getattr(drafter, "drafter", None), "config", None)
        if isinstance(cfg, DrafterConfig):  # a hybrid's DFlash drafter included
            what = "the longest record evaluated (prompt + completion)"
            lines += [f"{label}: {g.text()}" for g in context_guards(cfg, length, what, target.config)]
    return lines + position_lines(drafters, target, records)  # trained at other positions than served
