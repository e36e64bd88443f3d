"""Tables and plots every report shares: text and Markdown tables, grouped bars, a PNG written whole."""

from __future__ import annotations

import io
from pathlib import Path

from flashdraft.files import write_atomic


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in [header] + rows
    ]
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def bars(ax, labels: list[str], series: list[tuple[str, list[float]]]) -> None:
    """Grouped bars: one group per label, one bar per series."""
    width = 0.8 / len(series)
    for s, (name, values) in enumerate(series):
        xs = [i + (s - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, values, width=width, label=name)
    ax.set_xticks(range(len(labels)), labels)
    if len(series) > 1:
        ax.legend()


def save_png(fig, path: Path) -> None:
    """A plot written whole or not at all (a full disk: `DiskFullError` with its size, no cut PNG)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    data = buffer.getvalue()
    write_atomic(path, lambda tmp: tmp.write_bytes(data), "a report plot", len(data))
