"""`eval --compare-target`: a drafter's τ against the target as served (`--target-model`, e.g. quantised) and a
reference target (the bf16 one) side by side, each on its own records (its own completions and states: offline from
each one's completions or cache, online lossless against each one's own greedy output), the drop in τ overall, by
context length and by segment, and how often the two targets' greedy tokens differ.

The disagreement share is measured on the served target's records: both targets read the same tokens and their
greedy choices at every completion position are compared. A drafter can at best keep the tokens the served target
itself chooses; where the reference chooses otherwise, a drafter trained on the reference's states learnt the other
token, so the share bounds what such a drafter loses (reference doc, section 17: 0-1.6 % of positions for W8A8,
1.6-7.8 % for FP8 on a 1.4 M target).

The two targets are loaded one after the other (never both in memory): the served one evaluates and reads its
greedy tokens, then the reference does the same.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.records import load_eval_records
from flashdraft.target.model import TargetModel
from flashdraft.target.quantisation import mismatch


@dataclass(frozen=True)
class CompareTarget:
    """The reference target and its own records (`--compare-completions`, `--compare-cached-hidden-states`);
    with --prompts each target decodes its own completions and neither is needed."""

    target_model: str
    completions: str | None = None
    cached_hidden_states: str | None = None


def reference_options(options: dict[str, Any], compare: CompareTarget) -> dict[str, Any]:
    """The eval options of the reference's run: the same, but its own record source."""
    if options.get("prompts"):
        return dict(options)
    if options.get("completions") and not compare.completions:
        raise FlashdraftError(
            f"--compare-target {compare.target_model}: --completions holds the served target's completions; give the "
            f"reference's own with --compare-completions (flashdraft generate --target-model {compare.target_model})"
        )
    if options.get("cached_hidden_states") and not compare.cached_hidden_states:
        raise FlashdraftError(
            f"--compare-target {compare.target_model}: --cached-hidden-states holds the served target's states; give "
            f"the reference's own with --compare-cached-hidden-states (flashdraft cache --target-model "
            f"{compare.target_model})"
        )
    return options | {"completions": compare.completions, "cached_hidden_states": compare.cached_hidden_states}


def context_edges_of(summary: dict[str, Any]) -> list[int]:
    """The context-bucket edges a summary used (so the reference's buckets are the same)."""
    buckets = summary["by_context"]
    return [b["context_from"] for b in buckets] + [buckets[-1]["context_to"]] if buckets else []


@torch.no_grad()
def greedy_tokens(target: TargetModel, sequences: list[tuple[str, list[int], list[int]]]) -> list[list[int]]:
    """Each (id, prompt, completion)'s greedy token at every completion position, reading the sequence's own tokens
    before it (teacher forcing): [len(completion)] per sequence."""
    chosen = []
    for _, prompt, completion in sequences:
        ids = torch.tensor([prompt + completion], device=target.device)  # [1, P + M]
        out = target.forward(ids)
        start = len(prompt) - 1  # the logits at position i choose token i + 1
        chosen.append(out.logits_at(start, start + len(completion))[0].argmax(-1).tolist())
    return chosen


def served_sequences(target: TargetModel, options: dict[str, Any], summary: dict[str, Any]):
    """The served target's (id, prompt, completion) records, as evaluated: its completions file or cache, or
    (prompts) the greedy output the evaluation decoded (online: the speculative output, lossless; offline: decoded
    again here)."""
    records, _ = load_eval_records(
        target,
        cached_hidden_states=options.get("cached_hidden_states"),
        completions=options.get("completions"),
        prompts=options.get("prompts"),
        num_prompts=options.get("num_prompts"),
        verify=options.get("verify", True),
        allow_foreign=options.get("allow_foreign", False),
        chat_template_kwargs=options.get("chat_template_kwargs"),
        enable_thinking=options.get("enable_thinking"),
    )
    evaluated = {p["id"]: p for p in summary["per_prompt"]}
    records = [r for r in records if r.id in evaluated]
    if records and not records[0].completion_ids:
        if summary["mode"] == "online":
            return [(r.id, r.prompt_ids, list(evaluated[r.id]["output_ids"])) for r in records]
        from flashdraft.evaluation.online import greedy_baseline

        runs = greedy_baseline(target, records, summary.get("max_new_tokens") or options.get("max_new_tokens") or 256)
        return [(r.id, r.prompt_ids, list(run.output_ids)) for r, run in zip(records, runs, strict=True)]
    return [(r.id, r.prompt_ids, r.completion_ids) for r in records]


def disagreement(served: list[list[int]], reference: list[list[int]], ids: list[str]) -> dict[str, Any]:
    """Positions where the two targets' greedy tokens differ, overall and per record."""
    per_record = []
    for record_id, a, b in zip(ids, served, reference, strict=True):
        differ = sum(x != y for x, y in zip(a, b, strict=True))
        per_record.append({"id": record_id, "positions": len(a), "differ": differ})
    positions = sum(r["positions"] for r in per_record)
    differ = sum(r["differ"] for r in per_record)
    return {
        "positions": positions,
        "differ": differ,
        "share": differ / positions if positions else None,
        "records_agreeing_throughout": sum(r["differ"] == 0 for r in per_record),
        "per_record": per_record,
    }


def _drop(served: float | None, reference: float | None) -> float | None:
    return None if served is None or reference is None else reference - served


def _by_category(served: dict[str, Any], reference: dict[str, Any]) -> list[dict[str, Any]]:
    """The drop per category where the records carry one (SPEED-Bench's, `evaluation.categories`): τ step-weighted."""
    if not served.get("by_category") or not reference.get("by_category"):
        return []
    theirs = {c["category"]: c for c in reference["by_category"]["categories"]}
    rows = []
    for c in served["by_category"]["categories"]:
        r = theirs.get(c["category"], {})
        rows.append(
            {
                "dataset": f"category {c['category']}",
                "served_tau": c["tau_step_weighted"],
                "reference_tau": r.get("tau_step_weighted"),
                "drop": _drop(c["tau_step_weighted"], r.get("tau_step_weighted")),
            }
        )
    return rows


def comparison(served: dict[str, Any], reference: dict[str, Any], greedy: dict[str, Any], quantised: dict) -> dict:
    """The side-by-side figures of two eval summaries (the drafter against the served and the reference target)."""
    by_context = []
    ref_buckets = {(b["context_from"], b["context_to"]): b for b in reference["by_context"]}
    for b in served["by_context"]:
        r = ref_buckets.get((b["context_from"], b["context_to"]), {})
        by_context.append(
            {
                "context_from": b["context_from"],
                "context_to": b["context_to"],
                "served_tau": b["tau"],
                "reference_tau": r.get("tau"),
                "drop": _drop(b["tau"], r.get("tau")),
                "served_steps": b["steps"],
                "reference_steps": r.get("steps"),
            }
        )
    by_segment = None
    if served.get("by_segment") and reference.get("by_segment"):
        by_segment = {
            name: {
                "served_tau": s.get("tau"),
                "reference_tau": reference["by_segment"].get(name, {}).get("tau"),
                "drop": _drop(s.get("tau"), reference["by_segment"].get(name, {}).get("tau")),
            }
            for name, s in served["by_segment"].items()
            if isinstance(s, dict)
        }
    figures = {
        "mode": served["mode"],
        "served_target": served["target"],
        "reference_target": reference["target"],
        "served_quantisation": quantised["served"],
        "reference_quantisation": quantised["reference"],
        "served_tau": served["tau"],
        "reference_tau": reference["tau"],
        "drop": _drop(served["tau"], reference["tau"]),
        "served_lossless": served.get("lossless"),
        "reference_lossless": reference.get("lossless"),
        "by_dataset": [
            {
                "dataset": served["records_source"],
                "reference_records": reference["records_source"],
                "served_tau": served["tau"],
                "reference_tau": reference["tau"],
                "drop": _drop(served["tau"], reference["tau"]),
            }
        ]
        + _by_category(served, reference),
        "by_context": by_context,
        "by_segment": by_segment,
        "greedy_disagreement": greedy,
    }
    if "consistency" in served and "consistency" in reference:  # offline and online, each target
        figures["offline_online"] = {
            side: {k: s["consistency"][k] for k in ("offline_tau", "online_tau", "identical")}
            for side, s in (("served", served), ("reference", reference))
        }
    return figures


def _evaluate(drafter: str, target: TargetModel, log, options: dict[str, Any]) -> dict[str, Any]:
    """`flashdraft eval` of `drafter` ("ngram": the baseline) against a loaded target, as `api.evaluate_drafter`."""
    from flashdraft.evaluation.config import NGRAM, EvalConfig
    from flashdraft.evaluation.run import run_eval

    ngram = drafter == NGRAM
    cfg = EvalConfig(
        None if ngram else drafter,
        str(target.path),
        proposer=NGRAM if ngram else "dflash",
        device=str(target.device),
        dtype=target.dtype,
        **options,
    )
    return run_eval(cfg, log, target=target)


def evaluate_against_both(
    drafter: str, served_target: str, compare: CompareTarget, *, device, dtype, log, options: dict[str, Any]
) -> dict[str, Any]:
    """The drafter evaluated against the served target, then the reference (each on its own records, the same
    context buckets), and their `comparison` as the summary's `compare_target`."""
    ref_options = reference_options(options, compare)
    served = TargetModel.load(served_target, device or "cpu", dtype or torch.float32)
    log(f"served target {served_target}: quantisation {served.quantisation.describe()}")
    summary = _evaluate(drafter, served, log, options)
    sequences = served_sequences(served, options, summary)
    ids = [record_id for record_id, _, _ in sequences]
    served_choice = greedy_tokens(served, sequences)
    served_quantisation = served.quantisation
    del served
    gc.collect()

    reference = TargetModel.load(compare.target_model, device or "cpu", dtype or torch.float32)
    log(f"reference target {compare.target_model}: quantisation {reference.quantisation.describe()}")
    if options.get("context_buckets") is None:  # the served run's buckets, so the two line up
        ref_options = ref_options | {"context_buckets": context_edges_of(summary)}
    ref_summary = _evaluate(drafter, reference, log, ref_options)
    reference_choice = greedy_tokens(reference, sequences)
    said = mismatch(served_quantisation, reference.quantisation)
    quantised = {"served": served_quantisation.describe(), "reference": reference.quantisation.describe()}
    summary["compare_target"] = comparison(
        summary, ref_summary, disagreement(served_choice, reference_choice, ids), quantised
    )
    summary["compare_target"]["quantisation_differs"] = said is not None
    summary["compare_target"]["reference_summary"] = ref_summary
    return summary


def _tau(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_comparison(figures: dict[str, Any]) -> str:
    """The terminal view of `compare_target`: τ side by side, the drop, by context and segment, the disagreement."""
    g = figures["greedy_disagreement"]
    lines = [
        f"τ against the served and the reference target ({figures['mode']}):",
        f"  served    {figures['served_target']}: τ {_tau(figures['served_tau'])}"
        + (f", lossless {figures['served_lossless']}" if figures["served_lossless"] is not None else "")
        + f"; {figures['served_quantisation']}",
        f"  reference {figures['reference_target']}: τ {_tau(figures['reference_tau'])}"
        + (f", lossless {figures['reference_lossless']}" if figures["reference_lossless"] is not None else "")
        + f"; {figures['reference_quantisation']}",
        f"  drop (reference - served): {_tau(figures['drop'])}",
    ]
    for d in figures["by_dataset"]:
        lines.append(
            f"  dataset {d['dataset']}: served {_tau(d['served_tau'])}, reference {_tau(d['reference_tau'])}, "
            f"drop {_tau(d['drop'])}"
        )
    contexts = [
        f"[{b['context_from']}, {b['context_to']}) {_tau(b['served_tau'])} vs {_tau(b['reference_tau'])}"
        for b in figures["by_context"]
        if b["served_steps"] or b["reference_steps"]
    ]
    if contexts:
        lines.append("  by context (served vs reference τ): " + "; ".join(contexts))
    if figures.get("by_segment"):
        parts = [
            f"{name} {_tau(s['served_tau'])} vs {_tau(s['reference_tau'])}" for name, s in figures["by_segment"].items()
        ]
        lines.append("  by segment (served vs reference τ): " + "; ".join(parts))
    if figures.get("offline_online"):
        for side, c in figures["offline_online"].items():
            lines.append(
                f"  {side}: offline τ {_tau(c['offline_tau'])}, online τ {_tau(c['online_tau'])}, "
                f"{'identical' if c['identical'] else 'DIFFERENT'} acceptance lengths"
            )
    share = "-" if g["share"] is None else f"{100 * g['share']:.2f} %"
    lines.append(
        f"  greedy disagreement: the two targets choose different tokens at {g['differ']} of {g['positions']} "
        f"completion positions ({share}) of the served target's records; {g['records_agreeing_throughout']} of "
        f"{len(g['per_record'])} records agree throughout"
    )
    return "\n".join(lines)
