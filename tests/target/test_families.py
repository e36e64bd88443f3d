"""The target-family notes: a row adds what cannot be read (reasoning, notes) to a target flashdraft supports by its
layer kinds; a model type without a row works the same (support is read from the model, tests/target/
test_layer_kinds.py)."""

import pytest
from transformers import AutoConfig

from flashdraft.target.families import BY_MODEL_TYPE, FAMILIES, family_notes
from flashdraft.target.layer_kinds import ROLLBACK, read_support
from tests.conftest import run_cli, write_word_prompts
from tests.target.tiny_families import FAMILIES as TINY_FAMILIES
from tests.target.tiny_families import READ_TYPES, make_family_model


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES) + sorted(READ_TYPES) + ["qwen3", "llama", "qwen3_5_text"])
def test_every_type_the_tests_build_is_supported_by_its_layer_kinds_with_or_without_a_row(model_type):
    tiny = model_type in TINY_FAMILIES or model_type in READ_TYPES
    config = make_family_model(model_type).config if tiny else AutoConfig.for_model(model_type)
    support = read_support(config)
    assert set(support.layer_kinds) <= set(ROLLBACK) and len(support.rollback()) == len(support.kinds)
    notes = family_notes(config)
    assert (notes is not None) == (model_type in BY_MODEL_TYPE), model_type


def test_the_rows_keep_only_notes_and_the_multimodal_layout_reads_as_its_text_model():
    for family in FAMILIES.values():
        assert family.reasoning and family.cpu_engine and not hasattr(family, "layers")
    assert family_notes(AutoConfig.for_model("qwen3_5_moe")).model_type == "qwen3_5_moe"
    assert family_notes(AutoConfig.for_model("mistral")) is None  # no row, still supported
    assert read_support(AutoConfig.for_model("mistral", num_hidden_layers=2)).kinds == ["sliding"]
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
        ["init", *t, "--out", "init", "--target-layer-ids", "0,2", "--block-size", "4"],  # untrained: the check holds
        ["eval", "--checkpoint", "init", *t, "--completions", "c.json", "--served", "vllm", "--check-served"],
    ]
    for argv in stages:
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 0, (argv[0], err[-600:])
