import json

import pytest
import torch

from flashdraft.decoding.generate import SpeculativeConfig, speculative_generate
from flashdraft.decoding.hybrid import HybridDrafter, HybridProposer, HybridRule
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.decoding.proposers import DFlashProposer, as_proposer
from flashdraft.decoding.serving_rules import SamplingParams
from flashdraft.drafter.checkpoint import save_drafter
from flashdraft.evaluation.offline import offline_acceptance_lengths
from tests.conftest import (
    make_dflash2_drafter,
    make_drafter,
    make_dspark_drafter,
    make_flat_target,
    make_target,
    run_cli,
)
from tests.decoding.test_ngram import PROMPTS, greedy_records
from tests.evaluation.test_run import overfit

ALWAYS_NGRAM = HybridRule(min_match=0, ngram_prior=0.0)
NEVER_NGRAM = HybridRule(min_match=4, ngram_prior=0.0)  # the lookup matches at most 3 tokens
RULES = [ALWAYS_NGRAM, NEVER_NGRAM, HybridRule(1, 0.0), HybridRule(2, 0.5), HybridRule(4, 0.3), HybridRule(3, 1.0)]


@pytest.fixture(scope="module", params=["qwen3", "hybrid"])
def setup(request):
    """A target, its greedy records, and a drafter fitted to the first one: it accepts there and
    prompt lookup accepts on the repeating second prompt, so the rules have real choices."""
    target = make_target(request.param)
    records = greedy_records(target, 40)
    drafter = overfit(make_drafter(), target, records[0])
    return target, records, drafter


def offline(target, hybrid, record):
    target.set_context_layers(hybrid.context_layer_ids)
    features = target.forward(torch.tensor([record.input_ids])).context_features[0]
    return offline_acceptance_lengths(
        as_proposer(hybrid, target), record.prompt_ids, record.completion_ids, hybrid.block_size, features
    )


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_hybrid_is_lossless_and_offline_equals_online_step_for_step(setup, rule):
    target, records, drafter = setup
    hybrid = HybridDrafter(drafter, NGramProposer(target.vocab_size), rule)
    for r in records:
        online = speculative_generate(target, hybrid, r.prompt_ids, len(r.completion_ids))
        assert online.output_ids == r.completion_ids
        assert offline(target, hybrid, r) == online.acceptance_lengths


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
@pytest.mark.parametrize("rule", [NEVER_NGRAM, HybridRule(2, 0.5)], ids=str)
def test_hybrid_with_a_dflash2_or_dspark_drafter_is_lossless_and_offline_equals_online_step_for_step(
    setup, rule, family
):
    target, records, _ = setup
    new_drafter = make_dflash2_drafter if family == "dflash2" else make_dspark_drafter
    hybrid = HybridDrafter(overfit(new_drafter(), target, records[0]), NGramProposer(target.vocab_size), rule)
    for r in records:
        online = speculative_generate(target, hybrid, r.prompt_ids, len(r.completion_ids))
        assert online.output_ids == r.completion_ids
        assert offline(target, hybrid, r) == online.acceptance_lengths


def test_a_hybrid_step_that_proposes_the_dflash2_walk_samples_it_with_its_own_draw(setup):
    target, records, _ = setup
    proposer = HybridDrafter(
        make_dflash2_drafter(block_size=4), NGramProposer(target.vocab_size), NEVER_NGRAM
    ).new_proposer(target)
    prompt = records[0].prompt_ids
    target.set_context_layers(proposer.context_layer_ids)
    features = target.forward(torch.tensor([prompt])).context_features
    with torch.no_grad():
        rows = proposer.propose(prompt, len(prompt), features, torch.arange(len(prompt))[None], 4)
        drafts, q = proposer.draw(rows, 1.0, torch.Generator().manual_seed(0))
        expected = proposer.dflash.draw(rows, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(drafts, expected[0]) and torch.equal(q, expected[1])


def test_always_and_never_ngram_reproduce_ngram_and_dflash_exactly(setup):
    target, records, drafter = setup
    ngram = NGramProposer(target.vocab_size)
    for r in records:
        for rule, alone in ((ALWAYS_NGRAM, ngram), (NEVER_NGRAM, drafter)):
            hybrid = HybridDrafter(drafter, ngram, rule)
            expected = speculative_generate(
                target, alone, r.prompt_ids, len(r.completion_ids), speculative=SpeculativeConfig(block_size=8)
            )
            got = speculative_generate(target, hybrid, r.prompt_ids, len(r.completion_ids))
            assert got.acceptance_lengths == expected.acceptance_lengths, rule
    # and they differ from each other, so the comparison can fail
    always = speculative_generate(target, HybridDrafter(drafter, ngram, ALWAYS_NGRAM), PROMPTS[0], 40)
    assert always.acceptance_lengths != speculative_generate(target, drafter, PROMPTS[0], 40).acceptance_lengths


class Recording(DFlashProposer):
    """The DFlash proposer, keeping every step's drafts by anchor position."""

    def __init__(self, drafter, target) -> None:
        super().__init__(drafter, target)
        self.logits: dict[int, torch.Tensor] = {}

    def propose(self, tokens, anchor_pos, new_context, new_positions, block):
        self.logits[anchor_pos] = super().propose(tokens, anchor_pos, new_context, new_positions, block)
        return self.logits[anchor_pos]


def test_skipping_the_drafter_forward_keeps_its_context_exact(setup):
    target, records, drafter = setup
    ngram, rule = NGramProposer(target.vocab_size), HybridRule(1, 0.5)
    compared = skipped = 0
    for r in records:
        runs = {}
        for skip in (True, False):
            proposer = HybridProposer(Recording(drafter, target), ngram, rule, skip_drafter=skip)
            out = speculative_generate(target, proposer, r.prompt_ids, len(r.completion_ids))
            runs[skip] = (out.acceptance_lengths, proposer)
        (skipping_lengths, skipping), (full_lengths, full) = runs[True], runs[False]
        assert skipping_lengths == full_lengths and skipping.choices == full.choices
        for anchor_pos, logits in skipping.dflash.logits.items():  # the forwards it ran, after context it kept
            torch.testing.assert_close(logits, full.dflash.logits[anchor_pos], rtol=1e-4, atol=1e-4)
        compared += len(skipping.dflash.logits)
        skipped += len(full.dflash.logits) - len(skipping.dflash.logits)
    assert compared > 0 and skipped > 0  # both paths ran


def test_hybrid_sampling_keeps_the_target_distribution():
    # the second generated token (the first one a speculative step makes) against its exact law;
    # a repeating prompt makes the rule take the n-gram on the first step, a plain one the drafter
    target = make_flat_target("qwen3")
    model = target.model
    hybrid = HybridDrafter(make_drafter(block_size=4), NGramProposer(target.vocab_size), HybridRule(2, 0.5))
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], PROMPTS[0][:6]):
        with torch.no_grad():
            p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
            law = sum(p1[t] * torch.softmax(model(torch.tensor([prompt + [t]])).logits[0, -1], -1) for t in range(64))
        gen = torch.Generator().manual_seed(0)
        n = 600
        counts = torch.zeros(64)
        for _ in range(n):
            counts[
                speculative_generate(
                    target, hybrid, prompt, 2, sampling=SamplingParams(temperature=1.0), generator=gen
                ).output_ids[1]
            ] += 1
        top = torch.topk(law, 8).indices
        observed = torch.cat([counts[top], (n - counts[top].sum()).unsqueeze(0)])
        expected = torch.cat([law[top], (1 - law[top].sum()).unsqueeze(0)]) * n
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 26.1, (prompt, observed, expected)  # 8 degrees of freedom, p = 0.001


def test_as_proposer_gives_each_sequence_a_fresh_drafter_cache(setup):
    target, records, drafter = setup
    hybrid = HybridDrafter(drafter, NGramProposer(target.vocab_size))
    first, second = as_proposer(hybrid, target), as_proposer(hybrid, target)
    assert isinstance(first, HybridProposer) and first is not second and first.dflash.cache is not second.dflash.cache


# -- the eval command ---------------------------------------------------------------------------


def test_eval_hybrid_checks_consistency_against_a_reference(capsys, tmp_path):
    from tests.conftest import save_target, write_word_prompts

    target_dir = save_target(tmp_path / "target", "qwen3")
    prompts = write_word_prompts(tmp_path / "prompts.jsonl", 3)
    save_drafter(make_drafter(), tmp_path / "d")
    common = [
        "eval",
        "--checkpoint",
        tmp_path / "d",
        "--target-model",
        target_dir,
        "--prompts",
        prompts,
        "--max-new-tokens",
        30,
    ]
    rc, out, err = run_cli(
        capsys,
        *common,
        "--drafter",
        "hybrid",
        "--hybrid-min-match",
        2,
        "--hybrid-ngram-prior",
        0.4,
        "--online",
        "--check-consistency",
        "--reference",
        "ngram",
        "--json",
        tmp_path / "out.json",
    )
    assert rc == 0, err
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["drafter_type"] == "hybrid" and "min_match 2, ngram_prior 0.4" in summary["checkpoint_form"]
    assert summary["lossless"] is True and summary["consistency"]["identical"]
    assert summary["context_layers"] == 2 and summary["block_size"] == 8
    assert summary["reference"]["drafter_type"] == "ngram" and summary["reference"]["block_size"] == 8
    rc, out, err = run_cli(capsys, *common, "--drafter", "hybrid", "--hybrid-ngram-prior", 1.5)
    assert rc == 2 and "--hybrid-ngram-prior 1.5" in err and len(err.strip().splitlines()) == 1
