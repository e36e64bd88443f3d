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
    """The terminal's tables of an eval summary: its walk's, then each tree budget's (`eval --tree`), where the
    records have categories (the served ones are `served.format_served`'s)."""
    trees = summary.get("trees") or {}
    texts = [category_text(summary.get("by_category"))]
    texts += [
        category_text(r.get("by_category"), f"tree {trees['rule']} budget {r['budget']} by category")
        for r in trees.get("budgets", [])
    ]
    return [t for t in texts if t]


def category_sections(summary: dict[str, Any], out_dir: Path) -> list[str]:
    """The report's sections and plots of an eval summary: its walk's, the engine's counters' (`--served`) and each
    tree budget's (accept rate: accepted over the nodes verified)."""
    lines = category_section(summary.get("by_category"), out_dir)
    served = (summary.get("served") or {}).get("by_category")
    lines += category_section(served, out_dir, "Served by category (the engine's counters)", prefix="served_")
    trees = summary.get("trees") or {}
    for r in trees.get("budgets", []):
        heading = f"Tree {trees['rule']} budget {r['budget']} by category"
        lines += category_section(r.get("by_category"), out_dir, heading, prefix=f"tree{r['budget']}_")
    return lines
