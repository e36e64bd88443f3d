"""The completers: the local target (`decoding/batched.py`, tested in tests/decoding/test_batched.py) and an
OpenAI-compatible server."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flashdraft.data.completions import GenerationSettings
from flashdraft.data.openai_client import OpenAIClient
from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from tests.conftest import make_target
from tests.data.conftest import run_cli, save_target, write_prompts


class FakeServer:
    """A tiny OpenAI-compatible completions server answering with the target's greedy output."""

    def __init__(self, target: TargetModel, return_token_ids: bool) -> None:
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(req)
                out = autoregressive_generate(target, req["prompt"], req["max_tokens"])
                ids = out.output_ids
                choice = {
                    "index": 0,
                    "text": target.tokenizer.decode(ids, skip_special_tokens=True),
                    "finish_reason": "stop" if out.stop_reason == "eos" else "length",
                }
                if return_token_ids:
                    choice["token_ids"] = ids
                self._send({"object": "text_completion", "model": req["model"], "choices": [choice]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("return_token_ids, source", [(True, "server"), (False, "retokenized")])
def test_openai_backend_records_token_ids_from_the_server_or_retokenised(
    hybrid_dir, tmp_path, return_token_ids, source
):
    target = TargetModel.load(hybrid_dir)
    server = FakeServer(target, return_token_ids)
    try:
        prompts_path = write_prompts(tmp_path / "p.jsonl", 3)
        assert (
            run_cli(
                [
                    "generate",
                    "--target-model",
                    str(hybrid_dir),
                    "--prompts",
                    str(prompts_path),
                    "--out",
                    str(tmp_path / "c.json"),
                    "--max-new-tokens",
                    "5",
                    "--backend",
                    "openai",
                    "--base-url",
                    server.url,
                ]
            )
            == 0
        )
    finally:
        server.close()
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["token_ids"] == source and data["generation"]["server_model"] == "fake-model"
    assert data["generation"]["base_url"] == server.url
    assert [r["token_source"] for r in data["records"]] == [source] * 3
    # requests run concurrently (--batch-size of them), in any order
    assert sorted(q["prompt"] for q in server.requests) == sorted(r["prompt_ids"] for r in data["records"])
    assert {q["max_tokens"] for q in server.requests} == {5}
    local = [autoregressive_generate(target, r["prompt_ids"], 5).output_ids for r in data["records"]]
    if source == "server":
        assert [r["completion_ids"] for r in data["records"]] == local
    else:  # re-tokenised text: the same tokens here, where every token is a whole word
        assert [r["completion_ids"] for r in data["records"]] == [
            target.tokenizer(target.tokenizer.decode(ids, skip_special_tokens=True))["input_ids"] for ids in local
        ]


def test_openai_backend_sends_the_sampling_filters_and_records_them(hybrid_dir, tmp_path):
    target = TargetModel.load(hybrid_dir)
    server = FakeServer(target, True)
    try:
        assert (
            run_cli(
                [
                    "generate",
                    "--target-model",
                    str(hybrid_dir),
                    "--prompts",
                    str(write_prompts(tmp_path / "p.jsonl", 2)),
                    "--out",
                    str(tmp_path / "c.json"),
                    "--max-new-tokens",
                    "4",
                    "--backend",
                    "openai",
                    "--base-url",
                    server.url,
                    "--temperature",
                    "0.6",
                    "--top-k",
                    "20",
                    "--top-p",
                    "0.95",
                ]
            )
            == 0
        )
    finally:
        server.close()
    assert all(q["top_k"] == 20 and q["top_p"] == 0.95 and "min_p" not in q for q in server.requests)
    generation = json.loads((tmp_path / "c.json").read_text())["generation"]
    assert (generation["top_k"], generation["top_p"], generation["min_p"]) == (20, 0.95, None)


def test_generate_samples_with_the_targets_generation_config_filters_unless_told_not_to(tmp_path, capsys):
    target_dir = save_target(tmp_path / "target", "qwen3")
    (target_dir / "generation_config.json").write_text(json.dumps({"top_k": 3, "top_p": 0.9}))
    prompts = str(write_prompts(tmp_path / "p.jsonl", 2))
    common = [
        "generate",
        "--target-model",
        str(target_dir),
        "--prompts",
        prompts,
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.8",
    ]
    assert run_cli([*common, "--out", str(tmp_path / "a.json")]) == 0
    assert "top_k 3 (" in capsys.readouterr().out
    assert run_cli([*common, "--out", str(tmp_path / "b.json"), "--no-generation-config"]) == 0
    a, b = (json.loads((tmp_path / f"{n}.json").read_text())["generation"] for n in "ab")
    assert (a["top_k"], a["top_p"]) == (3, 0.9) and (b["top_k"], b["top_p"]) == (None, None)


def test_openai_backend_names_an_unreachable_server():
    with pytest.raises(FlashdraftError, match=r"http://127\.0\.0\.1:9/v1/models: cannot reach the server"):
        OpenAIClient("http://127.0.0.1:9", timeout=5)


def test_an_agent_steps_records_keep_their_tools_and_where_the_completion_calls_one(tmp_path):
    """The target writes each assistant step of a trace; its record keeps the tool schemas and the [start, end) token
    span of the call it wrote, where the template marks calls (here Qwen3's <tool_call> words)."""
    from flashdraft.data.completers import answer_turns
    from flashdraft.data.completions import record_json, record_problem
    from flashdraft.data.prompts import load_prompts
    from tests.conftest import make_tool_call_tokenizer
    from tests.data.conftest import SERVED_TOOLS, TOOLS, TRACE

    tok = make_tool_call_tokenizer()
    target = make_target("qwen3")
    target.tokenizer = tok
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": TRACE, "tools": TOOLS}) + "\n")
    steps = load_prompts(str(path), quiet=True)
    written = [1, 50, 2, 3, 51, 4, 61]  # a call (tokens 1..4), then an answer word and the stop token

    def complete(items):
        return [(written, "eos", "target") for _ in items]

    settings = GenerationSettings(prompts=str(path), max_new_tokens=8, chat_template=True)
    records = answer_turns(target, steps, settings, complete)
    assert [r.id for r in records] == ["a/step1", "a/step2"]
    assert all(r.tools == SERVED_TOOLS and r.tool_call_spans == [[1, 5]] for r in records)
    row = json.loads(record_json(records[1]))
    assert row["tool_call_spans"] == [[1, 5]] and record_problem(row, 64) is None
    assert "tool_call_spans is [[5, 9]]" in record_problem(row | {"tool_call_spans": [[5, 9]]}, 64)


def test_a_chat_request_sends_tool_call_arguments_as_json_text_and_reasoning_as_vllm_reads_it():
    from flashdraft.data.openai_client import _request_message

    call = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": {"q": "t5"}}}
    message = {"role": "assistant", "content": "", "reasoning": "t6", "reasoning_content": "t6", "tool_calls": [call]}
    sent = _request_message(message)
    assert sent["tool_calls"][0]["function"]["arguments"] == '{"q": "t5"}'  # the request's schema: JSON text
    assert sent["reasoning"] == "t6" and "reasoning_content" not in sent  # vLLM reads `reasoning`
    assert message["tool_calls"][0]["function"]["arguments"] == {"q": "t5"}  # the record's messages untouched
    assert _request_message({"role": "user", "content": "t1"}) == {"role": "user", "content": "t1"}
