"""The training loop: AdamW or Muon (`flashdraft.train.optim`), warm-up + cosine decay, gradient
accumulation and clipping, checkpoints, resume, metrics. Reads top to bottom: configuration, guards, set-up, loop.

Batches come from `flashdraft.train.data`: which records a step trains on is a function of
(seed, epoch, step) only, and each record's anchors of (seed, epoch, record index), so
`--resume` replays exactly the uninterrupted run and any world size sees the same global
batch. The loss of a global batch is normalised by its total weight across all ranks and
micro-batches, so gradient accumulation and DDP change nothing but speed.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from flashdraft.distributed import (
    Dist,
    any_rank,
    full_state_dict,
    load_full_state_dict,
    on_main,
    unwrap,
    wrap_model,
)
from flashdraft.drafter.checkpoint import load_drafter
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.drafter.run_dir import (
    CHECKPOINTS,
    RunLock,
    latest_checkpoint,
    load_trainer_state,
    read_best,
    remove_unfinished,
    save_checkpoint,
)
from flashdraft.errors import FlashdraftError, Interrupted
from flashdraft.files import DiskFullError, write_text_atomic
from flashdraft.progress import Progress
from flashdraft.stop import StopRequests
from flashdraft.target.model import TargetModel
from flashdraft.target.quantisation import quantisation_record
from flashdraft.train.compiled import CompiledStep, compile_by_default
from flashdraft.train.config import RESUMABLE_CHANGES, TrainConfig
from flashdraft.train.data import OnlineRecords
from flashdraft.train.engine_feed import EngineLost
from flashdraft.train.held_out import check_keep_best, held_out_metrics, keep_if_best
from flashdraft.train.host_memory import FeatureBuffers
from flashdraft.train.learning import LearningCheck, mean_record_length
from flashdraft.train.metrics import MetricsWriter, Window, memory_and_compiles
from flashdraft.train.optim import Optimizers, build_optimizers, warmup_steps
from flashdraft.train.packing import PackPlan, pack_plan
from flashdraft.train.prefetch import BatchPrefetcher
from flashdraft.train.recipe import PUBLISHED_RECIPE
from flashdraft.train.step import global_batch, loss_spec, optimizer_step, packed_units, stream_order


def check_no_shortcut(drafter: DFlashDrafter, target: TargetModel) -> None:
    """The layer whose output makes the labels (the target's last) must never feed `fc`:
    otherwise the answer leaks into the conditioning (failure mode 2)."""
    final = target.num_layers - 1
    if final in drafter.config.target_layer_ids:
        raise FlashdraftError(
            f"target_layer_ids {drafter.config.target_layer_ids} include layer {final}, the target's final layer "
            f"that produces the labels; the drafter would read the answer. Use ids below {final}"
        )
    if drafter.config.num_target_layers != target.num_layers:
        raise FlashdraftError(
            f"drafter num_target_layers {drafter.config.num_target_layers} != target's {target.num_layers} layers"
        )
    if drafter.config.hidden_size != target.hidden_size or drafter.config.vocab_size != target.vocab_size:
        raise FlashdraftError(
            f"drafter hidden_size/vocab_size {drafter.config.hidden_size}/{drafter.config.vocab_size} differ from "
            f"the target's {target.hidden_size}/{target.vocab_size}"
        )


def _steps(cfg: TrainConfig, num_records: int, world: int, plan: PackPlan | None = None) -> tuple[int, int]:
    """(steps per epoch, total steps) of the run: --max-steps when given, over as many epochs as that takes (as
    transformers' `max_steps` overrides `num_train_epochs`), else --epochs whole epochs. Packed: the epoch's rows,
    the last global batch filled with empty rows."""
    global_batch = cfg.batch_size * cfg.grad_accum * world
    steps_per_epoch = num_records // global_batch
    if plan is not None:
        steps_per_epoch = packed_units(cfg, plan, world) // global_batch
    if steps_per_epoch == 0:
        raise FlashdraftError(
            f"{num_records} training records are fewer than one global batch of {global_batch} "
            f"(batch size {cfg.batch_size} x grad accum {cfg.grad_accum} x {world} ranks)"
        )
    return steps_per_epoch, steps_per_epoch * cfg.epochs if cfg.max_steps is None else cfg.max_steps


def describe_steps(cfg: TrainConfig, steps_per_epoch: int, total_steps: int, num_records: int, world: int) -> list[str]:
    """The run's first lines: how many steps and epochs it does and why; an --eval-every past its end."""
    why = f"--max-steps {cfg.max_steps}" if cfg.max_steps is not None else f"--epochs {cfg.epochs}, no --max-steps"
    lines = [
        f"training {total_steps} steps ({why}): {total_steps / steps_per_epoch:.3g} epochs of {steps_per_epoch} "
        f"steps ({num_records} records, {cfg.batch_size * cfg.grad_accum * world} a step)"
    ]
    if cfg.eval_every > total_steps:
        lines.append(
            f"--eval-every {cfg.eval_every} is past the run's {total_steps} steps: held-out evaluation runs "
            f"once, after the last step"
        )
    return lines


def _write_run_config(cfg: TrainConfig, run_dir: Path, resume: bool) -> dict:
    """RUN/run_config.json; a resumed run must compute what the run it resumes computed."""
    config_path = run_dir / "run_config.json"
    config_dict = asdict(cfg)
    if resume and config_path.exists():
        previous = json.loads(config_path.read_text())
        # a field newer than the run's record compares as its default: what that run computed
        defaults = {f.name: f.default for f in fields(TrainConfig)}
        changed = {
            k for k in config_dict if k not in RESUMABLE_CHANGES and previous.get(k, defaults.get(k)) != config_dict[k]
        }
        if changed:
            raise FlashdraftError(
                f"{config_path}: --resume with a different configuration ({', '.join(sorted(changed))}); "
                f"resume with the run's own settings or start a new --out"
            )
    write_text_atomic(config_path, json.dumps(config_dict, indent=2) + "\n", "the run's configuration")
    print("training configuration:", json.dumps(config_dict), flush=True)
    return config_dict


def _resume(run_dir: Path, model, optimizer: Optimizers, num_records: int, dist: Dist, verify: bool, fsdp: bool) -> int:
    """Restore weights, optimizer, schedule and RNG from the newest complete checkpoint;
    returns the step to continue from (0 without one)."""
    if dist.is_main:
        remove_unfinished(run_dir)  # under the run's lock: no other trainer writes here
    last = latest_checkpoint(run_dir)
    if last is None:
        if dist.is_main:
            print(f"--resume: no complete checkpoint in {run_dir}; starting from step 0", flush=True)
        return 0
    state = load_trainer_state(last, verify=verify)
    if state["num_records"] != num_records or state["world_size"] != dist.world:
        raise FlashdraftError(
            f"{last}: saved with {state['num_records']} records on {state['world_size']} ranks; this run has "
            f"{num_records} records on {dist.world} ranks (resume needs the same data and world size)"
        )
    saved = load_drafter(last / "drafter", device=dist.device)
    load_full_state_dict(model, saved.state_dict(), fsdp)
    optimizer.load_state_dict(state["optimizer"], str(last))
    torch.set_rng_state(state["torch_rng"])
    if dist.is_main:
        print(f"resumed from {last} at step {state['step']}", flush=True)
    return state["step"]


def _prepare(
    cfg: TrainConfig, drafter: DFlashDrafter, target: TargetModel, records, dist: Dist, eval_records, eval_tau_records
) -> tuple[TrainConfig, int, int, LearningCheck, PackPlan | None]:
    """The checks before a run, the configuration it computes with (`recorded_config`), its steps (said in its
    first lines), its learning check and its packed rows (--pack-length)."""
    check_no_shortcut(drafter, target)
    check_keep_best(cfg, eval_records, eval_tau_records)
    cfg = recorded_config(cfg, drafter, target)
    plan = None
    if cfg.pack_length is not None:
        global_rows = cfg.batch_size * cfg.grad_accum * dist.world
        plan = pack_plan(records, cfg.pack_length, cfg.num_anchors, cfg.max_length, rows_multiple=global_rows)
    steps_per_epoch, total_steps = _steps(cfg, len(records), dist.world, plan)
    if dist.is_main:
        lines = describe_steps(cfg, steps_per_epoch, total_steps, len(records), dist.world)
        print("\n".join(lines + (plan.lines(len(records)) if plan else [])), flush=True)
    learning = LearningCheck(
        cfg.lr,
        total_steps,
        warmup_steps(total_steps, cfg.warmup_fraction),
        cfg.num_anchors,
        mean_record_length(records),
        bool(eval_tau_records),
    )
    return cfg, steps_per_epoch, total_steps, learning, plan


def _report_held_out(
    bar: Progress, writer: MetricsWriter | None, learning: LearningCheck, step: int, held_out: dict
) -> None:
    _warn(bar, learning.see(step, held_out.get("eval_tau"), held_out=True))
    if writer is not None and held_out:
        writer.write(step, held_out)
        bar.write(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in held_out.items() if isinstance(v, float)))


def _warn(bar: Progress, line: str | None) -> None:
    if line is not None and not bar.disable:
        bar.write(line)


def _log(bar: Progress, writer: MetricsWriter | None, step: int, metrics: dict) -> None:
    if writer is not None:
        writer.write(step, metrics)
    bar.set_postfix(
        loss=f"{metrics['loss']:.3f}",
        acc1=f"{metrics['position_accuracy'][0]:.2f}",
        tau_est=f"{metrics['estimated_acceptance']:.2f}",
        pad=f"{metrics['padding_share']:.0%}",
        wait=f"{metrics.get('wait_s', 0):.2f}s",
        compute=f"{metrics.get('compute_s', 0):.2f}s",
        refresh=not bar.plain,
    )


def _start_stream(cfg: TrainConfig, records, steps: range, steps_per_epoch: int, dist: Dist, plan) -> None:
    """A streamed source (the engine) is told which records this rank reads over `steps`, in order (`plan`: its
    rows' records, row by row; a resumed run starts at its checkpoint's step: the stream's position)."""
    if hasattr(records, "start"):
        records.start(stream_order(cfg, len(records), steps, steps_per_epoch, dist, plan))


def _compiled_step(cfg: TrainConfig, model, dist: Dist, backend: str) -> CompiledStep | None:
    """The step's forward and loss compiled (`--compile`; by default where it pays), or None."""
    if cfg.compile if cfg.compile is not None else compile_by_default(dist.device):
        return CompiledStep(model, backend=backend)
    return None


def _prefetcher(
    cfg: TrainConfig, records, steps: range, steps_per_epoch: int, dist: Dist, plan, options: LoopOptions
) -> BatchPrefetcher | None:
    """The steps' batches built `options.prefetch` ahead by `options.data_workers` threads (`train.prefetch`; one for
    a streamed source, read in its order), their features in the run's buffers (`train.host_memory`: pinned on CUDA,
    else reused once let go); None (built in the step) at depth 0 or when the target runs in this process for them
    (online: its forward would overlap the held-out evaluation's on the same model, and it computes on the step's
    own device and cores)."""
    if not options.prefetch or isinstance(records, OnlineRecords):
        return None
    pin = dist.device.type == "cuda"
    # batches alive at once: `prefetch` + 1 built ahead, the step's, the one before it until its name is rebound
    buffers = FeatureBuffers(pin=pin, keep=(options.prefetch + 3) * cfg.grad_accum)

    def build(step: int):
        return global_batch(cfg, records, step, steps_per_epoch, dist, plan, buffers=buffers)

    workers = 1 if hasattr(records, "start") else options.data_workers
    return BatchPrefetcher(build, steps, options.prefetch, pin=pin, workers=workers)


def _fetch_batch(
    cfg: TrainConfig, records, step: int, steps_per_epoch: int, run_dir: Path, state: tuple, plan, prefetcher=None
):
    """The step's batch (`plan`: packed rows; `prefetcher`: built ahead) and the seconds the step waited for it (the
    build, or what is left of it; the engine's states, when it feeds); an engine lost mid-run ends the run with a
    checkpoint (`state`: what `_save` takes after the step count)."""
    started, lost, batch = time.monotonic(), None, None
    try:
        if prefetcher is None:
            batch = global_batch(cfg, records, step, steps_per_epoch, state[-1], plan)
        else:
            batch = prefetcher.get(step)
    except EngineLost as e:
        lost = e
    # a streamed source: every rank stops at the same step when any rank's engine is lost (none left waiting)
    if hasattr(records, "start") and any_rank(lost is not None):
        lost = lost or EngineLost(f"rank {state[-1].rank}: an engine of another rank stopped answering")
        raise _engine_lost(lost, run_dir, step, state) from None
    return batch, time.monotonic() - started


def _engine_lost(error: EngineLost, run_dir: Path, done: int, state: tuple) -> FlashdraftError:
    """An engine died mid-run: the steps done are checkpointed and the run stops in one line naming it."""
    if done > 0:
        _save(run_dir, done, *state)
    where = f"checkpoint {latest_checkpoint(run_dir)}" if done > 0 else "no step done, no checkpoint"
    return FlashdraftError(f"{error}; stopped after step {done} ({where}): re-run with --resume once it serves again")


def _save(
    run_dir: Path,
    step: int,
    model,
    optimizer: Optimizers,
    cfg: TrainConfig,
    config_dict: dict,
    num_records: int,
    dist: Dist,
) -> None:
    """A checkpoint of everything resume needs (gathered from all ranks under FSDP)."""
    full = full_state_dict(model, cfg.fsdp)
    optimizer_state = optimizer.state_dict()  # every rank: under FSDP this gathers the shards

    def save() -> None:
        trainer_state = {
            "step": step,
            "optimizer": optimizer_state,
            "torch_rng": torch.get_rng_state(),
            "num_records": num_records,
            "world_size": dist.world,
            "config": config_dict,
        }
        save_checkpoint(run_dir, step, unwrap(model).config, full, trainer_state, cfg.keep_checkpoints)

    # the other ranks wait for rank 0's save, and stop with it when it failed (a full disk)
    on_main(dist, save, f"step {step}: writing its checkpoint")


def recorded_config(cfg: TrainConfig, drafter: DFlashDrafter, target: TargetModel) -> TrainConfig:
    """The configuration a run computes with: the options left unset from the published recipe (a no-op after
    run_training, which took the target's), and the recorded fields: the drafter's layout and the target's
    fingerprint."""
    cfg, _ = cfg.with_recipe(PUBLISHED_RECIPE)
    dcfg = drafter.config
    return cfg.recording(
        target_layer_ids=dcfg.target_layer_ids,
        mask_token_id=dcfg.mask_token_id,
        block_size=dcfg.block_size,
        first_draft_position=dcfg.first_draft_position,
        target_fingerprint=cfg.target_fingerprint or target.fingerprint(),
        target_quantisation=cfg.target_quantisation or quantisation_record(target),
    )


def _interrupted(
    stop: StopRequests, bar: Progress, run_dir: Path, done: int, total_steps: int, dist: Dist
) -> Interrupted:
    """The stop after step `done` (its checkpoint written), for every rank to raise."""
    bar.n = done  # the bar's count lags behind its loop; the line it closes with says where
    bar.close()
    signum = stop.signum or signal.SIGTERM  # a rank that got none stops with its peers
    where = run_dir / CHECKPOINTS / f"step-{done:07d}"
    return Interrupted(
        signum,
        f"{signal.Signals(signum).name} after step {done} of {total_steps}: checkpoint {where}" if dist.is_main else "",
        "--resume",
    )


def _wrap(cfg: TrainConfig, drafter: DFlashDrafter, total_steps: int, dist: Dist) -> tuple[torch.nn.Module, Optimizers]:
    """The drafter on this rank's device, wrapped for the world (DDP or FSDP2), and its optimizers."""
    drafter.to(dist.device).train()
    model = wrap_model(drafter, dist, cfg.fsdp)
    optimizer = build_optimizers(model, cfg, total_steps)
    return model, optimizer


def _progress_bar(start_step: int, total_steps: int, dist: Dist) -> Progress:
    """The steps to run, as the main rank's progress bar (the other ranks' are silent)."""
    return Progress(
        range(start_step, total_steps),
        initial=start_step,
        total=total_steps,
        desc="train",
        disable=not dist.is_main,
        dynamic_ncols=True,
    )


@dataclass(frozen=True)
class HeldOut:
    """The held-out sets a run evaluates every --eval-every steps: training records for the held-out loss and
    estimated acceptance, `flashdraft.evaluation.records.EvalRecord`s for the real offline τ (either may be None)."""

    records: object = None
    tau_records: list | None = None


@dataclass(frozen=True)
class LoopOptions:
    """How a run goes, not what it computes: resumed from its newest checkpoint, its metrics also sent to
    `report_to`, checksums verified on resume, `on_step(step)` called after each step (tests)."""

    resume: bool = False
    report_to: tuple[str, ...] = ()
    verify: bool = True
    on_step: object = None
    compile_backend: str = "inductor"  # with --compile (tests: "eager", the same graphs without inductor's compile)
    prefetch: int = 2  # global batches built ahead of the step in a thread (`train.prefetch`); 0: in the step
    data_workers: int = 2  # threads building them at once (a streamed source: one)


def train(
    cfg: TrainConfig,
    drafter: DFlashDrafter,
    target: TargetModel,
    records,
    run_dir: Path,
    held_out: HeldOut | None = None,
    options: LoopOptions = LoopOptions(),
    dist: Dist | None = None,
) -> DFlashDrafter:
    """Train `drafter` on `records` (cache or online records) into `run_dir`, evaluating `held_out`."""
    eval_records, eval_tau_records = (held_out.records, held_out.tau_records) if held_out else (None, None)
    resume, report_to, verify, on_step = options.resume, options.report_to, options.verify, options.on_step
    dist = dist or Dist()
    cfg, steps_per_epoch, total_steps, learning, plan = _prepare(
        cfg, drafter, target, records, dist, eval_records, eval_tau_records
    )
    lock = RunLock(run_dir) if dist.is_main else None
    writer = prefetcher = None
    try:
        config_dict = _write_run_config(cfg, run_dir, resume) if dist.is_main else asdict(cfg)
        model, optimizer = _wrap(cfg, drafter, total_steps, dist)
        spec, compiled = loss_spec(cfg, drafter), _compiled_step(cfg, model, dist, options.compile_backend)
        start_step = _resume(run_dir, model, optimizer, len(records), dist, verify, cfg.fsdp) if resume else 0
        _start_stream(cfg, records, range(start_step, total_steps), steps_per_epoch, dist, plan)
        prefetcher = _prefetcher(cfg, records, range(start_step, total_steps), steps_per_epoch, dist, plan, options)
        writer = MetricsWriter(run_dir, list(report_to), config_dict, start_step) if dist.is_main else None
        bar = _progress_bar(start_step, total_steps, dist)
        window = Window(cfg.first_draft_position)
        best = read_best(run_dir) if resume else None
        # SIGTERM/SIGINT: finish the step in flight, checkpoint it, stop (a second signal changes nothing)
        with StopRequests("step", dist.prefix()) as stop:
            for step in bar:
                epoch = step // steps_per_epoch
                state = (model, optimizer, cfg, config_dict, len(records), dist)
                batch, waited = _fetch_batch(cfg, records, step, steps_per_epoch, run_dir, state, plan, prefetcher)
                started = time.monotonic()
                result, grad_norm = optimizer_step(
                    model, target, optimizer, batch, spec, cfg.grad_clip, dist, run_dir, compiled
                )
                window.time(waited, time.monotonic() - started)
                if on_step is not None:
                    on_step(step)
                window.add(result, batch.micro_batches, dist.world)
                done = step + 1
                if done % cfg.log_every == 0 or done == total_steps:
                    figures = window.metrics(optimizer.last_lr(), grad_norm, epoch)
                    metrics = figures | memory_and_compiles(dist.device, compiled)
                    _log(bar, writer, done, metrics)
                    _warn(bar, learning.see(done, metrics["estimated_acceptance"], held_out=False))
                    window = Window(cfg.first_draft_position)
                if cfg.eval_every and (done % cfg.eval_every == 0 or done == total_steps):
                    held_out = held_out_metrics(model, target, cfg, dist, eval_records, eval_tau_records)
                    _report_held_out(bar, writer, learning, done, held_out)
                    if cfg.keep_best:
                        best = keep_if_best(run_dir, done, model, held_out, best, cfg, dist)
                saved = done % cfg.save_every == 0 or done == total_steps
                if saved:
                    _save(run_dir, done, *state)
                # every rank stops after the same step: one scalar all-reduce of "a signal came here"
                if done < total_steps and any_rank(stop.requested):
                    if not saved:
                        _save(run_dir, done, *state)
                    raise _interrupted(stop, bar, run_dir, done, total_steps, dist)
        if dist.is_main and learning.verdict():
            print(learning.verdict(), flush=True)
    except DiskFullError as e:
        e.then = (
            "free space (or move the run) and re-run the same command with --resume: it continues from the "
            "newest complete checkpoint"
        )
        raise
    finally:
        if prefetcher is not None:
            prefetcher.close()
        if writer is not None:
            writer.close()
        if lock is not None:
            lock.release()
    return unwrap(model)
