import math
import os
import random
import sys
import time

import pytest
import torch

from flashdraft.decoding.generate import SpeculativeConfig, autoregressive_generate, speculative_generate
from flashdraft.decoding.host_transfers import TRANSFERS
from flashdraft.decoding.proposers import DraftLimit
from flashdraft.decoding.serving_rules import (
    NO_FILTERS,
    RULES,
    SamplingFilters,
    SamplingParams,
    filters_for,
    target_probs,
)
from tests.conftest import EOS, make_dflash2_drafter, make_drafter, make_dspark_drafter, make_flat_target, make_target

PROMPT = [5, 9, 17, 3, 22, 40, 11, 8, 30, 2, 14, 27]


class OracleProposer:
    """Drafts the target's known greedy continuation, wrong from a random position on, so
    steps accept every length from 0 to B - 1 and rollback is exercised."""

    context_layer_ids: list[int] = [1]

    def __init__(self, reference: list[int], seed: int = 0) -> None:
        self.reference, self.rng = reference, random.Random(seed)

    def propose(self, tokens, anchor_pos, new_context, new_positions, block):
        assert new_context.shape[1] == new_positions.shape[1] and int(new_positions[0, -1]) == anchor_pos - 1
        truth = self.reference[len(tokens) : len(tokens) + block - 1]
        truth += [0] * (block - 1 - len(truth))
        wrong_from = self.rng.randrange(block)
        draft = [t if k < wrong_from else (t + 1) % 60 for k, t in enumerate(truth)]
        return torch.nn.functional.one_hot(torch.tensor(draft), 64).float() * 100


@pytest.mark.parametrize("mode", ["recompute", "deferred"])
@pytest.mark.parametrize("block", [2, 8, 16])
def test_greedy_speculative_equals_greedy_with_partial_acceptance(any_target, block, mode):
    any_target.rollback_mode = mode
    plain = autoregressive_generate(any_target, PROMPT, 40)
    spec = speculative_generate(
        any_target,
        OracleProposer(PROMPT + plain.output_ids),
        PROMPT,
        40,
        speculative=SpeculativeConfig(block_size=block),
    )
    assert spec.output_ids == plain.output_ids
    assert sum(spec.acceptance_lengths) == len(spec.output_ids) - 1
    assert max(spec.acceptance_lengths) > 1 and min(spec.acceptance_lengths) == 1
    assert max(spec.acceptance_lengths) <= block


@pytest.mark.parametrize("block", [2, 8, 16])
def test_greedy_speculative_with_dflash_drafter_and_short_sliding_window(any_target, block):
    # a window of 3 is shorter than the 12-token prompt: the drafter must honour it in its cache
    drafter = make_drafter(block_size=block, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    plain = autoregressive_generate(any_target, PROMPT, 30)
    spec = speculative_generate(any_target, drafter, PROMPT, 30)
    assert spec.output_ids == plain.output_ids
    assert len(spec.acceptance_lengths) >= 1


def test_stop_token_ends_both_decoders_at_the_same_place():
    target = make_target("hybrid")
    plain = autoregressive_generate(target, PROMPT, 40)
    stop = plain.output_ids[17]
    target.model.generation_config.eos_token_id = stop  # make a token we know appears a stop token
    plain = autoregressive_generate(target, PROMPT, 40)
    spec = speculative_generate(
        target, OracleProposer(PROMPT + plain.output_ids), PROMPT, 40, speculative=SpeculativeConfig(block_size=8)
    )
    assert plain.stop_reason == spec.stop_reason == "eos"
    assert spec.output_ids == plain.output_ids and spec.output_ids[-1] == stop
    assert EOS != stop


def test_max_new_tokens_is_respected_inside_a_block():
    target = make_target("qwen3")
    plain = autoregressive_generate(target, PROMPT, 13)
    spec = speculative_generate(
        target,
        OracleProposer(PROMPT + plain.output_ids + [0] * 20),
        PROMPT,
        13,
        speculative=SpeculativeConfig(block_size=16),
    )
    assert len(spec.output_ids) == 13 and spec.output_ids == plain.output_ids


@pytest.mark.parametrize("rule", ["vllm", "vllm-probabilistic"])
@pytest.mark.parametrize("limit", [None, DraftLimit(num_speculative_tokens=2, adaptive_threshold=0.1)], ids=str)
def test_speculative_sampling_matches_target_distribution_end_to_end(limit, rule):
    # second generated token (the first one a speculative step produces) vs its exact law; with
    # a limit the drafts are cut by the drafter's own confidence, which must not bias the law
    target = make_flat_target("hybrid")
    model = target.model
    drafter = make_drafter(block_size=4)
    prompt = PROMPT[:6]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        law = torch.zeros(64)
        for t1 in range(64):
            law += p1[t1] * torch.softmax(model(torch.tensor([prompt + [t1]])).logits[0, -1], -1)
    gen = torch.Generator().manual_seed(0)
    n = 600
    counts = torch.zeros(64)
    for _ in range(n):
        out = speculative_generate(
            target,
            drafter,
            prompt,
            2,
            sampling=SamplingParams(temperature=1.0),
            speculative=SpeculativeConfig(limit=limit, rule=rule),
            generator=gen,
        ).output_ids
        counts[out[1]] += 1
    # chi-square over the 8 likeliest second tokens plus "other"
    top = torch.topk(law, 8).indices
    observed = torch.cat([counts[top], (n - counts[top].sum()).unsqueeze(0)])
    expected = torch.cat([law[top], (1 - law[top].sum()).unsqueeze(0)]) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # 8 degrees of freedom, p = 0.001; power 0.9 at Cohen's w 0.23 with 600 draws (_assert_the_third_token_...)
    assert chi2 < 26.1, (observed, expected)
    assert math.isclose(float(law.sum()), 1.0, rel_tol=1e-4)


class SlowProposer(OracleProposer):
    """An oracle that takes 10 ms to draft."""

    def propose(self, tokens, anchor_pos, new_context, new_positions, block):
        time.sleep(0.01)
        return super().propose(tokens, anchor_pos, new_context, new_positions, block)


def test_drafting_and_verification_are_timed_apart_inside_the_loop():
    target = make_target("hybrid")
    plain = autoregressive_generate(target, PROMPT, 30)
    start = time.perf_counter()
    spec = speculative_generate(
        target, SlowProposer(PROMPT + plain.output_ids), PROMPT, 30, speculative=SpeculativeConfig(block_size=4)
    )
    wall = time.perf_counter() - start
    steps = len(spec.acceptance_lengths)
    assert spec.output_ids == plain.output_ids
    assert spec.draft_seconds >= 0.01 * steps and spec.verify_seconds > 0
    assert spec.draft_seconds + spec.verify_seconds <= wall


@pytest.mark.parametrize("limit", [None, DraftLimit(num_speculative_tokens=2)], ids=str)
def test_greedy_speculative_with_a_dflash2_drafter_equals_greedy(any_target, limit):
    drafter = make_dflash2_drafter(block_size=8)
    plain = autoregressive_generate(any_target, PROMPT, 30)
    spec = speculative_generate(any_target, drafter, PROMPT, 30, speculative=SpeculativeConfig(limit=limit))
    assert spec.output_ids == plain.output_ids
    assert sum(spec.acceptance_lengths) == len(spec.output_ids) - 1


def _assert_the_third_token_keeps_the_target_law(
    target,
    drafter,
    limit: DraftLimit | None = None,
    rule: str = "sglang",
    temperature: float = 1.0,
    filters: SamplingFilters = NO_FILTERS,
    min_accepted_twice: int = 60,
) -> None:
    """Sampled at `temperature` with `filters` from 600 seeds under `rule` (default: one that samples DFlash2's and
    DSpark's walks), the third generated token has the law of plain sampling with those settings (chi2 over its top
    8 and the rest), and the drafter's second draft was verified often enough to matter.

    Power (as the first-token test above): 600 draws, chi2 at p = 0.001 over 8 degrees of freedom, fail 9 times in
    10 at a noncentrality of 33, Cohen's w 0.23: about 5 % of the mass moved between two tokens of 10 % each. The
    laws a wrong verification gives differ from the target's by more; fewer draws would miss a shift of that size."""
    model = target.model
    prompt = PROMPT[:5]
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1], temperature, filters)  # [64]
        two = torch.tensor([prompt + [t] for t in range(64)])
        p2 = target_probs(model(two).logits[:, -1], temperature, filters)  # [64 (t1), 64 (t2)]
        three = torch.tensor([prompt + [t1, t2] for t1 in range(64) for t2 in range(64)])
        p3 = target_probs(model(three).logits[:, -1], temperature, filters).view(64, 64, 64)
        law = torch.einsum("a,ab,abc->c", p1, p2, p3)
    gen = torch.Generator().manual_seed(0)
    n, counts, accepted_twice = 600, torch.zeros(64), 0
    for _ in range(n):
        out = speculative_generate(
            target,
            drafter,
            prompt,
            3,
            sampling=SamplingParams(temperature=temperature, filters=filters),
            speculative=SpeculativeConfig(limit=limit, rule=rule),
            generator=gen,
        )
        counts[out.output_ids[2]] += 1
        accepted_twice += out.acceptance_lengths[0] >= 2
    assert accepted_twice > min_accepted_twice  # the walk's second draft was verified often enough to matter
    top = torch.topk(law, 8).indices
    observed = torch.cat([counts[top], (n - counts[top].sum()).unsqueeze(0)])
    expected = torch.cat([law[top], (1 - law[top].sum()).unsqueeze(0)]) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 26.1, (observed, expected)  # 8 degrees of freedom, p = 0.001


def test_dflash2_sampling_keeps_the_target_law_of_a_token_drafted_after_a_sampled_predecessor():
    # the third generated token: with block 4 and the first draft accepted it is the walk's second draft,
    # drawn from the selector's q given the sampled first draft; its law must be the target's exactly
    target = make_flat_target("qwen3")
    drafter = make_dflash2_drafter(block_size=4, selector_top_k=16)  # q is zero on 48 of the 64 tokens
    with torch.no_grad():  # pair scores near the flat target's scale, so drafts are accepted often
        drafter.candidate_selector.hidden_projection.weight.mul_(0.3)
    _assert_the_third_token_keeps_the_target_law(target, drafter)


@pytest.mark.parametrize("limit", [None, DraftLimit(confidence_threshold=0.5)], ids=str)
def test_greedy_speculative_with_a_dspark_drafter_equals_greedy(any_target, limit):
    drafter = make_dspark_drafter()
    plain = autoregressive_generate(any_target, PROMPT, 30)
    spec = speculative_generate(any_target, drafter, PROMPT, 30, speculative=SpeculativeConfig(limit=limit))
    assert spec.output_ids == plain.output_ids
    assert sum(spec.acceptance_lengths) == len(spec.output_ids) - 1


@pytest.mark.parametrize("limit", [None, DraftLimit(confidence_threshold=0.5)], ids=["uncut", "confidence-cut"])
def test_dspark_sampling_keeps_the_target_law_of_a_token_drafted_after_a_sampled_predecessor(limit):
    # the third generated token: with the first draft accepted it is the Markov walk's second draft, drawn from
    # q given the sampled first draft (and, cut, verified only when the sampled walk's confidence allows)
    target = make_flat_target("qwen3")
    drafter = make_dspark_drafter(block_size=3)
    with torch.no_grad():  # a Markov bias near the flat target's scale, so drafts are accepted often
        drafter.markov_head.markov_w2.weight.mul_(0.5)
    _assert_the_third_token_keeps_the_target_law(target, drafter, limit)


def _deepspec_reference_loop(target, drafter, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """DeepSpec's evaluator (`deepspec/eval/dspark/evaluator.py`, `draft_ops.build_dspark_proposal`) as a plain
    loop, everything recomputed each step (no caches): the block [anchor, mask x (B - 1)] at positions anchor..,
    context = the target's features of every token before the anchor; the drafts sampled left to right from
    lm_head(h_k) + W2 W1[previous] (the anchor first); the target verifies [anchor, drafts] greedily."""
    cfg = drafter.config
    target.set_context_layers(cfg.target_layer_ids)
    with torch.no_grad():
        out = [int(target.forward(torch.tensor([prompt])).logits[0, -1].argmax())]
        lengths = []
        while len(out) < max_new_tokens:
            tokens = prompt + out
            anchor = len(tokens) - 1
            features = target.forward(torch.tensor([tokens[:-1]])).context_features  # [1, anchor, n * H]
            block = torch.full((1, cfg.block_size), cfg.mask_token_id)
            block[0, 0] = tokens[-1]
            hidden = drafter(target.embed(block), torch.tensor([[anchor]]), features, torch.arange(anchor)[None])
            base = target.lm_head(hidden[0])  # [B, V]: every position drafts (anchor-first)
            drafts, previous = [], tokens[-1]
            for k in range(cfg.block_size):
                previous = int((base[k] + drafter.markov_head.bias(torch.tensor(previous))).argmax())
                drafts.append(previous)
            verify = target.forward(torch.tensor([tokens + drafts])).logits[0, anchor:].argmax(-1).tolist()
            a = 0
            while a < len(drafts) and drafts[a] == verify[a]:
                a += 1
            committed = (drafts[:a] + [verify[a]])[: max_new_tokens - len(out)]
            out += committed
            lengths.append(len(committed))
    return out, lengths


def test_dspark_decoding_equals_deepspecs_evaluator_loop_step_for_step(any_target):
    from tests.evaluation.test_run import greedy_records, overfit

    record = greedy_records(any_target, 30)[0]
    drafter = overfit(make_dspark_drafter(), any_target, record)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.mul_(0.3)  # a bias that moves some drafts, not all
    reference, lengths = _deepspec_reference_loop(any_target, drafter, record.prompt_ids, 30)
    spec = speculative_generate(any_target, drafter, record.prompt_ids, 30)
    assert spec.output_ids == reference and spec.acceptance_lengths == lengths
    assert max(lengths) > 2  # drafts past the first were accepted: the walk was exercised


@pytest.mark.parametrize("rule", ["vllm", "vllm-probabilistic", "sglang"])
def test_sampling_with_top_k_top_p_and_min_p_keeps_the_law_of_plain_sampling_under_every_rule(rule):
    # the third token at T = 0.8 with top-k, top-p and (the vLLM rules) min-p: a DSpark drafter's Markov walk is
    # sampled (vllm-probabilistic, sglang) or the argmax walk with q one-hot (vllm); its law must be plain sampling's
    target = make_flat_target("qwen3")
    drafter = make_dspark_drafter(block_size=3)
    with torch.no_grad():  # a Markov bias near the flat target's scale, so drafts are accepted often
        drafter.markov_head.markov_w2.weight.mul_(0.5)
    filters = filters_for(SamplingFilters(top_k=24, top_p=0.9, min_p=0.05), RULES[rule])
    # an argmax draft is accepted with p(d) alone, rarely twice on this flat target (the one-hot rule's law is also
    # tested on its own: test_serving_rules, test_acceptance)
    twice = 3 if rule == "vllm" else 30
    _assert_the_third_token_keeps_the_target_law(
        target, drafter, rule=rule, temperature=0.6, filters=filters, min_accepted_twice=twice
    )


TENSOR_READS = ("tolist", "item", "__bool__", "__int__", "__index__", "__float__")  # a tensor's value to the host


def _raw_reads(monkeypatch, run, copies: list | None = None) -> tuple[object, int, int]:
    """run()'s result, the reads of a tensor's value in Python it made (counted or not) and those the counter saw;
    `copies` collects the files of flashdraft's calls of torch.tensor (a copy from the host: on CUDA it waits too)."""
    reads = []
    for name in TENSOR_READS:
        raw = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _raw=raw, **k: reads.append(1) or _raw(self, *a, **k))
    if copies is not None:
        raw_tensor = torch.tensor

        def tensor(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if f"flashdraft{os.sep}" in caller:
                copies.append(caller)
            return raw_tensor(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)
    before = TRANSFERS.reads
    try:
        result = run()
    finally:
        monkeypatch.undo()
    return result, len(reads), TRANSFERS.reads - before


@pytest.mark.parametrize("kind", ["hybrid", "qwen3"])
def test_a_greedy_step_reads_the_device_once_and_the_counter_sees_every_read(kind, monkeypatch):
    target, drafter = make_target(kind), make_drafter(block_size=8)
    plain = autoregressive_generate(target, PROMPT, 30)
    speculative_generate(target, drafter, PROMPT, 4)  # warm-up: nothing below depends on first-call work
    for config in (SpeculativeConfig(), SpeculativeConfig(time_phases=False)):
        copies = []
        spec, raw, counted = _raw_reads(
            monkeypatch, lambda c=config: speculative_generate(target, drafter, PROMPT, 30, speculative=c), copies
        )
        steps = len(spec.acceptance_lengths)
        assert spec.output_ids == plain.output_ids and steps > 5
        assert spec.host_transfers == steps  # one per step, the prefill's first token not counted
        assert raw == counted == steps + 1  # nothing read past the counter: + the prefill's
        assert [os.path.basename(f) for f in copies] == ["generate.py"]  # the prompt; no copy from the host per step


@pytest.mark.parametrize(
    "setting",
    [
        {"sampling": SamplingParams(temperature=1.0)},
        {"speculative": SpeculativeConfig(limit=DraftLimit(num_speculative_tokens=3, adaptive_threshold=0.01))},
    ],
    ids=["sampled", "adaptive-limit"],
)
def test_sampled_and_limited_steps_read_more_and_the_counter_sees_every_read(setting, monkeypatch):
    target, drafter = make_target("hybrid"), make_drafter(block_size=8)
    spec, raw, counted = _raw_reads(
        monkeypatch,
        lambda: speculative_generate(
            target, drafter, PROMPT, 20, generator=torch.Generator().manual_seed(0), **setting
        ),
    )
    assert raw == counted == spec.host_transfers + 1 and spec.host_transfers > len(spec.acceptance_lengths)


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_plain_decoding_on_the_static_cache_equals_eager_greedy_and_seed_for_seed(kind):
    from functools import partial

    from flashdraft.decoding.generate import static_autoregressive_generate

    target = make_target(kind)
    eager = autoregressive_generate(target, PROMPT, 20)
    static = static_autoregressive_generate(target, PROMPT, 20, backend=None)
    assert static.output_ids == eager.output_ids and static.static and len(static.step_seconds) == 19
    flat = make_flat_target(kind)
    sampling = SamplingParams(temperature=1.0)
    runs = [
        decode(flat, PROMPT, 20, sampling, torch.Generator().manual_seed(5))
        for decode in (autoregressive_generate, partial(static_autoregressive_generate, backend=None))
    ]
    assert runs[0].output_ids == runs[1].output_ids
