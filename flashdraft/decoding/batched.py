"""Batched decoding with the target alone: many prompts at once, left-padded, as `flashdraft generate` runs the
target locally.

Greedy output equals `flashdraft.decoding.generate.autoregressive_generate` token for token; sampled output draws
each row from its own generator, so a row's tokens do not depend on the batch it is in.
"""

from __future__ import annotations

import torch

from flashdraft.decoding.host_transfers import to_host
from flashdraft.decoding.serving_rules import GREEDY, SamplingParams, target_probs
from flashdraft.target.model import TargetModel, decoding_attention


@torch.no_grad()
def generate_batch(
    target: TargetModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    generators: list[torch.Generator] | None = None,
) -> list[tuple[list[int], str]]:
    """Decode every prompt with the target's cache (at temperature > 0 sampled from the target's p with the
    sampling's filters, as the servers sample, each row from its own generator); returns (completion ids, stop
    reason) each.

    Prompts are left-padded to one width; the attention mask hides the padding and position
    ids count only real tokens, so each row decodes as it would alone. Rows that stopped
    keep being fed (their output is frozen) until every row has stopped.
    """
    from transformers import DynamicCache

    device, n = target.device, len(prompts)
    width = max(len(p) for p in prompts)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    ids = torch.full((n, width), pad, dtype=torch.long, device=device)  # [N, W]
    mask = torch.zeros((n, width), dtype=torch.long, device=device)  # [N, W]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, W]
    padded = any(len(p) < width for p in prompts)
    stop_ids = set(target.stop_token_ids)
    cache = DynamicCache(config=target.config)
    outputs: list[list[int]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    with decoding_attention(device):  # no per-length kernel builds on CUDA
        for _ in range(max_new_tokens):
            logits = target.model(
                input_ids=ids,
                attention_mask=mask if padded else None,  # no mask without padding: the same kernels as one prompt
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # the prompt's other positions need no [W, V] logits
            ).logits[:, -1]  # [N, V]
            if sampling.greedy:
                drawn = logits.argmax(-1)  # [N]
            else:
                probs = target_probs(logits, sampling.temperature, sampling.filters)  # [N, V]
                drawn = torch.cat([torch.multinomial(probs[i], 1, generator=generators[i]) for i in range(n)])  # [N]
            tokens = to_host(drawn)  # the step's one read of the device
            for i, token in enumerate(tokens):
                if reasons[i] == "length" and len(outputs[i]) < max_new_tokens:
                    outputs[i].append(token)
                    if token in stop_ids:
                        reasons[i] = "eos"
            if all(r == "eos" for r in reasons):
                break
            ids = drawn[:, None]  # [N, 1]
            mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
            positions = positions[:, -1:] + 1
    return list(zip(outputs, reasons, strict=True))
