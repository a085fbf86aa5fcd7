"""Where the sandboxed runner's interpreter lives, what it must not see, and the command
lines that put it inside bubblewrap's or util-linux unshare's namespaces.

Imports the standard library only; `rollwise.rewards.sandbox` starts the runner with these.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def interpreter_paths() -> tuple[str, ...]:
    """The directories the runner's interpreter needs (prefixes, standard library, the real
    executable's directory), real paths, none beneath another."""
    paths = {os.path.realpath(p) for p in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
        sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
        os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(sys.executable))}
    return tuple(sorted(p for p in paths
                        if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths)))


def hidden_dirs() -> list[str]:
    """Directories replaced by an empty tmpfs under bwrap and unshare: the shared temporary
    directories (writes there would outlive the execution and reach its siblings) and the
    home directory (keys, tokens, history)."""
    hide = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
    home = os.path.realpath(os.path.expanduser("~"))
    if home not in ("/", "") and os.path.isdir(home) and home not in hide:
        hide.append(home)
    return hide


def _beneath(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def readable_by_others(path: str) -> bool:
    """Whether a user that owns nothing can reach `path` (every directory on the way
    searchable by others): where the interpreter lives decides whether the dropped code's
    lazy imports work."""
    parts = Path(os.path.realpath(path)).parts
    for i in range(1, len(parts) + 1):
        try:
            mode = os.stat(os.path.join(*parts[:i])).st_mode
        except OSError:
            return False
        if not mode & 0o001:
            return False
    return True


@lru_cache(maxsize=1)
def interpreter_readable_by_others() -> bool:
    return all(readable_by_others(p) for p in interpreter_paths())


LANDLOCK_READ = ("/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime",
                 "/dev/urandom", "/dev/random", "/dev/zero")


def wrapper_argv(level: str, workdir: str) -> list[str]:
    """The command line that puts the runner inside `level`'s namespaces."""
    root = os.geteuid() == 0
    if level == "bwrap":
        argv = [shutil.which("bwrap") or "bwrap", "--unshare-ipc", "--unshare-pid",
                "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--as-pid-1", "--ro-bind", "/", "/",
                "--dev", "/dev", "--proc", "/proc"]
        if not root:
            argv[1:1] = ["--unshare-user"]
        hide = hidden_dirs()
        for path in hide:
            argv += ["--tmpfs", path]
        for path in interpreter_paths():  # the interpreter may live beneath one of them
            if _beneath(path, hide):
                # bwrap makes missing parents 0700: the code's user (nobody) must pass them
                parents = [str(p) for p in reversed(Path(path).parents)
                           if _beneath(str(p), hide) and str(p) not in hide]
                for parent in parents:
                    argv += ["--perms", "0755", "--dir", parent]
                argv += ["--ro-bind", path, path]
        argv += ["--bind", workdir, workdir, "--chdir", workdir]
        if root:  # the code's process drops to nobody itself, which needs these two
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        return argv
    if level == "unshare":
        argv = [shutil.which("unshare") or "unshare"]
        if not root:
            argv += ["--user", "--map-root-user"]
        return argv + ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                       "--mount-proc"]
    return []
