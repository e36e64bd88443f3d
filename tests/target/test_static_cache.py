"""The static decoding state (`flashdraft.target.static_cache`) against the eager path, for every target family the
suite builds: compiled once (dynamo's "eager" backend: the same guards and graph breaks as inductor, none of its
cost), a sweep of every accepted length at several positions runs without a recompile, equals the eager forward
and rollback row for row, keeps every buffer at its address, and keeps each recurrent layer's state after every
verified token equal to the recurrence over that many tokens."""

import pytest
import torch

from flashdraft.errors import FlashdraftError
from flashdraft.target.static_cache import StaticVerifier, capacity_for, static_verifier
from tests.conftest import make_target
from tests.target.tiny_families import make_family_target

LENGTH = 5  # the verify: an anchor and 4 drafts, so accepted lengths 0..4
PROMPT = [5, 9, 17, 3, 22, 40, 11, 8, 30, 2, 14]  # longer than gpt-oss's window of 8
# the accepted counts of the sweep: every one, rising then falling, so each is met at several positions
SWEEP = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 2]
# dense (Qwen3), Gated DeltaNet (Qwen3.5), sliding window + MoE (gpt-oss), MoE (Qwen3-MoE), Qwen3-Next,
# Mamba-2 hybrid (Nemotron-H), MLA (DeepSeek-V3)
FAMILIES = ["qwen3", "hybrid", "gpt_oss", "qwen3_moe", "qwen3_next", "nemotron_h", "deepseek_v3"]
# fp32 rounding of two orders of the same sums; the logits are ~10 in size
LOGITS_TOLERANCE = 1e-4


def build_target(family: str):
    target = make_target(family) if family in ("qwen3", "llama", "hybrid") else make_family_target(family)
    target.set_context_layers([0, 2])
    return target


def block_tokens(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, 60, (1, LENGTH), generator=gen)


def buffers(verifier: StaticVerifier) -> list[torch.Tensor]:
    cache = verifier.cache
    kv = [t for layer in cache.layers if layer is not None and layer.is_initialized for t in (layer.keys, layer.values)]
    recurrent = [t for slots in cache.recurrent.values() for t in slots.buffers()]
    return [cache.position, cache.slot, cache.write_positions, *kv, *recurrent]


@pytest.fixture(scope="module", params=FAMILIES)
def compiled(request):
    """A family's target and its verifier compiled with dynamo's eager backend, warmed up by one verify."""
    target = build_target(request.param)
    verifier = static_verifier(target, LENGTH, len(PROMPT) + 64, backend="eager")
    eager = target.new_cache()
    target.forward(torch.tensor([PROMPT]), eager)
    verifier.start(eager, len(PROMPT))
    verifier.verify(block_tokens(-1))  # the warm-up: the one compile
    return request.param, target, verifier


def test_a_sweep_of_every_accepted_length_equals_eager_without_a_recompile_or_a_moved_buffer(compiled):
    family, target, verifier = compiled
    assert verifier.counts.compiles == 1 and verifier.counts.graph_breaks == 0, family
    eager = target.new_cache()
    target.forward(torch.tensor([PROMPT]), eager)
    verifier.start(eager, len(PROMPT))  # the same buffers, seeded again
    reference = target.new_cache()
    target.forward(torch.tensor([PROMPT]), reference)
    addresses = [t.data_ptr() for t in buffers(verifier)]
    with torch.compiler.set_stance("fail_on_recompile"):
        for step, accepted in enumerate(SWEEP):
            tokens = block_tokens(step)
            static = verifier.verify(tokens)
            expected = target.forward(tokens, reference)
            assert torch.allclose(static.logits, expected.logits, atol=LOGITS_TOLERANCE), (family, step)
            assert torch.allclose(static.context_features, expected.context_features, atol=1e-5), (family, step)
            verifier.commit(accepted)
            target.rollback(reference, accepted + 1)
    assert int(verifier.cache.position) == reference.length == len(PROMPT) + sum(a + 1 for a in SWEEP)
    assert [t.data_ptr() for t in buffers(verifier)] == addresses
    assert verifier.counts.compiles == 1 and verifier.counts.recompiles == 0 and verifier.counts.graph_breaks == 0


@pytest.mark.parametrize("family", ["hybrid", "qwen3_next", "nemotron_h"])
def test_each_kept_recurrent_state_equals_the_recurrence_over_that_many_tokens(family):
    target = build_target(family)
    verifier = StaticVerifier(target, LENGTH, capacity_for(64), backend=None)
    eager = target.new_cache()
    target.forward(torch.tensor([PROMPT]), eager)
    verifier.start(eager, len(PROMPT))
    verifier.commit(0)  # slot 0 after seeding: the prompt's states
    verifier.cache.position.fill_(len(PROMPT))
    tokens = block_tokens(7)
    verifier.verify(tokens)
    for kept in range(1, LENGTH + 1):
        reference = target.new_cache()
        target.forward(torch.tensor([PROMPT + tokens[0, :kept].tolist()]), reference)  # the prompt and kept tokens
        for i, slots in verifier.cache.recurrent.items():
            expected = reference.kv.layers[i].recurrent_states[0]
            # the conv inputs and state the next verify would start from after keeping `kept` tokens
            before, state = slots.start(torch.tensor(kept - 1), target.linear_mixers[i].conv_kernel_size)
            assert torch.allclose(state, expected.float(), atol=1e-4), (family, i, kept)
            assert torch.allclose(before, reference.kv.layers[i].conv_states[0], atol=1e-5), (family, i, kept)


def test_a_verify_of_the_wrong_length_and_a_prompt_past_the_capacity_are_refused():
    target = build_target("qwen3")
    verifier = StaticVerifier(target, LENGTH, capacity_for(16), backend=None)
    with pytest.raises(ValueError, match="expected \\(1, 5\\)"):
        verifier.verify(torch.zeros(1, 3, dtype=torch.long))
    eager = target.new_cache()
    target.forward(torch.zeros(1, verifier.capacity - 2, dtype=torch.long), eager)
    with pytest.raises(FlashdraftError, match="do not fit"):
        verifier.start(eager, verifier.capacity - 2)


def test_a_verifier_is_kept_on_the_target_and_replaced_only_when_a_generation_does_not_fit():
    target = build_target("qwen3")
    first = static_verifier(target, LENGTH, 100, backend=None)
    assert static_verifier(target, LENGTH, 200, backend=None) is first  # 256 positions hold both
    larger = static_verifier(target, LENGTH, 300, backend=None)
    assert larger is not first and larger.capacity == 512


class Doubler:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_every_instance_compiles_its_own_graph_past_dynamos_limit_of_8_per_code_object():
    from flashdraft.target.static_cache import dynamo_totals, with_own_code

    before = dynamo_totals()[0]
    for factor in range(12):  # as many verifiers (or drafting states) in one process
        step = torch.compile(with_own_code(Doubler(factor).forward), backend="eager", fullgraph=True, dynamic=False)
        assert torch.equal(step(torch.ones(2)), torch.full((2,), float(factor)))
    assert dynamo_totals()[0] - before == 12  # sharing one code object, the ninth would raise (recompile limit)
