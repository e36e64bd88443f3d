"""The chat template's mode: the keyword arguments a prompt is rendered with (`chat_template_kwargs`, the request
field vLLM and SGLang read; `enable_thinking` on Qwen3.x), checked against the template, recorded with the
template's hash; where a completion's reasoning segment ends; the mode mix of a set of records; and a prompt
rendered by the serving engine set against flashdraft's own. A message's content as the template gets it: vLLM's
content format (`content_format`: "string", or "openai" for a template that loops over a message's parts), read from
the template as vLLM reads it, and the messages built in it (`template_messages`).

Where a completion's reasoning segment is: `data/reasoning.py` (`<think>` ... `</think>`, gpt-oss's analysis
channel, found in the text). A template that writes an empty think block into the prompt (thinking off) leaves the
completion all answer.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, deque
from typing import Any

from flashdraft.data.reasoning import NOT_CLOSED, reasoning_tokens
from flashdraft.errors import FlashdraftError

THINKING = "enable_thinking"
# arguments flashdraft itself passes to apply_chat_template: a kwarg of the same name would silently replace them
RESERVED = (
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "return_dict",
    "return_assistant_tokens_mask",
)


def json_object(value: Any, where: str, example: str = "") -> dict[str, Any]:
    """A JSON object given as itself or as its text (datasets files and request fields hold either), or a one-line
    error naming `where`, what was found and `example`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise FlashdraftError(f"{where}: not valid JSON ({e.msg}); expected a JSON object{example}") from None
    if not isinstance(value, dict):
        raise FlashdraftError(f"{where}: is {type(value).__name__} {str(value)[:60]}; expected a JSON object{example}")
    return value


def parse_kwargs(value: Any, where: str) -> dict[str, Any] | None:
    """`--chat-template-kwargs JSON` (a string) or a prompt row's `chat_template_kwargs` (an object): a JSON object
    whose names are not ones flashdraft passes itself; None stays None (the template's defaults)."""
    if value is None:
        return None
    value = json_object(value, where, " such as '{\"enable_thinking\": false}'")
    taken = [k for k in value if k in RESERVED]
    if taken:
        raise FlashdraftError(
            f"{where}: {', '.join(taken)} is set by flashdraft itself (the generation prompt is "
            f"always added); expected template variables only"
        )
    return dict(value)


def run_kwargs(chat_template_kwargs: str | dict | None, enable_thinking: bool | None) -> dict[str, Any] | None:
    """A run's kwargs: `--chat-template-kwargs`, with `--enable-thinking` / `--disable-thinking` as the shorthand of
    `enable_thinking` (both saying otherwise is refused); None: the template's defaults."""
    kwargs = parse_kwargs(chat_template_kwargs, "--chat-template-kwargs")
    if enable_thinking is None:
        return kwargs
    flag = "--enable-thinking" if enable_thinking else "--disable-thinking"
    if kwargs is not None and kwargs.get(THINKING, enable_thinking) != enable_thinking:
        raise FlashdraftError(f"{flag} contradicts --chat-template-kwargs ({THINKING} {kwargs[THINKING]}); give one")
    return (kwargs or {}) | {THINKING: enable_thinking}


def merged(run: dict[str, Any] | None, row: dict[str, Any] | None) -> dict[str, Any]:
    """A prompt's kwargs: the run's, a row's own over them (as a request's over a server's defaults); {} = the
    template's defaults."""
    return {**(run or {}), **(row or {})}


def describe_kwargs(kwargs: dict[str, Any] | None) -> str:
    return f"chat_template_kwargs {json.dumps(kwargs, sort_keys=True)}" if kwargs else "the template's defaults"


def template_text(tokenizer) -> str | None:
    """The chat template a tokenizer applies (the default one of a named set)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def template_sha256(tokenizer) -> str | None:
    """The first 16 hex digits of the sha256 of the template's text: which template rendered a record."""
    text = template_text(tokenizer)
    return hashlib.sha256(text.encode()).hexdigest()[:16] if text else None


def template_variables(tokenizer) -> set[str] | None:
    """The names a template reads from outside (None: a template jinja2 alone cannot parse, e.g. one with
    transformers' own tags)."""
    import jinja2
    from jinja2 import meta

    text = template_text(tokenizer)
    if text is None:
        return set()
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError:
        return None
    return meta.find_undeclared_variables(parsed)


def ignored_kwargs(tokenizer, kwargs: dict[str, Any], messages: list[dict[str, str]]) -> list[str]:
    """The kwargs the template ignores: names it never reads, and booleans whose opposite renders `messages` to
    the same prompt."""

    messages = template_messages(messages, content_format(tokenizer))

    def render(given: dict[str, Any]) -> str:  # as `prompts.render_conversation` renders with a template
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **given)

    names = template_variables(tokenizer)
    ignored = [k for k in kwargs if names is not None and k not in names]
    for k, v in kwargs.items():
        if isinstance(v, bool) and k not in ignored and render(kwargs | {k: not v}) == render(kwargs):
            ignored.append(k)
    return ignored


def reads_thinking(tokenizer) -> bool:
    names = template_variables(tokenizer)
    return names is None or THINKING in names


def resolve_mode(
    tokenizer,
    use_template: bool,
    chat_template_kwargs: str | dict | None,
    enable_thinking: bool | None,
    prompts: list,
    log,
) -> dict[str, Any] | None:
    """The run's kwargs (`run_kwargs`) checked against the template, the mode logged: refused without a template,
    a thinking shorthand refused where the template does not read `enable_thinking`, and each kwarg the template
    ignores (on the first prompt of each mix of kwargs) reported. `prompts`: `data.prompts.Prompt`s."""
    kwargs = run_kwargs(chat_template_kwargs, enable_thinking)
    rows = any(p.chat_template_kwargs for p in prompts)
    if not use_template:
        if kwargs is not None or rows:
            raise FlashdraftError(
                "chat_template_kwargs (--chat-template-kwargs, --enable-thinking, --disable-thinking "
                "or a prompt row's) need a chat template; this run renders plain text"
            )
        return None
    if enable_thinking is not None and not reads_thinking(tokenizer):
        raise FlashdraftError(
            f"--{'enable' if enable_thinking else 'disable'}-thinking: the chat template does not "
            f"read {THINKING} (not a Qwen3-style thinking template); drop it, or give the "
            f"template's own variables with --chat-template-kwargs"
        )
    first: dict[str, Any] = {}
    for p in prompts:
        first.setdefault(json.dumps(merged(kwargs, p.chat_template_kwargs), sort_keys=True), p)
    for key, p in first.items():
        ignored = ignored_kwargs(tokenizer, json.loads(key), p.conversation([]))
        if ignored:
            log(
                f"warning: the chat template ignores {', '.join(ignored)} (the rendered prompt of {p.id!r} is the "
                f"same without it): these records are in the template's one mode, whatever the kwargs say"
            )
    log(
        f"chat template {template_sha256(tokenizer)}: {describe_kwargs(kwargs)}"
        + (f", {len(first)} mixes of kwargs with the prompt rows' own" if rows else "")
    )
    return kwargs


# -- the content format: how a message's content reaches the template ------------------------------------------

_content_formats: dict[str, str] = {}  # the template's full sha256 -> its content format


class _Undetectable(Exception):
    """A template whose AST vLLM's detection asserts on (a loop or `set` into several names): vLLM then keeps its
    default format, "string"."""


def content_format(tokenizer, tools: list[dict[str, Any]] | None = None) -> str:
    """How vLLM (`--chat-template-content-format auto`, its default) passes a message's content to the template,
    read from the template's Jinja AST as vLLM's `renderers/hf.py` `_detect_content_format` reads it: "openai" (a
    list of parts) where the template loops over a message's `content` (a message: a loop variable over `messages`
    or a variable set from it), over a macro's parameter a call gives it, or over a variable named `content`; else
    "string", also without a template or for one Jinja cannot parse (vLLM's default). The template is the one
    applied: of a named set, `tool_use` for a request with `tools` where there is one. Cached per template."""
    text = getattr(tokenizer, "chat_template", None)
    if isinstance(text, dict):
        text = text["tool_use"] if tools is not None and "tool_use" in text else text.get("default")
    if not text:
        return "string"
    key = hashlib.sha256(text.encode()).hexdigest()
    if key not in _content_formats:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        try:
            # the environment transformers renders with (its own tags included), as vLLM parses it
            root = _compile_jinja_template(text).environment.parse(text)
            _content_formats[key] = "openai" if _loops_over_content(root) else "string"
        except Exception:  # noqa: BLE001 - any template vLLM cannot read it gives its default
            _content_formats[key] = "string"
    return _content_formats[key]


def template_messages(messages: list[dict[str, Any]], content_format_name: str) -> list[dict[str, Any]]:
    """`messages` as vLLM passes them to a text-only model's template (`renderers/chat_utils.py`
    `_parse_chat_message_content`): each content read as a list of text parts (a string is one part); in the
    "string" format the parts' texts joined by newlines, in the "openai" format the list itself, a tool result's
    joined back into a string (vLLM does so for tool messages of text parts)."""
    out = []
    for message in messages:
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
        if content_format_name == "string" or message["role"] == "tool":
            if any(part.get("type") == "image" for part in parts):
                raise FlashdraftError(
                    f"a {message['role']} message has image parts, but the chat template reads its content as a "
                    f"string (no loop over content parts); expected a vision-language template that places images"
                )
            content = "\n".join(part["text"] for part in parts)
        else:
            content = [dict(part) for part in parts]
        out.append(message | {"content": content})
    return out


def _reads(node, name: str, key: str | None = None) -> bool:
    """Whether `node` reads variable `name` (or its `key`), through filters, tests and slices (vLLM's
    `_is_var_or_elems_access`)."""
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test) or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        return _reads(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, nodes.Getitem):  # the variable itself, not through a filter, holds the key
        return _is_name(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and _is_name(node.node, name) and node.attr == key


def _is_name(node, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _target_name(node) -> str:
    from jinja2 import nodes

    if not isinstance(node.target, nodes.Name):
        raise _Undetectable
    return node.target.name


def _message_names(root) -> list[str]:
    """The names a template's messages go by: `messages`, the variables `set` from it (transitively), and the
    targets of loops over any of them (vLLM's `_iter_nodes_assign_messages_item`)."""
    from jinja2 import nodes

    names, queue = ["messages"], deque(["messages"])
    while queue:
        related = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, related):
                name = _target_name(assign)
                if name not in names:
                    names.append(name)
                    queue.append(name)
    return [_target_name(loop) for loop in root.find_all(nodes.For) if any(_reads(loop.iter, n) for n in names)]


def _loops_over_content(root) -> bool:
    """Whether the template loops over a message's content: `for part in message.content`, over a macro's
    parameter some call passes a message's content, or over a variable named `content` outside macros (vLLM's
    `_iter_nodes_assign_content_item`, in its order)."""
    from jinja2 import nodes

    messages = _message_names(root)
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = [arg.name for arg in macro.args]
        params = set()
        for call in root.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                given = [(names[i], arg) for i, arg in enumerate(call.args) if i < len(names)]
                given += [(kw.key, kw.value) for kw in call.kwargs if kw.key in names]
                params |= {param for param, arg in given if any(_reads(arg, n, "content") for n in messages)}
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(nodes.For):
        over = loop.iter
        named = isinstance(over, nodes.Name)
        if (
            any(_reads(over, n, "content") for n in messages)
            or (named and over.name in params_by_loop.get(id(loop), ()))
            or (named and id(loop) not in in_macros and over.name == "content")
        ):
            _target_name(loop)
            return True
    return False


# -- reasoning segments --------------------------------------------------------------------------------------------


def check_reasoning_end(value: Any, completion_length: int) -> str | None:
    """Why a record's `reasoning_end` is unusable, or None."""
    if value is None or value == NOT_CLOSED:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < completion_length:
        return (
            f"reasoning_end is {value!r}; expected a token index in 0..{completion_length - 1}, "
            f"{NOT_CLOSED!r} or absent"
        )
    return None


# -- the mode mix of a set of records -----------------------------------------------------------------------------


def mode_mix(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Records per kwargs, how many have a reasoning segment and how many stopped inside it, and the share of
    completion tokens in reasoning; each record a dict with `chat_template_kwargs`, `reasoning_end` and
    `completion_ids` (or their count, `completion_tokens`). None when no record was rendered with a chat
    template."""
    rendered = [r for r in records if r.get("chat_template_kwargs") is not None]
    if not rendered:
        return None
    per_kwargs = Counter(json.dumps(r["chat_template_kwargs"], sort_keys=True) for r in rendered)
    lengths = [r["completion_tokens"] if "completion_tokens" in r else len(r["completion_ids"]) for r in records]
    total = sum(lengths)
    reasoning = sum(reasoning_tokens(r.get("reasoning_end"), n) or 0 for r, n in zip(records, lengths, strict=True))
    return {
        "records_per_kwargs": [
            {"chat_template_kwargs": json.loads(k), "records": n} for k, n in sorted(per_kwargs.items())
        ],
        "records": len(records),
        "with_reasoning": sum(r.get("reasoning_end") is not None for r in records),
        "reasoning_not_closed": sum(r.get("reasoning_end") == NOT_CLOSED for r in records),
        "completion_tokens": total,
        "reasoning_token_share": reasoning / total if total else 0.0,
    }


def combine_mixes(earlier: dict[str, Any] | None, later: dict[str, Any] | None) -> dict[str, Any] | None:
    """The mode mix of two sets of records together (a drafter trained in stages: `--init` from a trained one)."""
    if not earlier or not later:
        return later or earlier
    per_kwargs = Counter()
    for mix in (earlier, later):
        for k in mix["records_per_kwargs"]:
            per_kwargs[json.dumps(k["chat_template_kwargs"], sort_keys=True)] += k["records"]
    total = earlier.get("completion_tokens", 0) + later.get("completion_tokens", 0)
    reasoning = sum(m["reasoning_token_share"] * m.get("completion_tokens", 0) for m in (earlier, later))
    return {
        "records_per_kwargs": [
            {"chat_template_kwargs": json.loads(k), "records": n} for k, n in sorted(per_kwargs.items())
        ],
        **{name: earlier[name] + later[name] for name in ("records", "with_reasoning", "reasoning_not_closed")},
        "completion_tokens": total,
        "reasoning_token_share": reasoning / total if total else 0.0,
    }


def describe_mix(mix: dict[str, Any] | None) -> str:
    """One line of a mode mix."""
    if mix is None:
        return "no chat template (plain text prompts)"
    kinds = ", ".join(
        f"{describe_kwargs(k['chat_template_kwargs'])}: {k['records']}" for k in mix["records_per_kwargs"]
    )
    return (
        f"{kinds} records; {mix['with_reasoning']} of {mix['records']} with a reasoning segment "
        f"({mix['reasoning_token_share']:.0%} of all completion tokens in reasoning), "
        f"{mix['reasoning_not_closed']} not closed (stopped inside their reasoning: they train reasoning only)"
    )


def mode_difference(trained: dict[str, Any] | None, evaluated: dict[str, Any] | None) -> str | None:
    """Why records evaluated in `evaluated`'s mode are not the mode the drafter was trained on, or None (the same
    kwargs, or a side that recorded none)."""
    if not trained or not evaluated:
        return None
    kinds = [
        {json.dumps(k["chat_template_kwargs"], sort_keys=True) for k in m["records_per_kwargs"]}
        for m in (trained, evaluated)
    ]
    if kinds[1] <= kinds[0]:
        return None
    return (
        f"evaluated in another chat mode than the drafter was trained on: trained on "
        f"{describe_mix(trained)}; evaluated on {describe_mix(evaluated)} (acceptance differs most between "
        f"thinking and non-thinking text: evaluate in the mode the drafter will serve, or train on both)"
    )


# -- the engine's rendering ---------------------------------------------------------------------------------------


def check_engine_render(
    client,
    engine: str,
    record_id: str,
    messages: list[dict[str, str]],
    kwargs: dict[str, Any],
    prompt_ids: list[int],
    tokenizer,
    tools: list[dict[str, Any]] | None = None,
) -> None:
    """Refuse a prompt the engine renders otherwise than flashdraft: `messages` with `kwargs` (and the row's
    `tools`) as a chat client sends them (none when `kwargs` is empty: the server's defaults apply), the engine's
    token ids against `prompt_ids`, naming the record and the first differing token."""
    served = client.tokenize_chat(messages, kwargs or None, tools)
    if served == prompt_ids:
        return
    k = next(
        (i for i, (a, b) in enumerate(zip(served, prompt_ids, strict=False)) if a != b),
        min(len(served), len(prompt_ids)),
    )

    def token(ids: list[int]) -> str:
        return f"{ids[k]} {tokenizer.convert_ids_to_tokens(ids[k])!r}" if k < len(ids) else "the end"

    raise FlashdraftError(
        f"record {record_id}: {engine} renders its prompt ({describe_kwargs(kwargs)}) otherwise than flashdraft: "
        f"first difference at token {k}, the engine's {token(served)}, flashdraft's {token(prompt_ids)} "
        f"({len(served)} and {len(prompt_ids)} tokens); a server with another chat template or "
        f"--default-chat-template-kwargs serves its clients other prompts than the drafter sees: start it with the "
        f"target's template and defaults, or give --chat-template-kwargs the mode it serves"
    )
