import json

import pytest
import torch
from safetensors import safe_open

from flashdraft.cli import main
from flashdraft.drafter.checkpoint import check_drafter_matches_target, load_drafter, save_drafter
from flashdraft.drafter.run_dir import save_checkpoint
from flashdraft.drafter.server_fields import VLLM
from flashdraft.errors import FlashdraftError
from flashdraft.serving.export import export_drafter
from tests.conftest import make_dflash2_drafter, make_drafter, make_dspark_drafter, make_target, save_target


def write_form(form: str, tmp_path, drafter) -> str:
    if form == "directory":
        return str(save_drafter(drafter, tmp_path / "src", dtype=torch.bfloat16))
    if form == "run":  # a training checkpoint as the trainer writes it (with checksums.json)
        state = {k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()}
        save_checkpoint(tmp_path / "run", 50, drafter.config, state, {"step": 50}, keep=1)
        return str(tmp_path / "run")
    torch.save({k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()}, tmp_path / "d.pt")
    return str(tmp_path / "d.pt")


@pytest.mark.parametrize("form", ["directory", "run", "state dict"])
def test_export_writes_the_public_format_from_every_checkpoint_form(tmp_path, form):
    # RoPE and positions of a bare state dict come from the target: give the drafter the target's
    drafter = make_drafter(rope_theta=10000.0, max_position_embeddings=512)
    target = make_target("qwen3") if form == "state dict" else None
    export_drafter(
        write_form(form, tmp_path, drafter),
        tmp_path / "out",
        target,
        target_name="Qwen/Qwen3-8B",
        block_size=8,
        target_layer_ids=[0, 2],
    )
    loaded = load_drafter(tmp_path / "out")
    expected = drafter.config.to_dict()
    if target is not None:  # with the target, export names the mask token's string too
        expected["dflash_config"] = {**expected["dflash_config"], "mask_token": "<mask>"}
    assert loaded.config.to_dict() | {"dtype": None} == expected | {"dtype": None}
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.to(torch.bfloat16).float()), key
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as sf:
        assert sf.get_tensor("fc.weight").dtype == torch.bfloat16  # kept as stored
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_export_readme_has_the_vllm_and_sglang_command_lines(tmp_path):
    src = save_drafter(make_drafter(), tmp_path / "src")  # block size 8
    export_drafter(src, tmp_path / "out", target_name="Qwen/Qwen3-8B")
    readme = (tmp_path / "out" / "README.md").read_text()
    out = str(tmp_path / "out")
    spec = json.dumps({"method": "dflash", "model": out, "num_speculative_tokens": 7})
    assert f"\nvllm serve Qwen/Qwen3-8B --speculative-config '{spec}'" in readme  # no V2 runner: one layer kind
    assert readme.startswith("# DFlash drafter") and "DFlash2" not in readme
    assert "python -m sglang.launch_server --model-path Qwen/Qwen3-8B --speculative-algorithm DFLASH" in readme
    assert f"--speculative-draft-model-path {out}" in readme
    assert "at the time of writing" in readme


def test_export_cli_refuses_a_bare_state_dict_without_a_target(capsys, tmp_path):
    torch.save(make_drafter().state_dict(), tmp_path / "d.pt")
    assert main(["export", "--checkpoint", str(tmp_path / "d.pt"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "give --target-model" in err and "d.pt" in err
    assert not (tmp_path / "out").exists()


def test_export_cli_with_dtype(capsys, tmp_path):
    src = save_drafter(make_drafter(), tmp_path / "src")
    assert main(["export", "--checkpoint", str(src), "--out", str(tmp_path / "out"), "--dtype", "fp16"]) == 0
    assert "exported" in capsys.readouterr().out
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as sf:
        assert sf.get_tensor("norm.weight").dtype == torch.float16


def test_export_with_the_target_writes_the_mask_token_string_which_loads_back_against_it(tmp_path):
    target = make_target("qwen3")  # its tokenizer has '<mask>' at 63, the drafter's mask_token_id
    export_drafter(save_drafter(make_drafter(), tmp_path / "src"), tmp_path / "out", target)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dflash_config"]["mask_token"] == "<mask>" and config["dflash_config"]["mask_token_id"] == 63
    loaded = load_drafter(tmp_path / "out")
    assert loaded.config.mask_token == "<mask>"
    check_drafter_matches_target(loaded.config, target, "exported")  # SGLang's pair check passes
    export_drafter(tmp_path / "src", tmp_path / "plain")  # without a target the string is unknown: not written
    assert "mask_token" not in json.loads((tmp_path / "plain" / "config.json").read_text())["dflash_config"]


def test_export_refuses_a_target_the_drafter_was_not_made_for(tmp_path):
    src = save_drafter(make_drafter(hidden_size=32, num_attention_heads=2, num_key_value_heads=1), tmp_path / "src")
    with pytest.raises(FlashdraftError, match="field 'hidden_size' is 32; expected 64"):
        export_drafter(src, tmp_path / "out", make_target("qwen3"))
    assert not (tmp_path / "out" / "config.json").exists()


def test_export_cli_prints_each_layers_causality_and_the_serving_rules(capsys, tmp_path):
    target = save_target(tmp_path / "target", kind="qwen3")
    src = save_drafter(
        make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6), tmp_path / "src"
    )
    out_dir = tmp_path / "out"
    assert main(["export", "--checkpoint", str(src), "--out", str(out_dir), "--target-model", str(target)]) == 0
    out = capsys.readouterr().out
    assert "2 layers (0 sliding 6 causal, 1 full non-causal; servers' default: no is_causal)" in out
    assert f"serving rules (flashdraft doctor {out_dir} --serving):" in out
    assert "ok   causality layer 0 (sliding_attention): sliding window 6, causal within the block" in out
    assert "ok   causality layer 1 (full_attention): full, non-causal within the block" in out
    assert "ok   V2 runner: layers mix sliding and full attention" in out
    assert "ok   mask token: dflash_config.mask_token '<mask>' is token 63 of the target's tokenizer" in out
    assert f"vLLM:   VLLM_USE_V2_MODEL_RUNNER=1 vllm serve {target} --speculative-config" in out
    readme = (out_dir / "README.md").read_text()
    assert f"VLLM_USE_V2_MODEL_RUNNER=1 vllm serve {target}" in readme and "--speculative-num-draft-tokens 8" in readme
    assert "0 sliding 6 causal, 1 full non-causal" in readme and f"flashdraft doctor {out_dir} --serving" in readme


@pytest.mark.parametrize("form", ["directory", "run"])
def test_export_of_a_dflash2_drafter_writes_the_published_contract_and_reloads_identically(tmp_path, form):
    drafter = make_dflash2_drafter(layer_types=["sliding_attention"] * 2, sliding_window=6, is_causal=False)
    export_drafter(write_form(form, tmp_path, drafter), tmp_path / "out", target_name="Qwen/Qwen3-8B")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "target_layer_ids": [0, 2],
        "mask_token_id": 63,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
        "block_size": 8,
    }
    assert config["is_causal"] is False and "draft_vocab_size" not in config
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as sf:
        keys = set(sf.keys())
    published = {
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
    }
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            published |= {f"layers.{i}.{conv}.base_kernel", f"layers.{i}.{conv}.kernel_projection.weight"}
    assert published <= keys and not any(k.endswith(("codebook.weight", "base_kernel.weight")) for k in keys)
    loaded = load_drafter(tmp_path / "out")
    assert loaded.config.family == "dflash2"
    assert loaded.config.to_dict() | {"dtype": None} == drafter.config.to_dict() | {"dtype": None}
    assert loaded.state_dict().keys() == drafter.state_dict().keys()
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.to(torch.bfloat16).float()), key


def test_export_cli_of_a_dflash2_drafter_prints_its_rules_and_the_readme_gives_its_commands(capsys, tmp_path):
    target = save_target(tmp_path / "target", kind="qwen3")
    src = save_drafter(make_dflash2_drafter(), tmp_path / "src")
    out_dir = tmp_path / "out"
    assert main(["export", "--checkpoint", str(src), "--out", str(out_dir), "--target-model", str(target)]) == 0
    out = capsys.readouterr().out
    assert "ok   format: config.json architectures ['DFlash2DraftModel'], model_type 'qwen3'" in out
    assert f"ok   V2 runner: DFlash2DraftModel: {VLLM} runs qwen3_dflash2.py" in out
    assert "ok   SGLang DFlash2: --speculative-algorithm DFLASH with --speculative-num-draft-tokens 8" in out
    assert "FAIL" not in out
    spec = json.dumps({"method": "dflash", "model": str(out_dir), "num_speculative_tokens": 7})
    readme = (out_dir / "README.md").read_text()
    assert readme.startswith("# DFlash2 drafter")
    assert f"VLLM_USE_V2_MODEL_RUNNER=1 vllm serve {target} --speculative-config '{spec}'" in readme
    assert "--speculative-algorithm DFLASH \\\n" in readme and "--speculative-num-draft-tokens 8" in readme
    assert "the V1 runner, chosen when a feature V2 lacks is asked for, refuses it\nwith an error" in readme
    assert "`num_speculative_tokens` must be 7" in readme


def test_export_cli_of_a_dspark_drafter_prints_its_rules_and_the_readme_gives_its_commands(capsys, tmp_path):
    target = save_target(tmp_path / "target", kind="qwen3")
    src = save_drafter(make_dspark_drafter(), tmp_path / "src")
    out_dir = tmp_path / "out"
    assert main(["export", "--checkpoint", str(src), "--out", str(out_dir), "--target-model", str(target)]) == 0
    out = capsys.readouterr().out
    assert "ok   layout: anchor-first (DSpark)" in out and "FAIL" not in out
    readme = (out_dir / "README.md").read_text()
    assert readme.startswith("# DSpark drafter") and "block size 7 (7 drafted tokens per step)" in readme
    spec = json.dumps({"method": "dspark", "model": str(out_dir), "num_speculative_tokens": 7})
    assert f"vllm serve {target} --speculative-config '{spec}'" in readme
    assert "--speculative-algorithm DSPARK" in readme and "--speculative-dspark-block-size 7" in readme
    reloaded = load_drafter(out_dir)
    assert reloaded.config.family == "dspark" and reloaded.confidence_head is not None


def test_a_drafter_exported_with_yarn_reloads_with_it_in_flashdraft_transformers_5_and_a_legacy_reader(tmp_path):
    from transformers import Qwen3Config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    drafter = make_drafter(rope_scaling=yarn, max_position_embeddings=512, trained_context_length=120)
    export_drafter(save_drafter(drafter, tmp_path / "src"), tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    reloaded = load_drafter(tmp_path / "out")
    assert reloaded.config.rope_scaling == yarn and reloaded.config.trained_context_length == 120  # flashdraft
    gen = torch.Generator().manual_seed(0)
    blocks, ctx = torch.randn(1, 8, 64, generator=gen), torch.randn(1, 300, 128, generator=gen)
    with torch.no_grad():  # the same drafter at long positions, where YaRN changes the rotation
        args = (blocks, torch.tensor([[300]]), ctx, torch.arange(300)[None])
        torch.testing.assert_close(reloaded(*args), drafter(*args))
    params = Qwen3Config.from_dict(json.loads(json.dumps(written))).rope_parameters  # transformers 5
    assert params["rope_type"] == "yarn" and params["factor"] == 4.0 and params["rope_theta"] == written["rope_theta"]
    assert params["original_max_position_embeddings"] == 128
    legacy = written["rope_scaling"]  # a reader of the legacy key alone
    assert legacy["rope_type"] == "yarn" and legacy["factor"] == 4.0
    assert legacy["original_max_position_embeddings"] == 128
