"""Memory a run can see (rollwise.runtime): the process's peak resident set per step and per
phase, and thread counts that follow the cores free of other work."""

from __future__ import annotations

import sys

import pytest
import torch

from rollwise import runtime
from rollwise.observe.progress import format_step_line
from rollwise.rundir import StepTimer

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


@linux
def test_peaks_are_per_interval_not_per_process() -> None:
    """A 400 MiB tensor freed inside a block shows in that block's peak and the step's, but
    not in the next step's (the kernel's high-water mark is reset at each reading)."""
    runtime.device_memory()
    with runtime.rss_peak() as quiet:
        pass
    with runtime.rss_peak() as busy:
        x = torch.ones(100 * 2**20)  # 400 MiB, touched
        del x
    assert busy["mb"] > quiet["mb"] + 350
    step = runtime.device_memory()["peak_rss_mb"]
    assert step >= busy["mb"] - 1
    assert runtime.device_memory()["peak_rss_mb"] < busy["mb"] - 350
    assert runtime.run_peak_rss_mb() >= busy["mb"] - 1


@linux
def test_step_timer_records_each_phase_peak() -> None:
    timer = StepTimer()
    with timer("rollout"):
        x = torch.ones(50 * 2**20)  # 200 MiB
        del x
    with timer("train"):
        pass
    assert timer.peaks["rollout"] > timer.peaks["train"] + 150
    assert set(timer.phases) == set(timer.peaks) == {"rollout", "train"}


def test_step_line_shows_the_peak() -> None:
    line = format_step_line({"step": 2, "num_steps": 5, "peak_rss_mb": 2150.0})
    assert line == "step 2/5 | rss 2.1 GB"


def test_threads_follow_the_free_cores(monkeypatch) -> None:
    """With other work on one of two cores, threads=0 means 1 thread, not 2."""
    samples = iter([{0: (100, 1000), 1: (100, 1000)},  # (idle, total) jiffies per core
                    {0: (190, 1100), 1: (105, 1100)}])  # core 0: 90% idle; core 1: 5%
    monkeypatch.setattr(runtime, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    try:
        assert runtime.configure(0) == 1 and torch.get_num_threads() == 1
        assert runtime.configure(2) == 2  # an explicit count wins
    finally:
        torch.set_num_threads(before)
    idle = iter([{0: (0, 0), 1: (0, 0)}, {0: (100, 100), 1: (80, 100)}])
    monkeypatch.setattr(runtime, "_cpu_times", lambda: next(idle))
    assert runtime.free_cores(0) == 2
