import pytest
import torch

from flashdraft.decoding.acceptance import accept_greedy, committed_length, greedy_verdict
from flashdraft.decoding.generate import SpeculativeConfig, autoregressive_generate, speculative_generate
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.decoding.proposers import BatchProposer, DFlashProposer, DraftLimit, as_proposer, draw_drafts
from flashdraft.decoding.serving_rules import verify
from flashdraft.evaluation.offline import WalkConfig, evaluate_offline, offline_acceptance_lengths
from tests.conftest import make_dflash2_drafter, make_drafter, make_target
from tests.decoding.test_ngram import PROMPTS, greedy_records
from tests.evaluation.test_run import overfit


def test_greedy_rule_online_and_offline_commit_the_same_prefix():
    # online the target's argmax is read from its logits; offline it is the next completion token
    completion = torch.tensor([7, 3, 5, 9, 2, 4])
    draft = torch.tensor([3, 5, 1, 2])  # agrees with completion[1:] for two tokens
    logits = torch.nn.functional.one_hot(completion[1:], 10).float()  # the target after [anchor, d1 .. d4]
    a, bonus = accept_greedy(draft, logits)
    assert (a, bonus) == (2, 9)
    assert committed_length(draft, completion, 0) == a + 1
    assert committed_length(torch.tensor([2, 4, 8]), completion, 3) == 2  # all agree, but 2 tokens are left


@pytest.mark.parametrize("one_hot", [False, True], ids=["q the drafter's", "q one-hot"])
def test_verification_keeps_the_target_distribution_with_sampled_or_argmax_drafts(one_hot):
    # context-free synthetic target: the emitted pair must follow p0 x p1 whatever q is, and whether the drafts were
    # sampled from q (min(1, p/q)) or are fixed with q one-hot (accept with p(d), resample p without d)
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.7, 0.1], [0.4, 0.4, 0.1, 0.1]])
    counts = torch.zeros(4, 4)
    n = 12000
    for _ in range(n):
        draft = q.argmax(-1) if one_hot else torch.multinomial(q, 1, generator=gen).squeeze(1)
        a, bonus, _ = verify(draft, None if one_hot else q, p, gen)
        emitted = draft[:a].tolist() + [bonus]
        if len(emitted) < 2:  # the second token comes from the next step: draw it from p1 directly
            emitted.append(int(torch.multinomial(p[1], 1, generator=gen)))
        counts[emitted[0], emitted[1]] += 1
    expected = torch.outer(p[0], p[1]) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7  # 15 degrees of freedom, p = 0.001


class FirstDrafts:
    """Verifies only the first k drafts of the n-gram block, k changing from step to step:
    the shape of a `num_speculative_tokens` or confidence-chosen k."""

    def __init__(self, vocab_size: int) -> None:
        self.ngram = NGramProposer(vocab_size)
        self.context_layer_ids: list[int] = []

    def propose(self, tokens, anchor_pos, new_context, new_positions, block):
        k = 1 + len(tokens) % (block - 1)  # 1 .. B - 1
        return self.ngram.propose(tokens, anchor_pos, new_context, new_positions, block)[:k]


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_a_proposer_drafting_fewer_tokens_is_verified_on_exactly_those_offline_and_online(kind):
    target = make_target(kind)
    proposer = FirstDrafts(target.vocab_size)
    for prompt in PROMPTS:
        plain = autoregressive_generate(target, prompt, 40)
        online = speculative_generate(target, proposer, prompt, 40, speculative=SpeculativeConfig(block_size=8))
        assert online.output_ids == plain.output_ids
        offline = offline_acceptance_lengths(proposer, prompt, plain.output_ids, 8)
        assert offline == online.acceptance_lengths
        assert max(online.acceptance_lengths) <= 8


def test_one_anchor_walk_feeds_context_as_online_does():
    # a DFlash drafter through the generic walk (features fed step by step, as online) must
    # match the batched DFlash walk: the generic walk's context feeding is what is checked
    target = make_target("hybrid")
    records = greedy_records(target)
    drafter = overfit(make_drafter(), target, records[0])
    target.set_context_layers(drafter.config.target_layer_ids)
    walks = []
    for r in records:
        features = target.forward(torch.tensor([r.input_ids])).context_features[0]
        batched = offline_acceptance_lengths(
            DFlashProposer(drafter, target), r.prompt_ids, r.completion_ids, 8, features
        )
        one_by_one = offline_acceptance_lengths(
            DFlashProposer(drafter, target), r.prompt_ids, r.completion_ids, 8, features, anchors_per_call=1
        )
        assert one_by_one == batched
        walks.append(batched)
    assert max(walks[0]) > 2  # the drafter accepts on the record it was fitted to: lengths vary


# -- verifying fewer drafts ------------------------------------------------------------------


def test_draft_limit_keeps_the_first_k_and_stops_before_the_first_unsure_draft():
    top = torch.tensor([0.9, 0.8, 0.3, 0.95])  # the drafter's top probability at each position
    probs = torch.cat([top[:, None], ((1 - top) / 3)[:, None].expand(4, 3)], dim=1)  # [4, V = 4]
    logits = probs.log() + 3.0  # any shift: the limit reads the softmax
    assert DraftLimit().count(logits) == 4
    assert DraftLimit(num_speculative_tokens=2).count(logits) == 2
    assert DraftLimit(num_speculative_tokens=9).count(logits) == 4
    assert DraftLimit(adaptive_threshold=0.5).count(logits) == 2
    assert DraftLimit(adaptive_threshold=0.25).count(logits) == 4
    assert DraftLimit(adaptive_threshold=0.95).count(logits) == 0  # unsure of the first: a plain greedy step
    assert DraftLimit(num_speculative_tokens=1, adaptive_threshold=0.5).count(logits) == 1


@pytest.fixture(scope="module")
def fitted():
    """A hybrid target, its greedy records and a drafter overfitted to the first (it accepts)."""
    target = make_target("hybrid")
    records = greedy_records(target)
    return target, records, overfit(make_drafter(), target, records[0])


LIMITS = [
    DraftLimit(num_speculative_tokens=1),
    DraftLimit(num_speculative_tokens=3),
    DraftLimit(adaptive_threshold=0.6),
    DraftLimit(num_speculative_tokens=5, adaptive_threshold=0.3),
]


@pytest.mark.parametrize("limit", LIMITS, ids=str)
@pytest.mark.parametrize("kind", ["dflash", "ngram"])
def test_verifying_fewer_drafts_stays_lossless_and_offline_equals_online(fitted, limit, kind):
    target, records, drafter = fitted
    if kind == "ngram":
        drafter = NGramProposer(target.vocab_size)
    else:  # the batched many-anchors walk survives the limit
        assert isinstance(as_proposer(drafter, target, limit), BatchProposer)
    offline = evaluate_offline(drafter, target, records, walk=WalkConfig(block_size=8, limit=limit))
    full = evaluate_offline(drafter, target, records, walk=WalkConfig(block_size=8))
    for record, walked in zip(records, offline.per_prompt, strict=True):
        online = speculative_generate(
            target,
            drafter,
            record.prompt_ids,
            len(record.completion_ids),
            speculative=SpeculativeConfig(block_size=8, limit=limit),
        )
        assert online.output_ids == record.completion_ids  # greedy: identical to autoregressive decoding
        assert walked.acceptance_lengths == online.acceptance_lengths
    assert max(offline.lengths) <= 1 + (limit.num_speculative_tokens or 7)
    if kind == "dflash":  # the limit changed what was verified, and (k > 1) still let several drafts through
        assert offline.lengths != full.lengths
        assert max(offline.lengths) > (2 if limit.num_speculative_tokens != 1 else 1)


def test_one_anchor_walk_equals_the_batched_walk_under_an_adaptive_limit(fitted):
    target, records, drafter = fitted
    limit = DraftLimit(adaptive_threshold=0.6)
    target.set_context_layers(drafter.config.target_layer_ids)
    for r in records:
        features = target.forward(torch.tensor([r.input_ids])).context_features[0]
        walks = [
            offline_acceptance_lengths(
                as_proposer(drafter, target, limit), r.prompt_ids, r.completion_ids, 8, features, anchors_per_call=n
            )
            for n in (1, 5)
        ]
        assert walks[0] == walks[1]


def test_the_greedy_verdict_on_the_device_equals_the_rule_for_every_accepted_length():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=gen)  # [k + 1, V] at [anchor, d1 .. d15]
    predicted = logits.argmax(-1)
    for accepted in range(16):  # drafts right up to `accepted`, then wrong
        draft = predicted[:15].clone()
        if accepted < 15:
            draft[accepted] = (draft[accepted] + 1) % 50
        verdict = greedy_verdict(draft, logits).tolist()  # [a, the target's argmax after each block token]
        a, bonus = accept_greedy(draft, logits)
        assert (verdict[0], verdict[1 + a]) == (a, bonus) == (accepted, int(predicted[accepted]))
        assert verdict[1 : a + 1] == draft[:a].tolist()  # the committed tokens begin with the accepted drafts


def first_prompt_context(fitted):
    """(target, drafter, the first record, its prompt's context features [1, P, n * H], positions [1, P])."""
    target, records, drafter = fitted
    target.set_context_layers(drafter.config.target_layer_ids)
    r = records[0]
    features = target.forward(torch.tensor([r.prompt_ids])).context_features
    return target, drafter, r, features, torch.arange(len(r.prompt_ids))[None]


def test_a_drafter_limited_to_k_drafts_computes_logits_for_only_k_positions(fitted):
    target, drafter, r, features, positions = first_prompt_context(fitted)
    for limit, rows in ((None, 7), (DraftLimit(num_speculative_tokens=3), 3)):
        inner = as_proposer(drafter, target, limit)
        inner = inner.inner if limit is not None else inner
        assert inner.propose(r.prompt_ids, len(r.prompt_ids), features, positions, 8).shape == (rows, target.vocab_size)


def test_an_adaptive_limit_computes_logits_only_up_to_the_chunk_of_the_first_unsure_draft(fitted):
    target, drafter, r, features, positions = first_prompt_context(fitted)
    full = as_proposer(drafter, target).propose(r.prompt_ids, len(r.prompt_ids), features, positions, 8)  # [7, V]
    top = torch.softmax(full, -1).amax(-1)  # [7]
    rows_seen = set()
    for threshold in (0.0, *top.tolist(), 1.0):
        limit = DraftLimit(adaptive_threshold=threshold)
        limited = as_proposer(drafter, target, limit)
        logits = limited.inner.propose(r.prompt_ids, len(r.prompt_ids), features, positions, 8)
        first_unsure = int((top >= threshold).int().cumprod(0).sum())  # the k the limit verifies
        assert logits.shape[0] == min(7, (first_unsure // 4 + 1) * 4)  # whole chunks of 4, none past it
        torch.testing.assert_close(logits, full[: logits.shape[0]])
        assert limit.count(logits) == limit.count(full) == first_unsure
        rows_seen.add(logits.shape[0])
    assert rows_seen == {4, 7}


def _one_proposal(proposer, target, prompt, block):
    target.set_context_layers(proposer.context_layer_ids)
    features = target.forward(torch.tensor([prompt]), target.new_cache()).context_features
    positions = torch.arange(len(prompt))[None]
    return proposer.propose(prompt, len(prompt), features, positions, block)


@torch.no_grad()
def test_a_dflash2_draw_samples_each_draft_from_the_q_it_returns_given_the_draft_before():
    # verification is lossless only if each draft was drawn from the q it is given:
    # for DFlash2 that q depends on the draft sampled before it, so check it conditionally
    target = make_target("qwen3")
    proposer = DFlashProposer(make_dflash2_drafter(block_size=4), target)
    logits = _one_proposal(proposer, target, [5, 9, 17, 3, 22], 4)
    gen = torch.Generator().manual_seed(0)
    draws = [draw_drafts(proposer, logits, 1.0, gen, "sglang") for _ in range(3000)]
    first = torch.stack([d for d, _ in draws])[:, 0]
    q0 = draws[0][1][0]
    assert all(torch.equal(q[0], q0) for _, q in draws)  # position 0's q does not depend on any draw
    d0 = int(first.mode().values)
    given = [(d, q) for d, q in draws if int(d[0]) == d0]
    second = torch.bincount(torch.stack([d[1] for d, _ in given]), minlength=64).float()
    q1 = given[0][1][1]
    assert all(torch.equal(q[1], q1) for _, q in given)
    assert not torch.allclose(q1, draws[[int(d[0]) != d0 for d, _ in draws].index(True)][1][1])  # q1 depends on d0
    support = q1 > 0.02
    expected = q1[support] * len(given)
    chi2 = float(((second[support] - expected) ** 2 / expected).sum())
    assert int(second[q1 == 0].sum()) == 0 and chi2 < 30.0, (second, q1)  # under 16 degrees of freedom, p ~ 0.02
