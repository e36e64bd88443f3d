"""`flashdraft doctor DRAFTER_DIR | STATE_DICT`: the checks of `flashdraft.drafter.checkpoint_doctor`,
each finding with its fix, and the exit code: 0 clean, 1 problems found."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from flashdraft.drafter.checkpoint import save_drafter
from tests.conftest import doctor, fail_lines, make_drafter

# -- drafters ------------------------------------------------------------------------------------------


def test_a_clean_drafter_prints_what_it_is_and_passes_against_its_target(doctor_files, capsys):
    rc, out, err = doctor(capsys, doctor_files["drafter"], "--target-model", doctor_files["target"])
    assert rc == 0, out
    assert "2 layers (0-1 full non-causal; is_causal: false), hidden 64" in out  # saved: is_causal written
    assert "target_layer_ids [0, 2] of 4" in out
    assert "fc.weight [64, 128] holds 2 context layers; target_layer_ids [0, 2] name 2" in out
    assert "weights sha256 " in out and "hidden_size 64 equals the target's 64" in out
    assert out.strip().endswith("all checks passed")


def test_a_drafter_whose_fc_and_tensors_disagree_with_its_config_lists_every_problem(doctor_files, tmp_path, capsys):
    d = shutil.copytree(doctor_files["drafter"], tmp_path / "d")
    state = load_file(d / "model.safetensors")
    state["fc.weight"] = torch.zeros(64, 192)
    state.pop("layers.1.mlp.up_proj.weight")
    save_file(state, str(d / "model.safetensors"))
    rc, out, err = doctor(capsys, d)
    fails = fail_lines(out)
    assert rc == 1 and len(fails) == 2, out
    assert "fc.weight [64, 192] holds 3 context layers; target_layer_ids [0, 2] name 2" in fails[0]
    assert (
        "2 problems: tensor 'layers.1.mlp.up_proj.weight' is missing (expected [128, 64]); tensor 'fc.weight' "
        "has shape [64, 192], expected [64, 128]" in fails[1]
    )
    assert "2 check(s) failed" in out


def test_a_drafter_for_another_target_fails_each_mismatch_with_the_fix(doctor_files, tmp_path, capsys):
    save_drafter(
        make_drafter(
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            num_target_layers=6,
            target_layer_ids=[1, 5],
        ),
        tmp_path / "d",
    )
    rc, out, err = doctor(capsys, tmp_path / "d", "--target-model", doctor_files["target"])
    fails = fail_lines(out)
    assert rc == 1
    assert any("hidden_size 32 differs from the target's 64" in f and "made for another target" in f for f in fails)
    assert any("num_target_layers 6 differs from the target's 4" in f for f in fails)
    assert any("target_layer_ids [1, 5] within the target's layers 0..2" in f for f in fails)


def test_a_drafter_without_weights_or_with_a_broken_config_is_a_failed_check(doctor_files, tmp_path, capsys):
    d = shutil.copytree(doctor_files["drafter"], tmp_path / "d")
    (d / "model.safetensors").write_bytes(b"\x07" * 64)
    rc, out, err = doctor(capsys, d)
    assert rc == 1 and "not a readable safetensors file" in fail_lines(out)[0]
    (d / "config.json").write_text("{")
    rc, out, err = doctor(capsys, d)
    assert rc == 1 and "config.json: not valid JSON" in fail_lines(out)[0]


def test_a_bare_state_dict_shows_its_shapes_and_loads_for_a_target(doctor_files, tmp_path, capsys):
    path = tmp_path / "d.safetensors"
    save_file(make_drafter(target_layer_ids=[2]).state_dict(), str(path))
    rc, out, err = doctor(capsys, path)
    assert rc == 0, out
    assert "hidden 64, 2 layers, head_dim 16, heads 4 / kv heads 2; fc.weight [64, 64] holds 1 context layers" in out
    assert "stores no vocabulary, target layer ids, mask token or block size" in out
    rc, out, err = doctor(capsys, path, "--target-model", doctor_files["target"])
    assert rc == 0, out
    assert "loads for target" in out and "assumed: target_layer_ids [2]: reference default" in out
    save_file(make_drafter().state_dict() | {"fc.weight": torch.zeros(64, 100)}, str(path))
    rc, out, err = doctor(capsys, path)
    assert rc == 1 and "fc in_features a multiple of hidden" in fail_lines(out)[0]
