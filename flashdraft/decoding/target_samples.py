"""Whether token sequences an engine returned are the target's own: at T = 0 every token its argmax (near-ties
aside), at T > 0 samples of its filtered p. One teacher-forced forward per sequence; what `generate --engine` and
`eval --served` use to check an engine rather than trust it."""

from __future__ import annotations

from typing import Any

import torch

from flashdraft.decoding.serving_rules import SamplingFilters
from flashdraft.evaluation.offline import target_probs_along
from flashdraft.evaluation.records import EvalRecord
from flashdraft.target.model import TargetModel

Z_LIMIT = 3.0  # |z| of the log-likelihood score past which outputs are not the target's samples (p ~ 0.003)
# a token that is not the argmax is a near-tie when its logit is this close to the top one (kernels round apart)
TIE_MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.02}


@torch.no_grad()
def greedy_agreement(target: TargetModel, outputs: list[EvalRecord]) -> dict[str, Any]:
    """T = 0: the first token of each output that is not the target's argmax given the tokens before it. Past a
    near-tie (`TIE_MARGIN`) the output is no longer the target's greedy one; a larger margin means it never was."""
    tie = TIE_MARGIN.get(target.dtype, 0.1)
    greedy, near_ties, problems = 0, 0, []
    for r in outputs:
        if not r.completion_ids:
            greedy += 1
            continue
        out = target.forward(torch.tensor([r.input_ids], device=target.device))
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
    return {"records": len(outputs), "greedy": greedy, "near_ties": near_ties, "tie_margin": tie,
            "problems": problems}  # fmt: skip


@torch.no_grad()
def sampling_fidelity(target: TargetModel, outputs: list[EvalRecord], temperature: float,
                      filters: SamplingFilters) -> dict[str, Any]:  # fmt: skip
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
