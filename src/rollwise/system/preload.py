"""jemalloc for the rollwise commands: found, preloaded by running the command again, and
detected. Kept free of torch, so that the re-run happens before anything heavy is imported
(`system.runtime.tune_allocator` then leaves such a process's allocator alone)."""

from __future__ import annotations

import ctypes.util
import functools
import importlib.util
import os
import sys
from pathlib import Path

JEMALLOC_ENV = "ROLLWISE_JEMALLOC"  # a jemalloc library to preload instead of the found one
_PRELOADED = "ROLLWISE_PRELOADED"  # set on the re-run: LD_PRELOAD as it was before
_entry = {"may_rerun": False}  # the console entry point only: never a caller's process


def jemalloc_library() -> str | None:
    """The jemalloc library `run.allocator = 'jemalloc'` preloads: $ROLLWISE_JEMALLOC
    (a path; '0' for none), else the one Ray ships (the `ray` extra), else the system's
    libjemalloc; None when there is none."""
    chosen = os.environ.get(JEMALLOC_ENV)
    if chosen:
        return chosen if Path(chosen).is_file() else None
    spec = importlib.util.find_spec("ray")  # located, not imported
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / "core" / "libjemalloc.so").is_file():
            return str(Path(folder) / "core" / "libjemalloc.so")
    return ctypes.util.find_library("jemalloc")


@functools.cache
def jemalloc_loaded() -> bool:
    """Whether this process allocates with jemalloc (it is mapped: preloaded at start)."""
    try:
        return "jemalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def preload_env(library: str) -> dict[str, str]:
    """The environment of a process that starts with `library` preloaded."""
    before = os.environ.get("LD_PRELOAD", "")
    return dict(os.environ, LD_PRELOAD=":".join(x for x in (library, before) if x))


def allow_rerun() -> None:
    """Called by the `rollwise` console entry point: this process is the command's own, and
    `preload_allocator` may run it again (a test's or a notebook's process never is)."""
    _entry["may_rerun"] = True


def preload_allocator(mode: str) -> None:
    """Run this command again, at once, with jemalloc preloaded, when `mode` is 'jemalloc'
    and it is not loaded yet; else return.
    LD_PRELOAD is the only way in: the C allocator is chosen when a process starts. The
    re-run does not try again and puts LD_PRELOAD back as it was, so the processes it
    starts (sandboxed code, reward workers) do not load jemalloc. On Linux only."""
    if _PRELOADED in os.environ:  # this is the re-run
        before = os.environ.pop(_PRELOADED)
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    if mode != "jemalloc" or jemalloc_loaded() or not _entry["may_rerun"]:
        return
    library = jemalloc_library() if sys.platform.startswith("linux") else None
    if library is None:
        raise ValueError("run.allocator = 'jemalloc': no jemalloc library found (install the "
                         "ray extra, or set ROLLWISE_JEMALLOC to a libjemalloc.so)")
    env = preload_env(library) | {_PRELOADED: os.environ.get("LD_PRELOAD", "")}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
