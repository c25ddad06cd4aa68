"""The queue's write-ahead log: an append-only file of checksummed records.

A record is ``kind (u8) | meta length (u32) | blob length (u32) | crc32 (u32)``
followed by the JSON meta and the opaque blob (a serialized group for puts).
A torn record at the tail (the process died mid-write) is cut off on open: it
was never acknowledged. Compaction rewrites the live state into a new file and
renames it over the old one atomically.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<BIII")
_FILE_MAGIC = b"TAUFLOW-QUEUE-WAL\x01\n"


class FsyncPolicy(str, enum.Enum):
    ALWAYS = "always"  # fsync before a Put is acknowledged (group commit across concurrent puts)
    INTERVAL = "interval"  # fsync in the background every interval; survives SIGKILL, not power loss
    NEVER = "never"  # leave it to the OS; survives SIGKILL, not power loss


Record = tuple[int, dict[str, Any], bytes]


class WalCorrupt(RuntimeError):
    pass


class WriteAheadLog:
    def __init__(self, path: str | os.PathLike[str], fsync: FsyncPolicy = FsyncPolicy.ALWAYS) -> None:
        self.path = Path(path)
        self.fsync = FsyncPolicy(fsync)
        self._fd: int | None = None
        self.size = 0
        self._written = 0  # records appended
        self._synced = 0  # records known on stable storage
        self._sync_task: asyncio.Task[None] | None = None

    # -- reading -------------------------------------------------------------------------

    def replay(self) -> Iterator[tuple[int, dict[str, Any], bytes, int]]:
        """Yields (kind, meta, blob, record_bytes) for every whole record, and cuts a torn tail."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or self.path.stat().st_size == 0:
            self._open_new()
            return
        good = 0
        with open(self.path, "rb") as f:
            magic = f.read(len(_FILE_MAGIC))
            if magic != _FILE_MAGIC:
                raise WalCorrupt(f"{self.path} is not a tauflow queue log")
            good = f.tell()
            end = os.fstat(f.fileno()).st_size
            while True:
                head = f.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    break
                kind, meta_len, blob_len, crc = _HEADER.unpack(head)
                if meta_len + blob_len > end - f.tell():
                    break  # lengths past the end of the file: a torn or garbage header (don't allocate them)
                body = f.read(meta_len + blob_len)
                if len(body) < meta_len + blob_len or zlib.crc32(body) != crc:
                    break
                try:
                    meta = json.loads(body[:meta_len])
                except ValueError:
                    break  # e.g. a zero-filled tail: an all-zero header has a valid crc and no meta
                good = f.tell()
                yield kind, meta, body[meta_len:], _HEADER.size + len(body)
        actual = self.path.stat().st_size
        if good < actual:
            log.warning("cutting torn tail of the log", extra={"path": str(self.path), "bytes": actual - good})
            os.truncate(self.path, good)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.size = good

    def _open_new(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        os.write(self._fd, _FILE_MAGIC)
        os.fsync(self._fd)
        _fsync_dir(self.path.parent)
        self.size = len(_FILE_MAGIC)

    # -- writing -------------------------------------------------------------------------

    def append(self, kind: int, meta: dict[str, Any], blob: bytes = b"") -> int:
        """Writes one record to the file (not yet fsynced); returns its size in bytes."""
        assert self._fd is not None, "replay() opens the log"
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
        crc = zlib.crc32(blob, zlib.crc32(meta_bytes))
        parts = [_HEADER.pack(kind, len(meta_bytes), len(blob), crc), meta_bytes, blob]
        total = sum(len(p) for p in parts)
        _write_all(self._fd, parts, total)
        self.size += total
        self._written += 1
        return total

    async def commit(self) -> None:
        """Returns once every record appended so far is durable under the fsync policy.

        With ``always``, concurrent callers share one fsync (group commit)."""
        if self.fsync is not FsyncPolicy.ALWAYS:
            return
        target = self._written
        while self._synced < target:
            if self._sync_task is None or self._sync_task.done():
                self._sync_task = asyncio.create_task(self._sync())
            await asyncio.shield(self._sync_task)

    async def _sync(self) -> None:
        upto = self._written
        assert self._fd is not None
        await asyncio.to_thread(os.fsync, self._fd)
        self._synced = max(self._synced, upto)

    async def sync_every(self, interval_s: float) -> None:
        """Background job for the ``interval`` policy."""
        while True:
            await asyncio.sleep(interval_s)
            if self._synced < self._written:
                await self._sync()

    async def idle(self) -> None:
        """Waits for a running fsync, so the file can be replaced safely."""
        if self._sync_task is not None and not self._sync_task.done():
            await asyncio.shield(self._sync_task)

    def rewrite(self, records: Iterable[Record]) -> list[int]:
        """Replaces the log with ``records`` atomically; returns each record's size.

        Call ``idle()`` first: no fsync may be running on the old file."""
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sizes = []
        try:
            os.write(fd, _FILE_MAGIC)
            size = len(_FILE_MAGIC)
            for kind, meta, blob in records:
                meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
                crc = zlib.crc32(blob, zlib.crc32(meta_bytes))
                parts = [_HEADER.pack(kind, len(meta_bytes), len(blob), crc), meta_bytes, blob]
                n = sum(len(p) for p in parts)
                _write_all(fd, parts, n)
                sizes.append(n)
                size += n
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.size = size
        self._synced = self._written
        return sizes

    def close(self) -> None:
        if self._fd is not None:
            if self.fsync is not FsyncPolicy.NEVER:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


def _write_all(fd: int, parts: list[bytes], total: int) -> None:
    written = os.writev(fd, parts)
    if written == total:
        return
    rest = b"".join(parts)[written:]  # a short write (rare: a signal or a full disk)
    while rest:
        rest = rest[os.write(fd, rest) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
