"""The chat mode a drafter was trained for, as `doctor --serving` and the export README state it, and the server
settings that serve its prompts in that mode.

Training writes the mode mix of its data into the drafter's config.json (`trained_chat_mode`: records per
`chat_template_kwargs`, the share of tokens in reasoning). A server renders a chat request with its template and
`--default-chat-template-kwargs` (vLLM 0.32 `vllm/entrypoints/launchers/cli_args.py`, SGLang 0.5.23 the flag of
the same name), the request's `chat_template_kwargs` over them; so a drafter trained without thinking on a Qwen3.x
target is served as trained only by a server started with `'{"enable_thinking": false}'` or by clients that send
it in each request.
"""

from __future__ import annotations

import json
from typing import Any

TRAINED_MODE = "trained_chat_mode"


def trained_mode(cfg) -> dict[str, Any] | None:
    """The mode mix recorded in a `DrafterConfig` (None: not recorded)."""
    return cfg.extra.get(TRAINED_MODE)


def _kinds(mix: dict[str, Any]) -> list[dict[str, Any]]:
    return [k["chat_template_kwargs"] for k in mix.get("records_per_kwargs", [])]


def server_settings(mix: dict[str, Any]) -> str:
    """How to start the servers (or what clients send) so that requests are rendered in the trained mode."""
    kinds = _kinds(mix)
    if len(kinds) != 1:
        listed = " or ".join(json.dumps(k, sort_keys=True) for k in kinds)
        return (
            f"trained on several modes ({listed}): any of them is served as trained; choose with "
            f"--default-chat-template-kwargs JSON (vLLM and SGLang) or each request's chat_template_kwargs"
        )
    if not kinds[0]:
        return (
            "trained with the template's defaults: start vLLM and SGLang without --default-chat-template-kwargs "
            "and let clients send no chat_template_kwargs (a client sending another mode gets prompts the "
            "drafter was not trained on)"
        )
    text = json.dumps(kinds[0], sort_keys=True)
    return (
        f"serve in the trained mode: vllm serve ... --default-chat-template-kwargs '{text}' (or each request's "
        f"\"chat_template_kwargs\": {text}); SGLang: --default-chat-template-kwargs '{text}' (the same request "
        f"field)"
    )


def trained_mode_lines(cfg) -> list[str]:
    """The facts `doctor --serving` prints: the trained mode and the server settings that serve it."""
    mix = trained_mode(cfg)
    if not mix:
        return [
            "chat mode trained for: not recorded (config.json has no trained_chat_mode: trained elsewhere, "
            "before flashdraft recorded it, or on plain text)"
        ]
    kinds = ", ".join(
        f"{json.dumps(k['chat_template_kwargs'], sort_keys=True)}: {k['records']} records"
        for k in mix["records_per_kwargs"]
    )
    return [
        f"chat mode trained for: {kinds} ({mix['reasoning_token_share']:.0%} of the tokens in reasoning, "
        f"{mix['reasoning_not_closed']} records stopped inside it)",
        server_settings(mix),
    ]
