"""Atomic file writes: a temporary file in the same folder, `fsync`, then `rename`.

A process killed at any instant leaves either the old file or the new one, never half of
one: `rename` within a folder is atomic on POSIX, and the `fsync` before it makes sure the
new name never points at data still in the page cache when the machine (not only the
process) goes down. The folder is fsync'ed after the rename so the new name itself is
durable.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make a rename or creation inside `folder` durable (a no-op where folders can't be
    opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory; the data is synced
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; when the block ends without error, the
    temporary file is fsync'ed and renamed onto `path`. On error it is removed and the old
    `path` (if any) is untouched. For writers that want a file name (safetensors)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
