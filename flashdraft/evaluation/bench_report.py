"""`flashdraft bench`'s terminal table and its Markdown report with plots (speed-up against concurrency per set,
τ per set, acceptance per position), from the summary `bench.run_bench` returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashdraft.evaluation.report import markdown_table, save_png, text_table
from flashdraft.files import write_text_atomic

PLOTS = {
    "speedup": "speedup_by_concurrency.png",
    "tau": "tau_by_set.png",
    "position_acceptance": "position_acceptance.png",
}
HEADER = [
    "set",
    "conc.",
    "tok/s alone",
    "tok/s drafter",
    "speed-up",
    "TPOT speed-up",
    "predicted",
    "break-even τ",
    "τ counters",
    "τ delivered",
    "τ flashdraft",
]


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _with_error(figure: dict[str, float | None], digits: int = 2) -> str:
    value, error = figure["value"], figure["error"]
    return _num(value, digits) + "x" + (f" ± {error:.{digits}f}" if error is not None else "")


def rows(summary: dict[str, Any]) -> list[list[str]]:
    """One row per set and concurrency: both servers' output tok/s, the measured speed-ups with their errors over
    the repeats, the predicted one and the break-even τ, τ from the counters and flashdraft's."""
    out = []
    for s in summary["sets"]:
        for row in s["by_concurrency"]:
            p = row["predicted"]
            out.append(
                [
                    s["prompts"],
                    str(row["concurrency"]),
                    _num(row["baseline"]["output_tok_s"], 1),
                    _num(row["speculative"]["output_tok_s"], 1),
                    _with_error(row["speedup_output_tok_s"]),
                    _with_error(row["speedup_tpot"]),
                    "-" if p["output_tok_s"] is None else f"{p['output_tok_s']:.2f}x",
                    _num(p["break_even_tau"]),
                    _num(row["tau"]),
                    _num(row["tau_delivered"]),
                    _num(s["flashdraft_tau"]),
                ]
            )
    return out


SPEED_BENCH_HEADER = ["split", "input", "category", "conc.", "speed-up", "predicted", "τ counters", "τ flashdraft"]


def speed_bench_rows(summary: dict[str, Any]) -> list[list[str]]:
    """SPEED-Bench sets by input length and category (on a throughput split: entropy tier) and concurrency: the
    measured speed-up beside the predicted one (none where no set is SPEED-Bench's)."""
    out = []
    for s in summary["sets"]:
        labels = s.get("speed_bench")
        for row in s["by_concurrency"] if labels else []:
            p = row["predicted"]["output_tok_s"]
            out.append(
                [
                    labels["split"],
                    labels["input_length"] or "-",
                    str(labels["category"]),
                    str(row["concurrency"]),
                    _with_error(row["speedup_output_tok_s"]),
                    "-" if p is None else f"{p:.2f}x",
                    _num(row["tau"]),
                    _num(s["flashdraft_tau"]),
                ]
            )
    return out


def _lossless_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    greedy = summary["temperature"] <= 0
    for s in summary["sets"]:
        what = "the target's greedy outputs" if greedy else "samples of the target's p"
        verdict = f"lossless: {str(s['lossless']).lower()} (both servers' outputs {what}"
        ties = sum(o.get("near_ties", 0) for o in s["outputs"].values())
        verdict += f", {ties} past a near-tie)" if greedy else ")"
        lines.append(f"{s['prompts']}: {verdict}")
        diff = s["first_difference"]
        if diff is not None:
            lines.append(
                f"  the servers' outputs first differ at {diff['request']}, token {diff['token']}: "
                f"{diff['baseline']} alone, {diff['speculative']} with the drafter"
            )
        lines += [f"  {p}" for p in s["problems"][:3]]
    return lines


def _setting(summary: dict[str, Any]) -> str:
    t = "greedy" if summary["temperature"] <= 0 else f"T {summary['temperature']:g}"
    return (
        f"{summary['engine']} on {summary['machine']}; {t}, {summary['max_new_tokens']} new tokens at most, "
        f"{summary['repeats']} repeats, k = {summary['num_speculative_tokens']}"
    )


def format_bench(summary: dict[str, Any]) -> str:
    """The terminal's table with the setting, the CPU note when it applies and the lossless verdicts."""
    lines = [f"served speed-up: {_setting(summary)}"]
    if summary.get("note"):
        lines.append(summary["note"])
    lines += [
        text_table(HEADER, rows(summary)),
        *(
            ["SPEED-Bench by input length and category:", text_table(SPEED_BENCH_HEADER, speed_bench_rows(summary))]
            if speed_bench_rows(summary)
            else []
        ),
        *_lossless_lines(summary),
        f"the servers' and vLLM's client's logs: {summary['logs']}",
        f"lossless: {str(summary['lossless']).lower()}",
    ]
    return "\n".join(lines)


def write_plots(summary: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """The three plots: measured and predicted speed-up against concurrency per set; τ per set (served at each
    concurrency and flashdraft's); acceptance per position at each set's lowest concurrency."""
    from matplotlib.figure import Figure

    paths = {name: out_dir / file for name, file in PLOTS.items()}
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for s in summary["sets"]:
        cs = [r["concurrency"] for r in s["by_concurrency"]]
        measured = [r["speedup_output_tok_s"] for r in s["by_concurrency"]]
        ax.errorbar(
            cs,
            [m["value"] for m in measured],
            yerr=[m["error"] or 0 for m in measured],
            marker="o",
            capsize=3,
            label=f"{s['prompts']} measured",
        )
        ax.plot(
            cs,
            [r["predicted"]["output_tok_s"] or float("nan") for r in s["by_concurrency"]],
            "--x",
            label=f"{s['prompts']} predicted",
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(summary["concurrency"], [str(c) for c in summary["concurrency"]])
    ax.set(
        xlabel="concurrency",
        ylabel="speed-up (output tok/s)",
        title=summary["engine"] + (" (a CPU's figures)" if summary.get("cpu_engine") else ""),
    )
    ax.legend(fontsize=7)
    save_png(fig, paths["speedup"])
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    names = [s["prompts"] for s in summary["sets"]]
    width = 0.8 / (len(summary["concurrency"]) + 1)
    for j, c in enumerate(summary["concurrency"]):
        taus = [next(r["tau"] for r in s["by_concurrency"] if r["concurrency"] == c) or 0 for s in summary["sets"]]
        ax.bar([i + j * width for i in range(len(names))], taus, width, label=f"served, concurrency {c}")
    ax.bar(
        [i + len(summary["concurrency"]) * width for i in range(len(names))],
        [s["flashdraft_tau"] or 0 for s in summary["sets"]],
        width,
        label="flashdraft (offline, delivered)",
    )
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set(ylabel="τ", title="τ per set")
    ax.legend(fontsize=7)
    save_png(fig, paths["tau"])
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for s in summary["sets"]:
        for r in s["by_concurrency"]:
            ax.plot(
                range(1, len(r["position_acceptance"]) + 1),
                r["position_acceptance"],
                marker="o",
                label=f"{s['prompts']}, concurrency {r['concurrency']}",
            )
    ax.set(xlabel="draft position", ylabel="accepted share of steps", title="acceptance per position (counters)")
    ax.legend(fontsize=7)
    save_png(fig, paths["position_acceptance"])
    return paths


def write_bench_report(summary: dict[str, Any], out_dir: str | Path) -> Path:
    """`report.md` and its plots in `out_dir`; returns the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = write_plots(summary, out)
    text = [
        f"# Served speed-up: {Path(summary['drafter']).name} on {Path(summary['target']).name}",
        "",
        f"{_setting(summary)}.",
        "",
    ]
    if summary.get("note"):
        text += [f"**{summary['note']}.**", ""]
    text += [
        markdown_table(HEADER, rows(summary)),
        "",
        "Speed-ups: with the drafter over the target alone, mean over "
        "the repeats ± its standard error; predicted from flashdraft's τ and the step costs of the same runs "
        "(docs/benchmarks.md#served-speed-up). τ counters: 1 + accepted / drafts from the engine's counters "
        "(drafts accepted past a request's end included); τ delivered: output tokens after the first per "
        "drafting step; τ flashdraft: its offline walk of the same requests (delivered).",
        "",
    ]
    if speed_bench_rows(summary):
        text += [
            "## SPEED-Bench by input length and category",
            "",
            "Each category (on a throughput split: entropy tier) served as its own set, as `vllm bench serve` "
            "sends it (each request's first turn).",
            "",
            markdown_table(SPEED_BENCH_HEADER, speed_bench_rows(summary)),
            "",
        ]
    text += [f"- {line.strip()}" for line in _lossless_lines(summary)] + [""]
    text += [f"![{name}]({path.name})" for name, path in paths.items()]
    report = out / "report.md"
    write_text_atomic(report, "\n".join(text) + "\n", what="the bench report")
    return report
