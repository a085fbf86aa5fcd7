"""Render any benchmark JSON as one self-contained HTML page.

The JSON is walked as a tree: the scalars of each object form a key/value table, nested
objects become sections, every list of objects becomes a table, and when such a list has a
name-like string column and numeric columns, each numeric column also gets a bar chart.
An optional top-level "curves" entry is drawn as line plots (see `_curves`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from rollwise.observe import html, plots
from rollwise.observe.metrics import number

# Preferred label columns for bar charts, in order; otherwise the first all-string column.
NAME_KEYS = ("name", "label", "method", "engine", "config", "variant", "allocator", "id")
MAX_CHARTS_PER_TABLE = 12


def write_bench_report(json_path: Path, out: Path | None = None) -> Path:
    """Write an HTML page for the benchmark JSON at `json_path` (default: same name, .html)."""
    json_path = Path(json_path)
    data = json.loads(json_path.read_text(encoding="utf-8"))
    out = Path(out) if out is not None else json_path.with_suffix(".html")
    title = f"rollwise benchmark: {json_path.stem}"
    curves = data.pop("curves", None) if isinstance(data, dict) else None
    body = f"<h1>{escape(title)}</h1>\n" + "\n".join(_curves(curves) + _render(data, depth=0))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html.page(title, body), encoding="utf-8")
    return out


def _curves(curves: Any) -> list[str]:
    """Line plots of an optional top-level "curves" entry:
    {title: {"x": x label, "y": y label, "series": {name: [[x, y], ...]}}}."""
    if not isinstance(curves, dict):
        return []
    figures = []
    for title, c in curves.items():
        series = {name: [(float(x), float(y)) for x, y in points]
                  for name, points in c.get("series", {}).items()}
        png = plots.line_plot(series, c.get("x", "x"), c.get("y", "y"), title)
        if png is not None:
            figures.append(html.figure(png, title))
    return [_heading("curves", 0), '<div class="figures">', *figures, "</div>"] if figures else []


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, dict) for x in value)


def _is_section(value: Any) -> bool:
    """A value rendered as its own section rather than as one cell."""
    return isinstance(value, dict) or (
        isinstance(value, list) and any(isinstance(x, (dict, list)) for x in value)
    )


def _heading(text: str, depth: int) -> str:
    level = min(2 + depth, 4)
    return f"<h{level}>{escape(text)}</h{level}>"


def _render(node: Any, depth: int) -> list[str]:
    """HTML fragments for one JSON value."""
    if isinstance(node, dict):
        parts = []
        scalars = {k: v for k, v in node.items() if not _is_section(v)}
        if scalars:
            parts.append(html.kv_table(scalars))
        for key, value in node.items():
            if _is_section(value):
                parts.append(_heading(str(key), depth))
                parts.extend(_render(value, depth + 1))
        return parts
    if _is_records(node):
        return [html.table(node), *_charts(node)]
    if isinstance(node, list) and any(_is_section(x) for x in node):
        parts = []
        for i, item in enumerate(node):
            parts.append(_heading(f"[{i}]", depth))
            parts.extend(_render(item, depth + 1))
        return parts
    return [f"<p>{escape(html.fmt_value(node))}</p>"]


def name_key(rows: Sequence[dict[str, Any]]) -> str | None:
    """The column that names each row: a preferred name, else the first all-string column.

    >>> name_key([{"tok_s": 3.0, "engine": "hf"}, {"tok_s": 9.0, "engine": "native"}])
    'engine'
    """
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    stringy = [c for c in columns if all(isinstance(r.get(c), str) for r in rows)]
    for key in NAME_KEYS:
        if key in stringy:
            return key
    return stringy[0] if stringy else None


def numeric_keys(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Columns whose present values are all numbers (bools excluded), in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    return [
        c
        for c in columns
        if any(c in r for r in rows) and all(number(r, c) is not None for r in rows if c in r)
    ]


def _charts(rows: list[dict[str, Any]]) -> list[str]:
    """A bar chart per numeric column, labelled by the name column (if there is one)."""
    label = name_key(rows)
    if label is None:
        return []
    figures = []
    for key in numeric_keys(rows)[:MAX_CHARTS_PER_TABLE]:
        named = [(r[label], r[key]) for r in rows if key in r]
        png = plots.bar_chart([n for n, _ in named], [v for _, v in named], key)
        if png is not None:
            figures.append(html.figure(png, key))
    return ['<div class="figures">', *figures, "</div>"] if figures else []
