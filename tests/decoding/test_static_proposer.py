import pytest
import torch

from flashdraft.decoding.generate import SpeculativeConfig, speculative_generate
from flashdraft.decoding.hybrid import HybridDrafter, HybridRule
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.decoding.proposers import DFlashProposer, DraftLimit, as_proposer
from flashdraft.decoding.serving_rules import SamplingParams
from flashdraft.decoding.static_proposer import (
    CompiledDraft,
    StaticDFlashProposer,
    StepShape,
    draft_counts,
    static_state,
)
from flashdraft.decoding.tree import TreeRule, tree_generate
from flashdraft.errors import FlashdraftError
from tests.conftest import make_dflash2_drafter, make_drafter, make_dspark_drafter, make_flat_target
from tests.decoding.test_ngram import PROMPTS, greedy_records
from tests.evaluation.test_run import overfit

# backend "eager": Dynamo traces the same graphs, with the same guards and graph breaks, as inductor would compile
COMPILED = CompiledDraft(max_length=160, backend="eager")
# float32 on one thread: the compiled pass attends a masked fixed buffer, eager a grown one (a summation order apart)
TOLERANCE = dict(atol=1e-4, rtol=1e-4)
FAMILIES = ["dflash", "dflash2", "dspark"]
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)


@pytest.fixture(scope="module")
def target():
    """One target for the module (a state, and its graphs, is per drafter and target): a flat one, so sampled drafts
    are accepted often too."""
    return make_flat_target("qwen3")


@pytest.fixture(scope="module")
def drafters(target):
    """One drafter per family, shared by the module's tests so their compiled graphs are too (the state is the
    drafter's): DFlash with a sliding layer whose window is shorter than the context, fitted to the first prompt's
    completion so its steps accept long and short drafts."""
    dflash = overfit(make_drafter(**SLIDING), target, greedy_records(target, 40)[0])
    return {"dflash": dflash, "dflash2": make_dflash2_drafter(), "dspark": make_dspark_drafter()}


def _feature_steps(counts: list[int], width: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    position = 0
    for c in counts:
        yield torch.randn(1, c, width, generator=gen), position + torch.arange(c)[None], position + c
        position += c


@pytest.mark.parametrize("family", FAMILIES)
def test_every_accepted_length_at_every_position_compiles_nothing_and_proposes_the_eager_rows(drafters, target, family):
    # a prompt, then steps committing every a + 1 in 1 .. B + 1 three times over (positions ~20 .. ~100), under
    # fail_on_recompile after the first step: the rows (DFlash2 and DSpark: their walks'), the hidden states and
    # DSpark's confidence equal eager's, the argmax drafts exactly; the cache's buffers keep their storage
    drafter = drafters[family]
    block = drafter.config.block_size
    eager, static = DFlashProposer(drafter, target), as_proposer(drafter, target, compiled=COMPILED)
    counts = [14, 1] + [a + 1 for _ in range(3) for a in range(block + 1)]
    width = drafter.fc.in_features
    torch._dynamo.utils.counters["graph_break"].clear()
    with torch.no_grad():
        for i, (features, positions, anchor_pos) in enumerate(_feature_steps(counts, width)):
            tokens = [7 * i % 60]
            if i == 2:
                warmed, pointers = static.compiles, [b.data_ptr() for b in static.state.cache.buffers()]
            with torch.compiler.set_stance("fail_on_recompile" if i >= 2 else "default"):
                got = static.propose(tokens, anchor_pos, features, positions, block)
            expected = eager.propose(tokens, anchor_pos, features, positions, block)
            torch.testing.assert_close(got, expected, **TOLERANCE)
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
            torch.testing.assert_close(static.block_distributions(0), eager.block_distributions(0), **TOLERANCE)
            if family == "dspark":
                torch.testing.assert_close(static.last_confidence, eager.last_confidence, **TOLERANCE)
    assert static.compiles == warmed and [b.data_ptr() for b in static.state.cache.buffers()] == pointers
    assert not torch._dynamo.utils.counters["graph_break"]
    assert static.state.written == sum(counts)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_greedy_generation_drafts_the_eager_tokens(drafters, target, family):
    drafter = drafters[family]
    config = SpeculativeConfig(block_size=drafter.config.block_size)  # a proposer alone does not say its block
    eager = speculative_generate(target, drafter, PROMPTS[0], 40, speculative=config)
    proposer = as_proposer(drafter, target, compiled=COMPILED)
    static = speculative_generate(target, proposer, PROMPTS[0], 40, speculative=config)
    assert static.output_ids == eager.output_ids
    assert static.acceptance_lengths == eager.acceptance_lengths
    if family == "dflash":
        assert max(eager.acceptance_lengths) > 2


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_sampled_generation_draws_the_eager_tokens_seed_for_seed(drafters, target, family):
    # the flat target accepts sampled drafts often; DFlash2 and DSpark sample their walks from the compiled rows
    drafter = drafters[family]
    sampling = SamplingParams(temperature=1.0)
    runs = [
        speculative_generate(
            target,
            d,
            PROMPTS[0],
            30,
            sampling=sampling,
            speculative=SpeculativeConfig(block_size=drafter.config.block_size),
            generator=torch.Generator().manual_seed(3),
        )
        for d in (drafter, as_proposer(drafter, target, compiled=COMPILED))
    ]
    assert runs[1].output_ids == runs[0].output_ids
    assert runs[1].acceptance_lengths == runs[0].acceptance_lengths
    assert max(runs[0].acceptance_lengths) > 1


def test_dspark_with_a_limit_and_a_confidence_cut_verifies_the_eager_drafts(drafters, target):
    drafter = drafters["dspark"]
    limit = DraftLimit(num_speculative_tokens=4, confidence_threshold=0.5)
    config = SpeculativeConfig(block_size=drafter.config.block_size, limit=limit)
    eager = speculative_generate(target, drafter, PROMPTS[0], 30, speculative=config)
    proposer = as_proposer(drafter, target, limit, compiled=COMPILED)
    static = speculative_generate(target, proposer, PROMPTS[0], 30, speculative=config)
    assert static.output_ids == eager.output_ids and static.acceptance_lengths == eager.acceptance_lengths
    assert proposer.inner.state.shape.drafts == 4
    assert draft_counts(proposer).compiles <= proposer.inner.compiles
    assert draft_counts(proposer).recompiles == draft_counts(proposer).graph_breaks == 0
    assert draft_counts(as_proposer(drafter, target, limit)).compiles == 0  # eager


def test_the_ngram_proposer_is_unchanged_and_the_hybrid_drafts_as_eagerly_with_a_compiled_drafter(drafters, target):
    ngram = NGramProposer(target.vocab_size)
    assert as_proposer(ngram, target, compiled=COMPILED) is ngram
    hybrid = HybridDrafter(drafters["dflash"], ngram, HybridRule(2, 0.5))
    for prompt in PROMPTS[:2]:  # the second repeats itself: prompt lookup wins steps, the drafter keeps context
        config = SpeculativeConfig(block_size=hybrid.block_size)
        eager = speculative_generate(target, hybrid, prompt, 30, speculative=config)
        proposer = as_proposer(hybrid, target, compiled=COMPILED)
        assert isinstance(proposer.dflash, StaticDFlashProposer)
        static = speculative_generate(target, proposer, prompt, 30, speculative=config)
        assert static.output_ids == eager.output_ids and static.acceptance_lengths == eager.acceptance_lengths
        assert proposer.choices["dflash"] > 0 and draft_counts(proposer).recompiles == 0


def test_a_sequence_past_the_cache_capacity_or_sharing_its_state_is_refused_in_one_line(drafters, target):
    drafter = drafters["dflash"]
    first, second = (as_proposer(drafter, target, compiled=COMPILED) for _ in range(2))
    features, block = torch.zeros(1, 3, drafter.fc.in_features), drafter.config.block_size
    with torch.no_grad():  # as decoding runs (grad mode is part of what a graph was compiled for)
        first.propose([1], 3, features, torch.arange(3)[None], block)
        second.propose([1], 3, features, torch.arange(3)[None], block)  # takes the state over
        with pytest.raises(FlashdraftError, match="another sequence"):
            first.propose([1], 4, None, torch.zeros(1, 0, dtype=torch.long), block)
        capacity = second.state.capacity
        too_long = torch.zeros(1, capacity, drafter.fc.in_features)
        with pytest.raises(FlashdraftError, match=f"sized for {capacity}"):
            second.propose([1], capacity + 3, too_long, 3 + torch.arange(capacity)[None], block)


def test_a_drafter_with_dynamic_rope_is_refused_in_one_line_naming_it(target):
    drafter = make_drafter(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    proposer = as_proposer(drafter, target, compiled=COMPILED)
    with pytest.raises(FlashdraftError, match="RoPE is 'dynamic'"):
        proposer.propose([1], 3, torch.zeros(1, 3, drafter.fc.in_features), torch.arange(3)[None], 8)


def test_a_compiled_generation_drafts_and_verifies_in_fixed_shapes_and_a_second_one_compiles_nothing(drafters, target):
    # the loop's switch (SpeculativeConfig.compile): the drafter's graphs and the target's static verify together
    drafter = drafters["dflash"]
    eager = speculative_generate(target, drafter, PROMPTS[0], 32)
    compiled = SpeculativeConfig(compile=True, compile_backend="eager")
    warm = speculative_generate(target, drafter, PROMPTS[0], 32, speculative=compiled)
    assert warm.output_ids == eager.output_ids and warm.acceptance_lengths == eager.acceptance_lengths
    assert warm.recompiles == warm.graph_breaks == 0
    with torch.compiler.set_stance("fail_on_recompile"):  # another prompt length, other accepted lengths
        run = speculative_generate(target, drafter, PROMPTS[2], 32, speculative=compiled)
    assert run.output_ids == speculative_generate(target, drafter, PROMPTS[2], 32).output_ids
    assert (run.compiles, run.recompiles, run.graph_breaks) == (0, 0, 0)


def test_the_tree_loop_builds_its_trees_from_the_compiled_drafter_as_from_the_eager_one(drafters, target):
    # DDTree over the DFlash drafter's logits, DFlash2's selector beam over its hidden states and logits
    for drafter, rule in ((drafters["dflash"], TreeRule("ddtree", 10)), (drafters["dflash2"], TreeRule("beam", 8, 2))):
        eager = tree_generate(target, drafter, PROMPTS[0], 24, rule)
        compiled = SpeculativeConfig(compile=True, compile_backend="eager")
        static = tree_generate(target, drafter, PROMPTS[0], 24, rule, compiled)
        assert static.output_ids == eager.output_ids and static.acceptance_lengths == eager.acceptance_lengths
        assert static.nodes_per_step == eager.nodes_per_step and static.recompiles == static.graph_breaks == 0


@pytest.mark.parametrize("threshold", [0.03, 0.05])
def test_an_adaptive_limit_verifies_the_drafts_the_eager_proposer_verifies(drafters, target, threshold):
    # eagerly the LM head stops at the chunk holding the first unsure draft; compiled, every row is computed and the
    # limit counts the same leading confident drafts (the flat target's LM head keeps the drafter's top probabilities
    # low: two thresholds around them)
    drafter = drafters["dflash"]
    config = SpeculativeConfig(block_size=drafter.config.block_size, limit=DraftLimit(adaptive_threshold=threshold))
    eager = speculative_generate(target, drafter, PROMPTS[0], 30, speculative=config)
    proposer = as_proposer(drafter, target, config.limit, compiled=COMPILED)
    static = speculative_generate(target, proposer, PROMPTS[0], 30, speculative=config)
    assert static.output_ids == eager.output_ids and static.acceptance_lengths == eager.acceptance_lengths


def test_the_uncompiled_fixed_shape_path_proposes_the_eager_rows_and_compiles_nothing(drafters, target):
    drafter = drafters["dspark"]
    eager = DFlashProposer(drafter, target)
    static = as_proposer(drafter, target, compiled=CompiledDraft(max_length=64, backend=None))
    with torch.no_grad():
        for i, (features, positions, anchor_pos) in enumerate(_feature_steps([12, 3, 8, 1], drafter.fc.in_features)):
            got = static.propose([i], anchor_pos, features, positions, drafter.config.block_size)
            torch.testing.assert_close(
                got, eager.propose([i], anchor_pos, features, positions, drafter.config.block_size), **TOLERANCE
            )
    assert static.compiles == 0


def test_a_step_without_new_context_and_two_writes_before_a_draft_propose_the_eager_rows(target):
    """The step's graph always writes R rows: all padding when no context came (nothing becomes visible), and
    context staged by an earlier write goes in before a second one."""
    drafter = make_drafter(**SLIDING)
    block, width = drafter.config.block_size, drafter.fc.in_features
    eager = DFlashProposer(drafter, target)
    static = as_proposer(drafter, target, compiled=CompiledDraft(max_length=64, backend=None))
    steps = list(_feature_steps([12, 0, 3, 0], width))
    with torch.no_grad():
        for i, (features, positions, anchor_pos) in enumerate(steps):
            got = static.propose([i], anchor_pos, features, positions, block)
            torch.testing.assert_close(got, eager.propose([i], anchor_pos, features, positions, block), **TOLERANCE)
        # two writes (2 and 3 rows, each within R), then one draft: as the eager proposer given all 5 at once
        (first, first_at, _), (second, second_at, end) = _feature_steps([2, 3], width, seed=1)
        first_at, second_at = first_at + steps[-1][2], second_at + steps[-1][2]
        static.state.write(first, first_at)
        static.state.write(second, second_at)
        hidden, logits, _, _ = static.state.draft(7, int(second_at[0, -1]) + 1)
        expected = eager.propose(
            [7], int(second_at[0, -1]) + 1, torch.cat([first, second], 1), torch.cat([first_at, second_at], 1), block
        )
    torch.testing.assert_close(logits[0], expected, **TOLERANCE)


def test_a_drafter_cast_to_another_dtype_drafts_from_a_state_of_its_own(target):
    drafter = make_drafter()
    settings = CompiledDraft(max_length=64, backend=None)
    shape = StepShape(block=drafter.config.block_size, drafts=4, use_selector=True, honour_draft_top_k=True)
    first = static_state(drafter, target, shape, settings)
    assert static_state(drafter, target, shape, settings) is first
    drafter.to(torch.float64)
    cast = static_state(drafter, target, shape, settings)
    assert cast is not first and cast.dtype == torch.float64 and cast.cache.keys[0].dtype == torch.float64
