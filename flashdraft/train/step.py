"""One training step: the loss of a micro-batch (`forward_loss`), its gradients over the global batch
(`forward_backward`) and the update (`optimizer_step`); the global batch a step trains on (`global_batch`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.distributed import (
    Dist,
    all_reduce_max,
    all_reduce_sum,
    no_grad_sync,
    unwrap,
)
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from flashdraft.train.compiled import CompiledStep, batch_shape, graphs_compiled
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import Batch, BatchSpec, add_context_noise, make_batch, record_generator
from flashdraft.train.host_memory import FeatureBuffers
from flashdraft.train.loss import DraftHeads, DSparkLoss, LossParts, LossSpec, block_loss, label_weight_total
from flashdraft.train.metrics import StepResult
from flashdraft.train.optim import Optimizers
from flashdraft.train.packing import PackPlan, make_packed_batch


def loss_spec(cfg: TrainConfig, drafter: DFlashDrafter, held_out: bool = False) -> LossSpec:
    """The loss a run trains with, built once from its configuration and the drafter's layout. held_out: the
    recipe's hard CE alone with the decay weights (no KL, no selector term, DSpark's CE only), so the held-out losses
    of runs compare and a held-out cache needs no target logits; the family's figures are still counted."""
    layout = drafter.config
    dspark = None
    if drafter.markov_head is not None:
        dspark = (
            DSparkLoss(1.0, 0.0, 0.0)
            if held_out
            else DSparkLoss(cfg.dspark_ce_weight, cfg.dspark_tv_weight, cfg.confidence_loss_weight)
        )
    return LossSpec(
        block_size=layout.block_size,
        gamma=cfg.loss_decay_gamma,
        weighting="decay" if held_out else cfg.loss_weighting,
        dpace_alpha=cfg.dpace_alpha,
        kl_weight=0.0 if held_out else cfg.kl_weight,
        first_draft=layout.first_draft_position,
        selector_loss_weight=0.0 if held_out else cfg.selector_loss_weight,
        selector_missing_label=cfg.selector_missing_label,
        dspark=dspark,
    )


def forward_loss(
    model, target: TargetModel, batch: Batch, spec: LossSpec, compiled: CompiledStep | None = None
) -> LossParts:
    """The drafter's loss parts on one micro-batch (bf16 autocast on GPU); the target only embeds. `compiled`: the
    forward and the loss's chunks run compiled (`train.compiled`)."""
    device = batch.block_ids.device
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"  # on CPU a target in bf16/fp16 (--target-dtype) sets the compute dtype
        else torch.autocast("cpu", dtype=target.dtype, enabled=target.dtype != torch.float32)
    )
    drafter = unwrap(model)
    heads = DraftHeads.of(drafter, target.lm_head) if compiled is None else compiled.heads(drafter, target)
    chunk_fn = None if compiled is None else compiled.chunk_fn(heads, spec)
    graphs_before = graphs_compiled()
    with autocast:
        with torch.no_grad():
            block_embeds = drafter.embed(batch.block_ids, target)  # [N, K * B, H], frozen
        hidden = (model if compiled is None else compiled.forward)(
            block_embeds,
            batch.anchor_positions,
            batch.context_features.to(block_embeds.dtype),
            batch.context_positions,
            documents=batch.documents,
            context_tiles=batch.context_tiles,
        )
        parts = block_loss(hidden, batch, heads, spec, chunk_fn=chunk_fn)
    if compiled is not None:
        compiled.count(batch_shape(batch), graphs_before)
    return parts


def _nonfinite_input(micro_batches: list[Batch], records) -> str:
    """Where a NaN/Inf loss came from when the input itself holds NaN/Inf context features
    (a damaged cache), as a clause for the error; empty when the input is finite."""
    for batch in micro_batches:
        bad = ~torch.isfinite(batch.context_features)  # [N, T, n * H]
        if bad.any():
            row, token, _ = (int(x) for x in bad.nonzero()[0])
            at = row
            if batch.documents is not None:  # packed: record_indices lists each row's documents in turn
                docs_before = int((batch.documents[1][:row].max(1).values + 1).sum())
                at = docs_before + int(batch.documents[1][row, token])
            index = batch.record_indices[at]
            name = getattr(records[index], "id", index)
            where = f" of {records.directory}" if hasattr(records, "directory") else ""
            return (
                f": record {name!r} (index {index}){where} has NaN/Inf context features at token {token}; the "
                f"data is damaged, check it with flashdraft doctor"
            )
    return ""


@dataclass
class GlobalBatch:
    """A step's global batch: its record indices over all ranks, and this rank's micro-batches of them."""

    step: int
    epoch: int
    indices: list[int]
    micro_batches: list[Batch]
    records: object  # the records drawn from, to name them when the loss is not finite


def step_indices(
    cfg: TrainConfig, num_units: int, step: int, steps_per_epoch: int, dist: Dist, shuffled: int | None = None
) -> tuple[list, list]:
    """The step's global batch of unit indices (records; packed: rows) and this rank's share of it (in the order it
    reads them). `shuffled` (packed): only the first `shuffled` units are shuffled, the rest (empty rows that make
    the epoch a whole number of global batches) come last."""
    epoch, in_epoch = divmod(step, steps_per_epoch)
    size = cfg.batch_size * cfg.grad_accum * dist.world
    generator = torch.Generator().manual_seed(cfg.seed * 7919 + epoch)
    order = torch.randperm(num_units if shuffled is None else shuffled, generator=generator)
    if shuffled is not None:
        order = torch.cat([order, torch.arange(shuffled, num_units)])
    global_indices = order[in_epoch * size : (in_epoch + 1) * size].tolist()
    return global_indices, global_indices[dist.rank :: dist.world]


def packed_units(cfg: TrainConfig, plan: PackPlan, world: int) -> int:
    """The rows of an epoch: the plan's, and empty ones up to a whole number of global batches (every record is
    trained once an epoch, none dropped)."""
    size = cfg.batch_size * cfg.grad_accum * world
    return -(-len(plan.rows) // size) * size


def plan_rows(plan: PackPlan, units: list[int]) -> list[list[int]]:
    """The rows (each its record indices) of `units`: an empty row past the plan's."""
    return [plan.rows[u] if u < len(plan.rows) else [] for u in units]


def step_units(
    cfg: TrainConfig, num_records: int, step: int, steps_per_epoch: int, dist: Dist, plan: PackPlan | None = None
) -> tuple[list[int], list[int]]:
    """The step's global batch of record indices and this rank's units of it in the order it reads them: record
    indices, or (with a `plan`) row indices (`plan_rows`)."""
    if plan is None:
        return step_indices(cfg, num_records, step, steps_per_epoch, dist)
    units = packed_units(cfg, plan, dist.world)
    global_units, mine = step_indices(cfg, units, step, steps_per_epoch, dist, shuffled=len(plan.rows))
    return [i for row in plan_rows(plan, global_units) for i in row], mine


def stream_order(
    cfg: TrainConfig, num_records: int, steps: range, steps_per_epoch: int, dist: Dist, plan: PackPlan | None = None
) -> list[int]:
    """The record indices this rank reads over `steps`, in order: what a streamed source (the engine) must yield.
    Packed: the records of its rows, row by row, as `make_packed_batch` reads them."""
    order = []
    for step in steps:
        mine = step_units(cfg, num_records, step, steps_per_epoch, dist, plan)[1]
        order += mine if plan is None else [i for row in plan_rows(plan, mine) for i in row]
    return order


def global_batch(
    cfg: TrainConfig,
    records,
    step: int,
    steps_per_epoch: int,
    dist: Dist,
    plan: PackPlan | None = None,
    buffers: FeatureBuffers | None = None,
) -> GlobalBatch:
    """This rank's micro-batches of the step's global batch, and the global batch's record
    indices: a function of (seed, epoch, step) only, so resume and any world size agree. With a `plan`, the
    micro-batches are its packed rows (`packing.make_packed_batch`). `buffers`: where their context features are built
    (a run's: reused on the CPU, pinned for a GPU; None: fresh)."""
    epoch = step // steps_per_epoch
    batch_spec = BatchSpec(
        seed=cfg.seed,
        num_anchors=cfg.num_anchors,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        max_length=cfg.max_length,
        first_draft=cfg.first_draft_position,
        buffers=buffers,
    )
    global_indices, mine = step_units(cfg, len(records), step, steps_per_epoch, dist, plan)
    micro_batches = []
    for m in range(cfg.grad_accum):
        idx = mine[m * cfg.batch_size : (m + 1) * cfg.batch_size]
        if plan is None:
            batch = make_batch([records[i] for i in idx], idx, epoch, batch_spec)
        else:
            batch = make_packed_batch(records, plan_rows(plan, idx), epoch, batch_spec, plan)
        micro_batches.append(add_context_noise(batch, cfg.noise_std, record_generator(cfg.seed + 1, epoch, idx[0])))
    return GlobalBatch(step, epoch, global_indices, micro_batches, records)


def optimizer_step(
    model,
    target: TargetModel,
    optimizer: Optimizers,
    batch: GlobalBatch,
    spec: LossSpec,
    grad_clip: float,
    dist: Dist,
    run_dir: Path,
    compiled: CompiledStep | None = None,
) -> tuple[StepResult, float]:
    """One step on the global batch: the gradients of its loss, normalised by its total weight across all ranks and
    micro-batches (so accumulation and DDP change nothing but speed), their clipped norm, the update. A batch
    without supervised tokens or a non-finite loss stops the run, naming the records. Returns the step's figures
    and its gradient norm. `compiled`: the forward and loss chunks compiled, their compiles counted there."""
    drafter = unwrap(model)
    # the checkpoint records the longest context trained at, over this run and the one it started from
    reach = all_reduce_max(max(b.context_reach(spec.block_size) for b in batch.micro_batches))
    drafter.config.trained_context_length = max(drafter.config.trained_context_length or 0, reach)
    vocabulary = drafter.vocabulary_mask()  # a reduced vocabulary trains only the labels it can draft
    micro_batches = [b.with_labels_in(vocabulary) for b in batch.micro_batches]
    weight_total = sum(
        label_weight_total(b.labels, spec.block_size, spec.gamma, spec.weighting, spec.first_draft)
        for b in micro_batches
    )
    weight_total = float(all_reduce_sum(torch.tensor(weight_total, dtype=torch.float64)))
    if weight_total == 0:
        raise FlashdraftError(f"step {batch.step}: records {batch.indices} have no supervised completion tokens")
    loss, figures = torch.zeros((), dtype=torch.float64), None
    for m, micro_batch in enumerate(micro_batches):
        with no_grad_sync(model, skip=m < len(micro_batches) - 1):
            parts = forward_loss(model, target, micro_batch.to(dist.device), spec, compiled)
            (parts.weighted_sum * (dist.world / weight_total)).backward()
        loss += float(parts.weighted_sum.detach())
        part_figures = parts.figures.map(lambda t: t.detach().cpu())
        figures = part_figures if figures is None else figures + part_figures
    result = StepResult(float(all_reduce_sum(loss)) / weight_total, weight_total, figures)
    if not math.isfinite(result.loss):
        raise FlashdraftError(
            f"step {batch.step}: loss is {result.loss} on records {batch.indices} (epoch {batch.epoch})"
            f"{_nonfinite_input(batch.micro_batches, batch.records)}; stopped, last good checkpoint kept in "
            f"{run_dir / 'checkpoints'}"
        )
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    optimizer.step()
    optimizer.zero_grad()
    return result, grad_norm
