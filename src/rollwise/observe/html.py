"""Tiny HTML helpers for self-contained report pages: inline CSS, no scripts, no external files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from typing import Any

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1100px; color: #222; padding: 0 1em; }
h1 { margin-bottom: .2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; }
.muted { color: #777; }
.figures { display: flex; flex-wrap: wrap; gap: 1em; }
.figure { flex: 1 1 30em; }
.figure img { max-width: 100%; }
.headline { font-size: 1.3em; margin: .6em 0; }
table { border-collapse: collapse; margin: .6em 0; font-size: .9em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .85em; }
"""


def fmt_value(value: Any) -> str:
    """A cell value as text: numbers to 4 significant digits, structures as compact JSON.

    >>> fmt_value(0.123456), fmt_value(12345.67), fmt_value(True), fmt_value([1, 2])
    ('0.1235', '12345.7', 'True', '[1, 2]')
    """
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        # 4 significant digits, but no exponent for seconds or token counts like 12345.6
        return f"{value:.1f}" if 1e4 <= abs(value) < 1e15 else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(", ", ": "))
    return str(value)


def _cell(value: Any, tag: str = "td") -> str:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    cls = "" if numeric else ' class="text"'
    return f"<{tag}{cls}>{escape(fmt_value(value))}</{tag}>"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """An HTML table of dict rows; columns are the union of keys in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    head = "".join(f'<th class="text">{escape(str(c))}</th>' for c in columns)
    body = "".join(
        "<tr>" + "".join(_cell(row.get(c, "")) for c in columns) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def kv_table(items: dict[str, Any]) -> str:
    """A two-column key/value table."""
    body = "".join(
        f'<tr><th class="text">{escape(str(k))}</th>{_cell(v)}</tr>' for k, v in items.items()
    )
    return f"<table><tbody>{body}</tbody></table>"


def figure(png_base64: str, caption: str) -> str:
    """An embedded PNG with a caption."""
    alt = escape(caption, quote=True)
    return (
        f'<div class="figure"><img src="data:image/png;base64,{png_base64}" alt="{alt}">'
        f'<div class="muted">{escape(caption)}</div></div>'
    )


def page(title: str, body: str) -> str:
    """A complete HTML document with the inline stylesheet."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>"
        f"<body>\n{body}\n</body></html>\n"
    )
