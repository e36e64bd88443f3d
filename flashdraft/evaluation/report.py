"""Presenting an evaluation summary (`evaluate.run_eval`'s dict, the `--json` content): a
terminal table, and a Markdown report with PNG plots (histogram of acceptance lengths,
per-position acceptance, τ per prompt, τ and per-position acceptance against context length),
the reference side by side when there is one.

Everything here reads only the summary dict, so a report can be rebuilt from a saved JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashdraft.evaluation.category_report import category_sections, category_texts
from flashdraft.evaluation.results import accepts_nothing_problem
from flashdraft.evaluation.tables import bars, markdown_table, save_png, text_table
from flashdraft.files import write_text_atomic

PLOTS = {
    "histogram": "histogram.png",
    "position_acceptance": "position_acceptance.png",
    "tau_per_prompt": "tau_per_prompt.png",
    "tau_by_context": "tau_by_context.png",
    "position_acceptance_by_context": "position_acceptance_by_context.png",
}


# online: the speed-up's bound τ x t(greedy step) / (t(draft) + t(verify)), and its parts
TIMING_ROWS = [
    ("speed-up bound", "speedup_bound"),
    ("speed-up / bound", "speedup_of_bound"),
    ("t(draft) ms per step", "draft_ms"),
    ("t(verify) ms per step", "verify_ms"),
    ("t(greedy step) ms", "greedy_step_ms"),
]


def _fmt(value: Any, signed: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:+.3f}" if signed else f"{value:.3f}"
    if isinstance(value, int) and signed:
        return f"{value:+d}"
    return str(value)


def _at(values: list, index: int):
    return values[index] if index < len(values) else None


def figure_rows(summary: dict[str, Any], per_position: bool = True) -> list[list[str]]:
    """[figure, drafter, (reference, difference)] rows of every pooled figure (`per_position`: with the histogram
    of committed lengths and the acceptance of each draft position)."""
    ref, diff = summary.get("reference"), summary.get("difference")
    rows: list[tuple[str, Any, Any, Any]] = [
        ("steps", summary["num_steps"], ref and ref["num_steps"], diff and diff["num_steps"]),
        ("τ (pooled)", summary["tau"], ref and ref["tau"], diff and diff["tau"]),
        (
            "τ (mean of prompts)",
            summary["tau_prompt_mean"],
            ref and ref["tau_prompt_mean"],
            diff and diff["tau_prompt_mean"],
        ),
    ]
    if summary.get("expected_tau") is not None:  # T > 0: τ without the noise of the acceptance draws
        rows.append(
            (
                "expected τ given the drafts",
                summary["expected_tau"],
                ref and ref.get("expected_tau"),
                diff and diff.get("expected_tau"),
            )
        )
        rows.append(
            ("  its standard error", summary["expected_tau_stderr"], ref and ref.get("expected_tau_stderr"), None)
        )
    if summary["mode"] == "online":
        rows += [
            ("lossless (all prompts)", summary["lossless"], ref and ref["lossless"], None),
            (
                "speculative tokens/s",
                summary["speculative_tokens_per_s"],
                ref and ref["speculative_tokens_per_s"],
                None,
            ),
            ("greedy tokens/s", summary["greedy_tokens_per_s"], ref and ref["greedy_tokens_per_s"], None),
            ("speed-up", summary["speedup"], ref and ref["speedup"], diff and diff["speedup"]),
        ]
        rows += [(name, summary.get(key), ref and ref.get(key), None) for name, key in TIMING_ROWS]
        compiled = summary.get("compile") or {}
        if compiled.get("static"):  # --compile: what compiled, and that the records after the warm-up compiled nothing
            rows.append(("graphs compiled (--compile)", compiled["compiles"], None, None))
            rows.append(("  of them after the warm-up", compiled["after_warm_up"], None, None))
            rows.append(("  graph breaks", compiled["graph_breaks"], None, None))
    length = max(len(summary["histogram"]), len(ref["histogram"]) if ref else 0) if per_position else 0
    for n in range(1, length + 1):
        rows.append(
            (
                f"steps committing {n}",
                _at(summary["histogram"], n - 1),
                ref and _at(ref["histogram"], n - 1),
                diff and diff["histogram"][n - 1],
            )
        )
    for k in range(1, length):
        rows.append(
            (
                f"draft {k} accepted",
                _at(summary["position_acceptance"], k - 1),
                ref and _at(ref["position_acceptance"], k - 1),
                diff and diff["position_acceptance"][k - 1],
            )
        )
    return [[name, _fmt(a)] + ([_fmt(b), _fmt(d, signed=True)] if ref else []) for name, a, b, d in rows]


def prompt_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and one row per prompt: steps and τ (and lossless online), with the reference."""
    ref = summary.get("reference")
    online = summary["mode"] == "online"
    header = ["prompt", "steps", "τ"] + (["lossless"] if online else [])
    if ref:
        header += ["ref steps", "ref τ", "Δτ"]
    ref_prompts = {p["id"]: p for p in ref["per_prompt"]} if ref else {}
    rows = []
    for p in summary["per_prompt"]:
        row = [str(p["id"]), _fmt(p["num_steps"]), _fmt(p["tau"])] + ([_fmt(p["lossless"])] if online else [])
        if ref:
            r = ref_prompts.get(p["id"])
            row += [_fmt(r and r["num_steps"]), _fmt(r and r["tau"]), _fmt(r and p["tau"] - r["tau"], signed=True)]
        rows.append(row)
    return header, rows


def _bucket_name(bucket: dict[str, Any]) -> str:
    return f"{bucket['context_from']}-{bucket['context_to']}"


def context_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and one row per context bucket (tokens before a step's anchor): steps, τ, the first drafts'
    acceptance, online the bucket's step costs and speed-up bound; the reference's τ beside them."""
    ref = summary.get("reference")
    online = summary["mode"] == "online"
    header = ["context", "steps", "τ", "draft 1", "draft 2", "draft 3"]
    header += ["t(draft) ms", "t(verify) ms", "t(greedy) ms", "bound"] if online else []
    header += ["ref τ"] if ref else []
    ref_tau = {_bucket_name(b): b["tau"] for b in ref["by_context"]} if ref else {}
    rows = []
    for b in summary["by_context"]:
        accepted = b["position_acceptance"] or []
        row = [_bucket_name(b), _fmt(b["steps"]), _fmt(b["tau"])] + [_fmt(_at(accepted, k)) for k in range(3)]
        if online:
            row += [_fmt(b[k]) for k in ("draft_ms", "verify_ms", "greedy_step_ms", "speedup_bound")]
        if ref:
            row.append(_fmt(ref_tau.get(_bucket_name(b))))
        rows.append(row)
    return header, rows


def _figure_header(summary: dict[str, Any]) -> list[str]:
    return ["figure", "drafter"] + (["reference", "difference"] if summary.get("reference") else [])


def _context(summary: dict[str, Any]) -> str:
    if summary["context_layers"] is None:  # the n-gram baseline reads tokens only
        context = "no context features"
    else:
        context = f"{summary['context_layers']} context layers {summary['target_layer_ids']}"
    return context + _draft_limit(summary)


def _draft_limit(summary: dict[str, Any]) -> str:
    """Which drafts each step verified, when not all B - 1."""
    k, p = summary.get("num_speculative_tokens"), summary.get("adaptive_threshold")
    c = summary.get("confidence_threshold")
    return (
        (f", verifying the first {k} drafts" if k is not None else "")
        + (f", verifying drafts up to the first under probability {p}" if p is not None else "")
        + (f", verifying drafts up to the first with confidence under {c}" if c is not None else "")
    )


def sampling_line(summary: dict[str, Any]) -> str:
    """How the steps were drafted and verified: greedy (every server alike), or the temperature, the target-side
    filters and the serving rule (`flashdraft.decoding.serving_rules`)."""
    sampling = summary.get("sampling") or {}
    temperature = sampling.get("temperature", summary.get("temperature", 0.0))
    if not temperature or temperature <= 0:
        return "greedy decoding (temperature 0: the same under every server's rule)"
    filters = "".join(
        f", {k.replace('_', '-')} {sampling[k]}" for k in ("top_k", "top_p", "min_p") if sampling.get(k) is not None
    )
    return f"sampled at temperature {temperature}{filters}, under the {summary.get('serving_rule')} serving rule"


def selector_line(s: dict[str, Any]) -> str:
    """What a DFlash2 drafter's candidate selector adds (`flashdraft.evaluation.offline.selector_figures`), in words."""
    return (
        f"candidate selector (DFlash2): τ {s['tau']:.3f} walking it, {s['unary_tau']:.3f} drafting the unary "
        f"argmax ({s['gain']:.3f}x); the target's token is in the unary top-{s['top_k']} at "
        f"{s['top_k_coverage']:.1%} of the {s['verified_positions']} verified positions"
    )


def confidence_lines(s: dict[str, Any]) -> list[str]:
    """A DSpark drafter's confidence head (`evaluation.offline.confidence_figures`), in words: its calibration per
    block position, then the τ and cost of each confidence cut against the uncut block."""
    ece = s["expected_calibration_error"]
    accepted = s.get("acceptance_probability", s["observed"])  # the rule's acceptance probability (greedy: observed)
    pairs = ", ".join(
        f"{p:.2f}/{o:.2f}" for p, o, n in zip(s["predicted"], accepted, s["positions_reached"], strict=True) if n
    )
    lines = [
        f"confidence head (DSpark): predicted/actual acceptance probability per draft position {pairs}; "
        f"expected calibration error {'-' if ece is None else f'{ece:.3f}'}"
    ]
    u = s["uncut"]
    lines.append(f"  uncut: τ {u['tau']:.3f}, {u['drafts_verified_per_step']:.2f} drafts verified per step")
    for cut in s["cuts"]:
        lines.append(
            f"  cut at confidence {cut['threshold']} (DeepSpec's evaluator's cut): τ {cut['tau']:.3f}, "
            f"{cut['drafts_verified_per_step']:.2f} drafts verified per step"
        )
    return lines


def mode_lines(summary: dict[str, Any]) -> list[str]:
    """The chat mode evaluated, the one trained (where they differ) and τ by segment, where the summary has them."""
    from flashdraft.data.chat_mode import describe_mix
    from flashdraft.evaluation.modes import segment_line

    lines = [f"chat mode: {describe_mix(summary['chat_mode'])}"] if summary.get("chat_mode") else []
    if summary.get("chat_mode_warning"):
        lines.append(f"warning: {summary['chat_mode_warning']}")
    segments = segment_line(summary.get("by_segment"))
    if segments:
        lines.append(segments + " (each step in the segment of the first token it commits)")
    served = segment_line((summary.get("served") or {}).get("by_segment"))
    if served:
        lines.append(f"served outputs {served}")
    return lines


def format_summary(summary: dict[str, Any], verbose: bool = True) -> str:
    """The terminal view: pooled figures, then (`verbose`) the per-position figures and the per-prompt and
    per-context-length tables; a τ within noise of 1.0 as a problem line first."""
    title = (
        f"{summary['mode']} evaluation of {summary['checkpoint']}: {summary['num_prompts']} prompts, "
        f"block size {summary['block_size']}, {_context(summary)}"
    )
    title += "\n" + sampling_line(summary)
    if summary.get("reference"):
        ref = summary["reference"]
        title += f"\nreference {ref['checkpoint']}: block size {ref['block_size']}, {_context(ref)}"
    problem = accepts_nothing_problem(summary["tau"], "τ") if summary.get("checkpoint") != "ngram" else None
    if problem:
        title = f"problem: {problem} (trained enough? `flashdraft doctor RUN` says what the run logged)\n" + title
    parts = [title, text_table(_figure_header(summary), figure_rows(summary, per_position=verbose))]
    if verbose:
        parts += [
            text_table(*prompt_rows(summary)),
            "by context length (tokens before the step's anchor):\n" + text_table(*context_rows(summary)),
        ]
    else:
        parts.append("per draft position, per prompt and per context length: --verbose, --report DIR or --json FILE")
    parts += mode_lines(summary)
    parts += category_texts(summary)  # SPEED-Bench: τ by category, both aggregations
    if summary.get("selector"):
        parts.append(selector_line(summary["selector"]))
    if summary.get("confidence"):
        parts.append("\n".join(confidence_lines(summary["confidence"])))
    if "consistency" in summary:
        c = summary["consistency"]
        parts.append(
            f"offline vs online: {'identical acceptance lengths' if c['identical'] else 'DIFFERENT'} "
            f"(offline τ {c['offline_tau']:.3f}, online τ {c['online_tau']:.3f}"
            + (
                f", live features rounded to the cache's {c['live_features_rounded_to']}"
                if c.get("live_features_rounded_to")
                else ""
            )
            + ")"
            + "".join(f"\n  {m}" for m in c["mismatches"])
        )
    if summary.get("served"):
        from flashdraft.evaluation.served import format_served

        parts.append(format_served(summary["served"]))
    return "\n\n".join(parts)


# -- plots ----------------------------------------------------------------------------------


def write_plots(summary: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    # the object API renders without pyplot, so no GUI backend is ever chosen or needed
    from matplotlib.figure import Figure

    ref = summary.get("reference")
    names = ["drafter"] + (["reference"] if ref else [])
    results = [summary] + ([ref] if ref else [])
    length = max(len(r["histogram"]) for r in results)
    paths = {}

    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    bars(
        ax,
        [str(n) for n in range(1, length + 1)],
        [(name, _pad(r["histogram"], length)) for name, r in zip(names, results, strict=True)],
    )
    ax.set(xlabel="tokens committed per step (a + 1)", ylabel="steps", title="Acceptance lengths")
    paths["histogram"] = out_dir / PLOTS["histogram"]
    save_png(fig, paths["histogram"])

    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    for name, r in zip(names, results, strict=True):
        ax.plot(range(1, len(r["position_acceptance"]) + 1), r["position_acceptance"], marker="o", label=name)
    ax.set(
        xlabel="draft position k",
        ylabel="share of steps accepting draft k",
        ylim=(0, 1.05),
        title="Per-position acceptance",
    )
    if ref:
        ax.legend()
    paths["position_acceptance"] = out_dir / PLOTS["position_acceptance"]
    save_png(fig, paths["position_acceptance"])

    ids = [str(p["id"]) for p in summary["per_prompt"]]
    series = [("drafter", [p["tau"] for p in summary["per_prompt"]])]
    if ref:
        by_id = {str(p["id"]): p["tau"] for p in ref["per_prompt"]}
        series.append(("reference", [by_id.get(i, 0.0) for i in ids]))
    fig = Figure(figsize=(max(6, 0.5 * len(ids) + 2), 4))
    ax = fig.add_subplot()
    bars(ax, ids, series)
    ax.tick_params(axis="x", labelrotation=90)
    ax.set(xlabel="prompt", ylabel="τ", title="τ per prompt")
    paths["tau_per_prompt"] = out_dir / PLOTS["tau_per_prompt"]
    save_png(fig, paths["tau_per_prompt"])
    return paths | _context_plots(summary, names, results, out_dir)


def _context_plots(summary: dict[str, Any], names: list[str], results: list[dict], out_dir: Path) -> dict[str, Path]:
    """τ against context length (each bucket at its midpoint) for drafter and reference, and the drafter's
    per-position acceptance against context length (one line per draft position)."""
    from matplotlib.figure import Figure

    def mid(b: dict) -> float:
        return (b["context_from"] + b["context_to"]) / 2

    paths = {}
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    for name, r in zip(names, results, strict=True):
        filled = [b for b in r["by_context"] if b["steps"]]
        ax.plot([mid(b) for b in filled], [b["tau"] for b in filled], marker="o", label=name)
    ax.set(
        xlabel="context length (tokens before the anchor; bucket midpoints)", ylabel="τ", title="τ by context length"
    )
    if len(results) > 1:
        ax.legend()
    paths["tau_by_context"] = out_dir / PLOTS["tau_by_context"]
    save_png(fig, paths["tau_by_context"])

    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    filled = [b for b in summary["by_context"] if b["steps"]]
    drafts = len(summary["position_acceptance"])
    for k in range(min(drafts, 8)):  # the first drafts carry most of τ; more lines would not read
        ax.plot(
            [mid(b) for b in filled], [b["position_acceptance"][k] for b in filled], marker="o", label=f"draft {k + 1}"
        )
    ax.set(
        xlabel="context length (tokens before the anchor; bucket midpoints)",
        ylim=(0, 1.05),
        ylabel="share of steps accepting draft k",
        title="Per-position acceptance by context length",
    )
    if filled:
        ax.legend(fontsize="small", ncol=2)
    paths["position_acceptance_by_context"] = out_dir / PLOTS["position_acceptance_by_context"]
    save_png(fig, paths["position_acceptance_by_context"])
    return paths


def _pad(values: list, length: int) -> list:
    return list(values) + [0] * (length - len(values))


def write_report(summary: dict[str, Any], out_dir: str | Path) -> Path:
    """Write `report.md` and its PNG plots into out_dir; returns the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(summary, out)
    context = (
        f"context layers found in `fc`: {summary['context_layers']} (target_layer_ids {summary['target_layer_ids']})"
        if summary["context_layers"] is not None
        else f"{summary.get('checkpoint_form')}: no context features"
    )
    lines = [
        f"# Drafter evaluation: {summary['checkpoint']}",
        "",
        f"- mode: **{summary['mode']}**; target `{summary.get('target')}`; records: {summary.get('records_source')}",
        f"- block size {summary['block_size']}{_draft_limit(summary)}; {context}; at most "
        f"{summary.get('max_blocks') or 'all'} blocks per prompt",
        f"- {sampling_line(summary)}",
        *[f"- {line}" for line in mode_lines(summary)],
    ]
    if summary.get("reference"):
        ref = summary["reference"]
        lines.append(
            f"- reference: {ref['checkpoint']} (block size {ref['block_size']}, {_context(ref)}); "
            f"difference = drafter - reference"
        )
    lines += [
        "- τ = tokens committed per step (accepted drafts + the bonus token), pooled over all steps; "
        "per-position acceptance = share of steps whose k-th draft was accepted.",
    ]
    if summary["mode"] == "online":
        lines.append(
            "- speed-up bound = τ × t(greedy step) / (t(draft) + t(verify)), the costs per step measured "
            "inside the decode loop; speed-up / bound = the share of it the loop delivers."
        )
    lines += [
        "",
        "## Figures",
        "",
        markdown_table(_figure_header(summary), figure_rows(summary)),
        "",
        f"![acceptance lengths]({plots['histogram'].name})",
        "",
        f"![per-position acceptance]({plots['position_acceptance'].name})",
        "",
        "## Per prompt",
        "",
        markdown_table(*prompt_rows(summary)),
        "",
        f"![tau per prompt]({plots['tau_per_prompt'].name})",
        "",
        "## By context length",
        "",
        "Each step counted in the bucket of its context: the tokens before its anchor.",
        "",
        markdown_table(*context_rows(summary)),
        "",
        f"![tau by context]({plots['tau_by_context'].name})",
        "",
        f"![per-position acceptance by context]({plots['position_acceptance_by_context'].name})",
        "",
    ]
    lines += category_sections(summary, out)  # SPEED-Bench: τ by category, both aggregations
    if summary.get("selector"):
        lines += ["## Candidate selector", "", selector_line(summary["selector"]) + ".", ""]
    if summary.get("confidence"):
        first, *cuts = confidence_lines(summary["confidence"])
        lines += ["## Confidence head", "", first + ".", "", *[f"- {c.strip()}" for c in cuts], ""]
    if "consistency" in summary:
        c = summary["consistency"]
        lines += [
            "## Offline vs online",
            "",
            f"{'Identical' if c['identical'] else 'DIFFERENT'} acceptance lengths "
            f"(offline τ {c['offline_tau']:.3f}, online τ {c['online_tau']:.3f}).",
            "",
        ]
        lines += [f"- {m}" for m in c["mismatches"]]
    path = out / "report.md"
    write_text_atomic(path, "\n".join(lines).rstrip() + "\n", "the evaluation report")  # last: its plots are there
    return path
