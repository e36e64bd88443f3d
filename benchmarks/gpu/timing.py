"""Timing on the device: a wall time is taken between two synchronisations, so it counts the kernels it launched."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, repeats: int, setup=lambda: None) -> float:
    """Median wall time of fn(setup()) in ms; setup runs outside the timed region."""
    times = []
    for _ in range(repeats):
        arg = setup()
        sync(device)
        t0 = time.perf_counter()
        fn(arg)
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
