"""The draft tree's verify on the target's static cache (`SpeculativeConfig(compile=True)` in `tree_generate`) against
the eager tree verify: token for token and step for step for every target family the tree loop verifies; after
warm-up a whole generation compiles nothing more whatever the tree, the accepted path and the position, breaks no
graph, and keeps every buffer at its address."""

import random

import pytest
import torch

from flashdraft.decoding.generate import SpeculativeConfig, autoregressive_generate
from flashdraft.decoding.static_tree import StaticTreeVerifier, static_tree_verifier
from flashdraft.decoding.tree import DraftTree, TreeRule, tree_generate, tree_on_device
from flashdraft.errors import FlashdraftError
from flashdraft.target.static_cache import capacity_for
from tests.conftest import VOCAB, make_target
from tests.decoding.test_tree import PROMPT
from tests.decoding.test_verification import build_target

EAGER = SpeculativeConfig(block_size=8, compile=False)
STATIC = SpeculativeConfig(block_size=8, compile=True, compile_backend=None)  # the static path, uncompiled
# backend "eager": Dynamo traces the same graphs, with the same guards and graph breaks, as inductor would compile
COMPILED = SpeculativeConfig(block_size=8, compile=True, compile_backend="eager")
RULES = [TreeRule("ddtree", 6), TreeRule("topk", 5, width=2)]
SMALL = TreeRule("ddtree", 4)  # the compiled one: 5 nodes, at most 4 deep (the graph unrolls its depth loops)


class BranchingOracle:
    """Drafts the target's greedy continuation, at each position as the best or (at random) the second-best token,
    wrong from a position that cycles through `WRONG_FROM` (shifted by the seed): the accepted path goes through
    sibling branches and stops at every depth."""

    WRONG_FROM = (0, 3, 1, 7, 2, 5, 4)

    context_layer_ids: list[int] = [1]

    def __init__(self, reference: list[int], seed: int = 0) -> None:
        self.reference, self.rng, self.calls = reference, random.Random(seed), seed

    def propose(self, tokens, anchor_pos, new_context, new_positions, block):
        assert new_context.shape[1] == new_positions.shape[1] and int(new_positions[0, -1]) == anchor_pos - 1
        truth = self.reference[len(tokens) : len(tokens) + block - 1]
        truth += [0] * (block - 1 - len(truth))
        wrong_from = self.WRONG_FROM[self.calls % len(self.WRONG_FROM)]
        self.calls += 1
        rows = torch.zeros(block - 1, VOCAB)
        for k, token in enumerate(truth):
            token = token if k < wrong_from else (token + 2) % 60
            second = self.rng.random() < 0.25
            rows[k, token] = 5.0 if second else 6.0
            rows[k, (token + 1) % 60] = 6.0 if second else 5.0
        return rows


def _oracle(target, prompt: list[int], seed: int = 0) -> tuple[BranchingOracle, list[int]]:
    plain = autoregressive_generate(target, prompt, 30).output_ids
    return BranchingOracle(prompt + plain, seed), plain


# dense; sliding window + MoE; Gated DeltaNet hybrid; MLA; Gated DeltaNet + MoE (Mamba-2: the tree loop refuses it)
@pytest.mark.parametrize(
    ("family", "rule"), list(zip(["qwen3", "gpt_oss", "hybrid", "deepseek_v3", "qwen3_next"], RULES * 3, strict=False))
)
def test_static_tree_decoding_equals_eager_step_for_step_through_sibling_branches(family, rule):
    target = build_target(family)
    oracle, plain = _oracle(target, PROMPT)
    eager = tree_generate(target, oracle, PROMPT, 30, rule, EAGER)
    oracle, _ = _oracle(target, PROMPT)
    static = tree_generate(target, oracle, PROMPT, 30, rule, STATIC)
    assert static.static and not eager.static
    assert static.output_ids == eager.output_ids == plain, rule
    assert static.acceptance_lengths == eager.acceptance_lengths, rule
    assert static.nodes_per_step == eager.nodes_per_step
    # committed lengths from 1 (nothing accepted) to more than 3 (paths past the second draft)
    assert min(static.acceptance_lengths) == 1 and max(static.acceptance_lengths) > 3, rule


@pytest.fixture(scope="module")
def warmed():
    """A Gated DeltaNet hybrid (attention and recurrent layers both committed) whose tree verify and commit were
    compiled by one generation: (target, that generation)."""
    target = make_target("hybrid")
    oracle, _ = _oracle(target, PROMPT)
    return target, tree_generate(target, oracle, PROMPT, 30, SMALL, COMPILED)


def test_a_compiled_tree_generation_after_warm_up_compiles_nothing_and_breaks_no_graph(warmed):
    target, warm = warmed
    assert (warm.compiles, warm.draft_compiles, warm.recompiles, warm.graph_breaks) == (2, 0, 0, 0)  # verify, commit
    assert warm.compile_seconds > 0
    verifier = static_tree_verifier(target, SMALL.budget + 1, SMALL.budget, len(PROMPT) + 30, "eager")
    buffers = [verifier.cache.position, verifier.cache.tree.parents, verifier.cache.write_positions]
    buffers += [layer.keys for layer in verifier.cache.layers if layer is not None]
    buffers += [slots.states for slots in verifier.cache.recurrent.values()]
    addresses = [buffer.data_ptr() for buffer in buffers]
    for seed, prompt in enumerate((PROMPT[::-1] + [33], PROMPT[3:])):  # other prompt lengths, trees, paths
        oracle, plain = _oracle(target, prompt, seed + 1)
        with torch.compiler.set_stance("fail_on_recompile"):
            run = tree_generate(target, oracle, prompt, 30, SMALL, COMPILED)
        assert run.output_ids == plain and run.acceptance_lengths != warm.acceptance_lengths
        assert len(set(run.acceptance_lengths)) > 2
        assert (run.compiles, run.recompiles, run.graph_breaks, run.compile_seconds) == (0, 0, 0, 0.0)
        assert run.host_transfers == 2 * len(run.acceptance_lengths)  # the ranked tokens, the argmax: as eagerly
    assert [buffer.data_ptr() for buffer in buffers] == addresses


def test_compile_on_a_tree_target_without_a_static_rule_is_refused_in_one_line():
    target = make_target("qwen3")
    oracle, _ = _oracle(target, PROMPT)
    with pytest.raises(FlashdraftError, match="compile backend 'cudagraphs'"):
        tree_generate(
            target, oracle, PROMPT, 4, RULES[0], SpeculativeConfig(compile=True, compile_backend="cudagraphs")
        )
    target.vision = object()  # M-RoPE positions after an image: no static rule
    with pytest.raises(FlashdraftError, match="--compile refused: a vision-language target"):
        tree_generate(target, oracle, PROMPT, 4, RULES[0], COMPILED)


@pytest.mark.parametrize("family", ["hybrid", "gpt_oss"])  # Gated DeltaNet + attention; sliding window + attention
def test_the_commit_keeps_the_accepted_paths_states_as_a_forward_over_the_path_alone(family):
    """A tree whose path (root, the greedy token, the next) runs through a sibling and leaves branches beside it:
    after the commit the recurrent slot, its conv inputs and the K/V rows are those of a forward over the prompt and
    the path alone."""
    target = build_target(family)
    anchor, first, second, _ = autoregressive_generate(target, PROMPT, 4).output_ids
    wrong = [(t + 1) % 60 for t in (first, second)]
    # nodes: 1 a wrong first token, 2 the right one, 3 the right second after 2, 4 a wrong third, 5 a wrong second
    tree = DraftTree([wrong[0], first, second, wrong[1], wrong[1]], [-1, 0, 0, 2, 3, 2], [0, 1, 1, 2, 3, 2])
    verifier = StaticTreeVerifier(target, 8, capacity_for(64), None, max_depth=4)  # two padding nodes
    eager = target.new_cache()
    target.forward(torch.tensor([PROMPT]), eager)
    verifier.start(eager, len(PROMPT))
    verdict = verifier.verify_tree(tree_on_device(tree, [anchor, *tree.tokens], torch.device("cpu"), 8))
    assert int(verdict.length) == 3 and verdict.order[:3].tolist() == [0, 2, 3]
    verifier.commit_tree(verdict)
    reference = target.new_cache()
    target.forward(torch.tensor([PROMPT + [anchor, first, second]]), reference)
    end = len(PROMPT) + 3
    assert int(verifier.cache.position) == end and int(verifier.cache.slot) == 2
    for i, layer in enumerate(reference.kv.layers):
        if i in verifier.cache.recurrent:
            slots = verifier.cache.recurrent[i]
            torch.testing.assert_close(slots.states[2], layer.recurrent_states[0], atol=1e-4, rtol=1e-4)
            before, _ = slots.start(verifier.cache.slot, target.linear_mixers[i].conv_kernel_size)
            torch.testing.assert_close(before, layer.conv_states[0], atol=1e-5, rtol=1e-5)
        else:  # a sliding layer's eager cache keeps its last keys only: compare those
            kept = layer.keys.shape[-2]
            torch.testing.assert_close(verifier.cache.layers[i].keys[:, :, end - kept : end], layer.keys)
            torch.testing.assert_close(verifier.cache.layers[i].values[:, :, end - kept : end], layer.values)
