"""`flashdraft train` end to end on a saved tiny random target: generate -> cache -> train."""

import json

import pytest
import torch

from flashdraft.cli import main
from flashdraft.drafter.checkpoint import load_drafter
from tests.conftest import save_target


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    save_target(d / "target", "hybrid")
    gen = torch.Generator().manual_seed(0)
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(6):
            words = " ".join(f"t{int(t)}" for t in torch.randint(0, 60, (5,), generator=gen))
            f.write(json.dumps({"id": f"p{i}", "prompt": words}) + "\n")
    assert (
        main(
            [
                "generate",
                "--target-model",
                str(d / "target"),
                "--prompts",
                str(d / "prompts.jsonl"),
                "--out",
                str(d / "c.json"),
                "--max-new-tokens",
                "20",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "cache",
                "--target-model",
                str(d / "target"),
                "--completions",
                str(d / "c.json"),
                "--out",
                str(d / "cache"),
                "--layers",
                "0,2",
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    return d


def _train(d, *extra):
    return main(
        [
            "train",
            "--target-model",
            str(d / "target"),
            "--draft-layers",
            "2",
            "--block-size",
            "4",
            "--target-layer-ids",
            "0,2",
            "--batch-size",
            "2",
            "--num-anchors",
            "8",
            "--lr",
            "3e-3",
            "--log-every",
            "1",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def dflash_run(workdir):
    """A trained DFlash run of this module's target, made here so that no test reads another test's output."""
    out = workdir / "dflash-run"
    assert _train(workdir, "--cached-hidden-states", str(workdir / "cache"), "--out", str(out)) == 0
    return out


def test_offline_training_from_a_cache_writes_a_loadable_public_drafter(workdir):
    out = workdir / "offline"
    assert _train(workdir, "--cached-hidden-states", str(workdir / "cache"), "--out", str(out), "--epochs", "2") == 0
    drafter = load_drafter(out / "checkpoints/step-0000006/drafter")
    assert drafter.config.target_layer_ids == [0, 2] and drafter.config.block_size == 4
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6 and {
        "loss",
        "position_accuracy",
        "estimated_acceptance",
        "tokens_per_s",
        "lr",
        "grad_norm",
    } <= set(json.loads(lines[-1]))


def test_held_out_evaluation_reports_real_tau_from_the_offline_evaluator_by_context_too(workdir):
    out = workdir / "with-eval"
    assert (
        _train(
            workdir,
            "--cached-hidden-states",
            str(workdir / "cache"),
            "--out",
            str(out),
            "--max-steps",
            "2",
            "--eval-every",
            "2",
            "--eval-cached-hidden-states",
            str(workdir / "cache"),
        )
        == 0
    )
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"eval_loss", "eval_estimated_acceptance", "eval_tau", "eval_tau_steps"} <= set(last)
    assert 1.0 <= last["eval_tau"] <= 4 and last["eval_tau_steps"] > 0
    buckets = last["eval_tau_by_context"]  # the same walk by context length: its steps add up
    assert sum(b["steps"] for b in buckets) == last["eval_tau_steps"] and buckets[0]["context_from"] >= 0


def test_online_training_from_completions_runs_the_target_in_the_loop(workdir):
    out = workdir / "online"
    assert _train(workdir, "--completions", str(workdir / "c.json"), "--out", str(out), "--max-steps", "2") == 0
    config = json.loads((out / "run_config.json").read_text())
    assert config["target_layer_ids"] == [0, 2] and config["data_fingerprint"]
    assert config["loss_decay_gamma"] == 0.0  # the recipe has no decay for B = 4


def test_training_uses_the_recipe_loss_decay_for_the_block_size_unless_given(workdir):
    common = [
        "train",
        "--target-model",
        str(workdir / "target"),
        "--target-layer-ids",
        "0,2",
        "--block-size",
        "8",
        "--batch-size",
        "2",
        "--num-anchors",
        "4",
        "--max-steps",
        "1",
        "--cached-hidden-states",
        str(workdir / "cache"),
    ]
    assert main([*common, "--out", str(workdir / "decay-recipe")]) == 0
    assert main([*common, "--out", str(workdir / "decay-off"), "--loss-decay-gamma", "0"]) == 0
    recipe = json.loads((workdir / "decay-recipe" / "run_config.json").read_text())
    off = json.loads((workdir / "decay-off" / "run_config.json").read_text())
    assert recipe["loss_decay_gamma"] == 4.0 and off["loss_decay_gamma"] == 0.0


def test_cache_with_other_layer_ids_than_the_drafter_is_refused(workdir, capsys):
    # a 1-layer drafter takes the default ids [L // 2] = [2]; the cache holds [0, 2]
    code = main(
        [
            "train",
            "--target-model",
            str(workdir / "target"),
            "--cached-hidden-states",
            str(workdir / "cache"),
            "--out",
            str(workdir / "bad"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layer" in err[0]


def test_kl_training_without_stored_target_logits_is_refused_before_the_first_step(workdir, capsys):
    out = workdir / "kl-refused"
    assert (
        _train(
            workdir,
            "--cached-hidden-states",
            str(workdir / "cache"),
            "--out",
            str(out),
            "--max-steps",
            "2",
            "--kl-weight",
            "0.5",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--kl-weight 0.5" in err and "--with-target-logits" in err and str(workdir / "cache") in err
    assert not (out / "checkpoints").exists()


def test_kl_training_evaluates_held_out_hard_ce_on_a_cache_without_logits(workdir):
    assert (
        main(
            [
                "cache",
                "--target-model",
                str(workdir / "target"),
                "--completions",
                str(workdir / "c.json"),
                "--out",
                str(workdir / "cache-topk"),
                "--layers",
                "0,2",
                "--dtype",
                "fp32",
                "--with-target-logits",
                "8",
            ]
        )
        == 0
    )
    out = workdir / "kl"
    assert (
        _train(
            workdir,
            "--cached-hidden-states",
            str(workdir / "cache-topk"),
            "--out",
            str(out),
            "--max-steps",
            "2",
            "--kl-weight",
            "0.5",
            "--eval-every",
            "2",
            "--eval-cached-hidden-states",
            str(workdir / "cache"),
        )
        == 0
    )
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["eval_loss"] > 0 and last["eval_tau"] >= 1.0


def _eval_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_tau" in r]


def test_keep_best_keeps_the_drafter_of_the_best_held_out_tau_also_across_resume(workdir, capsys):
    out, cache = workdir / "best", str(workdir / "cache")
    args = [
        "--cached-hidden-states",
        cache,
        "--out",
        str(out),
        "--eval-every",
        "1",
        "--eval-cached-hidden-states",
        cache,
        "--save-every",
        "1",
        "--keep-checkpoints",
        "20",
        "--keep-best",
        "--lr",
        "2e-2",
    ]
    assert _train(workdir, *args, "--max-steps", "4", "--epochs", "3") == 0
    assert _train(workdir, *args, "--max-steps", "8", "--epochs", "3", "--resume") == 0
    rows = _eval_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    taus = [r["eval_tau"] for r in rows]
    best_step = rows[taus.index(max(taus))]["step"]  # the first step reaching the best τ
    record = json.loads((out / "best/best.json").read_text())
    assert record == {"step": best_step, "metric": "eval_tau", "value": max(taus)}
    best, same_step = load_drafter(out / "best"), load_drafter(out / f"checkpoints/step-{best_step:07d}/drafter")
    for (name, a), b in zip(best.state_dict().items(), same_step.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(out),
                "--target-model",
                str(workdir / "target"),
                "--cached-hidden-states",
                cache,
                "--max-blocks",
                "2",
            ]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert "its newest checkpoint step-0000008" in said and f"is --checkpoint {out / 'best'}" in said


def test_keep_best_without_a_held_out_set_is_refused_before_training(workdir, capsys):
    out = workdir / "best-refused"
    code = _train(workdir, "--cached-hidden-states", str(workdir / "cache"), "--out", str(out), "--keep-best")
    assert code == 2 and "--keep-best ranks held-out evaluations" in capsys.readouterr().err
    assert not (out / "checkpoints").exists()


def test_a_sliding_drafter_made_by_init_trains_and_evaluates_offline_equal_online_losslessly(workdir, capsys):
    """The seed's drafter shape (sliding layers + a full one): init -> train -> eval, causal sliding layers."""
    target = str(workdir / "target")
    init = workdir / "sliding-init"
    assert (
        main(
            [
                "init",
                "--target-model",
                target,
                "--out",
                str(init),
                "--layer-types",
                "sliding,full",
                "--sliding-window",
                "6",
                "--target-layer-ids",
                "0,2",
                "--block-size",
                "4",
            ]
        )
        == 0
    )
    out = workdir / "sliding"
    assert (
        main(
            [
                "train",
                "--target-model",
                target,
                "--cached-hidden-states",
                str(workdir / "cache"),
                "--out",
                str(out),
                "--init",
                str(init),
                "--batch-size",
                "2",
                "--num-anchors",
                "8",
                "--lr",
                "3e-3",
                "--max-steps",
                "4",
                "--epochs",
                "10",
            ]
        )
        == 0
    )
    drafter = load_drafter(out / "checkpoints/step-0000004/drafter")
    assert [(a.causal, a.window) for a in drafter.config.layer_attention] == [(True, 6), (False, None)]
    capsys.readouterr()
    report = workdir / "sliding-eval.json"
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(out),
                "--target-model",
                target,
                "--completions",
                str(workdir / "c.json"),
                "--online",
                "--check-consistency",
                "--json",
                str(report),
            ]
        )
        == 0
    )
    figures = json.loads(report.read_text())
    assert figures["lossless"] is True and figures["num_steps"] > 0


def test_train_draft_vocab_size_gives_an_own_head_over_the_most_frequent_tokens_that_evaluates_and_exports(
    workdir, capsys
):
    target = str(workdir / "target")
    out = workdir / "reduced"
    assert (
        _train(
            workdir,
            "--cached-hidden-states",
            str(workdir / "cache"),
            "--out",
            str(out),
            "--max-steps",
            "3",
            "--epochs",
            "10",
            "--draft-vocab-size",
            "40",
        )
        == 0
    )
    drafter = load_drafter(out / "checkpoints/step-0000003/drafter")
    ids = drafter.target_ids().tolist()
    assert drafter.config.draft_vocab_size == 40 and len(ids) == 40 and {61, 63} <= set(ids)  # eos and mask kept
    start = load_drafter(out / "checkpoints/step-0000003/drafter")
    assert not torch.equal(start.lm_head.weight, torch.zeros_like(start.lm_head.weight))
    capsys.readouterr()
    report = workdir / "reduced-eval.json"
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(out),
                "--target-model",
                target,
                "--completions",
                str(workdir / "c.json"),
                "--online",
                "--check-consistency",
                "--json",
                str(report),
            ]
        )
        == 0
    )
    assert json.loads(report.read_text())["lossless"] is True
    exported = workdir / "reduced-export"
    assert main(["export", "--checkpoint", str(out), "--out", str(exported), "--target-model", target]) == 0
    from safetensors import safe_open

    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        d2t = f.get_tensor("d2t")
    # vLLM 0.33 DFlashQwen3ForCausalLM.load_weights: "d2t" -> draft_id_to_target_id, "lm_head.*" kept as is
    assert {"d2t", "lm_head.weight"} <= keys and (torch.arange(40) + d2t).tolist() == ids
    assert json.loads((exported / "config.json").read_text())["draft_vocab_size"] == 40


def test_a_dflash2_drafter_made_by_init_trains_offline_and_online_and_evaluates_offline_equal_online(workdir, capsys):
    target = str(workdir / "target")
    init = workdir / "dflash2-init"
    assert (
        main(
            [
                "init",
                "--target-model",
                target,
                "--out",
                str(init),
                "--family",
                "dflash2",
                "--selector-rank",
                "8",
                "--selector-top-k",
                "4",
                "--target-layer-ids",
                "0,2",
                "--block-size",
                "4",
            ]
        )
        == 0
    )
    train = [
        "train",
        "--target-model",
        target,
        "--init",
        str(init),
        "--batch-size",
        "2",
        "--num-anchors",
        "8",
        "--lr",
        "3e-3",
        "--epochs",
        "10",
        "--save-every",
        "2",
        "--log-every",
        "1",
    ]
    offline = ["--cached-hidden-states", str(workdir / "cache")]
    assert main([*train, *offline, "--out", str(workdir / "d2-straight"), "--max-steps", "4"]) == 0
    straight = load_drafter(workdir / "d2-straight/checkpoints/step-0000004/drafter")
    assert not torch.equal(straight.candidate_selector.hidden_projection.weight, torch.zeros(8, 64))  # trained
    metrics = json.loads((workdir / "d2-straight/metrics.jsonl").read_text().splitlines()[-1])
    assert len(metrics["top_k_coverage"]) == len(metrics["selector_accuracy"]) == 3
    assert (
        main(
            [*train, "--completions", str(workdir / "c.json"), "--out", str(workdir / "d2-online"), "--max-steps", "2"]
        )
        == 0
    )
    capsys.readouterr()
    report = workdir / "d2-eval.json"
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(workdir / "d2-straight"),
                "--target-model",
                target,
                "--completions",
                str(workdir / "c.json"),
                "--online",
                "--check-consistency",
                "--json",
                str(report),
            ]
        )
        == 0
    )
    figures = json.loads(report.read_text())
    assert figures["lossless"] is True and figures["consistency"]["identical"] is True
    assert figures["selector"]["top_k"] == 4 and figures["selector"]["unary_tau"] > 0
    assert "candidate selector (DFlash2): τ" in capsys.readouterr().out


def test_a_dflash2_drafter_from_a_trained_dflash_one_drafts_exactly_as_it_at_step_0(workdir, dflash_run, capsys):
    target = str(workdir / "target")
    dflash = dflash_run
    assert (
        main(
            [
                "init",
                "--target-model",
                target,
                "--out",
                str(workdir / "from-dflash"),
                "--family",
                "dflash2",
                "--from-drafter",
                str(dflash),
                "--selector-rank",
                "8",
            ]
        )
        == 0
    )
    taus = []
    for drafter in (dflash, workdir / "from-dflash"):
        out = workdir / f"{drafter.name}-tau.json"
        assert (
            main(
                [
                    "eval",
                    "--checkpoint",
                    str(drafter),
                    "--target-model",
                    target,
                    "--cached-hidden-states",
                    str(workdir / "cache"),
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        taus.append([p["acceptance_lengths"] for p in json.loads(out.read_text())["per_prompt"]])
    assert taus[0] == taus[1]


def test_a_dspark_drafter_made_by_init_trains_offline_and_online_and_evaluates_offline_equal_online(
    workdir, dflash_run, capsys
):
    target = str(workdir / "target")
    init = workdir / "dspark-init"
    assert (
        main(
            [
                "init",
                "--target-model",
                target,
                "--out",
                str(init),
                "--family",
                "dspark",
                "--markov-rank",
                "8",
                "--target-layer-ids",
                "0,2",
                "--block-size",
                "4",
            ]
        )
        == 0
    )
    train = [
        "train",
        "--target-model",
        target,
        "--init",
        str(init),
        "--batch-size",
        "2",
        "--num-anchors",
        "8",
        "--lr",
        "3e-3",
        "--epochs",
        "10",
        "--save-every",
        "2",
        "--log-every",
        "1",
    ]
    # the paper's loss needs the target's distribution: a cache without logits is refused, one with them trains
    capsys.readouterr()
    assert (
        main(
            [
                *train,
                "--cached-hidden-states",
                str(workdir / "cache"),
                "--out",
                str(workdir / "ds-none"),
                "--max-steps",
                "2",
            ]
        )
        == 2
    )
    assert "holds no target logits; a DSpark drafter's loss needs" in capsys.readouterr().err
    assert (
        main(
            [
                "cache",
                "--target-model",
                target,
                "--completions",
                str(workdir / "c.json"),
                "--out",
                str(workdir / "cache-logits"),
                "--layers",
                "0,2",
                "--dtype",
                "fp32",
                "--with-target-logits",
                "16",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                *train,
                "--cached-hidden-states",
                str(workdir / "cache-logits"),
                "--out",
                str(workdir / "ds"),
                "--max-steps",
                "4",
            ]
        )
        == 0
    )
    trained = load_drafter(workdir / "ds/checkpoints/step-0000004/drafter")
    assert trained.markov_head.markov_w2.weight.abs().sum() > 0  # the Markov head learned from its zero start
    metrics = json.loads((workdir / "ds/metrics.jsonl").read_text().splitlines()[-1])
    assert len(metrics["position_accuracy"]) == len(metrics["accept_rate"]) == len(metrics["confidence_mean"]) == 4
    assert (
        main(
            [*train, "--completions", str(workdir / "c.json"), "--out", str(workdir / "ds-online"), "--max-steps", "2"]
        )
        == 0
    )
    assert "accept_rate" in json.loads((workdir / "ds-online/metrics.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    report = workdir / "ds-eval.json"
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(workdir / "ds"),
                "--target-model",
                target,
                "--completions",
                str(workdir / "c.json"),
                "--online",
                "--check-consistency",
                "--confidence-threshold",
                "0.5",
                "--json",
                str(report),
            ]
        )
        == 0
    )
    figures = json.loads(report.read_text())
    assert figures["lossless"] is True and figures["consistency"]["identical"] is True
    assert figures["confidence_threshold"] == 0.5 and len(figures["confidence"]["predicted"]) == 4
    assert "confidence head (DSpark): predicted/actual acceptance probability" in capsys.readouterr().out
    # sampled: the head against the acceptance of the rule evaluated, the cut of its sampled walk offline too
    for mode in ("--online", "--no-verify"):
        assert (
            main(
                [
                    "eval",
                    "--checkpoint",
                    str(workdir / "ds"),
                    "--target-model",
                    target,
                    "--prompts",
                    str(workdir / "prompts.jsonl"),
                    "--num-prompts",
                    "2",
                    mode,
                    "--temperature",
                    "0.7",
                    "--serving-rule",
                    "sglang",
                    "--confidence-threshold",
                    "0.5",
                    "--max-new-tokens",
                    "12",
                    "--json",
                    str(report),
                ]
            )
            == 0
        )
        figures = json.loads(report.read_text())
        assert figures["serving_rule"] == "sglang" and figures["confidence"]["positions_reached"][0] > 0
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(workdir / "ds"),
                "--target-model",
                target,
                "--completions",
                str(workdir / "c.json"),
                "--num-speculative-tokens",
                "2",
            ]
        )
        == 2
    )
    assert "expected --block-size 2" in capsys.readouterr().err
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(dflash_run),
                "--target-model",
                target,
                "--completions",
                str(workdir / "c.json"),
                "--confidence-threshold",
                "0.5",
            ]
        )
        == 2
    )
    assert "has no confidence head" in capsys.readouterr().err


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def test_stage_two_warm_starts_from_stage_one_weights_only_under_the_rope_scaling_given(workdir, capsys):
    cache = ["--cached-hidden-states", str(workdir / "cache")]
    stage1, stage2 = workdir / "stage1", workdir / "stage2"
    assert _train(workdir, *cache, "--out", str(stage1), "--max-steps", "2", "--max-length", "12") == 0
    assert (
        _train(
            workdir,
            *cache,
            "--out",
            str(stage2),
            "--max-steps",
            "2",
            "--init",
            str(stage1),
            "--rope-scaling",
            json.dumps(YARN),
        )
        == 0
    )
    first = load_drafter(stage1 / "checkpoints/step-0000002/drafter").config
    second = load_drafter(stage2 / "checkpoints/step-0000002/drafter").config
    assert first.rope_scaling is None and second.rope_scaling == YARN
    assert first.trained_context_length <= 12 - 1 + 4 < second.trained_context_length  # the longer of both
    # weights only: a fresh optimizer and schedule (stage 2 starts at step 0, at the warm-up's first learning rate)
    lr = [json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["lr"] for run in (stage1, stage2)]
    assert lr[0] == lr[1] and torch.load(stage2 / "checkpoints/step-0000002/trainer.pt")["step"] == 2
    assert "RoPE yarn factor 4, original_max_position_embeddings 16" in capsys.readouterr().out
    # a resume under another scaling is refused: the run's configuration records it
    assert _train(workdir, *cache, "--out", str(stage2), "--max-steps", "3", "--init", str(stage1), "--resume") == 2
    assert "rope_scaling" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value, expected",
    [
        ('{"rope_type": "yarn", "factor": 4', "is not valid JSON"),
        ('{"rope_type": "ntk", "factor": 4}', "rope_type 'ntk'; expected one of default, linear"),
        ('{"rope_type": "yarn", "original_max_position_embeddings": 16}', "expected factor too"),
        (
            '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 16, "scale": 2}',
            "unknown key 'scale'",
        ),
    ],
)
def test_a_rope_scaling_flag_that_does_not_parse_is_one_line_and_exit_2(workdir, capsys, value, expected):
    with pytest.raises(SystemExit) as stopped:  # argparse's error, on one line
        _train(workdir, "--completions", "c.json", "--out", str(workdir / "never"), "--rope-scaling", value)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--rope-scaling" in err and expected in err
    assert not (workdir / "never").exists()


def test_packed_training_from_a_cache_reads_its_loss_masks_and_says_its_rows(workdir, capsys):
    from flashdraft.data.cache_reader import HiddenStateCache

    cache = HiddenStateCache(workdir / "cache")
    assert [m.tolist() for m in cache.loss_masks()] == [cache[i].loss_mask.bool().tolist() for i in range(len(cache))]
    out = workdir / "packed"
    longest = max(cache.lengths)
    args = ("--cached-hidden-states", str(workdir / "cache"), "--out", str(out), "--max-steps", "2")
    assert _train(workdir, *args, "--pack-length", str(longest + 4)) == 0
    printed = capsys.readouterr().out
    assert f"rows of {longest + 4} tokens" in printed and "--batch-size counts rows" in printed
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 <= row["padding_share"] < 1


def test_an_fp16_target_whose_states_overflow_on_a_training_record_is_refused_before_the_first_step():
    """The check online training makes past the target's 8-token load probe: the first records' states, in fp16."""
    from types import SimpleNamespace

    from flashdraft.errors import FlashdraftError
    from flashdraft.train.data import OnlineRecords
    from flashdraft.train.run import SequenceRecord, _check_fp16_range

    def forward(input_ids):  # [1, T] -> layer 3's states [T, 4] past fp16's range at token 2
        features = torch.zeros(input_ids.shape[1], 2 * 4, dtype=torch.float16)
        features[2, 5] = float("inf")
        return SimpleNamespace(context_features=features[None])

    target = SimpleNamespace(
        dtype=torch.float16, device="cpu", hidden_size=4, set_context_layers=lambda ids: None, forward=forward
    )
    records = OnlineRecords([SequenceRecord(torch.arange(5), torch.ones(5, dtype=torch.bool))], target, [1, 3])
    with pytest.raises(
        FlashdraftError, match=r"training record 0: hidden states of target layer 3 reach inf at token 2"
    ):
        _check_fp16_range(records, target, [1, 3])
    _check_fp16_range(records, SimpleNamespace(dtype=torch.bfloat16), [1, 3])  # bf16: nothing to check
