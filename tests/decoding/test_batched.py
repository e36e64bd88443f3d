"""Batched decoding with the target alone: equal to one-prompt decoding, row for row."""

import pytest
import torch

from flashdraft.data.completions import record_seed
from flashdraft.decoding.batched import CompiledBatch, generate_batch, static_batch_step
from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.decoding.serving_rules import SamplingFilters, SamplingParams
from flashdraft.errors import FlashdraftError
from tests.conftest import make_flat_target, make_target
from tests.target.tiny_families import make_family_target

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12], [20, 21]]  # different lengths: left padding in a batch
SAMPLED = SamplingParams(temperature=1.5)


@pytest.mark.parametrize("kind", ["qwen3", "hybrid", "llama"])
def test_batched_greedy_equals_greedy_generate(kind):
    target = make_target(kind)
    batched = generate_batch(target, PROMPTS, max_new_tokens=10)
    for prompt, (ids, reason) in zip(PROMPTS, batched, strict=True):
        plain = autoregressive_generate(target, prompt, 10)
        assert ids == plain.output_ids and reason == plain.stop_reason


@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h", "deepseek_v3"])
def test_batched_greedy_equals_greedy_generate_on_recurrent_and_latent_cache_families(model_type):
    """Left padding must not leak into Gated DeltaNet's or Mamba-2's states (their conv bias included)."""
    from tests.target.tiny_families import make_family_target

    target = make_family_target(model_type)
    batched = generate_batch(target, PROMPTS, max_new_tokens=10)
    assert [ids for ids, _ in batched] == [autoregressive_generate(target, p, 10).output_ids for p in PROMPTS]


def test_batch_stops_each_row_at_its_stop_token_and_keeps_it():
    target = make_target("qwen3")
    # make a token that some rows generate and others do not the stop token
    outputs = [set(autoregressive_generate(target, p, 12).output_ids) for p in PROMPTS]
    stop = next(t for t in sorted(set.union(*outputs)) if any(t not in o for o in outputs))
    target.model.generation_config.eos_token_id = stop
    plain = [autoregressive_generate(target, p, 12) for p in PROMPTS]
    assert any(r.stop_reason == "eos" for r in plain) and any(r.stop_reason == "length" for r in plain)
    batched = generate_batch(target, PROMPTS, max_new_tokens=12)
    assert [(r.output_ids, r.stop_reason) for r in plain] == [(ids, reason) for ids, reason in batched]
    assert all(ids[-1] == stop for ids, reason in batched if reason == "eos")


def test_sampling_is_per_record_seeded_so_batching_does_not_change_it():
    target = make_target("hybrid")
    gens = lambda seed: [torch.Generator().manual_seed(record_seed(seed, f"r{i}")) for i in range(len(PROMPTS))]  # noqa: E731
    together = generate_batch(target, PROMPTS, 8, SAMPLED, generators=gens(0))
    alone = [generate_batch(target, [p], 8, SAMPLED, [g])[0] for p, g in zip(PROMPTS, gens(0), strict=True)]
    assert together == alone
    plain = autoregressive_generate(
        target, PROMPTS[0], 8, sampling=SamplingParams(temperature=1.5), generator=gens(0)[0]
    )
    assert together[0][0] == plain.output_ids
    assert generate_batch(target, PROMPTS, 8, SAMPLED, gens(1)) != together


def test_sampling_with_filters_draws_as_plain_sampling_with_them_and_only_inside_them():
    target = make_target("hybrid")
    gens = lambda: [torch.Generator().manual_seed(record_seed(0, f"r{i}")) for i in range(len(PROMPTS))]  # noqa: E731
    filters = SamplingFilters(top_k=3, top_p=0.9)
    batched = generate_batch(target, PROMPTS, 8, SamplingParams(1.5, filters), gens())
    plain = [
        autoregressive_generate(
            target, p, 8, sampling=SamplingParams(temperature=1.5, filters=filters), generator=g
        ).output_ids
        for p, g in zip(PROMPTS, gens(), strict=True)
    ]
    assert [ids for ids, _ in batched] == plain
    unfiltered = [ids for ids, _ in generate_batch(target, PROMPTS, 8, SAMPLED, gens())]
    assert unfiltered != plain  # the filters drew otherwise
    # top-k 1 keeps only the top token: sampling at any temperature is greedy decoding
    assert generate_batch(target, PROMPTS, 8, SamplingParams(1.5, SamplingFilters(top_k=1)), gens()) == generate_batch(
        target, PROMPTS, 8
    )


# -- on the static cache (`CompiledBatch`, `generate --compile`) -------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3", "hybrid", "gpt_oss", "nemotron_h", "deepseek_v3"])
def test_static_batched_greedy_equals_the_eager_batch_on_every_layer_kind(kind):
    """Dense; Gated DeltaNet; sliding window (8) passed by prompt and tokens; Mamba-2; MLA: the static cache's rows
    left-padded as the eager batch's, the batch filled to a wider width."""
    target = make_target(kind) if kind in ("qwen3", "hybrid") else make_family_target(kind)
    eager = generate_batch(target, PROMPTS, max_new_tokens=12)
    assert generate_batch(target, PROMPTS, 12, compiled=CompiledBatch(width=6, backend=None)) == eager


def test_static_batched_sampling_draws_as_the_eager_batch_seed_for_seed():
    target = make_flat_target("hybrid")  # a flat p: draws far from the argmax
    gens = lambda: [torch.Generator().manual_seed(record_seed(0, f"r{i}")) for i in range(len(PROMPTS))]  # noqa: E731
    sampling = SamplingParams(temperature=1.0)
    eager = generate_batch(target, PROMPTS, 12, sampling, gens())
    static = generate_batch(target, PROMPTS, 12, sampling, gens(), compiled=CompiledBatch(width=4, backend=None))
    assert static == eager and eager != generate_batch(target, PROMPTS, 12)


@pytest.fixture(scope="module")
def compiled_batch():
    """A Gated DeltaNet hybrid (attention and recurrent layers) and its batched step compiled by one call: (target,
    the `CompiledBatch`, that call's output)."""
    target = make_target("hybrid")
    compiled = CompiledBatch(width=4, backend="eager")  # dynamo's guards and graph breaks, without inductor's cost
    return target, compiled, generate_batch(target, PROMPTS, 10, compiled=compiled)


def test_a_compiled_batch_after_warm_up_compiles_nothing_breaks_no_graph_and_keeps_its_buffers(compiled_batch):
    target, compiled, warm = compiled_batch
    assert warm == generate_batch(target, PROMPTS, 10)
    assert (compiled.counts.compiles, compiled.counts.recompiles, compiled.counts.graph_breaks) == (1, 0, 0)
    assert compiled.counts.compile_seconds > 0
    step = static_batch_step(target, 4, 16, "eager")
    buffers = [step.cache.position, step.pads, *[s.states for s in step.cache.recurrent.values()]]
    buffers += [layer.keys for layer in step.cache.layers if layer is not None]
    addresses = [b.data_ptr() for b in buffers]
    others = [[9, 4, 1, 2, 8, 6, 3], [30, 31]]  # fewer rows, other widths and paddings: the same graph
    with torch.compiler.set_stance("fail_on_recompile"):
        out = generate_batch(target, others, 14, compiled=compiled)
    assert out == generate_batch(target, others, 14)
    assert (compiled.counts.compiles, compiled.counts.recompiles, compiled.counts.graph_breaks) == (1, 0, 0)
    assert [b.data_ptr() for b in buffers] == addresses


def test_a_batch_wider_than_the_compiled_width_is_refused(compiled_batch):
    target, compiled, _ = compiled_batch
    with pytest.raises(FlashdraftError, match="a batch of 5 prompts; the compiled batch holds 4"):
        generate_batch(target, [*PROMPTS, [3]], 4, compiled=compiled)


def test_a_batch_step_too_short_is_replaced_by_one_at_least_twice_as_long():
    """`generate` answers its prompts shortest first: the static cache doubles, so a run compiles a few times."""
    target = make_target("qwen3")
    first = static_batch_step(target, 2, 10, None)
    assert first.capacity == 256 and static_batch_step(target, 2, 200, None) is first
    assert static_batch_step(target, 2, 300, None).capacity == 512
    assert static_batch_step(target, 2, 1100, None).capacity == 1280
