"""τ by category (SPEED-Bench's, `data/speed_bench.py`), counted the way each peer counts, side by side.

A request is one benchmark row; each of its turns is one record (a turn asked after the target's own answer to the
one before). From the steps of each record, per category and over the split:

- `tau_request_mean`, Model Optimizer's (`specdec_bench`): a request's τ is its committed tokens over its steps
  across every turn; the category's is the mean of its requests' (each request weighted equally);
- `tau_step_weighted`, the servers' (vLLM's and aiperf's counters, `1 + accepted / drafts` over all requests):
  every step weighted equally, equal to 1 + `accepted` / `drafts` here;
- `acceptance_rate`, llama.cpp's: accepted draft tokens over drafted ones (a rate, not a length): the drafted
  tokens counted where they are (a server's counters, a tree's nodes), else each step verifying `drafts_per_step`;
- `position_acceptance`: the share of steps whose k-th draft was accepted;
- `first_turn`: the same over each request's first turn only, what `vllm bench serve` measures (its loader sends
  `messages[0]` alone); aiperf, like Model Optimizer, sends every turn.

Counts come from acceptance lengths (flashdraft's walks) or from a server's counters (`served`), one `TurnCounts` per
record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashdraft.evaluation.config import EvalConfig
from flashdraft.evaluation.records import EvalRecord
from flashdraft.evaluation.results import EvalResult

AGGREGATIONS = {
    "tau_request_mean": "per-request mean over every turn (Model Optimizer's specdec_bench)",
    "tau_step_weighted": "step-weighted, 1 + accepted / drafts (vLLM's and aiperf's server counters)",
    "first_turn": "first turn only, step-weighted (what `vllm bench serve` sends)",
    "acceptance_rate": "accepted / drafted tokens (llama.cpp's acceptance rate)",
}


@dataclass(frozen=True)
class TurnCounts:
    """One record's drafting steps: how many, the drafts accepted in all, and per position (k = 0: the first)."""

    steps: int
    accepted: int
    accepted_per_position: tuple[int, ...]
    drafted: int | None = None  # draft tokens verified in all, where counted (a server's, a tree's nodes)

    @classmethod
    def of_lengths(cls, lengths: list[int], drafts: int, drafted: int | None = None) -> TurnCounts:
        """From tokens committed per step (accepted drafts + 1)."""
        per_position = tuple(sum(n - 1 > k for n in lengths) for k in range(drafts))
        return cls(len(lengths), sum(n - 1 for n in lengths), per_position, drafted)


def category_of(record: EvalRecord) -> str | None:
    return (record.meta or {}).get("category")


def by_category(
    records: list[EvalRecord], counts: list[TurnCounts], drafts_per_step: int | None
) -> dict[str, Any] | None:
    """The figures per category and over all (`overall`) of records with a category (None: no record has one).
    `counts[i]` are `records[i]`'s steps; `drafts_per_step`: drafts each step verifies (None: not fixed, as under an
    adaptive or confidence cut: no acceptance rate)."""
    if not any(category_of(r) for r in records):
        return None
    groups: dict[str, list[tuple[EvalRecord, TurnCounts]]] = {}
    for record, c in zip(records, counts, strict=False):  # served: the requests before a failure
        groups.setdefault(category_of(record) or "(none)", []).append((record, c))
    pairs = [p for group in groups.values() for p in group]
    splits = sorted({(r.meta or {}).get("split") for r in records} - {None})
    return {
        "split": ",".join(splits) or None,
        "aggregations": AGGREGATIONS,
        "categories": [_figures(name, groups[name], drafts_per_step) for name in sorted(groups)],
        "overall": _figures("overall", pairs, drafts_per_step),
    }


def _figures(name: str, pairs: list[tuple[EvalRecord, TurnCounts]], drafts_per_step: int | None) -> dict[str, Any]:
    figures = {"category": name, **_aggregate(pairs, drafts_per_step)}
    first = [(r, c) for r, c in pairs if r.turn == 0]
    figures["first_turn"] = {k: v for k, v in _aggregate(first, drafts_per_step).items() if k != "turns"}
    return figures


def _aggregate(pairs: list[tuple[EvalRecord, TurnCounts]], drafts_per_step: int | None) -> dict[str, Any]:
    requests: dict[str, list[TurnCounts]] = {}
    for record, c in pairs:
        requests.setdefault(record.request_id or record.id, []).append(c)
    per_request = [
        1 + sum(c.accepted for c in turns) / steps
        for turns in requests.values()
        if (steps := sum(c.steps for c in turns))
    ]
    steps = sum(c.steps for _, c in pairs)
    accepted = sum(c.accepted for _, c in pairs)
    width = max((len(c.accepted_per_position) for _, c in pairs), default=0)
    per_position = [
        sum(c.accepted_per_position[k] for _, c in pairs if k < len(c.accepted_per_position)) for k in range(width)
    ]
    return {
        "rows": len(requests),
        "turns": len(pairs),
        "steps": steps,
        "drafts": steps,  # one drafting step verifies one draft block: vLLM's num_drafts
        "accepted": accepted,
        "tau_request_mean": sum(per_request) / len(per_request) if per_request else None,
        "tau_step_weighted": 1 + accepted / steps if steps else None,
        "acceptance_rate": _rate(accepted, [c for _, c in pairs], drafts_per_step),
        "position_acceptance": [a / steps for a in per_position] if steps else None,
    }


def _rate(accepted: int, counts: list[TurnCounts], drafts_per_step: int | None) -> float | None:
    """llama.cpp's acceptance rate: accepted over drafted tokens, counted where every record counts them, else each
    step verifying `drafts_per_step` (None: not fixed, no rate)."""
    if counts and all(c.drafted is not None for c in counts):
        drafted = sum(c.drafted for c in counts)
    else:
        drafted = sum(c.steps for c in counts) * drafts_per_step if drafts_per_step else 0
    return accepted / drafted if drafted else None


def result_by_category(result: EvalResult, records: list[EvalRecord], cfg: EvalConfig) -> dict[str, Any] | None:
    """τ by category of a walk (`evaluation.categories`); None where the records have none. A step verifies
    --num-speculative-tokens drafts, or all; under an adaptive or confidence cut no fixed number (no rate)."""
    cut = cfg.adaptive_threshold is not None or cfg.confidence_threshold is not None
    drafts = None if cut else cfg.num_speculative_tokens or result.max_drafts
    counts = [TurnCounts.of_lengths(p.acceptance_lengths, result.max_drafts) for p in result.per_prompt]
    return by_category(records, counts, drafts)
