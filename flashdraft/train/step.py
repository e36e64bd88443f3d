"""One training step: the loss of a micro-batch (`forward_loss`), its gradients over the global batch
(`forward_backward`) and the update (`optimizer_step`); the global batch a step trains on (`global_batch`)."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch

from flashdraft.distributed import (
    Dist,
    all_reduce_max,
    all_reduce_sum,
    no_grad_sync,
    unwrap,
)
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import Batch, add_context_noise, make_batch, record_generator
from flashdraft.train.loss import DSparkLoss, block_loss, label_weight_total
from flashdraft.train.metrics import StepResult
from flashdraft.train.optim import Optimizers


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


def optimizer_step(
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
