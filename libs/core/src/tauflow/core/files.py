"""Files that survive a crash: a directory's entries made durable, and a file replaced whole or not at all.

Every service that keeps state on disk (the queue's log, the trainer's checkpoints, ready files, the
controller's Prometheus targets) uses these, so that "durable" means one thing in tauflow.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Makes the entries of directory ``path`` durable (a file created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, durable: bool = False) -> None:
    """Replaces ``path`` with ``data`` at once: a reader sees the old file or the new one, never half of
    it. ``durable``: fsynced (the file, then its directory) before this returns."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, target)
    if durable:
        fsync_dir(target.parent)
