import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashdraft.data.cache as cache_module
from flashdraft.data.cache import CacheSpec, build_cache
from flashdraft.data.cache_doctor import doctor_cache
from flashdraft.data.cache_reader import HiddenStateCache
from flashdraft.data.completions import load_completions
from flashdraft.drafter.checkpoint import save_drafter
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from tests.conftest import make_drafter, make_target
from tests.data.conftest import run_cli, write_prompts

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def completions(hybrid_dir, tmp_path_factory) -> Path:
    """Five records of the hybrid target, made through the CLI."""
    d = tmp_path_factory.mktemp("completions")
    prompts = write_prompts(d / "p.jsonl", 5)
    assert (
        run_cli(
            [
                "generate",
                "--target-model",
                str(hybrid_dir),
                "--prompts",
                str(prompts),
                "--out",
                str(d / "c.json"),
                "--max-new-tokens",
                "7",
                "--batch-size",
                "2",
            ]
        )
        == 0
    )
    return d / "c.json"


def test_cache_is_quiet_per_record_unless_verbose_and_says_so(hybrid_dir, completions, tmp_path, capsys):
    assert (
        run_cli(
            [
                "cache",
                "--target-model",
                str(hybrid_dir),
                "--completions",
                str(completions),
                "--out",
                str(tmp_path / "cache"),
                "--layers",
                "0,2",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "features mean" not in printed and "--verbose prints a line per record" in printed


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_generate_cache_doctor_round_trip(hybrid_dir, completions, tmp_path, capsys):
    out = tmp_path / "cache"
    assert (
        run_cli(
            [
                "cache",
                "--target-model",
                str(hybrid_dir),
                "--completions",
                str(completions),
                "--out",
                str(out),
                "--layers",
                "0,2",
                "--records-per-shard",
                "2",
                "--verbose",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "q0: " in printed and "features mean" in printed and "std" in printed  # per-record statistics
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"] + [f"shard-0000{k}.safetensors" for k in range(3)]
    assert run_cli(["doctor", str(out), "--target-model", str(hybrid_dir), "--samples", "5"]) == 0
    printed = capsys.readouterr().out
    assert "alignment of 5 records with a fresh forward" in printed and "all checks passed" in printed


def test_cached_records_equal_a_fresh_forward_and_the_completions(hybrid_dir, completions, tmp_path):
    target = TargetModel.load(hybrid_dir)
    loaded = load_completions(completions, target, quiet=True)
    build_cache(
        target, loaded, tmp_path / "c", spec=CacheSpec(layer_ids=[1, 3], dtype="fp32", records_per_shard=2, topk=3)
    )
    cache = HiddenStateCache(tmp_path / "c")
    assert len(cache) == 5 and cache.layer_ids == [1, 3] and cache.hidden_size == 64
    assert cache.dtype == torch.float32 and cache.target_fingerprint == target.fingerprint()
    assert cache.lengths == [len(r.prompt_ids) + len(r.completion_ids) for r in loaded]
    for i, r in enumerate(loaded):
        c = cache[i]
        tokens = r.prompt_ids + r.completion_ids
        assert c.id == r.id and c.input_ids.dtype == torch.long and c.input_ids.tolist() == tokens
        assert c.prompt_length == len(r.prompt_ids)
        assert c.loss_mask.dtype == torch.bool and c.loss_mask.tolist() == [
            k >= len(r.prompt_ids) for k in range(len(tokens))
        ]
        # independently of TargetModel's hooks: hidden_states[l + 1] of output_hidden_states
        out = target.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
        expected = torch.cat([out.hidden_states[2][0], out.hidden_states[4 - 0][0]], dim=-1)
        assert c.context_features.shape == (len(tokens), 2 * 64)
        torch.testing.assert_close(c.context_features[:, :64], expected[:, :64], rtol=1e-5, atol=1e-5)
        target.set_context_layers([1, 3])
        fresh = target.forward(torch.tensor([tokens]))
        assert torch.equal(c.context_features, fresh.context_features[0])
        values, indices = c.target_topk
        top = fresh.logits[0].topk(3, dim=-1)
        assert torch.equal(values, top.values) and torch.equal(indices, top.indices)


def test_bf16_cache_passes_doctor_and_a_shifted_layer_claim_is_caught(hybrid_dir, completions, tmp_path, capsys):
    target = TargetModel.load(hybrid_dir)
    build_cache(
        target,
        load_completions(completions, target, quiet=True),
        tmp_path / "c",
        spec=CacheSpec(layer_ids=[1, 2], dtype="bf16"),
    )
    assert HiddenStateCache(tmp_path / "c").dtype == torch.bfloat16
    assert doctor_cache(tmp_path / "c", target, layer_ids=[1, 2], samples=2)
    # the features of layers 1, 2 labelled as 2, 3: an off-by-one in the layer offset
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["layer_ids"] = [2, 3]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert not doctor_cache(tmp_path / "c", target, samples=2)
    out = capsys.readouterr().out
    assert "FAIL alignment" in out and "matches hidden_states[2] instead of hidden_states[3]" in out


def test_default_cache_stores_features_in_the_dtype_the_target_computes_them_in(hybrid_dir, completions, tmp_path):
    target = TargetModel.load(hybrid_dir)  # fp32 on CPU
    loaded = load_completions(completions, target, quiet=True)
    build_cache(target, loaded, tmp_path / "auto", spec=CacheSpec(layer_ids=[1, 3]))
    manifest = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    assert manifest["dtype"] == "float32" and manifest["computed_with"]["target_dtype"] == "float32"
    cache = HiddenStateCache(tmp_path / "auto")
    target.set_context_layers([1, 3])
    fresh = target.forward(torch.tensor([cache.token_ids(0).tolist()])).context_features[0]
    assert torch.equal(cache.features(0), fresh)  # nothing rounded: exactly what live decoding computes
    # --dtype bf16 still halves the features
    build_cache(target, loaded, tmp_path / "bf16", spec=CacheSpec(layer_ids=[1, 3], dtype="bf16"))
    assert HiddenStateCache(tmp_path / "bf16").dtype == torch.bfloat16
    sizes = [(d / "shard-00000.safetensors").stat().st_size for d in (tmp_path / "auto", tmp_path / "bf16")]
    assert sizes[1] < 0.55 * sizes[0]
    # a bf16 target's cache is bf16 by default
    bf16_target = TargetModel.load(hybrid_dir, dtype=torch.bfloat16)
    build_cache(bf16_target, loaded, tmp_path / "bf16-target", spec=CacheSpec(layer_ids=[1, 3]))
    assert json.loads((tmp_path / "bf16-target" / "manifest.json").read_text())["dtype"] == "bfloat16"
    # a cache built with another dtype is not resumed with the default: the error names the flag that resumes it
    refused = r"holds a cache with dtype = 'bfloat16', this run asks for 'float32'; use another --out .* --dtype bf16"
    with pytest.raises(FlashdraftError, match=refused):
        build_cache(target, loaded, tmp_path / "bf16", spec=CacheSpec(layer_ids=[1, 3]))
    with pytest.raises(FlashdraftError, match="--dtype fp8: expected auto or one of bf16, fp16, fp32"):
        build_cache(target, loaded, tmp_path / "x", spec=CacheSpec(layer_ids=[1, 3], dtype="fp8"))


def test_a_cache_for_other_layers_another_target_or_a_damaged_shard_is_refused(
    hybrid_dir, qwen3_dir, completions, tmp_path, capsys
):
    target = TargetModel.load(hybrid_dir)
    build_cache(
        target,
        load_completions(completions, target, quiet=True),
        tmp_path / "c",
        spec=CacheSpec(layer_ids=[0, 2], records_per_shard=2),
    )
    cache = HiddenStateCache(tmp_path / "c")
    cache.check_compatible(target, [0, 2])
    with pytest.raises(FlashdraftError, match=r"cache holds layer ids \[0, 2\], the drafter's target_layer_ids are"):
        cache.check_compatible(target, [1, 2])
    with pytest.raises(FlashdraftError, match="cache made by target fingerprint .* the features come from another"):
        cache.check_compatible(make_target("hybrid", seed=1))
    with pytest.raises(FlashdraftError, match="cache hidden size is 64, the target's is 32"):
        cache.check_compatible(make_target_with_hidden(32))

    # doctor: another target, and a drafter with other layer ids
    drafter_dir = tmp_path / "drafter"
    save_drafter(make_drafter(target_layer_ids=[1, 3]), drafter_dir)
    capsys.readouterr()
    assert (
        run_cli(["doctor", str(tmp_path / "c"), "--target-model", str(qwen3_dir), "--checkpoint", str(drafter_dir)])
        == 1
    )
    out = capsys.readouterr().out
    assert "FAIL layer ids [0, 2] differ from the drafter's target_layer_ids [1, 3]" in out
    assert "FAIL" in out and "fingerprint" in out and "2 check(s) failed" in out

    shard = tmp_path / "c" / "shard-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])  # truncated
    with pytest.raises(
        FlashdraftError,
        match=r"shard-00001\.safetensors: \d+ bytes, manifest\.json says \d+ "
        r"\(truncated or replaced\)",
    ):
        HiddenStateCache(tmp_path / "c")
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    with pytest.raises(FlashdraftError, match=r"shard-00001\.safetensors: sha256 differs"):
        HiddenStateCache(tmp_path / "c")
    HiddenStateCache(tmp_path / "c", verify=False)  # sizes only
    assert run_cli(["doctor", str(tmp_path / "c")]) == 1
    assert "FAIL sha256 of 3 shard files: shard-00001.safetensors differ" in capsys.readouterr().out
    (tmp_path / "c" / "manifest.json").unlink()
    with pytest.raises(FlashdraftError, match="no manifest.json; not a finished hidden-state cache"):
        HiddenStateCache(tmp_path / "c")


def make_target_with_hidden(hidden: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.conftest import make_tokenizer

    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return TargetModel(Qwen3ForCausalLM(cfg).eval(), make_tokenizer(), path=None)


def test_nan_features_are_refused_naming_record_and_layer(hybrid_dir, completions, tmp_path, monkeypatch):
    target = TargetModel.load(hybrid_dir)
    forward = target.forward

    def poisoned(ids, cache=None):
        out = forward(ids, cache)
        out.context_features[0, 3, 64 + 5] = float("inf")  # second listed layer, token 3
        return out

    monkeypatch.setattr(target, "forward", poisoned)
    with pytest.raises(FlashdraftError, match="record 'q0': context features of layer 3 are NaN/Inf at token 3"):
        build_cache(
            target, load_completions(completions, target, quiet=True), tmp_path / "c", spec=CacheSpec(layer_ids=[1, 3])
        )


def test_a_killed_run_resumes_without_redoing_shards_and_gives_the_same_bytes(
    hybrid_dir, completions, tmp_path, monkeypatch
):
    target = TargetModel.load(hybrid_dir)
    loaded = load_completions(completions, target, quiet=True)
    build_cache(target, loaded, tmp_path / "whole", spec=CacheSpec(layer_ids=[0, 2], records_per_shard=2, topk=2))

    real, built = cache_module._build_shard, []

    def dies_after_two(run, k, records):
        if len(built) == 2:
            # the third shard dies half written, as a kill would leave it
            (run.directory / f"shard-{k:05d}.safetensors.tmp").write_bytes(b"partial")
            raise KeyboardInterrupt
        built.append(k)
        return real(run, k, records)

    monkeypatch.setattr(cache_module, "_build_shard", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        build_cache(target, loaded, tmp_path / "resumed", spec=CacheSpec(layer_ids=[0, 2], records_per_shard=2, topk=2))
    assert not (tmp_path / "resumed" / "manifest.json").exists()
    with pytest.raises(FlashdraftError, match="an unfinished run: re-run flashdraft cache"):
        HiddenStateCache(tmp_path / "resumed")

    def counts(run, k, records):
        built.append(k)
        return real(run, k, records)

    monkeypatch.setattr(cache_module, "_build_shard", counts)
    built.clear()
    with pytest.raises(FlashdraftError, match=r"holds a cache with layer_ids = \[0, 2\], this run asks for \[0, 1\]"):
        build_cache(target, loaded, tmp_path / "resumed", spec=CacheSpec(layer_ids=[0, 1], records_per_shard=2, topk=2))
    build_cache(target, loaded, tmp_path / "resumed", spec=CacheSpec(layer_ids=[0, 2], records_per_shard=2, topk=2))
    assert built == [2]  # only the unfinished shard
    assert files_of(tmp_path / "resumed") == files_of(tmp_path / "whole")

    built.clear()  # a finished cache: nothing to redo, same bytes
    build_cache(target, loaded, tmp_path / "resumed", spec=CacheSpec(layer_ids=[0, 2], records_per_shard=2, topk=2))
    assert built == [] and files_of(tmp_path / "resumed") == files_of(tmp_path / "whole")


def test_a_cache_into_a_foreign_directory_is_refused(hybrid_dir, completions, tmp_path):
    target = TargetModel.load(hybrid_dir)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(FlashdraftError, match="exists and is not a flashdraft cache"):
        build_cache(
            target, load_completions(completions, target, quiet=True), tmp_path / "d", spec=CacheSpec(layer_ids=[0])
        )


def test_two_process_torchrun_gives_the_same_completions_and_cache_as_one(hybrid_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    # the ranks run at this process's thread count: the 1-rank run is in this process, and a kernel's
    # summation order (so the features' last bits) depends on its thread count
    env = dict(
        os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), TRANSFORMERS_VERBOSITY="error", PYTHONPATH=str(ROOT)
    )

    def run(world: int, name: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        launcher = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={world}", "-m", "flashdraft.cli"]
        gen = [
            "generate",
            "--target-model",
            str(hybrid_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(d / "c.json"),
            "--max-new-tokens",
            "6",
            "--batch-size",
            "2",
        ]
        cache = [
            "cache",
            "--target-model",
            str(hybrid_dir),
            "--completions",
            str(d / "c.json"),
            "--out",
            str(d / "cache"),
            "--layers",
            "0,2",
            "--records-per-shard",
            "2",
        ]
        for args in (gen, cache):
            if world == 1:  # in this process: the same code, without paying for another start-up
                assert run_cli(args) == 0
                continue
            done = subprocess.run(launcher + args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return d

    one, two = run(1, "one"), run(2, "two")
    assert (one / "c.json").read_bytes() == (two / "c.json").read_bytes()
    assert files_of(one / "cache") == files_of(two / "cache")
    assert len(HiddenStateCache(two / "cache")) == 5


def test_doctor_names_what_a_path_is_not(tmp_path, capsys):
    assert run_cli(["doctor", str(tmp_path / "absent")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    shutil.copy(__file__, tmp_path / "x.py")
    assert run_cli(["doctor", str(tmp_path / "x.py")]) == 2
    assert "not something doctor can check" in capsys.readouterr().err


def test_round_trip_on_the_builtin_tiny_target(tmp_path, capsys):
    c, out = tmp_path / "c.json", tmp_path / "cache"
    assert (
        run_cli(
            [
                "generate",
                "--target-model",
                "tiny",
                "--prompts",
                "builtin:code",
                "--num-prompts",
                "2",
                "--max-new-tokens",
                "8",
                "--out",
                str(c),
            ]
        )
        == 0
    )
    records = json.loads(c.read_text())["records"]
    assert records[0]["id"] == "code-fizzbuzz" and records[0]["prompt"].startswith("def fizzbuzz(n):")
    assert run_cli(["cache", "--target-model", "tiny", "--completions", str(c), "--out", str(out)]) == 0
    assert run_cli(["doctor", str(out), "--target-model", "tiny", "--samples", "2"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_draft_config_and_doctor_checkpoint_take_the_shipped_tiny_drafter_by_name(tmp_path, capsys):
    c, out = tmp_path / "c.json", tmp_path / "cache"
    assert (
        run_cli(
            [
                "generate",
                "--target-model",
                "tiny",
                "--prompts",
                "builtin:code",
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "4",
                "--out",
                str(c),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        run_cli(
            [
                "cache",
                "--target-model",
                "tiny",
                "--completions",
                str(c),
                "--out",
                str(out),
                "--draft-config",
                "tiny-drafter",
            ]
        )
        == 0
    ), capsys.readouterr().err
    assert "reference default" not in capsys.readouterr().out  # the drafter's ids, not a guess
    assert HiddenStateCache(out).layer_ids == [1, 2, 3]  # tiny-drafter's target_layer_ids
    assert run_cli(["doctor", str(out), "--checkpoint", "tiny-drafter", "--no-verify"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_layer_ids_come_from_layers_or_a_drafter_or_the_reference_default(tmp_path, capsys, monkeypatch):
    from flashdraft.data.cache_run import resolve_layer_ids

    target = make_target("qwen3", num_layers=6)
    assert resolve_layer_ids(target, None, None) == [1, 2, 3]  # 5 and 4 default ids would collide on 6 layers
    assert "reference default for a 3-layer drafter" in capsys.readouterr().out
    assert resolve_layer_ids(make_target("qwen3"), None, None) == [2]
    assert resolve_layer_ids(target, [0, 4], None) == [0, 4]
    with pytest.raises(FlashdraftError, match="strictly increasing"):
        resolve_layer_ids(target, [4, 0], None)  # servers capture in layer order
    with pytest.raises(FlashdraftError, match="outside the target's 6 layers"):
        resolve_layer_ids(target, [6], None)
    save_drafter(make_drafter(target_layer_ids=[1, 3]), tmp_path / "d")  # made for a 4-layer target
    with pytest.raises(FlashdraftError, match="drafter made for a target with 4 layers"):
        resolve_layer_ids(target, None, str(tmp_path / "d"))
    assert resolve_layer_ids(make_target("qwen3"), None, str(tmp_path / "d" / "config.json")) == [1, 3]
    with pytest.raises(FlashdraftError, match="not both"):
        resolve_layer_ids(target, [1], str(tmp_path / "d"))
    # a run directory gives its newest checkpoint's ids; a local directory named like a shipped drafter wins
    for step, ids in ((1, [0, 3]), (2, [1, 2])):
        save_drafter(make_drafter(target_layer_ids=ids), tmp_path / f"run/checkpoints/step-{step:07d}/drafter")
        (tmp_path / f"run/checkpoints/step-{step:07d}/COMPLETE").write_text(f"step {step}\n")
    assert resolve_layer_ids(make_target("qwen3"), None, str(tmp_path / "run")) == [1, 2]
    save_drafter(make_drafter(target_layer_ids=[0, 2]), tmp_path / "tiny-drafter")
    monkeypatch.chdir(tmp_path)
    assert resolve_layer_ids(make_target("qwen3"), None, "tiny-drafter") == [0, 2]


def test_listing_records_for_eval_reads_token_ids_only_and_features_on_demand(
    hybrid_dir, completions, tmp_path, monkeypatch
):
    from flashdraft.evaluation.records import records_from_cache

    target = TargetModel.load(hybrid_dir)
    loaded = load_completions(completions, target, quiet=True)
    build_cache(target, loaded, tmp_path / "c", spec=CacheSpec(layer_ids=[0, 2], records_per_shard=2))
    cache = HiddenStateCache(tmp_path / "c")
    expected = [cache[i].context_features for i in range(len(cache))]
    reads = []
    monkeypatch.setattr(HiddenStateCache, "__getitem__", lambda self, i: reads.append(i))
    features = HiddenStateCache.features
    monkeypatch.setattr(HiddenStateCache, "features", lambda self, i: reads.append(i) or features(self, i))
    records = records_from_cache(cache)
    assert reads == []  # listing 5 records read no features
    assert [(r.id, r.prompt_ids, r.completion_ids) for r in records] == [
        (r.id, r.prompt_ids, r.completion_ids) for r in loaded
    ]
    assert torch.equal(records[3].stored_features(), expected[3]) and reads == [3]
    assert records[3].feature_dtype == cache.dtype == torch.float32  # eval reads the cache's dtype from here


def test_a_cache_its_filesystem_cannot_hold_is_refused_before_any_forward_unless_forced(
    hybrid_dir, completions, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(cache_module, "free_bytes", lambda path: 1000)  # a filesystem with 1 KB free
    out = tmp_path / "cache"
    argv = [
        "cache",
        "--target-model",
        str(hybrid_dir),
        "--completions",
        str(completions),
        "--out",
        str(out),
        "--layers",
        "0,2",
        "--dtype",
        "bf16",
    ]
    assert run_cli(argv) == 2
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in load_completions(completions, quiet=True))
    needed = tokens * (2 * 64 * 2 + 4 + 1)  # features of 2 layers x 64 hidden in bf16, int32 id, bool mask
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {out}: the cache still to write needs about {needed / 1000:.1f} KB ({tokens} tokens of 5 records x 2 "
        f"layers x 64 hidden x 2 bytes (bfloat16)), its filesystem has 1.0 KB free; free space, choose another "
        f"--out, or give --force to try anyway"
    )
    assert not list(out.glob("*.safetensors")) and not (out / ".lock").exists()
    assert run_cli(argv + ["--force"]) == 0
    assert len(HiddenStateCache(out)) == 5


def test_a_dspark_draft_config_caches_the_target_logits_its_loss_reads_unless_told_not_to(tmp_path, capsys):
    c, d = tmp_path / "c.json", tmp_path / "dspark"
    assert (
        run_cli(
            [
                "generate",
                "--target-model",
                "tiny",
                "--prompts",
                "builtin:code",
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "4",
                "--out",
                str(c),
            ]
        )
        == 0
    )
    assert (
        run_cli(
            [
                "init",
                "--target-model",
                "tiny",
                "--out",
                str(d),
                "--family",
                "dspark",
                "--draft-layers",
                "1",
                "--target-layer-ids",
                "1,2,3",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        run_cli(
            [
                "cache",
                "--target-model",
                "tiny",
                "--completions",
                str(c),
                "--out",
                str(tmp_path / "with"),
                "--draft-config",
                str(d),
            ]
        )
        == 0
    )
    assert "DSpark drafter: storing the target's top 64 logits" in capsys.readouterr().out
    assert HiddenStateCache(tmp_path / "with").topk == 64
    assert (
        run_cli(
            [
                "cache",
                "--target-model",
                "tiny",
                "--completions",
                str(c),
                "--out",
                str(tmp_path / "without"),
                "--draft-config",
                str(d),
                "--with-target-logits",
                "0",
            ]
        )
        == 0
    )
    assert HiddenStateCache(tmp_path / "without").topk == 0
