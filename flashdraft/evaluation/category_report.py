"""τ by category in the terminal and the Markdown report (`evaluation.categories`' figures, read from the summary
dict alone, so a report can be rebuilt from a saved JSON): one row per category and the split's overall, both
aggregations side by side with the first-turn figure and llama.cpp's rate, and the plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashdraft.evaluation.tables import bars, markdown_table, save_png, text_table

CATEGORY_PLOTS = {
    "tau_by_category": "tau_by_category.png",
    "position_acceptance_by_category": "position_acceptance_by_category.png",
}
HEADER = [
    "category",
    "rows",
    "turns",
    "steps",
    "τ per request",
    "τ step-weighted",
    "τ 1st turn",
    "accept rate",
    "draft 1",
    "draft 2",
    "draft 3",
]
LEGEND = (
    "τ per request: mean over requests of each one's tokens per step over every turn (Model Optimizer's "
    "specdec_bench); τ step-weighted: 1 + accepted / drafts over every step (vLLM's and aiperf's server counters); "
    "τ 1st turn: step-weighted over each request's first turn only (what `vllm bench serve` sends); accept rate: "
    "accepted / drafted tokens (llama.cpp's, a rate, not a length); draft k: share of steps accepting the k-th draft"
)


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def category_rows(figures: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and one row per category, the overall last."""
    rows = []
    for c in figures["categories"] + [figures["overall"]]:
        accepted = c["position_acceptance"] or []
        rows.append(
            [
                c["category"],
                str(c["rows"]),
                str(c["turns"]),
                str(c["steps"]),
                _fmt(c["tau_request_mean"]),
                _fmt(c["tau_step_weighted"]),
                _fmt(c["first_turn"]["tau_step_weighted"]),
                _fmt(c["acceptance_rate"]),
            ]
            + [_fmt(accepted[k] if k < len(accepted) else None) for k in range(3)]
        )
    return HEADER, rows


# the figures a reference is shown beside the drafter with: (column, key; first_turn's step-weighted for "first_turn")
COMPARED = (
    ("τ per request", "tau_request_mean"),
    ("τ step-weighted", "tau_step_weighted"),
    ("τ 1st turn", "first_turn"),
    ("accept rate", "acceptance_rate"),
)


def _figure(c: dict[str, Any] | None, key: str) -> Any:
    if c is None:
        return None
    return c["first_turn"]["tau_step_weighted"] if key == "first_turn" else c[key]


def comparison_rows(figures: dict[str, Any], reference: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and one row per category (the overall last): each figure of the drafter, the reference's beside it,
    and their difference (drafter - reference)."""
    header = ["category", "rows", "turns"]
    for name, _ in COMPARED:
        header += [name, "reference", "difference"]
    theirs = {c["category"]: c for c in reference["categories"] + [reference["overall"]]}
    rows = []
    for c in figures["categories"] + [figures["overall"]]:
        row = [c["category"], str(c["rows"]), str(c["turns"])]
        for _, key in COMPARED:
            mine, ref = _figure(c, key), _figure(theirs.get(c["category"]), key)
            row += [_fmt(mine), _fmt(ref), _fmt(mine - ref if mine is not None and ref is not None else None)]
        rows.append(row)
    return header, rows


def _reference_figures(summary: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The reference's name and τ by category where both it and the drafter have one."""
    reference = summary.get("reference") or {}
    if not summary.get("by_category") or not reference.get("by_category"):
        return None
    return reference.get("checkpoint", "reference"), reference["by_category"]


def comparison_text(summary: dict[str, Any]) -> str | None:
    """The terminal's drafter-beside-reference table by category, or None without a reference or categories."""
    found = _reference_figures(summary)
    if found is None:
        return None
    name, reference = found
    return (
        f"drafter vs reference {name} by category:\n{text_table(*comparison_rows(summary['by_category'], reference))}"
    )


def category_text(figures: dict[str, Any] | None, title: str = "by category") -> str | None:
    """The terminal's table, or None where the records have no category."""
    if not figures:
        return None
    split = f" of SPEED-Bench {figures['split']}" if figures.get("split") else ""
    return f"{title}{split}:\n{text_table(*category_rows(figures))}\n{LEGEND}"


def category_section(
    figures: dict[str, Any] | None, out_dir: Path, heading: str = "By category", prefix: str = ""
) -> list[str]:
    """The report's section with its plots written into `out_dir`, their names prefixed with `prefix` (no lines
    where the records have no category)."""
    if not figures:
        return []
    plots = write_category_plots(figures, out_dir, prefix)
    split = f" (SPEED-Bench {figures['split']})" if figures.get("split") else ""
    return [
        f"## {heading}{split}",
        "",
        LEGEND + ".",
        "",
        markdown_table(*category_rows(figures)),
        "",
        f"![tau by category]({plots['tau_by_category'].name})",
        "",
        f"![per-position acceptance by category]({plots['position_acceptance_by_category'].name})",
        "",
    ]


def write_category_plots(figures: dict[str, Any], out_dir: Path, prefix: str = "") -> dict[str, Path]:
    """τ per category (the two aggregations and the first turn, grouped bars) and each category's per-position
    acceptance (a line per category)."""
    from matplotlib.figure import Figure

    categories = figures["categories"] + [figures["overall"]]
    names = [c["category"] for c in categories]
    paths = {}
    fig = Figure(figsize=(max(6, 0.9 * len(names) + 2), 4))
    ax = fig.add_subplot()
    bars(
        ax,
        names,
        [
            ("per request (Model Optimizer)", [c["tau_request_mean"] or 0.0 for c in categories]),
            ("step-weighted (vLLM, aiperf)", [c["tau_step_weighted"] or 0.0 for c in categories]),
            ("first turn (vllm bench serve)", [c["first_turn"]["tau_step_weighted"] or 0.0 for c in categories]),
        ],
    )
    ax.tick_params(axis="x", labelrotation=45)
    ax.set(ylabel="τ", title="τ by category")
    paths["tau_by_category"] = out_dir / (prefix + CATEGORY_PLOTS["tau_by_category"])
    save_png(fig, paths["tau_by_category"])

    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    for c in categories:
        accepted = c["position_acceptance"] or []
        ax.plot(range(1, len(accepted) + 1), accepted, marker="o", label=c["category"])
    ax.set(xlabel="draft position k", ylabel="share of steps accepting draft k", ylim=(0, 1.05))
    ax.set_title("Per-position acceptance by category")
    ax.legend(fontsize="small", ncol=2)
    paths["position_acceptance_by_category"] = out_dir / (prefix + CATEGORY_PLOTS["position_acceptance_by_category"])
    save_png(fig, paths["position_acceptance_by_category"])
    return paths


def category_texts(summary: dict[str, Any]) -> list[str]:
    """The terminal's tables of an eval summary: its walk's, the reference's beside it, then each tree budget's
    (`eval --tree`), where the records have categories (the served ones are `served.format_served`'s)."""
    trees = summary.get("trees") or {}
    texts = [category_text(summary.get("by_category")), comparison_text(summary)]
    texts += [
        category_text(r.get("by_category"), f"tree {trees['rule']} budget {r['budget']} by category")
        for r in trees.get("budgets", [])
    ]
    return [t for t in texts if t]


def category_sections(summary: dict[str, Any], out_dir: Path) -> list[str]:
    """The report's sections and plots of an eval summary: its walk's, the reference's beside it and its own, the
    engine's counters' (`--served`) and each tree budget's (accept rate: accepted over the nodes verified)."""
    lines = category_section(summary.get("by_category"), out_dir)
    found = _reference_figures(summary)
    if found is not None:  # the reference's figures beside the drafter's, then its own table and plots
        name, reference = found
        lines += [
            f"## Drafter vs reference {name} by category",
            "",
            "Each figure of the drafter, the reference's on the same records beside it, and the difference "
            "(drafter - reference).",
            "",
            markdown_table(*comparison_rows(summary["by_category"], reference)),
            "",
        ]
        lines += category_section(reference, out_dir, f"Reference {name} by category", prefix="reference_")
    served = (summary.get("served") or {}).get("by_category")
    lines += category_section(served, out_dir, "Served by category (the engine's counters)", prefix="served_")
    trees = summary.get("trees") or {}
    for r in trees.get("budgets", []):
        heading = f"Tree {trees['rule']} budget {r['budget']} by category"
        lines += category_section(r.get("by_category"), out_dir, heading, prefix=f"tree{r['budget']}_")
    return lines
