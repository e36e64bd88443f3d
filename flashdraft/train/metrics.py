"""The training figures: a step's sums (`StepResult`), the window of steps a log line sums (`Window`), the
family's own figures (DFlash2's selector, DSpark's acceptance probabilities and confidence), and where rows go
(`MetricsWriter`: metrics.jsonl, TensorBoard, W&B)."""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.distributed import all_reduce_sum
from flashdraft.drafter import model as drafter_model
from flashdraft.errors import FlashdraftError
from flashdraft.files import append_whole, write_text_atomic
from flashdraft.train.data import Batch
from flashdraft.train.loss import LossFigures, estimated_acceptance


@dataclass
class StepResult:
    loss: float  # the global batch's mean loss
    weight_total: float  # its total loss weight (all ranks)
    figures: LossFigures  # this rank's, per block position


class MetricsWriter:
    """metrics.jsonl always; TensorBoard when installed; W&B when asked."""

    def __init__(self, run_dir: Path, report_to: list[str], config: dict, start_step: int = 0) -> None:
        path = run_dir / "metrics.jsonl"
        # rows after the checkpoint resumed from are written again by the resumed run, and a row
        # cut short by a kill is not a row: keep only complete rows up to start_step
        kept = []
        for line in path.read_text().splitlines(keepends=True) if path.exists() else []:
            try:
                if line.endswith("\n") and json.loads(line)["step"] <= start_step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
        write_text_atomic(path, "".join(kept), "the metrics kept from before the resumed step")
        self.path = path
        # rows are appended whole or not at all (`append_whole`): a full disk leaves complete rows
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.tb = self.wandb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError:
                raise FlashdraftError(
                    "--report-to wandb: the wandb package is not installed (pip install wandb)"
                ) from None
            self.wandb = wandb.init(project="flashdraft", dir=str(run_dir), config=config)

    def write(self, step: int, metrics: dict) -> None:
        append_whole(
            self.fd,
            (json.dumps({"step": step, **metrics}) + "\n").encode(),
            self.path,
            f"the metrics row of step {step}",
        )
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        os.close(self.fd)
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def selector_metrics(top_k_hits: torch.Tensor | None, selector_correct: torch.Tensor | None, count) -> dict:
    """DFlash2's figures per block position 1..B-1: how often the label is among the unary top-K, and
    how often the selector, teacher-forced, picks it (the walk's per-position accuracy); {} for DFlash."""
    if top_k_hits is None:
        return {}
    n = count[1:].clamp(min=1)
    acc, tau_est = estimated_acceptance(selector_correct, count)
    return {
        "top_k_coverage": (top_k_hits[1:] / n).tolist(),
        "selector_accuracy": acc,
        "selector_estimated_acceptance": tau_est,
    }


def dspark_metrics(accept_rate: torch.Tensor | None, confidence: torch.Tensor | None, count, first_draft: int) -> dict:
    """DSpark's figures per drafting position: the mean acceptance probability 1 - |p_draft - p_target|_1 / 2 and
    its expected accepted length (DeepSpec's accept_rate@k and tau_probabilistic), and the confidence head's mean
    estimate beside it (calibrated when the two agree); {} for the other families."""
    if accept_rate is None:
        return {}
    n = count[first_draft:].clamp(min=1)
    rate = accept_rate[first_draft:] / n
    metrics = {"accept_rate": rate.tolist(), "expected_accepted_length": float(1 + rate.cumprod(0).sum())}
    if confidence is not None:
        metrics["confidence_mean"] = (confidence[first_draft:] / n).tolist()
    return metrics


def figure_metrics(figures: LossFigures, first_draft: int) -> dict:
    """The figures as a log row's: per-position accuracy and the acceptance it estimates, then the family's."""
    acc, tau_est = estimated_acceptance(figures.correct, figures.count, first_draft)
    return (
        {"position_accuracy": acc, "estimated_acceptance": tau_est}
        | selector_metrics(figures.top_k_hits, figures.selector_correct, figures.count)
        | dspark_metrics(figures.accept_rate, figures.confidence, figures.count, first_draft)
    )


def memory_and_compiles(device: torch.device, compiled=None) -> dict:
    """The run's peak memory so far (GiB: CUDA's max allocated on a GPU, the process's peak resident set on CPU) and
    the distinct shapes flex attention was handed (each a compile under dynamic=False; `drafter.model.flex_shapes`),
    with torch.compile's own count of the graphs it built; the compiled step's compiles and recompiles (`compiled`, a
    `train.compiled.CompiledStep`; 0 without one)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    from torch._dynamo.utils import counters

    return {
        "peak_memory_gib": peak,
        "attention_shapes": len(drafter_model.flex_shapes),
        "compiled_graphs": int(counters["stats"]["unique_graphs"]),
        "step_compiles": 0 if compiled is None else compiled.compiles,
        "step_recompiles": 0 if compiled is None else compiled.recompiles,
    }


class Window:
    """Training figures summed over the steps since the last log line."""

    def __init__(self, first_draft: int = 1) -> None:
        self.loss = self.weight = 0.0
        self.figures: LossFigures | None = None  # summed over ranks
        self.first_draft = first_draft  # the layout's first drafting position (0: anchor-first)
        self.tokens = self.slots = self.steps = 0  # real context tokens, and context slots (real + padding)
        self.wait_s = self.compute_s = 0.0  # waiting for the steps' data (the engine's states), computing them
        self.t0 = time.perf_counter()

    def time(self, wait_s: float, compute_s: float) -> None:
        self.steps += 1
        self.wait_s, self.compute_s = self.wait_s + wait_s, self.compute_s + compute_s

    def add(self, result: StepResult, micro_batches: list[Batch], world: int) -> None:
        self.loss += result.loss * result.weight_total
        self.weight += result.weight_total
        figures = result.figures.map(all_reduce_sum)
        self.figures = figures if self.figures is None else self.figures + figures
        self.tokens += sum(int((b.context_positions < (1 << 40)).sum()) for b in micro_batches) * world
        self.slots += sum(b.context_positions.numel() for b in micro_batches) * world

    def metrics(self, lr: float, grad_norm: float, epoch: int) -> dict:
        figures = figure_metrics(self.figures, self.first_draft)
        metrics = {
            "loss": self.loss / self.weight,
            "position_accuracy": figures.pop("position_accuracy"),
            "estimated_acceptance": figures.pop("estimated_acceptance"),
            "tokens_per_s": self.tokens / (time.perf_counter() - self.t0),
            "padding_share": 1 - self.tokens / max(1, self.slots),  # of the context slots the batches held
            "lr": lr,
            "grad_norm": grad_norm,
            "epoch": epoch,
            "wait_s": self.wait_s / max(1, self.steps),  # per step
            "compute_s": self.compute_s / max(1, self.steps),
        }
        return metrics | figures
