"""Reasoning segments found in the text: `<think>` single tokens or split over several, gpt-oss's analysis
channel, and a template whose markers flashdraft does not know said, never counted as no reasoning."""

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from flashdraft.data.reasoning import (
    HARMONY,
    NOT_CLOSED,
    THINK,
    reasoning_end,
    reasoning_markers,
    reasoning_tokens,
    unknown_reasoning_note,
)
from tests.conftest import CHAT_WORDS, make_chat_tokenizer

THINK_ID, END_ID = CHAT_WORDS["<think>"], CHAT_WORDS["</think>"]


def characters_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A tokenizer of single characters: every marker is spelled over several tokens."""
    chars = sorted(set("<>/|_ abcdefghijklmnopqrstuvwxyz0123456789"))
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = template
    return fast


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_think_tokens_open_in_the_prompt_or_the_completion_and_close_at_the_end_token():
    markers = reasoning_markers(make_chat_tokenizer())
    assert markers.style == THINK
    assert reasoning_end([5, THINK_ID], [1, 2, END_ID, 3], markers) == 2
    assert reasoning_end([5, THINK_ID], [1, 2, 3], markers) == NOT_CLOSED  # opened by the generation prompt
    assert reasoning_end([5], [THINK_ID, 2, 3], markers) == NOT_CLOSED  # opened by the completion itself
    assert reasoning_end([5, THINK_ID, END_ID], [1, 2, 3], markers) is None  # thinking off: no reasoning segment
    assert reasoning_tokens(2, 4) == 3 and reasoning_tokens(NOT_CLOSED, 4) == 4 and reasoning_tokens(None, 4) is None


def test_think_markers_split_over_several_tokens_are_found_in_the_text():
    tok = characters_tokenizer("{{ messages }}<think>")
    markers = reasoning_markers(tok)
    assert markers is not None and markers.style == THINK
    prompt, completion = ids_of(tok, "user hi<think>"), ids_of(tok, "ab</think>cd")
    end = reasoning_end(prompt, completion, markers)
    assert end == len("ab</think>") - 1  # the token that completes the end marker
    assert reasoning_end(ids_of(tok, "user hi"), completion, markers) is None  # never opened: no reasoning


def test_gpt_oss_reasoning_is_its_analysis_channel_and_the_answer_its_final_channel():
    tok = characters_tokenizer("<|start|>{{ m }}<|channel|>analysis<|message|>{{ r }}<|end|><|channel|>final")
    markers = reasoning_markers(tok)
    assert markers.style == HARMONY
    prompt = ids_of(tok, "<|start|>user<|message|>hi<|end|><|start|>assistant")
    analysis = "<|channel|>analysis<|message|>think<|end|>"
    completion = ids_of(tok, analysis + "<|start|>assistant<|channel|>final<|message|>ok<|return|>")
    assert reasoning_end(prompt, completion, markers) == len(analysis) - 1
    assert reasoning_end(prompt, ids_of(tok, "<|channel|>final<|message|>ok<|end|>"), markers) is None
    assert reasoning_end(prompt, ids_of(tok, "<|channel|>analysis<|message|>th"), markers) == NOT_CLOSED


def test_a_thinking_template_with_unknown_markers_is_said_not_taken_for_no_reasoning():
    tok = characters_tokenizer("{% if enable_thinking %}<reason>{% endif %}")
    assert reasoning_markers(tok) is None
    assert "markers flashdraft does not know" in unknown_reasoning_note(tok)
    assert unknown_reasoning_note(make_chat_tokenizer()) is None  # <think>: known
    assert unknown_reasoning_note(characters_tokenizer("{{ messages }}")) is None  # no thinking mode at all


def test_tool_calls_are_found_by_the_templates_markers_qwens_and_gpt_oss_commentary_channel():
    from flashdraft.data.reasoning import tool_call_markers, tool_call_tokens

    tok = characters_tokenizer("{% for t in tools %}{{ t }}{% endfor %}<tool_call>")
    completion = ids_of(tok, "ab<tool_call>x</tool_call>cd<tool_call>y")
    inside = tool_call_tokens(completion, tool_call_markers(tok))
    first = len("ab")
    second = len("ab<tool_call>x</tool_call>cd")
    assert inside == set(range(first, second - 2)) | set(range(second, len(completion)))  # a cut call: to the end
    harmony = characters_tokenizer("<|channel|>commentary to=functions.x <|call|> <|channel|>analysis")
    assert tool_call_markers(harmony).style.start == "<|channel|>commentary"
    assert tool_call_markers(characters_tokenizer("{{ messages }}")) is None


def test_harmony_tool_calls_are_the_messages_ending_in_call_not_the_commentary_preambles():
    from flashdraft.data.reasoning import _harmony_calls

    analysis = "<|channel|>analysis<|message|>think<|end|>"
    preamble = "<|start|>assistant<|channel|>commentary<|message|>looking<|end|>"
    call = "<|start|>assistant<|channel|>commentary to=functions.grep <|constrain|>json<|message|>{}<|call|>"
    text = analysis + preamble + call
    assert _harmony_calls(text) == [(len(analysis + preamble), len(text))]
    addressed_first = " to=functions.grep<|channel|>commentary json<|message|>{}<|call|>"  # after <|start|>assistant
    assert _harmony_calls(addressed_first) == [(0, len(addressed_first))]
    cut = '<|channel|>commentary to=functions.grep <|constrain|>json<|message|>{"q'
    assert _harmony_calls(analysis + cut) == [(len(analysis), len(analysis + cut))]  # cut short: to the end
    assert _harmony_calls(analysis + "<|start|>assistant<|channel|>final<|message|>hi<|return|>") == []


def test_a_completions_tool_calls_are_kept_as_token_spans_where_the_markers_are_known():
    from flashdraft.data.reasoning import check_tool_call_spans, tool_call_markers, tool_call_spans

    tok = characters_tokenizer("{% for t in tools %}{{ t }}{% endfor %}<tool_call>")
    completion = ids_of(tok, "ab<tool_call>x</tool_call>cd<tool_call>y")
    second = len("ab<tool_call>x</tool_call>cd")
    spans = tool_call_spans(completion, tool_call_markers(tok))
    assert spans == [[2, second - 2], [second, len(completion)]]
    assert check_tool_call_spans(spans, len(completion)) is None
    assert "expected [start, end) pairs" in check_tool_call_spans([[3, 2]], len(completion))
    assert tool_call_spans(ids_of(tok, "abcd"), tool_call_markers(tok)) is None  # no call: nothing kept
    assert tool_call_spans(completion, None) is None  # markers unknown


def byte_level_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer as Qwen3's: whitespace spelled as byte pieces (`\\n\\n` is the piece `ĊĊ`), `<think>`
    and `</think>` added tokens."""
    from tokenizers import AddedToken, decoders

    pieces = ["ĊĊ", "Ċ", "<|im_start|>", "<|im_end|>", "user", "assistant", "hi", "ok"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)} | {"?": len(pieces)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = template
    return fast


# Qwen3's generation prompt: thinking off closes an empty block, followed by a blank line
QWEN3_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_thinking_off_on_a_byte_level_tokenizer_is_a_closed_block_though_its_blank_line_is_the_piece_cc():
    from flashdraft.data.reasoning import closed_in_prompt

    tok = byte_level_tokenizer(QWEN3_STYLE_TEMPLATE)
    markers = reasoning_markers(tok)
    messages = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    on = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    off_ids, on_ids = ids_of(tok, off), ids_of(tok, on)
    assert tok.convert_ids_to_tokens(off_ids)[-1] == "ĊĊ"  # the piece `str.strip()` does not see as blank
    assert closed_in_prompt(markers, off_ids)
    assert not closed_in_prompt(markers, on_ids)  # thinking on: no block in the prompt
    assert not closed_in_prompt(markers, off_ids + ids_of(tok, "ok"))  # text after the block: not the prompt's end
    from flashdraft.evaluation.modes import by_segment
    from flashdraft.evaluation.records import EvalRecord
    from flashdraft.evaluation.results import EvalResult, PromptResult

    walked = EvalResult("offline", 4, [1], 1, [PromptResult("a", [2, 1])])
    segments = by_segment(walked, [EvalRecord("a", off_ids, ids_of(tok, "okokok"))], tok)
    assert segments["answer"]["steps"] == 2 and segments["reasoning"]["steps"] == 0  # thinking off: all answer
