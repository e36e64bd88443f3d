"""The resumable writing of a completions file."""

import functools
import json

import pytest

from flashdraft.data import completions_writer
from flashdraft.data.completions import GenerationSettings, load_completions
from flashdraft.data.completions_writer import generate_completions
from flashdraft.data.prompts import Prompt, load_prompts
from flashdraft.decoding.batched import CompiledBatch
from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from tests.conftest import make_target
from tests.data.conftest import run_cli, write_prompts


def settings(**kw) -> GenerationSettings:
    return GenerationSettings(**{"prompts": "test", "max_new_tokens": 6} | kw)


def test_generate_writes_header_and_records_and_resumes_without_duplicates(hybrid_dir, tmp_path):
    target = TargetModel.load(hybrid_dir)
    prompts = load_prompts(str(write_prompts(tmp_path / "p.jsonl", 5)), quiet=True)
    out = tmp_path / "c.json"
    generate_completions(target, prompts[:2], out, settings(), batch_size=2)
    first = json.loads(out.read_text())
    assert first["format"] == "flashdraft.completions" and first["version"] == 1
    assert first["target"]["fingerprint"] == target.fingerprint() and first["token_ids"] == "target"
    assert first["generation"]["max_new_tokens"] == 6 and first["num_records"] == 2
    r = first["records"][0]
    assert r["id"] == "q0" and r["prompt"] == "t0 t1" and r["prompt_ids"] == [0, 1]
    assert r["completion_ids"] == autoregressive_generate(target, [0, 1], 6).output_ids
    assert r["completion"] == target.tokenizer.decode(r["completion_ids"], skip_special_tokens=True)
    assert r["stop_reason"] == "length"

    # a killed run: one more record made it to the part file, the next line was cut short
    part = tmp_path / "c.json.part0.jsonl"
    extra = dict(r, id="q2", prompt_ids=[14, 15, 16, 17], prompt="t14 t15 t16 t17")
    extra["completion_ids"] = autoregressive_generate(target, extra["prompt_ids"], 6).output_ids
    extra["completion"] = target.tokenizer.decode(extra["completion_ids"], skip_special_tokens=True)
    header = {k: v for k, v in first.items() if k in ("format", "version", "target", "generation")}
    part.write_text(json.dumps(header) + "\n" + json.dumps(extra) + "\n" + '{"id": "q3", "pro')

    generate_completions(target, prompts, out, settings(), batch_size=2)
    final = json.loads(out.read_text())
    assert [x["id"] for x in final["records"]] == ["q0", "q1", "q2", "q3", "q4"]  # prompt order, once each
    assert final["records"][:2] == first["records"] and final["records"][2] == extra
    assert not list(tmp_path.glob("*.part*")) and not list(tmp_path.glob("*.tmp"))
    before = out.read_bytes()
    generate_completions(target, prompts, out, settings(), batch_size=3)  # nothing left to do
    assert out.read_bytes() == before


def test_resume_with_other_settings_is_refused(hybrid_dir, tmp_path):
    target = TargetModel.load(hybrid_dir)
    prompts = load_prompts(str(write_prompts(tmp_path / "p.jsonl", 2)), quiet=True)
    generate_completions(target, prompts, tmp_path / "c.json", settings())
    with pytest.raises(FlashdraftError, match="generation setting 'max_new_tokens' is 6, this run uses 7"):
        generate_completions(target, prompts, tmp_path / "c.json", settings(max_new_tokens=7))
    other = make_target("hybrid", seed=1)
    with pytest.raises(FlashdraftError, match="made by target fingerprint"):
        generate_completions(other, prompts, tmp_path / "c.json", settings())


def test_multi_turn_prompts_answer_each_turn_after_the_previous_answer(tmp_path):
    target = make_target("qwen3")
    prompts = [Prompt("mt", ["t1 t2", "t3"]), Prompt("single", ["t4"])]
    generate_completions(target, prompts, tmp_path / "c.json", settings(), batch_size=2)
    records = {r.id: r for r in load_completions(tmp_path / "c.json", target, quiet=True)}
    assert sorted(records) == ["mt/turn1", "mt/turn2", "single"]
    t1, t2 = records["mt/turn1"], records["mt/turn2"]
    assert t2.prompt == t1.prompt + t1.completion + "\n\nt3"
    assert t2.completion_ids == autoregressive_generate(target, t2.prompt_ids, 6).output_ids


def test_min_prompt_tokens_keeps_only_long_turns_and_answers_short_ones_a_later_turn_reads(tmp_path, capsys):
    target = make_target("qwen3")
    # "mt": a short first turn whose answer is context for its long second turn; "short": one short turn
    prompts = [Prompt("mt", ["t1 t2", "t3"]), Prompt("short", ["t4"]), Prompt("long", [" ".join(["t5"] * 12)])]
    generate_completions(target, prompts, tmp_path / "all.json", settings(), batch_size=3)
    full = {r.id: r for r in load_completions(tmp_path / "all.json", target, quiet=True)}
    least = min(len(full["mt/turn2"].prompt_ids), len(full["long"].prompt_ids))
    assert least > max(len(full["mt/turn1"].prompt_ids), len(full["short"].prompt_ids))
    generate_completions(target, prompts, tmp_path / "c.json", settings(min_prompt_tokens=least), batch_size=3)
    records = {r.id: r for r in load_completions(tmp_path / "c.json", target, quiet=True)}
    assert sorted(records) == ["long", "mt/turn2"]
    assert records["mt/turn2"].prompt_ids == full["mt/turn2"].prompt_ids  # the first turn's answer is its context
    assert f"2 turns shorter than --min-prompt-tokens {least} left out" in capsys.readouterr().out


def test_generate_compiled_writes_the_eager_records_and_prints_what_compiled(tmp_path, capsys, monkeypatch):
    target = make_target("qwen3")
    prompts = load_prompts(str(write_prompts(tmp_path / "p.jsonl", 5)), quiet=True)  # batches of 2, 2 and 1
    # the static path uncompiled (tests/decoding/test_batched.py proves its one graph), not inductor's minutes on a CPU
    monkeypatch.setattr(completions_writer, "CompiledBatch", functools.partial(CompiledBatch, backend=None))
    generate_completions(target, prompts, tmp_path / "eager.json", settings(), batch_size=2)
    assert "static cache" not in capsys.readouterr().out
    generate_completions(target, prompts, tmp_path / "compiled.json", settings(), batch_size=2, compile=True)
    eager, compiled = (json.loads((tmp_path / f"{n}.json").read_text())["records"] for n in ("eager", "compiled"))
    assert compiled == eager
    out = capsys.readouterr().out
    assert "compiled (static cache): 0 compiles in 0.0 s, 0 recompiles, 0 graph breaks" in out


def test_compile_is_refused_with_a_server_backend_and_on_a_target_without_a_static_rule(tmp_path, hybrid_dir, capsys):
    prompts = str(write_prompts(tmp_path / "p.jsonl", 2))
    common = ["generate", "--target-model", str(hybrid_dir), "--prompts", prompts, "--out", str(tmp_path / "c.json")]
    assert run_cli([*common, "--compile", "--backend", "openai", "--base-url", "http://x"]) == 2
    assert "--compile decodes locally on a static cache: drop --backend openai and --engine" in capsys.readouterr().err
    target = TargetModel.load(hybrid_dir)
    target.vision = object()  # M-RoPE positions after an image: no static rule
    with pytest.raises(FlashdraftError, match="--compile refused: a vision-language target"):
        generate_completions(target, load_prompts(prompts, quiet=True), tmp_path / "c.json", settings(), compile=True)
