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
) -> EvalResult:
    """Offline τ of `drafter` (a DFlash drafter, the hybrid, or a stateless `Proposer` such as
    the n-gram baseline) on `records`, each walked for at most `max_blocks` steps, verifying the
    drafts `limit` keeps."""
    b, layer_ids, context_layers = drafter_shape(drafter, block_size)
    features = features or FeatureSource(target)
    per_prompt = []
    for record in records:
        f = features(record, layer_ids) if layer_ids else None
        lengths = offline_acceptance_lengths(as_proposer(drafter, target, limit), record.prompt_ids,
                                             record.completion_ids, b, f, max_blocks, target.device)  # fmt: skip
        per_prompt.append(PromptResult(record.id, lengths))
    return EvalResult("offline", b, layer_ids, context_layers, per_prompt)
