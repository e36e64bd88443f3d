"""torch.distributed set-up for `torchrun`: DDP (default) or FSDP2 (`--fsdp`), NCCL on GPU,
gloo on CPU. A single process without torchrun is world size 1 and wraps nothing."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None = None) -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if world == 1:
        return DistInfo(device=torch.device("cuda" if use_cuda else "cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), device=dev)


def wrap_model(model: nn.Module, info: DistInfo, fsdp: bool) -> nn.Module:
    if info.world_size == 1:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)


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
    if fsdp and dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
