"""The README's pipeline on a tiny target of each family with recurrent or latent caches, and of the types whose
support is read from the model alone (no family row): every stage exits 0,
and online evaluation is lossless with offline τ equal to online τ."""

import pytest

from tests.conftest import run_cli, write_word_prompts
from tests.target.tiny_families import FAMILIES, READ_TYPES, save_family_target


@pytest.mark.parametrize("model_type", list(FAMILIES) + list(READ_TYPES))
def test_every_stage_of_the_pipeline_runs_on_the_family(model_type, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    target = save_family_target(tmp_path / "target", model_type)
    write_word_prompts(tmp_path / "prompts.jsonl", 6)
    t = ["--target-model", target]
    stages = [
        ["generate", *t, "--prompts", "prompts.jsonl", "--out", "train.json", "--max-new-tokens", "24"],
        ["cache", *t, "--completions", "train.json", "--out", "cache", "--layers", "2"],
        ["init", *t, "--out", "init", "--draft-layers", "1", "--block-size", "4"],
        ["train", *t, "--cached-hidden-states", "cache", "--out", "run", "--init", "init", "--max-steps", "2"],
        ["train", *t, "--completions", "train.json", "--out", "online", "--init", "init", "--max-steps", "2"],
        ["eval", "--checkpoint", "run", *t, "--cached-hidden-states", "cache"],
        ["eval", "--checkpoint", "run", *t, "--completions", "train.json", "--online", "--check-consistency"],
        ["export", "--checkpoint", "run", "--out", "drafter", *t],
        ["doctor", "drafter", "--serving", *t],
    ]
    for argv in stages:
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 0, (argv[0], err[-400:])
        if "--check-consistency" in argv:
            assert "offline vs online: identical acceptance lengths" in out
        if "--serving" in argv:  # the layer kinds read and their rollback, each server's support said
            assert "caches roll back as" in out and "SGLang on it: " in out and "vLLM on a " in out
