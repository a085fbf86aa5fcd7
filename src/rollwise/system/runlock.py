"""An exclusive lock on a run directory: one writer at a time.

`runs/<name>/.lock` is held with `flock` for as long as the run is open, and holds the
holder's PID and host for the message a second writer gets. The kernel drops an `flock`
when its process dies however it dies (SIGKILL included), so a lock file left by a dead
process is simply taken over: there is no stale-PID guessing.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are then not protected against a 2nd writer
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"
_HELD: set[int] = set()  # descriptors of locks this process took (see close_inherited)


class RunLockedError(RuntimeError):
    """Another live process holds the run directory."""


def holder(root: Path) -> str:
    """What the lock file says about its holder ('pid 123 on host'), or 'unknown'."""
    try:
        text = (Path(root) / LOCK_FILE).read_text().strip()
    except OSError:
        return "unknown"
    return text or "unknown"


class RunLock:
    """`RunLock(root)` takes the lock or raises `RunLockedError`; `release()` drops it."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / LOCK_FILE
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self._fd)
                self._fd = None
                raise RunLockedError(
                    f"{self.root} is in use by another rollwise process ({holder(self.root)}); "
                    "wait for it to finish or stop it, or choose another run.name") from None
        _HELD.add(self._fd)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it would let a waiting
        process lock a file that a third one then recreates under a new inode."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        _HELD.discard(self._fd)
        with contextlib.suppress(OSError):
            os.close(self._fd)  # closing the descriptor releases the flock
        self._fd = None

    def __del__(self):
        self.release()


def close_inherited() -> None:
    """Close the lock descriptors a forked child inherited. A flock lives as long as any
    process holds its descriptor, so a helper process (a reward worker) that kept it would
    keep the run locked after its parent died."""
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
