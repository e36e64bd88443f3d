import math

import torch

from flashdraft.train.blocks import IGNORE
from flashdraft.train.loss import block_loss, estimated_acceptance, position_weights, recipe_decay_gamma


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
    parts = block_loss(hidden, labels, head, 4, gamma=2.0)
    logits = head(hidden[0]).detach()
    w = position_weights(4, 2.0)
    expected = sum(
        float(w[i % 4]) * float(torch.nn.functional.cross_entropy(logits[i : i + 1], labels[0, i : i + 1]))
        for i in range(8)
        if labels[0, i] != IGNORE
    )
    assert math.isclose(float(parts.weighted_sum.detach()), expected, rel_tol=1e-5)
    assert math.isclose(float(parts.weight_total), float(w[1] + w[2] + w[3] + w[1] + w[3]), rel_tol=1e-6)
    assert parts.count.tolist() == [0, 2, 1, 2]


def test_estimated_acceptance_is_one_plus_sum_of_running_products():
    correct, count = torch.tensor([0.0, 8, 4, 2]), torch.tensor([0.0, 10, 10, 10])
    acc, tau = estimated_acceptance(correct, count)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(acc, [0.8, 0.4, 0.2], strict=True))
    assert math.isclose(tau, 1 + 0.8 + 0.8 * 0.4 + 0.8 * 0.4 * 0.2, rel_tol=1e-6)
