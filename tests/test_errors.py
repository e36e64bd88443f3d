"""Every bad input a user can hand the CLI ends in exit code 2 and one line on stderr naming the
file, field or tensor, what was found and what was expected (`--debug` shows the traceback).
Valid records next to invalid ones are still counted and used where the command allows it.

One module-level set of files (a tiny random target saved as a user has it, its completions,
their cache and a drafter) is made once; each test damages a copy of what it needs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft.cli import main
from flashdraft.drafter.checkpoint import save_drafter
from flashdraft.errors import FlashdraftError
from flashdraft.files import sha256_file
from tests.conftest import make_drafter, make_hf_model, make_tokenizer

PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's lines on stderr are progress, not messages


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def refused(capsys, *argv) -> str:
    """Run the CLI, require exit 2 with exactly one message line, and return it."""
    rc, out, err = run(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip() and not PROGRESS_BAR.search(line)]
    assert rc == 2, f"exit {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def save_target(directory: Path, embed_scale: float = 1.0) -> Path:
    model = make_hf_model("qwen3")
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("errors")
    target = save_target(root / "target")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": " ".join(f"t{(5 * i + k) % 60}" for k in range(4 + i))}) + "\n"
            for i in range(5)
        )
    )
    assert (
        main(
            [
                "generate",
                "--target-model",
                str(target),
                "--prompts",
                str(prompts),
                "--out",
                str(root / "c.json"),
                "--max-new-tokens",
                "12",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "cache",
                "--target-model",
                str(target),
                "--completions",
                str(root / "c.json"),
                "--out",
                str(root / "cache"),
                "--layers",
                "0,2",
                "--dtype",
                "fp32",
                "--records-per-shard",
                "2",
            ]
        )
        == 0
    )
    save_drafter(make_drafter(), root / "drafter")  # layers [0, 2] of 4, block size 8, mask token 63
    return {
        "root": root,
        "target": target,
        "prompts": prompts,
        "completions": root / "c.json",
        "cache": root / "cache",
        "drafter": root / "drafter",
    }


def eval_args(files, checkpoint, **source) -> list:
    src = source or {"completions": files["completions"]}
    flags = [x for k, v in src.items() for x in (f"--{k.replace('_', '-')}", v)]
    return ["eval", "--checkpoint", checkpoint, "--target-model", files["target"], "--max-blocks", 2, *flags]


def train_args(files, out, *source, layer_ids: str = "0,2") -> list:
    return [
        "train",
        "--target-model",
        files["target"],
        "--out",
        out,
        "--max-steps",
        1,
        "--batch-size",
        2,
        "--num-anchors",
        4,
        "--block-size",
        4,
        "--target-layer-ids",
        layer_ids,
        *source,
    ]


# -- drafters ---------------------------------------------------------------------------------------


def _state_edit(edit):
    def damage(d: Path) -> None:
        state = load_file(d / "model.safetensors")
        edit(state)
        save_file(state, str(d / "model.safetensors"))

    return damage


def _json_edit(edit):
    """A damage that edits a JSON file in place."""

    def damage(path: Path) -> None:
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))

    return damage


def _config_edit(edit):
    return lambda d: _json_edit(edit)(d / "config.json")


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


DRAFTER_DAMAGE = {
    "missing tensor": (
        _state_edit(lambda s: s.pop("layers.1.mlp.up_proj.weight")),
        "tensor 'layers.1.mlp.up_proj.weight' is missing; expected shape [128, 64]",
    ),
    "unexpected tensor": (
        _state_edit(lambda s: s.update({"layers.2.mlp.up_proj.weight": torch.zeros(128, 64)})),
        "unexpected tensor 'layers.2.mlp.up_proj.weight' with shape [128, 64]",
    ),
    "mis-shaped tensor": (
        _state_edit(lambda s: s.update({"layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})),
        "tensor 'layers.0.self_attn.k_proj.weight' has shape [64, 64]; expected [32, 64]",
    ),
    "fc not a multiple of hidden": (
        _state_edit(lambda s: s.update({"fc.weight": torch.zeros(64, 100)})),
        "in_features 100 is not a multiple of hidden_size 64",
    ),
    "fc not matching target_layer_ids": (
        _state_edit(lambda s: s.update({"fc.weight": torch.zeros(64, 192)})),
        "shape [64, 192] (3 context layers) but the config's target_layer_ids [0, 2] need [64, 128]",
    ),
    "mask token out of range": (
        _config_edit(lambda c: c["dflash_config"].update(mask_token_id=64)),
        "field 'dflash_config.mask_token_id' is 64; expected a token id in 0..63",
    ),
    "block size < 2": (
        _config_edit(lambda c: c.update(block_size=1)),
        "field 'block_size' is 1; expected an integer >= 2",
    ),
    "unknown layer type": (
        _config_edit(lambda c: c.update(layer_types=["full_attention", "banded"])),
        "field 'layer_types' is 'banded'; expected one of full_attention, sliding_attention",
    ),
    "not a DFlash config": (_config_edit(lambda c: c.pop("dflash_config")), "field 'dflash_config' is None"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{"), "config.json: not valid JSON"),
    "no config.json": (lambda d: (d / "config.json").unlink(), "no config.json; expected a drafter directory"),
    "unsorted target_layer_ids": (
        _config_edit(lambda c: c["dflash_config"].update(target_layer_ids=[2, 0])),
        "field 'dflash_config.target_layer_ids' is [2, 0]; expected unique, strictly "
        "increasing ids: vLLM and SGLang capture target layers in layer order (e.g. "
        "[0, 2])",
    ),
    "truncated safetensors": (_truncate, "model.safetensors: not a readable safetensors file (truncated or corrupt"),
    "corrupt safetensors": (
        lambda d: (d / "model.safetensors").write_bytes(b"\x07" * 64),
        "model.safetensors: not a readable safetensors file (truncated or corrupt",
    ),
    "no weights": (
        lambda d: (d / "model.safetensors").unlink(),
        "no model.safetensors or model.safetensors.index.json; expected the drafter's weights there",
    ),
}


@pytest.mark.parametrize("case", DRAFTER_DAMAGE)
def test_a_damaged_drafter_is_refused_naming_file_and_tensor_or_field(files, tmp_path, capsys, case):
    damage, expected = DRAFTER_DAMAGE[case]
    drafter = shutil.copytree(files["drafter"], tmp_path / "d")
    damage(drafter)
    line = refused(capsys, *eval_args(files, drafter))
    assert str(drafter) in line and expected in line, line


FOREIGN_DRAFTERS = {
    "hidden_size": (
        dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64),
        "field 'hidden_size' is 32; expected 64 (the target's hidden size)",
    ),
    "vocab_size": (dict(vocab_size=128), "field 'vocab_size' is 128; expected 64 (the target's LM head rows)"),
}


@pytest.mark.parametrize("command", ["eval", "speculate", "train --init"])
@pytest.mark.parametrize("field", FOREIGN_DRAFTERS)
def test_a_drafter_made_for_another_target_is_refused(files, tmp_path, capsys, command, field):
    overrides, expected = FOREIGN_DRAFTERS[field]
    save_drafter(make_drafter(**overrides), tmp_path / "d")
    argv = {
        "eval": eval_args(files, tmp_path / "d"),
        "speculate": [
            "speculate",
            "--target-model",
            files["target"],
            "--checkpoint",
            tmp_path / "d",
            "--prompt",
            "t1 t2",
        ],
        "train --init": [
            "train",
            "--target-model",
            files["target"],
            "--init",
            tmp_path / "d",
            "--out",
            tmp_path / "run",
            "--completions",
            files["completions"],
        ],
    }[command]
    line = refused(capsys, *argv)
    assert str(tmp_path / "d") in line and expected in line and "made for another target" in line, line


def test_debug_shows_the_traceback(files, tmp_path, capsys):
    drafter = shutil.copytree(files["drafter"], tmp_path / "d")
    (drafter / "model.safetensors").unlink()
    with pytest.raises(FlashdraftError, match="no model.safetensors"):
        main(["--debug", *map(str, eval_args(files, drafter))])


# -- completions ------------------------------------------------------------------------------------


COMPLETIONS_DAMAGE = {
    "not JSON": (lambda p: p.write_text(p.read_text()[:300]), "not valid JSON"),
    "empty file": (lambda p: p.write_text(""), "empty file; expected a completions file from flashdraft generate"),
    "other format": (
        _json_edit(lambda d: d.update(format="other")),
        "field 'format' is 'other'; expected 'flashdraft.completions'",
    ),
    "other version": (_json_edit(lambda d: d.update(version=9)), "field 'version' is 9; expected 1"),
    "records not a list": (_json_edit(lambda d: d.update(records="x")), "field 'records' is str; expected a list"),
    "no target header": (_json_edit(lambda d: d.pop("target")), "field 'target' is None; expected an object"),
    "no records": (_json_edit(lambda d: d.update(records=[])), "no valid records (of 0)"),
    "every id out of vocabulary": (
        _json_edit(lambda d: [r.update(completion_ids=[1, 64]) for r in d["records"]]),
        "no valid records (of 5)",
    ),
}


def _completions_argv(files, tmp_path, path, command):
    """The command line of `command` (eval, cache or train) reading the completions file `path`."""
    return {
        "eval": eval_args(files, files["drafter"], completions=path),
        "cache": ["cache", "--target-model", files["target"], "--completions", path, "--out", tmp_path / "cache"],
        "train": train_args(files, tmp_path / "run", "--completions", path),
    }[command]


@pytest.mark.parametrize("command", ["eval", "cache", "train"])
@pytest.mark.parametrize("case", COMPLETIONS_DAMAGE)
def test_a_bad_completions_file_is_refused(files, tmp_path, capsys, case, command):
    damage, expected = COMPLETIONS_DAMAGE[case]
    path = Path(shutil.copy(files["completions"], tmp_path / "c.json"))
    damage(path)
    argv = _completions_argv(files, tmp_path, path, command)
    line = refused(capsys, *argv)
    assert str(path) in line and expected in line, line


def test_records_out_of_vocabulary_are_skipped_and_the_rest_counted_and_used(files, tmp_path, capsys):
    path = Path(shutil.copy(files["completions"], tmp_path / "c.json"))
    _json_edit(lambda d: d["records"][1].update(completion_ids=[3, 70, 5]))(path)
    rc, out, err = run(capsys, *eval_args(files, files["drafter"], completions=path), "--json", tmp_path / "e.json")
    assert rc == 0, err
    assert "c.json: 4 of 5 records valid" in out
    assert "skipped q1: completion_ids has 1 ids outside the vocabulary 0..63 (first: 70)" in out
    assert [p["id"] for p in json.loads((tmp_path / "e.json").read_text())["per_prompt"]] == ["q0", "q2", "q3", "q4"]
    rc, out, err = run(
        capsys, "cache", "--target-model", files["target"], "--completions", path, "--out", tmp_path / "cache"
    )
    assert rc == 0, err
    assert json.loads((tmp_path / "cache" / "manifest.json").read_text())["num_records"] == 4


@pytest.mark.parametrize("command", ["eval", "cache", "train"])
def test_completions_of_another_target_are_refused_unless_allowed(files, tmp_path, capsys, command):
    path = Path(shutil.copy(files["completions"], tmp_path / "c.json"))
    _json_edit(lambda d: d["target"].update(fingerprint="0123456789abcdef"))(path)
    argv = _completions_argv(files, tmp_path, path, command)
    line = refused(capsys, *argv)
    assert str(path) in line and "made by target fingerprint 0123456789abcdef" in line
    assert "pass --allow-foreign-completions" in line
    rc, out, err = run(capsys, *argv, "--allow-foreign-completions")
    assert rc == 0, err
    assert "made by another target (0123456789abcdef); used anyway" in out


# -- caches -----------------------------------------------------------------------------------------


def _manifest_edit(edit):
    return lambda cache: _json_edit(edit)(cache / "manifest.json")


def _flip_last_byte(cache: Path) -> None:
    shard = cache / "shard-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))


def _shorter_records(manifest: dict) -> None:
    """The manifest lists one token fewer for shard 0 than its file holds."""
    last = [r for r in manifest["records"] if r["shard"] == 0][-1]
    last["length"] -= 1
    manifest["shards"][0]["num_tokens"] -= 1
    manifest["num_tokens"] -= 1


CACHE_DAMAGE = {
    "another target": (
        _manifest_edit(lambda m: m["target"].update(fingerprint="0123456789abcdef")),
        "manifest.json: cache made by target fingerprint 0123456789abcdef",
    ),
    "missing shard": (
        lambda c: (c / "shard-00001.safetensors").unlink(),
        "shard-00001.safetensors: missing; manifest.json lists it",
    ),
    "truncated shard": (
        lambda c: (c / "shard-00001.safetensors").write_bytes((c / "shard-00001.safetensors").read_bytes()[:-100]),
        "bytes, manifest.json says",
    ),
    "checksum mismatch": (_flip_last_byte, "shard-00001.safetensors: sha256 differs from manifest.json"),
    "a record longer than its shard": (
        _manifest_edit(lambda m: m["records"][1].update(length=m["records"][1]["length"] + 1)),
        "manifest.json: the records of shard-00000.safetensors hold",
    ),
    "a shard longer than its records": (
        _manifest_edit(_shorter_records),
        "shard-00000.safetensors: tensor 'input_ids' has shape",
    ),
    "unfinished run": (
        lambda c: ((c / "manifest.json").unlink(), (c / ".progress").mkdir()),
        "no manifest.json; not a finished hidden-state cache (an unfinished run: re-run flashdraft cache)",
    ),
}


@pytest.mark.parametrize("command", ["eval", "train"])
@pytest.mark.parametrize("case", CACHE_DAMAGE)
def test_a_bad_cache_is_refused(files, tmp_path, capsys, case, command):
    damage, expected = CACHE_DAMAGE[case]
    cache = shutil.copytree(files["cache"], tmp_path / "cache")
    damage(cache)
    argv = {
        "eval": eval_args(files, files["drafter"], cached_hidden_states=cache),
        "train": train_args(files, tmp_path / "run", "--cached-hidden-states", cache),
    }[command]
    line = refused(capsys, *argv)
    assert str(cache) in line and expected in line, line


def test_a_bit_flip_passes_with_no_verify_and_is_caught_without(files, tmp_path, capsys):
    cache = shutil.copytree(files["cache"], tmp_path / "cache")
    _flip_last_byte(cache)
    refused(capsys, *eval_args(files, files["drafter"], cached_hidden_states=cache))
    rc, out, err = run(capsys, *eval_args(files, files["drafter"], cached_hidden_states=cache), "--no-verify")
    assert rc == 0, err


@pytest.mark.parametrize("command", ["eval", "train"])
def test_a_cache_for_other_layer_ids_is_refused(files, tmp_path, capsys, command):
    save_drafter(make_drafter(target_layer_ids=[1, 2]), tmp_path / "d")
    if command == "eval":
        line = refused(capsys, *eval_args(files, tmp_path / "d", cached_hidden_states=files["cache"]))
        assert "holds target layers [0, 2]; the drafter needs target_layer_ids [1, 2]" in line
    else:
        line = refused(
            capsys, *train_args(files, tmp_path / "run", "--cached-hidden-states", files["cache"], layer_ids="1,2")
        )
        assert "cache holds layer ids [0, 2], the drafter's target_layer_ids are [1, 2]" in line
    assert str(files["cache"]) in line


def _poison(cache: Path) -> None:
    """NaN in one feature of every record, stored with a matching checksum (a cache made by a
    tool that did not refuse it)."""
    manifest = json.loads((cache / "manifest.json").read_text())
    layer_width = manifest["hidden_size"]
    for shard in manifest["shards"]:
        tensors = load_file(cache / shard["file"])
        for r in manifest["records"]:
            if r["shard"] == shard["index"]:
                tensors["context_features"][r["offset"] + 3, layer_width + 5] = float("nan")
        save_file(tensors, str(cache / shard["file"]))
        shard["bytes"], shard["sha256"] = (cache / shard["file"]).stat().st_size, sha256_file(cache / shard["file"])
    (cache / "manifest.json").write_text(json.dumps(manifest))


def test_nan_features_in_a_cache_are_refused_naming_file_record_layer_and_token(files, tmp_path, capsys):
    cache = shutil.copytree(files["cache"], tmp_path / "cache")
    _poison(cache)
    line = refused(capsys, *eval_args(files, files["drafter"], cached_hidden_states=cache))
    where = cache / "shard-00000.safetensors"
    assert f"{where}: record 'q0' has NaN/Inf context features at token 3 of layer 2" in line
    line = refused(capsys, *train_args(files, tmp_path / "run", "--cached-hidden-states", cache))
    assert re.search(
        r"step 0: loss is nan on records .*: record 'q\d' \(index \d\) of .*cache has NaN/Inf context "
        r"features at token 3",
        line,
    ), line


def test_features_that_overflow_the_cache_dtype_are_refused_when_caching(files, tmp_path, capsys):
    loud = save_target(tmp_path / "loud", embed_scale=1e7)  # hidden states far beyond fp16's 65504
    rc, out, err = run(
        capsys,
        "generate",
        "--target-model",
        loud,
        "--prompts",
        files["prompts"],
        "--out",
        tmp_path / "c.json",
        "--max-new-tokens",
        3,
        "--num-prompts",
        2,
    )
    assert rc == 0, err
    line = refused(
        capsys,
        "cache",
        "--target-model",
        loud,
        "--completions",
        tmp_path / "c.json",
        "--out",
        tmp_path / "cache",
        "--layers",
        "0",
        "--dtype",
        "fp16",
    )
    # the fp16 range guard (`target.overflow`) names the layer and the largest value before anything is stored
    assert re.search(
        r"record 'q0': hidden states of target layer 0 reach [\d.e+]+ at token \d+, beyond fp16's range", line
    )
    assert "(--dtype bf16)" in line


# -- prompts ----------------------------------------------------------------------------------------


def generate_args(files, prompts, out, *extra) -> list:
    return [
        "generate",
        "--target-model",
        files["target"],
        "--prompts",
        prompts,
        "--out",
        out,
        "--max-new-tokens",
        8,
        *extra,
    ]


PROMPT_DAMAGE = {
    "empty file": ("p.jsonl", "", "no prompts found"),
    "unknown file type": ("p.txt", "t1 t2\n", "unknown prompt file type '.txt'; expected .jsonl, .json, .parquet"),
    "not JSON": ("p.jsonl", '{"prompt": "t1"}\n{"prompt":\n', "p.jsonl:2: not valid JSON"),
    "unknown row format": (
        "p.jsonl",
        '{"text": "t1"}\n',
        "p.jsonl:1: no 'prompt', 'messages', 'conversations' or 'turns' field",
    ),
}


@pytest.mark.parametrize("case", PROMPT_DAMAGE)
def test_a_bad_prompt_file_is_refused(files, tmp_path, capsys, case):
    name, text, expected = PROMPT_DAMAGE[case]
    (tmp_path / name).write_text(text)
    line = refused(capsys, *generate_args(files, tmp_path / name, tmp_path / "c.json"))
    assert str(tmp_path / name) in line and expected in line, line


@pytest.fixture
def long_prompts(tmp_path) -> Path:
    """Three prompts; the middle one longer than the target's 512 positions minus 8 new tokens."""
    rows = [
        {"id": "short", "prompt": "t1 t2 t3"},
        {"id": "long", "prompt": " ".join(f"t{k % 60}" for k in range(600))},
        {"id": "also-short", "prompt": "t4 t5"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_prompt_longer_than_the_context_is_an_error_by_default(files, tmp_path, capsys, long_prompts):
    line = refused(capsys, *generate_args(files, long_prompts, tmp_path / "c.json"))
    expected = f"{long_prompts}: prompt 'long' has 600 tokens; expected at most 504 (the target's context minus "
    assert expected + "--max-new-tokens)" in line
    assert "--long-prompts skip" in line
    line = refused(
        capsys,
        "eval",
        "--checkpoint",
        files["drafter"],
        "--target-model",
        files["target"],
        "--prompts",
        long_prompts,
        "--max-new-tokens",
        8,
    )
    assert f"{long_prompts}: prompt 'long' has 600 tokens; expected at most 504" in line


def test_long_prompts_skip_and_truncate_are_counted(files, tmp_path, capsys, long_prompts):
    rc, out, err = run(capsys, *generate_args(files, long_prompts, tmp_path / "s.json", "--long-prompts", "skip"))
    assert rc == 0, err
    assert "prompts longer than 504 tokens (context minus --max-new-tokens): 1 skipped (--long-prompts skip)" in out
    assert [r["id"] for r in json.loads((tmp_path / "s.json").read_text())["records"]] == ["short", "also-short"]

    rc, out, err = run(capsys, *generate_args(files, long_prompts, tmp_path / "t.json", "--long-prompts", "truncate"))
    assert rc == 0, err
    assert "1 truncated (--long-prompts truncate)" in out
    long = json.loads((tmp_path / "t.json").read_text())["records"][1]
    assert long["id"] == "long" and len(long["prompt_ids"]) == 504 and long["prompt_truncated_from"] == 600
    assert long["prompt_ids"] == [k % 60 for k in range(600)][-504:]  # the end of the prompt is kept

    rc, out, err = run(
        capsys,
        "eval",
        "--checkpoint",
        files["drafter"],
        "--target-model",
        files["target"],
        "--prompts",
        long_prompts,
        "--max-new-tokens",
        8,
        "--long-prompts",
        "skip",
    )
    assert rc == 0, err
    assert "1 skipped (--long-prompts skip)" in out and "records: 2 valid of 2" in out


# -- flags ------------------------------------------------------------------------------------------

BAD_FLAGS = {
    "init block size": (
        ["init", "--target-model", "T", "--out", "D", "--block-size", "1"],
        "argument --block-size: expected an integer >= 2",
    ),
    "eval block size": (
        ["eval", "--checkpoint", "D", "--target-model", "T", "--prompts", "P", "--block-size", "0"],
        "argument --block-size: expected an integer >= 2",
    ),
    "speculate block size": (
        ["speculate", "--target-model", "T", "--checkpoint", "D", "--prompt", "x", "--block-size", "x"],
        "argument --block-size: expected an integer >= 2",
    ),
    "train block size": (
        ["train", "--target-model", "T", "--out", "O", "--completions", "C", "--block-size", "1"],
        "argument --block-size: expected an integer >= 2",
    ),
    "generate num prompts": (
        ["generate", "--target-model", "T", "--prompts", "P", "--out", "O", "--num-prompts", "0"],
        "argument --num-prompts: expected a positive integer, found 0",
    ),
    "eval num prompts": (
        ["eval", "--checkpoint", "D", "--target-model", "T", "--prompts", "P", "--num-prompts", "-3"],
        "argument --num-prompts: expected a positive integer, found -3",
    ),
    "cache num prompts": (
        ["cache", "--target-model", "T", "--completions", "C", "--out", "O", "--num-prompts", "x"],
        "argument --num-prompts: expected a positive integer, found 'x'",
    ),
    "eval max blocks": (
        ["eval", "--checkpoint", "D", "--target-model", "T", "--prompts", "P", "--max-blocks", "0"],
        "argument --max-blocks: expected a positive integer, found 0",
    ),
    "generate temperature": (
        ["generate", "--target-model", "T", "--prompts", "P", "--out", "O", "--temperature", "-0.5"],
        "argument --temperature: expected a finite number >= 0 (0 = greedy), found -0.5",
    ),
    "eval temperature": (
        ["eval", "--checkpoint", "D", "--target-model", "T", "--prompts", "P", "--online", "--temperature", "nan"],
        "argument --temperature: expected a finite number >= 0",
    ),
    "cache layers": (
        ["cache", "--target-model", "T", "--completions", "C", "--out", "O", "--layers", "x"],
        "argument --layers: expected layer ids >= 0 such as 1,6,11; found 'x'",
    ),
    "train both sources": (
        ["train", "--target-model", "T", "--out", "O", "--completions", "C", "--cached-hidden-states", "X"],
        "argument --cached-hidden-states: not allowed with argument --completions",
    ),
    "missing required": (
        ["init", "--out", "D"],
        "flashdraft init: the following arguments are required: --target-model",
    ),
}


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_a_flag_out_of_range_is_one_line(capsys, case):
    argv, expected = BAD_FLAGS[case]
    line = refused(capsys, *argv)
    assert expected in line and line.endswith("--help)"), line


# Target layer ids, on every flag that takes them: servers capture target layers in layer
# order, so a drafter or cache must list them unique and strictly increasing.
UNSORTED_IDS = {
    "init": ["init", "--target-model", "T", "--out", "D", "--target-layer-ids", "3,1,2"],
    "train": ["train", "--target-model", "T", "--out", "O", "--completions", "C", "--target-layer-ids", "3,1,2"],
    "eval (bare state dict)": [
        "eval",
        "--checkpoint",
        "S.pt",
        "--target-model",
        "T",
        "--prompts",
        "P",
        "--target-layer-ids",
        "3,1,2",
    ],
    "export (bare state dict)": [
        "export",
        "--checkpoint",
        "S.pt",
        "--out",
        "O",
        "--target-model",
        "T",
        "--target-layer-ids",
        "3,1,2",
    ],
    "cache": ["cache", "--target-model", "T", "--completions", "C", "--out", "O", "--layers", "2,0"],
    "duplicates": ["init", "--target-model", "T", "--out", "D", "--target-layer-ids", "1,1"],
}


@pytest.mark.parametrize("case", UNSORTED_IDS)
def test_unsorted_or_repeated_layer_ids_are_refused_naming_the_flag_and_the_servers_rule(capsys, case):
    argv = UNSORTED_IDS[case]
    flag, value = argv[-2], argv[-1]
    line = refused(capsys, *argv)
    assert (
        f"argument {flag}: expected unique, strictly increasing ids: vLLM and SGLang capture target layers in "
        f"layer order"
        in line
        and f"found '{value}'" in line
    ), line
    assert not Path(argv[argv.index("--out") + 1] if "--out" in argv else "D").exists()


@pytest.mark.parametrize(
    "command", ["export", "speculate", "train --init", "cache --draft-config", "doctor --checkpoint"]
)
def test_a_drafter_saved_with_unsorted_layer_ids_is_refused_on_load(files, tmp_path, capsys, command):
    drafter = shutil.copytree(files["drafter"], tmp_path / "d")
    _config_edit(lambda c: c["dflash_config"].update(target_layer_ids=[2, 0]))(drafter)
    argv = {
        "export": ["export", "--checkpoint", drafter, "--out", tmp_path / "x"],
        "speculate": ["speculate", "--target-model", files["target"], "--checkpoint", drafter, "--prompt", "t1 t2"],
        "train --init": [
            "train",
            "--target-model",
            files["target"],
            "--init",
            drafter,
            "--out",
            tmp_path / "run",
            "--completions",
            files["completions"],
        ],
        "cache --draft-config": [
            "cache",
            "--target-model",
            files["target"],
            "--completions",
            files["completions"],
            "--out",
            tmp_path / "c",
            "--draft-config",
            drafter,
        ],
        "doctor --checkpoint": ["doctor", files["cache"], "--checkpoint", drafter],
    }[command]
    line = refused(capsys, *argv)
    assert str(drafter) in line and "field 'dflash_config.target_layer_ids' is [2, 0]" in line, line
    assert "strictly increasing" in line and "layer order" in line, line


def test_doctor_reports_unsorted_layer_ids_of_a_drafter_and_of_a_cache(files, tmp_path, capsys):
    drafter = shutil.copytree(files["drafter"], tmp_path / "d")
    _config_edit(lambda c: c["dflash_config"].update(target_layer_ids=[2, 0]))(drafter)
    rc, out, _ = run(capsys, "doctor", drafter)
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert rc == 1 and len(fails) == 1 and "field 'dflash_config.target_layer_ids' is [2, 0]" in fails[0], out
    cache = shutil.copytree(files["cache"], tmp_path / "cache")  # a cache written before the rule
    _manifest_edit(lambda m: m.update(layer_ids=[2, 0]))(cache)
    rc, out, _ = run(capsys, "doctor", cache)
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert rc == 1 and len(fails) == 1, out
    assert "layer ids [2, 0] are not unique, strictly increasing ids" in fails[0] and "--layers 0,2" in fails[0]


CONFLICTS = {
    "two record sources": (
        lambda f, t: eval_args(f, f["drafter"], completions=f["completions"], cached_hidden_states=f["cache"]),
        "give exactly one record source: --cached-hidden-states DIR, --completions C.json or --prompts P (found 2)",
    ),
    "layers and a drafter's": (
        lambda f, t: [
            "cache",
            "--target-model",
            f["target"],
            "--completions",
            f["completions"],
            "--out",
            t / "c",
            "--layers",
            "0",
            "--draft-config",
            f["drafter"],
        ],
        "give --layers or --draft-config, not both",
    ),
    "--init and another block size": (
        lambda f, t: [
            "train",
            "--target-model",
            f["target"],
            "--init",
            f["drafter"],
            "--out",
            t / "run",
            "--completions",
            f["completions"],
            "--block-size",
            "4",
        ],
        "--block-size 4 conflicts with {drafter} (--init), whose config.json has 8",
    ),
    "a server for local generation": (
        lambda f, t: generate_args(f, f["prompts"], t / "c.json", "--base-url", "http://x"),
        "--base-url and --server-model are for --backend openai",
    ),
    "step-for-step check of sampled drafts": (
        lambda f, t: [
            *eval_args(f, f["drafter"]),
            "--temperature",
            "0.7",
            "--check-consistency",
            "--serving-rule",
            "vllm-probabilistic",
        ],
        "--check-consistency at --temperature 0.7",
    ),
}


@pytest.mark.parametrize("case", CONFLICTS)
def test_conflicting_options_are_refused(files, tmp_path, capsys, case):
    argv, expected = CONFLICTS[case]
    line = refused(capsys, *argv(files, tmp_path))
    assert expected.format(drafter=files["drafter"]) in line, line
