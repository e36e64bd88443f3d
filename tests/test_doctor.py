"""`flashdraft doctor PATH` on every kind of PATH: what it is, what is wrong with it (each
finding with its fix), and the exit code: 0 clean, 1 problems found, 2 unusable input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from flashdraft.drafter.checkpoint import load_drafter, save_drafter
from flashdraft.drafter.run_dir import BUILTIN_DRAFTERS
from flashdraft.drafter.server_fields import SGLANG, VLLM
from tests.conftest import (
    doctor,
    fail_lines,
    make_dflash2_drafter,
    make_drafter,
    make_dspark_drafter,
    run_cli,
)

# -- what cannot be checked at all: exit 2 ------------------------------------------------------------


def test_an_unusable_path_is_exit_2_with_one_line(doctor_files, tmp_path, capsys):
    for path, expected in [
        (tmp_path / "absent", "no such file or directory"),
        (Path(__file__), "not something doctor can check"),
        (
            doctor_files["target"],
            "without dflash_config in config.json, not a DFlash drafter (a target? pass it as --target-model)",
        ),
    ]:
        rc, out, err = doctor(capsys, path)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
    (tmp_path / "x.json").write_text("{not json")
    rc, out, err = doctor(capsys, tmp_path / "x.json")
    assert rc == 2 and "not valid JSON" in err
    rc, out, err = doctor(capsys, doctor_files["drafter"], "--checkpoint", doctor_files["drafter"])
    assert rc == 2 and "names a drafter to check a cache or completions file against" in err


# -- completions and caches ----------------------------------------------------------------------------


def test_completions_print_their_header_and_pass_against_their_target(doctor_files, capsys):
    rc, out, err = doctor(
        capsys,
        doctor_files["completions"],
        "--target-model",
        doctor_files["target"],
        "--checkpoint",
        doctor_files["drafter"],
    )
    assert rc == 0, out
    assert "4 records, token ids from target" in out and "4 of 4 records valid" in out
    assert "generation: prompts" in out and "max_new_tokens 10" in out
    assert "the same as" in out and "vocab_size 64 equals the drafter's 64" in out


def test_bad_records_a_foreign_target_and_an_unfinished_run_are_each_reported(doctor_files, tmp_path, capsys):
    path = Path(shutil.copy(doctor_files["completions"], tmp_path / "c.json"))
    data = json.loads(path.read_text())
    data["records"][2]["completion_ids"] = [1, 99]
    path.write_text(json.dumps(data))
    (tmp_path / "c.json.part0.jsonl").write_text("{}\n")
    rc, out, err = doctor(capsys, path, "--target-model", doctor_files["other"])
    fails = fail_lines(out)
    assert rc == 1 and len(fails) == 3, out
    assert "c.json.part0.jsonl exist" in fails[0] and "re-run the same flashdraft generate command" in fails[0]
    assert "3 of 4 records valid; q2: completion_ids has 1 ids outside the vocabulary 0..63" in fails[1]
    assert "not" in fails[2] and "--allow-foreign-completions" in fails[2]
    path.unlink()  # only the parts of an unfinished run are left
    rc, out, err = doctor(capsys, path)
    assert rc == 1 and "c.json.part0.jsonl exist" in out


def test_a_cache_with_nan_features_or_other_layers_fails_with_the_fix(doctor_files, tmp_path, capsys):
    cache = shutil.copytree(doctor_files["cache"], tmp_path / "cache")
    shard = cache / "shard-00000.safetensors"
    tensors = load_file(shard)
    tensors["context_features"][5, 70] = float("inf")
    save_file(tensors, str(shard))
    save_drafter(make_drafter(target_layer_ids=[1, 2]), tmp_path / "d")
    rc, out, err = doctor(capsys, cache, "--checkpoint", tmp_path / "d", "--no-verify")
    fails = fail_lines(out)
    assert rc == 1 and len(fails) == 2, out
    assert "sha256 of 1 shard files not checked (--no-verify)" in out
    assert "1 records are not; first: record 'q0' has NaN/Inf context features at token 5 of layer 2" in fails[0]
    assert "layer ids [0, 2] differ from the drafter's target_layer_ids [1, 2]" in fails[1]
    assert "flashdraft cache --layers 1,2" in fails[1]
    assert "layers [0, 2] (context-layer count 2)" in out and "fingerprints: target" in out


def test_an_unfinished_cache_says_to_rerun_the_same_command(doctor_files, tmp_path, capsys):
    cache = shutil.copytree(doctor_files["cache"], tmp_path / "cache")
    (cache / "manifest.json").unlink()
    (cache / ".progress").mkdir()
    rc, out, err = doctor(capsys, cache)
    assert rc == 1 and "an unfinished run" in out and "re-run the same flashdraft cache command" in fail_lines(out)[0]


# -- serving rules (doctor DRAFTER --serving) ------------------------------------------------------

SERVING_RULES = [
    "format: config.json architectures",
    "tensors, every public key with its shape",
    "target layers: ",
    "causality layer 0 ",
    "V2 runner: ",
    "mask token: mask_token_id",
    "mask token: dflash_config.mask_token",
    "file modes: ",
    "vocabulary: ",
    "block size: ",
    "scalings: ",
    "server fields: ",
]


def rule_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("ok   ", "warn ", "FAIL "))]


def save_readable(drafter, directory: Path) -> Path:
    """A saved drafter with 0644 files (what the file-mode rule wants), whatever save_file wrote."""
    save_drafter(drafter, directory)
    for f in directory.iterdir():
        f.chmod(0o644)
    return directory


def test_serving_on_the_tiny_drafter_lists_every_rule_with_its_server_and_the_commands(capsys):
    rc, out, err = doctor(capsys, "tiny-drafter", "--serving", "--target-model", "tiny")
    assert rc == 0, out + err
    lines = rule_lines(out)
    for rule in SERVING_RULES:
        assert any(rule in line for line in lines), (rule, out)
    serving = [line for line in lines if any(rule in line for rule in SERVING_RULES)]
    assert all(VLLM in line or SGLANG in line for line in serving), serving
    assert "causality layer 1 (full_attention): full, non-causal within the block" in out
    assert "V2 runner: layers all full_attention" in out
    assert "vLLM:   vllm serve " in out and '"num_speculative_tokens": 15' in out
    assert "SGLang: python -m sglang.launch_server --model-path " in out and "--speculative-num-draft-tokens 16" in out
    assert "2 layers (0-1 full non-causal; is_causal: false)" in out  # the plain description too
    assert "VLLM_USE_V2_MODEL_RUNNER" not in out.split("vLLM:   ")[1]  # plain DFlash, one kind of layer
    assert not any("DFlash2" in line for line in lines if not line.startswith("ok   scalings: ")), out


def test_serving_prints_the_sampling_rule_of_each_command_and_of_a_command_given(capsys):
    rc, out, err = doctor(capsys, "tiny-drafter", "--serving")
    assert rc == 0, out + err
    assert "sampling at T > 0 under vllm serve <target-model>: eval --serving-rule vllm; " in out
    assert "sampling at T > 0 under python -m sglang.launch_server: eval --serving-rule sglang; " in out
    assert "dflash: argmax walk, q one-hot, accept with p(d)" in out
    spec = '{"method": "dflash", "draft_sample_method": "probabilistic"}'
    rc, out, err = doctor(capsys, "tiny-drafter", "--serving-command", f"vllm serve m --speculative-config '{spec}'")
    assert rc == 0, out + err
    assert "eval --serving-rule vllm-probabilistic; " in out and "--serving-rule sglang" not in out


def test_serving_on_a_sliding_drafter_gives_each_layer_its_causality_and_the_v2_runner(doctor_files, tmp_path, capsys):
    d = save_readable(
        make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6), tmp_path / "d"
    )
    rc, out, err = doctor(capsys, d, "--serving", "--target-model", doctor_files["target"])
    assert rc == 0 and not fail_lines(out), out
    assert "2 layers (0 sliding 6 causal, 1 full non-causal; servers' default: no is_causal)" in out
    assert (
        "ok   causality layer 0 (sliding_attention): sliding window 6, causal within the block (servers' "
        f"default for sliding_attention); {VLLM} and {SGLANG} serve it the same" in out
    )
    assert "ok   causality layer 1 (full_attention): full, non-causal within the block" in out
    assert (
        f"ok   V2 runner: layers mix sliding and full attention: {VLLM} serves them on its V2 model runner, "
        "its default; its V1 runner refuses them" in out
    )
    assert f"vLLM:   VLLM_USE_V2_MODEL_RUNNER=1 vllm serve {doctor_files['target']} " in out
    assert "ok   file modes: readable by other users (config.json 0644, model.safetensors 0644" in out
    assert "warn mask token: dflash_config.mask_token absent" in out  # a flashdraft save without a target
    assert out.strip().endswith("warning(s))")


def test_serving_warns_when_the_weights_are_not_readable_by_other_users(doctor_files, tmp_path, capsys):
    d = save_readable(make_drafter(), tmp_path / "d")
    (d / "model.safetensors").chmod(0o600)
    rc, out, err = doctor(capsys, d, "--serving")
    assert rc == 0, out  # a warning: the drafter is fine, the server's user may not read it
    assert "warn file modes: not readable by other users (config.json 0644, model.safetensors 0600" in out
    assert f"fix: chmod a+r {d / 'model.safetensors'}" in out


def test_serving_fails_a_drafter_relying_on_dflash_config_causal_which_sglang_does_not_read(tmp_path, capsys):
    d = save_readable(
        make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6), tmp_path / "d"
    )
    config = json.loads((d / "config.json").read_text())
    config.pop("is_causal", None)
    config["dflash_config"]["causal"] = False  # vLLM: every layer non-causal; SGLang: its default per layer type
    (d / "config.json").write_text(json.dumps(config))
    rc, out, err = doctor(capsys, d, "--serving")
    fails = fail_lines(out)
    assert rc == 1 and len(fails) == 1, out
    assert (
        "causality layer 0 (sliding_attention): sliding window 6, non-causal within the block "
        f"(dflash_config.causal: false, read by vLLM only) in flashdraft, but {VLLM} serves it sliding "
        f"window 6, non-causal within the block and {SGLANG} sliding window 6, causal within the block" in fails[0]
    )
    assert "re-export it" in fails[0]


def test_serving_fails_a_mask_token_string_the_tokenizer_knows_by_another_id(doctor_files, tmp_path, capsys):
    d = save_readable(make_drafter(mask_token_id=60, extra={"dflash_config": {"mask_token": "<mask>"}}), tmp_path / "d")
    rc, out, err = doctor(capsys, d, "--serving", "--target-model", doctor_files["target"])
    fails = fail_lines(out)
    assert rc == 1 and len(fails) == 1, out
    assert (
        "mask token: dflash_config.mask_token '<mask>' is token 63 of the target's tokenizer, not "
        f"mask_token_id 60: {SGLANG} speculative/dflash_worker_v2.py _resolve_mask_token_id refuses the "
        "pair" in fails[0]
    )


def test_serving_warns_that_sglang_ignores_a_reduced_vocabulary_and_the_reference_scalings(tmp_path, capsys):
    d = save_readable(
        make_drafter(draft_vocab_size=32, extra={"dflash_config": {"output_multiplier": 2.0}}), tmp_path / "d"
    )
    rc, out, err = doctor(capsys, d, "--serving")
    assert rc == 0, out
    assert f"warn vocabulary: draft_vocab_size 32 with its own lm_head and d2t: {VLLM} serves it" in out
    assert "DFlashDraftModel has no lm_head, its load_weights skips lm_head.weight and d2t" in out
    assert "warn scalings: dflash_config.output_multiplier 2.0: flashdraft trains and evaluates with it" in out


def test_serving_needs_a_drafter_directory(doctor_files, capsys):
    rc, out, err = doctor(capsys, doctor_files["run"], "--serving")
    assert rc == 2 and "--serving: checks a drafter directory" in err and "flashdraft export" in err


DFLASH2_RULES = [
    "format: config.json architectures ['DFlash2DraftModel'], model_type 'qwen3'",
    "tensors, every public key with its shape, DFlash2's",
    "V2 runner: DFlash2DraftModel: ",
    "vocabulary: the full target vocabulary",
    f"block size: block_size 8: {VLLM} qwen3_dflash2.py",
    "SGLang DFlash2: ",
    "scalings: ",
]


def test_serving_on_a_dflash2_drafter_lists_each_dflash2_rule_and_the_commands(doctor_files, tmp_path, capsys):
    # as published: every layer sliding and is_causal false, so only DFlash2 itself needs the V2 runner
    d = save_readable(
        make_dflash2_drafter(layer_types=["sliding_attention"] * 2, sliding_window=6, is_causal=False), tmp_path / "d"
    )
    rc, out, err = doctor(capsys, d, "--serving", "--target-model", doctor_files["target"])
    assert rc == 0 and not fail_lines(out), out
    lines = rule_lines(out)
    for rule in SERVING_RULES + DFLASH2_RULES:
        assert any(rule in line for line in lines), (rule, out)
    dflash2 = [line for line in lines if any(rule in line for rule in DFLASH2_RULES)]
    assert len(dflash2) == len(DFLASH2_RULES) and all(VLLM in x or SGLANG in x for x in dflash2)
    assert (
        "maps DFlash2DraftModel to qwen3_dflash2.py (v1/worker/gpu/spec_decode/dflash2/), V2 runner (its "
        "default), with "
        '--speculative-config method "dflash" as for DFlash' in out
    )
    assert "candidate_selector predecessor_codebook / successor_codebook without '.weight', as published" in out
    assert (
        f"ok   V2 runner: DFlash2DraftModel: {VLLM} runs qwen3_dflash2.py (v1/worker/gpu/spec_decode/"
        "dflash2/) on its V2 model runner, its default; its V1 runner (chosen when a feature V2 lacks is asked "
        'for) refuses it with "Model Runner V1 does not support: DFlash candidate-head drafts"' in out
    )
    assert "ok   vocabulary: the full target vocabulary (no draft_vocab_size, no d2t)" in out
    assert (
        "takes the convolutions' block length from 1 + num_speculative_tokens, not from block_size: "
        "num_speculative_tokens 7 (= block_size - 1); any other value convolves across a different "
        "block" in out
    )
    assert (
        "ok   SGLang DFlash2: --speculative-algorithm DFLASH with --speculative-num-draft-tokens 8 (= block_size" in out
        and "conv_kernel_size 2, conv_group_size 16, selector_rank 8, selector_top_k 4" in out
    )
    spec = json.dumps({"method": "dflash", "model": str(d), "num_speculative_tokens": 7})
    assert (
        f"vLLM:   VLLM_USE_V2_MODEL_RUNNER=1 vllm serve {doctor_files['target']} --speculative-config '{spec}'" in out
    )
    assert (
        f"SGLang: python -m sglang.launch_server --model-path {doctor_files['target']} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {d} --speculative-num-draft-tokens 8" in out
    )


@pytest.mark.parametrize("rename", [None, ".weight"])
def test_serving_fails_a_dflash2_drafter_whose_codebook_is_missing_or_misnamed(doctor_files, tmp_path, capsys, rename):
    d = save_readable(make_dflash2_drafter(), tmp_path / "d")
    state = load_file(d / "model.safetensors")
    codebook = state.pop("candidate_selector.successor_codebook")
    if rename:  # the nn.Linear habit; the published name has no `.weight`
        state["candidate_selector.successor_codebook" + rename] = codebook
    save_file(state, str(d / "model.safetensors"))
    rc, out, err = doctor(capsys, d, "--serving")
    tensors = [line for line in fail_lines(out) if "every public key with its shape, DFlash2's 11 included" in line]
    assert rc == 1 and len(tensors) == 1, out
    assert "neither notices a missing tensor): 'candidate_selector.successor_codebook' missing" in tensors[0]
    assert ("'candidate_selector.successor_codebook.weight' unexpected" in tensors[0]) == bool(rename)


def test_serving_warns_of_a_field_only_one_server_reads_and_names_the_re_export_that_fixes_it(tmp_path, capsys):
    drafter = make_drafter()
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text()) | {"use_gemma_norm": True}
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    rc, out, _ = run_cli(capsys, "doctor", tmp_path / "d", "--serving")
    assert rc == 0
    line = next(x for x in out.splitlines() if "server fields: use_gemma_norm" in x)
    assert line.startswith("warn") and SGLANG in line and "re-export" in out
    assert "config.json sets use_gemma_norm = true" in out  # the plain description lists it too


DSPARK_RULES = [
    "format: config.json architectures ['Qwen3DSparkModel'], model_type 'qwen3'",
    "the Markov head's markov_head.markov_w1 / markov_w2.weight [64, 8] and confidence_head.proj",
    "layout: anchor-first (DSpark)",
    "confidence head: enable_confidence_head true",
    "adaptive verification: ",
    "Markov head: vanilla, rank 8",
    "vocabulary: the full target vocabulary",
    f"block size: block_size 7: {VLLM} qwen3_dspark.py",
]


def test_serving_on_a_dspark_drafter_lists_each_dspark_rule_and_the_commands(doctor_files, tmp_path, capsys):
    d = save_readable(make_dspark_drafter(), tmp_path / "d")
    rc, out, err = doctor(capsys, d, "--serving", "--target-model", doctor_files["target"])
    assert rc == 0 and not fail_lines(out), out
    lines = rule_lines(out)
    for rule in SERVING_RULES + DSPARK_RULES:
        assert any(rule in line for line in lines), (rule, out)
    assert "warn adaptive verification: the confidence head estimates each draft's acceptance" in out
    assert "so N must be 7 (= block_size)" in out
    spec = json.dumps({"method": "dspark", "model": str(d), "num_speculative_tokens": 7})
    assert f"vLLM:   vllm serve {doctor_files['target']} --speculative-config '{spec}'" in out
    assert (
        f"SGLang: python -m sglang.launch_server --model-path {doctor_files['target']} --speculative-algorithm DSPARK "
        f"--speculative-draft-model-path {d} --speculative-dspark-block-size 7" in out
    )


def test_serving_fails_a_dspark_config_that_leaves_the_confidence_fields_to_the_servers_defaults(
    doctor_files, tmp_path, capsys
):
    d = save_readable(make_dspark_drafter(confidence_head=False, confidence_head_with_markov=False), tmp_path / "d")
    config = json.loads((d / "config.json").read_text())
    del config["enable_confidence_head"], config["confidence_head_with_markov"]
    (d / "config.json").write_text(json.dumps(config))
    rc, out, _ = doctor(capsys, d, "--serving", "--target-model", doctor_files["target"])
    assert rc == 1 and any("confidence head: enable_confidence_head null" in line for line in fail_lines(out)), out


def test_serving_names_the_trained_context_and_warns_when_served_past_it(doctor_files, tmp_path, capsys):
    drafter = doctor_files["run"] / "checkpoints" / "step-0000002" / "drafter"
    trained = json.loads((drafter / "config.json").read_text())["trained_context_length"]
    d = save_readable(load_drafter(drafter), tmp_path / "d")
    rc, out, err = doctor(capsys, d, "--serving", "--max-model-len", trained)
    assert rc == 0, out + err
    assert f"ok   trained context: {trained} tokens (trained_context_length) covers the served context" in out
    assert "context read per step at" in out and "layers 0-1 (full)" in out
    rc, out, err = doctor(capsys, d, "--serving", "--max-model-len", 32768)
    assert rc == 0, out + err  # a warning, not a failure
    assert (
        f"warn trained context: the served context (--max-model-len) is 32768 tokens, past the {trained} tokens "
        f"the drafter was trained at (trained_context_length)" in out
    )
    assert "layers 0-1 (full) 32768 each: 65536 per step in all" in out
    rc, out, err = doctor(capsys, "tiny-drafter", "--serving")  # stage 2 of the long-context recipe: 3,748 tokens
    assert (
        "warn trained context: the served context (the drafter's max_position_embeddings) is 4096 tokens, past "
        "the 3748 tokens the drafter was trained at" in out
    )
    unknown = tmp_path / "unknown"
    shutil.copytree(BUILTIN_DRAFTERS["tiny-drafter"], unknown)
    config = json.loads((unknown / "config.json").read_text())
    del config["trained_context_length"]  # a drafter from before the field, or from another trainer
    (unknown / "config.json").write_text(json.dumps(config))
    rc, out, err = doctor(capsys, unknown, "--serving")
    assert "trained context: unknown (config.json has no trained_context_length" in out
    assert "the served context (the drafter's max_position_embeddings): 4096 tokens" in out


def test_serving_warns_when_the_target_has_rope_scaling_the_drafter_lacks(doctor_files, tmp_path, capsys):
    target = tmp_path / "yarn-target"
    shutil.copytree(doctor_files["target"], target)
    config = json.loads((target / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    config["rope_parameters"] = {**config.get("rope_parameters", {}), **yarn}
    (target / "config.json").write_text(json.dumps(config))
    d = save_readable(
        make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6), tmp_path / "d"
    )
    rc, out, err = doctor(capsys, d, "--serving", "--target-model", target)
    assert rc == 0, out + err
    assert (
        "warn rope scaling: the drafter's native (no scaling) differs from the target's yarn factor 4, "
        "original_max_position_embeddings 128"
        in out
        and "--rope-scaling" in out
    )
    served = config["max_position_embeddings"]
    assert f"layer 0 (sliding 6) 6, layer 1 (full) {served}: {served + 6} per step in all" in out
    rc, out, err = doctor(
        capsys, save_readable(make_drafter(rope_scaling=yarn), tmp_path / "y"), "--serving", "--target-model", target
    )
    assert "ok   rope scaling: the drafter's yarn factor 4, original_max_position_embeddings 128 is the target's" in out


def test_max_model_len_without_serving_is_one_line_exit_2(doctor_files, capsys):
    rc, out, err = doctor(capsys, doctor_files["drafter"], "--max-model-len", 4096)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "expected --serving with it" in err


def test_doctor_serving_opens_its_rules_with_a_verdict_counting_them(doctor_files, capsys):
    rc, out, err = doctor(capsys, doctor_files["drafter"], "--serving")
    lines = out.splitlines()
    verdict = next(i for i, line in enumerate(lines) if "serving rules (vLLM and SGLang):" in line)
    assert lines[verdict + 1].strip().startswith("serving rules, read from")  # the rules follow the verdict
    ok, warn, fail = (int(x.split()[0]) for x in lines[verdict].split(": ", 1)[1].split(", "))
    rules = lines[verdict + 1 :]
    assert ok == sum(r.startswith("ok ") for r in rules) and warn == sum(r.startswith("warn ") for r in rules)
    assert fail == sum(r.startswith("FAIL ") for r in rules) and (rc == 1) == (fail > 0)
