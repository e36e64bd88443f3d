"""target_verify_cost: on the bf16 slice after a prompt, t(forward of 16 new tokens) / t(1 token), with the
linear-attention backend that ran: what a verification costs beside a plain decoding step."""

from __future__ import annotations

import copy

import torch

from flashdraft.target.model import TargetModel

from .shapes import BLOCK, Widths
from .timing import median_ms


def check_target_verify_cost(target: TargetModel, widths: Widths) -> dict:
    device = target.device
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.vocab_size, (1, widths.prompt_tokens), generator=gen).to(device)
    block = torch.randint(0, target.vocab_size, (1, BLOCK), generator=gen).to(device)
    base = target.new_cache()
    target.forward(prompt, base)
    ms = {}
    for n in (1, BLOCK, 1, BLOCK):  # the first round warms up (kernel compilation), the second counts
        ms[n] = median_ms(
            lambda cache, n=n: target.forward(block[:, :n], cache),
            device,
            widths.repeats,
            setup=lambda: copy.deepcopy(base),
        )
    return {
        "check": "target_verify_cost",
        "case": f"{BLOCK} vs 1 tokens",
        "linear_backend": target.linear_backend,
        "prompt_tokens": widths.prompt_tokens,
        "t1_ms": round(ms[1], 3),
        f"t{BLOCK}_ms": round(ms[BLOCK], 3),
        "ratio": round(ms[BLOCK] / ms[1], 2),
    }


def summary(row: dict) -> str:
    return f"t16/t1 = {row['ratio']} ({row[f't{BLOCK}_ms']} / {row['t1_ms']} ms, {row['linear_backend']})"
