"""Where a completion's reasoning segment is, found in its text whatever the tokenizer makes of the markers.

Two ways of writing reasoning are known (reference doc sections 13 and 15): Qwen3.x, GLM-4.x, DeepSeek-R1 and
Nemotron write `<think>` ... `</think>` (single tokens in their tokenizers, plain text in others); gpt-oss writes
the harmony format, its reasoning in the analysis channel (`<|channel|>analysis<|message|>` ... `<|end|>`) and its
answer in the final channel. Which one a target writes is read from its chat template. The markers are found in
the tokens' text (`convert_ids_to_tokens` joined: the markers hold no space, so byte-level and sentencepiece pieces
spell them as they are), so a marker split over several tokens is found as well as a single one.

A completion is in its reasoning from its first token when the rendered prompt leaves a reasoning block open (the
generation prompt of a thinking template) or when it opens one itself; its reasoning ends at the token that
completes the end marker (that token included), or is "not closed" when it stops first.
"""

from __future__ import annotations

from dataclasses import dataclass

NOT_CLOSED = "not closed"  # a completion that stopped inside its reasoning


@dataclass(frozen=True)
class ReasoningStyle:
    name: str
    start: str  # the text that opens a reasoning segment
    end: str  # the text that closes it


THINK = ReasoningStyle("think", "<think>", "</think>")
HARMONY = ReasoningStyle("harmony analysis channel", "<|channel|>analysis<|message|>", "<|end|>")


@dataclass(frozen=True)
class ReasoningMarkers:
    """A target's reasoning style and its tokenizer, which spells the tokens out."""

    style: ReasoningStyle
    tokenizer: object

    def text(self, ids: list[int]) -> tuple[str, list[int]]:
        """The ids' text and, per character, the index of the token it comes from."""
        pieces = self.tokenizer.convert_ids_to_tokens(list(ids))
        owners = [k for k, piece in enumerate(pieces) for _ in (piece or "")]
        return "".join(piece or "" for piece in pieces), owners


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return " ".join(template.values()) if isinstance(template, dict) else str(template)


def reasoning_markers(tokenizer) -> ReasoningMarkers | None:
    """How the target writes reasoning, read from its chat template (and, without one, from a tokenizer that holds
    `<think>` and `</think>`); None where it writes none flashdraft knows (`unknown_reasoning_note` says so)."""
    template = template_text(tokenizer)
    if "<|channel|>" in template and "analysis" in template:
        return ReasoningMarkers(HARMONY, tokenizer)
    vocab = tokenizer.get_vocab()
    if THINK.start in template or (THINK.start in vocab and THINK.end in vocab):
        return ReasoningMarkers(THINK, tokenizer)
    return None


def unknown_reasoning_note(tokenizer) -> str | None:
    """One line where the chat template reads a thinking switch but writes no reasoning markers flashdraft knows:
    its records get no reasoning segment, which is not the same as none."""
    template = template_text(tokenizer)
    if reasoning_markers(tokenizer) is None and ("enable_thinking" in template or "reasoning" in template):
        return (
            "the chat template has a thinking mode but writes its reasoning with markers flashdraft does not know "
            f"(known: {THINK.start} ... {THINK.end}, gpt-oss's {HARMONY.start}); reasoning is not told apart from "
            "the answer"
        )
    return None


def reasoning_end(
    prompt_ids: list[int], completion_ids: list[int], markers: ReasoningMarkers | None
) -> int | str | None:
    """The index in `completion_ids` of the token that ends its reasoning, NOT_CLOSED when it stops inside its
    reasoning, None when it has no reasoning segment."""
    if markers is None:
        return None
    style = markers.style
    completion, owners = markers.text(completion_ids)
    opened = _open_in(markers, prompt_ids) or style.start in completion
    end = completion.find(style.end, max(completion.find(style.start), 0))
    if opened and end >= 0:
        return owners[end + len(style.end) - 1]
    return NOT_CLOSED if opened else None


def _open_in(markers: ReasoningMarkers, prompt_ids: list[int]) -> bool:
    """Whether the prompt leaves a reasoning block open (the generation prompt of a thinking template)."""
    prompt, _ = markers.text(prompt_ids)
    return markers.style.start in prompt and prompt.rfind(markers.style.start) > prompt.rfind(markers.style.end)


def closed_in_prompt(markers: ReasoningMarkers | None, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends in a closed, empty-or-not reasoning block (a thinking template in thinking-off mode:
    `<think></think>` as the generation prompt): every completion token is then answer."""
    if markers is None:
        return False
    prompt, owners = markers.text(prompt_ids)
    end = prompt.rfind(markers.style.end)
    if end < 0 or prompt.rfind(markers.style.start) >= end:
        return False
    # what follows the marker, decoded: token pieces spell whitespace their own way (byte-level `ĊĊ` is "\n\n",
    # sentencepiece `▁` a space), so the pieces' text is blank only once decoded; the marker's own token first
    after = end + len(markers.style.end)
    last = owners[after - 1]
    in_marker_token = "".join(c for c, owner in zip(prompt[after:], owners[after:], strict=True) if owner == last)
    return not in_marker_token.strip() and not markers.tokenizer.decode(list(prompt_ids[last + 1 :])).strip()


def reasoning_tokens(end: int | str | None, completion_length: int) -> int | None:
    """How many of a completion's first tokens are its reasoning (None: no reasoning segment)."""
    if end is None:
        return None
    return completion_length if end == NOT_CLOSED else int(end) + 1


# -- tool calls ----------------------------------------------------------------------------------------------------

QWEN_TOOL_CALL = ReasoningStyle("<tool_call>", "<tool_call>", "</tool_call>")  # Qwen3, GLM's Hermes-style calls
HARMONY_TOOL_CALL = ReasoningStyle("harmony commentary channel", "<|channel|>commentary", "<|call|>")


def tool_call_markers(tokenizer) -> ReasoningMarkers | None:
    """How the target writes a tool call, read from its chat template; None where flashdraft knows no marker."""
    template = template_text(tokenizer)
    if "<|channel|>" in template and "commentary" in template:
        return ReasoningMarkers(HARMONY_TOOL_CALL, tokenizer)
    if QWEN_TOOL_CALL.start in template:
        return ReasoningMarkers(QWEN_TOOL_CALL, tokenizer)
    return None


def tool_call_tokens(completion_ids: list[int], markers: ReasoningMarkers) -> set[int]:
    """The indices of a completion's tokens inside its tool calls, markers included (a call cut short: to the end)."""
    text, owners = markers.text(completion_ids)
    if markers.style == HARMONY_TOOL_CALL:
        return {owners[k] for start, stop in _harmony_calls(text) for k in range(start, stop)}
    inside: set[int] = set()
    start = text.find(markers.style.start)
    while start >= 0:
        end = text.find(markers.style.end, start + len(markers.style.start))
        stop = len(text) if end < 0 else end + len(markers.style.end)
        inside |= set(owners[start:stop])
        start = text.find(markers.style.start, stop) if end >= 0 else -1
    return inside


HARMONY_MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>")


def _harmony_calls(text: str) -> list[tuple[int, int]]:
    """Character ranges of a harmony completion's tool calls: the messages that end with `<|call|>` (a commentary
    message addressed `to=functions.NAME`, the address before or after its channel), and a last message cut short
    whose header (before `<|message|>`) has an address; a preamble on the commentary channel ends with `<|end|>`
    and is no call."""
    calls, start = [], 0
    while start < len(text):
        ends = [(text.find(e, start), e) for e in HARMONY_MESSAGE_ENDS if text.find(e, start) >= 0]
        if not ends:
            header = text[start:].split("<|message|>")[0]
            if " to=" in header or header.startswith("to="):
                calls.append((start, len(text)))
            break
        at, marker = min(ends)
        if marker == "<|call|>":
            calls.append((start, at + len(marker)))
        start = at + len(marker)
    return calls


def tool_call_spans(completion_ids: list[int], markers: ReasoningMarkers | None) -> list[list[int]] | None:
    """A completion's tool calls as [start, end) spans of its token indices (markers included); None where the
    template's tool-call markers are unknown or the completion calls no tool (what a record keeps)."""
    if markers is None:
        return None
    spans: list[list[int]] = []
    for k in sorted(tool_call_tokens(completion_ids, markers)):
        if spans and spans[-1][1] == k:
            spans[-1][1] = k + 1
        else:
            spans.append([k, k + 1])
    return spans or None


def check_tool_call_spans(value, completion_length: int) -> str | None:
    """Why a record's `tool_call_spans` is unusable, or None."""
    if value is None:
        return None
    ok = isinstance(value, list) and all(
        isinstance(s, list)
        and len(s) == 2
        and all(isinstance(k, int) and not isinstance(k, bool) for k in s)
        and 0 <= s[0] < s[1] <= completion_length
        for s in value
    )
    if not ok:
        return (
            f"tool_call_spans is {str(value)[:60]}; expected [start, end) pairs of token indices in "
            f"0..{completion_length}"
        )
    return None
