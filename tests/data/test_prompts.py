import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashdraft.data.prompts import encode_text, has_chat_template, load_prompts, render_conversation
from flashdraft.errors import FlashdraftError
from tests.conftest import make_tokenizer, run_cli, save_chat_target
from tests.data.conftest import CALL, SERVED_TOOLS, TOOLS, TRACE


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _compiles(source: str) -> bool:
    try:
        compile(source, "<prompt>", "exec")
        return True
    except SyntaxError:
        return False


def test_builtin_code_has_about_200_prompts_in_train_and_heldout_splits_that_never_overlap():
    train = load_prompts("builtin:code", quiet=True)
    heldout = load_prompts("builtin:code:heldout", quiet=True)
    assert len(train) + len(heldout) >= 190 and len(heldout) >= 20
    assert not {p.id for p in train} & {p.id for p in heldout}
    assert not {p.turns[0] for p in train} & {p.turns[0] for p in heldout}
    assert [p.id for p in load_prompts("builtin:code:train", quiet=True)] == [p.id for p in train]
    # code-completion prompts for a plain code LM: Python that ends where the model continues
    for p in train + heldout:
        assert len(p.turns) == 1 and p.turns[0].endswith("\n")
        assert any(_compiles(p.turns[0] + " " * indent + "pass\n") for indent in (4, 8, 12)), p.id
    assert load_prompts("builtin:code", num_prompts=3, quiet=True) == train[:3]


def test_jsonl_rows_with_prompt_messages_or_turns(tmp_path, capsys):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "t1 t2"},
            {
                "id": 7,
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "old answer"},
                ],
            },
            {"question_id": "mt-1", "turns": ["first", "second"]},
        ],
    )
    prompts = load_prompts(str(path))
    assert [p.id for p in prompts] == ["p000000", "7", "mt-1"]
    assert prompts[0].turns == ["t1 t2"] and prompts[0].prefix == []
    assert prompts[1].prefix == [{"role": "system", "content": "be brief"}] and prompts[1].turns == ["hi"]
    assert prompts[2].turns == ["first", "second"]
    assert prompts[2].record_id(1) == "mt-1/turn2" and prompts[0].record_id(0) == "p000000"
    assert prompts[2].conversation(["A1"]) == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "second"},
    ]
    out = capsys.readouterr().out
    assert "using 3 of 3 prompts" in out and "1 rows ended with an assistant reply" in out


@pytest.mark.parametrize(
    "row, message",
    [
        ({"text": "x"}, "no 'prompt', 'messages', 'conversations' or 'turns' field (found ['text'])"),
        ({"prompt": ""}, "field 'prompt' is ''"),
        ({"turns": "one"}, "field 'turns'"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "no user message"),
    ],
)
def test_bad_rows_are_errors_naming_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(FlashdraftError, match=r"p\.jsonl:2: ") as e:
        load_prompts(str(path))
    assert message in str(e.value)


def test_bad_json_duplicate_ids_unknown_builtin_and_missing_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(FlashdraftError, match=r"bad\.jsonl:2: not valid JSON"):
        load_prompts(str(bad))
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(FlashdraftError, match=r"dup\.jsonl:2: id 'a' repeats the id of .*dup\.jsonl:1"):
        load_prompts(str(dup))
    for spec in ("builtin:poems", "builtin:stdlib:0", "builtin:stdlib:many", "builtin:stdlib:heldout:3:4"):
        with pytest.raises(FlashdraftError, match="unknown built-in set"):
            load_prompts(spec)
    with pytest.raises(FlashdraftError, match="no such file"):
        load_prompts(str(tmp_path / "absent.jsonl"))


def test_parquet_file_and_saved_dataset_read_through_datasets(tmp_path):
    rows = {"id": ["a", "b"], "prompt": ["t1 t2", "t3"]}
    pq.write_table(pa.table(rows), tmp_path / "p.parquet")
    from_parquet = load_prompts(str(tmp_path / "p.parquet"), quiet=True)
    assert [(p.id, p.turns) for p in from_parquet] == [("a", ["t1 t2"]), ("b", ["t3"])]

    import datasets

    datasets.Dataset.from_dict({"turns": [["x", "y"]]}).save_to_disk(str(tmp_path / "saved"))
    saved = load_prompts(str(tmp_path / "saved"), quiet=True)
    assert saved[0].turns == ["x", "y"] and saved[0].id == "p000000"

    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(FlashdraftError, match=r"other\.parquet row 0: no 'prompt'"):
        load_prompts(str(tmp_path / "other.parquet"))


def test_chat_template_is_applied_only_where_the_tokenizer_has_one():
    tok = make_tokenizer()
    assert not has_chat_template(tok)
    messages = [
        {"role": "user", "content": "t1 t2"},
        {"role": "assistant", "content": "t3"},
        {"role": "user", "content": "t4"},
    ]
    # no template: a plain LM continues the text; an answer continues its prompt
    assert render_conversation(tok, messages, False) == "t1 t2t3\n\nt4"
    assert encode_text(tok, "t1 t2", False) == [1, 2]

    tok.chat_template = (
        "{% for m in messages %}t60 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t59{% endif %}"
    )
    assert has_chat_template(tok)
    text = render_conversation(tok, messages[:1], True)
    assert text == "t60 t1 t2 t59"
    assert encode_text(tok, text, True) == [60, 1, 2, 59]


# -- the field's formats: ShareGPT and role/content conversations, tools, agent traces --------------------------------

CONVERSATION = [("system", "be brief"), ("user", "t1 t2"), ("assistant", "t3"), ("user", "t4"), ("assistant", "t5")]
SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}


def test_sharegpt_and_role_content_conversations_read_as_the_equivalent_messages(tmp_path, capsys):
    messages = [{"role": r, "content": c} for r, c in CONVERSATION]
    rows = {
        "messages": {"id": "a", "messages": messages},
        "sharegpt": {"id": "a", "conversations": [{"from": SHAREGPT[r], "value": c} for r, c in CONVERSATION]},
        "role-content": {"id": "a", "conversations": messages},
    }
    read = {name: load_prompts(str(write_jsonl(tmp_path / f"{name}.jsonl", [row]))) for name, row in rows.items()}
    assert read["sharegpt"] == read["messages"] == read["role-content"]
    target, done = save_chat_target(tmp_path / "target"), {}
    for name in rows:  # the target's completions of each: the same prompt and completion ids
        out = tmp_path / f"{name}.json"
        argv = ["generate", "--target-model", target, "--prompts", tmp_path / f"{name}.jsonl", "--out", out]
        assert run_cli(capsys, *argv, "--max-new-tokens", "6")[0] == 0
        done[name] = [(r["prompt_ids"], r["completion_ids"]) for r in json.loads(out.read_text())["records"]]
    assert done["sharegpt"] == done["messages"] == done["role-content"]
    assert read["messages"][0].turns == ["t4"] and read["messages"][0].prefix == messages[:3]  # the reply removed
    table = pa.table({"id": ["a"], "conversations": [rows["sharegpt"]["conversations"]]})
    pq.write_table(table, tmp_path / "c.parquet")
    assert load_prompts(str(tmp_path / "c.parquet"), quiet=True) == read["messages"]
    with pytest.raises(FlashdraftError, match=r"conversations\[0\] is .*'from': one of human/"):
        load_prompts(str(write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "bot", "value": "x"}]}])))


def test_an_agent_trace_is_one_prompt_per_assistant_step_after_the_datas_messages_with_its_tools(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"id": "a", "messages": TRACE, "tools": json.dumps(TOOLS)}])
    steps = load_prompts(str(path), quiet=True)
    assert [p.id for p in steps] == ["a/step1", "a/step2"] and all(p.tools == SERVED_TOOLS for p in steps)
    assert steps[0].conversation([]) == TRACE[:1]  # the target writes the tool call
    # after the data's call (its arguments read as an object) and the tool's result (never invented)
    called = TRACE[1] | {"tool_calls": [CALL | {"function": {"name": "grep", "arguments": {"q": "t5", "n": 1}}}]}
    called |= {"reasoning": "t6"}  # as vLLM gives the template a turn's reasoning: under both names
    assert steps[1].conversation([]) == [TRACE[0], called, TRACE[2]]


TOOLS_TEMPLATE = (
    "{%- if tools -%}<|im_start|> system {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|> "
    "{%- endif -%}"
    "{%- for m in messages -%}<|im_start|> {{ m.role }} {{ m.content }}"
    "{%- for c in m.tool_calls or [] %} <tool_call> {{ c.function.name }} </tool_call>{% endfor %} <|im_end|> "
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|> assistant {% endif -%}"
)


def test_tools_and_tool_calls_render_as_transformers_apply_chat_template_with_tools(tmp_path):
    from tests.conftest import make_chat_tokenizer

    tok = make_chat_tokenizer(TOOLS_TEMPLATE)
    step = load_prompts(str(write_jsonl(tmp_path / "t.jsonl", [{"messages": TRACE, "tools": TOOLS}])), quiet=True)[1]
    text = render_conversation(tok, step.conversation([]), True, None, step.tools)
    messages = step.conversation([])
    assert text == tok.apply_chat_template(messages, tools=SERVED_TOOLS, add_generation_prompt=True, tokenize=False)
    assert "grep" in text.split("<|im_end|>")[0] and "<tool_call> grep </tool_call>" in text


def test_a_template_that_ignores_tools_or_tool_calls_while_rows_carry_them_is_said_in_one_line(tmp_path):
    from flashdraft.data.prompts import ignored_tools_note
    from tests.conftest import PLAIN_TEMPLATE, make_chat_tokenizer

    prompts = load_prompts(str(write_jsonl(tmp_path / "t.jsonl", [{"messages": TRACE, "tools": TOOLS}])), quiet=True)
    note = ignored_tools_note(make_chat_tokenizer(PLAIN_TEMPLATE), prompts, None)
    assert "ignores `tools` (2 of 2 prompts carry tool schemas) and `tool_calls` (1 prompts have earlier" in note
    assert "\n" not in note and ignored_tools_note(make_chat_tokenizer(TOOLS_TEMPLATE), prompts, None) is None
    names_only = TOOLS_TEMPLATE.replace("{%- for c in m.tool_calls or [] %} <tool_call> {{ c.function.name }}", "")
    names_only = names_only.replace(" </tool_call>{% endfor %}", "")  # renders the schemas, drops the calls
    assert "ignores `tool_calls` (1 prompts" in ignored_tools_note(make_chat_tokenizer(names_only), prompts, None)


def test_a_template_that_refuses_the_tool_role_is_a_one_line_error_naming_the_prompt(tmp_path):
    from tests.conftest import make_chat_tokenizer

    strict = make_chat_tokenizer(
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{{ m.content }} {% endfor %}"
    )
    step = load_prompts(str(write_jsonl(tmp_path / "t.jsonl", [{"id": "a", "messages": TRACE}])), quiet=True)[1]
    with pytest.raises(FlashdraftError, match=r"prompt 'a/step2': the chat template refuses its conversation "):
        render_conversation(strict, step.conversation([]), True, where=f"prompt {step.id!r}")


def test_tool_call_arguments_in_json_text_render_as_the_server_renders_them_and_bad_ones_are_refused(tmp_path):
    from tests.conftest import make_chat_tokenizer

    tok = make_chat_tokenizer()  # writes arguments as Qwen3's template does: text as it is, an object with tojson
    step = load_prompts(str(write_jsonl(tmp_path / "t.jsonl", [{"messages": TRACE, "tools": TOOLS}])), quiet=True)[1]
    text = render_conversation(tok, step.conversation([]), True, None, step.tools)
    # vLLM parses the OpenAI format's JSON text into an object before rendering: json.dumps' spacing, not the row's
    assert '<think> t6 </think>  grep {"q": "t5", "n": 1} <|im_end|>' in text  # the call's reasoning kept
    raw = tok.apply_chat_template(TRACE[:3], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert 'grep {"q":"t5","n":1} <|im_end|>' in raw  # what the text itself would have rendered
    for arguments, found in (("{oops", ": not valid JSON"), ("[1, 2]", r": is list \[1, 2\]; expected a JSON object")):
        bad = [TRACE[0], TRACE[1] | {"tool_calls": [CALL | {"function": {"name": "g", "arguments": arguments}}]}]
        with pytest.raises(
            FlashdraftError, match=r"b\.jsonl:1: messages\[1\]\.tool_calls\[0\]\.function\.arguments" + found
        ):
            load_prompts(str(write_jsonl(tmp_path / "b.jsonl", [{"messages": bad}])), quiet=True)


def test_tools_stored_as_nested_parquet_columns_read_as_written_without_their_neighbours_keys(tmp_path):
    listing = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    other = [{"type": "function", "function": {"name": "ls", "description": "list", "parameters": listing}}]
    rows = [{"id": "a", "messages": TRACE, "tools": TOOLS}, {"id": "b", "messages": TRACE[:1], "tools": other}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")  # Arrow: one struct type for both rows
    read = load_prompts(str(tmp_path / "t.parquet"), quiet=True)
    as_jsonl = load_prompts(str(write_jsonl(tmp_path / "t.jsonl", rows)), quiet=True)
    assert [p.tools for p in read] == [SERVED_TOOLS, SERVED_TOOLS, other] and read == as_jsonl  # no "required": null


def test_tool_schemas_reach_the_template_as_vllm_hands_them_to_it_and_no_schema_is_refused(tmp_path):
    given = {
        "function": {"parameters": {"type": "object"}, "strict": True, "name": "ls", "x-extra": 1},
        "type": "function",
    }
    row = {"messages": TRACE[:1], "tools": [given, {"function": {"name": "cat", "description": "read"}}]}
    [prompt] = load_prompts(str(write_jsonl(tmp_path / "t.jsonl", [row])), quiet=True)
    # ChatCompletionToolsParam.model_dump(): name, description, parameters (null where absent), strict where set
    assert [json.dumps(t) for t in prompt.tools] == [
        '{"type": "function", "function": {"name": "ls", "description": null, "parameters": {"type": "object"}, '
        '"strict": true}}',
        '{"type": "function", "function": {"name": "cat", "description": "read", "parameters": null}}',
    ]
    for tool, found in (
        ({"type": "retrieval"}, r"tools\[0\] is .*an OpenAI function schema"),
        ({"function": {}}, "name is None"),
    ):
        with pytest.raises(FlashdraftError, match=found):
            load_prompts(str(write_jsonl(tmp_path / "b.jsonl", [{"messages": TRACE[:1], "tools": [tool]}])), quiet=True)


def test_tool_calls_without_ids_get_them_once_so_every_render_sees_the_same_messages(tmp_path):
    bare_call = {k: v for k, v in CALL.items() if k not in ("id", "type")}
    bare = [
        TRACE[0],
        TRACE[1] | {"tool_calls": [bare_call]},
        {k: v for k, v in TRACE[2].items() if k != "tool_call_id"},
    ]
    steps = load_prompts(str(write_jsonl(tmp_path / "t.jsonl", [{"messages": bare + TRACE[3:]}])), quiet=True)
    messages = steps[1].conversation([])
    call = messages[1]["tool_calls"][0]
    assert call["id"] == "call_1_0" and call["type"] == "function"  # deterministic: message 1, call 0
    assert messages[2]["tool_call_id"] == "call_1_0"  # the tool result answers the call before it
    given = load_prompts(str(write_jsonl(tmp_path / "g.jsonl", [{"messages": TRACE}])), quiet=True)[1]
    assert given.conversation([])[1]["tool_calls"][0]["id"] == "c1"  # ids in the data kept


def test_content_as_text_parts_reads_as_the_string_and_another_part_type_is_refused_in_one_line(tmp_path):
    from tests.conftest import make_chat_tokenizer

    tok = make_chat_tokenizer()
    parts = [{"type": "text", "text": "t1 t2"}, {"type": "text", "text": "t3"}]
    rows = [
        {"messages": [{"role": "user", "content": parts}]},
        {"messages": [{"role": "user", "content": "t1 t2\nt3"}]},
    ]
    as_parts, as_string = load_prompts(str(write_jsonl(tmp_path / "p.jsonl", rows)), quiet=True)
    assert as_parts.conversation([])[-1]["content"] == parts  # kept as read: joined where a template renders them
    render = [render_conversation(tok, p.conversation([]), True, None, p.tools) for p in (as_parts, as_string)]
    assert encode_text(tok, render[0], False) == encode_text(tok, render[1], False)
    audio = [{"type": "text", "text": "t1"}, {"type": "input_audio", "input_audio": {"data": "x"}}]
    with pytest.raises(FlashdraftError, match=r"i\.jsonl:1: messages\[0\]\.content\[1\] is a 'input_audio' part"):
        load_prompts(str(write_jsonl(tmp_path / "i.jsonl", [{"messages": [{"role": "user", "content": audio}]}])))
