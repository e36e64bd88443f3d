"""What an evaluation found: acceptance lengths per prompt and the figures the reference
quotes, pooled over prompts.

Figures: τ = total committed / steps (pooled over prompts; its ceiling is B), the mean of
per-prompt τ, the histogram of committed lengths 1..B, and per-position acceptance: the
share of steps whose k-th draft was accepted (committed length > k), so τ = 1 + Σ_k of it.
Online, the speed-up over plain decoding and the bound that τ and the measured costs imply.

Each figure also by context length (`by_context`): a step falls in the bucket of the tokens
before its anchor (prompt + tokens committed before it), so long-context decay shows, with the
measured draft and verify cost of each bucket online (a drafter's full-attention layers read
the whole context every step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flashdraft.decoding.acceptance import tau_of
from flashdraft.errors import FlashdraftError

# τ this close to 1.0 is what a drafter that accepts (almost) nothing gets, as an untrained one does: random drafts
# over a real vocabulary are accepted well under 1 % of steps, a drafter that learned anything clears 1.05 at once
ACCEPTS_NOTHING_MARGIN = 0.05


def accepts_nothing(tau: float) -> bool:
    """Whether τ is within noise of 1.0: the drafter's drafts are (almost) never accepted."""
    return tau < 1.0 + ACCEPTS_NOTHING_MARGIN


def accepts_nothing_problem(tau: float, what: str) -> str | None:
    """The problem line for a τ within noise of 1.0 (`what`: which τ, e.g. "held-out τ"), else None."""
    if not accepts_nothing(tau):
        return None
    return (
        f"{what} {tau:.3f} is within {ACCEPTS_NOTHING_MARGIN} of 1.0: the drafter accepts (almost) nothing, like "
        f"an untrained one"
    )


def speedup_bound(tau: float, greedy_step_s: float, draft_s: float, verify_s: float) -> float | None:
    """The speed-up τ and the measured per-step costs allow: a step commits τ tokens in
    t(draft) + t(verify of k + 1 tokens), plain decoding spends τ x t(greedy step) on them.
    Prefill, acceptance and rollback are left out, so a measured speed-up stays under it."""
    step = draft_s + verify_s
    return tau * greedy_step_s / step if step > 0 else None


def position_acceptance_of(lengths: list[int], max_drafts: int) -> list[float]:
    """[k - 1] = share of steps (committing `lengths`) whose k-th draft was accepted, k = 1..max_drafts."""
    steps = max(len(lengths), 1)
    return [sum(n > k for n in lengths) / steps for k in range(1, max_drafts + 1)]


def parse_context_buckets(spec: str, flag: str = "--context-buckets") -> list[int]:
    """Bucket edges from '0,512,2048,...': at least two, non-negative, strictly increasing."""
    try:
        edges = [int(x) for x in spec.split(",")]
    except ValueError:
        edges = []
    if len(edges) < 2 or edges[0] < 0 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise FlashdraftError(
            f"{flag} {spec!r}: expected at least two strictly increasing non-negative token "
            f"counts, e.g. 0,512,2048,8192"
        )
    return edges


def default_context_edges(contexts: list[int]) -> list[int]:
    """Powers of two spanning `contexts`: from the largest at or under the shortest to the first past the
    longest (0 first when a context is under 2)."""
    if not contexts:
        return [0, 1]
    low, high = min(contexts), max(contexts)
    edge = 1 << int(math.log2(low)) if low >= 2 else 0
    edges = [edge]
    while edges[-1] <= high:
        edges.append(max(2 * edges[-1], 2))
    return edges


def record_context_edges(records: list, max_new_tokens: int) -> list[int]:
    """Default `by_context` buckets: powers of two spanning every context a step of these records can have,
    from the shortest prompt to the longest prompt and completion."""
    ends = [len(r.prompt_ids) + (len(r.completion_ids) or max_new_tokens) for r in records]
    return default_context_edges([min(len(r.prompt_ids) for r in records), max(ends) - 1])


@dataclass
class PromptResult:
    id: str
    acceptance_lengths: list[int]  # tokens committed per step
    output_ids: list[int] | None = None  # online: the speculative output
    lossless: bool | None = None  # online, greedy: output equals plain greedy decoding
    prompt_length: int = 0  # tokens before the first step's anchor
    # online, per step: (draft seconds, verify seconds), as timed by `speculative_generate`
    step_seconds: list[tuple[float, float]] | None = None
    # per step: its expected committed length given its drafts (online; offline at T > 0 an unbiased estimate)
    # and, online, the variance of its committed length given its drafts (`expected_tau_figures`)
    expected_lengths: list[float] | None = None
    length_variances: list[float] | None = None

    @property
    def tau(self) -> float:
        return tau_of(self.acceptance_lengths)

    @property
    def step_contexts(self) -> list[int]:
        """Tokens before each step's anchor: the prompt and everything committed before the step."""
        contexts, context = [], self.prompt_length
        for n in self.acceptance_lengths:
            contexts.append(context)
            context += n
        return contexts


@dataclass
class EvalResult:
    mode: str  # "offline" or "online"
    block_size: int
    target_layer_ids: list[int]
    context_layers: int | None  # found in fc.weight; None for a drafter without context features (n-gram)
    per_prompt: list[PromptResult]
    temperature: float = 0.0
    speculative_tokens_per_s: float | None = None  # online
    greedy_tokens_per_s: float | None = None  # online
    # online, in ms: per speculative step (every step, not only the first max_blocks), per greedy token
    draft_ms: float | None = None
    verify_ms: float | None = None
    greedy_step_ms: float | None = None
    speedup_bound: float | None = None  # `speedup_bound` of these and the τ of every step
    # drafts a step can verify: block_size - 1 (fill-in), block_size (anchor-first, DSpark); None: block_size - 1
    drafts_per_block: int | None = None
    context_edges: list[int] | None = None  # `by_context` bucket edges; None: `default_context_edges`
    # online: (context before the input token, seconds) of every plain-decoding forward after the prefill
    greedy_steps: list[tuple[int, float]] = field(default_factory=list)
    # online: the static verify (`SpeculativeConfig.compile`): static or not, graphs compiled (the warm-up's and
    # after it), recompiles, graph breaks, compile seconds; None offline
    compile: dict | None = None

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1 if self.drafts_per_block is None else self.drafts_per_block

    @property
    def lengths(self) -> list[int]:
        return [n for p in self.per_prompt for n in p.acceptance_lengths]

    @property
    def num_steps(self) -> int:
        return len(self.lengths)

    @property
    def tau(self) -> float:
        return tau_of(self.lengths)

    @property
    def tau_prompt_mean(self) -> float:
        taus = [p.tau for p in self.per_prompt if p.acceptance_lengths]
        return sum(taus) / len(taus) if taus else 0.0

    @property
    def histogram(self) -> list[int]:
        """counts[n - 1] = steps that committed n tokens, n = 1 .. drafts + 1 (B, or B + 1 anchor-first)."""
        counts = [0] * (self.max_drafts + 1)
        for n in self.lengths:
            counts[n - 1] += 1
        return counts

    @property
    def position_acceptance(self) -> list[float]:
        """[k - 1] = share of steps whose k-th draft was accepted, k = 1..B-1."""
        return position_acceptance_of(self.lengths, self.max_drafts)

    @property
    def by_context(self) -> list[dict[str, Any]]:
        """τ and per-position acceptance of the steps in each context bucket [context_from, context_to);
        online also each bucket's mean draft and verify time, the plain-decoding step time at those
        contexts and the speed-up bound they imply."""
        steps = []  # (context, committed, (draft s, verify s) or None) of every step
        for p in self.per_prompt:
            timed = p.step_seconds or [None] * len(p.acceptance_lengths)
            steps += zip(p.step_contexts, p.acceptance_lengths, timed, strict=True)
        edges = self.context_edges or default_context_edges([c for c, _, _ in steps])
        buckets = []
        for low, high in zip(edges, edges[1:], strict=False):
            inside = [(n, t) for c, n, t in steps if low <= c < high]
            lengths = [n for n, _ in inside]
            bucket: dict[str, Any] = {
                "context_from": low,
                "context_to": high,
                "steps": len(lengths),
                "tau": tau_of(lengths) if lengths else None,
                "position_acceptance": position_acceptance_of(lengths, self.max_drafts) if lengths else None,
            }
            if self.mode == "online":
                bucket |= self._bucket_costs([t for _, t in inside if t is not None], bucket["tau"], low, high)
            buckets.append(bucket)
        return buckets

    def _bucket_costs(self, timed: list[tuple[float, float]], tau: float | None, low: int, high: int) -> dict:
        greedy = [s for c, s in self.greedy_steps if low <= c < high]
        draft_s = sum(d for d, _ in timed) / len(timed) if timed else None
        verify_s = sum(v for _, v in timed) / len(timed) if timed else None
        greedy_s = sum(greedy) / len(greedy) if greedy else None
        bound = (
            speedup_bound(tau, greedy_s, draft_s, verify_s) if None not in (tau, greedy_s, draft_s, verify_s) else None
        )
        return {
            "draft_ms": _ms(draft_s),
            "verify_ms": _ms(verify_s),
            "greedy_step_ms": _ms(greedy_s),
            "speedup_bound": bound,
        }

    @property
    def lossless(self) -> bool | None:
        flags = [p.lossless for p in self.per_prompt]
        return None if self.mode != "online" or None in flags else all(flags)

    @property
    def speedup(self) -> float | None:
        if self.speculative_tokens_per_s is None or not self.greedy_tokens_per_s:
            return None
        return self.speculative_tokens_per_s / self.greedy_tokens_per_s

    @property
    def speedup_of_bound(self) -> float | None:
        """Measured speed-up / bound: how much of what τ allows the decode loop delivers."""
        return self.speedup / self.speedup_bound if self.speedup is not None and self.speedup_bound else None

    def to_json(self) -> dict[str, Any]:
        per_prompt = []
        for p in self.per_prompt:
            row: dict[str, Any] = {
                "id": p.id,
                "prompt_length": p.prompt_length,
                "acceptance_lengths": p.acceptance_lengths,
                "tau": p.tau,
                "num_steps": len(p.acceptance_lengths),
            }
            if self.mode == "online":
                row |= {"output_ids": p.output_ids, "lossless": p.lossless}
            if p.expected_lengths is not None:  # T > 0: each step's expected committed length given its drafts
                row["expected_lengths"] = p.expected_lengths
            per_prompt.append(row)
        return {
            "mode": self.mode,
            "block_size": self.block_size,
            "target_layer_ids": self.target_layer_ids,
            "context_layers": self.context_layers,
            "temperature": self.temperature,
            "tau": self.tau,
            "tau_prompt_mean": self.tau_prompt_mean,
            "num_steps": self.num_steps,
            "num_prompts": len(self.per_prompt),
            "histogram": self.histogram,
            "position_acceptance": self.position_acceptance,
            "by_context": self.by_context,
            "lossless": self.lossless,
            "speedup": self.speedup,
            "speculative_tokens_per_s": self.speculative_tokens_per_s,
            "greedy_tokens_per_s": self.greedy_tokens_per_s,
            "draft_ms": self.draft_ms,
            "verify_ms": self.verify_ms,
            "greedy_step_ms": self.greedy_step_ms,
            "speedup_bound": self.speedup_bound,
            "speedup_of_bound": self.speedup_of_bound,
            "compile": self.compile,
            "per_prompt": per_prompt,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _pad(values: list, length: int, fill) -> list:
    return list(values) + [fill] * (length - len(values))


def first_difference(a: list, b: list) -> int | None:
    """Index of the first position where two lists differ (or one ends), None if equal."""
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def difference(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """result - reference, per figure and per prompt (of two `EvalResult.to_json()`)."""

    def sub(a, b):
        return None if a is None or b is None else a - b

    length = max(len(result["histogram"]), len(reference["histogram"]))
    hist_a, hist_b = _pad(result["histogram"], length, 0), _pad(reference["histogram"], length, 0)
    pos_a = _pad(result["position_acceptance"], length - 1, 0.0)
    pos_b = _pad(reference["position_acceptance"], length - 1, 0.0)
    ref_prompts = {p["id"]: p for p in reference["per_prompt"]}
    return {
        "tau": sub(result["tau"], reference["tau"]),
        "tau_prompt_mean": sub(result["tau_prompt_mean"], reference["tau_prompt_mean"]),
        "num_steps": result["num_steps"] - reference["num_steps"],
        "histogram": [a - b for a, b in zip(hist_a, hist_b, strict=True)],
        "position_acceptance": [a - b for a, b in zip(pos_a, pos_b, strict=True)],
        "speedup": sub(result["speedup"], reference["speedup"]),
        "expected_tau": sub(result.get("expected_tau"), reference.get("expected_tau")),
        "per_prompt": [
            {
                "id": p["id"],
                "tau": sub(p["tau"], ref_prompts[p["id"]]["tau"]),
                "num_steps": p["num_steps"] - ref_prompts[p["id"]]["num_steps"],
            }
            for p in result["per_prompt"]
            if p["id"] in ref_prompts
        ],
    }


def expected_tau_figures(result: EvalResult) -> dict[str, Any]:
    """τ without the noise of the acceptance draws: `expected_tau`, the mean over steps of each step's expected
    committed length given its drafts (from the acceptance probabilities verification computes: E = 1 + sum_k
    prod_{i <= k} alpha_i), with `expected_tau_stderr`, its standard error with the prompts as the units (a prompt's
    steps share its sampled continuation, so they are not independent: over 30 seeds the spread of expected_tau
    was 0.97-0.98x this and 1.44-1.46x the error that treats steps as independent, `benchmarks/expected_tau_error.py`;
    one prompt: that error); online also
    `tau_stderr_given_drafts`, sqrt(sum of each step's variance given its drafts) / steps: how far the sampled τ
    falls from expected_tau by the acceptance draws alone (the two agree when |tau - expected_tau| is within a few
    of it). None where the walk computed none."""
    expected = [e for p in result.per_prompt for e in (p.expected_lengths or [])]
    variances = [v for p in result.per_prompt for v in (p.length_variances or [])]
    n = len(expected)
    if n == 0 or n != result.num_steps:
        return {"expected_tau": None, "expected_tau_stderr": None, "tau_stderr_given_drafts": None}
    mean = sum(expected) / n
    given_drafts = sum(variances) ** 0.5 / n if len(variances) == n else None
    return {
        "expected_tau": mean,
        "expected_tau_stderr": _clustered_stderr(result, mean),
        "tau_stderr_given_drafts": given_drafts,
    }


def _clustered_stderr(result: EvalResult, mean: float) -> float:
    """Standard error of the steps' mean expected length with each prompt's steps one unit (the ratio estimator's
    linearised variance, G / (G - 1) sum_g (S_g - mean n_g)^2 / N^2 over G prompts with S_g the sum of their n_g
    steps' expected lengths, N steps in all); with one prompt, std over steps / sqrt(steps)."""
    units = [(sum(p.expected_lengths), len(p.expected_lengths)) for p in result.per_prompt if p.expected_lengths]
    steps = sum(k for _, k in units)
    if len(units) < 2:
        values = [e for p in result.per_prompt for e in (p.expected_lengths or [])]
        spread = (sum((e - mean) ** 2 for e in values) / (steps - 1)) ** 0.5 if steps > 1 else 0.0
        return spread / steps**0.5
    g = len(units)
    return (g / (g - 1) * sum((s - mean * k) ** 2 for s, k in units)) ** 0.5 / steps
