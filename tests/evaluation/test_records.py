"""A benchmark request's later turn is asked after the target's own answer, rendered in the record's chat mode."""

from flashdraft.data.prompts import Prompt, encode_text, render_conversation
from flashdraft.evaluation.records import EvalRecord, later_turn
from tests.conftest import make_chat_tokenizer


def test_a_later_turn_follows_the_targets_own_answer_and_the_last_turn_has_none():
    tok = make_chat_tokenizer()
    prompt = Prompt("q", ["t1 t2", "t3"], meta={"category": "math", "split": "qualitative"})
    first = EvalRecord(
        "q/turn1",
        [1],
        [],
        chat_template_kwargs={"enable_thinking": False},
        meta=prompt.meta,
        request_id="q",
        conversation=prompt,
    )
    answer = tok("t7 t8", add_special_tokens=False)["input_ids"]
    second = later_turn(first, answer, tok)
    messages = [
        {"role": "user", "content": "t1 t2"},
        {"role": "assistant", "content": "t7 t8"},
        {"role": "user", "content": "t3"},
    ]
    assert (second.id, second.turn, second.request_id, second.meta) == ("q/turn2", 1, "q", prompt.meta)
    assert second.messages == messages and second.answers == ["t7 t8"]
    rendered = render_conversation(tok, messages, True, {"enable_thinking": False})
    assert second.prompt_ids == encode_text(tok, rendered, True)
    assert later_turn(second, answer, tok) is None
    assert later_turn(EvalRecord("p", [1], [2, 3]), answer, tok) is None  # no request: no later turn
