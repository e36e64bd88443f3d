"""Device-to-host reads of decoding, counted.

On a GPU every read of a tensor's value on the host (`.tolist()`, `.item()`, `int(t)`, `bool(t)`) waits until every
kernel queued before it has run: the host stops launching work and the device idles until the host catches up. A
speculative step needs one such read (which tokens it commits), so decoding reads through `to_host`, which counts:
`GenerationResult.host_transfers` and `benchmarks/decode.py` report the count per step, and a test holds the greedy
step to one. On a CPU a read costs nothing more than the computation it waits for; the count is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TransferCount:
    """Device-to-host reads made through `to_host` since the process started (never reset: callers take
    differences)."""

    reads: int = 0


TRANSFERS = TransferCount()


def to_host(tensor: torch.Tensor) -> list:
    """tensor's values as Python numbers (nested lists; a 0-d tensor gives one number), counted as one read."""
    TRANSFERS.reads += 1
    return tensor.tolist()
