"""Process-level settings that make CPU training fast (threads, the memory allocator), and the
memory peaks a run reports."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from rollwise.system.preload import jemalloc_loaded

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL

ALLOCATORS = ("reuse", "jemalloc", "compact")
_in_use = {"allocator": "system"}  # what the last tune_allocator left in use


def tune_allocator(mode: str = "reuse") -> str:
    """Set how the C allocator trades memory for speed; the allocator in use: 'jemalloc',
    'reuse', 'compact' or 'system' (not glibc, or left alone).

    With glibc, by default every allocation over its mmap threshold is mapped afresh and
    returned on free, so each decode step and each backward pass pays for page faults that
    zero fresh pages (half the CPU time in the kernel; a training step about 1.5x slower).
    `reuse` (rollwise's default) serves large tensors from the heap and keeps freed memory
    for reuse: fast, but the heap fragments, and the resident set ends well above the live
    tensors (0.75 GB above them in a LoRA update of the quickstart). `compact` does the
    opposite: every allocation over 64 KiB is mapped afresh and returned when freed, and
    the heap's free top is trimmed past 1 MiB, so the resident set follows the live tensors,
    at the page faults' cost. jemalloc (preloaded at start, `preload.preload_allocator`)
    keeps freed blocks in size classes: nearly `compact`'s memory at a smaller cost in time
    (docs/performance.md). A process that did not preload it (the Python API, a Ray actor)
    asked for 'jemalloc' gets 'reuse'. ROLLWISE_NO_MALLOPT=1 leaves glibc alone.
    """
    if mode not in ALLOCATORS:
        raise ValueError(f"run.allocator must be one of {', '.join(ALLOCATORS)}, not '{mode}'")
    _in_use["allocator"] = _tune(mode)
    return _in_use["allocator"]


def allocator_in_use() -> str:
    """What the last `tune_allocator` left in use (run headers and summaries show it)."""
    return _in_use["allocator"]


def _tune(mode: str) -> str:
    if jemalloc_loaded():
        return "jemalloc"
    if os.environ.get("ROLLWISE_NO_MALLOPT"):
        return "system"
    mode = "compact" if mode == "compact" else "reuse"
    mmap_at, trim_at = (1 << 30, 1 << 31) if mode == "reuse" else (1 << 16, 1 << 20)
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_at) and libc.mallopt(_M_TRIM_THRESHOLD, trim_at)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return "system"
    return mode if ok else "system"


def trim_heap() -> None:
    """Give freed heap memory back to the system (jemalloc: purge every arena; glibc:
    malloc_trim; elsewhere nothing), so that a resident-set figure taken next counts live
    memory, not what the allocator keeps for reuse."""
    try:
        if jemalloc_loaded():  # its symbols are the process's own (preloaded)
            ctypes.CDLL(None).mallctl(f"arena.{_ALL_ARENAS}.purge".encode(), None, None,
                                      None, ctypes.c_size_t(0))
        else:
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _cpu_times() -> dict[int, tuple[int, int]]:
    """{cpu: (idle jiffies, total jiffies)} from /proc/stat (Linux)."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
            out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return out


def free_cores(sample_s: float = 0.1) -> int:
    """Cores this process may run on that other work is not using now: a core counts when
    it was at least half idle over `sample_s` (/proc/stat). At least 1; every allowed core
    where /proc/stat cannot be read (macOS). A busy neighbour on one of two cores makes this
    1: two threads would leave one waiting on the busy core at every parallel operation."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(
        range(os.cpu_count() or 1))
    try:
        before = _cpu_times()
        time.sleep(sample_s)
        after = _cpu_times()
    except (OSError, ValueError, IndexError):
        return max(1, len(allowed))
    free = 0
    for cpu in allowed:
        if cpu in before and cpu in after:
            idle = after[cpu][0] - before[cpu][0]
            total = after[cpu][1] - before[cpu][1]
            free += total <= 0 or idle >= 0.5 * total
    return max(1, free)


def configure(threads: int = 0, allocator: str = "reuse") -> int:
    """Torch CPU threads (0: the cores free now, `free_cores`) and the allocator's mode
    (`tune_allocator`); returns the thread count."""
    threads = threads or free_cores()
    torch.set_num_threads(threads)
    tune_allocator(allocator)
    return threads


_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
_step_peak_kb = 0  # the highest resident set seen since the last device_memory(), in KiB
_run_peak_kb = 0  # ... since the process started (resets of the kernel's mark folded in)


def _rss_hwm_kb() -> int:
    """The kernel's high-water mark of this process's resident set, in KiB: VmHWM from
    /proc/self/status (Linux), else getrusage's ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def _fold_and_reset() -> int:
    """Fold the current high-water mark into the step's and the run's peak, then reset the
    kernel's mark to the current resident set ("5" into /proc/self/clear_refs, Linux 4.0+;
    where refused the mark keeps growing and later peaks are the process's so far)."""
    global _step_peak_kb, _run_peak_kb
    hwm = _rss_hwm_kb()
    _step_peak_kb, _run_peak_kb = max(_step_peak_kb, hwm), max(_run_peak_kb, hwm)
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass
    return hwm


@contextlib.contextmanager
def rss_peak() -> Iterator[dict[str, float]]:
    """Measure the peak resident set of the process during the block: yields a dict whose
    `mb` is filled in (MiB) when the block ends. The whole process is counted (every thread:
    in the asynchronous driver a phase's figure includes what runs beside it), not the
    children (Ray actors, sandboxed reward processes)."""
    out: dict[str, float] = {}
    _fold_and_reset()
    try:
        yield out
    finally:
        out["mb"] = _fold_and_reset() / 1024


def run_peak_rss_mb() -> float:
    """The process's peak resident set so far (MiB), across every reset of the kernel's mark."""
    return max(_run_peak_kb, _rss_hwm_kb()) / 1024


def device_memory() -> dict[str, float]:
    """Memory peaks since the last call, then reset: `peak_rss_mb`, the process's resident
    set (CPU memory: weights, optimizer state, activations, caches; MiB, from the kernel's
    VmHWM, see `rss_peak`), and on a GPU `cuda_max_allocated_mb` (all CUDA devices in use)."""
    global _step_peak_kb
    _fold_and_reset()
    out = {"peak_rss_mb": _step_peak_kb / 1024}
    _step_peak_kb = 0
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return out
    peak = 0
    for i in range(torch.cuda.device_count()):
        peak = max(peak, torch.cuda.max_memory_allocated(i))
        torch.cuda.reset_peak_memory_stats(i)
    return out | {"cuda_max_allocated_mb": peak / 2**20}
