import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.decoding.proposers import DFlashProposer
from flashdraft.drafter.checkpoint import load_drafter
from flashdraft.drafter.run_dir import RunLock, complete_checkpoints, latest_checkpoint
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TINY_DIR
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import BatchSpec, make_batch
from flashdraft.train.loop import HeldOut, LoopOptions, describe_steps, recorded_config, train
from flashdraft.train.recipe import PUBLISHED_RECIPE, TINY_RECIPE, recipe_for
from tests.conftest import MASK, make_dflash2_drafter, make_drafter, make_dspark_drafter
from tests.train.helpers import make_records

REPO = Path(__file__).resolve().parents[2]


def _cfg(**kw) -> TrainConfig:
    base = dict(epochs=10, max_steps=6, batch_size=2, lr=3e-3, num_anchors=6, save_every=3, log_every=1)
    return TrainConfig(**(base | kw))


def test_final_target_layer_as_context_is_refused_before_training(target, records, tmp_path):
    drafter = make_drafter(target_layer_ids=[0, 3])  # layer 3 is the target's last: it makes the labels
    with pytest.raises(FlashdraftError, match="final layer"):
        train(_cfg(), drafter, target, records, tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_training_forward_predicts_what_the_inference_path_predicts(target, records):
    drafter = make_drafter(block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    record = records[0]
    batch = make_batch([record], [0], 0, batch_spec=BatchSpec(seed=0, num_anchors=5, block_size=4, mask_token_id=MASK))
    hidden = drafter(
        target.embed(batch.block_ids), batch.anchor_positions, batch.context_features, batch.context_positions
    )
    train_logits = target.lm_head(hidden)  # [1, K * 4, V]
    for j, anchor in enumerate(batch.anchor_positions[0].tolist()):
        proposer = DFlashProposer(drafter, target)
        infer_logits = proposer.propose(
            record.input_ids[: anchor + 1].tolist(),
            anchor,
            record.context_features[None, :anchor],
            torch.arange(anchor)[None],
            4,
        )
        torch.testing.assert_close(train_logits[0, j * 4 + 1 : j * 4 + 4], infer_logits, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def records_with_logits(target):
    return make_records(target, n=8, topk=16)


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(
    target, records, records_with_logits, tmp_path, optimizer, family
):
    new_drafter = {"dflash": make_drafter, "dflash2": make_dflash2_drafter, "dspark": make_dspark_drafter}[family]
    if family == "dspark":  # the paper's loss: the target's distribution at every label
        records = records_with_logits
    straight = train(_cfg(optimizer=optimizer), new_drafter(), target, records, tmp_path / "a")

    def crash(step):
        if step == 4:
            raise KeyboardInterrupt  # killed after the step-3 checkpoint, mid step 5

    with pytest.raises(KeyboardInterrupt):
        train(
            _cfg(optimizer=optimizer),
            new_drafter(),
            target,
            records,
            tmp_path / "b",
            options=LoopOptions(on_step=crash),
        )
    assert latest_checkpoint(tmp_path / "b").name == "step-0000003"
    resumed = train(
        _cfg(optimizer=optimizer),
        new_drafter(seed=99),
        target,
        records,
        tmp_path / "b",
        options=LoopOptions(resume=True),
    )
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    final = load_drafter(latest_checkpoint(tmp_path / "b") / "drafter")
    assert torch.equal(final.fc.weight, straight.fc.weight)


def test_checkpoints_keep_the_last_k_and_load_in_public_format(target, records, tmp_path):
    train(_cfg(save_every=1, keep_checkpoints=2), make_drafter(), target, records, tmp_path)
    names = [p.name for p in complete_checkpoints(tmp_path)]
    assert names == ["step-0000005", "step-0000006"]
    assert sorted(p.name for p in (tmp_path / "checkpoints/step-0000006/drafter").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def test_second_trainer_on_the_same_run_directory_is_refused(target, records, tmp_path):
    lock = RunLock(tmp_path)
    try:
        with pytest.raises(FlashdraftError, match="another trainer"):
            train(_cfg(), make_drafter(), target, records, tmp_path)
    finally:
        lock.release()


def test_configuration_used_is_written_and_printed(target, records, tmp_path, capsys):
    train(_cfg(loss_decay_gamma=4.0, noise_std=0.1, max_steps=1), make_drafter(), target, records, tmp_path)
    written = json.loads((tmp_path / "run_config.json").read_text())
    assert written["loss_decay_gamma"] == 4.0 and written["noise_std"] == 0.1
    assert written["target_layer_ids"] == [0, 2] and written["mask_token_id"] == MASK
    assert written["target_fingerprint"] == target.fingerprint()
    assert '"loss_decay_gamma": 4.0' in capsys.readouterr().out


def test_nan_loss_stops_naming_step_and_records_and_keeps_last_good_checkpoint(target, records, tmp_path):
    bad = [r for r in records]
    poisoned = type(records[0])(records[5].input_ids, records[5].loss_mask, records[5].context_features.clone(), None)
    poisoned.context_features[3] = float("nan")
    bad[5] = poisoned
    with pytest.raises(FlashdraftError, match=r"step \d+: loss is nan on records \[.*5.*\]"):
        train(_cfg(epochs=3, max_steps=None, save_every=1), make_drafter(), target, bad, tmp_path)
    last = latest_checkpoint(tmp_path)
    assert last is None or torch.isfinite(load_drafter(last / "drafter").fc.weight).all()


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_gradient_accumulation_matches_one_larger_batch_within_rounding(target, records, tmp_path, weighting):
    # AdamW: Muon's bf16 orthogonalisation would blur the last bits this compares (see the gloo test)
    big = train(
        _cfg(batch_size=4, max_steps=2, loss_weighting=weighting, optimizer="adamw"),
        make_drafter(),
        target,
        records,
        tmp_path / "a",
    )
    accum = train(
        _cfg(batch_size=2, grad_accum=2, max_steps=2, loss_weighting=weighting, optimizer="adamw"),
        make_drafter(),
        target,
        records,
        tmp_path / "b",
    )
    # atol: Adam divides by sqrt(v), so a near-zero gradient element's last-bit difference between the two
    # summation orders reaches ~1e-5 of the weight on some CPUs (1.2e-5 on an x86_64 without AVX-512)
    for key, value in big.state_dict().items():
        torch.testing.assert_close(value, accum.state_dict()[key], rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("weighting, optimizer", [("decay", "adamw"), ("dpace", "adamw"), ("dpace", "muon")])
def test_training_lowers_held_out_loss_and_raises_estimated_acceptance(target, records, tmp_path, weighting, optimizer):
    cfg = _cfg(
        max_steps=40,
        epochs=100,
        eval_every=40,
        log_every=40,
        save_every=1000,
        loss_weighting=weighting,
        optimizer=optimizer,
    )
    held_out = make_records(target, n=4, seed=1)
    drafter = make_drafter()
    from flashdraft.train.held_out import evaluate_loss

    before = evaluate_loss(drafter, target, held_out, cfg, torch.device("cpu"))
    train(cfg, drafter, target, records, tmp_path, held_out=HeldOut(records=held_out))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    after, trained = rows[-1], next(row for row in rows if "loss" in row)
    assert trained["peak_memory_gib"] > 0 and 0 <= trained["padding_share"] < 1
    assert trained["attention_shapes"] >= 0 and trained["compiled_graphs"] >= 0
    # D-PACE aims at acceptance (early on it trains the first positions far more than the CE measured here), and
    # Muon's larger steps fit these 8 records sooner: both raise acceptance, the recipe's AdamW + decay lowers CE
    if (weighting, optimizer) == ("decay", "adamw"):
        assert after["eval_loss"] < before["eval_loss"] - 0.2
    assert after["eval_estimated_acceptance"] > before["eval_estimated_acceptance"] + 0.03


# Muon's Newton-Schulz in bf16 (on GPUs): a last-bit (fp32) change of its input flips the odd bf16 rounding, and
# a flip moves that step's orthogonalised update by about 1 % (a 1-ulp perturbation, measured); compounding over
# 3 steps through momentum and the next gradients gave 5.9 % of the update between 1 and 2 ranks. Twice that is
# the tolerance, for any two different summation orders (accumulation, all-reduce, reduce-scatter); these CPU
# ranks orthogonalise in fp32, which stays well inside it.
MUON_TOLERANCE = 0.12  # ||difference|| / ||update|| of each matrix


def _shard_local_muon_gap(matrices: dict[str, torch.Tensor]) -> float:
    """How far a Muon that orthogonalises each of 2 row shards lands from one over the whole
    matrix (the bug the FSDP comparison guards against): the least relative difference."""
    from flashdraft.train.optim import newton_schulz

    ns = torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))]).defaults
    gaps = []
    for i, value in enumerate(matrices.values()):
        x = torch.randn(value.shape, generator=torch.Generator().manual_seed(i))
        whole = newton_schulz(x, ns["ns_coefficients"], ns["ns_steps"], ns["eps"], torch.float32)
        shards = [newton_schulz(h, ns["ns_coefficients"], ns["ns_steps"], ns["eps"], torch.float32) for h in x.chunk(2)]
        gaps.append(float((torch.cat(shards) - whole).norm() / whole.norm()))
    return min(gaps)


def test_two_gloo_ranks_with_ddp_or_fsdp_train_what_one_rank_trains_within_rounding(tmp_path):
    """DDP and FSDP2 on 2 ranks sum gradients in other orders than one rank accumulating (and
    than each other): AdamW weights agree within 1e-5, Muon's matrices within 12 % of their update."""
    runs = {
        "one": (1, 2, 2, "ddp", "decay"),
        "ddp": (2, 2, 1, "ddp", "decay"),
        "fsdp": (2, 2, 1, "fsdp", "decay"),
        # D-PACE's normaliser must not be rank-local: 2 ranks x 1 micro-batch == 1 rank x 2 (x 4 accumulation)
        "one-dpace": (1, 1, 4, "ddp", "dpace"),
        "ddp-dpace": (2, 2, 1, "ddp", "dpace"),
        "one-muon": (1, 2, 2, "ddp", "decay", "muon"),
        "ddp-muon": (2, 2, 1, "ddp", "decay", "muon"),
        "fsdp-muon": (2, 2, 1, "fsdp", "decay", "muon"),
    }
    plan = [
        dict(
            run_dir=str(tmp_path / name),
            procs=procs,
            batch=batch,
            accum=accum,
            fsdp=mode == "fsdp",
            weighting=weighting,
            optimizer=(options or ["adamw"])[0],
            family="dflash",
        )
        for name, (procs, batch, accum, mode, weighting, *options) in runs.items()
    ]
    pairs = {family: {f"one-{family}": (1, 1, 4), f"fsdp-{family}": (2, 2, 1)} for family in ("dflash2", "dspark")}
    plan += [
        dict(
            run_dir=str(tmp_path / name),
            procs=procs,
            batch=batch,
            accum=accum,
            fsdp=True,
            weighting="dpace",
            optimizer="adamw",
            family=family,
        )
        for family, pair in pairs.items()
        for name, (procs, batch, accum) in pair.items()
    ]
    # packed (--pack-length 64: two 30-token records a row, 4 rows, 2 steps an epoch): the 2 ranks' rows together are
    # the one rank's, every record once, or the weights part
    plan += [
        dict(
            run_dir=str(tmp_path / name),
            procs=procs,
            batch=1,
            accum=accum,
            fsdp=False,
            weighting="decay",
            optimizer="adamw",
            family="dflash",
            pack=64,
        )
        for name, procs, accum in (("one-packed", 1, 2), ("ddp-packed", 2, 1))
    ]
    # one 2-rank launch runs all 15 (the 1-process runs split between its ranks before the group exists)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO / "tests/train/ddp_worker.py"),
            "--plan",
            str(tmp_path / "plan.json"),
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    assert all(latest_checkpoint(Path(p["run_dir"])).name == "step-0000002" for p in plan)  # steps 0-2
    # a DFlash2 drafter (convolutions, selector loss) and a DSpark one (Markov and confidence heads, the paper's
    # loss) under FSDP2, as the D-PACE pair above
    for family, new_drafter in (("dflash2", make_dflash2_drafter), ("dspark", make_dspark_drafter)):
        pair = pairs[family]
        # random (as if trained) family parts magnify the last bits more: measured up to 0.2 % of each tensor's
        # update (1.4e-5 of 6e-3); an unaveraged or rank-local gradient would be off by about all of it
        one, fsdp = (load_drafter(latest_checkpoint(tmp_path / n) / "drafter").state_dict() for n in pair)
        start = new_drafter(block_size=4).state_dict()
        for key, value in one.items():
            assert float((fsdp[key] - value).abs().max()) < 0.02 * float((value - start[key]).abs().max()), key
    # AdamW normalises each element's step, so a last-bit gradient difference moves a weight by at most about
    # lr x (its relative change): measured up to 1.2e-6 (1 vs 2 ranks) and 9e-8 (DDP vs FSDP) after 3 steps of
    # lr 3e-3; a rank-local loss normaliser or an unaveraged gradient is off by about the update (~1e-3)
    pairs = (("one", "ddp"), ("one", "fsdp"), ("ddp", "fsdp"), ("one-dpace", "ddp-dpace"), ("one-packed", "ddp-packed"))
    for one_name, name in pairs:
        one = load_drafter(latest_checkpoint(tmp_path / one_name) / "drafter")
        other = load_drafter(latest_checkpoint(tmp_path / name) / "drafter")
        for key, value in one.state_dict().items():
            torch.testing.assert_close(value, other.state_dict()[key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
    init = make_drafter(block_size=4).state_dict()
    weights = {
        name: load_drafter(latest_checkpoint(tmp_path / name) / "drafter").state_dict()
        for name in ("one-muon", "ddp-muon", "fsdp-muon")
    }
    matrices = {key: value for key, value in init.items() if value.ndim == 2}
    # under FSDP2 Muon orthogonalises the whole gathered matrix, as DDP does; a shard's own orthogonalisation
    # would be 37-78 % off: the tolerance must stay well below that
    assert _shard_local_muon_gap(matrices) > 2.5 * MUON_TOLERANCE
    for a, b in (("one-muon", "ddp-muon"), ("ddp-muon", "fsdp-muon")):
        for key, value in weights[a].items():
            if key in matrices:
                update = (value - init[key]).norm()
                assert float((weights[b][key] - value).norm() / update) < MUON_TOLERANCE, f"{a} {b} {key}"
            else:  # norms: AdamW, as above
                torch.testing.assert_close(value, weights[b][key], rtol=1e-4, atol=1e-5, msg=f"{a} {b} {key}")


def test_two_rank_fsdp_run_stopped_after_a_checkpoint_resumes_bit_identically_with_muon_and_adamw(tmp_path):
    """FSDP2 checkpoints hold the whole weights and the whole (gathered) optimizer state; resume
    shards them again (the weights used to be loaded into the sharded model as plain tensors). One 2-rank launch runs
    the whole run, the run stopped after its step-2 checkpoint, then its resume: each builds its drafter, optimizers
    and loop anew, so the resume reads only what the checkpoint on disk holds."""
    row = dict(procs=2, batch=2, accum=1, fsdp=True, weighting="dpace", optimizer="muon", family="dflash")
    plan = [
        dict(row, run_dir=str(tmp_path / run), mode=mode)
        for mode, run in (("full", "full"), ("stop", "resumed"), ("resume", "resumed"))
    ]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    worker = str(REPO / "tests/train/ddp_worker.py")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", worker, "--plan"]
        + [str(tmp_path / "plan.json")],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    assert (tmp_path / "resumed" / "stopped-at").read_text() == "step-0000002"  # the resume had work left
    full = load_drafter(latest_checkpoint(tmp_path / "full") / "drafter").state_dict()
    resumed = load_drafter(latest_checkpoint(tmp_path / "resumed") / "drafter").state_dict()
    assert latest_checkpoint(tmp_path / "resumed").name == "step-0000004"
    assert all(torch.equal(full[key], resumed[key]) for key in full)


def test_the_checkpoint_records_the_longest_context_trained_at_and_a_warm_start_keeps_the_longer(
    target, records, tmp_path
):
    from flashdraft.distributed import Dist
    from flashdraft.train.step import global_batch

    drafter = make_drafter()
    cfg = _cfg(max_steps=3, max_length=14)  # records are 30 tokens: truncated to 14
    train(cfg, drafter, target, records, tmp_path / "short")
    cfg = recorded_config(cfg, drafter, target)  # the block size and mask token the run trained with
    steps_per_epoch = len(records) // cfg.batch_size
    reach = max(
        b.context_reach(cfg.block_size)
        for step in range(3)
        for b in global_batch(cfg, records, step, steps_per_epoch, Dist()).micro_batches
    )
    assert reach <= 14 - 1 + cfg.block_size  # the last anchor inside the truncated sequence, plus the block
    short = load_drafter(latest_checkpoint(tmp_path / "short") / "drafter")
    assert short.config.trained_context_length == reach
    # stage 2 on the full sequences, warm-started from stage 1: its longer context
    train(_cfg(max_steps=3), short, target, records, tmp_path / "long")
    long = load_drafter(latest_checkpoint(tmp_path / "long") / "drafter").config.trained_context_length
    assert reach < long <= len(records[0].input_ids) - 1 + cfg.block_size
    # warm-started from a drafter trained longer elsewhere: its own, the larger, stays
    train(_cfg(max_steps=1), make_drafter(trained_context_length=5000), target, records, tmp_path / "kept")
    assert load_drafter(latest_checkpoint(tmp_path / "kept") / "drafter").config.trained_context_length == 5000


def test_max_steps_runs_that_many_steps_over_as_many_epochs_as_it_takes(target, records, tmp_path, capsys):
    # 8 records at batch 2: 4 steps an epoch; --epochs 1 would stop at 4, --max-steps 10 runs 10 (2.5 epochs)
    train(_cfg(epochs=1, max_steps=10, save_every=100), make_drafter(), target, records, tmp_path)
    assert latest_checkpoint(tmp_path).name == "step-0000010"
    assert "training 10 steps (--max-steps 10): 2.5 epochs of 4 steps (8 records, 2 a step)" in capsys.readouterr().out


def test_the_first_lines_say_the_epochs_run_and_an_eval_every_past_the_end():
    lines = describe_steps(_cfg(epochs=3, max_steps=None, eval_every=100), 4, 12, 8, 1)
    assert lines[0] == "training 12 steps (--epochs 3, no --max-steps): 3 epochs of 4 steps (8 records, 2 a step)"
    assert lines[1].startswith("--eval-every 100 is past the run's 12 steps")
    assert len(describe_steps(_cfg(eval_every=4), 4, 6, 8, 1)) == 1


def test_a_run_that_learns_nothing_is_warned_about_and_its_verdict_is_a_problem(target, records, tmp_path, capsys):
    train(_cfg(lr=1e-12, max_steps=8, save_every=100), make_drafter(), target, records, tmp_path)
    out, err = capsys.readouterr()
    warning = [line for line in (out + err).splitlines() if line.startswith("warning: step")]
    assert len(warning) == 1 and "--lr 1e-12 is small" in warning[0] and "only 8 optimizer steps" in warning[0]
    assert "problem: step 8: estimated τ (training batches)" in out


def test_the_recipe_fills_only_what_no_one_chose_and_tiny_gets_its_own():
    assert recipe_for("tiny") is TINY_RECIPE and recipe_for(TINY_DIR) is TINY_RECIPE
    given = TrainConfig(lr=1e-3)
    cfg, filled = given.with_recipe(TINY_RECIPE)
    assert filled == ["num_anchors", "max_steps"]
    assert (cfg.lr, cfg.num_anchors, cfg.epochs, cfg.max_steps) == (1e-3, 8, None, 1000)
    assert given == TrainConfig(lr=1e-3)  # the caller's configuration is left as built
    given_epochs, filled = TrainConfig(epochs=3).with_recipe(PUBLISHED_RECIPE)
    assert filled == ["lr", "num_anchors"]
    assert (given_epochs.epochs, given_epochs.max_steps, given_epochs.num_anchors) == (3, None, 512)
