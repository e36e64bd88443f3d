"""The chat mode of an evaluation (`data/chat_mode.py`): the mode mix of the records evaluated, τ by segment
(reasoning / answer) wherever records have a reasoning segment, and the warning when the records are in another
mode than the drafter was trained on (`trained_chat_mode`, which training writes into the drafter's config.json).

A step belongs to the segment of the first token it commits: the reasoning segment runs from the completion's
first token through its `</think>` (the whole completion when its reasoning is not closed), the answer after it.
Each segment's τ is the tokens its steps committed over its steps, and its token share those tokens over all.
"""

from __future__ import annotations

from typing import Any

from flashdraft.data.chat_mode import (
    describe_mix,
    mode_difference,
    mode_mix,
)
from flashdraft.data.reasoning import (
    closed_in_prompt,
    reasoning_end,
    reasoning_markers,
    reasoning_tokens,
    tool_call_markers,
    tool_call_tokens,
    unknown_reasoning_note,
)
from flashdraft.evaluation.records import EvalRecord
from flashdraft.evaluation.results import EvalResult
from flashdraft.serving.chat_mode import TRAINED_MODE


def walked_completion(result: EvalResult, record: EvalRecord, index: int) -> list[int]:
    """The tokens a result's walk committed for a record: its online output, else the record's completion."""
    output = result.per_prompt[index].output_ids if result.mode == "online" else None
    return list(output) if output else list(record.completion_ids)


def by_segment(result: EvalResult, records: list[EvalRecord], tokenizer) -> dict[str, Any] | None:
    """τ, steps, tokens and token share of the reasoning, the tool-call and the answer segments (None: no record has
    a reasoning segment, a tool call or a prompt in thinking-off mode). A step belongs to the segment of the first
    token it commits; tool calls are found where the template's markers are known, said where they are not and the
    records carry tools."""
    markers, calls = reasoning_markers(tokenizer), tool_call_markers(tokenizer)
    segments = {"reasoning": [0, 0], "tool_call": [0, 0], "answer": [0, 0]}  # [steps, tokens committed]
    found = False
    for k, (record, walked) in enumerate(zip(records, result.per_prompt, strict=True)):
        completion = walked_completion(result, record, k)
        reasoning = reasoning_tokens(reasoning_end(record.prompt_ids, completion, markers), len(completion))
        in_call = tool_call_tokens(completion, calls) if calls is not None else set()
        # thinking off (the prompt closes an empty reasoning block): a segmented record, all of it answer
        found |= reasoning is not None or bool(in_call) or closed_in_prompt(markers, record.prompt_ids)
        start = 0
        for n in walked.acceptance_lengths:
            name = "tool_call" if start in in_call else "reasoning" if start < (reasoning or 0) else "answer"
            segments[name][0] += 1
            segments[name][1] += n
            start += n
    if not found:
        return None
    total = sum(tokens for _, tokens in segments.values())
    figures: dict[str, Any] = {
        name: {
            "tau": tokens / steps if steps else None,
            "steps": steps,
            "tokens": tokens,
            "token_share": tokens / total if total else None,
        }
        for name, (steps, tokens) in segments.items()
    }
    if calls is None:
        del figures["tool_call"]
        if any(r.tools for r in records):
            figures["tool_call_note"] = "the chat template's tool-call markers are unknown: tool calls not told apart"
    return figures


def evaluated_mode(records: list[EvalRecord], tokenizer) -> dict[str, Any] | None:
    """The mode mix of the records evaluated (`chat_mode.mode_mix`), their reasoning found in their tokens."""
    markers = reasoning_markers(tokenizer)
    return mode_mix(
        [
            {
                "chat_template_kwargs": r.chat_template_kwargs,
                "completion_ids": r.completion_ids,
                "reasoning_end": reasoning_end(r.prompt_ids, r.completion_ids, markers),
            }
            for r in records
        ]
    )


def trained_mode(drafter) -> dict[str, Any] | None:
    """The mode mix a drafter (a hybrid's DFlash drafter) was trained on, where training recorded it."""
    drafter = getattr(drafter, "drafter", drafter)
    config = getattr(drafter, "config", None)
    return getattr(config, "extra", {}).get(TRAINED_MODE) if config is not None else None


def mode_figures(drafter, records: list[EvalRecord], tokenizer, log) -> dict[str, Any]:
    """The summary's `chat_mode` (the records') and `trained_chat_mode` (the drafter's), the warning logged when
    they differ."""
    evaluated, trained = evaluated_mode(records, tokenizer), trained_mode(drafter)
    if evaluated is not None:
        log(f"chat mode of the records: {describe_mix(evaluated)}")
        if unknown_reasoning_note(tokenizer):
            log(f"note: {unknown_reasoning_note(tokenizer)}")
    note = mode_difference(trained, evaluated)
    if note:
        log(f"warning: {note}")
    return {"chat_mode": evaluated, TRAINED_MODE: trained, "chat_mode_warning": note}


def segment_line(segments: dict[str, Any] | None) -> str | None:
    """One line of τ by segment for the terminal and the report."""
    if not segments:
        return None
    parts = []
    for name, s in segments.items():
        if not isinstance(s, dict):
            parts.append(s)  # a note: tool calls not told apart
            continue
        tau = "-" if s["tau"] is None else f"{s['tau']:.3f}"
        share = "-" if s["token_share"] is None else f"{s['token_share']:.0%}"
        parts.append(f"{name} τ {tau} over {s['steps']} steps ({share} of the tokens)")
    return "by segment: " + "; ".join(parts)
