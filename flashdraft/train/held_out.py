"""Held-out evaluation during training: the held-out loss and estimated acceptance, the real offline τ, and
`--keep-best`'s ranking of them."""

from __future__ import annotations

from pathlib import Path

import torch

from flashdraft.distributed import (
    Dist,
    full_state_dict,
    on_main,
    unwrap,
)
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.drafter.run_dir import (
    save_best,
)
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.offline import WalkConfig, evaluate_offline
from flashdraft.evaluation.results import record_context_edges
from flashdraft.target.model import TargetModel
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import BatchSpec, make_batch
from flashdraft.train.metrics import figure_metrics
from flashdraft.train.step import forward_loss, loss_spec


@torch.no_grad()
def evaluate_loss(model, target: TargetModel, records, cfg: TrainConfig, device) -> dict:
    """Held-out loss, per-position accuracy and estimated acceptance (fixed anchors), through the training step's
    own forward with the held-out loss (`loss_spec(held_out=True)`: the recipe's hard CE, so held-out losses of runs
    compare and a held-out cache needs no stored target logits); the family's figures beside them."""
    model.eval()
    drafter = unwrap(model)
    spec = loss_spec(cfg, drafter, held_out=True)
    total = weight = 0.0
    figures = None
    vocabulary = drafter.vocabulary_mask()
    batch_spec = BatchSpec(  # fixed anchors: seed + 1, epoch 0
        seed=cfg.seed + 1,
        num_anchors=cfg.num_anchors,
        block_size=spec.block_size,
        mask_token_id=drafter.config.mask_token_id,
        max_length=cfg.max_length,
        first_draft=spec.first_draft,
    )
    for start in range(0, len(records), cfg.batch_size):
        idx = list(range(start, min(len(records), start + cfg.batch_size)))
        batch = make_batch([records[i] for i in idx], idx, 0, batch_spec).to(device)
        parts = forward_loss(model, target, batch.with_labels_in(vocabulary), spec)
        total += float(parts.weighted_sum)
        weight += float(parts.weight_total)
        figures = parts.figures if figures is None else figures + parts.figures
    model.train()
    return {
        "eval_loss": total / max(weight, 1e-9),
        **{f"eval_{k}": v for k, v in figure_metrics(figures, spec.first_draft).items()},
    }


@torch.no_grad()
def evaluate_tau(drafter: DFlashDrafter, target: TargetModel, records: list, max_blocks: int) -> dict:
    """Real τ on held-out records: the offline walk that equals live speculative decoding."""
    was_training = drafter.training
    drafter.eval()
    result = evaluate_offline(
        drafter, target, records, walk=WalkConfig(max_blocks=max_blocks, context_edges=record_context_edges(records, 0))
    )
    drafter.train(was_training)
    by_context = [{k: b[k] for k in ("context_from", "context_to", "steps", "tau")} for b in result.by_context]
    return {
        "eval_tau": result.tau,
        "eval_tau_prompt_mean": result.tau_prompt_mean,
        "eval_tau_steps": result.num_steps,
        "eval_tau_by_context": by_context,
    }


def held_out_metrics(model, target: TargetModel, cfg: TrainConfig, dist: Dist, eval_records, eval_tau_records) -> dict:
    """Held-out loss and estimated acceptance, and the real offline τ."""
    held_out = {}
    if eval_records is not None:
        held_out |= evaluate_loss(model, target, eval_records, cfg, dist.device)
    if eval_tau_records:
        held_out |= evaluate_tau(unwrap(model), target, eval_tau_records, cfg.eval_max_blocks)
    return held_out


def best_metric(held_out: dict) -> tuple[str, float] | None:
    """The held-out figure --keep-best ranks by, as (name, value to maximise): the real τ, else
    minus the held-out loss."""
    if "eval_tau" in held_out:
        return "eval_tau", held_out["eval_tau"]
    if "eval_loss" in held_out:
        return "eval_loss", -held_out["eval_loss"]
    return None


def keep_if_best(
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


def check_keep_best(cfg: TrainConfig, eval_records, eval_tau_records) -> None:
    """--keep-best needs held-out evaluations to rank."""
    held_out_set = eval_records is not None or bool(eval_tau_records)
    if cfg.keep_best and not (cfg.eval_every > 0 and held_out_set):
        raise FlashdraftError(
            f"--keep-best ranks held-out evaluations; found --eval-every {cfg.eval_every} and "
            f"{'a' if held_out_set else 'no'} held-out set; expected --eval-every N > 0 and "
            f"--eval-cached-hidden-states or --eval-completions"
        )
