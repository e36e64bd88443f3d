"""The completions endpoint of an OpenAI-compatible server (vLLM, SGLang), asked by token ids:
what `flashdraft generate --backend openai` sends and reads."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from flashdraft.errors import FlashdraftError


class OpenAIClient:
    """The completions endpoint of an OpenAI-compatible server (vLLM, SGLang), by token ids."""

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 600.0) -> None:
        base = base_url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.timeout = timeout
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict | None = None, root: bool = False) -> dict:
        url = (self.base.removesuffix("/v1") if root else self.base) + path
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:200]
            raise FlashdraftError(f"{url}: server answered HTTP {e.code} ({detail})") from None
        except (urllib.error.URLError, OSError) as e:
            raise FlashdraftError(f"{url}: cannot reach the server ({getattr(e, 'reason', e)})") from None
        except json.JSONDecodeError:
            raise FlashdraftError(f"{url}: the server's answer is not JSON") from None

    def _first_model(self) -> str:
        models = self._request("/models").get("data") or []
        if not models:
            raise FlashdraftError(f"{self.base}/models: the server lists no model; pass --server-model")
        return models[0]["id"]

    def complete(
        self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int, filters: dict | None = None
    ) -> dict:
        """One completion; `filters` (top_k, top_p, min_p) go in the request body as vLLM and SGLang read them."""
        body = {
            "model": self.model,
            "prompt": prompt_ids,  # token ids: the server sees exactly the locally rendered prompt
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "return_token_ids": True,  # vLLM returns choices[0].token_ids; others ignore it
            **(filters or {}),
        }
        choices = self._request("/completions", body).get("choices") or []
        if not choices:
            raise FlashdraftError(f"{self.base}/completions: the answer has no choices")
        return choices[0]

    def tokenize_chat(
        self, messages: list[dict], chat_template_kwargs: dict | None = None, tools: list[dict] | None = None
    ) -> list[int]:
        """The token ids the server renders `messages` to for a chat client: vLLM's /tokenize with the generation
        prompt, `chat_template_kwargs` over the server's --default-chat-template-kwargs (none sent: its defaults),
        and the request's `tools`."""
        body = {"model": self.model, "messages": [_request_message(m) for m in messages], "add_generation_prompt": True}
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        if tools:
            body["tools"] = tools
        tokens = self._request("/tokenize", body, root=True).get("tokens")
        if not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
            raise FlashdraftError(f"{self.base.removesuffix('/v1')}/tokenize: the answer has no token ids ('tokens')")
        return tokens


def _request_message(message: dict) -> dict:
    """A message as an OpenAI client sends it: tool calls' `arguments` as JSON text (the request's schema; the
    server parses them back into the objects flashdraft renders), an earlier turn's reasoning as `reasoning` (the
    field vLLM reads; it gives the template `reasoning_content` too)."""
    message = {k: v for k, v in message.items() if k != "reasoning_content"}
    if not message.get("tool_calls"):
        return message
    calls = [
        c | {"function": c["function"] | {"arguments": json.dumps(c["function"].get("arguments") or {})}}
        if isinstance(c.get("function", {}).get("arguments"), dict)
        else c
        for c in message["tool_calls"]
    ]
    return message | {"tool_calls": calls}
