"""The served check's near ties: the drafts a walk verified whose top two logits lie within bf16's spacing."""

from __future__ import annotations

import torch

import flashdraft.evaluation.engine_walk as engine_walk
import flashdraft.evaluation.offline as offline
from flashdraft.evaluation.records import EvalRecord, FeatureSource
from tests.conftest import make_drafter, make_target


def test_near_ties_redraft_each_verified_draft_as_the_walk_drafted_it_and_keep_those_within_the_spacing(monkeypatch):
    target, drafter = make_target("qwen3"), make_drafter()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 60, (40,), generator=generator).tolist()
    record = EvalRecord("r0", tokens[:8], tokens[8:])
    walked: dict[int, torch.Tensor] = {}  # anchor -> the walk's draft logits [drafts, V]
    draft = offline.draft_anchors

    def spy(proposer, anchors, *args, **kwargs):
        logits, fed = draft(proposer, anchors, *args, **kwargs)
        walked.update({a: x.float() for a, x in zip(anchors, logits, strict=True)})
        return logits, fed

    monkeypatch.setattr(offline, "draft_anchors", spy)
    lengths = (
        offline.evaluate_offline(drafter, target, [record], FeatureSource(target)).per_prompt[0].acceptance_lengths
    )
    monkeypatch.setattr(engine_walk, "NEAR_TIE_ULPS", 1e9)  # every verified draft a tie: all of them, with gaps
    ties = engine_walk.near_ties(drafter, target, record, lengths, block=8)
    anchors = [sum(lengths[:s]) for s in range(len(lengths))]
    assert [(t.step, t.position) for t in ties] == [(s, k) for s, n in enumerate(lengths) for k in range(min(n, 7))]
    for t in ties:
        top = walked[anchors[t.step]][t.position].topk(2).values
        assert abs(t.gap - float(top[0] - top[1])) <= 1e-5 * (1 + abs(t.gap))  # the same draft, recomputed
    monkeypatch.setattr(engine_walk, "NEAR_TIE_ULPS", 2)
    kept = engine_walk.near_ties(drafter, target, record, lengths, block=8)
    assert kept == [t for t in ties if t.gap <= 2 * t.spacing]
