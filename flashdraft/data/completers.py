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
from flashdraft.data.images import message_images
from flashdraft.data.openai_client import OpenAIClient
from flashdraft.data.prompts import (
    Prompt,
    encode_text,
    fit_prompt,
    prompt_token_limit,
    render_conversation,
)
from flashdraft.data.reasoning import reasoning_end, reasoning_markers, tool_call_markers, tool_call_spans
from flashdraft.decoding.batched import CompiledBatch, generate_batch
from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.decoding.verification import check_static
from flashdraft.errors import FlashdraftError
from flashdraft.target.image_files import ENGINE_WITHOUT_IMAGES, check_target_reads_images, open_image
from flashdraft.target.model import TargetModel
from flashdraft.target.static_cache import CompileCounts
from flashdraft.target.vision import position_runs


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
    images_of: dict[str, dict] = {}  # record id -> its images and served positions (a vision-language target's)
    for turn in range(max(len(p.turns) for p in batch)):
        active, texts, prompt_ids = [], [], []
        for p in batch:
            if len(p.turns) <= turn or p.id in dropped:
                continue
            kwargs = merged(settings.chat_template_kwargs, p.chat_template_kwargs) if use_template else None
            where = f"prompt {p.record_id(turn)!r}"
            conversation = p.conversation(answers[p.id])
            text = render_conversation(tok, conversation, use_template, kwargs, p.tools, where)
            ids = _turn_ids(target, text, conversation, use_template, p.record_id(turn), complete, images_of)
            if len(ids) < settings.min_prompt_tokens:
                short.add(p.record_id(turn))
                if turn == len(p.turns) - 1:  # no later turn reads its answer: not answered at all
                    stats["shorter"] = stats.get("shorter", 0) + 1
                    continue
            fitted = fit_prompt(p.record_id(turn), ids, limit, settings.long_prompts, stats, settings.prompts)
            if fitted is None:
                dropped.add(p.id)
                continue
            _refuse_cut_images(len(fitted) < len(ids) and p.record_id(turn) in images_of, where, len(ids), limit)
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
            mode |= images_of.get(rid, {})  # its images and the drafter's served positions
            records[p.id].append(
                CompletionRecord(rid, text, ids, out, completion, reason, source, truncated_from.get(rid), **mode)
            )
            answers[p.id].append(completion)
    stats["shorter"] = stats.get("shorter", 0) + sum(r.id in short for p in batch for r in records[p.id])
    return [r for p in batch for r in records[p.id] if r.id not in short]


def _turn_ids(
    target: TargetModel, text: str, conversation: list, use_template: bool, rid: str, complete, images_of: dict
) -> list[int]:
    """A rendered turn's token ids: with its images' placeholders as the target's processor expands them (their
    record fields into `images_of[rid]`), else the text's; a turn of no tokens refused."""
    sources = message_images(conversation)
    if not sources:
        ids = encode_text(target.tokenizer, text, use_template)
    else:
        ids, images_of[rid] = _encode_with_images(target, text, sources, f"prompt {rid!r}", complete)
    if not ids:
        raise FlashdraftError(f"prompt {rid!r}: encodes to no tokens; expected a non-empty prompt")
    return ids


def _refuse_cut_images(cut: bool, where: str, length: int, limit: int | None) -> None:
    if cut:
        raise FlashdraftError(
            f"{where}: {length} tokens with its images, over the limit of {limit}; a prompt with images is not "
            f"truncated (its placeholders would be cut), expected --long-prompts error or skip"
        )


def _encode_with_images(target: TargetModel, text: str, sources: list[str], where: str, complete):
    """A rendered prompt's ids with its images' placeholders, and the record's fields for them (its images and the
    drafter's served positions where not the index); the images' inputs go to `complete` (only a local completer
    takes them: a server is sent token ids)."""
    check_target_reads_images(target, True, where)
    images_of = getattr(complete, "images_of", None)
    if images_of is None:
        raise FlashdraftError(f"{where}: has images; {ENGINE_WITHOUT_IMAGES}")
    ids, inputs = target.processor.encode(text, [open_image(s, where) for s in sources], where)
    images_of[where] = inputs
    runs = position_runs(target.vision.prompt_positions(ids, inputs.image_grid_thw))
    return ids, {"images": sources, "position_runs": runs if runs != [[0, 0, 1]] else None}


def local_completer(target: TargetModel, settings: GenerationSettings, compiled: CompiledBatch | None = None):
    """Text prompts decoded in batches; a prompt with images (its inputs in `complete.images_of`, by `where`) alone,
    with its images bound (greedy output equal to the batch's, `flashdraft.decoding.batched`). `compiled`: the
    batches on the target's static cache, compiled once (`complete.compiled.counts`: what compiled); a target
    without a static rule is refused in one line."""
    if compiled is not None:
        check_static(target, compiled.backend)

    def generator(rid: str) -> torch.Generator:
        return torch.Generator(device=target.device).manual_seed(record_seed(settings.seed, rid))

    def complete(items: list[tuple[str, list[int]]]) -> list[tuple[list[int], str, str]]:
        results: dict[int, tuple[list[int], str, str]] = {}
        for k, (rid, ids) in enumerate(items):
            inputs = complete.images_of.pop(f"prompt {rid!r}", None)
            if inputs is not None:
                with target.images(ids, inputs, f"prompt {rid!r}"):
                    g = generator(rid) if settings.temperature > 0 else None
                    out = autoregressive_generate(target, ids, settings.max_new_tokens, settings.sampling, g)
                results[k] = (out.output_ids, out.stop_reason, "target")
        text = [k for k in range(len(items)) if k not in results]
        if text:
            generators = [generator(items[k][0]) for k in text] if settings.temperature > 0 else None
            outs = generate_batch(
                target,
                [items[k][1] for k in text],
                settings.max_new_tokens,
                settings.sampling,
                generators,
                compiled=compiled,
            )
            results |= {k: (ids, reason, "target") for k, (ids, reason) in zip(text, outs, strict=True)}
        return [results[k] for k in range(len(items))]

    complete.images_of = {}
    complete.compiled = compiled
    return complete


def describe_compiled(counts: CompileCounts) -> str:
    """One line: what the static step compiled (`generate --compile`), as `speculate` says it of its verify."""
    return (
        f"compiled (static cache): {counts.compiles} compiles in {counts.compile_seconds:.1f} s, "
        f"{counts.recompiles} recompiles, {counts.graph_breaks} graph breaks"
    )


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
