"""Draft trees (#59).

- draft_tree: on a dense Qwen3-8B-shaped bf16 slice, tree_generate with DDTree at budgets 16/32/64 against greedy
  decoding token for token, and the tree's step costs (verify of budget + 1 tokens): the best budget.
- draft_tree_hybrid: on the Qwen3.6-27B-shaped hybrid slice, fla's kernels refuse tree verification in one line.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft.decoding.generate import SpeculativeConfig, speculative_generate
from flashdraft.target.model import TargetModel

from .models import new_drafter
from .shapes import BLOCK, NEAR_TIE, Widths


def dense_slice(widths: Widths, device: torch.device) -> TargetModel:
    """A Qwen3-8B-shaped dense target slice (real widths, few layers, random weights): bf16 on GPU, fp32 on CPU."""
    torch.manual_seed(0)
    cfg = Qwen3Config(eos_token_id=widths.tree_slice["vocab_size"] - 2, **widths.tree_slice)
    with device:
        model = Qwen3ForCausalLM(cfg)
    return TargetModel(model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval(), None, None)


def top_two(target: TargetModel, ids: list[int]) -> dict:
    """The target's top logit after `ids` and its gap to the second: how near a tie its greedy choice there is."""
    logits = target.forward(torch.tensor([ids], device=target.device), target.new_cache()).logits_at(-1, None)
    top = logits[0, 0].float().topk(2).values
    return {"top_logit": round(float(top[0]), 4), "top_two_gap": round(float(top[0] - top[1]), 4)}


def check_draft_tree(widths: Widths, device: torch.device) -> dict:
    """`tree_generate` with DDTree at each budget on a dense slice against plain greedy decoding, token for token
    (in bf16 a first difference is allowed only at a near-tie: the greedy choice's top-2 logit gap within
    NEAR_TIE x |top logit|, named in the row), and `evaluation.trees.step_costs` (verify of budget + 1 tokens under
    the tree mask, the chain's block beside it): the predicted speed-up per budget and the best budget. The drafter
    is random (τ near 1): the costs and losslessness are the figures, not the τ."""
    from flashdraft.decoding.generate import autoregressive_generate
    from flashdraft.decoding.tree import TreeRule, tree_generate
    from flashdraft.evaluation.config import Candidate
    from flashdraft.evaluation.records import EvalRecord
    from flashdraft.evaluation.results import speedup_bound
    from flashdraft.evaluation.trees import step_costs

    target = dense_slice(widths, device)
    fields = widths.drafters["qwen3-8b-drafter"] | dict(
        num_target_layers=target.num_layers,
        target_layer_ids=list(range(target.num_layers)),
        vocab_size=target.vocab_size,
        mask_token_id=target.vocab_size - 1,
    )
    drafter = new_drafter(fields, device, next(target.model.parameters()).dtype).eval()
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, target.vocab_size - 2, (widths.prompt_tokens,), generator=gen).tolist()
    n = widths.new_tokens
    greedy = autoregressive_generate(target, prompt, n).output_ids
    chain = speculative_generate(target, drafter, prompt, n, speculative=SpeculativeConfig(block_size=BLOCK))
    rules = {budget: TreeRule("ddtree", budget) for budget in widths.tree_budgets}
    taus, differs = {}, {}
    for budget, rule in rules.items():
        out = tree_generate(target, drafter, prompt, n, rule)
        taus[budget] = sum(out.acceptance_lengths) / max(1, len(out.acceptance_lengths))
        at = next((i for i, (a, b) in enumerate(zip(out.output_ids, greedy, strict=False)) if a != b), None)
        if at is not None or len(out.output_ids) != len(greedy):
            at = at if at is not None else min(len(out.output_ids), len(greedy))
            differs[budget] = {"at": at} | top_two(target, prompt + greedy[:at])
    candidate = Candidate("random", drafter, BLOCK, "random drafter", None)
    costs = step_costs(candidate, target, EvalRecord("p", prompt, greedy), rules)
    plain, draft = costs["plain_step_s"], costs["draft_s"]
    predicted = {
        b: speedup_bound(taus[b], plain, draft + c["build_s"], c["verify_s"]) for b, c in costs["budgets"].items()
    }
    bf16 = next(target.model.parameters()).dtype == torch.bfloat16
    near_tie = bf16 and all(d["top_two_gap"] <= NEAR_TIE * abs(d["top_logit"]) for d in differs.values())
    return {
        "check": "draft_tree",
        "case": f"ddtree dense {'bf16' if bf16 else 'fp32'}",
        "passed": not differs or near_tie,
        "lossless": {b: b not in differs for b in rules},
        "differs": differs,
        "new_tokens": n,
        "chain_tau": round(chain.tau, 3),
        "tree_tau": {b: round(t, 3) for b, t in taus.items()},
        "plain_step_ms": round(plain * 1000, 3),
        "draft_ms": round(draft * 1000, 3),
        "chain_verify_ms": round(costs["chain_verify_s"] * 1000, 3),
        "verify_ms": {b: round(c["verify_s"] * 1000, 3) for b, c in costs["budgets"].items()},
        "nodes": {b: c["nodes"] for b, c in costs["budgets"].items()},
        "predicted_speedup": {b: round(p or 0.0, 3) for b, p in predicted.items()},
        "chain_predicted_speedup": round(speedup_bound(chain.tau, plain, draft, costs["chain_verify_s"]) or 0, 3),
        "best_budget": max(predicted, key=lambda b: predicted[b] or 0.0),
    }


def check_tree_refusal(target: TargetModel) -> dict:
    """A hybrid target with fla's kernels refuses tree verification in one line (`check_tree_target`); the torch
    Gated DeltaNet (CPU, or no fla) verifies trees and is not refused."""
    from flashdraft.decoding.tree import check_tree_target
    from flashdraft.errors import FlashdraftError

    try:
        check_tree_target(target)
        refusal = None
    except FlashdraftError as e:
        refusal = str(e)
    expected = target.linear_backend == "fla"
    return {
        "check": "draft_tree_hybrid",
        "case": f"hybrid {target.linear_backend}",
        "passed": (refusal is not None) == expected and (refusal is None or "\n" not in refusal),
        "linear_backend": target.linear_backend,
        "refused": refusal is not None,
        "refusal": refusal,
    }


def summary(row: dict) -> str:
    return (
        f"lossless {row['lossless']}; verify ms {row['verify_ms']} (chain {row['chain_verify_ms']}); best budget "
        f"{row['best_budget']}"
    )


def summary_refusal(row: dict) -> str:
    return (row["refusal"] or f"{row['linear_backend']} backend: trees verified, not refused")[:90]
