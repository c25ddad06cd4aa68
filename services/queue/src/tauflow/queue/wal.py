"""The queue's write-ahead log: an append-only file of framed, checksummed records (wal_frames.py).

Recovery tells a torn tail from damage in the middle (docs/reliability.md, "The write-ahead log"):

* a *torn tail* — damage after which no whole record follows — is what a crash mid-append leaves; it
  was never acknowledged and is cut (a copy is kept unless it is only a partial record or zeros);
* damage *before* a whole record is corruption. Every intact record after it is found again (frames
  carry a keyed tag, so a group's payload cannot pass for one), the lost ones are logged at ERROR, and
  by default the queue refuses to start (``WalDamaged``) and changes nothing. With
  ``on_corruption: proceed`` it keeps the damaged file beside the log (``queue.wal.corrupt-<UTC>``)
  and rewrites the log from every intact record.

A failed write is rolled back (truncated to the last whole record) and raises ``WalWriteError``; a
failed rollback or fsync breaks the log: every later append and commit fails until a restart.
Compaction rewrites the live state into a new file and renames it over the old one atomically.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import json
import logging
import mmap
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tauflow.core.files import fsync_dir
from tauflow.core.logs import LogLimit
from tauflow.queue.wal_frames import (
    Bad,
    BadHeader,
    Format,
    FormatV1,
    FormatV2,
    Frame,
    FrameWriter,
    all_zeros,
    frame_size,
    open_format,
    resync,
    write_all,
)

log = logging.getLogger(__name__)

_DISK_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
_REPORTED_RECORDS = 20  # lost records named per damaged stretch in the log (the rest are counted)
_LOG_ROLLBACKS_EVERY_S = 10.0  # a full disk fails every write: one line this often, with the count


class FsyncPolicy(str, enum.Enum):
    ALWAYS = "always"  # fsync before Put, Ack and SetTrainerVersion answer (group commit across calls)
    INTERVAL = "interval"  # fsync in the background every interval; survives SIGKILL, not power loss
    NEVER = "never"  # leave it to the OS; survives SIGKILL, not power loss


class OnCorruption(str, enum.Enum):
    REFUSE = "refuse"  # damage before the last record: refuse to start, change nothing
    PROCEED = "proceed"  # keep the damaged file aside, start with every intact record


Record = tuple[int, dict[str, Any], bytes]


class WalCorrupt(RuntimeError):
    """The log cannot be opened as it is."""


class WalDamaged(WalCorrupt):
    """Records were lost to damage before the last intact record, and the policy is to refuse."""


class WalWriteError(RuntimeError):
    """A write or fsync of the log failed; the record it was for is not in the log."""

    def __init__(self, errno_: int, reason: str) -> None:
        super().__init__(reason)
        self.errno = errno_
        self.reason = reason

    @property
    def disk_full(self) -> bool:
        """No space (or file size limit): the same call can succeed once space returns."""
        return self.errno in _DISK_FULL


@dataclass
class LostRecord:
    seq: int | None  # None in a format-1 log
    offset: int
    meta: dict[str, Any] | None  # the record's meta where it could still be read (a PUT's names its group)


@dataclass
class Loss:
    """One damaged stretch of the log: bytes [start, end) held the records numbered first..last."""

    start: int
    end: int
    first_seq: int | None  # None in a format-1 log (it has no sequence numbers)
    last_seq: int | None
    records: list[LostRecord] = field(default_factory=list)

    @property
    def count(self) -> int | None:
        return None if self.first_seq is None or self.last_seq is None else self.last_seq - self.first_seq + 1


@dataclass
class _Scan:
    """What replay() found, for what it does to the file afterwards."""

    fmt: Format
    good_end: int = 0  # end of the last whole record read in order (before any damage)
    seq: int = 0  # the next record's number in the file being read
    tail: Bad | None = None
    tail_bytes: int = 0
    tail_trivial: bool = True  # a partial record or zeros: what an interrupted append leaves
    after_loss: int = 0  # intact records read after the first damaged stretch
    prefix_records: int = 0  # records before the first damaged stretch


class WriteAheadLog:
    def __init__(
        self,
        path: str | os.PathLike[str],
        fsync: FsyncPolicy = FsyncPolicy.ALWAYS,
        on_corruption: OnCorruption = OnCorruption.REFUSE,
    ) -> None:
        self.path = Path(path)
        self.fsync = FsyncPolicy(fsync)
        self.on_corruption = OnCorruption(on_corruption)
        self.size = 0
        self.broken: str | None = None  # why every later append and commit fails
        self.losses: list[Loss] = []  # damaged stretches replay() found (so far, while it runs)
        self.kept: list[Path] = []  # copies of damaged files and cut tails that replay() kept
        self._fd: int | None = None
        self._fmt = FormatV2.new()
        self._seq = 0  # the next record's number
        self._written = 0  # records appended
        self._synced = 0  # records known on stable storage
        self._sync_task: asyncio.Task[None] | None = None
        # While a rewrite runs in the background: every record appended since its snapshot, to go after it.
        self._tail: list[tuple[int, bytes, bytes]] | None = None
        self._rollback_log = LogLimit(_LOG_ROLLBACKS_EVERY_S)  # (a full disk: every write fails)

    # -- reading -------------------------------------------------------------------------

    def replay(self) -> Iterator[tuple[int, dict[str, Any], bytes, int]]:
        """Yields (kind, meta, blob, record_bytes) for every intact record, then opens the log for appends."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or self.path.stat().st_size == 0:
            self._open_new()
            return
        tmp = self.path.with_name(self.path.name + ".recover")
        out: FrameWriter | None = None
        try:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                try:
                    fmt, start = open_format(mm)
                except BadHeader as e:
                    raise WalCorrupt(f"{self.path}: {e}; the queue cannot start from it") from None
                scan = _Scan(fmt, good_end=start)
                if isinstance(fmt, FormatV1):  # read once more, then written as format 2
                    out = FrameWriter.create(tmp, FormatV2.new())
                for frame in self._scan(mm, scan, start):
                    if self.losses and out is None and self.on_corruption is OnCorruption.PROCEED:
                        out = FrameWriter.create(tmp, fmt, copy_from=(mm, scan.good_end), seq=scan.prefix_records)
                    meta = json.loads(frame.meta)
                    size = frame_size(frame.meta, frame.blob)
                    if out is not None:
                        size = out.write(frame.kind, frame.meta, frame.blob)
                    yield frame.kind, meta, frame.blob, size
                if scan.tail is not None and not scan.tail_trivial and not self.losses:
                    self.kept.append(self._keep((mm, scan.tail.offset), "tail"))
            if self.losses and self.on_corruption is OnCorruption.REFUSE:
                raise WalDamaged(self._refusal(scan))
            self._finish(scan, out, tmp)
            out = None
        finally:
            if out is not None:  # refused, or the caller stopped reading: the log stays as it was
                out.close()
                tmp.unlink(missing_ok=True)

    def _scan(self, mm: mmap.mmap, scan: _Scan, pos: int) -> Iterator[Frame]:
        """Yields the records to recover; records the damaged stretches in ``self.losses``."""
        fmt, end = scan.fmt, len(mm)
        while pos < end:
            found = fmt.read(mm, pos, end)
            if isinstance(found, Frame) and found.seq in (None, scan.seq):
                pos, scan.seq = found.end, scan.seq + 1
                if not self.losses:
                    scan.good_end = pos
                    yield found
                elif self.on_corruption is OnCorruption.PROCEED:
                    scan.after_loss += 1
                    yield found
                else:
                    scan.after_loss += 1  # counted for the report, not applied: the queue will not start
                continue
            named: list[Bad] = []
            if isinstance(found, Frame):  # whole, but out of order: records went missing, or a stale copy
                bad, nxt = Bad(pos, "sequence"), found if found.seq is not None and found.seq > scan.seq else None
            else:
                bad, nxt = found, None
            nxt = nxt or resync(fmt, mm, pos + 1, end, scan.seq, named)
            if nxt is None:  # nothing whole after it: a torn tail
                scan.tail, scan.tail_bytes = bad, end - pos
                scan.tail_trivial = bad.why in ("short", "partial") or all_zeros(mm, pos, end)
                return
            if not self.losses:
                scan.prefix_records = scan.seq
            self._lost(fmt, [bad, *named], nxt, scan.seq)
            pos = nxt.offset  # read again as the next record
            scan.seq = scan.seq if nxt.seq is None else nxt.seq

    def _lost(self, fmt: Format, bad: list[Bad], nxt: Frame, seq: int) -> None:
        """Records and logs a damaged stretch: ``bad`` holds what was found at its start and the damaged
        records in it that can still be told apart; ``nxt`` is the first whole record after it."""
        v2 = isinstance(fmt, FormatV2)
        loss = Loss(bad[0].offset, nxt.offset, seq if v2 else None, (nxt.seq or 0) - 1 if v2 else None)
        for i, b in enumerate(bad):
            meta = b.meta_json()
            if v2 or meta is not None:
                known = b.seq if b.seq is not None else (seq if i == 0 else None)
                loss.records.append(LostRecord(known, b.offset, meta))
        self.losses.append(loss)
        named = [
            {"seq": r.seq, "offset": r.offset, "meta": json.dumps(r.meta)[:300] if r.meta is not None else "unreadable"}
            for r in loss.records[:_REPORTED_RECORDS]
        ]
        log.error(
            "records lost to damage in the log",
            extra={
                "path": str(self.path),
                "bytes": f"{loss.start}-{loss.end}",
                "damage": bad[0].why,
                "seqs": f"{loss.first_seq}-{loss.last_seq}" if v2 else "unknown (format 1 log)",
                "lost_records": loss.count if v2 else "unknown",
                "readable": named,
            },
        )

    def _refusal(self, scan: _Scan) -> str:
        lost = sum(x.count or 0 for x in self.losses)
        where = "; ".join(
            f"bytes {x.start}-{x.end}" + (f" seqs {x.first_seq}-{x.last_seq}" if x.count is not None else "")
            for x in self.losses[:5]
        )
        return (
            f"{self.path} is damaged before its last record: "
            + (f"{lost} records lost" if isinstance(scan.fmt, FormatV2) else "records lost")
            + f" in {len(self.losses)} damaged stretch(es) ({where}), {scan.after_loss} intact records after "
            "the damage; nothing was changed. To start with every intact record, set wal.on_corruption=proceed "
            f"(the damaged file is then kept as {self.path.name}.corrupt-<UTC time>)"
        )

    def _finish(self, scan: _Scan, out: FrameWriter | None, tmp: Path) -> None:
        if scan.tail is not None and not self.losses:
            meta = scan.tail.meta_json()  # (what the cut record was, where its meta can still be read: a
            # Put's group id, as a loss in the middle names its records)
            log.warning(
                "cutting torn tail of the log",
                extra={
                    "path": str(self.path),
                    "bytes": scan.tail_bytes,
                    "damage": scan.tail.why,
                    "kept": str(self.kept[-1]) if self.kept else "no (a partial record or zeros)",
                    "record": json.dumps(meta)[:300] if meta is not None else "unreadable",
                },
            )
        if out is not None:  # replace the file with what was recovered
            out.sync_and_close()
            if self.losses:
                self.kept.append(self._keep(None, "corrupt"))
                log.error(
                    "started from the intact records; the damaged log is kept",
                    extra={
                        "path": str(self.path),
                        "kept": str(self.kept[-1]),
                        "recovered_after_damage": scan.after_loss,
                    },
                )
            os.replace(tmp, self.path)
            fsync_dir(self.path.parent)
            self._fmt, self._seq, self.size = out.fmt, out.seq, out.size
        else:
            if scan.tail is not None:
                os.truncate(self.path, scan.good_end)
            assert isinstance(scan.fmt, FormatV2)
            self._fmt, self._seq, self.size = scan.fmt, scan.seq, scan.good_end
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def _keep(self, data: tuple[mmap.mmap, int] | None, what: str) -> Path:
        """Keeps the whole damaged file (``data`` None: a hard link, no copy) or ``data``'s bytes from
        an offset beside the log."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        aside = self.path.with_name(f"{self.path.name}.{what}-{stamp}")
        n = 1
        while aside.exists():
            aside, n = self.path.with_name(f"{self.path.name}.{what}-{stamp}-{n}"), n + 1
        if data is not None:
            mm, start = data
            with open(aside, "wb") as f:
                f.writelines(mm[at : at + (1 << 24)] for at in range(start, len(mm), 1 << 24))
        else:
            try:
                os.link(self.path, aside)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(self.path, aside)
        return aside

    def _open_new(self) -> None:
        tmp = self.path.with_name(self.path.name + ".new")
        out = FrameWriter.create(tmp, FormatV2.new())
        out.sync_and_close()
        os.replace(tmp, self.path)  # a crash never leaves a half-written header
        fsync_dir(self.path.parent)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._fmt, self._seq, self.size = out.fmt, 0, out.size

    # -- writing -------------------------------------------------------------------------

    def append(self, kind: int, meta: dict[str, Any], blob: bytes = b"") -> int:
        """Writes one record to the file (not yet fsynced); returns its size in bytes.

        Raises WalWriteError with nothing of the record left in the file."""
        assert self._fd is not None, "replay() opens the log"
        if self.broken is not None:
            raise WalWriteError(errno.EIO, self.broken)
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
        parts = self._fmt.frame(kind, self._seq, meta_bytes, blob)
        total = sum(len(p) for p in parts)
        try:
            write_all(self._fd, parts, total)
        except OSError as e:
            self._roll_back(e)
            raise _write_error(e, "writing the log") from None
        self._seq += 1
        self.size += total
        self._written += 1
        if self._tail is not None:
            self._tail.append((kind, meta_bytes, blob))
        return total

    def _roll_back(self, cause: OSError) -> None:
        """Cuts what a failed write left, so that no partial record sits before the next one."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self.size)
        except OSError as e:
            self._break(f"the log could not be rolled back after a failed write ({_describe(e)}); restart the queue")
        if failed_writes := self._rollback_log.due():
            log.error(
                "a write to the log failed and was rolled back",
                extra={"path": str(self.path), "error": _describe(cause), "failed_writes": failed_writes},
            )

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            log.error("the log is broken: every later change is refused", extra={"path": str(self.path), "why": why})

    async def commit(self) -> None:
        """Returns once every record appended so far is durable under the fsync policy.

        With ``always``, concurrent callers share one fsync (group commit). Raises WalWriteError when
        the log is broken."""
        if self.broken is not None:
            raise WalWriteError(errno.EIO, self.broken)
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
        if self.broken is not None:
            raise WalWriteError(errno.EIO, self.broken)
        try:
            await asyncio.to_thread(os.fsync, self._fd)
        except OSError as e:
            # After a failed fsync the kernel may have dropped the dirty pages: nothing written since
            # the last good fsync can be trusted to be on disk, and retrying would report success.
            self._break(f"fsync of the log failed ({_describe(e)}); restart the queue")
            raise _write_error(e, "syncing the log") from None
        self._synced = max(self._synced, upto)

    async def sync_every(self, interval_s: float) -> None:
        """Background job for the ``interval`` policy (stops once the log is broken)."""
        while self.broken is None:
            await asyncio.sleep(interval_s)
            if self._synced < self._written:
                with contextlib.suppress(WalWriteError):
                    await self._sync()

    async def idle(self) -> None:
        """Waits for a running fsync, so the file can be replaced safely."""
        if self._sync_task is not None and not self._sync_task.done():
            with contextlib.suppress(WalWriteError):
                await asyncio.shield(self._sync_task)

    def rewrite(self, records: Iterable[Record]) -> list[int]:
        """Replaces the log with ``records`` atomically; returns each record's size.

        Call ``idle()`` first: no fsync may be running on the old file. On WalWriteError the old log
        stays in place and in use."""
        if self.broken is not None:
            raise WalWriteError(errno.EIO, self.broken)
        tmp = self.path.with_name(self.path.name + ".compact")
        out = FrameWriter.create(tmp, FormatV2.new())
        sizes = []
        try:
            for kind, meta, blob in records:
                sizes.append(out.write(kind, json.dumps(meta, separators=(",", ":")).encode(), blob))
            out.sync_and_close()
        except OSError as e:
            out.close()
            tmp.unlink(missing_ok=True)
            raise _write_error(e, "compacting the log (the old log is kept)") from None
        self._swap(tmp, out)
        return sizes

    async def rewrite_in_background(self, records: Iterable[Record]) -> list[int]:
        """Replaces the log with ``records`` (a snapshot of the state now) and every record appended while it
        is written; returns the size of each of ``records``.

        The snapshot's frames are written and fsynced in a thread while the log takes appends as before
        (a compaction of hundreds of MB held the event loop for seconds); each record appended meanwhile
        is kept and written after the snapshot, most of them in the thread too, the last few on the loop
        right before the new file replaces the old one, so that none can come between. On WalWriteError
        the old log stays in place and in use, with every record appended meanwhile."""
        if self.broken is not None:
            raise WalWriteError(errno.EIO, self.broken)
        if self._tail is not None:
            raise RuntimeError("a rewrite is under way")
        # Encoded now: the metas describe the state at this moment (the loop changes it from here on).
        frames = [(kind, json.dumps(meta, separators=(",", ":")).encode(), blob) for kind, meta, blob in records]
        tmp = self.path.with_name(self.path.name + ".compact")
        out: FrameWriter | None = None
        self._tail = []
        try:
            out = await _shielded_thread(FrameWriter.create, tmp, FormatV2.new())
            sizes = await _shielded_thread(_write_frames, out, frames)
            for _ in range(_CATCH_UP_PASSES):  # what came meanwhile, in the thread while there is much of it
                if len(self._tail) <= _TAIL_ON_LOOP:
                    break
                batch, self._tail = self._tail, []
                await _shielded_thread(_write_frames, out, batch)
            await self.idle()  # no fsync running on the old file when it is replaced
            # From here to the end nothing awaits: no append can come between the last tail and the swap.
            if self.broken is not None:
                raise WalWriteError(errno.EIO, self.broken)
            for kind, meta, blob in self._tail:
                out.write(kind, meta, blob)
            out.sync_and_close()  # (the bulk was fsynced in the thread: this one covers the last records)
        except OSError as e:
            if out is not None:
                out.close()
            tmp.unlink(missing_ok=True)
            raise _write_error(e, "compacting the log (the old log is kept)") from None
        except BaseException:
            if out is not None:
                out.close()
            tmp.unlink(missing_ok=True)
            raise
        finally:
            self._tail = None
        self._swap(tmp, out)
        return sizes

    def _swap(self, tmp: Path, out: FrameWriter) -> None:
        """Puts the fsynced file ``tmp`` (written by ``out``) in place of the log and appends to it from now on."""
        os.replace(tmp, self.path)
        try:
            fsync_dir(self.path.parent)
        except OSError as e:
            self._break(f"fsync of the log's directory failed ({_describe(e)}); restart the queue")
        try:  # the new descriptor first: the old one is never left closed under its number
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            self._break(f"the compacted log could not be opened ({_describe(e)}); restart the queue")
            raise _write_error(e, "opening the compacted log") from None
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        self._fmt, self._seq, self.size = out.fmt, out.seq, out.size
        self._synced = self._written

    def close(self) -> None:
        if self._fd is not None:
            if self.fsync is not FsyncPolicy.NEVER and self.broken is None:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


_CATCH_UP_PASSES = 4  # passes over the records appended during a background rewrite, in its thread
_TAIL_ON_LOOP = 64  # records appended meanwhile that may be left for the loop to write before the swap


def _write_frames(out: FrameWriter, frames: list[tuple[int, bytes, bytes]]) -> list[int]:
    """Writes ``frames`` to ``out`` and fsyncs it (in a thread); returns their sizes."""
    sizes = [out.write(kind, meta, blob) for kind, meta, blob in frames]
    assert out.fd is not None
    os.fsync(out.fd)
    return sizes


async def _shielded_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a thread; a cancellation waits for the thread to finish first (it writes a file
    that the caller closes and removes on the way out)."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await work
        raise


def _write_error(e: OSError, doing: str) -> WalWriteError:
    code = e.errno or errno.EIO
    if code in _DISK_FULL:
        return WalWriteError(code, f"the queue's disk is full ({_describe(e)} {doing}); nothing was stored")
    return WalWriteError(code, f"the queue's log cannot be written ({_describe(e)} {doing}); nothing was stored")


def _describe(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "error")
    return f"{name}: {e.strerror or e}"
