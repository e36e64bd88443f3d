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
import math
import signal
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path

import torch

from flashdraft.distributed import (
    Dist,
    all_reduce_max,
    all_reduce_sum,
    any_rank,
    full_state_dict,
    load_full_state_dict,
    no_grad_sync,
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
    save_best,
    save_checkpoint,
)
from flashdraft.errors import FlashdraftError, Interrupted
from flashdraft.evaluation.offline import evaluate_offline
from flashdraft.evaluation.results import record_context_edges
from flashdraft.files import DiskFullError, write_text_atomic
from flashdraft.progress import Progress
from flashdraft.stop import StopRequests
from flashdraft.target.model import TargetModel
from flashdraft.train.data import Batch, add_context_noise, make_batch, record_generator
from flashdraft.train.learning import LearningCheck, mean_record_length
from flashdraft.train.loss import DSparkLoss, block_loss, estimated_acceptance, label_weight_total
from flashdraft.train.metrics import MetricsWriter, StepResult, Window, dspark_metrics, selector_metrics
from flashdraft.train.optim import Optimizers, build_optimizers, warmup_steps
from flashdraft.train.recipe import PUBLISHED_RECIPE, Recipe


@dataclass
class TrainConfig:
    """Everything that decides what a run computes; written to RUN/run_config.json."""

    # None: the recipe's (`apply_recipe`, `recipe.py`): the published one, or the tiny target's on `tiny`
    epochs: int | None = None  # whole epochs, when no --max-steps is given
    max_steps: int | None = None  # the steps run, over as many epochs as they take
    lr: float | None = None
    warmup_fraction: float = 0.04
    min_lr_fraction: float = 0.0
    weight_decay: float = 0.0
    # "muon": Muon on the layers' and fc's matrices, AdamW on the rest (with D-PACE 1.11x / 1.09x the held-out
    # tau of AdamW at equal steps, docs/benchmarks.md); "adamw": AdamW for all (the published recipe; --fsdp)
    optimizer: str = "muon"
    muon_lr: float | None = None  # Muon's lr (None: lr; its update is scaled to AdamW's RMS)
    grad_clip: float = 1.0
    batch_size: int = 4  # sequences per micro-batch per rank
    grad_accum: int = 1
    num_anchors: int | None = None  # anchors (blocks) sampled per sequence
    max_length: int | None = None
    # per-position weights: "dpace" (dpace_alpha; measured 1.10-1.13x the held-out tau of "decay" at equal
    # steps, docs/benchmarks.md) or "decay" (loss_decay_gamma, the published recipe)
    loss_weighting: str = "dpace"
    loss_decay_gamma: float | None = None  # None or 0: no decay (run_training fills in the recipe's for None)
    dpace_alpha: float = 0.5  # D-PACE smoothing: q~ = (1 - alpha) q + alpha
    kl_weight: float = 0.0  # opt-in soft-label KL to the stored top-k target logits
    # DFlash2: weight of the candidate selector's cross-entropy, and what to do with a label outside the
    # unary top-K ("inject" it into the candidates, or "skip" the position; docs/benchmarks.md compares them)
    selector_loss_weight: float = 0.3  # measured best of 0.1 / 0.3 / 1 / 3 from scratch and from a DFlash drafter
    selector_missing_label: str = "inject"
    # DSpark: the paper's loss terms (0.1 CE + 0.9 |p_draft - p_target|_1 + 1.0 confidence BCE; `loss.DSparkLoss`)
    dspark_ce_weight: float = 0.1
    dspark_tv_weight: float = 0.9
    confidence_loss_weight: float = 1.0
    noise_std: float = 0.0  # Gaussian noise on context features (never on labels)
    seed: int = 0
    save_every: int = 200
    keep_checkpoints: int = 3
    log_every: int = 10
    eval_every: int = 0
    eval_max_blocks: int = 32  # speculative steps per held-out record for the real (offline) τ
    keep_best: bool = False  # also keep RUN/best/: the drafter of the best held-out τ (held-out loss without τ)
    fsdp: bool = False
    # the drafter's RoPE scaling for this run (stage 2 of the long-context recipe: YaRN on a warm start); None: the
    # drafter's own; {"rope_type": "default"}: native RoPE
    rope_scaling: dict | None = None
    # filled in at start, for the record (not options)
    target_layer_ids: list[int] = field(default_factory=list, metadata={"recorded": True})
    mask_token_id: int = field(default=-1, metadata={"recorded": True})
    block_size: int = field(default=0, metadata={"recorded": True})
    first_draft_position: int = field(default=1, metadata={"recorded": True})  # the layout: 0 anchor-first (DSpark)
    data_fingerprint: str = field(default="", metadata={"recorded": True})
    target_fingerprint: str = field(default="", metadata={"recorded": True})

    @classmethod
    def option_names(cls) -> list[str]:
        """The fields a user chooses (`flashdraft train` has an option for each)."""
        return [f.name for f in fields(cls) if not f.metadata.get("recorded")]

    def apply_recipe(self, recipe: Recipe) -> list[str]:
        """Fill the fields left None from `recipe`; returns their names. The step budget is the recipe's only where
        neither --epochs nor --max-steps was given."""
        filled = [name for name in ("lr", "num_anchors") if getattr(self, name) is None]
        for name in filled:
            setattr(self, name, getattr(recipe, name))
        if self.epochs is None and self.max_steps is None:
            self.epochs, self.max_steps = recipe.epochs, recipe.max_steps
            filled.append("max_steps" if recipe.max_steps is not None else "epochs")
        return filled


# settings a resumed run may change: they decide how long it runs and what it writes, not what it computes
RESUMABLE_CHANGES = ("max_steps", "epochs", "save_every", "log_every", "eval_every", "keep_checkpoints", "keep_best")


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


def forward_loss(
    model,
    target: TargetModel,
    batch: Batch,
    cfg: TrainConfig,
    block_size: int,
    device,
    kl_weight: float | None = None,
    weighting: str | None = None,
    selector_loss_weight: float | None = None,
    held_out: bool = False,
):
    """The drafter's loss parts on one micro-batch (bf16 autocast on GPU); the target only embeds. held_out: a
    DSpark drafter's loss is its hard CE alone (its distribution figures still counted where the target's are known)."""
    kl_weight = cfg.kl_weight if kl_weight is None else kl_weight
    selector_loss_weight = cfg.selector_loss_weight if selector_loss_weight is None else selector_loss_weight
    weighting = cfg.loss_weighting if weighting is None else weighting
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"  # on CPU a target in bf16/fp16 (--target-dtype) sets the compute dtype
        else torch.autocast("cpu", dtype=target.dtype, enabled=target.dtype != torch.float32)
    )
    with autocast:
        with torch.no_grad():
            block_embeds = unwrap(model).embed(batch.block_ids, target)  # [N, K * B, H], frozen
        hidden = model(
            block_embeds, batch.anchor_positions, batch.context_features.to(block_embeds.dtype), batch.context_positions
        )
        drafter = unwrap(model)
        head = partial(drafter.logits, target_lm_head=target.lm_head)  # the target's head, as served
        dspark = None
        if drafter.markov_head is not None:
            dspark = (
                DSparkLoss(1.0, 0.0, 0.0)
                if held_out
                else DSparkLoss(cfg.dspark_ce_weight, cfg.dspark_tv_weight, cfg.confidence_loss_weight)
            )
        return block_loss(
            hidden,
            batch.labels,
            head,
            block_size,
            cfg.loss_decay_gamma,
            batch.target_topk,
            kl_weight,
            weighting,
            cfg.dpace_alpha,
            drafter.candidate_selector,
            batch.block_ids,
            selector_loss_weight,
            cfg.selector_missing_label,
            cfg.first_draft_position,
            drafter,
            dspark,
        )


@torch.no_grad()
def evaluate_loss(model, target, records, cfg: TrainConfig, block_size: int, mask_token_id: int, device) -> dict:
    """Held-out loss, per-position accuracy and estimated acceptance (fixed anchors).

    The loss is the recipe's hard CE even when training mixes in KL or a selector loss, so held-out
    losses of runs compare, and a held-out cache needs no stored target logits; a DFlash2 drafter's
    selector figures come beside it."""
    model.eval()
    total = weight = 0.0
    correct = count = top_k_hits = selector_correct = accept_rate = confidence = None
    vocabulary = unwrap(model).vocabulary_mask()
    for start in range(0, len(records), cfg.batch_size):
        idx = list(range(start, min(len(records), start + cfg.batch_size)))
        batch = make_batch(
            [records[i] for i in idx],
            idx,
            0,
            cfg.seed + 1,
            cfg.num_anchors,
            block_size,
            mask_token_id,
            cfg.max_length,
            cfg.first_draft_position,
        ).to(device)
        batch = batch.with_labels_in(vocabulary)
        parts = forward_loss(
            model,
            target,
            batch,
            cfg,
            block_size,
            device,
            kl_weight=0.0,
            weighting="decay",
            selector_loss_weight=0.0,
            held_out=True,
        )
        total += float(parts.weighted_sum)
        weight += float(parts.weight_total)
        correct = parts.correct if correct is None else correct + parts.correct
        count = parts.count if count is None else count + parts.count
        if parts.top_k_hits is not None:
            top_k_hits = parts.top_k_hits + (0 if top_k_hits is None else top_k_hits)
            selector_correct = parts.selector_correct + (0 if selector_correct is None else selector_correct)
        if parts.accept_rate is not None:
            accept_rate = parts.accept_rate + (0 if accept_rate is None else accept_rate)
        if parts.confidence is not None:
            confidence = parts.confidence + (0 if confidence is None else confidence)
    model.train()
    acc, tau = estimated_acceptance(correct, count, cfg.first_draft_position)
    family = selector_metrics(top_k_hits, selector_correct, count) | dspark_metrics(
        accept_rate, confidence, count, cfg.first_draft_position
    )
    return {
        "eval_loss": total / max(weight, 1e-9),
        "eval_position_accuracy": acc,
        "eval_estimated_acceptance": tau,
        **{f"eval_{k}": v for k, v in family.items()},
    }


@torch.no_grad()
def evaluate_tau(drafter: DFlashDrafter, target: TargetModel, records: list, max_blocks: int) -> dict:
    """Real τ on held-out records: the offline walk that equals live speculative decoding."""
    was_training = drafter.training
    drafter.eval()
    result = evaluate_offline(
        drafter, target, records, max_blocks=max_blocks, context_edges=record_context_edges(records, 0)
    )
    drafter.train(was_training)
    by_context = [{k: b[k] for k in ("context_from", "context_to", "steps", "tau")} for b in result.by_context]
    return {
        "eval_tau": result.tau,
        "eval_tau_prompt_mean": result.tau_prompt_mean,
        "eval_tau_steps": result.num_steps,
        "eval_tau_by_context": by_context,
    }


def _nonfinite_input(micro_batches: list[Batch], records) -> str:
    """Where a NaN/Inf loss came from when the input itself holds NaN/Inf context features
    (a damaged cache), as a clause for the error; empty when the input is finite."""
    for batch in micro_batches:
        bad = ~torch.isfinite(batch.context_features)  # [N, T, n * H]
        if bad.any():
            row, token, _ = (int(x) for x in bad.nonzero()[0])
            index = batch.record_indices[row]
            name = getattr(records[index], "id", index)
            where = f" of {records.directory}" if hasattr(records, "directory") else ""
            return (
                f": record {name!r} (index {index}){where} has NaN/Inf context features at token {token}; the "
                f"data is damaged, check it with flashdraft doctor"
            )
    return ""


def _steps(cfg: TrainConfig, num_records: int, world: int) -> tuple[int, int]:
    """(steps per epoch, total steps) of the run: --max-steps when given, over as many epochs as that takes (as
    transformers' `max_steps` overrides `num_train_epochs`), else --epochs whole epochs."""
    global_batch = cfg.batch_size * cfg.grad_accum * world
    steps_per_epoch = num_records // global_batch
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


def global_batch(cfg: TrainConfig, records, step: int, steps_per_epoch: int, dist: Dist) -> tuple[list[Batch], list]:
    """This rank's micro-batches of the step's global batch, and the global batch's record
    indices: a function of (seed, epoch, step) only, so resume and any world size agree."""
    epoch, in_epoch = divmod(step, steps_per_epoch)
    size = cfg.batch_size * cfg.grad_accum * dist.world
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch))
    global_indices = order[in_epoch * size : (in_epoch + 1) * size].tolist()
    mine = global_indices[dist.rank :: dist.world]
    micro_batches = []
    for m in range(cfg.grad_accum):
        idx = mine[m * cfg.batch_size : (m + 1) * cfg.batch_size]
        batch = make_batch(
            [records[i] for i in idx],
            idx,
            epoch,
            cfg.seed,
            cfg.num_anchors,
            cfg.block_size,
            cfg.mask_token_id,
            cfg.max_length,
            cfg.first_draft_position,
        )
        micro_batches.append(add_context_noise(batch, cfg.noise_std, record_generator(cfg.seed + 1, epoch, idx[0])))
    return micro_batches, global_indices


def forward_backward(
    model, target: TargetModel, micro_batches: list[Batch], cfg: TrainConfig, dist: Dist
) -> StepResult:
    """Gradients of the global batch's loss, normalised by its total weight across all ranks
    and micro-batches (so accumulation and DDP change nothing but speed)."""
    block_size = cfg.block_size
    vocabulary = unwrap(model).vocabulary_mask()  # a reduced vocabulary trains only the labels it can draft
    micro_batches = [b.with_labels_in(vocabulary) for b in micro_batches]
    weight_total = sum(
        label_weight_total(b.labels, block_size, cfg.loss_decay_gamma, cfg.loss_weighting, cfg.first_draft_position)
        for b in micro_batches
    )
    weight_total = float(all_reduce_sum(torch.tensor(weight_total, dtype=torch.float64)))
    if weight_total == 0:
        return StepResult(0.0, 0.0, torch.zeros(block_size), torch.zeros(block_size))
    loss = torch.zeros((), dtype=torch.float64)
    result = StepResult(0.0, weight_total, torch.zeros(block_size), torch.zeros(block_size))
    for m, batch in enumerate(micro_batches):
        batch = batch.to(dist.device)
        with no_grad_sync(model, skip=m < len(micro_batches) - 1):
            parts = forward_loss(model, target, batch, cfg, block_size, dist.device)
            (parts.weighted_sum * (dist.world / weight_total)).backward()
        loss += float(parts.weighted_sum.detach())
        result.correct += parts.correct.cpu()
        result.count += parts.count.cpu()
        if parts.top_k_hits is not None:  # DFlash2's selector figures
            result.top_k_hits = parts.top_k_hits.cpu() + (0 if result.top_k_hits is None else result.top_k_hits)
            result.selector_correct = parts.selector_correct.cpu() + (
                0 if result.selector_correct is None else result.selector_correct
            )
        for name in ("accept_rate", "confidence"):  # DSpark's figures
            if getattr(parts, name) is not None:
                setattr(
                    result,
                    name,
                    getattr(parts, name).cpu() + (getattr(result, name) if getattr(result, name) is not None else 0),
                )
    result.loss = float(all_reduce_sum(loss)) / weight_total
    return result


def held_out_metrics(model, target: TargetModel, cfg: TrainConfig, dist: Dist, eval_records, eval_tau_records) -> dict:
    """Held-out loss and estimated acceptance, and the real offline τ."""
    held_out = {}
    if eval_records is not None:
        held_out |= evaluate_loss(model, target, eval_records, cfg, cfg.block_size, cfg.mask_token_id, dist.device)
    if eval_tau_records:
        held_out |= evaluate_tau(unwrap(model), target, eval_tau_records, cfg.eval_max_blocks)
    return held_out


def _prepare(
    cfg: TrainConfig, drafter: DFlashDrafter, target: TargetModel, records, dist: Dist, eval_records, eval_tau_records
) -> tuple[int, int, LearningCheck]:
    """The checks before a run, its recorded layout, its steps (said in its first lines) and its learning check."""
    cfg.apply_recipe(PUBLISHED_RECIPE)  # what run_training left unset (a no-op after it)
    check_no_shortcut(drafter, target)
    _check_keep_best(cfg, eval_records, eval_tau_records)
    _record_layout(cfg, drafter, target)
    steps_per_epoch, total_steps = _steps(cfg, len(records), dist.world)
    if dist.is_main:
        print("\n".join(describe_steps(cfg, steps_per_epoch, total_steps, len(records), dist.world)), flush=True)
    learning = LearningCheck(
        cfg.lr,
        total_steps,
        warmup_steps(total_steps, cfg.warmup_fraction),
        cfg.num_anchors,
        mean_record_length(records),
        bool(eval_tau_records),
    )
    return steps_per_epoch, total_steps, learning


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
        refresh=not bar.plain,
    )


def best_metric(held_out: dict) -> tuple[str, float] | None:
    """The held-out figure --keep-best ranks by, as (name, value to maximise): the real τ, else
    minus the held-out loss."""
    if "eval_tau" in held_out:
        return "eval_tau", held_out["eval_tau"]
    if "eval_loss" in held_out:
        return "eval_loss", -held_out["eval_loss"]
    return None


def _keep_if_best(
    run_dir: Path, step: int, model, held_out: dict, best: dict | None, cfg: TrainConfig, dist: Dist
) -> dict | None:
    """Save RUN/best/ when this evaluation beats the best so far; returns the best record."""
    ranked = best_metric(held_out)
    if ranked is None:
        return best
    name, score = ranked
    value = held_out[name]
    if best is not None and best["metric"] == name and score <= best_metric({name: best["value"]})[1]:
        return best
    full = full_state_dict(model, cfg.fsdp)
    on_main(
        dist,
        lambda: save_best(run_dir, step, unwrap(model).config, full, name, value),
        f"step {step}: writing {run_dir / 'best'}",
    )
    return {"step": step, "metric": name, "value": value}


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


def _check_keep_best(cfg: TrainConfig, eval_records, eval_tau_records) -> None:
    """--keep-best needs held-out evaluations to rank."""
    held_out_set = eval_records is not None or bool(eval_tau_records)
    if cfg.keep_best and not (cfg.eval_every > 0 and held_out_set):
        raise FlashdraftError(
            f"--keep-best ranks held-out evaluations; found --eval-every {cfg.eval_every} and "
            f"{'a' if held_out_set else 'no'} held-out set; expected --eval-every N > 0 and "
            f"--eval-cached-hidden-states or --eval-completions"
        )


def _record_layout(cfg: TrainConfig, drafter: DFlashDrafter, target: TargetModel) -> None:
    """The configuration's recorded fields: the drafter's layout and the target's fingerprint."""
    dcfg = drafter.config
    cfg.target_layer_ids, cfg.mask_token_id, cfg.block_size = dcfg.target_layer_ids, dcfg.mask_token_id, dcfg.block_size
    cfg.first_draft_position = dcfg.first_draft_position
    cfg.target_fingerprint = cfg.target_fingerprint or target.fingerprint()


def _optimizer_step(
    model,
    target: TargetModel,
    optimizer: Optimizers,
    micro_batches: list[Batch],
    indices: list,
    records,
    cfg: TrainConfig,
    dist: Dist,
    step: int,
    epoch: int,
    run_dir: Path,
) -> tuple[StepResult, float]:
    """One step on the global batch: gradients, their clipped norm, the update. A batch without supervised tokens or
    a non-finite loss stops the run, naming the records. Returns the step's figures and its gradient norm."""
    # the checkpoint records the longest context trained at, over this run and the one it started from
    reach = all_reduce_max(max(b.context_reach(cfg.block_size) for b in micro_batches))
    drafter_config = unwrap(model).config
    drafter_config.trained_context_length = max(drafter_config.trained_context_length or 0, reach)
    result = forward_backward(model, target, micro_batches, cfg, dist)
    if result.weight_total == 0:
        raise FlashdraftError(f"step {step}: records {indices} have no supervised completion tokens")
    if not math.isfinite(result.loss):
        raise FlashdraftError(
            f"step {step}: loss is {result.loss} on records {indices} (epoch {epoch})"
            f"{_nonfinite_input(micro_batches, records)}; stopped, last good checkpoint kept in "
            f"{run_dir / 'checkpoints'}"
        )
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    optimizer.step()
    optimizer.zero_grad()
    return result, grad_norm


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


def train(
    cfg: TrainConfig,
    drafter: DFlashDrafter,
    target: TargetModel,
    records,
    run_dir: Path,
    resume: bool = False,
    eval_records=None,
    report_to: list[str] = (),
    dist: Dist | None = None,
    on_step=None,
    eval_tau_records: list | None = None,
    verify: bool = True,
) -> DFlashDrafter:
    """Train `drafter` on `records` (cache or online records) into `run_dir`.

    eval_records: held-out training records for loss and estimated acceptance;
    eval_tau_records: held-out `flashdraft.evaluation.records.EvalRecord`s for the real offline τ.
    """
    dist = dist or Dist()
    steps_per_epoch, total_steps, learning = _prepare(
        cfg, drafter, target, records, dist, eval_records, eval_tau_records
    )
    lock = RunLock(run_dir) if dist.is_main else None
    writer = None
    try:
        config_dict = _write_run_config(cfg, run_dir, resume) if dist.is_main else asdict(cfg)
        drafter.to(dist.device).train()
        model = wrap_model(drafter, dist, cfg.fsdp)
        optimizer = build_optimizers(
            model,
            cfg.optimizer,
            cfg.lr,
            cfg.muon_lr,
            cfg.weight_decay,
            total_steps,
            cfg.warmup_fraction,
            cfg.min_lr_fraction,
            cfg.fsdp,
        )
        start_step = _resume(run_dir, model, optimizer, len(records), dist, verify, cfg.fsdp) if resume else 0
        writer = MetricsWriter(run_dir, list(report_to), config_dict, start_step) if dist.is_main else None
        bar = Progress(
            range(start_step, total_steps),
            initial=start_step,
            total=total_steps,
            desc="train",
            disable=not dist.is_main,
            dynamic_ncols=True,
        )
        window = Window(cfg.first_draft_position)
        best = read_best(run_dir) if resume else None
        # SIGTERM/SIGINT: finish the step in flight, checkpoint it, stop (a second signal changes nothing)
        with StopRequests("step", dist.prefix()) as stop:
            for step in bar:
                epoch = step // steps_per_epoch
                micro_batches, indices = global_batch(cfg, records, step, steps_per_epoch, dist)
                result, grad_norm = _optimizer_step(
                    model, target, optimizer, micro_batches, indices, records, cfg, dist, step, epoch, run_dir
                )
                if on_step is not None:
                    on_step(step)
                window.add(result, micro_batches, dist.world)
                done = step + 1
                if done % cfg.log_every == 0 or done == total_steps:
                    metrics = window.metrics(optimizer.last_lr(), grad_norm, epoch)
                    _log(bar, writer, done, metrics)
                    _warn(bar, learning.see(done, metrics["estimated_acceptance"], held_out=False))
                    window = Window(cfg.first_draft_position)
                if cfg.eval_every and (done % cfg.eval_every == 0 or done == total_steps):
                    held_out = held_out_metrics(model, target, cfg, dist, eval_records, eval_tau_records)
                    _report_held_out(bar, writer, learning, done, held_out)
                    if cfg.keep_best:
                        best = _keep_if_best(run_dir, done, model, held_out, best, cfg, dist)
                saved = done % cfg.save_every == 0 or done == total_steps
                if saved:
                    _save(run_dir, done, model, optimizer, cfg, config_dict, len(records), dist)
                # every rank stops after the same step: one scalar all-reduce of "a signal came here"
                if done < total_steps and any_rank(stop.requested):
                    if not saved:
                        _save(run_dir, done, model, optimizer, cfg, config_dict, len(records), dist)
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
        if writer is not None:
            writer.close()
        if lock is not None:
            lock.release()
    return unwrap(model)
