"""Where a training batch's largest tensor, its context features, is allocated in host memory.

A batch of the 8B drafter's features is about 170 MB (4 records x 1,024 tokens x 5 x 4,096 bf16), written once by
the batch builder. In memory fresh from the allocator every 4 KiB page costs a fault (and the kernel zeroes it) the
first time the copy touches it: on a 2-core CPU that made building a batch cost 2-3x a copy of the same bytes into
memory already touched (`benchmarks/cache_read.py` prints both). Two remedies, by where the batch goes:
- for a GPU, the buffer is allocated pinned (page-locked) by torch's caching host allocator: its pages are reused
  from batch to batch (no faults after the first), the copy to the device can overlap the step, and the batch needs
  no second copy to pin it (`Batch.pin_memory` then leaves the features in place);
- on the CPU, the buffer is a private anonymous mapping advised to use transparent huge pages (`MADV_HUGEPAGE`,
  where the kernel offers them): one fault per 2 MiB instead of 512. Where the kernel refuses, it is ordinary
  memory, the result the same.
"""

from __future__ import annotations

import math
import mmap

import torch

# below this, the allocator's own memory is as good (a huge page would be mostly empty)
HUGE_PAGE_BYTES = 2 << 20


def feature_buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """An uninitialised tensor of `shape` for a batch's context features: pinned (`pin`, the batch goes to a GPU),
    else in memory advised to use huge pages when it spans at least one."""
    if pin:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages, nothing else changes
        pass
    # the tensor holds the mapping (its buffer): unmapped when the last tensor viewing it is freed
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)
