"""`flashdraft demo`: the whole pipeline on the built-in tiny target, in minutes on a CPU.

generate the target's completions of the built-in coding prompts (train and held-out)
-> cache their context features -> train a drafter (block size 16) for the time left
-> evaluate on the held-out prompts offline and online (lossless and offline == online
checked) against the untrained drafter, the n-gram baseline and the hybrid of the trained
drafter with it -> report.md, report.json and plots. Every stage reuses what a previous run
finished, so a re-run is quick.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from flashdraft.drafter.config import DEFAULT_BLOCK_SIZE
from flashdraft.errors import FlashdraftError
from flashdraft.train.data import BatchSpec


@dataclass(frozen=True)
class DemoSettings:
    """The demo's recipe, tuned for the built-in target on a 2-core CPU (see docs/tiny.md)."""

    target_model: str = "tiny"
    train_prompts: str = "builtin:code"
    heldout_prompts: str = "builtin:code:heldout"
    num_train_prompts: int | None = None  # all
    num_heldout_prompts: int = 8
    max_new_tokens: int = 128
    draft_layers: int = 1
    target_layer_ids: tuple[int, ...] = (1, 2, 3)
    block_size: int = DEFAULT_BLOCK_SIZE
    lr: float = 6e-3
    num_anchors: int = 8  # few blocks per sequence, many steps: measured best per CPU-second (docs/tiny.md)
    batch_size: int = 4
    loss_decay_gamma: float = 7.0
    eval_max_blocks: int | None = None  # walk every held-out completion to its end
    reference_drafter: str | None = "tiny-drafter"  # evaluated next to the live run (None: not evaluated)
    seed: int = 0
    # also decode compiled (`--compile`): the trained drafter against greedy decoding, both on the target's static
    # cache under torch.compile; its first compile takes a minute or two of the budget (docs/tiny.md)
    compile: bool = False


COMPILE_RESERVE_S = 120.0  # the budget kept for the compiled evaluation: its first compile (3 graphs) and run


def _stage(name: str, t_start: float) -> None:
    print(f"\n== {name} == ({time.perf_counter() - t_start:.0f} s into the demo)", flush=True)


def _seconds_per_step(cfg, drafter, target, records, block_size: int, mask_token_id: int) -> float:
    """Time whole training steps on this machine to size the run: forward + backward, gradient clipping and the
    run's own optimizer (Muon's orthogonalisation costs as much as the backward pass on tiny); the drafter's
    weights are restored after."""
    from flashdraft.train.data import make_batch
    from flashdraft.train.optim import build_optimizers
    from flashdraft.train.step import forward_loss, loss_spec

    start = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    drafter = drafter.train()
    optimizer = build_optimizers(drafter, cfg, 100)
    spec = loss_spec(cfg, drafter)
    times = []
    for step in range(5):
        idx = [(step * cfg.batch_size + i) % len(records) for i in range(min(cfg.batch_size, len(records)))]
        batch = make_batch(
            [records[i] for i in idx],
            idx,
            0,
            batch_spec=BatchSpec(
                seed=cfg.seed, num_anchors=cfg.num_anchors, block_size=block_size, mask_token_id=mask_token_id
            ),
        )
        t0 = time.perf_counter()
        parts = forward_loss(drafter, target, batch, spec)
        parts.weighted_sum.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    drafter.load_state_dict(start)
    return sorted(times[1:])[len(times[1:]) // 2] * 1.1  # the median after a warm-up step; logging, evals on top


WARM_UP_SHARE = 0.1  # the first tenth of the steps: the loss falls from its random-init value (39 on tiny)


def loss_ylim(steps: list[int], losses: list[float]) -> tuple[float, float] | None:
    """The loss axis of the steps after the first tenth (warm-up and the first fall, where an
    untrained drafter's loss is several times the rest: on tiny 39, then 4-6), so the curve that
    matters fills the plot; None (matplotlib's own limits) when the first steps would not squash
    the rest into less than half the axis, or there are too few points."""
    later = [loss for step, loss in zip(steps, losses, strict=True) if step > WARM_UP_SHARE * steps[-1]]
    if len(later) < 2:
        return None
    low, high = min(later), max(later)
    if max(losses) - low <= 2 * (high - low):
        return None
    pad = 0.05 * (high - low) or 0.05 * abs(high) or 0.05
    return low - pad, high + pad


def training_curve_figure(rows: list[dict]):
    """The training curve of metrics.jsonl rows: loss (its axis from `loss_ylim`), estimated
    acceptance and held-out τ against the step."""
    from matplotlib.figure import Figure

    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval_tau" in r]
    steps, losses = [r["step"] for r in train_rows], [r["loss"] for r in train_rows]
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    ax.plot(steps, losses, label="training loss")
    ax.set(xlabel="step", ylabel="loss", title="Drafter training")
    ylim = loss_ylim(steps, losses) if train_rows else None
    if ylim is not None:
        ax.set_ylim(*ylim)
        cut = [s for s, loss in zip(steps, losses, strict=True) if loss > ylim[1]]
        ax.annotate(
            f"loss above the axis until step {cut[-1]} (up to {max(losses):.3g})",
            xy=(0.99, 0.97),
            xycoords="axes fraction",
            ha="right",
            va="top",
            fontsize="small",
            color="tab:blue",
        )
    ax2 = ax.twinx()
    ax2.plot(
        [r["step"] for r in train_rows],
        [r["estimated_acceptance"] for r in train_rows],
        color="tab:orange",
        label="estimated acceptance (train)",
    )
    if eval_rows:
        ax2.plot(
            [r["step"] for r in eval_rows],
            [r["eval_tau"] for r in eval_rows],
            "o-",
            color="tab:green",
            label="held-out τ",
        )
    ax2.set(ylabel="tokens per step")
    fig.legend(loc="upper center", ncol=3, fontsize="small")
    return fig


def training_curve(metrics_path: Path, out_png: Path) -> None:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    training_curve_figure(rows).savefig(out_png, dpi=100, bbox_inches="tight")


def _check_same_target(out: Path, target_model: str) -> None:
    """A demo directory from another target (say, before an update of the built-in one) is
    refused up front, with the way out, rather than at some stage deep in the run."""
    from flashdraft.target.weights import TargetHead

    previous = out / "completions-train.json"
    if not previous.is_file():
        return
    try:
        found = json.loads(previous.read_text())["target"]["fingerprint"]
    except (ValueError, KeyError, TypeError):
        return  # not ours to judge: stage 1 names what is wrong with the file
    now = TargetHead.load(target_model).fingerprint()
    if found != now:
        raise FlashdraftError(
            f"{out}: holds a demo run on another target (fingerprint {found}; {target_model} is now {now}, "
            f"for instance after an update of the built-in target); remove {out} or use another --out"
        )


def _train_stage(s: DemoSettings, out: Path, train_cache: Path, heldout_cache: Path, deadline: float) -> tuple:
    """Train until `deadline` (perf_counter; sized by timing two steps here), or reuse a finished
    run; returns (the best held-out checkpoint's drafter directory, untrained drafter directory, facts)."""
    from flashdraft.drafter.checkpoint import save_drafter
    from flashdraft.drafter.init import DrafterChoices, new_drafter_for_target
    from flashdraft.drafter.run_dir import latest_checkpoint, read_best
    from flashdraft.target.weights import TargetHead
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.run import TrainRun, load_training_records, run_training

    layer_ids = list(s.target_layer_ids)
    target = TargetHead.load(s.target_model)  # training reads the cache: no target forward
    untrained_dir = out / "drafter-untrained"
    choices = DrafterChoices(num_layers=s.draft_layers, block_size=s.block_size, target_layer_ids=layer_ids)
    untrained = new_drafter_for_target(target, choices, seed=s.seed)
    if not (untrained_dir / "model.safetensors").exists():
        save_drafter(untrained, untrained_dir)
    run_dir = out / "run"
    done_marker = run_dir / "DEMO_DONE"
    cfg = TrainConfig(
        lr=s.lr,
        num_anchors=s.num_anchors,
        batch_size=s.batch_size,
        seed=s.seed,
        loss_decay_gamma=s.loss_decay_gamma,
        log_every=5,
        keep_checkpoints=1,
        keep_best=True,
    )
    if done_marker.exists():
        train_info = json.loads(done_marker.read_text())
        print(f"reusing the finished training run in {run_dir} ({train_info['steps']} steps)")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        records, _ = load_training_records(target, layer_ids, str(train_cache), None)
        per_step = _seconds_per_step(cfg, untrained, target, records, s.block_size, untrained.config.mask_token_id)
        steps = max(10, int((deadline - time.perf_counter()) / per_step))
        cfg = replace(
            cfg,
            epochs=-(-steps // max(1, len(records) // cfg.batch_size)),
            max_steps=steps,
            save_every=steps,
            eval_every=max(10, steps // 4),
        )
        print(f"{per_step:.2f} s per step here: training {steps} steps ({steps * per_step / 60:.1f} min)")
        t0 = time.perf_counter()
        run = TrainRun(
            s.target_model,
            str(run_dir),
            cached_hidden_states=str(train_cache),
            init=str(untrained_dir),
            eval_cached_hidden_states=str(heldout_cache),
        )
        run_training(cfg, run)
        train_info = {"steps": steps, "train_seconds": round(time.perf_counter() - t0, 1)}
        done_marker.write_text(json.dumps(train_info))
    best = read_best(run_dir)
    train_info["best_step"] = best["step"] if best else train_info["steps"]
    trained_dir = Path(best["path"]) if best else latest_checkpoint(run_dir) / "drafter"
    return trained_dir, untrained_dir, train_info


def _generate_stage(s: DemoSettings, out: Path) -> tuple[Path, Path]:
    """The target's own completions of the training and the held-out prompts."""
    from flashdraft.data.generate import GenerateConfig, run_generate

    paths = []
    for split, prompts, num_prompts in (
        ("train", s.train_prompts, s.num_train_prompts),
        ("heldout", s.heldout_prompts, s.num_heldout_prompts),
    ):
        config = GenerateConfig(
            target_model=s.target_model,
            prompts=prompts,
            out=str(out / f"completions-{split}.json"),
            num_prompts=num_prompts,
            max_new_tokens=s.max_new_tokens,
            batch_size=16,
            seed=s.seed,
        )
        paths.append(run_generate(config))
    return paths[0], paths[1]


def _reference_figures(drafter: str, reference: dict) -> dict:
    """The shipped reference drafter's figures, for the report."""
    return {
        "drafter": drafter,
        "tau_offline": reference["consistency"]["offline_tau"],
        "tau_online": reference["consistency"]["online_tau"],
        "lossless": reference["lossless"],
        "speedup": reference["speedup"],
        "offline_equals_online": reference["consistency"]["identical"],
    }


def run_demo(out: str | Path = "demo-out", minutes: float = 5.0, settings: DemoSettings | None = None) -> dict:
    from flashdraft.data.cache_run import CacheConfig, run_cache
    from flashdraft.drafter.run_dir import BUILTIN_DRAFTERS
    from flashdraft.evaluation.config import EvalConfig
    from flashdraft.evaluation.records import quiet
    from flashdraft.evaluation.report import write_report
    from flashdraft.evaluation.run import run_eval as evaluate
    from flashdraft.target.model import TargetModel

    s = settings or DemoSettings()
    if minutes <= 0:
        raise FlashdraftError(f"--minutes {minutes}: expected a positive time budget")
    t_start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layers_arg = list(s.target_layer_ids)
    _check_same_target(out, s.target_model)

    _stage("1/5 generate the target's own completions", t_start)
    train_c, heldout_c = _generate_stage(s, out)

    _stage("2/5 cache context features", t_start)
    train_cache, heldout_cache = (
        run_cache(CacheConfig(s.target_model, str(completions), str(out / name), layers=layers_arg, dtype="fp32"))
        for completions, name in ((train_c, "cache-train"), (heldout_c, "cache-heldout"))
    )

    _stage("3/5 train the drafter", t_start)
    # finish with a tenth of the budget to spare, after evaluation and report (measured 92 s + 10 s of 300 on a
    # 2-core CPU without AVX-512: 0.4 of the budget is reserved for them)
    deadline = t_start + 0.9 * minutes * 60 - max(30.0, 0.4 * minutes * 60) - (COMPILE_RESERVE_S if s.compile else 0)
    trained_dir, untrained_dir, train_info = _train_stage(s, out, train_cache, heldout_cache, deadline)

    _stage("4/5 evaluate on held-out prompts", t_start)
    torch.set_num_threads(1)  # batch-1 decoding of a tiny model is fastest on one thread
    # online with the consistency check: live figures (lossless, speed-up) plus the offline walk
    common = dict(target_model=s.target_model, completions=str(heldout_c), max_blocks=s.eval_max_blocks)
    loaded = TargetModel.load(s.target_model)  # once for every evaluation

    def run_eval(cfg, log):
        return evaluate(cfg, log, target=loaded)

    trained = run_eval(EvalConfig(str(trained_dir), online=True, check_consistency=True, **common), quiet)
    untrained_offline = run_eval(EvalConfig(str(untrained_dir), **common), quiet)
    ngram = run_eval(EvalConfig(None, proposer="ngram", online=True, check_consistency=True, **common), quiet)
    hybrid = run_eval(
        EvalConfig(str(trained_dir), proposer="hybrid", online=True, check_consistency=True, **common), quiet
    )
    # the trained drafter and greedy decoding, both on the static cache compiled once (the same figures as above)
    compiled = run_eval(EvalConfig(str(trained_dir), online=True, compile=True, **common), quiet) if s.compile else None
    reference = None
    # the shipped drafter (trained for an hour on 1 M tokens), where this copy of flashdraft has it
    if s.reference_drafter and s.target_model == "tiny" and BUILTIN_DRAFTERS[s.reference_drafter].is_dir():
        reference = run_eval(EvalConfig(s.reference_drafter, online=True, check_consistency=True, **common), quiet)

    _stage("5/5 report", t_start)
    write_report(trained, out / "eval")
    training_curve(out / "run" / "metrics.jsonl", out / "training_curve.png")
    report = _summary(s, trained, untrained_offline, ngram, hybrid, train_info, trained_dir)
    if reference is not None:
        report["reference"] = _reference_figures(s.reference_drafter, reference)
    if compiled is not None:
        report["compiled"] = _compiled_figures(compiled)
    report["total_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report))
    print(_markdown(report))
    return report


def _summary(
    s: DemoSettings,
    trained: dict,
    untrained_offline: dict,
    ngram: dict,
    hybrid: dict,
    train_info: dict,
    trained_dir: Path,
) -> dict:
    consistency = trained["consistency"]
    return {
        "target": s.target_model,
        "tau_offline": consistency["offline_tau"],
        "tau_online": consistency["online_tau"],
        "offline_equals_online": consistency["identical"],
        "lossless": trained["lossless"],
        "speedup": trained["speedup"],
        "speculative_tokens_per_s": trained["speculative_tokens_per_s"],
        "greedy_tokens_per_s": trained["greedy_tokens_per_s"],
        "tau_untrained": untrained_offline["tau"],
        "tau_ngram": ngram["tau"],
        "speedup_ngram": ngram["speedup"],
        "lossless_ngram": ngram["lossless"],
        "tau_hybrid": hybrid["consistency"]["offline_tau"],
        "tau_hybrid_online": hybrid["consistency"]["online_tau"],
        "speedup_hybrid": hybrid["speedup"],
        "lossless_hybrid": hybrid["lossless"],
        "offline_equals_online_hybrid": hybrid["consistency"]["identical"],
        "train_seconds": train_info["train_seconds"],
        "train_steps": train_info["steps"],
        "best_step": train_info.get("best_step", train_info["steps"]),
        "heldout_prompts": len(trained["per_prompt"]),
        "block_size": s.block_size,
        "drafter": str(trained_dir),
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(s).items()},
    }


def _compiled_figures(compiled: dict) -> dict:
    """The compiled evaluation's figures: tokens/s of both sides, the speed-up, and what compiled when."""
    keys = ("tau", "lossless", "speedup", "speculative_tokens_per_s", "greedy_tokens_per_s", "compile")
    return {key: compiled[key] for key in keys}


def _compiled_row(r: dict) -> list[str]:
    if "compiled" not in r:
        return []
    c = r["compiled"]
    return [
        f"| trained DFlash, compiled (against compiled greedy) | | {c['tau']:.2f} | {c['lossless']} | "
        f"{c['speedup']:.2f}x |"
    ]


def _reference_row(r: dict) -> list[str]:
    ref = r.get("reference")
    if ref is None:
        return []
    return [
        f"| shipped `{ref['drafter']}` (reference) | {ref['tau_offline']:.2f} | {ref['tau_online']:.2f} | "
        f"{ref['lossless']} | {ref['speedup']:.2f}x |"
    ]


def _markdown(r: dict) -> str:
    return "\n".join(
        [
            "# flashdraft demo",
            "",
            f"Target `{r['target']}`, drafter trained {r['train_seconds']} s ({r['train_steps']} steps; the best "
            f"held-out checkpoint, step {r['best_step']}, is evaluated), block size {r['block_size']}, "
            f"{r['heldout_prompts']} held-out prompts; whole demo {r['total_seconds']} s.",
            "",
            "| drafter | τ offline | τ online | lossless | speed-up vs greedy |",
            "|---|---|---|---|---|",
            f"| trained DFlash | {r['tau_offline']:.2f} | {r['tau_online']:.2f} | {r['lossless']} "
            f"| {r['speedup']:.2f}x |",
            *_compiled_row(r),
            *_reference_row(r),
            f"| untrained DFlash | {r['tau_untrained']:.2f} | | | |",
            f"| n-gram prompt lookup | {r['tau_ngram']:.2f} | | {r['lossless_ngram']} | {r['speedup_ngram']:.2f}x |",
            f"| hybrid (trained DFlash + n-gram) | {r['tau_hybrid']:.2f} | {r['tau_hybrid_online']:.2f} | "
            f"{r['lossless_hybrid']} | {r['speedup_hybrid']:.2f}x |",
            "",
            f"Offline τ equals online τ step for step: {r['offline_equals_online']} (hybrid: "
            f"{r['offline_equals_online_hybrid']}).",
            "",
            "![training curve](training_curve.png)",
            "",
            "![acceptance histogram](eval/histogram.png)",
            "",
            "![per-position acceptance](eval/position_acceptance.png)",
            "",
            "Full evaluation of the trained drafter (per prompt): [eval/report.md](eval/report.md)",
            "",
        ]
    )
