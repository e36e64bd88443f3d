"""How each server verifies drafts at T > 0, as data, and the one acceptance function that reads it (section 11 of
the reference doc; read from vLLM 0.33.0 `config/speculative.py` draft_sample_method,
`v1/worker/gpu/spec_decode/rejection_sampler_utils.py`, `v1/worker/gpu/sample/sampler.py` apply_sampling_params;
SGLang 0.5.23 `speculative/dflash_utils.py` build_speculative_verify_target_probs, `dflash_worker_v2.py`,
`kernels/ops/speculative/dspark/dspark_accept.py`, `kernels/ops/speculative/reject_sampling.py`).

A rule says, per drafter family, whether drafts at T > 0 are the argmax walk (the verifier then takes q one-hot at
the draft: accept with probability p(d), resample from p without d) or a sampled walk at the request's temperature
(q the drafter's: accept with min(1, p/q), resample from max(p - q, 0)); whether `dspark_draft_topk` is honoured;
and which target-side filters apply to p before verifying, in the server's order. The one-hot rule is the
min(1, p/q) rule with q a point mass, so `verify` is one function for both.

Greedy decoding (T = 0) is the same under every rule: the argmax, accepted when it equals the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashdraft.decoding.host_transfers import to_host
from flashdraft.drafter.families import FAMILIES
from flashdraft.drafter.server_fields import SGLANG, VLLM
from flashdraft.errors import FlashdraftError

SAMPLED = "sampled walk at T, q the drafter's, accept min(1, p/q), resample max(p - q, 0)"
ONE_HOT = "argmax walk, q one-hot, accept with p(d), resample p without d"


@dataclass(frozen=True)
class ServingRule:
    name: str
    server: str
    # families drafting a sampled walk at T > 0 (None: every family of `drafter.families`); the rest, and a proposer
    # without a drafter (family None: the n-gram), draft the argmax walk
    sampled_families: frozenset[str] | None
    honours_draft_top_k: bool  # DSpark's dspark_draft_topk: the Markov bias on the top-k base candidates only
    target_filters: tuple[str, ...]  # applied to the target's logits before verifying, in this order
    source: str  # where the rule is read

    def samples_drafts(self, family: str | None) -> bool:
        """Whether a proposer of this family draws its drafts at T > 0 (False: argmax walk, q one-hot)."""
        return family is not None and (self.sampled_families is None or family in self.sampled_families)

    def describe(self, family: str | None = None) -> str:
        families = [family] if family else list(FAMILIES)
        drafts = "; ".join(f"{f}: {SAMPLED if self.samples_drafts(f) else ONE_HOT}" for f in families)
        top_k = "honoured" if self.honours_draft_top_k else "ignored"
        return (
            f"{self.name} ({self.server}): {drafts}; dspark_draft_topk {top_k}; target p filtered by "
            f"{', '.join(self.target_filters)}"
        )


RULES: dict[str, ServingRule] = {
    "vllm": ServingRule(
        "vllm",
        f"{VLLM}, draft_sample_method greedy (its default)",
        frozenset(),
        True,
        ("temperature", "min_p", "top_k", "top_p"),
        "config/speculative.py draft_sample_method = 'greedy'; rejection_sampler_utils.py draft_log_prob = 0.0",
    ),
    "vllm-probabilistic": ServingRule(
        "vllm-probabilistic",
        f"{VLLM}, draft_sample_method probabilistic",
        None,
        True,
        ("temperature", "min_p", "top_k", "top_p"),
        "rejection_sampler_utils.py: accept if target_logprob > log(u) + draft_logprob",
    ),
    "sglang": ServingRule(
        "sglang",
        SGLANG,
        frozenset({"dflash2", "dspark"}),
        False,
        ("temperature", "top_k", "top_p"),
        "dflash_utils.py draft_probs = zeros (DFlash); dspark_accept.py / reject_sampling.py coin * q < p "
        "(DFlash2 selector, DSpark Markov walk); build_speculative_verify_target_probs (no min_p)",
    ),
}
DEFAULT_RULE = "vllm"  # what a drafter served with vLLM's defaults meets


def serving_rule(name: str | ServingRule | None) -> ServingRule:
    """The rule of this name (None: the default)."""
    if isinstance(name, ServingRule):
        return name
    if (name or DEFAULT_RULE) not in RULES:
        raise FlashdraftError(f"--serving-rule {name!r}: expected one of {', '.join(RULES)}")
    return RULES[name or DEFAULT_RULE]


# -- the sampling settings of a request -----------------------------------------------------------


@dataclass(frozen=True)
class SamplingFilters:
    """The target-side filters of a request (None: off). Temperature is passed beside them."""

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    source: dict[str, str] = field(default_factory=dict, compare=False)  # value name -> where it came from

    def active(self) -> dict[str, float | int]:
        values = {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}
        neutral = {"top_k": (None, 0, -1), "top_p": (None, 1.0), "min_p": (None, 0.0)}
        return {k: v for k, v in values.items() if v not in neutral[k]}

    def to_json(self) -> dict:
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p, "source": dict(self.source)}


NO_FILTERS = SamplingFilters()


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling, as vLLM's `SamplingParams` holds it: the temperature (0: greedy), the filters of the
    target's p (`SamplingFilters`: top-k, top-p, min-p) and the seed each record's draws start from."""

    temperature: float = 0.0
    filters: SamplingFilters = NO_FILTERS
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


GREEDY = SamplingParams()
GENERATION_CONFIG_FIELDS = ("top_k", "top_p", "min_p")


def resolve_filters(
    target_path: str | Path | None,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    use_generation_config: bool = True,
) -> SamplingFilters:
    """The filters a request gets: those given, else the target's generation_config.json values (as vLLM
    generation_config="auto" and SGLang sampling_defaults="model" apply them), unless `use_generation_config` is off."""
    given = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
    source = {k: "given" for k, v in given.items() if v is not None}
    path = Path(target_path) / "generation_config.json" if target_path is not None else None
    if use_generation_config and path is not None and path.is_file():
        try:
            defaults = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise FlashdraftError(f"{path}: not readable JSON ({e}); --no-generation-config ignores it") from None
        for k in GENERATION_CONFIG_FIELDS:
            if given[k] is None and defaults.get(k) is not None:
                given[k], source[k] = defaults[k], str(path)
    return SamplingFilters(given["top_k"], given["top_p"], given["min_p"], source)


def greedy_filters_note(top_k: int | None, top_p: float | None, min_p: float | None) -> str | None:
    """A line saying filters given at temperature 0 change nothing (None when none were given)."""
    given = [f"--{name} {v}" for name, v in (("top-k", top_k), ("top-p", top_p), ("min-p", min_p)) if v is not None]
    if not given:
        return None
    return (
        f"note: {', '.join(given)} changes nothing at temperature 0 (greedy decoding takes the top token, which "
        f"every filter keeps)"
    )


def greedy_in_effect_note(temperature: float, filters: SamplingFilters) -> str | None:
    """A warning where a filter makes T > 0 greedy in effect: top_k 1 keeps only the likeliest token, so every
    request decodes greedily whatever its temperature (a benchmark default that silently changes what is measured)."""
    if temperature <= 0 or filters.top_k != 1:
        return None
    where = filters.source.get("top_k", "given")
    return (
        f"warning: top_k 1 ({where}) makes temperature {temperature:g} greedy in effect: only the likeliest "
        f"token is kept, so every token is the greedy one; pass --top-k with a larger value (or "
        f"--temperature 0 to say greedy)"
    )


def check_filters(filters: SamplingFilters, rule: ServingRule) -> None:
    """A filter the rule's server does not apply in verification, given explicitly, is refused (one from a
    generation config is dropped by `filters_for`, as the server drops it)."""
    for name in filters.active():
        if name not in rule.target_filters and filters.source.get(name) == "given":
            raise FlashdraftError(
                f"--{name.replace('_', '-')} {getattr(filters, name)}: {rule.server} does not apply {name} when it "
                f"verifies drafts (its speculative output ignores it); expected another --serving-rule or no "
                f"--{name.replace('_', '-')}"
            )


def filters_for(filters: SamplingFilters, rule: ServingRule) -> SamplingFilters:
    """`filters` without those the rule's server does not apply."""
    keep = {k: (getattr(filters, k) if k in rule.target_filters else None) for k in GENERATION_CONFIG_FIELDS}
    return SamplingFilters(**keep, source=filters.source)


def request_filters(
    target_path: str | Path | None,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    rule: ServingRule,
    use_generation_config: bool = True,
) -> tuple[SamplingFilters, list[str]]:
    """The filters a request at `temperature` gets under `rule`, and the names of those the generation config set
    that the rule's server drops: none when greedy; else those given, then the target's generation_config.json
    values, without those the rule's server does not apply (one given explicitly that it does not apply is refused)."""
    if temperature <= 0:
        return NO_FILTERS, []
    given = resolve_filters(target_path, top_k, top_p, min_p, use_generation_config)
    check_filters(given, rule)
    filters = filters_for(given, rule)
    return filters, sorted(set(given.active()) - set(filters.active()))


def target_probs(logits: torch.Tensor, temperature: float, filters: SamplingFilters = NO_FILTERS) -> torch.Tensor:
    """The target's p as the servers verify with it: logits [..., V] / T, then min-p (vLLM), top-k (ties at the k-th
    kept, as vLLM), top-p (the smallest head of the sorted distribution holding p of the mass, at least one token),
    each on what the filter before it left; returns probabilities [..., V] (float32)."""
    x = logits.float() / temperature
    active = filters.active()
    if "min_p" in active:  # tokens under min_p x the top probability
        x = x.masked_fill(x < x.amax(-1, keepdim=True) + torch.log(torch.tensor(float(active["min_p"]))), -torch.inf)
    if "top_k" in active and active["top_k"] < x.shape[-1]:
        kth = x.topk(int(active["top_k"]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    if "top_p" in active:
        ordered, order = x.sort(-1, descending=True)
        mass_before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of the tokens ranked above
        drop = mass_before >= float(active["top_p"])
        drop[..., 0] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    return x.softmax(-1)


# -- the acceptance rule --------------------------------------------------------------------------


def acceptance_probabilities(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    """alpha [k]: the probability that each draft of [k] is accepted once all before it were, min(1, p(d) / q(d)),
    q [k, V] the drafter's distribution or None (one-hot at the drafts: p(d)); p [>= k, V] the target's."""
    k = draft.shape[0]
    p_d = p[:k].gather(-1, draft[:, None])[:, 0]
    if q is None:
        return p_d
    q_d = q.gather(-1, draft[:, None])[:, 0]
    return torch.where(q_d > 0, (p_d / q_d.clamp(min=1e-30)).clamp(max=1.0), torch.zeros_like(p_d))


def verify(
    draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int, torch.Tensor]:
    """Lossless verification of one block: draft [k], q [k, V] or None (one-hot), p [k + 1, V] the filtered target
    distribution after each block token. Accept d(j+1) with min(1, p(d) / q(d)); at the first rejection the bonus is
    drawn from normalize(max(p - q, 0)) (one-hot: p without d), after k acceptances from p's last row.
    Returns (a, bonus, alpha [k])."""
    alpha = acceptance_probabilities(draft, q, p)
    for j in range(draft.shape[0]):
        u = torch.rand((), generator=generator, device=p.device)
        if to_host(u < alpha[j]):  # a read per draft: the sampled rule's cost (greedy reads once per step)
            continue
        residual = p[j].clone()
        if q is None:
            residual.index_fill_(0, draft[j : j + 1], 0.0)  # a tensor index: no read of the device
        else:
            residual = (residual - q[j]).clamp(min=0)
        total = residual.sum()
        residual = torch.where(total > 0, residual / total, p[j])  # decided on the device
        return j, to_host(torch.multinomial(residual, 1, generator=generator))[0], alpha
    return draft.shape[0], to_host(torch.multinomial(p[draft.shape[0]], 1, generator=generator))[0], alpha


def expected_committed(alpha: torch.Tensor, cap: int) -> tuple[float, float]:
    """Mean and variance of the tokens a step commits, min(a + 1, cap), when draft j is accepted with alpha[j] [k]
    once all before it were: P(a >= j) = prod_{i <= j} alpha_i, so E = 1 + sum_{j < cap} P(a >= j)."""
    reach = alpha[: max(cap - 1, 0)].double().cumprod(0)  # P(a >= j), j = 1 .. min(k, cap - 1)
    m = torch.arange(2, reach.shape[0] + 2, dtype=torch.float64, device=reach.device)  # n >= m  <=>  a >= m - 1
    sums = to_host(torch.stack([reach.sum(), ((2 * m - 1) * reach).sum()]))  # E[n^2] = sum_m (2m - 1) P(n >= m)
    mean, second = 1.0 + sums[0], 1.0 + sums[1]
    return mean, max(second - mean * mean, 0.0)


# -- the rule a serving command implies ------------------------------------------------------------


def rule_of_command(command: str) -> ServingRule:
    """The rule a vLLM or SGLang serving command line implies: vLLM's draft_sample_method in --speculative-config
    (absent: greedy, its default), SGLang's one rule (its DFlash2/DSpark walks are sampled;
    SGLANG_DSPARK_USE_GREEDY_DRAFT=1 is not modelled)."""
    if "sglang" in command:
        return RULES["sglang"]
    if "vllm" not in command:
        raise FlashdraftError(
            f"--serving-command {command!r}: expected a 'vllm serve ...' or "
            f"'python -m sglang.launch_server ...' command line"
        )
    import re

    method = re.search(r'"?draft_sample_method"?\s*[:=]\s*"?(\w+)', command)
    if method is None or method.group(1) == "greedy":
        return RULES["vllm"]
    if method.group(1) == "probabilistic":
        return RULES["vllm-probabilistic"]
    raise FlashdraftError(
        f"--serving-command: draft_sample_method {method.group(1)!r} is not built (expected greedy or probabilistic)"
    )
