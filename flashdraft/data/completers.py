"""The completers of `flashdraft generate`: the target run locally in batches, or an OpenAI-compatible server.

Local generation is `flashdraft.decoding.batched.generate_batch` (left padding with an attention mask). A server
(vLLM, SGLang) gets the prompt's token ids. Each prompt's turns are answered in order, each turn's prompt rendered
with the earlier answers.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from flashdraft.data.chat_mode import (
    merged,
    template_sha256,
)
from flashdraft.data.completions import CompletionRecord, GenerationSettings, record_seed, request_meta
from flashdraft.data.openai_client import OpenAIClient
from flashdraft.data.prompts import (
    Prompt,
    encode_text,
    fit_prompt,
    prompt_token_limit,
    render_conversation,
)
from flashdraft.data.reasoning import reasoning_end, reasoning_markers, tool_call_markers, tool_call_spans
from flashdraft.decoding.batched import generate_batch
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel


def answer_turns(
    target: TargetModel,
    batch: list[Prompt],
    settings: GenerationSettings,
    complete: Callable[[list[tuple[str, list[int]]]], list[tuple[list[int], str, str]]],
    long_prompt_stats: dict[str, int] | None = None,
    check_render: Callable[[str, list, dict, list[int]], None] | None = None,
) -> list[CompletionRecord]:
    """Answer every turn of every prompt in the batch: turn k of all prompts that have it is
    one call of `complete` ([(record id, prompt ids)] -> [(completion ids, stop reason, source)]).
    A turn longer than the context (minus max_new_tokens) is refused, skipped with the prompt's
    later turns, or truncated, by `settings.long_prompts`; `long_prompt_stats` counts them. With a template, each
    turn is rendered with the prompt's kwargs and, when `check_render` is given (an engine), checked by it (record
    id, messages, kwargs, prompt ids) before it is sent."""
    tok, use_template = target.tokenizer, settings.chat_template
    markers, sha = (reasoning_markers(tok), template_sha256(tok)) if use_template else (None, None)
    calls = tool_call_markers(tok) if use_template else None
    limit = prompt_token_limit(target.context_length, settings.max_new_tokens)
    stats = long_prompt_stats if long_prompt_stats is not None else {}
    answers: dict[str, list[str]] = {p.id: [] for p in batch}
    records: dict[str, list[CompletionRecord]] = {p.id: [] for p in batch}
    dropped: set[str] = set()
    short: set[str] = set()  # record ids under settings.min_prompt_tokens: answered for context, not kept
    truncated_from: dict[str, int] = {}
    for turn in range(max(len(p.turns) for p in batch)):
        active, texts, prompt_ids = [], [], []
        for p in batch:
            if len(p.turns) <= turn or p.id in dropped:
                continue
            kwargs = merged(settings.chat_template_kwargs, p.chat_template_kwargs) if use_template else None
            where = f"prompt {p.record_id(turn)!r}"
            text = render_conversation(tok, p.conversation(answers[p.id]), use_template, kwargs, p.tools, where)
            ids = encode_text(tok, text, use_template)
            if not ids:
                raise FlashdraftError(
                    f"prompt {p.record_id(turn)!r}: encodes to no tokens; expected a non-empty prompt"
                )
            if len(ids) < settings.min_prompt_tokens:
                short.add(p.record_id(turn))
                if turn == len(p.turns) - 1:  # no later turn reads its answer: not answered at all
                    stats["shorter"] = stats.get("shorter", 0) + 1
                    continue
            fitted = fit_prompt(p.record_id(turn), ids, limit, settings.long_prompts, stats, settings.prompts)
            if fitted is None:
                dropped.add(p.id)
                continue
            if len(fitted) < len(ids):  # the record's text is what the target saw: the kept tokens
                text = tok.decode(fitted)
                truncated_from[p.record_id(turn)] = len(ids)
            elif check_render is not None and use_template:
                check_render(p.record_id(turn), p.conversation(answers[p.id]), kwargs, fitted, p.tools)
            active.append(p)
            texts.append(text)
            prompt_ids.append(fitted)
        if not active:
            continue
        results = complete([(p.record_id(turn), ids) for p, ids in zip(active, prompt_ids, strict=True)])
        for p, text, ids, (out, reason, source) in zip(active, texts, prompt_ids, results, strict=True):
            completion = tok.decode(out, skip_special_tokens=True)
            rid = p.record_id(turn)
            mode = (
                {}
                if not use_template
                else {
                    "messages": p.conversation(answers[p.id]),
                    "chat_template_sha256": sha,
                    "chat_template_kwargs": merged(settings.chat_template_kwargs, p.chat_template_kwargs),
                    "reasoning_end": reasoning_end(ids, out, markers),
                    "tools": p.tools,
                    "tool_call_spans": tool_call_spans(out, calls),
                }
            )
            mode["meta"] = request_meta(p.meta, p.id, turn)  # a benchmark row's labels: figures by category
            records[p.id].append(
                CompletionRecord(rid, text, ids, out, completion, reason, source, truncated_from.get(rid), **mode)
            )
            answers[p.id].append(completion)
    stats["shorter"] = stats.get("shorter", 0) + sum(r.id in short for p in batch for r in records[p.id])
    return [r for p in batch for r in records[p.id] if r.id not in short]


def local_completer(target: TargetModel, settings: GenerationSettings):
    def complete(items: list[tuple[str, list[int]]]) -> list[tuple[list[int], str, str]]:
        generators = None
        if settings.temperature > 0:
            generators = [
                torch.Generator(device=target.device).manual_seed(record_seed(settings.seed, rid)) for rid, _ in items
            ]
        outs = generate_batch(target, [ids for _, ids in items], settings.max_new_tokens, settings.sampling, generators)
        return [(ids, reason, "target") for ids, reason in outs]

    return complete


# -- OpenAI-compatible server ------------------------------------------------------------


def openai_completer(target: TargetModel, settings: GenerationSettings, client: OpenAIClient, workers: int):
    stop_ids = target.stop_token_ids

    def one(item: tuple[str, list[int]]) -> tuple[list[int], str, str]:
        rid, prompt_ids = item
        choice = client.complete(
            prompt_ids,
            settings.max_new_tokens,
            settings.temperature,
            record_seed(settings.seed, rid),
            settings.sampling.filters.active(),
        )
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise FlashdraftError(f"record {rid!r}: server finish_reason is {finish!r}; expected 'stop' or 'length'")
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            source = "server"
        else:
            ids = list(target.tokenizer(choice.get("text") or "", add_special_tokens=False)["input_ids"])
            source = "retokenized"
        if finish == "stop" and stop_ids and (not ids or ids[-1] not in stop_ids):
            # servers leave the stop token out of the text: put it back, as local generation keeps it
            ids = ids + [stop_ids[0]]
        return ids, "eos" if finish == "stop" else "length", source

    def complete(items):
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(one, items))

    return complete
