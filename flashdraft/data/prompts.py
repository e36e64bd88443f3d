"""Prompt sources: JSONL files, local datasets (Parquet/JSONL through `datasets`), and the
built-in coding prompts; and how a prompt becomes the target's input tokens.

Every prompt is a conversation to answer: a fixed prefix of chat messages (possibly
empty) and one or more user turns, each answered by the target after the previous
answer. The three row formats map onto it:

- `prompt`: a string, one user turn;
- `messages`: chat messages ({role, content}); the last user message is the turn to
  answer and the ones before are the prefix; a trailing assistant reply is the answer the
  target regenerates, so it is removed (and counted in the summary);
- `turns`: a list of user turns (the public DFlash benchmark files), answered in order;
- `conversations` (ShareGPT and the peers' prepared files): `{from, value}` messages with `human`, `gpt`,
  `system`, `tool` (and their kin, `ROLE_NAMES`), or `{role, content}` ones: read as `messages`.

A row may carry `tools` (OpenAI function schemas) and messages with `tool_calls` and the `tool` role: they reach
the chat template as transformers' `apply_chat_template(messages, tools=...)` passes them, and as vLLM renders a
chat request with `tools`. A conversation with tool calls or tool results is an agent trace: each assistant turn
in it is a prompt of its own (`ID/stepK`), the messages before it as the data has them (the tools' results come
from the data, the target never invents one), so the target writes every assistant turn and the loss covers only
what it wrote.

The tokenizer's chat template is applied where the target has one; without one (a plain
code LM such as the built-in target) the text is used as is and a conversation is
concatenated, each answer continuing its prompt.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.data.chat_mode import content_format, json_object, parse_kwargs, template_messages
from flashdraft.data.images import image_part, is_image_part, row_images, with_row_images
from flashdraft.data.stdlib import stdlib_prompts
from flashdraft.errors import FlashdraftError
from flashdraft.files import read_jsonl
from flashdraft.safe_load import refuse_script

BUILTIN_CODE = Path(__file__).parent / "builtin_code.jsonl"
BUILTIN_SPLITS = {"builtin:code": "train", "builtin:code:train": "train", "builtin:code:heldout": "heldout"}
BUILTIN_SPECS = [
    *BUILTIN_SPLITS,
    "builtin:stdlib[:N]",
    "builtin:stdlib:heldout[:N]",
    "builtin:long[:N]",
    "builtin:long:heldout[:N]",
    "speed-bench:PATH[:SPLIT[:CATEGORY+...]]",
]
ROLES = ("system", "user", "assistant", "tool", "developer")
# ShareGPT's `from` names (and the peers' kin) mapped to chat roles
ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning", "reasoning_content")


@dataclass
class Prompt:
    id: str
    turns: list[str | dict]  # user turns (or a whole message: an agent step's, text parts'), answered in order
    prefix: list[dict[str, Any]] = field(default_factory=list)  # chat messages before the first turn
    chat_template_kwargs: dict[str, Any] | None = None  # the row's own (over the run's): e.g. its thinking mode
    tools: list[dict[str, Any]] | None = None  # OpenAI function schemas the template renders
    # a benchmark row's labels (SPEED-Bench: category, split, ...; `data/speed_bench.py`): figures per category
    meta: dict[str, Any] | None = None

    def conversation(self, answers: list[str]) -> list[dict[str, Any]]:
        """Messages up to and including the turn after `answers` (earlier replies)."""
        messages = list(self.prefix)
        for turn, answer in zip(self.turns, answers, strict=False):
            messages += [_as_message(turn), {"role": "assistant", "content": answer}]
        messages.append(_as_message(self.turns[len(answers)]))
        return messages

    def record_id(self, turn: int) -> str:
        """The completion record id of one turn: the prompt id, suffixed for multi-turn prompts."""
        return self.id if len(self.turns) == 1 else f"{self.id}/turn{turn + 1}"


def _as_message(turn: str | dict) -> dict[str, Any]:
    return turn if isinstance(turn, dict) else {"role": "user", "content": turn}


# -- reading ----------------------------------------------------------------------------


def load_prompts(spec: str, num_prompts: int | None = None, quiet: bool = False) -> list[Prompt]:
    """Read prompts from `spec`: a .jsonl file, a .parquet file or dataset directory, or a
    built-in set (`builtin:code` = train split, `builtin:code:heldout`, `builtin:stdlib[:N]`,
    `builtin:stdlib:heldout[:N]`, and the long-context `builtin:long[:N]`, `builtin:long:heldout[:N]`,
    `data/long_context.py`), or a prepared SPEED-Bench split (`speed-bench:PATH[:SPLIT[:CATEGORY+...]]`,
    `data/speed_bench.py`). Returns the first `num_prompts` (all if None) in file order."""
    stats = {"trailing_assistant_removed": 0}
    if spec.startswith("speed-bench:"):
        from flashdraft.data.speed_bench import speed_bench_requests

        requests, source = speed_bench_requests(spec)
        prompts = [Prompt(r.id, list(r.turns), r.prefix, meta=r.meta) for r in requests]
        return _chosen(prompts, source, num_prompts, quiet, stats)
    if spec.startswith(("builtin:stdlib", "builtin:long")):
        rows, source = _split_rows(spec), spec
    elif spec.startswith("builtin:"):
        if spec not in BUILTIN_SPLITS:
            raise FlashdraftError(f"--prompts {spec}: unknown built-in set; expected one of {', '.join(BUILTIN_SPECS)}")
        split = BUILTIN_SPLITS[spec]
        rows = [(loc, row) for loc, row in read_jsonl(BUILTIN_CODE) if row.get("split") == split]
        source = spec
    else:
        path = Path(spec)
        if not path.exists():
            raise FlashdraftError(
                f"--prompts {spec}: no such file or directory; expected a .jsonl/.parquet file, a dataset "
                f"directory, or one of {', '.join(BUILTIN_SPECS)}"
            )
        rows = list(read_jsonl(path)) if path.suffix == ".jsonl" else list(_read_dataset(path))
        source = str(path)
    prompts: list[Prompt] = []
    seen: dict[str, str] = {}
    base = Path(spec).parent if not spec.startswith("builtin:") else None  # relative image paths start there
    for index, (loc, row) in enumerate(rows):
        for prompt in _parse_row(row, loc, index, stats, base):
            if prompt.id in seen:
                raise FlashdraftError(
                    f"{loc}: id {prompt.id!r} repeats the id of {seen[prompt.id]}; ids must be unique"
                )
            seen[prompt.id] = loc
            prompts.append(prompt)
    return _chosen(prompts, source, num_prompts, quiet, stats)


def _chosen(
    prompts: list[Prompt], source: str, num_prompts: int | None, quiet: bool, stats: dict[str, int]
) -> list[Prompt]:
    """The first `num_prompts` of a source's prompts, said unless `quiet`."""
    if not prompts:
        raise FlashdraftError(f"{source}: no prompts found")
    total = len(prompts)
    if num_prompts is not None:
        prompts = prompts[:num_prompts]
    if not quiet:
        note = f"using {len(prompts)} of {total} prompts from {source}"
        if stats["trailing_assistant_removed"]:
            note += (
                f" ({stats['trailing_assistant_removed']} rows ended with an assistant reply; it was removed, "
                f"the target regenerates it)"
            )
        print(note)
    return prompts


def _split_rows(spec: str) -> list[tuple[str, dict[str, str]]]:
    """Rows of `builtin:stdlib[:heldout][:N]` (windows of the standard library's files that share no line
    with the built-in coding prompts, data/stdlib.py) or `builtin:long[:heldout][:N]` (long-context cuts of
    them, data/long_context.py)."""
    name = spec.split(":")[1]
    parts = spec.split(":")[2:]
    split = "heldout" if parts[:1] == ["heldout"] else "train"
    parts = parts[1:] if split == "heldout" else parts
    if name not in ("stdlib", "long") or len(parts) > 1 or (parts and not (parts[0].isdigit() and int(parts[0]) > 0)):
        raise FlashdraftError(
            f"--prompts {spec}: unknown built-in set; expected one of {', '.join(BUILTIN_SPECS)} with N a positive "
            f"number of prompts"
        )
    if name == "long":
        from flashdraft.data.long_context import long_prompts

        windows = long_prompts(split)
    else:
        code_prompts = [row["prompt"] for _, row in read_jsonl(BUILTIN_CODE)]
        windows = stdlib_prompts(split, avoid_texts=code_prompts)
    if parts:
        windows = windows[: int(parts[0])]
    return [(f"{spec} {pid}", {"id": pid, "prompt": text}) for pid, text in windows]


def _read_dataset(path: Path):
    """Yield (location, row) of a local dataset: a Parquet/JSON file, a directory of data
    files, or a directory written by `Dataset.save_to_disk`."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local paths only
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_dir() and any((path / name).exists() for name in ("state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(path))
        elif path.is_dir():
            refuse_script(path)
            ds = datasets.load_dataset(str(path))
        elif path.suffix == ".parquet":
            ds = datasets.load_dataset("parquet", data_files=str(path))
        elif path.suffix == ".json":
            ds = datasets.load_dataset("json", data_files=str(path))
        else:
            raise FlashdraftError(f"{path}: unknown prompt file type {path.suffix!r}; expected .jsonl, .json, .parquet")
    except FlashdraftError:
        raise
    except Exception as e:  # datasets raises many types; name the file and the cause
        raise FlashdraftError(f"{path}: cannot read as a dataset ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if "train" in ds:
            ds = ds["train"]
        elif len(splits) == 1:
            ds = ds[splits[0]]
        else:
            raise FlashdraftError(f"{path}: dataset has splits {splits} and none is 'train'; expected one split")
    for index, row in enumerate(ds):
        yield f"{path} row {index}", _without_nulls(row)


def _without_nulls(value: Any) -> Any:
    """A datasets row without the keys whose value is null: a Parquet (Arrow) struct column holds every row's keys,
    so a tool schema or tool call stored as nested objects gains its neighbours' keys as nulls (`"description":
    null`), which a template would render; JSON text keeps a row as written."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _parse_row(
    row: dict[str, Any], loc: str, index: int, stats: dict[str, int], base: Path | None = None
) -> list[Prompt]:
    """The prompts of one row: one, or one per assistant step of an agent trace. `base`: the folder relative image
    paths start from."""
    kwargs = parse_kwargs(row.get("chat_template_kwargs"), f"{loc}: field 'chat_template_kwargs'")
    tools = _tools(row.get("tools"), loc)
    prompts = _parse_turns(row, loc, index, stats, base)
    for prompt in prompts:
        prompt.chat_template_kwargs, prompt.tools = kwargs, tools
    return prompts


def _tools(tools: Any, loc: str) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if isinstance(tools, str):  # datasets files often store them as JSON text
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise FlashdraftError(f"{loc}: field 'tools' is not valid JSON ({e.msg}); expected a list") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise FlashdraftError(f"{loc}: field 'tools' is {str(tools)[:80]}; expected a list of function schemas")
    return [_served_tool(t, f"{loc}: tools[{k}]") for k, t in enumerate(tools)] or None


def _served_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool schema as vLLM hands it to the template (`ChatCompletionToolsParam.model_dump()`, vLLM 0.32): type,
    then the function's name, description and parameters in that order, the last two null where absent, `strict`
    and `defer_loading` only where set, other keys dropped; a template that writes `tool | tojson` (Qwen3's) renders
    the schema the server renders."""
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise FlashdraftError(
            f"{where} is {str(tool)[:80]}; expected {{'type': 'function', 'function': {{'name', 'description', "
            f"'parameters'}}}} (an OpenAI function schema)"
        )
    if not isinstance(function.get("name"), str):
        raise FlashdraftError(f"{where}.function.name is {function.get('name')!r}; expected a string")
    served = {k: function.get(k) for k in ("name", "description", "parameters")}
    defer = function.get("defer_loading", tool.get("defer_loading"))
    served |= {k: v for k, v in (("strict", function.get("strict")), ("defer_loading", defer)) if v is not None}
    top = tool.get("defer_loading")
    return {"type": "function", "function": served} | ({"defer_loading": top} if top is not None else {})


def _parse_turns(
    row: dict[str, Any], loc: str, index: int, stats: dict[str, int], base: Path | None = None
) -> list[Prompt]:
    raw_id = row.get("id", row.get("question_id"))
    pid = str(raw_id) if raw_id is not None else f"p{index:06d}"
    if row.get("prompt") is not None:
        text = row["prompt"]
        if not isinstance(text, str) or not text:
            raise FlashdraftError(f"{loc}: field 'prompt' is {text!r}; expected a non-empty string")
        return [Prompt(pid, [text])]
    if row.get("turns") is not None:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise FlashdraftError(f"{loc}: field 'turns' is {str(turns)[:80]}; expected a list of non-empty strings")
        return [Prompt(pid, list(turns))]
    for name in ("messages", "conversations"):
        if row.get(name) is not None:
            messages = _messages(row[name], loc, name, base)
            sources = row_images(row, base, loc)  # LLaVA's `image`, ShareGPT's `images`
            if sources:
                messages = with_row_images(messages, sources, loc)
            return _message_prompts(messages, pid, f"{loc}: field '{name}'", stats)
    raise FlashdraftError(
        f"{loc}: no 'prompt', 'messages', 'conversations' or 'turns' field (found {sorted(row)}); expected one of them"
    )


def _messages(raw: Any, loc: str, name: str, base: Path | None = None) -> list[dict[str, Any]]:
    """Chat messages of a `messages` or `conversations` field: {role, content} or ShareGPT's {from, value}."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            pass
    if not isinstance(raw, list) or not raw:
        raise FlashdraftError(f"{loc}: field '{name}' is {str(raw)[:80]}; expected a list of messages")
    messages = []
    for k, m in enumerate(raw):
        if isinstance(m, dict) and "from" in m and "role" not in m:
            m = {"role": ROLE_NAMES.get(str(m["from"]).lower(), m["from"]), "content": m.get("value")} | {
                key: m[key] for key in MESSAGE_FIELDS[2:] if m.get(key) is not None
            }
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = m | {"content": _content_parts(m["content"], f"{loc}: {name}[{k}].content", base)}
        calls = isinstance(m, dict) and m.get("role") == "assistant" and bool(m.get("tool_calls"))
        content = m.get("content") if isinstance(m, dict) else None
        content_ok = isinstance(content, str | list) or (calls and not content)
        if not isinstance(m, dict) or m.get("role") not in ROLES or not content_ok:
            raise FlashdraftError(
                f"{loc}: {name}[{k}] is {str(m)[:80]}; expected {{'role': one of {'/'.join(ROLES)}, 'content': a "
                f"string or a list of text parts}} or {{'from': one of {'/'.join(ROLE_NAMES)}, 'value': a string}}"
            )
        message = {key: m[key] for key in MESSAGE_FIELDS if m.get(key) is not None} | {
            "content": m.get("content") or ""
        }
        if message.get("tool_calls"):
            message["tool_calls"] = _tool_calls(message["tool_calls"], f"{loc}: {name}[{k}].tool_calls")
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if isinstance(reasoning, str) and message["role"] == "assistant":
            # vLLM reads a request message's `reasoning` and gives its template both names (Qwen3's reads
            # reasoning_content); a `reasoning_content` alone it drops, so it is sent as `reasoning`
            message |= {"reasoning": reasoning, "reasoning_content": reasoning}
        messages.append(message)
    return _with_call_ids(messages)


def _content_parts(parts: list, where: str, base: Path | None = None) -> list[dict[str, Any]]:
    """Content given as OpenAI's list of parts, kept as parts: how the template gets them (joined, or the list) is
    the template's content format, resolved where the prompt is rendered (`chat_mode.template_messages`). Image parts
    are read as `data.images` reads them (a vision-language target renders them; a text-only one refuses them where
    it loads); any other part (audio, video) is refused."""
    out = []
    for n, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if is_image_part(part):
            out.append(image_part(part, base, f"{where}[{n}]"))
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            raise FlashdraftError(
                f"{where}[{n}] is a {kind!r} part; expected {{'type': 'text', 'text': a string}} or an image part "
                f"({{'type': 'image_url', 'image_url': {{'url': a local path, file:// or data: URL}}}})"
            )
        out.append(part)
    return out


def _with_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls with an `id` each and tool results with the `tool_call_id` of the call they answer, filled where
    the data has none (templates do not need them; vLLM's request format does): `call_{message}_{n}`, and a tool
    message takes the next unanswered call's id in order. Both renders (local and the engine's) see the same."""
    pending: list[str] = []
    out = []
    for k, message in enumerate(messages):
        if message.get("tool_calls"):
            calls = [
                {"type": "function"} | call | {"id": call.get("id") or f"call_{k}_{n}"}
                for n, call in enumerate(message["tool_calls"])
            ]
            message = message | {"tool_calls": calls}
            pending = [c["id"] for c in calls]
        elif message["role"] == "tool":
            answered = message.get("tool_call_id") or (pending[0] if pending else f"call_{k}_0")
            pending = [i for i in pending if i != answered]
            message = message | {"tool_call_id": answered}
        out.append(message)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls with their `arguments` as objects: vLLM parses the OpenAI format's JSON
    text into an object before it renders a request (`renderers/chat_utils.py` `_postprocess_messages`; empty
    arguments become {}), and transformers' templates expect objects, so text arguments would render otherwise
    than the server renders them (Qwen3's template writes text as it is, an object with `tojson`)."""
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
    ):
        raise FlashdraftError(
            f"{where} is {str(calls)[:80]}; expected a list of {{'type': 'function', 'function': {{'name', "
            f"'arguments'}}}}"
        )
    normalized = []
    for n, call in enumerate(calls):
        where_arguments = f"{where}[{n}].function.arguments"
        arguments = json_object(call["function"].get("arguments") or {}, where_arguments, " (vLLM renders {} for it)")
        normalized.append(call | {"function": call["function"] | {"arguments": arguments}})
    return normalized


def _message_prompts(messages: list[dict[str, Any]], pid: str, where: str, stats: dict[str, int]) -> list[Prompt]:
    """A conversation's prompts: its last user message answered after the rest, or, in an agent trace (tool calls
    or tool results), each assistant step answered after the data's messages before it."""
    if _is_agent_trace(messages):
        steps = [k for k in range(1, len(messages) + 1) if messages[k - 1]["role"] in ("user", "tool")]
        steps = [k for k in steps if k == len(messages) or messages[k]["role"] == "assistant"]
        return [Prompt(f"{pid}/step{n + 1}", [messages[k - 1]], prefix=messages[: k - 1]) for n, k in enumerate(steps)]
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
        stats["trailing_assistant_removed"] += 1
    if not messages or messages[-1]["role"] != "user":
        raise FlashdraftError(f"{where} has no user message to answer at its end")
    last = messages[-1]
    return [Prompt(pid, [last["content"] if isinstance(last["content"], str) else last], prefix=messages[:-1])]


def _is_agent_trace(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


# -- tokens -----------------------------------------------------------------------------


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_conversation(
    tokenizer,
    messages: list[dict[str, Any]],
    use_chat_template: bool,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    where: str = "a prompt",
) -> str:
    """The text the target sees before its reply: the chat template with the generation
    prompt and `chat_template_kwargs` (None: the template's defaults; earlier replies as the template renders
    them, e.g. without their reasoning), or (no template) the contents concatenated, each reply continuing its
    prompt. Content given as text parts reaches the template as vLLM passes it in the template's content format
    (`chat_mode.content_format`); plain text joins them as vLLM's "string" format does. A template that refuses the
    conversation (`raise_exception`: a role it has no place for, such as `tool`) is a one-line error naming
    `where`."""
    if use_chat_template:
        import jinja2

        given = template_messages(messages, content_format(tokenizer, tools))
        try:
            return tokenizer.apply_chat_template(
                given, tools=tools, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
            )
        except jinja2.TemplateError as e:
            roles = "/".join(m["role"] for m in messages)
            raise FlashdraftError(
                f"{where}: the chat template refuses its conversation ({e}; roles {roles}); expected a conversation "
                f"the target's template renders (one without a tool role renders no agent trace)"
            ) from None
    text = ""
    for m in template_messages(messages, "string"):
        if m["role"] == "assistant" or not text:
            text += m["content"]
        else:
            text += "\n\n" + m["content"]
    return text


def ignored_tools_note(tokenizer, prompts: list[Prompt], kwargs: dict[str, Any] | None) -> str | None:
    """One line where rows carry `tools` or tool calls and the chat template renders the same prompt without them:
    the target never sees the schemas, or the calls its tools' results answer (a server given them would not
    either)."""
    if not has_chat_template(tokenizer):
        return None
    ignored = []
    carrying = [p for p in prompts if p.tools]
    if carrying:
        first = carrying[0].conversation([])
        with_tools = render_conversation(
            tokenizer, first, True, kwargs, carrying[0].tools, f"prompt {carrying[0].id!r}"
        )
        if with_tools == render_conversation(tokenizer, first, True, kwargs):
            ignored.append(f"`tools` ({len(carrying)} of {len(prompts)} prompts carry tool schemas)")
    calling = [p for p in prompts if any(m.get("tool_calls") for m in p.conversation([]))]
    if calling:
        messages = calling[0].conversation([])
        bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        with_calls = render_conversation(tokenizer, messages, True, kwargs, where=f"prompt {calling[0].id!r}")
        if with_calls == render_conversation(tokenizer, bare, True, kwargs):
            ignored.append(f"`tool_calls` ({len(calling)} prompts have earlier tool calls in their messages)")
    if not ignored:
        return None
    return (
        f"the chat template ignores {' and '.join(ignored)}: the target does not see them (its template renders "
        f"none); use the target's own template, which renders them"
    )


def encode_text(tokenizer, text: str, use_chat_template: bool) -> list[int]:
    """Token ids of a rendered prompt. A chat template already holds the special tokens it
    wants, so none are added on top; plain text gets the tokenizer's usual ones."""
    return list(tokenizer(text, add_special_tokens=not use_chat_template)["input_ids"])


# -- prompts longer than the target's context ------------------------------------------------

LONG_PROMPT_POLICIES = ("error", "skip", "truncate")


def prompt_token_limit(context_length: int | None, max_new_tokens: int) -> int | None:
    """Longest prompt that leaves room for `max_new_tokens` in the target's context (None: no
    limit known). Raises when even an empty prompt would not fit."""
    if context_length is None:
        return None
    if max_new_tokens >= context_length:
        raise FlashdraftError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the target's context of "
            f"{context_length} tokens (max_position_embeddings); expected fewer than {context_length}"
        )
    return context_length - max_new_tokens


def fit_prompt(
    prompt_id: str, ids: list[int], limit: int | None, policy: str, stats: dict[str, int], source: str = "--prompts"
) -> list[int] | None:
    """`ids` if they fit in `limit` tokens; else, by `policy` (`--long-prompts`): an error,
    None (skip the prompt) or its last `limit` tokens (the end holds the question and the
    generation prompt). Skips and truncations are counted in `stats`."""
    if limit is None or len(ids) <= limit:
        return ids
    if policy == "skip":
        stats["skipped"] = stats.get("skipped", 0) + 1
        return None
    if policy == "truncate":
        stats["truncated"] = stats.get("truncated", 0) + 1
        return ids[-limit:]
    raise FlashdraftError(
        f"{source}: prompt {prompt_id!r} has {len(ids)} tokens; expected at most {limit} (the target's context minus "
        f"--max-new-tokens); pass --long-prompts skip or --long-prompts truncate (keeps the last {limit})"
    )


def describe_long_prompts(stats: dict[str, int], limit: int | None) -> str | None:
    """One summary line for the prompts `fit_prompt` skipped or truncated, or None."""
    parts = [f"{stats[k]} {k}" for k in ("skipped", "truncated") if stats.get(k)]
    if not parts:
        return None
    return f"prompts longer than {limit} tokens (context minus --max-new-tokens): {', '.join(parts)}"
