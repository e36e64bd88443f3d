import dataclasses

import pytest
import torch

from flashdraft.cli import main
from flashdraft.drafter.checkpoint import load_drafter
from tests.conftest import MASK, save_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("target"), "hybrid")


def test_init_writes_a_drafter_that_loads_with_default_layer_ids_and_mask_token(target_dir, tmp_path):
    assert main(["init", "--target-model", str(target_dir), "--out", str(tmp_path / "d"), "--block-size", "8"]) == 0
    drafter = load_drafter(tmp_path / "d")
    cfg = drafter.config
    assert cfg.target_layer_ids == [2] and cfg.num_target_layers == 4 and cfg.block_size == 8
    assert cfg.mask_token_id == MASK and cfg.hidden_size == 64 and cfg.vocab_size == 64


def test_init_refuses_a_mask_token_outside_the_vocabulary(target_dir, tmp_path, capsys):
    code = main(["init", "--target-model", str(target_dir), "--out", str(tmp_path / "d"), "--mask-token-id", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--mask-token-id 64" in err[0] and "0..63" in err[0]
    assert not (tmp_path / "d").exists()


def test_user_error_is_one_line_and_exit_code_2_unless_debug(tmp_path, capsys):
    assert main(["speculate", "--target-model", str(tmp_path / "none"), "--checkpoint", "x", "--prompt", "p"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    with pytest.raises(Exception, match="not a local model directory"):
        main(
            [
                "--debug",
                "speculate",
                "--target-model",
                str(tmp_path / "none"),
                "--checkpoint",
                "tiny-drafter",
                "--prompt",
                "p",
            ]
        )


def test_an_input_path_that_does_not_exist_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from flashdraft.target.model import TargetModel

    monkeypatch.setattr(TargetModel, "load", lambda *a, **k: pytest.fail("the target was loaded"))
    for command, flag in (("eval", "--checkpoint"), ("eval", "--cached-hidden-states"), ("cache", "--completions")):
        argv = [command, "--target-model", "tiny", flag, str(tmp_path / "runn"), "--out", str(tmp_path / "o")]
        if command == "eval":
            argv = [a for a in argv if a not in ("--out", str(tmp_path / "o"))]
        assert main(argv) == 2
        assert capsys.readouterr().err == f"error: {flag} {tmp_path / 'runn'}: no such file or directory\n"


def test_speculate_checks_losslessness_against_greedy(target_dir, tmp_path, capsys):
    main(["init", "--target-model", str(target_dir), "--out", str(tmp_path / "d"), "--block-size", "4"])
    code = main(
        [
            "speculate",
            "--target-model",
            str(target_dir),
            "--checkpoint",
            str(tmp_path / "d"),
            "--prompt",
            "t1 t2 t3 t4",
            "--max-new-tokens",
            "12",
        ]
    )
    assert code == 0 and "lossless True" in capsys.readouterr().out


def test_speculate_compile_decodes_on_the_static_cache_losslessly(target_dir, tmp_path, capsys, monkeypatch):
    # the static path run as written (compiling it is tests/decoding/test_verification.py's and eval's to prove)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    main(["init", "--target-model", str(target_dir), "--out", str(tmp_path / "d"), "--block-size", "4"])
    argv = ["speculate", "--target-model", str(target_dir), "--checkpoint", str(tmp_path / "d")]
    code = main([*argv, "--prompt", "t1 t2 t3 t4", "--max-new-tokens", "12", "--compile"])
    out = capsys.readouterr().out
    assert code == 0 and "lossless True" in out and "compiled (static cache): 0 compiles" in out
    code = main([*argv, "--prompt", "t1 t2 t3 t4", "--max-new-tokens", "12", "--no-compile"])
    out = capsys.readouterr().out
    assert code == 0 and "lossless True" in out and "static cache" not in out


def test_init_layers_from_target_copies_the_target_layer_and_refuses_a_count_mismatch(target_dir, tmp_path, capsys):
    from flashdraft.target.weights import TargetHead

    out = tmp_path / "d"
    args = ["init", "--target-model", str(target_dir), "--out", str(out), "--draft-layers", "1"]
    assert main([*args, "--layers-from-target", "3"]) == 0
    expected = TargetHead.load(target_dir).attention_layer_weights(3)
    own = load_drafter(out).layers[0].state_dict()
    for name, tensor in expected.items():
        assert torch.equal(own[name], tensor), name
    code = main([*args, "--out", str(tmp_path / "e"), "--layers-from-target", "1,3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "2 target layers for a drafter of 1 layers" in err[0]
    assert not (tmp_path / "e").exists()


def test_init_config_and_train_init_take_the_shipped_tiny_drafter_by_name(tmp_path, capsys):
    from flashdraft.drafter.run_dir import BUILTIN_DRAFTERS
    from flashdraft.target.weights import TargetHead
    from flashdraft.train.run import _starting_drafter

    assert (
        main(
            ["init", "--target-model", "tiny", "--out", str(tmp_path / "d"), "--config", "tiny-drafter", "--seed", "1"]
        )
        == 0
    ), capsys.readouterr().err
    cfg = load_drafter(tmp_path / "d").config
    assert cfg.target_layer_ids == [1, 2, 3] and cfg.num_hidden_layers == 2 and cfg.block_size == 16
    shape = dict(draft_layers=None, block_size=None, mask_token_id=None, target_layer_ids=None)
    drafter = _starting_drafter(TargetHead.load("tiny"), None, "tiny-drafter", shape, seed=0, verify=True)
    shipped = load_drafter(BUILTIN_DRAFTERS["tiny-drafter"])
    assert torch.equal(drafter.fc.weight, shipped.fc.weight)  # loaded, not a fresh drafter


def _dests(command: str) -> set[str]:
    from flashdraft.cli import build_parser

    return {a.dest for a in build_parser().commands[command]._actions if a.dest != "help"}


def test_eval_options_are_the_eval_config_fields_by_name():
    from flashdraft.evaluation.config import EvalConfig

    # what evaluate_drafter takes as its own arguments, and what eval writes after
    own = {"checkpoint", "drafter", "target_model", "device", "dtype", "json", "report"}
    assert _dests("eval") - own == set(EvalConfig.option_names())


@pytest.mark.parametrize("command", ["generate", "cache", "parity"])
def test_each_option_is_a_field_of_the_config_the_command_builds(command):
    from flashdraft.commands.parity import ParityConfig
    from flashdraft.data.cache_run import CacheConfig
    from flashdraft.data.generate import GenerateConfig

    # the command builds its config: one field per option
    config = {"generate": GenerateConfig, "cache": CacheConfig, "parity": ParityConfig}[command]
    assert _dests(command) == {f.name for f in dataclasses.fields(config)}
