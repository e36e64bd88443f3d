"""Processes launched by `torchrun`: each rank's place (RANK / WORLD_SIZE / LOCAL_RANK) and
device, and the collectives training needs. A single process without torchrun is rank 0 of
1 and wraps nothing.

Data commands (generate, cache) take disjoint slices of the work and only ever wait for each
other (barriers), so a gloo group serves on CPU and GPU alike; training all-reduces gradients
(DDP by default, FSDP2 with `--fsdp`): NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # this rank's (init_distributed)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def close(self) -> None:
        """End the process group (called from `finally`, after a run or an error)."""
        if self.world > 1 and torch.distributed.is_initialized():
            # gloo's worker threads drop their last finished works a moment after the collective
            # returns, and a work that holds a tensor Python also held needs the GIL to be freed;
            # if the interpreter is already shutting down, that thread aborts the process
            # ("terminate called without an active exception", exit -6 after a complete run).
            # Sleeping releases the GIL so they finish first.
            time.sleep(0.2)
            torch.distributed.destroy_process_group()

    def prefix(self) -> str:
        """A prefix for printed lines, so interleaved output says which rank spoke."""
        return f"[rank {self.rank}] " if self.world > 1 else ""


def pick_device(dist: Dist, device: str | None) -> torch.device:
    """The rank's device: `device` if given (cuda means this rank's local GPU), else the
    local GPU when there is one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", dist.local_rank)
    return torch.device(device)


def init_distributed(device: str | None = None, collectives: bool = False) -> Dist:
    """The process's place in a torchrun job (rank 0 of 1 when run directly) and its device.
    `collectives`: the job all-reduces tensors (training): NCCL when the rank has a GPU.
    Otherwise ranks only meet at barriers, waiting for the slowest: gloo, with a timeout
    that allows a long caching job."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        dist = Dist()
        dist.device = pick_device(dist, device)
        return dist
    dist = Dist(rank=int(os.environ["RANK"]), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    dist.device = pick_device(dist, device)
    if not torch.distributed.is_initialized():
        if not collectives:
            torch.distributed.init_process_group("gloo", timeout=timedelta(hours=48))
        elif dist.device.type == "cuda":
            torch.cuda.set_device(dist.device)
            torch.distributed.init_process_group("nccl")
        else:
            torch.distributed.init_process_group("gloo")
    return dist


def load_dtype(device: torch.device, name: str | None) -> torch.dtype:
    """The dtype to load the target in: `name` (fp32/bf16/fp16), else fp32 on CPU and bf16 on GPU."""
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    return names[name or ("fp32" if device.type == "cpu" else "bf16")]


# -- training collectives --------------------------------------------------------------------


def wrap_model(model: nn.Module, dist: Dist, fsdp: bool) -> nn.Module:
    """DDP (or FSDP2) around the drafter under torchrun; the drafter itself for one process."""
    if dist.world == 1:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)


def no_grad_sync(model: nn.Module, skip: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if not skip:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2

        @contextlib.contextmanager
        def fsdp_no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return fsdp_no_sync()
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def full_state_dict(model: nn.Module, fsdp: bool) -> dict[str, torch.Tensor]:
    """The whole drafter state on CPU (gathered from all ranks under FSDP)."""
    if fsdp and torch.distributed.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], fsdp: bool) -> None:
    """Load a whole drafter state (as `full_state_dict` gives it); under FSDP each rank keeps its shards."""
    if fsdp and torch.distributed.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    else:
        unwrap(model).load_state_dict(state)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank: one scalar all-reduce that every rank must call at the
    same point (the flag itself for one process). How ranks agree to stop together, so none waits
    in a collective for a rank that has left."""
    if not torch.distributed.is_initialized():
        return flag
    return bool(all_reduce_sum(torch.tensor([float(flag)], device=_scalar_device())).item() > 0)


def all_reduce_max(value: int) -> int:
    """The largest `value` over the ranks (every rank must call it at the same point)."""
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.long, device=_scalar_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def _scalar_device() -> torch.device:
    """Where a collective's scalar lives: NCCL reduces only CUDA tensors."""
    nccl = torch.distributed.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def on_main(dist: Dist, work, failing: str):
    """`work()` on rank 0 only (a check or a lock before the ranks write), and every rank learns
    whether it raised a FlashdraftError: all stop then, none writing or waiting in a collective
    for a rank 0 that has left. Returns rank 0's result (None elsewhere); `failing` names what
    failed for the other ranks' line."""
    from flashdraft.errors import FlashdraftError

    result, error = None, None
    if dist.is_main:
        try:
            result = work()
        except FlashdraftError as e:
            error = e
    if any_rank(error is not None):
        raise error or FlashdraftError(f"{failing}: failed on rank 0 (its error above)")
    return result


def lock_on_main(dist: Dist, path, output, writer: str):
    """Rank 0 takes the output's lock (`flashdraft.files.OutputLock`) for the whole job; when
    another job holds it, every rank stops before writing. Returns the lock (None off rank 0)."""
    from flashdraft.files import OutputLock

    return on_main(dist, lambda: OutputLock(path, output, writer), f"{output}: locking it")
