"""Process-level settings that make CPU training fast: threads and the memory allocator."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def tune_allocator() -> bool:
    """Serve large tensors from the heap and keep freed memory for reuse (glibc only).

    By default glibc maps every allocation over its mmap threshold afresh and returns it on
    free, so each decode step and each backward pass pays for page faults that zero fresh
    pages (seen here as half the CPU time in the kernel; a training step about 1.5x slower).
    Set ROLLWISE_NO_MALLOPT=1 to leave the allocator alone.
    """
    if os.environ.get("ROLLWISE_NO_MALLOPT"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return False
    return bool(ok)


def configure(threads: int = 0) -> None:
    """Torch CPU threads (0: all cores) and the allocator."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    tune_allocator()


def device_memory() -> dict[str, float]:
    """The GPU memory peak since the last call (`cuda_max_allocated_mb`, all CUDA devices in
    use), then reset; {} where CUDA was never used in this process."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    peak = 0
    for i in range(torch.cuda.device_count()):
        peak = max(peak, torch.cuda.max_memory_allocated(i))
        torch.cuda.reset_peak_memory_stats(i)
    return {"cuda_max_allocated_mb": peak / 2**20}

