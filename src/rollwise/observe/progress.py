"""Terminal progress: a transient `rich` bar and a one-line summary per training step.

The bar switches itself off when stdout is not a terminal (logs, CI, pipes) or when the
environment sets ROLLWISE_NO_PROGRESS=1; it then still accepts `.advance()` calls.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from rollwise.observe.metrics import number


class ProgressHandle:
    """What `progress_bar` yields: advance it; a disabled handle only counts."""

    def __init__(self, progress: Progress | None, task: TaskID | None) -> None:
        self._progress = progress
        self._task = task
        self.completed = 0.0

    def advance(self, n: float = 1) -> None:
        """Mark `n` more units done."""
        self.completed += n
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)

    def set_description(self, description: str) -> None:
        """Change the text shown left of the bar."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=description)

    @property
    def enabled(self) -> bool:
        """Whether a bar is actually drawn."""
        return self._progress is not None


def progress_enabled() -> bool:
    """True when stdout is a terminal and ROLLWISE_NO_PROGRESS is not "1"."""
    if os.environ.get("ROLLWISE_NO_PROGRESS", "") == "1":
        return False
    return sys.stdout.isatty()


@contextmanager
def progress_bar(
    total: float | None, description: str = "", enabled: bool | None = None
) -> Iterator[ProgressHandle]:
    """A transient bar with count, elapsed time and ETA; `enabled=None` decides automatically.

    >>> with progress_bar(3, "rollout", enabled=False) as bar:
    ...     bar.advance(2)
    >>> bar.completed
    2.0
    """
    if enabled is None:
        enabled = progress_enabled()
    if not enabled:
        yield ProgressHandle(None, None)
        return
    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield ProgressHandle(progress, task)


def format_step_line(record: dict[str, Any]) -> str:
    """One line summarising a training-step metrics record; missing keys are left out.

    Reads: step, num_steps, reward_mean, eval_accuracy, response_len_p50, zero_var_frac,
    time_rollout, time_reward, time_train (seconds), rollout_tokens_per_s, and the verifier
    calls that failed (reward_errors, reward_timeouts, reward_infra) when there were any,
    the process's peak resident set (peak_rss_mb) and the GPU memory peak
    (cuda_max_allocated_mb) on a GPU.

    >>> format_step_line({"step": 3, "num_steps": 20, "reward_mean": 0.414, "time_train": 12.34})
    'step 3/20 | reward 0.41 | train 12.3s'
    >>> format_step_line({"step": 4, "reward_errors": 2, "reward_timeouts": 0})
    'step 4 | reward failures: 2 raised/NaN'
    """
    parts: list[str] = []
    step, total = number(record, "step"), number(record, "num_steps")
    if step is not None:
        parts.append(f"step {int(step)}" + (f"/{int(total)}" if total is not None else ""))
    for key, label in (
        ("reward_mean", "reward"),
        ("eval_accuracy", "acc"),
        ("response_len_p50", "len p50"),
        ("zero_var_frac", "zero-var"),
    ):
        v = number(record, key)
        if v is not None:
            shown = f"{v:.0f}" if key == "response_len_p50" else f"{v:.2f}"
            parts.append(f"{label} {shown}")
    times = [
        f"{label} {t:.1f}s"
        for key, label in (
            ("time_rollout", "rollout"),
            ("time_reward", "reward"),
            ("time_train", "train"),
        )
        if (t := number(record, key)) is not None
    ]
    if times:
        parts.append(" ".join(times))
    parts += _throughput_and_memory(record)
    failed = [f"{int(n)} {label}" for key, label in (("reward_errors", "raised/NaN"),
                                                      ("reward_timeouts", "timed out"),
                                                      ("reward_infra", "infra, masked"))
              if (n := number(record, key))]
    if failed:
        parts.append("reward failures: " + ", ".join(failed))
    return " | ".join(parts)


def _throughput_and_memory(record: dict[str, Any]) -> list[str]:
    """The step line's tokens/s, memory peaks, learner busy fraction and async queue parts."""
    parts: list[str] = []
    tps = number(record, "rollout_tokens_per_s")
    if tps is not None:
        parts.append(f"{tps:.0f} tok/s")
    rss = number(record, "peak_rss_mb")
    if rss is not None:
        parts.append(f"rss {rss / 1024:.1f} GB")
    gpu = number(record, "cuda_max_allocated_mb")
    if gpu is not None:
        parts.append(f"gpu {gpu:.0f} MB")
    busy = number(record, "learner_busy_time_frac")
    if busy is not None:
        parts.append(f"learner busy {busy:.0%}")
    if number(record, "time_wait") is not None:  # the asynchronous driver
        stale = sum(number(record, f"staleness_hist_{k}") or 0 for k in ("1", "2", "3plus"))
        parts.append(f"queue {int(number(record, 'queue_depth') or 0)} stale {int(stale)}")
    return parts
