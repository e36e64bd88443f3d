"""Target directories for the data tests: tiny random targets saved as a user would have them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdraft.cli import main
from tests.conftest import save_target  # noqa: F401 (re-exported for the data tests)


def run_cli(args: list[str]) -> int:
    """The exit status of `flashdraft ARGS` (failed checks exit 1 through SystemExit)."""
    try:
        return main(args)
    except SystemExit as e:
        return int(e.code)


def write_prompts(path: Path, count: int = 5) -> Path:
    """Plain prompts of different lengths (so batches need padding) over the test vocabulary."""
    with open(path, "w") as f:
        for i in range(count):
            text = " ".join(f"t{(7 * i + j) % 60}" for j in range(2 + i))
            f.write(json.dumps({"id": f"q{i}", "prompt": text}) + "\n")
    return path


@pytest.fixture(scope="session")
def hybrid_dir(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("hybrid"), "hybrid")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("qwen3"), "qwen3")


# an agent trace: a user turn, the assistant's tool call, the tool's result, the answer; and the tools' schemas
TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object", "properties": {}}}}]
# the same as vLLM hands them to the template: name, description (null where absent), parameters
SERVED_TOOLS = [
    {
        "type": "function",
        "function": {"name": "grep", "description": None, "parameters": TOOLS[0]["function"]["parameters"]},
    }
]
# its arguments JSON text, as OpenAI clients send them (read as the object the server renders)
CALL = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"q":"t5","n":1}'}}
TRACE = [
    {"role": "user", "content": "t1"},
    {"role": "assistant", "content": "", "reasoning_content": "t6", "tool_calls": [CALL]},
    {"role": "tool", "content": "t7", "tool_call_id": "c1"},
    {"role": "assistant", "content": "t8"},
]
