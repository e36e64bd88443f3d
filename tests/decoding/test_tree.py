import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.decoding.proposers import as_proposer
from flashdraft.decoding.tree import (
    TreeRule,
    ancestor_mask,
    beam_tree,
    ddtree,
    path_on_device,
    topk_tree,
    tree_generate,
    tree_on_device,
)
from flashdraft.errors import FlashdraftError
from tests.conftest import VOCAB, make_dflash2_drafter, make_drafter, make_dspark_drafter, make_target
from tests.decoding.test_generate import _raw_reads
from tests.target.tiny_families import make_family_target

PROMPT = [5, 9, 17, 3, 22, 40, 11, 8, 30, 2, 14, 27]
CAT, DOG, SAT, RAN = 10, 11, 20, 21


def _logits(*rows: dict[int, float]) -> torch.Tensor:
    """Logits [k, VOCAB] whose softmax puts these probabilities on these tokens (the rest shared evenly)."""
    out = []
    for row in rows:
        rest = (1.0 - sum(row.values())) / (VOCAB - len(row))
        p = torch.full((VOCAB,), rest)
        for token, prob in row.items():
            p[token] = prob
        out.append(p.log())
    return torch.stack(out)


def test_ddtree_pops_the_best_cumulative_paths_as_vllms_example():
    logits = _logits({CAT: 0.6, DOG: 0.3}, {SAT: 0.7, RAN: 0.2})
    tree = ddtree(logits, budget=4)
    assert tree.tokens == [CAT, SAT, DOG, SAT]
    assert tree.parents == [-1, 0, 1, 0, 3]
    assert tree.depths == [0, 1, 2, 1, 2]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(tree.ancestors(), expected)
    assert tree.accepted_path({0: DOG, 3: SAT, 4: CAT}.get) == [0, 3, 4]


def test_topk_tree_keeps_the_best_expansions_of_each_depths_frontier():
    logits = _logits({CAT: 0.6, DOG: 0.3}, {SAT: 0.7, RAN: 0.2})
    tree = topk_tree(logits, budget=5, width=2)
    # depth 1: cat .6, dog .3; depth 2 expansions: cat-sat .42, cat-ran .12, dog-sat .21, dog-ran .06
    assert tree.tokens == [CAT, SAT, DOG, SAT, RAN]
    assert tree.parents == [-1, 0, 1, 0, 3, 1]


@pytest.mark.parametrize("rule", ["ddtree", "topk"])
def test_every_node_follows_its_parent_one_depth_deeper_within_the_budget(rule):
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    for budget in (1, 3, 10, 40):
        tree = ddtree(logits, budget) if rule == "ddtree" else topk_tree(logits, budget, width=4)
        assert tree.size == budget
        for node in range(1, tree.size + 1):
            assert tree.parents[node] < node and tree.depths[node] == tree.depths[tree.parents[node]] + 1


def test_width_one_is_the_chain_argmax_path():
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(2))
    chain = logits.argmax(-1).tolist()
    assert topk_tree(logits, budget=7, width=1).tokens == chain
    assert topk_tree(logits, budget=3, width=1).tokens == chain[:3]
    assert ddtree(logits, budget=1).tokens == chain[:1]


def test_beam_of_width_one_is_the_dflash2_selectors_greedy_walk():
    drafter = make_dflash2_drafter()
    selector = drafter.candidate_selector
    gen = torch.Generator().manual_seed(3)
    hidden, unary = torch.randn(1, 7, 64, generator=gen), torch.randn(1, 7, VOCAB, generator=gen) * 3
    with torch.no_grad():
        walk = selector.walk(hidden, unary, torch.tensor([5]))[0][0].tolist()
        tree = beam_tree(selector, hidden[0], unary[0], anchor=5, budget=7, width=1)
        wide = beam_tree(selector, hidden[0], unary[0], anchor=5, budget=12, width=3)
    assert tree.tokens == walk
    assert wide.size == 12 and all(wide.depths[wide.parents[n]] + 1 == wide.depths[n] for n in range(1, 13))


class RankedOracle:
    """Drafts the target's greedy continuation as the second-best token of the first position and the best of the
    others, so that only a tree's sibling branch is accepted past the first draft."""

    context_layer_ids: list[int] = [1]

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference

    def propose(self, tokens, anchor_pos, new_context, new_positions, block):
        truth = self.reference[len(tokens) : len(tokens) + block - 1]
        truth += [0] * (block - 1 - len(truth))
        rows = torch.zeros(block - 1, VOCAB)
        for k, token in enumerate(truth):
            rows[k, token] = 2.5 if k == 0 else 3.0
            rows[k, (token + 1) % 60] = 3.0 if k == 0 else 2.5
        return rows


def _targets():
    return [
        ("dense", make_target("qwen3")),
        ("sliding window + MoE", make_family_target("gpt_oss")),
        ("MoE", make_family_target("qwen3_moe")),
        ("Gated DeltaNet hybrid", make_target("hybrid")),
        ("MLA", make_family_target("deepseek_v3")),
        ("Gated DeltaNet + MoE", make_family_target("qwen3_next")),
    ]


@pytest.mark.parametrize("rule", [TreeRule("ddtree", 6), TreeRule("topk", 5, width=2)])
def test_tree_decoding_equals_greedy_decoding_through_sibling_branches(rule):
    for name, target in _targets():
        plain = autoregressive_generate(target, PROMPT, 30).output_ids
        out = tree_generate(target, RankedOracle(PROMPT + plain), PROMPT, 30, rule, _block(8))
        assert out.output_ids == plain, name
        # past the first draft only a sibling branch is right: steps that commit more went through one
        assert max(out.acceptance_lengths) > 2, name
        assert sum(out.acceptance_lengths) == len(plain) - 1


def test_tree_decoding_with_drafters_equals_greedy_decoding():
    target = make_family_target("gpt_oss")  # sliding window 8: contexts pass it
    plain = autoregressive_generate(target, PROMPT, 24).output_ids
    for drafter, rule in (
        (make_drafter(hidden_size=128), TreeRule("ddtree", 12)),
        (make_dflash2_drafter(hidden_size=128), TreeRule("beam", 10, width=3)),
    ):
        out = tree_generate(target, drafter, PROMPT, 24, rule)
        assert out.output_ids == plain
        assert all(n <= rule.budget for n in out.nodes_per_step)


def test_a_tree_step_reads_the_device_twice_and_the_counter_sees_every_read(monkeypatch):
    target = make_target("hybrid")
    plain = autoregressive_generate(target, PROMPT, 24).output_ids
    for drafter, rule in (
        (make_drafter(block_size=8), TreeRule("ddtree", 8)),
        (make_drafter(block_size=8), TreeRule("topk", 6, width=2)),
        (make_dflash2_drafter(block_size=8), TreeRule("beam", 6, width=2)),
    ):
        out, raw, counted = _raw_reads(monkeypatch, lambda d=drafter, r=rule: tree_generate(target, d, PROMPT, 24, r))
        steps = len(out.acceptance_lengths)
        assert out.output_ids == plain and steps > 3, rule
        assert out.host_transfers == 2 * steps, rule  # the tree's ranked tokens, the target's argmax per node
        assert raw == counted == out.host_transfers + 1, rule  # nothing read past the counter: + the prefill's


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss", "hybrid"])  # dense; sliding window; Gated DeltaNet
def test_a_tree_step_copies_to_the_device_once_and_keeps_greedy_outputs(kind, monkeypatch):
    """The step's one copy from the host (`tree_on_device`), no tensor indexed by a host list, whatever the layers."""
    target = make_family_target(kind) if kind == "gpt_oss" else make_target(kind)
    drafter, rule = make_drafter(block_size=8, hidden_size=target.config.hidden_size), TreeRule("ddtree", 8)
    plain = autoregressive_generate(target, PROMPT, 24).output_ids
    copies = []
    with ListIndexing() as indexing:  # a mode, not a patched Tensor.__getitem__ (that leaves a sequence slot behind)
        out, _, _ = _raw_reads(monkeypatch, lambda: tree_generate(target, drafter, PROMPT, 24, rule), copies)
    steps = len(out.acceptance_lengths)
    assert out.output_ids == plain and steps > 3
    assert [os.path.basename(f) for f in copies] == ["tree.py"] * (steps + 1)  # the prompt's, one per step
    assert indexing.lists == []


class ListIndexing(TorchFunctionMode):
    """Collects the Python lists tensors are indexed by (each a copy from the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.lists: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            keys = args[1] if isinstance(args[1], tuple) else (args[1],)
            self.lists.extend(k for k in keys if isinstance(k, list))
        return func(*args, **(kwargs or {}))


def test_the_device_ancestor_mask_and_path_are_the_hosts():
    tree = ddtree(_logits({CAT: 0.6, DOG: 0.3}, {SAT: 0.7, RAN: 0.2}), budget=4)  # nodes CAT, SAT, DOG, SAT
    nodes = tree_on_device(tree, [0, *tree.tokens], torch.device("cpu"))
    assert torch.equal(ancestor_mask(nodes, max(tree.depths)), tree.ancestors())
    for predicted in ([DOG, 0, 0, SAT, 0], [CAT, SAT, CAT, 0, 0], [CAT, RAN, 0, 0, 0], [RAN, 0, 0, 0, 0]):
        path = tree.accepted_path(predicted.__getitem__)
        on_device = path_on_device(nodes, torch.tensor(predicted), len(path), max(tree.depths))
        assert on_device.tolist() == path, predicted


def test_mamba_targets_dspark_drafters_and_beam_without_a_selector_are_refused():
    with pytest.raises(FlashdraftError, match="Mamba-2 mixers"):
        tree_generate(make_family_target("nemotron_h"), make_drafter(hidden_size=128), PROMPT, 8, TreeRule("ddtree", 4))
    with pytest.raises(FlashdraftError, match="DSpark"):
        tree_generate(make_target("qwen3"), make_dspark_drafter(), PROMPT, 8, TreeRule("ddtree", 4))
    with pytest.raises(FlashdraftError, match="candidate selector"):
        tree_generate(make_target("qwen3"), make_drafter(), PROMPT, 8, TreeRule("beam", 4))
    with pytest.raises(FlashdraftError, match="ddtree has no width"):
        TreeRule("ddtree", 4, width=2)


def _block(size: int):
    from flashdraft.decoding.generate import SpeculativeConfig

    return SpeculativeConfig(block_size=size)


def test_block_distributions_are_the_drafters_own_logits():
    target = make_target("qwen3")
    proposer = as_proposer(make_drafter(), target)
    target.set_context_layers(proposer.context_layer_ids)
    features = target.forward(torch.tensor([PROMPT])).context_features
    rows = proposer.propose(PROMPT, len(PROMPT) - 1, features[:, :-1], torch.arange(len(PROMPT) - 1)[None], 8)
    torch.testing.assert_close(proposer.block_distributions(0)[1], rows)
