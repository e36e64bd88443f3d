"""matmul_rate: one bf16 matmul's rate, the dense rate the training checks' FLOPs are a share of."""

from __future__ import annotations

import torch

from .shapes import Widths
from .timing import median_ms


def matmul_rate(device: torch.device, size: int) -> float:
    """FLOP/s of one bf16 [size, size] @ [size, size] matmul (2 size^3 FLOPs), the median of 5 after a warm-up:
    the dense rate the training step's FLOPs are a share of."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    ms = median_ms(lambda _: a @ b, device, 5)
    return 2 * size**3 / (ms / 1000)


def check_matmul_rate(widths: Widths, device: torch.device, measured: dict) -> dict:
    measured["flops_per_s"] = matmul_rate(device, widths.matmul_size)
    return {
        "check": "matmul_rate",
        "case": f"bf16 {widths.matmul_size}^3",
        "tflops_per_s": round(measured["flops_per_s"] / 1e12, 4),
    }


def summary(row: dict) -> str:
    return f"{row['tflops_per_s']} TFLOP/s"
