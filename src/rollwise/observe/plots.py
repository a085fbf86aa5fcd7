"""Small matplotlib plots rendered off-screen (Agg) to base64 PNG for self-contained HTML.

Figures are built with `matplotlib.figure.Figure` and an explicit Agg canvas, never through
`pyplot`, so no global backend state changes and nothing opens a window. Each function
returns None when it has nothing to draw, so callers simply omit that plot.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

Series = dict[str, list[tuple[float, float]]]  # label -> [(x, y), ...]


def _figure(width: float = 6.4, height: float = 3.4) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def fig_to_base64(fig: Figure) -> str:
    """The figure as a base64-encoded PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def line_plot(series: Series, xlabel: str, ylabel: str, title: str) -> str | None:
    """One line per non-empty series (markers when it has few points); None if all empty."""
    series = {k: sorted(v) for k, v in series.items() if v}
    if not series:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    all_int = True
    for label, points in series.items():
        xs, ys = zip(*points)
        all_int = all_int and all(isinstance(x, int) for x in xs)
        ax.plot(xs, ys, label=label, marker="o" if len(points) <= 30 else None, markersize=3)
    if all_int:  # steps, rollouts: no tick at step 2.5
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig_to_base64(fig)


def histograms(samples: dict[str, Sequence[float]], xlabel: str, title: str) -> str | None:
    """Overlaid histograms on shared bins, one per non-empty sample; None if all empty."""
    samples = {k: list(v) for k, v in samples.items() if len(v)}
    if not samples:
        return None
    lo = min(min(v) for v in samples.values())
    hi = max(max(v) for v in samples.values())
    bins = min(40, max(1, int(hi - lo) + 1))
    fig = _figure()
    ax = fig.add_subplot()
    for label, values in samples.items():
        ax.hist(
            values, bins=bins, range=(lo, hi + 1), alpha=0.55, label=f"{label} (n={len(values)})"
        )
    ax.set(xlabel=xlabel, ylabel="count", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig_to_base64(fig)


def stacked_bars(
    xs: Sequence[float], parts: dict[str, Sequence[float]], xlabel: str, ylabel: str, title: str
) -> str | None:
    """Bars at `xs` stacked from `parts` (each as long as `xs`); None if nothing to stack."""
    parts = {k: list(v) for k, v in parts.items() if any(v)}
    if not xs or not parts:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom = [0.0] * len(xs)
    for label, values in parts.items():
        ax.bar(xs, values, bottom=bottom, label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    return fig_to_base64(fig)


def bar_chart(labels: Sequence[str], values: Sequence[float], title: str) -> str | None:
    """A labelled vertical bar chart; None if there are no bars."""
    if not labels:
        return None
    fig = _figure(width=max(4.0, min(12.0, 0.6 * len(labels) + 2)), height=3.2)
    ax = fig.add_subplot()
    positions = list(range(len(labels)))
    bars = ax.bar(positions, values, color="#4c72b0")
    ax.bar_label(bars, labels=[f"{v:.4g}" for v in values], fontsize="small")
    ax.set_xticks(
        positions,
        [str(x) for x in labels],
        rotation=30 if len(labels) > 4 else 0,
        ha="right" if len(labels) > 4 else "center",
        fontsize="small",
    )
    ax.set_title(title)
    ax.margins(y=0.12)  # room for the value labels above the bars
    ax.grid(alpha=0.3, axis="y")
    return fig_to_base64(fig)
