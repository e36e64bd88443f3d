"""The chat template's mode, end to end on a Qwen3-style thinking template written for the tests
(`tests.conftest.THINKING_TEMPLATE`): both modes rendered as transformers renders them with the kwargs, recorded per
record with the template's hash; multi-turn history as the template renders it (earlier reasoning dropped); a trace
cut inside its reasoning counted as not closed; a template that ignores its kwarg reported; and the engine's own
rendering equal to flashdraft's, a server started with another default refused. Content given as text parts: the
template's content format read as vLLM detects it, and the parts given to the template as vLLM gives them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from flashdraft.data.chat_mode import content_format, parse_kwargs, run_kwargs, template_messages
from flashdraft.data.prompts import encode_text, load_prompts, render_conversation
from flashdraft.data.reasoning import NOT_CLOSED, reasoning_end, reasoning_markers
from flashdraft.errors import FlashdraftError
from tests.conftest import CHAT_WORDS, PLAIN_TEMPLATE, make_chat_tokenizer, run_cli, save_chat_target
from tests.data.conftest import SERVED_TOOLS, TOOLS, TRACE

THINK, END = CHAT_WORDS["<think>"], CHAT_WORDS["</think>"]


def _prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _generate(capsys, tmp_path, target, prompts, *options, name="c.json"):
    rc, out, err = run_cli(
        capsys,
        "generate",
        "--target-model",
        target,
        "--prompts",
        prompts,
        "--out",
        tmp_path / name,
        "--max-new-tokens",
        "6",
        *options,
    )
    assert rc == 0, err
    return json.loads((tmp_path / name).read_text()), out


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    return save_chat_target(tmp_path_factory.mktemp("chat") / "target")


def test_both_modes_give_the_prompts_transformers_renders_with_the_kwargs_recorded_per_record(
    capsys, tmp_path, chat_target
):
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "t1 t2 t3"}])
    tok = make_chat_tokenizer()
    messages = [{"role": "user", "content": "t1 t2 t3"}]
    for options, kwargs in (
        ((), {}),
        (("--chat-template-kwargs", '{"enable_thinking": false}'), {"enable_thinking": False}),
        (("--enable-thinking",), {"enable_thinking": True}),
    ):
        data, out = _generate(capsys, tmp_path, chat_target, prompts, *options, name=f"{len(kwargs)}{options}.json")
        record = data["records"][0]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert record["prompt"] == text
        assert record["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
        assert record["chat_template_kwargs"] == kwargs and record["messages"] == messages
        assert len(record["chat_template_sha256"]) == 16
        assert data["generation"]["chat_template_kwargs"] == (kwargs or None)
        thinking = kwargs.get("enable_thinking", True)
        # thinking off: the template wrote the empty think block into the prompt; the completion is all answer
        assert record["prompt_ids"][-2:] == ([CHAT_WORDS["assistant"], THINK] if thinking else [THINK, END])
        expected = reasoning_end(record["prompt_ids"], record["completion_ids"], reasoning_markers(tok))
        assert record.get("reasoning_end") == expected and (expected is None) != thinking
        assert ("the template's defaults" in out) == (not kwargs)
        assert data["chat_mode"]["records_per_kwargs"] == [{"chat_template_kwargs": kwargs, "records": 1}]


def test_multi_turn_history_is_the_templates_rendering_with_earlier_reasoning_dropped(capsys, tmp_path, chat_target):
    history = [
        {"role": "user", "content": "t1"},
        {"role": "assistant", "content": "t7 t8 </think> t9"},
        {"role": "user", "content": "t2"},
    ]
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": "m", "messages": history}, {"id": "t", "turns": ["t3", "t4"]}])
    data, _ = _generate(capsys, tmp_path, chat_target, prompts)
    tok = make_chat_tokenizer()
    records = {r["id"]: r for r in data["records"]}
    assert (
        records["m"]["prompt"].split()
        == "<|im_start|> user t1 <|im_end|> <|im_start|> assistant t9 <|im_end|> "
        "<|im_start|> user t2 <|im_end|> <|im_start|> assistant <think>".split()
    )  # t7 t8: reasoning dropped
    first = records["t/turn1"]
    answer = tok.decode(first["completion_ids"], skip_special_tokens=True)
    second = [
        {"role": "user", "content": "t3"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "t4"},
    ]
    assert records["t/turn2"]["messages"] == second
    assert records["t/turn2"]["prompt"] == tok.apply_chat_template(second, add_generation_prompt=True, tokenize=False)


def test_a_trace_cut_inside_its_reasoning_is_not_closed_and_counted(capsys, tmp_path, chat_target):
    markers = reasoning_markers(make_chat_tokenizer())
    assert reasoning_end([5, THINK], [1, 2, END, 3], markers) == 2
    assert reasoning_end([5, THINK], [1, 2, 3], markers) == NOT_CLOSED  # opened by the generation prompt
    assert reasoning_end([5], [THINK, 2, 3], markers) == NOT_CLOSED  # opened by the completion itself
    assert reasoning_end([5, THINK, END], [1, 2, 3], markers) is None  # thinking off: no reasoning segment
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"t{i} t{i + 1}"} for i in range(3)])
    data, out = _generate(capsys, tmp_path, chat_target, prompts)
    cut = sum(r.get("reasoning_end") == NOT_CLOSED for r in data["records"])
    assert data["chat_mode"]["reasoning_not_closed"] == cut and cut >= 1
    assert f"{cut} not closed (stopped inside their reasoning" in out


def test_a_template_that_ignores_its_kwarg_is_reported_and_its_shorthand_refused(capsys, tmp_path):
    target = save_chat_target(tmp_path / "plain", PLAIN_TEMPLATE)
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "t1"}])
    data, out = _generate(capsys, tmp_path, target, prompts, "--chat-template-kwargs", '{"enable_thinking": false}')
    assert "warning: the chat template ignores enable_thinking" in out
    assert data["records"][0]["chat_template_kwargs"] == {"enable_thinking": False}  # recorded as asked
    rc, _, err = run_cli(
        capsys,
        "generate",
        "--target-model",
        target,
        "--prompts",
        prompts,
        "--out",
        tmp_path / "d.json",
        "--disable-thinking",
    )
    assert rc == 2 and "--disable-thinking: the chat template does not read enable_thinking" in err


def test_kwargs_that_are_no_object_or_that_flashdraft_sets_are_one_line_errors():
    with pytest.raises(FlashdraftError, match="not valid JSON"):
        parse_kwargs("{enable_thinking", "--chat-template-kwargs")
    with pytest.raises(FlashdraftError, match="expected a JSON object"):
        parse_kwargs("[1]", "--chat-template-kwargs")
    with pytest.raises(FlashdraftError, match="add_generation_prompt is set by flashdraft itself"):
        parse_kwargs({"add_generation_prompt": False}, "row 1")
    with pytest.raises(FlashdraftError, match="--enable-thinking contradicts --chat-template-kwargs"):
        run_kwargs('{"enable_thinking": false}', True)
    assert run_kwargs('{"reasoning_effort": "low"}', False) == {"reasoning_effort": "low", "enable_thinking": False}


# -- content given as text parts ----------------------------------------------------------------------------------

# a template that reads a message's content as OpenAI's list of parts (vLLM's "openai" content format), t60 after
# each part so that the parts stay visible in the prompt
PARTS_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|> {{ m.role }} {% for part in m.content %}{{ part.text }} t60 {% endfor %}"
    "<|im_end|> {% endfor -%}{%- if add_generation_prompt -%}<|im_start|> assistant {% endif -%}"
)
TWO_PARTS = [{"type": "text", "text": "t1 t2"}, {"type": "text", "text": "t3"}]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (PLAIN_TEMPLATE, "string"),
        (PARTS_TEMPLATE, "openai"),
        # through a variable named `content` (vLLM follows no other name set from it), and a macro's parameter
        (
            "{% for m in messages %}{% set content = m['content'] %}{% for p in content %}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{% endfor %}{% endfor %}", "string"),
        (
            "{% macro say(x) %}{% for p in x %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ say(m.content) }}{% endfor %}",
            "openai",
        ),
        # vLLM reads a key of the loop variable itself only, not through a filter
        ("{% for m in messages %}{% for p in (m | first)['content'] %}{{ p }}{% endfor %}{% endfor %}", "string"),
        # a loop into two names before the content loop: vLLM's detection gives up, its default is "string"
        (
            "{% for k, v in messages %}{% endfor %}"
            "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "string",
        ),
        ("{% for m in messages %}{{ m.content }", "string"),  # not a template Jinja parses
    ],
)
def test_the_content_format_is_read_from_the_template_as_vllm_detects_it(template, expected):
    assert content_format(SimpleNamespace(chat_template=template)) == expected
    named = SimpleNamespace(chat_template={"default": PLAIN_TEMPLATE, "tool_use": template})
    assert content_format(named, tools=TOOLS) == expected  # the template applied to a request with tools
    assert content_format(named) == "string"


def test_text_parts_reach_an_openai_format_template_part_by_part_and_one_part_renders_as_the_string(tmp_path):
    tok = make_chat_tokenizer(PARTS_TEMPLATE)
    rows = [
        {"id": "two", "messages": [{"role": "system", "content": "t5"}, {"role": "user", "content": TWO_PARTS}]},
        {"id": "one", "messages": [{"role": "system", "content": "t5"}, {"role": "user", "content": TWO_PARTS[:1]}]},
        {"id": "string", "messages": [{"role": "system", "content": "t5"}, {"role": "user", "content": "t1 t2"}]},
    ]
    prompts = load_prompts(str(_prompts(tmp_path / "p.jsonl", rows)), quiet=True)
    ids = {p.id: encode_text(tok, render_conversation(tok, p.conversation([]), True), True) for p in prompts}
    # a string content is one part, as vLLM passes it to an "openai" template; each part rendered on its own
    words = "<|im_start|> system t5 t60 <|im_end|> <|im_start|> user t1 t2 t60 t3 t60 <|im_end|> <|im_start|> assistant"
    assert tok.convert_ids_to_tokens(ids["two"]) == words.split()
    assert ids["one"] == ids["string"] and ids["one"] != ids["two"]
    # a tool result's text parts vLLM joins into a string even for an "openai" template
    assert template_messages([{"role": "tool", "content": TWO_PARTS}], "openai")[0]["content"] == "t1 t2\nt3"


# -- the engine's rendering ----------------------------------------------------------------------------------------


# a tool call and its result without ids (as many agent datasets store them), and text given as a list of parts
TRACE_WITHOUT_IDS = [
    TRACE[0],
    TRACE[1] | {"tool_calls": [{"function": TRACE[1]["tool_calls"][0]["function"]}]},
    {k: v for k, v in TRACE[2].items() if k != "tool_call_id"},
    *TRACE[3:],
]
PARTS_MESSAGE = {"role": "user", "content": [{"type": "text", "text": "t4"}]}


def test_rows_without_call_ids_or_with_text_parts_render_as_their_plain_forms_locally(capsys, tmp_path):
    target = save_chat_target(tmp_path / "target")
    prompts = _prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "c", "messages": TRACE, "tools": TOOLS},
            {"id": "d", "messages": TRACE_WITHOUT_IDS, "tools": TOOLS},
            {"id": "b", "prompt": "t4"},
            {"id": "e", "messages": [PARTS_MESSAGE]},
        ],
    )
    data, _ = _generate(capsys, tmp_path, target, prompts)
    ids = {r["id"]: r["prompt_ids"] for r in data["records"]}
    assert ids["d/step1"] == ids["c/step1"] and ids["d/step2"] == ids["c/step2"] and ids["e"] == ids["b"]


@pytest.mark.engine
def test_the_engines_render_equals_flashdrafts_and_a_server_with_another_default_is_refused(capsys, tmp_path):
    from flashdraft.data.chat_mode import check_engine_render
    from flashdraft.data.openai_client import OpenAIClient
    from flashdraft.serving.engine import VllmServer, engine_info, engine_python

    target = save_chat_target(tmp_path / "target", engine=True)
    prompts = _prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "turns": ["t1 t2", "t3"]},
            {"id": "b", "prompt": "t4", "chat_template_kwargs": {"enable_thinking": False}},
            {"id": "c", "messages": TRACE, "tools": TOOLS},  # an agent trace: two steps, the tools rendered
            {"id": "d", "messages": TRACE_WITHOUT_IDS, "tools": TOOLS},  # ids filled: vLLM requires them
            {"id": "e", "messages": [PARTS_MESSAGE], "chat_template_kwargs": {"enable_thinking": False}},
        ],
    )
    # generate --engine vllm: every prompt (both modes, the second turn's history) rendered by the engine too
    data, out = _generate(capsys, tmp_path, target, prompts, "--engine", "vllm", "--verify-share", "0.3")
    assert len(data["records"]) == 8 and "completions against the target" in out
    # the engine's tokens are the local target's greedy ones, recorded as the server's, with the engine named
    local, _ = _generate(capsys, tmp_path, target, prompts, name="local.json")
    assert [r["completion_ids"] for r in data["records"]] == [r["completion_ids"] for r in local["records"]]
    assert {r["token_source"] for r in data["records"]} == {"server"}
    assert data["generation"]["backend"] == "vllm" and data["generation"]["engine_version"].startswith("vllm")
    ids = {r["id"]: r["prompt_ids"] for r in data["records"]}
    assert ids["d/step1"] == ids["c/step1"] and ids["d/step2"] == ids["c/step2"] and ids["e"] == ids["b"]
    assert [r["tools"] for r in data["records"] if r["id"].startswith("c/")] == [SERVED_TOOLS, SERVED_TOOLS]
    python = engine_python()
    with VllmServer(
        python,
        str(target),
        tmp_path / "server.log",
        info=engine_info(python),
        # a request's own template trusted: an "openai"-format template served without another server start
        extra_args=["--default-chat-template-kwargs", '{"enable_thinking": false}', "--trust-request-chat-template"],
    ) as server:
        client, tok = OpenAIClient(server.base_url), make_chat_tokenizer()
        for r in data["records"]:  # the records' own kwargs sent: the server's default does not apply
            if r["chat_template_kwargs"]:
                check_engine_render(
                    client, "vllm", r["id"], r["messages"], r["chat_template_kwargs"], r["prompt_ids"], tok
                )
        record = data["records"][0]  # rendered with the template's default (thinking): the server thinks not
        with pytest.raises(
            FlashdraftError,
            match=r"record a/turn1: vllm renders its prompt \(the template's "
            r"defaults\) otherwise than flashdraft: first difference at token "
            r"8, the engine's 59 '</think>'",
        ):
            check_engine_render(client, "vllm", record["id"], record["messages"], {}, record["prompt_ids"], tok)
        # a row of two text parts through a template that loops over them: vLLM detects its "openai" format and
        # renders the prompt flashdraft renders
        parts_tok, messages = make_chat_tokenizer(PARTS_TEMPLATE), [{"role": "user", "content": TWO_PARTS}]
        body = {
            "model": client.model,
            "messages": messages,
            "add_generation_prompt": True,
            "chat_template": PARTS_TEMPLATE,
        }
        served = client._request("/tokenize", body, root=True)["tokens"]
        assert served == encode_text(parts_tok, render_conversation(parts_tok, messages, True), True)
