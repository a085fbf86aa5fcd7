"""Observe: metrics as JSON lines, terminal progress, and self-contained HTML reports.

Light on purpose: no torch import, so the CLI and reports load fast.

May import: types, system, replay.
"""

from rollwise.observe.bench_report import write_bench_report
from rollwise.observe.metrics import MetricsWriter, read_metrics, summarize_lengths
from rollwise.observe.progress import format_step_line, progress_bar
from rollwise.observe.report import write_report

__all__ = [
    "MetricsWriter",
    "format_step_line",
    "progress_bar",
    "read_metrics",
    "summarize_lengths",
    "write_bench_report",
    "write_report",
]
