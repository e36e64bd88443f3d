"""spec_loop_overhead: speculative decoding on the slice with a random Qwen3.6-27B-shaped drafter, per rollback mode;
per step, verification, drafter forward and bookkeeping, reads of the device, and the step against its floor (the
bytes it must read over the measured copy bandwidth). static_decode: the same loop eager against compiled on the
static cache (`SpeculativeConfig(compile=True)`: on CUDA the verify and the drafter's steps as CUDA graphs)."""

from __future__ import annotations

import time

import torch

from flashdraft.decoding.generate import SpeculativeConfig, speculative_generate
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.target.model import TargetModel

from .models import new_drafter
from .shapes import BLOCK, Widths
from .timing import median_ms, sync


def bytes_read_per_step(target: TargetModel, drafter: DFlashDrafter) -> int:
    """What one speculative step must read at least: every weight of the target but its input embedding (a few
    rows), the drafter's, and the target's LM head twice (the verification's and the drafter's borrowed one)."""

    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    embedding = target.model.get_input_embeddings()
    lm_head = target.model.get_output_embeddings()
    return size(target.model) - size(embedding) + size(drafter) + size(lm_head)


def copy_bandwidth(device: torch.device, megabytes: int = 1024) -> float:
    """Bytes per second the device moves in a copy (each byte read once and written once: 2 x size per copy);
    the median of 5 copies after one warm-up."""
    n = megabytes * 2**20 // 4 if device.type == "cuda" else 2**22  # 16 MB on a CPU: a dry run
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = median_ms(lambda _: dst.copy_(src), device, 5)
    return 2 * src.numel() * 4 / (ms / 1000)


ROLLBACK_MODES = ("recompute", "deferred")  # what a step pays to undo rejected drafts in linear layers (model.py)


def slice_drafter(target: TargetModel, drafter_fields: dict) -> DFlashDrafter:
    """A random drafter of `drafter_fields`' shape reading every layer of the slice, on its device and dtype."""
    fields = drafter_fields | dict(
        num_target_layers=target.num_layers,
        target_layer_ids=list(range(target.num_layers)),
        vocab_size=target.vocab_size,
        mask_token_id=target.vocab_size - 1,
    )
    return new_drafter(fields, target.device, next(target.model.parameters()).dtype).eval()


def check_spec_loop_overhead(target: TargetModel, drafter_fields: dict, widths: Widths) -> list[dict]:
    """A random drafter is rejected at almost every step, so the loop runs about one step per token. One row per
    rollback mode: "recompute" re-runs the linear layers over the accepted tokens (their weights read again, where
    fla gives no per-token states), "deferred" feeds them again at the front of the next verification."""
    device = target.device
    drafter = slice_drafter(target, drafter_fields)
    spent = {"verify": 0.0, "drafter": 0.0}
    forward = target.forward

    def timed_forward(*args, **kwargs):  # every target forward: the prefill and one verification per step
        sync(device)
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        sync(device)
        spent["verify"] += time.perf_counter() - t0
        return out

    started = [0.0]

    def drafter_starts(module, args) -> None:
        sync(device)
        started[0] = time.perf_counter()

    def drafter_ends(module, args, output) -> None:
        sync(device)
        spent["drafter"] += time.perf_counter() - started[0]

    drafter.register_forward_pre_hook(drafter_starts)
    drafter.register_forward_hook(drafter_ends)
    prompt = torch.randint(0, target.vocab_size, (widths.prompt_tokens,), generator=torch.Generator().manual_seed(2))
    step_bytes = bytes_read_per_step(target, drafter)
    bandwidth = copy_bandwidth(device)
    floor_ms = step_bytes / bandwidth * 1000
    rows, mode_before = [], target.rollback_mode
    for mode in ROLLBACK_MODES:
        target.rollback_mode = mode
        speculative_generate(
            target, drafter, prompt.tolist(), 4, speculative=SpeculativeConfig(block_size=BLOCK)
        )  # warm-up
        target.forward = timed_forward  # instance attribute: speculative_generate calls target.forward
        try:
            spent.update(verify=0.0, drafter=0.0)
            prefill_ms = median_ms(lambda _: forward(prompt[None].to(device), target.new_cache()), device, 1)
            sync(device)
            t0 = time.perf_counter()
            result = speculative_generate(
                target, drafter, prompt.tolist(), widths.new_tokens, speculative=SpeculativeConfig(block_size=BLOCK)
            )
            sync(device)
            total = time.perf_counter() - t0
        finally:
            del target.forward
            target.rollback_mode = mode_before
        steps = len(result.acceptance_lengths)
        step_ms = (total * 1000 - prefill_ms) / steps
        verify_ms = (spent["verify"] * 1000 - prefill_ms) / steps
        drafter_ms = spent["drafter"] * 1000 / steps
        rows.append(
            {
                "check": "spec_loop_overhead",
                "case": f"per step, rollback {mode}",
                "steps": steps,
                "tau": round(result.tau, 2),
                "rollback_mode": mode,
                "step_ms": round(step_ms, 3),
                "verify_ms": round(verify_ms, 3),
                "drafter_ms": round(drafter_ms, 3),
                "bookkeeping_ms": round(step_ms - verify_ms - drafter_ms, 3),  # rollback's re-run included
                "overhead_share": round((step_ms - verify_ms) / step_ms, 3),
                "host_transfers_per_step": round(result.host_transfers / steps, 2),
                "bytes_read_per_step_gb": round(step_bytes / 1e9, 3),
                "bandwidth_gb_s": round(bandwidth / 1e9, 1),
                "floor_ms": round(floor_ms, 3),
                "step_over_floor": round(step_ms / floor_ms, 1),
            }
        )
    return rows


def summary(row: dict) -> str:
    return (
        f"{row['step_ms']} ms/step: verify {row['verify_ms']}, drafter {row['drafter_ms']}, "
        f"other {row['bookkeeping_ms']}; {row['step_over_floor']}x the {row['floor_ms']} ms floor"
    )


def check_static_decode(target: TargetModel, drafter_fields: dict, widths: Widths, dry_run: bool) -> list[dict]:
    """The loop of spec_loop_overhead eager, then compiled on the static cache (on CUDA with inductor's
    "reduce-overhead": the verify and the drafter's step as CUDA graphs; in --dry-run traced by dynamo's "eager"
    backend, which proves the same graphs without inductor's CPU compile). Each after a warm-up generation that
    compiles, sized for the timed one: per step its time and split, against the floor; the compiled row passes when
    the timed generation compiled nothing and no graph broke. `same_tokens`: the compiled output equals the eager one
    (in bf16 a near-tie may part them; said, not failed)."""
    device = target.device
    drafter = slice_drafter(target, drafter_fields)
    prompt = torch.randint(0, target.vocab_size, (widths.prompt_tokens,), generator=torch.Generator().manual_seed(2))
    floor_ms = bytes_read_per_step(target, drafter) / copy_bandwidth(device) * 1000
    positions = widths.prompt_tokens + widths.new_tokens
    backend = "eager" if dry_run else "inductor"
    rows, eager_ids = [], None
    for compiled in (False, True):
        config = SpeculativeConfig(
            block_size=BLOCK, compile=compiled, compile_backend=backend, static_positions=positions
        )
        warm = speculative_generate(target, drafter, prompt.tolist(), 4, speculative=config)
        sync(device)
        result = speculative_generate(target, drafter, prompt.tolist(), widths.new_tokens, speculative=config)
        sync(device)
        steps = len(result.acceptance_lengths)
        step_ms = result.decode_seconds * 1000 / steps
        eager_ids = eager_ids or result.output_ids
        case = "eager" if not compiled else "CUDA graphs" if device.type == "cuda" else f"compiled ({backend})"
        row = {
            "check": "static_decode",
            "case": case,
            "steps": steps,
            "tau": round(result.tau, 2),
            "step_ms": round(step_ms, 3),
            "verify_ms": round(result.verify_seconds * 1000 / steps, 3),
            "drafter_ms": round(result.draft_seconds * 1000 / steps, 3),
            "floor_ms": round(floor_ms, 3),
            "step_over_floor": round(step_ms / floor_ms, 1),
            "host_transfers_per_step": round(result.host_transfers / steps, 2),
        }
        if compiled:
            row |= {
                "warm_up_compiles": warm.compiles,
                "warm_up_compile_seconds": round(warm.compile_seconds, 1),  # the verify's (the drafter's not timed)
                "compiles_after_warm_up": result.compiles,
                "graph_breaks": warm.graph_breaks + result.graph_breaks,
                "same_tokens": result.output_ids == eager_ids,
                "eager_over_compiled": round(rows[0]["step_ms"] / step_ms, 2),
            }
            row["passed"] = row["compiles_after_warm_up"] == 0 and row["graph_breaks"] == 0
        rows.append(row)
    return rows


def summary_static(row: dict) -> str:
    if "passed" not in row:
        return f"{row['step_ms']} ms/step, {row['step_over_floor']}x the {row['floor_ms']} ms floor"
    return (
        f"{row['step_ms']} ms/step ({row['eager_over_compiled']}x eager's), {row['step_over_floor']}x the floor; "
        f"after warm-up {row['compiles_after_warm_up']} compiles, {row['graph_breaks']} graph breaks"
    )
