"""Where a training batch's largest tensor, its context features, is built in host memory.

A batch of the 8B drafter's features is about 170 MB (4 records x 1,024 tokens x 5 x 4,096 bf16), written once by
the batch builder straight from the records' mapped shards. Memory fresh from the allocator costs a page fault (and
the kernel zeroes the page) the first time the copy touches each 4 KiB page: on a shared 2-core CPU a copy into fresh
memory cost 2-5x the same copy into memory already touched (`benchmarks/cache_read.py` prints both). So:
- a run's batches take their buffers from `FeatureBuffers`: on the CPU the buffer of a batch the run has let go is
  reused (checked: no tensor, view or autograd record holds it any more), so after the first few steps no page is
  faulted in again; for a GPU the buffer is pinned (page-locked) memory from torch's caching host allocator, which
  itself reuses its blocks once their copies to the device are done, lets the step's copy overlap, and spares the
  batch a second copy to pin it (`Batch.pin_memory` leaves pinned tensors in place).
Fresh buffers advised to use transparent huge pages (`MADV_HUGEPAGE`) were tried: on the shared 2-core CPU they ran
from 0.3x to 1.9x torch's own memory from one run to the next, so reuse, which needs no fault at all, is what is
kept.
"""

from __future__ import annotations

import math
import threading

import torch


def feature_buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """A fresh, uninitialised tensor of `shape`, pinned with `pin` (for a GPU)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def _storage_users(tensor: torch.Tensor) -> int | None:
    """How many tensors (views and autograd records included) hold `tensor`'s storage, counting `tensor` itself;
    None where this torch cannot say (then nothing is reused)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    return use_count(tensor.untyped_storage()._cdata) - 1  # less the storage object made to ask


class FeatureBuffers:
    """The context feature buffers of a run's batches (`take`): pinned (`pin`) for a GPU, else up to `keep` buffers
    kept and each reused once nothing but this keeps it (the smallest that fits). Thread-safe: the prefetcher's
    workers take buffers at once."""

    def __init__(self, pin: bool = False, keep: int = 0) -> None:
        self.pin = pin
        self.keep = 0 if pin else keep  # pinned blocks are reused by torch's own allocator, after their copies
        self._kept: list[torch.Tensor] = []  # flat buffers
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape`: a free kept buffer's first elements, or a fresh buffer (kept when
        there is room, or in place of a free one too small)."""
        count = math.prod(shape)
        with self._lock:
            free = [i for i, flat in enumerate(self._kept) if flat.dtype == dtype and _storage_users(flat) == 1]
            fitting = [i for i in free if self._kept[i].numel() >= count]
            if fitting:
                return self._kept[min(fitting, key=lambda i: self._kept[i].numel())][:count].view(shape)
            flat = feature_buffer((count,), dtype, self.pin)
            if len(self._kept) < self.keep and _storage_users(flat) is not None:
                self._kept.append(flat)
            elif free:
                self._kept[free[0]] = flat
            return flat.view(shape)
