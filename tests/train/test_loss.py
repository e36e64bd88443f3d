import math

import torch

from flashdraft.train.blocks import IGNORE
from flashdraft.train.loss import (
    BlockLabels,
    DraftHeads,
    DSparkLoss,
    LossSpec,
    block_loss,
    block_predecessors,
    dpace_weights,
    estimated_acceptance,
    label_weight_total,
    position_weights,
    recipe_decay_gamma,
    selector_loss,
    target_distribution_terms,
)
from tests.conftest import make_dflash2_drafter, make_dspark_drafter


def test_decay_weights_are_exp_minus_k_minus_one_over_gamma_and_zero_at_anchor():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[8]), math.exp(-7 / 7), rel_tol=1e-6)
    assert position_weights(4, None).tolist() == [0, 1, 1, 1]
    assert position_weights(4, 0.0).tolist() == [0, 1, 1, 1]


def test_recipe_decay_gamma_is_the_published_one_per_block_size_and_none_elsewhere():
    assert [recipe_decay_gamma(b) for b in (16, 10, 8, 4)] == [7.0, 5.0, 4.0, 0.0]


def test_loss_is_the_weighted_mean_of_hard_cross_entropy():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 5, bias=False)
    hidden = torch.randn(1, 8, 8)
    labels = torch.tensor([[IGNORE, 1, 2, 3, IGNORE, 4, IGNORE, 0]])
    parts = block_loss(hidden, BlockLabels(labels), DraftHeads(head), LossSpec(4, gamma=2.0))
    logits = head(hidden[0]).detach()
    w = position_weights(4, 2.0)
    expected = sum(
        float(w[i % 4]) * float(torch.nn.functional.cross_entropy(logits[i : i + 1], labels[0, i : i + 1]))
        for i in range(8)
        if labels[0, i] != IGNORE
    )
    assert math.isclose(float(parts.weighted_sum.detach()), expected, rel_tol=1e-5)
    assert math.isclose(float(parts.weight_total), float(w[1] + w[2] + w[3] + w[1] + w[3]), rel_tol=1e-6)
    assert parts.figures.count.tolist() == [0, 2, 1, 2]


def test_estimated_acceptance_is_one_plus_sum_of_running_products():
    correct, count = torch.tensor([0.0, 8, 4, 2]), torch.tensor([0.0, 10, 10, 10])
    acc, tau = estimated_acceptance(correct, count)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(acc, [0.8, 0.4, 0.2], strict=True))
    assert math.isclose(tau, 1 + 0.8 + 0.8 * 0.4 + 0.8 * 0.4 * 0.2, rel_tol=1e-6)


def test_dpace_weights_equal_the_closed_form_on_a_hand_computed_block():
    # q = 0.5, 0.2, 0.8 at positions 1..3, alpha 0.5: q~ = 0.75, 0.6, 0.9; P = 0.75, 0.45, 0.405
    q = torch.tensor([[0.0, 0.5, 0.2, 0.8]])
    trained = torch.tensor([[False, True, True, True]])
    w = dpace_weights(q, trained, alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.75 + 0.45 + 0.405, 0.45 + 0.405, 0.405]]))
    # an untrained position past the end of the sequence is 1 in the products, 0 in the sums
    w = dpace_weights(q, torch.tensor([[False, True, True, False]]), alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.75 + 0.45, 0.45, 0.0]]))


def test_dpace_loss_weights_come_from_the_label_probability_and_carry_no_gradient():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 5, bias=False)
    hidden = torch.randn(1, 8, 8, requires_grad=True)
    labels = torch.tensor([[IGNORE, 1, 2, 3, IGNORE, 4, 0, IGNORE]])
    parts = block_loss(hidden, BlockLabels(labels), DraftHeads(head), LossSpec(4, weighting="dpace", dpace_alpha=0.3))
    logits = head(hidden[0])  # [8, 5]
    trained = labels[0] != IGNORE
    ce = torch.nn.functional.cross_entropy(logits[trained], labels[0][trained], reduction="none")
    q = torch.zeros(8)
    q[trained] = torch.exp(-ce.detach())
    w = dpace_weights(q.view(2, 4), trained.view(2, 4), 0.3).view(8)[trained]
    expected = (w * ce).sum()
    torch.testing.assert_close(parts.weighted_sum, expected)
    (grad,) = torch.autograd.grad(parts.weighted_sum, hidden)
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(grad, expected_grad)  # the weights are constants: no d(weight)/d(hidden) term
    assert label_weight_total(labels, 4, None, "dpace") == 2  # normalised per trained block


def test_dpace_normaliser_is_known_from_labels_alone_so_any_partition_sums_to_the_same():
    labels = torch.tensor([[IGNORE, 1, 2, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE], [IGNORE, 1, 2, 3, IGNORE, 4, 0, 1]])
    whole = label_weight_total(labels, 4, None, "dpace")
    assert whole == label_weight_total(labels[:1], 4, None, "dpace") + label_weight_total(labels[1:], 4, None, "dpace")
    assert whole == 3  # the second sequence's first block and both blocks of the other


def test_selector_predecessors_are_the_anchor_then_the_true_previous_label_within_each_block():
    block_ids = torch.tensor([[10, 9, 9, 9, 20, 9, 9, 9]])  # two blocks of 4: anchors 10 and 20, mask 9
    labels = torch.tensor([[IGNORE, 11, 12, IGNORE, IGNORE, 21, IGNORE, 23]])
    pred = block_predecessors(block_ids, labels, 4)
    assert pred[0, [1, 2, 3, 5, 6, 7]].tolist() == [10, 11, 12, 20, 21, IGNORE]  # position 7 follows an untrained one


def _selector_case():
    drafter = make_dflash2_drafter()  # top-K 4 over 64 tokens
    gen = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(6, 64, generator=gen), torch.randn(6, 64, generator=gen, requires_grad=True)
    labels = logits.detach().argsort(-1, descending=True)[torch.arange(6), torch.tensor([0, 1, 3, 5, 9, 2])]
    predecessors = torch.tensor([3, 7, 8, IGNORE, 40, 2])
    return drafter.candidate_selector, hidden, logits, labels, predecessors


def test_selector_loss_is_the_teacher_forced_cross_entropy_over_the_top_k_with_a_missing_label_injected():
    selector, hidden, logits, labels, predecessors = _selector_case()
    ce, used, in_top_k, _ = selector_loss(selector, hidden, logits, labels, predecessors, "inject")
    assert in_top_k.tolist() == [True, True, True, False, False, True]  # ranks 0, 1, 3 in; 5 and 9 out
    assert used.tolist() == [True, True, True, False, True, True]  # no predecessor at 3; 4 injected
    for m in (0, 4):  # written out: candidates = the top-K, the K-th replaced by a missing label
        ids = logits[m].detach().topk(4).indices.clone()
        if labels[m] not in ids:
            ids[-1] = labels[m]
        scores = logits[m].detach()[ids] + selector.pair_scores(
            selector.hidden_projection(hidden[m]), predecessors[m], ids
        )
        expected = torch.nn.functional.cross_entropy(scores[None], (ids == labels[m]).nonzero()[0])
        torch.testing.assert_close(ce[m], expected)
    ce.sum().backward()
    assert logits.grad is None or float(logits.grad.abs().sum()) == 0  # the unary scores are not trained by it
    assert float(selector.hidden_projection.weight.grad.abs().sum()) > 0


def test_selector_loss_skip_leaves_positions_whose_label_is_outside_the_top_k_out():
    selector, hidden, logits, labels, predecessors = _selector_case()
    ce, used, _, _ = selector_loss(selector, hidden, logits, labels, predecessors, "skip")
    assert used.tolist() == [True, True, True, False, False, True]
    assert ce[3].item() == ce[4].item() == 0.0 and bool((ce[used] >= 0).all())


def test_block_loss_of_a_dflash2_drafter_adds_the_weighted_selector_loss_and_counts_its_figures():
    drafter = make_dflash2_drafter()
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 64, bias=False)
    hidden = torch.randn(1, 8, 64)
    block_ids = torch.tensor([[5, 63, 63, 63, 6, 63, 63, 63]])
    labels = torch.tensor([[IGNORE, 1, 2, 3, IGNORE, 4, 7, 0]])
    blocks = BlockLabels(labels, block_ids)
    plain = block_loss(hidden, blocks, DraftHeads(head), LossSpec(4, gamma=2.0))
    with_selector = DraftHeads(head, selector=drafter.candidate_selector)
    parts = [
        block_loss(hidden, blocks, with_selector, LossSpec(4, gamma=2.0, selector_loss_weight=weight))
        for weight in (0.0, 0.5, 1.0)
    ]
    torch.testing.assert_close(parts[0].weighted_sum, plain.weighted_sum)
    selector_half = parts[1].weighted_sum - plain.weighted_sum  # the selector term at weight 0.5
    torch.testing.assert_close(parts[2].weighted_sum - parts[1].weighted_sum, selector_half)
    assert parts[1].weighted_sum.item() > plain.weighted_sum.item()
    assert parts[1].weight_total == plain.weight_total  # the normaliser is the backbone's, known from labels
    assert (
        parts[1].figures.top_k_hits[1:].sum() <= parts[1].figures.count[1:].sum()
        and parts[1].figures.selector_correct[0] == 0
    )


# -- DSpark -------------------------------------------------------------------------------------------


def test_dspark_decay_is_exp_minus_k_over_4_from_block_position_0_and_the_normaliser_counts_it():
    w = position_weights(7, recipe_decay_gamma(7, "dspark"), first_draft=0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(7.0) / 4))
    labels = torch.tensor([[1, 2, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]])
    assert math.isclose(label_weight_total(labels, 7, 4.0, first_draft=0), 1 + math.exp(-0.25), rel_tol=1e-6)
    acc, tau = estimated_acceptance(
        torch.tensor([2.0, 1.0, 0, 0, 0, 0, 0]), torch.tensor([2.0, 2, 1, 1, 1, 1, 1]), first_draft=0
    )
    assert acc[:2] == [1.0, 0.5] and tau == 2.5


def test_dspark_predecessors_are_the_anchor_at_position_0_then_the_previous_label():
    block_ids = torch.tensor([[5, 63, 63, 9, 63, 63]])
    labels = torch.tensor([[1, 2, 3, 4, IGNORE, IGNORE]])
    assert block_predecessors(block_ids, labels, 3, first_draft=0).tolist() == [[5, 1, 2, 9, 4, IGNORE]]


def test_the_l1_distance_to_a_top_k_target_counts_the_draft_mass_outside_it_and_is_exact_with_the_whole_vocab():
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    full = (torch.softmax(logits, -1) - torch.softmax(target, -1)).abs().sum(-1)
    values, indices = target.topk(64, -1)
    torch.testing.assert_close(target_distribution_terms(logits, (values, indices)), full)
    values, indices = target.topk(4, -1)  # renormalised over 4: the rest of the draft's mass is distance
    p_target = torch.zeros(5, 64).scatter(1, indices, torch.softmax(values, -1))
    torch.testing.assert_close(
        target_distribution_terms(logits, (values, indices)), (torch.softmax(logits, -1) - p_target).abs().sum(-1)
    )


def test_dspark_block_loss_is_the_papers_weighted_ce_l1_and_confidence_bce_with_the_teacher_forced_markov_bias():
    drafter = make_dspark_drafter(block_size=3)
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 64, bias=False)
    hidden = torch.randn(1, 6, 64)
    block_ids = torch.tensor([[5, 63, 63, 9, 63, 63]])
    labels = torch.tensor([[1, 2, 3, 4, IGNORE, IGNORE]])
    topk = torch.randn(1, 6, 64).topk(64, -1)
    topk = (topk.values, topk.indices)
    terms = DSparkLoss(0.1, 0.9, 1.0)
    heads = DraftHeads(head, markov_head=drafter.markov_head, confidence_head=drafter.confidence_head)
    spec = LossSpec(3, gamma=4.0, first_draft=0, dspark=terms)
    parts = block_loss(hidden, BlockLabels(labels, block_ids, topk), heads, spec)
    trained = labels[0] != IGNORE
    predecessors = torch.tensor([5, 1, 2, 9])  # the anchor, then the true previous token: never a later one
    with torch.no_grad():
        logits = head(hidden[0, trained]) + drafter.markov_head.bias(predecessors)
        p_target = torch.softmax(topk[0][0, trained], -1).gather(1, topk[1][0, trained].argsort(-1))
        l1 = (torch.softmax(logits, -1) - p_target).abs().sum(-1)
        accept = 1 - l1 / 2
        c = drafter.confidence(hidden[0, trained], predecessors)
        bce = -(accept * c.log() + (1 - accept) * (1 - c).log())
        ce = torch.nn.functional.cross_entropy(logits, labels[0, trained], reduction="none")
        w = torch.exp(-torch.tensor([0.0, 1, 2, 0]) / 4)
        expected = (w * (0.1 * ce + 0.9 * l1 + bce)).sum()
    torch.testing.assert_close(parts.weighted_sum.detach(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parts.figures.accept_rate, torch.stack([accept[0] + accept[3], accept[1], accept[2]]))
    torch.testing.assert_close(parts.figures.confidence, torch.stack([c[0] + c[3], c[1], c[2]]))
    parts.weighted_sum.backward()  # every head gets a gradient: the Markov head through CE and L1, the confidence
    assert drafter.markov_head.markov_w2.weight.grad.abs().sum() > 0  # head through its BCE
    assert drafter.confidence_head.proj.weight.grad.abs().sum() > 0


# -- the chunked logits ------------------------------------------------------------------------------


def _family_cases():
    """(name, heads, spec, blocks) for each family's loss over 2 sequences x 3 blocks of 4, vocabulary 64."""
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 64, (2, 12), generator=gen)
    labels[:, ::4] = IGNORE
    labels[1, 7] = IGNORE
    block_ids = torch.full((2, 12), 63)
    block_ids[:, ::4] = torch.randint(0, 64, (2, 3), generator=gen)
    top = torch.randn(2, 12, 64, generator=gen).topk(8, -1)
    topk = (top.values, top.indices)
    head = torch.nn.Linear(64, 64, bias=False)
    dflash2, dspark = make_dflash2_drafter(), make_dspark_drafter(block_size=4)
    dspark_labels = labels.clone()
    dspark_labels[:, ::4] = torch.randint(0, 64, (2, 3), generator=gen)  # anchor-first: position 0 is trained
    return [
        ("dflash decay", DraftHeads(head), LossSpec(4, gamma=2.0), BlockLabels(labels)),
        (
            "dflash dpace kl",
            DraftHeads(head),
            LossSpec(4, weighting="dpace", kl_weight=0.3),
            BlockLabels(labels, None, topk),
        ),
        (
            "dflash2 selector",
            DraftHeads(head, selector=dflash2.candidate_selector),
            LossSpec(4, weighting="dpace", selector_loss_weight=0.5),
            BlockLabels(labels, block_ids),
        ),
        (
            "dspark",
            DraftHeads(head, markov_head=dspark.markov_head, confidence_head=dspark.confidence_head),
            LossSpec(4, gamma=4.0, first_draft=0, dspark=DSparkLoss()),
            BlockLabels(dspark_labels, block_ids, topk),
        ),
    ]


def test_chunked_logits_give_the_whole_batch_loss_figures_and_gradients_for_every_family():
    for name, heads, spec, blocks in _family_cases():
        results = []
        for chunk_rows in (3, 10_000):  # several chunks, each recomputed in backward; one chunk of all rows
            hidden = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
            params = [p for p in heads.lm_head.parameters()]
            for part in (heads.selector, heads.markov_head, heads.confidence_head):
                params += [] if part is None else list(part.parameters())
            parts = block_loss(hidden, blocks, heads, spec, chunk_rows=chunk_rows)
            grads = torch.autograd.grad(parts.weighted_sum, [hidden, *params], allow_unused=True)
            results.append((parts, grads))
        (chunked, chunked_grads), (whole, whole_grads) = results
        torch.testing.assert_close(chunked.weighted_sum, whole.weighted_sum, msg=name)
        torch.testing.assert_close(chunked.figures.correct, whole.figures.correct, msg=name)
        for a, b in zip(chunked_grads, whole_grads, strict=True):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, msg=name)
        assert any(g is not None and float(g.abs().sum()) > 0 for g in chunked_grads[1:]), name


def test_chunked_loss_never_keeps_more_than_a_chunk_of_logits_for_backward():
    _, _, spec, blocks = _family_cases()[1]  # D-PACE and KL: both read the whole distribution
    heads = DraftHeads(torch.nn.Linear(64, 256, bias=False))  # vocabulary 256 beside hidden 64: logits told apart
    hidden = torch.randn(2, 12, 64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        parts = block_loss(hidden, blocks, heads, spec, chunk_rows=4)
    assert int((blocks.labels != IGNORE).sum()) > 8
    assert not [s for s in saved if s[-1:] == (256,) and s[0] > 4]  # logits kept are a chunk's (4 rows), never all M
    parts.weighted_sum.backward()
    assert float(hidden.grad.abs().sum()) > 0
    trained = blocks.labels != IGNORE
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the check sees logits kept whole
        torch.nn.functional.cross_entropy(heads.lm_head(hidden[trained]).float(), blocks.labels[trained])
    assert [s for s in saved if s[-1:] == (256,) and s[0] > 4]
