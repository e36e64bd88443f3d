"""Training records built from a tiny random target's own greedy output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.target.model import TargetModel


@dataclass
class Record:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    context_features: torch.Tensor | None
    target_topk: tuple[torch.Tensor, torch.Tensor] | None
    prompt_length: int = 0


def make_records(
    target: TargetModel, n: int = 8, layer_ids=(0, 2), new_tokens: int = 24, topk: int = 0, seed: int = 0
) -> list[Record]:
    target.set_context_layers(list(layer_ids))
    gen = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(n):
        prompt = torch.randint(0, 60, (6,), generator=gen).tolist()
        ids = torch.tensor(prompt + autoregressive_generate(target, prompt, new_tokens).output_ids)
        out = target.forward(ids[None])
        top = None
        if topk:
            values, indices = out.logits[0].topk(topk, dim=-1)
            top = (values, indices)
        records.append(Record(ids, torch.arange(len(ids)) >= len(prompt), out.context_features[0], top, len(prompt)))
    return records
