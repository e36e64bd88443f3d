"""Evaluation records: a prompt, the target's completion, and the context features a drafter
reads (from a hidden-state cache, else from one target forward); where they come from
(a cache, a completions file, a prompt source) and which can be evaluated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel

Log = Callable[[str], None]


def quiet(_: str) -> None:
    """A `Log` that prints nothing."""


@dataclass
class EvalRecord:
    """A prompt and the target's completion, with context features when a cache holds them
    (as a tensor, or read only when needed through `load_features`: a cache can be large)."""

    id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    context_features: torch.Tensor | None = None  # [P + M, len(layer_ids) * H]
    layer_ids: list[int] = field(default_factory=list)  # target layers in the stored features, in order
    load_features: Callable[[], torch.Tensor] | None = None  # reads context_features on demand
    feature_dtype: torch.dtype | None = None  # the dtype a cache stores its features in (None: not from a cache)
    # rendered with a chat template (`data/chat_mode.py`): its kwargs ({}: the template's defaults) and messages
    chat_template_kwargs: dict | None = None
    messages: list[dict[str, str]] | None = None
    tools: list[dict] | None = None  # the tool schemas rendered with them
    # a benchmark's request (SPEED-Bench, `data/speed_bench.py`): its labels (category, split), the row it belongs
    # to, which of its turns this is, and, while turns remain, the prompt and the target's answers so far
    meta: dict | None = None
    request_id: str | None = None
    turn: int = 0
    conversation: Any = None  # data.prompts.Prompt whose later turns follow this one
    answers: list[str] = field(default_factory=list)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def stored_features(self) -> torch.Tensor | None:
        if self.context_features is not None:
            return self.context_features
        return self.load_features() if self.load_features is not None else None


def invalid_reason(record: EvalRecord, vocab_size: int) -> str | None:
    """Why a record cannot be evaluated, or None."""
    if not record.prompt_ids:
        return "empty prompt (the first anchor needs context before it)"
    if len(record.completion_ids) < 2:
        return f"completion has {len(record.completion_ids)} tokens; a step needs at least 2"
    bad = [t for t in record.input_ids if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} outside the target's vocabulary (0..{vocab_size - 1})"
    return None


def select_layers(features: torch.Tensor, held: list[int], wanted: list[int], hidden: int) -> torch.Tensor:
    """The columns of `features` ([T, len(held) * H], layers in `held` order) for `wanted`."""
    if held == wanted:
        return features
    parts = [features[:, held.index(i) * hidden : (held.index(i) + 1) * hidden] for i in wanted]
    return torch.cat(parts, dim=-1)


class FeatureSource:
    """Context features of a record for given target layers: sliced from the record's own
    (a cache) when they hold every layer, else from one target forward over prompt +
    completion. Logs each record's token count and feature statistics the first time."""

    def __init__(self, target: TargetModel, log: Log = quiet) -> None:
        self.target, self.log = target, log
        self.target_forwards = 0  # offline from a cache must leave this at 0
        self._logged: set[tuple[str, tuple[int, ...]]] = set()

    def __call__(self, record: EvalRecord, layer_ids: list[int]) -> torch.Tensor:
        hidden = self.target.hidden_size
        stored = record.stored_features() if record.layer_ids and set(layer_ids) <= set(record.layer_ids) else None
        if stored is not None:
            expected = [len(record.input_ids), len(record.layer_ids) * hidden]
            if list(stored.shape) != expected:
                raise FlashdraftError(
                    f"record {record.id}: stored context features have shape {list(stored.shape)}; expected "
                    f"{expected} ({len(record.input_ids)} tokens, {len(record.layer_ids)} layers x hidden {hidden})"
                )
            features, origin = select_layers(stored, record.layer_ids, layer_ids, hidden), "cache"
        else:
            self.target.set_context_layers(layer_ids)
            ids = torch.tensor([record.input_ids], device=self.target.device)
            features, origin = self.target.forward(ids).context_features[0], "target forward"
            self.target_forwards += 1
        key = (record.id, tuple(layer_ids))
        if key not in self._logged:
            self._logged.add(key)
            stats = features.float()
            if not torch.isfinite(stats).all():
                raise FlashdraftError(f"record {record.id}: context features for layers {layer_ids} contain NaN/Inf")
            self.log(
                f"record {record.id}: {len(record.prompt_ids)} prompt + {len(record.completion_ids)} completion "
                f"tokens, features {list(features.shape)} of layers {layer_ids} ({origin}) "
                f"mean {stats.mean():.4f} std {stats.std():.4f}"
            )
        return features


def records_from_cache(cache, num_records: int | None = None) -> list[EvalRecord]:
    """Records of a `flashdraft.data.cache_reader.HiddenStateCache`: listing them reads token ids only;
    each record reads its features when it is evaluated, so memory holds one record's at a time."""
    records = []
    ids, prompt_lengths = cache.ids, cache.prompt_lengths
    rows = cache.manifest.get("records") or []
    for index in range(len(cache) if num_records is None else min(len(cache), num_records)):
        tokens, p = cache.token_ids(index).tolist(), prompt_lengths[index]
        row = rows[index] if index < len(rows) else {}
        records.append(
            EvalRecord(
                str(ids[index]),
                tokens[:p],
                tokens[p:],
                layer_ids=list(cache.layer_ids),
                load_features=lambda index=index: cache.features(index),
                feature_dtype=cache.dtype,
                chat_template_kwargs=row.get("chat_template_kwargs"),
            )
        )
    return records


def load_eval_records(
    target: TargetModel,
    *,
    cached_hidden_states: str | None = None,
    completions: str | None = None,
    prompts: str | None = None,
    num_prompts: int | None = None,
    verify: bool = True,
    allow_foreign: bool = False,
    chat_template_kwargs: dict | None = None,
    enable_thinking: bool | None = None,
    log: Log = quiet,
) -> tuple[list[EvalRecord], str]:
    """Records from a hidden-state cache (its sha256 checked unless not `verify`), a completions
    file (another target's refused unless `allow_foreign`) or a prompt source (then without
    completions: the caller decodes them; rendered in the mode `chat_template_kwargs` / `enable_thinking` say,
    `data.chat_mode.resolve_mode`). Returns (records, source description). More than 8 parameters because it is the
    one reader of every record source, keyword-only, which `EvalConfig` and `BenchConfig` pass by name."""
    given = [x for x in (cached_hidden_states, completions, prompts) if x is not None]
    if len(given) != 1:
        raise FlashdraftError(
            "give exactly one record source: --cached-hidden-states DIR, --completions C.json or --prompts P "
            f"(found {len(given)})"
        )
    if (chat_template_kwargs is not None or enable_thinking is not None) and prompts is None:
        raise FlashdraftError(
            "--chat-template-kwargs, --enable-thinking and --disable-thinking render --prompts; "
            "completions and caches were rendered in the mode each record records"
        )
    if cached_hidden_states is not None:
        from flashdraft.data.cache_reader import HiddenStateCache

        cache = HiddenStateCache(cached_hidden_states, verify=verify)
        cache.check_compatible(target, cache.layer_ids)
        records = records_from_cache(cache, num_prompts)
        return records, f"hidden-state cache {cached_hidden_states} (layers {list(cache.layer_ids)})"
    if completions is not None:
        from flashdraft.data.completions import load_completions

        # prints the valid count and each skip
        loaded = load_completions(completions, target, allow_foreign=allow_foreign).records
        if num_prompts is not None:
            loaded = loaded[:num_prompts]
        records = [
            EvalRecord(
                str(r.id),
                list(r.prompt_ids),
                list(r.completion_ids),
                chat_template_kwargs=r.chat_template_kwargs,
                messages=r.messages if r.prompt_truncated_from is None else None,
                tools=r.tools,
            )
            for r in loaded
        ]
        return records, f"completions {completions}"
    return _records_of_prompts(target, prompts, num_prompts, chat_template_kwargs, enable_thinking, log)


def _records_of_prompts(
    target: TargetModel,
    prompts: str,
    num_prompts: int | None,
    chat_template_kwargs: dict | None,
    enable_thinking: bool | None,
    log: Log,
) -> tuple[list[EvalRecord], str]:
    """Records of a prompt source's first turns, rendered in the mode the options say (`load_eval_records`)."""
    from flashdraft.data.chat_mode import merged, resolve_mode
    from flashdraft.data.prompts import encode_text, has_chat_template, load_prompts, render_conversation

    tok = target.tokenizer
    chat = has_chat_template(tok)
    records = []
    loaded = load_prompts(prompts, num_prompts, quiet=True)
    kwargs = resolve_mode(tok, chat, chat_template_kwargs, enable_thinking, loaded, log)
    for prompt in loaded:
        # the first user turn: later turns need the target's earlier answers in the prompt; a benchmark's request
        # (SPEED-Bench) keeps its prompt so they follow (`later_turn`), as the peers ask them
        mode = merged(kwargs, prompt.chat_template_kwargs) if chat else None
        text = render_conversation(tok, prompt.conversation([]), chat, mode, prompt.tools, f"prompt {prompt.id!r}")
        request = prompt.meta is not None
        records.append(
            EvalRecord(
                prompt.record_id(0) if request else prompt.id,
                encode_text(tok, text, chat),
                [],
                chat_template_kwargs=mode,
                messages=prompt.conversation([]) if chat else None,
                tools=prompt.tools if chat else None,
                meta=prompt.meta,
                request_id=prompt.id if request else None,
                conversation=prompt if request and len(prompt.turns) > 1 else None,
            )
        )
    return records, f"prompts {prompts} ({'chat template' if chat else 'no chat template'})"


def fit_prompts(
    records: list[EvalRecord], target: TargetModel, max_new_tokens: int, policy: str, source: str, log: Log
) -> list[EvalRecord]:
    """Records still to be decoded (no completion) whose prompt leaves no room for
    `max_new_tokens` in the target's context: refused, skipped or truncated (`--long-prompts`)."""
    from flashdraft.data.prompts import describe_long_prompts, fit_prompt, prompt_token_limit

    if all(r.completion_ids for r in records):
        return records
    limit = prompt_token_limit(target.context_length, max_new_tokens)
    stats: dict[str, int] = {}
    kept = []
    for r in records:
        ids = r.prompt_ids if r.completion_ids else fit_prompt(r.id, r.prompt_ids, limit, policy, stats, source)
        if ids is not None:
            if len(ids) < len(r.prompt_ids):  # truncated: no longer what its messages render to
                r.messages = None
            r.prompt_ids = ids
            kept.append(r)
    note = describe_long_prompts(stats, limit)
    if note:
        log(f"{note} (--long-prompts {policy})")
    return kept


def later_turn(record: EvalRecord, answer_ids: list[int], tokenizer) -> EvalRecord | None:
    """The record of a request's next turn, asked after the target's own answer to this one (`answer_ids`, its
    output), rendered in the record's chat mode; None after its last turn or for a record of no request."""
    from flashdraft.data.prompts import encode_text, has_chat_template, render_conversation

    prompt = record.conversation
    if prompt is None or record.turn + 1 >= len(prompt.turns):
        return None
    chat = has_chat_template(tokenizer)
    answers = record.answers + [tokenizer.decode(answer_ids, skip_special_tokens=True)]
    messages = prompt.conversation(answers)
    turn = record.turn + 1
    where = f"prompt {prompt.record_id(turn)!r}"
    text = render_conversation(tokenizer, messages, chat, record.chat_template_kwargs, prompt.tools, where)
    return EvalRecord(
        prompt.record_id(turn),
        encode_text(tokenizer, text, chat),
        [],
        chat_template_kwargs=record.chat_template_kwargs,
        messages=messages if chat else None,
        tools=record.tools,
        meta=record.meta,
        request_id=record.request_id,
        turn=turn,
        conversation=prompt,
        answers=answers,
    )
