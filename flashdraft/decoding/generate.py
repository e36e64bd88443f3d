"""Speculative decoding with a DFlash drafter (section 3 of the reference doc), and the
plain decoding it must reproduce.

One step: the drafter sees the committed context (features of every token before the
anchor) and drafts a block [anchor, mask, ..., mask] in one pass; the target verifies the
block in one pass; the longest agreeing prefix plus the target's bonus token is committed,
the target cache is rolled back to the committed tokens, and their features become new
drafter context. Greedy is token-identical to `autoregressive_generate`; with temperature > 0 the
serving rule's accept/resample rule (`flashdraft.decoding.serving_rules`) keeps the law of the target's output, sampled
with the same filters, exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from flashdraft.decoding.acceptance import greedy_verdict, tau_of
from flashdraft.decoding.host_transfers import TRANSFERS, to_host
from flashdraft.decoding.proposers import (
    DraftLimit,
    Proposer,
    ProposerFactory,
    as_proposer,
    default_block_size,
    draw_drafts,
)
from flashdraft.decoding.serving_rules import (
    GREEDY,
    NO_FILTERS,
    SamplingFilters,
    SamplingParams,
    ServingRule,
    expected_committed,
    serving_rule,
    target_probs,
    verify,
)
from flashdraft.decoding.verification import compiled_drafting, resolve_compile, verification_for
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel, decoding_attention
from flashdraft.target.static_cache import dynamo_totals, static_verifier


@dataclass
class GenerationResult:
    """One generation: the new tokens and, for speculative decoding, how many each step
    committed (`tau`: their mean) and the time spent drafting and verifying."""

    output_ids: list[int]  # generated tokens only (prompt excluded)
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per step (a + 1)
    stop_reason: str = "length"  # "eos" or "length"
    draft_seconds: float = 0.0  # speculative: summed over steps, the drafter proposing and its drafts sampled
    verify_seconds: float = 0.0  # speculative: summed over steps, the target's forward over [anchor, drafts]
    # per step (speculative: draft and verify seconds; plain: one forward's seconds, the prefill left out)
    step_seconds: list = field(default_factory=list)
    # speculative: per step, the mean and variance of its committed length given its drafts (from the acceptance
    # probabilities the verification computed; greedy: the committed length, variance 0)
    expected_lengths: list[float] = field(default_factory=list)
    length_variances: list[float] = field(default_factory=list)
    # speculative: device-to-host reads the steps made (`flashdraft.decoding.host_transfers`; the prefill's left out)
    host_transfers: int = 0
    # speculative: the steps' wall time, the prefill left out: drafting, verifying and the bookkeeping around them
    decode_seconds: float = 0.0
    # speculative: verified on the static cache (`SpeculativeConfig.compile`), and what torch.compile did during this
    # generation: graphs compiled (the target's verify and the drafter's steps: none once warmed up), of them the
    # drafter's, the verify's recompiles (a warmed verifier compiling again), graph breaks, the verify's compile seconds
    static: bool = False
    compiles: int = 0
    draft_compiles: int = 0
    recompiles: int = 0
    graph_breaks: int = 0
    compile_seconds: float = 0.0

    @property
    def tau(self) -> float:
        return tau_of(self.acceptance_lengths)


def _sample(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None, filters: SamplingFilters = NO_FILTERS
) -> torch.Tensor:
    """One token of logits [V]: the argmax at temperature 0, else a draw from the filtered p."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(target_probs(logits, temperature, filters), 1, generator=generator)[0]


def _truncate(tokens: list[int], budget: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """Cut new tokens at the budget or just after the first stop token."""
    for i, t in enumerate(tokens[:budget]):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens[:budget], False


def _rounded(features: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """`features` cast to `dtype` and back: what a cache stored in `dtype` holds for them."""
    if features is None or dtype is None:
        return features
    return features.to(dtype).to(features.dtype)


def _clock(device: torch.device) -> float:
    """perf_counter after the device's queued work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def autoregressive_generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Plain autoregressive decoding with the target's cache: one token per forward, the argmax at
    temperature 0, else sampled from p after the filters (`flashdraft.decoding.serving_rules.target_probs`)."""
    stop_ids = set(target.stop_token_ids)
    cache = target.new_cache()
    ids = torch.tensor([prompt_ids], device=target.device)
    out: list[int] = []
    step_seconds: list[float] = []
    with decoding_attention(target.device):
        while len(out) < max_new_tokens:
            start = _clock(target.device)
            logits = target.forward(ids, cache).logits_at(-1, None)[0, 0]
            token = _sample(logits, sampling.temperature, generator, sampling.filters)  # [] on the device
            out.append(to_host(token))
            if len(out) > 1:  # the first forward is the prefill, not a decoding step
                step_seconds.append(_clock(target.device) - start)
            if out[-1] in stop_ids:
                return GenerationResult(out, stop_reason="eos", step_seconds=step_seconds)
            ids = token.view(1, 1)  # the next input, without a trip through the host
    return GenerationResult(out, step_seconds=step_seconds)


@torch.no_grad()
def static_autoregressive_generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    backend: str | None = "inductor",
    positions: int | None = None,
) -> GenerationResult:
    """`autoregressive_generate` with every step after the prefill a 1-token verify on the target's static cache,
    compiled once by `backend` (`flashdraft.target.static_cache`; None: the static path uncompiled): the plain
    decoding a compiled speculative decoder is set against. The same tokens (greedy) and draws (sampled).
    `positions`: the static cache holds at least this many (a warm-up sizes it for the longest generation after)."""
    stop_ids = set(target.stop_token_ids)
    cache = target.new_cache()
    with decoding_attention(target.device):
        logits = target.forward(torch.tensor([prompt_ids], device=target.device), cache).logits_at(-1, None)[0, 0]
        token = _sample(logits, sampling.temperature, generator, sampling.filters)
        verifier = static_verifier(target, 1, max(len(prompt_ids) + max_new_tokens, positions or 0) + 1, backend)
        verifier.start(cache, len(prompt_ids))
        counts_before = replace(verifier.counts)
        result = GenerationResult([to_host(token)], static=True)
        while len(result.output_ids) < max_new_tokens and result.output_ids[-1] not in stop_ids:
            start = _clock(target.device)
            logits = verifier.verify(token.view(1, 1)).logits[0, 0]
            verifier.commit(0)
            token = _sample(logits, sampling.temperature, generator, sampling.filters)
            result.output_ids.append(to_host(token))
            result.step_seconds.append(_clock(target.device) - start)
    result.stop_reason = "eos" if result.output_ids[-1] in stop_ids else "length"
    result.compiles = verifier.counts.compiles - counts_before.compiles
    result.recompiles = verifier.counts.recompiles - counts_before.recompiles
    result.graph_breaks = verifier.counts.graph_breaks - counts_before.graph_breaks
    result.compile_seconds = verifier.counts.compile_seconds - counts_before.compile_seconds
    return result


def _accept(
    draft: torch.Tensor,
    q: torch.Tensor | None,
    verified,
    temperature: float,
    generator: torch.Generator | None,
    filters: SamplingFilters,
    budget: int,
    stop_ids: set[int],
) -> tuple[list[int], torch.Tensor, tuple[float, float] | None]:
    """One step's verification of `draft` [k] against the target's forward `verified` over [anchor, d1 .. dk]:
    (the a + 1 tokens it commits before any cut, the next anchor [1] on the device, and at temperature > 0 the mean
    and variance of the step's committed length given its drafts; None greedy). Greedy reads the device once: the
    target's argmax over all k + 1 rows (the LM head over rows past a rejection costs less than a second read)."""
    if temperature <= 0:
        verdict = greedy_verdict(draft, verified.logits_at(0, draft.shape[0] + 1)[0])  # [k + 2] on the device
        values = to_host(verdict)
        a = values[0]
        return values[1 : a + 2], verdict[a + 1 : a + 2], None
    a, bonus, alpha = verify(draft, q, target_probs(verified.logits[0], temperature, filters), generator)
    drafts = to_host(draft)
    # an accepted stop token ends the step: the step commits at most up to the first drafted one
    stop_at = next((j + 1 for j, t in enumerate(drafts) if t in stop_ids), budget)
    committed = drafts[:a] + [bonus]
    anchor = torch.full((1,), bonus, dtype=torch.long, device=draft.device)  # a fill: no copy from the host
    return committed, anchor, expected_committed(alpha, min(budget, stop_at))


@dataclass(frozen=True)
class SpeculativeConfig:
    """How each speculative step drafts and verifies: the block (None: the drafter's), the drafts it verifies
    (`limit`: fewer, still lossless), the server's rule at T > 0 (`flashdraft.decoding.serving_rules`; None: vLLM's)
    and the dtype the context features are rounded to before the drafter sees them (None: as computed)."""

    block_size: int | None = None
    limit: DraftLimit | None = None
    rule: ServingRule | str | None = None
    round_context_to: torch.dtype | None = None
    # False: no device synchronisation between drafting and verifying (on CUDA the step's only wait is then its one
    # read; draft and verify seconds count the host's launch time only)
    time_phases: bool = True
    # True: verify on the target's static cache at a fixed length, compiled once (`flashdraft.target.static_cache`);
    # False: the eager reference path; None: where it pays (`decoding.verification.compile_by_default`)
    compile: bool | None = None
    # what compiles the static verify: "inductor" (on CUDA as CUDA graphs), "eager" / "aot_eager" (dynamo's tracing
    # alone: one graph proven without inductor's cost), None: the static cache run uncompiled
    compile_backend: str | None = "inductor"
    # positions the static cache holds at least (None: this generation's prompt and new tokens); an evaluation sets it
    # to its longest record's, so the graph its warm-up compiles serves every record
    static_positions: int | None = None


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: DFlashDrafter | ProposerFactory | Proposer,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    speculative: SpeculativeConfig = SpeculativeConfig(),
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate with drafter + target; returns the tokens, each step's committed count and the
    time spent drafting and verifying.

    `drafter` is a DFlash drafter, a `ProposerFactory` (the hybrid) or any `Proposer`; `speculative.limit`
    cuts each step's drafts (fewer verified tokens, still lossless). The first token comes from
    the prefill, as in plain decoding; every later token comes from a speculative step. A step
    commits min(a + 1, tokens still allowed), cut after a stop token, so the acceptance
    lengths add up to len(output_ids) - 1.

    `speculative.round_context_to`: the target's context features are rounded to this dtype (and cast
    back) before the proposer sees them, as a hidden-state cache in that dtype stores them;
    `eval --check-consistency` against such a cache uses it to compare the same features.
    None (real decoding): the features as the target computed them.

    At temperature > 0, `speculative.rule` decides how drafts are drawn and verified, and the sampling's filters
    (top-k, top-p, min-p: those the rule's server applies) shape the target's p.
    """
    block = speculative.block_size or default_block_size(drafter)
    rule = serving_rule(speculative.rule)
    if block < 2:
        raise ValueError(f"block_size {block} < 2")
    compile = resolve_compile(speculative.compile, target)
    positions = max(len(prompt_ids) + max_new_tokens, speculative.static_positions or 0)
    compiled = compiled_drafting(drafter, speculative.compile_backend, positions + block + 1) if compile else None
    proposer = as_proposer(drafter, target, speculative.limit, rule=rule, compiled=compiled)
    target.set_context_layers(proposer.context_layer_ids)
    with decoding_attention(target.device):
        return _speculative_steps(
            target,
            proposer,
            prompt_ids,
            max_new_tokens,
            sampling,
            replace(speculative, block_size=block, rule=rule, compile=compile, static_positions=positions),
            generator,
        )


def _speculative_steps(
    target: TargetModel,
    proposer: Proposer,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    speculative: SpeculativeConfig,
    generator: torch.Generator | None,
) -> GenerationResult:
    """The prefill and the steps of `speculative_generate` (the proposer made, `speculative`'s block and rule
    resolved)."""
    block = speculative.block_size
    temperature, filters, round_context_to = sampling.temperature, sampling.filters, speculative.round_context_to
    stop_ids, device, cache = set(target.stop_token_ids), target.device, target.new_cache()
    clock = _clock if speculative.time_phases else lambda _: time.perf_counter()

    prefill = target.forward(torch.tensor([prompt_ids], device=device), cache)
    verification = verification_for(
        target,
        cache,
        proposer,
        block,
        speculative.static_positions,
        compile=speculative.compile,
        backend=speculative.compile_backend,
    )
    counts_before, graphs_before = replace(verification.counts), dynamo_totals()
    first = to_host(_sample(prefill.logits_at(-1, None)[0, 0], temperature, generator, filters))
    result = GenerationResult([first], static=verification.static)
    if first in stop_ids:
        result.stop_reason = "eos"
        return result
    # drafter context not yet in its cache: features [1, C, n * H] at positions [1, C]
    new_context = _rounded(prefill.context_features, round_context_to)
    new_positions = torch.arange(len(prompt_ids), device=device)[None]
    anchor_pos = len(prompt_ids)
    anchor = torch.full((1,), first, dtype=torch.long, device=device)  # [1]: the last committed token, on the device
    reads_before, loop_start = TRANSFERS.reads, _clock(device)

    while len(result.output_ids) < max_new_tokens:
        tokens = prompt_ids + result.output_ids
        start = clock(device)
        draft_logits = proposer.propose(tokens, anchor_pos, new_context, new_positions, block)  # [k, V]
        draft, q = draw_drafts(proposer, draft_logits, temperature, generator, rule=speculative.rule)  # [k], q
        drafted = clock(device)
        verified = verification.verify(anchor, draft)  # over [anchor, d1 .. dk]
        verified_at = clock(device)
        budget = max_new_tokens - len(result.output_ids)
        accepted, anchor, moments = _accept(draft, q, verified, temperature, generator, filters, budget, stop_ids)
        result.draft_seconds += drafted - start
        result.verify_seconds += verified_at - drafted
        result.step_seconds.append((drafted - start, verified_at - drafted))
        a = len(accepted) - 1
        committed, stopped = _truncate(accepted, budget, stop_ids)
        result.output_ids += committed
        result.acceptance_lengths.append(len(committed))
        mean, variance = moments if moments is not None else (float(len(committed)), 0.0)  # greedy: as committed
        result.expected_lengths.append(mean)
        result.length_variances.append(variance)
        if stopped:
            result.stop_reason = "eos"
            break
        # the anchor and the accepted drafts stay in the target cache; the bonus is the next anchor
        verification.commit(a)
        new_context = verified.context_features[:, : a + 1] if verified.context_features is not None else None
        new_context = _rounded(new_context, round_context_to)
        new_positions = anchor_pos + torch.arange(a + 1, device=device)[None]
        anchor_pos += a + 1
    result.host_transfers = TRANSFERS.reads - reads_before
    result.decode_seconds = _clock(device) - loop_start
    counts, graphs = verification.counts, dynamo_totals()
    result.compiles, result.graph_breaks = graphs[0] - graphs_before[0], graphs[1] - graphs_before[1]
    result.draft_compiles = result.compiles - (counts.compiles - counts_before.compiles)
    result.recompiles = counts.recompiles - counts_before.recompiles
    result.compile_seconds = counts.compile_seconds - counts_before.compile_seconds
    return result


@dataclass
class GreedyComparison:
    """One prompt decoded speculatively and plainly, greedy, each timed (`flashdraft speculate`)."""

    speculative: GenerationResult
    plain: GenerationResult
    speculative_seconds: float
    plain_seconds: float

    @property
    def lossless(self) -> bool:
        return self.speculative.output_ids == self.plain.output_ids

    def summary(self) -> str:
        spec, plain = self.speculative, self.plain
        compiled = ""
        if spec.static:
            compiled = (
                f", compiled (static cache): {spec.compiles} compiles in {spec.compile_seconds:.1f} s before timing, "
                f"{spec.recompiles} recompiles, {spec.graph_breaks} graph breaks"
            )
        return (
            f"tokens {len(spec.output_ids)}, steps {len(spec.acceptance_lengths)}, tau {spec.tau:.2f}, "
            f"lossless {self.lossless}, speculative {len(spec.output_ids) / self.speculative_seconds:.1f} tok/s, "
            f"greedy{' (compiled)' if plain.static else ''} {len(plain.output_ids) / self.plain_seconds:.1f} tok/s"
            f"{compiled}"
        )

    def check_lossless(self) -> None:
        if not self.lossless:
            raise FlashdraftError("speculative output differs from greedy decoding (not lossless)")


def compare_with_greedy(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    block_size: int | None = None,
    compile: bool | None = None,
) -> GreedyComparison:
    """Greedy speculative decoding of `prompt_ids` beside plain greedy decoding, each timed: the
    two outputs must be the same tokens. `compile`: `SpeculativeConfig.compile` (compiled, the first generation
    pays the compile: a warm-up generation runs first, untimed)."""
    speculative = SpeculativeConfig(block_size=block_size, compile=compile)
    warm_up = None
    if resolve_compile(compile, target):
        warm_up = speculative_generate(target, drafter, prompt_ids, max_new_tokens, speculative=speculative)
    t0 = time.perf_counter()
    spec = speculative_generate(target, drafter, prompt_ids, max_new_tokens, speculative=speculative)
    if warm_up is not None:  # what the compile cost, reported with the timed run's own (none, after warm-up)
        spec.compiles += warm_up.compiles
        spec.compile_seconds += warm_up.compile_seconds
        spec.graph_breaks += warm_up.graph_breaks
        spec.recompiles += warm_up.recompiles
    t_spec = time.perf_counter() - t0
    if warm_up is not None:  # compiled against compiled: plain decoding as a 1-token static verify, warmed up too
        static_autoregressive_generate(target, prompt_ids, max_new_tokens)
        t0 = time.perf_counter()
        plain = static_autoregressive_generate(target, prompt_ids, max_new_tokens)
    else:
        t0 = time.perf_counter()
        plain = autoregressive_generate(target, prompt_ids, max_new_tokens)
    return GreedyComparison(spec, plain, t_spec, time.perf_counter() - t0)
