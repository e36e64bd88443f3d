"""Sharding work across processes launched by `torchrun`.

Each rank reads RANK / WORLD_SIZE / LOCAL_RANK from the environment and takes a disjoint
slice of the work; ranks only ever need to wait for each other (barriers), never to
exchange tensors, so a gloo process group serves on CPU and GPU alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def prefix(self) -> str:
        """A prefix for printed lines, so interleaved output says which rank spoke."""
        return f"[rank {self.rank}] " if self.world > 1 else ""


def init_distributed() -> Dist:
    """The process's place in a torchrun job (rank 0 of 1 when run directly)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.distributed.is_initialized():
        # ranks wait for the slowest one at the barriers: allow a long caching job
        torch.distributed.init_process_group("gloo", timeout=timedelta(hours=48))
    return Dist(rank=rank, world=world, local_rank=local_rank)


def pick_device(dist: Dist, device: str | None) -> torch.device:
    """The rank's device: `device` if given (cuda means this rank's local GPU), else the
    local GPU when there is one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", dist.local_rank)
    return torch.device(device)


def load_dtype(device: torch.device, name: str | None) -> torch.dtype:
    """The dtype to load the target in: `name` (fp32/bf16/fp16), else fp32 on CPU and bf16 on GPU."""
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    return names[name or ("fp32" if device.type == "cpu" else "bf16")]
