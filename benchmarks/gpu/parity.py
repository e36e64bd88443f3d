"""linear_attention_parity: on the Qwen3.6-27B-shaped slice of the target (real widths, 4 layers: 3 Gated
DeltaNet + 1 gated full attention, random weights), fp32 and bf16: every linear-attention backend against the fp32
reference per linear layer, judged against the reference path's own error in that dtype, prompts and a
continuation after a prefill, by `flashdraft parity`'s own `run_parity`. On a GPU it fails when fla did not run."""

from __future__ import annotations

import torch

from flashdraft.target.model import TargetModel
from flashdraft.target.parity import run_parity

from .shapes import Widths


def check_linear_attention_parity(target: TargetModel, widths: Widths, dry_run: bool) -> list[dict]:
    """`flashdraft parity`'s own rule (`run_parity`): every backend in fp32 and bf16 against the fp32 torch chunked
    reference per linear layer, prompts and a continuation after a cached prefill; one row per dtype."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in widths.parity_prompt_lengths]
    result = run_parity(target, prompts, dtypes=(torch.float32, torch.bfloat16))
    failed = result.failures()
    rows = []
    for dtype in result.dtypes:
        passed = not [f for f in failed if f[1] == dtype] and bool(result.errors["prompt"][dtype])
        why = None
        if not result.errors["prompt"][dtype]:
            passed, why = False, "only one backend runs here"
        elif "fla" in result.skipped and not dry_run:  # on a GPU, fla is what this check is for
            passed, why = False, f"fla did not run: {result.skipped['fla']}"
        rows.append(
            {
                "check": "linear_attention_parity",
                "case": dtype,
                "passed": passed,
                "reference": f"{result.reference} float32",
                "layers": result.layer_ids,
                "errors": {
                    case: {b: [float(f"{e:.3g}") for e in es] for b, es in by_dtype[dtype].items()}
                    for case, by_dtype in result.errors.items()
                },
                "floors": {case: [float(f"{e:.3g}") for e in by[dtype]] for case, by in result.floors.items()},
                "rule": f"error <= {result.noise_factor:g} x floor + {result.error_floor:g}",
                "skipped": result.skipped,
                "tokens": sum(widths.parity_prompt_lengths),
                **({"why": why} if why else {}),
            }
        )
    return rows


def summary(row: dict) -> str:
    worst = max((e for by in row["errors"].values() for es in by.values() for e in es), default=float("nan"))
    floor = max((f for fs in row["floors"].values() for f in fs), default=float("nan"))
    return f"worst error {worst:.2e}, floor {floor:.2e} ({row['rule']})" + (f"; {row['why']}" if "why" in row else "")
