"""tiny_decode: the README's tiny pipeline's decoding on the device: the built-in tiny target and drafter (fp32),
greedy and speculative, lossless; tokens/s of each."""

from __future__ import annotations

import time

import torch

from flashdraft.decoding.generate import speculative_generate
from flashdraft.target.model import TargetModel

from .shapes import Widths
from .timing import sync


def check_tiny_decode(widths: Widths, device: torch.device) -> dict:
    """The README's tiny pipeline's decoding on the device: the built-in target and drafter (fp32), 4 prompts (2 in
    --dry-run), greedy and speculative, lossless; tokens/s of each (the CPU's figure is in docs/benchmarks.md)."""
    from flashdraft.decoding.generate import autoregressive_generate
    from flashdraft.drafter.run_dir import load_any_drafter
    from flashdraft.evaluation.records import load_eval_records
    from flashdraft.target.model import TINY_DIR

    target = TargetModel.load("tiny", device, torch.float32)
    drafter = load_any_drafter(TINY_DIR.parent / "tiny-drafter", target).drafter.to(device).eval()
    records, _ = load_eval_records(target, prompts="builtin:code:heldout", num_prompts=widths.tiny_prompts)
    new_tokens = 2 * widths.new_tokens
    speculative_generate(target, drafter, records[0].prompt_ids, 8)  # warm-up
    autoregressive_generate(target, records[0].prompt_ids, 8)
    seconds, tokens, lossless, lengths, reads = {"greedy": 0.0, "speculative": 0.0}, 0, True, [], 0
    for record in records:
        sync(device)
        t0 = time.perf_counter()
        plain = autoregressive_generate(target, record.prompt_ids, new_tokens)
        sync(device)
        t1 = time.perf_counter()
        spec = speculative_generate(target, drafter, record.prompt_ids, new_tokens)
        sync(device)
        seconds["greedy"] += t1 - t0
        seconds["speculative"] += time.perf_counter() - t1
        tokens += len(plain.output_ids)
        lossless &= spec.output_ids == plain.output_ids
        lengths += spec.acceptance_lengths
        reads += spec.host_transfers
    return {
        "check": "tiny_decode",
        "case": f"built-in tiny, {len(records)} prompts",
        "passed": lossless,
        "new_tokens": new_tokens,
        "greedy_tokens_per_s": round(tokens / seconds["greedy"], 1),
        "speculative_tokens_per_s": round(tokens / seconds["speculative"], 1),
        "tau": round(sum(lengths) / max(len(lengths), 1), 2),
        "host_transfers_per_step": round(reads / max(len(lengths), 1), 2),
    }


def summary(row: dict) -> str:
    spec, greedy = row["speculative_tokens_per_s"], row["greedy_tokens_per_s"]
    return f"{spec} tok/s speculative, {greedy} greedy, tau {row['tau']}, lossless {row['passed']}"
