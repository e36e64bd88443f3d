"""The target-family table: every family the tiny configs build is in it, each layer kind it names rolls back a
known way, and a model type outside it is refused before its weights load, in one line naming it and the
supported ones."""

import json

import pytest
from transformers import AutoConfig

from flashdraft.errors import FlashdraftError
from flashdraft.target.families import BY_MODEL_TYPE, FAMILIES, ROLLBACK, target_family
from tests.conftest import run_cli, save_target, write_word_prompts
from tests.target.tiny_families import FAMILIES as TINY_FAMILIES


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES) + ["qwen3", "llama", "qwen3_5_text"])
def test_every_family_the_tests_build_is_in_the_table(model_type):
    assert target_family(AutoConfig.for_model(model_type)).model_type in FAMILIES


def test_each_family_names_layer_kinds_with_a_rollback_and_a_reasoning_style():
    for family in FAMILIES.values():
        assert family.layers and set(family.layers) <= set(ROLLBACK), family.model_type
        assert len(family.rollback()) == len(family.layers) and family.vllm and family.cpu_engine
    assert target_family(AutoConfig.for_model("qwen3_5_moe")).model_type == "qwen3_5_moe"  # the multimodal layout


def test_a_model_type_outside_the_table_is_refused_in_one_line_before_any_work(tmp_path, capsys):
    with pytest.raises(FlashdraftError, match=r"model type 'mistral' is not a target family flashdraft knows"):
        target_family(AutoConfig.for_model("mistral"), "somewhere")
    target = save_target(tmp_path / "target", "qwen3")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"model_type": "phi3", "architectures": ["X"]}))
    write_word_prompts(tmp_path / "p.jsonl", 2)
    for argv in (
        ["generate", "--target-model", target, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "c.json"],
        ["init", "--target-model", target, "--out", tmp_path / "init"],
    ):
        rc, _, err = run_cli(capsys, *argv)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(lines) == 1 and "'phi3'" in lines[0] and "qwen3_moe" in lines[0], err
        assert "Traceback" not in err
    assert len(BY_MODEL_TYPE) > len(FAMILIES)  # aliases: text configs and multimodal layouts


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_the_cpu_engine_serves_a_drafter_on_the_family_step_for_step_as_flashdraft_walks_it(
    model_type, tmp_path, capsys, monkeypatch
):
    from tests.target.tiny_families import save_family_target

    monkeypatch.chdir(tmp_path)
    t = ["--target-model", save_family_target(tmp_path / "target", model_type)]
    write_word_prompts(tmp_path / "p.jsonl", 4)
    stages = [
        ["generate", *t, "--prompts", "p.jsonl", "--out", "c.json", "--max-new-tokens", "32"],
        ["init", *t, "--out", "init", "--target-layer-ids", "0,2", "--block-size", "4"],
        ["train", *t, "--completions", "c.json", "--out", "run", "--init", "init", "--max-steps", "40"],
        ["eval", "--checkpoint", "run", *t, "--completions", "c.json", "--served", "vllm", "--check-served"],
    ]
    if model_type == "qwen3_moe":  # the engine's capture, checked against the target
        stages.append(["cache", *t, "--completions", "c.json", "--out", "cache", "--layers", "0,2", "--engine", "vllm"])
    for argv in stages:
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 0, (argv[0], err[-600:])
