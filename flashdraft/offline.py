"""Offline τ of a drafter: the acceptance walk (`flashdraft.acceptance`) over each record's
completion, with context features from the record's cache or one target forward. Needs no
target forward when the features come from a cache; training reports held-out τ with it.
"""

from __future__ import annotations

import torch

from flashdraft.acceptance import (
    DraftLimit,
    Proposer,
    ProposerFactory,
    as_proposer,
    default_block_size,
    offline_acceptance_lengths,
)
from flashdraft.model import DFlashDrafter
from flashdraft.records import EvalRecord, FeatureSource
from flashdraft.results import EvalResult, PromptResult
from flashdraft.target import TargetModel


def drafter_shape(
    drafter: DFlashDrafter | ProposerFactory | Proposer, block_size: int | None
) -> tuple[int, list[int], int | None]:
    """(block size, target layer ids, context layers) of a DFlash drafter or another Proposer."""
    block_size = block_size or default_block_size(drafter)
    if isinstance(drafter, DFlashDrafter):
        cfg = drafter.config
        return block_size, cfg.target_layer_ids, drafter.fc.weight.shape[1] // cfg.hidden_size
    ids = list(drafter.context_layer_ids)
    return block_size, ids, len(ids) or None


@torch.no_grad()
def evaluate_offline(
    drafter: DFlashDrafter | ProposerFactory | Proposer,
    target: TargetModel,
    records: list[EvalRecord],
    features: FeatureSource | None = None,
    block_size: int | None = None,
    max_blocks: int | None = None,
    limit: DraftLimit | None = None,
    use_selector: bool = True,
) -> EvalResult:
    """Offline τ of `drafter` (a DFlash drafter, the hybrid, or a stateless `Proposer` such as
    the n-gram baseline) on `records`, each walked for at most `max_blocks` steps, verifying the
    drafts `limit` keeps (`use_selector` False: a DFlash2 drafter's unary argmax path)."""
    b, layer_ids, context_layers = drafter_shape(drafter, block_size)
    features = features or FeatureSource(target)
    per_prompt = []
    for record in records:
        f = features(record, layer_ids) if layer_ids else None
        proposer = as_proposer(drafter, target, limit, use_selector)
        lengths = offline_acceptance_lengths(proposer, record.prompt_ids, record.completion_ids, b, f, max_blocks,
                                             target.device)  # fmt: skip
        per_prompt.append(PromptResult(record.id, lengths))
    return EvalResult("offline", b, layer_ids, context_layers, per_prompt)


@torch.no_grad()
def selector_figures(
    drafter: DFlashDrafter,
    target: TargetModel,
    records: list[EvalRecord],
    walked: EvalResult,
    features: FeatureSource | None = None,
    max_blocks: int | None = None,
) -> dict:
    """What a DFlash2 drafter's candidate selector adds, beside the walk `walked` (its greedy
    evaluation on `records`): τ of the same drafter drafting its unary argmax instead, and how
    often the target's token is among the unary top-K at the positions the walk verified (each
    step's accepted drafts and its first rejected one): the selector can only choose a token in
    its top-K, so coverage bounds what it can fix."""
    b = walked.block_size
    features = features or FeatureSource(target)
    unary = evaluate_offline(drafter, target, records, features, b, max_blocks, use_selector=False)
    top_k, hits, verified = drafter.candidate_selector.top_k, 0, 0
    for record, walk in zip(records, walked.per_prompt, strict=True):
        p, completion = len(record.prompt_ids), record.completion_ids
        f = features(record, drafter.config.target_layer_ids)
        steps, i = [], 0  # (anchor index, committed) of each step of the walk
        for n in walk.acceptance_lengths:
            steps.append((i, n))
            i += n
        proposer = as_proposer(drafter, target, use_selector=False)
        per_call, fed = proposer.anchors_per_call(b), 0
        for start in range(0, len(steps), per_call):
            chunk = steps[start : start + per_call]
            end = p + chunk[-1][0]  # context strictly before the chunk's last anchor
            logits = proposer.propose_anchors([completion[a] for a, _ in chunk], [p + a for a, _ in chunk],
                                              f[None, fed:end], torch.arange(fed, end)[None], b)  # fmt: skip
            fed = end
            for (a, n), rows in zip(chunk, logits, strict=True):
                candidates = rows.topk(top_k, dim=-1).indices  # [B - 1, K]
                for j in range(min(n, b - 1)):
                    verified += 1
                    hits += bool((candidates[j] == completion[a + 1 + j]).any())
    return {"top_k": top_k, "tau": walked.tau, "unary_tau": unary.tau, "gain": walked.tau / unary.tau if unary.tau
            else None, "top_k_coverage": hits / verified if verified else None, "verified_positions": verified,
            "unary_per_prompt": [p.acceptance_lengths for p in unary.per_prompt]}  # fmt: skip
