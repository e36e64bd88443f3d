"""The completions format and its loader (and generate through the engine)."""

import json

import pytest

from flashdraft.data.completions import GenerationSettings, load_completions
from flashdraft.data.completions_writer import generate_completions
from flashdraft.data.prompts import load_prompts
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from tests.conftest import VOCAB, make_target
from tests.conftest import run_cli as run_captured
from tests.data.conftest import write_prompts


def settings(**kw) -> GenerationSettings:
    return GenerationSettings(**{"prompts": "test", "max_new_tokens": 6} | kw)


def test_loader_skips_invalid_records_saying_why_and_refuses_another_target(hybrid_dir, tmp_path, capsys):
    target = TargetModel.load(hybrid_dir)
    prompts = load_prompts(str(write_prompts(tmp_path / "p.jsonl", 3)), quiet=True)
    path = tmp_path / "c.json"
    generate_completions(target, prompts, path, settings())
    data = json.loads(path.read_text())
    good = data["records"][0]
    data["records"] += [
        dict(good, id="oov", completion_ids=[1, VOCAB + 5]),
        dict(good, id="empty", completion_ids=[]),
        dict(good, id="badstop", stop_reason="maybe"),
        dict(good, id="q1"),  # duplicate id
        dict(good, id="notype", prompt_ids="1 2"),
        dict(good, id="labelled", meta={"category": "math", "split": "qualitative", "question_id": "r", "turn": 1}),
        dict(good, id="badmeta", meta={"category": 3}),
        dict(good, id="badturn", meta={"category": "math", "turn": -1}),
    ]
    path.write_text(json.dumps(data))
    capsys.readouterr()
    loaded = load_completions(path, target)
    out = capsys.readouterr().out
    assert [r.id for r in loaded] == ["q0", "q1", "q2", "labelled"] and len(loaded.skipped) == 7
    assert "c.json: 4 of 11 records valid" in out
    # a benchmark row's labels are optional (files without them still read) and checked where given
    assert loaded[0].meta is None and loaded[3].meta["category"] == "math"
    assert "skipped badmeta: field 'meta.category' is 3; expected a string" in out
    assert "skipped badturn: field 'meta.turn' is -1; expected an integer >= 0" in out
    assert f"skipped oov: completion_ids has 1 ids outside the vocabulary 0..{VOCAB - 1} (first: {VOCAB + 5})" in out
    assert "skipped empty: empty completion" in out and "skipped q1: duplicate id" in out
    assert "skipped badstop: stop_reason is 'maybe'" in out and "skipped notype: field 'prompt_ids' is str" in out

    other = make_target("hybrid", seed=1)
    with pytest.raises(FlashdraftError, match="made by target fingerprint .* completions must come from the target"):
        load_completions(path, other)
    assert len(load_completions(path, other, allow_foreign=True, quiet=True)) == 4
    path.write_text(path.read_text()[:200])
    with pytest.raises(FlashdraftError, match="not valid JSON"):
        load_completions(path)


@pytest.mark.engine  # the session's engine models: built on the engine tests' worker
def test_generate_with_the_engine_starts_its_own_server(capsys, engine_models, tmp_path):
    m = engine_models
    rc, _, err = run_captured(
        capsys,
        "generate",
        "--target-model",
        m["target"],
        "--prompts",
        m["prompts"],
        "--out",
        tmp_path / "x.json",
        "--engine",
        "vllm",
        "--backend",
        "openai",
        "--base-url",
        "http://x",
    )
    assert rc == 2 and "--engine vllm starts its own server: drop --backend openai and --base-url" in err
