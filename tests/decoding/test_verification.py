"""Speculative decoding on the target's static cache (`SpeculativeConfig(compile=True)`) against the eager path: token
for token greedy, seed for seed sampled, for every target family; a whole generation after warm-up compiles nothing
more; the static verify's length fits every proposer."""

from dataclasses import replace

import pytest
import torch

from flashdraft.decoding.generate import SpeculativeConfig, autoregressive_generate, speculative_generate
from flashdraft.decoding.hybrid import HybridDrafter
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.decoding.proposers import DraftLimit, as_proposer
from flashdraft.decoding.serving_rules import SamplingParams
from flashdraft.decoding.verification import max_drafts, resolve_compile
from flashdraft.errors import FlashdraftError
from tests.conftest import VOCAB, make_drafter, make_dspark_drafter, make_flat_target, make_target
from tests.decoding.test_generate import PROMPT, OracleProposer
from tests.target.tiny_families import make_family_target

STATIC = SpeculativeConfig(block_size=6, compile=True, compile_backend=None)  # the static path, uncompiled
EAGER = SpeculativeConfig(block_size=6, compile=False)


def build_target(family: str):
    return make_target(family) if family in ("qwen3", "hybrid") else make_family_target(family)


# the loop over the layer kinds' rules (attention, Gated DeltaNet, sliding window, Mamba-2, MLA); every family's verify
# equals eager's at every accepted length, compiled, in tests/target/test_static_cache.py
@pytest.mark.parametrize("family", ["qwen3", "hybrid", "gpt_oss", "nemotron_h", "deepseek_v3"])
def test_greedy_static_decoding_equals_eager_token_for_token_at_every_accepted_length(family):
    target = build_target(family)
    plain = autoregressive_generate(target, PROMPT, 24)
    eager = speculative_generate(target, OracleProposer(PROMPT + plain.output_ids), PROMPT, 24, speculative=EAGER)
    static = speculative_generate(target, OracleProposer(PROMPT + plain.output_ids), PROMPT, 24, speculative=STATIC)
    assert static.static and not eager.static
    assert static.output_ids == eager.output_ids == plain.output_ids
    assert static.acceptance_lengths == eager.acceptance_lengths
    assert min(static.acceptance_lengths) == 1 and max(static.acceptance_lengths) > 2


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_sampled_static_decoding_equals_eager_seed_for_seed(kind):
    target = make_flat_target(kind)
    drafter = make_drafter(block_size=6)
    sampling = SamplingParams(temperature=1.0)
    runs = [
        speculative_generate(
            target, drafter, PROMPT, 20, sampling, speculative, generator=torch.Generator().manual_seed(11)
        )
        for speculative in (EAGER, STATIC)
    ]
    assert runs[1].output_ids == runs[0].output_ids
    assert runs[1].acceptance_lengths == runs[0].acceptance_lengths


def test_a_compiled_generation_after_warm_up_compiles_nothing_and_breaks_no_graph():
    target = make_target("qwen3")
    compiled = SpeculativeConfig(block_size=6, compile=True, compile_backend="eager")
    plain = autoregressive_generate(target, PROMPT, 24)
    warm = speculative_generate(target, OracleProposer(PROMPT + plain.output_ids), PROMPT, 24, speculative=compiled)
    assert (warm.compiles, warm.recompiles, warm.graph_breaks) == (1, 0, 0)
    other = PROMPT[::-1] + [33]  # another prompt length, other accepted lengths: the same graph
    plain = autoregressive_generate(target, other, 24)
    with torch.compiler.set_stance("fail_on_recompile"):
        run = speculative_generate(
            target, OracleProposer(other + plain.output_ids, seed=3), other, 24, speculative=compiled
        )
    assert run.output_ids == plain.output_ids and run.acceptance_lengths != warm.acceptance_lengths
    assert (run.compiles, run.recompiles, run.graph_breaks) == (0, 0, 0)
    assert run.compile_seconds == 0.0 < warm.compile_seconds
    # a DFlash drafter drafts compiled too (`decoding.static_proposer`): its step's graph at warm-up, then none
    drafter = make_drafter(block_size=6)
    warm = speculative_generate(target, drafter, PROMPT, 16, speculative=compiled)
    assert warm.draft_compiles == 1 and warm.compiles == 2  # and a verify of 1 + 5 (the oracle had 1 + 6)
    with torch.compiler.set_stance("fail_on_recompile"):
        run = speculative_generate(target, drafter, other, 16, speculative=compiled)
    eager = speculative_generate(target, drafter, other, 16, speculative=EAGER)
    assert run.output_ids == eager.output_ids and run.acceptance_lengths == eager.acceptance_lengths
    assert (run.compiles, run.draft_compiles, run.graph_breaks) == (0, 0, 0)


def test_the_static_verify_holds_every_proposers_drafts():
    target = make_target("qwen3")
    assert max_drafts(as_proposer(make_drafter(block_size=8), target), 8) == 7  # fill-in: B - 1
    assert max_drafts(as_proposer(make_dspark_drafter(block_size=8), target), 8) == 8  # anchor-first: B
    assert max_drafts(as_proposer(make_drafter(), target, DraftLimit(num_speculative_tokens=3)), 8) == 7
    assert max_drafts(NGramProposer(VOCAB), 8) == 7
    hybrid = HybridDrafter(make_dspark_drafter(block_size=8), NGramProposer(VOCAB))
    assert max_drafts(hybrid.new_proposer(target), 8) == 8
    assert max_drafts(OracleProposer([]), 8) == 8  # unknown: the block


def test_an_unknown_backend_and_a_layer_kind_without_a_static_rule_are_refused_and_the_default_is_eager():
    target = make_target("qwen3")
    assert resolve_compile(None, target) is False and resolve_compile(True, target) is True
    with pytest.raises(FlashdraftError, match="compile backend 'cudagraphs'"):
        speculative_generate(
            target, make_drafter(), PROMPT, 4, speculative=SpeculativeConfig(compile=True, compile_backend="cudagraphs")
        )
    kinds = ("attention", "chunked", "attention", "attention")  # as Llama 4's chunked attention would read
    target.support = replace(target.support, layer_kinds=kinds)
    with pytest.raises(FlashdraftError, match=r"--compile refused: layer kinds \['chunked'\] have no static cache"):
        speculative_generate(target, make_drafter(), PROMPT, 4, speculative=SpeculativeConfig(compile=True))
    assert len(speculative_generate(target, make_drafter(), PROMPT, 4).output_ids) == 4  # eager by default
