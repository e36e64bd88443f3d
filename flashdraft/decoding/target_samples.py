"""Whether token sequences an engine returned are the target's own: at T = 0 every token its argmax (near-ties
aside), at T > 0 samples of its filtered p. One teacher-forced forward per sequence; what `generate --engine` and
`eval --served` use to check an engine rather than trust it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flashdraft.decoding.serving_rules import SamplingFilters, target_probs
from flashdraft.target.image_files import record_images
from flashdraft.target.model import TargetModel

Z_LIMIT = 3.0  # |z| of the log-likelihood score past which outputs are not the target's samples (p ~ 0.003)
# a token that is not the argmax is a near-tie when its logit is this close to the top one (kernels round apart)
TIE_MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.02}


class TokenRecord(Protocol):
    """What these checks read of a record: evaluation's `EvalRecord` is one, and so is an `EngineOutput`."""

    id: str
    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass(frozen=True)
class EngineOutput:
    """The tokens an engine returned for one prompt."""

    id: str
    prompt_ids: list[int]
    completion_ids: list[int]


def target_probs_along(
    target: TargetModel, record: TokenRecord, temperature: float, filters: SamplingFilters
) -> Callable[[int, int], torch.Tensor]:
    """The target's filtered p along the record's completion (one forward; rows computed when a walk reads them):
    `probs_at(start, end)` gives [end - start, V], the p of completion[start + 1 .. end]."""
    with record_images(target, record):  # its images, where it has any
        out = target.forward(torch.tensor([record.prompt_ids + record.completion_ids], device=target.device))
    p = len(record.prompt_ids)

    def probs_at(start: int, end: int) -> torch.Tensor:
        return target_probs(out.logits_at(p + start, p + end)[0], temperature, filters)

    return probs_at


@torch.no_grad()
def greedy_agreement(target: TargetModel, outputs: Sequence[TokenRecord]) -> dict[str, Any]:
    """T = 0: the first token of each output that is not the target's argmax given the tokens before it. Past a
    near-tie (`TIE_MARGIN`) the output is no longer the target's greedy one; a larger margin means it never was."""
    tie = TIE_MARGIN.get(target.dtype, 0.1)
    greedy, near_ties, problems = 0, 0, []
    for r in outputs:
        if not r.completion_ids:
            greedy += 1
            continue
        with record_images(target, r):  # its images, where it has any
            out = target.forward(torch.tensor([r.prompt_ids + r.completion_ids], device=target.device))
        p = len(r.prompt_ids)
        logits = out.logits_at(p - 1, p + len(r.completion_ids) - 1)[0].float()  # [M, V]
        tokens = torch.tensor(r.completion_ids, device=logits.device)
        wrong = (logits.argmax(-1) != tokens).nonzero()
        if not len(wrong):
            greedy += 1
            continue
        k = int(wrong[0])
        margin = float(logits[k].max() - logits[k, tokens[k]])
        if margin <= tie:
            near_ties += 1
        else:
            problems.append(f"record {r.id} token {k}: not the target's argmax (logit {margin:.3g} under it)")
    return {"records": len(outputs), "greedy": greedy, "near_ties": near_ties, "tie_margin": tie, "problems": problems}


@torch.no_grad()
def sampling_fidelity(
    target: TargetModel, outputs: Sequence[TokenRecord], temperature: float, filters: SamplingFilters
) -> dict[str, Any]:
    """T > 0: are the outputs samples of the target's p (at `temperature`, after `filters`)? A token p gives no
    mass is impossible; otherwise the score z = sum_t (log p(x_t) + H(p_t)) / sqrt(sum_t Var_p(log p)) is about
    N(0, 1) for true samples (E[log p(x)] = -H(p)): a sampler of another distribution drifts from 0."""
    score = variance = 0.0
    tokens, problems = 0, []
    for r in outputs:
        if not r.completion_ids:
            continue
        probs = target_probs_along(target, r, temperature, filters)(-1, len(r.completion_ids) - 1)  # [M, V]
        picked = probs.gather(1, torch.tensor(r.completion_ids, device=probs.device)[:, None])[:, 0]
        zero = (picked <= 0).nonzero()
        if len(zero):
            problems.append(f"record {r.id} token {int(zero[0])}: probability 0 under the target's filtered p")
        logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
        entropy = -(probs * logp).sum(-1)
        kept = picked > 0
        score += float((picked[kept].log() + entropy[kept]).sum())
        variance += float(((probs * logp * logp).sum(-1) - entropy**2)[kept].sum())
        tokens += len(r.completion_ids)
    z = score / variance**0.5 if variance > 0 else 0.0
    if abs(z) > Z_LIMIT:
        problems.append(f"log-likelihood score z = {z:+.1f} over {tokens} tokens, past {Z_LIMIT:g}")
    return {"tokens": tokens, "log_likelihood_z": z, "z_limit": Z_LIMIT, "problems": problems}
