"""The write-ahead log under damage and full disks (#11): a damaged middle is found, reported and refused
(or recovered past, when told to), a torn tail is still cut, payload bytes never pass for records, and a
failed write leaves no partial record behind. Logs are built through QueueState, so they are realistic.

(Above 450 lines: each failure mode of the one file the queue's durability rests on, kept together.)
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from tauflow.queue.config import QueueConfig
from tauflow.queue.model import GroupRecord
from tauflow.queue.records import ACK, LEASE, PUT
from tauflow.queue.state import QueueState
from tauflow.queue.wal import FsyncPolicy, OnCorruption, WalCorrupt, WalDamaged, WalWriteError, WriteAheadLog
from tauflow.queue.wal_frames import FRAME_BYTES, MAGIC_V1, MAGIC_V2, FormatV2

SRC = Path(__file__).resolve().parents[1] / "src"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def group(gid: str, payload: bytes | None = None, size: int = 100) -> GroupRecord:
    return GroupRecord(gid, payload if payload is not None else (gid.encode() + b":" + b"x" * size)[:size], 0, 10)


def open_state(path: Path, on_corruption: OnCorruption = OnCorruption.REFUSE) -> QueueState:
    wal = WriteAheadLog(path, FsyncPolicy.NEVER, on_corruption)
    return QueueState(QueueConfig(max_staleness=-1, default_lease_s=10.0), wal, clock=Clock())


def close(q: QueueState) -> None:
    assert q.wal is not None
    q.wal.close()


def summary(q: QueueState) -> dict[str, Any]:
    m = q.memory
    return {
        "pending": list(m.pending),
        "payloads": {g: r.payload for g, r in m.groups.items()},
        "leases": {lid: x.group_ids for lid, x in m.leases.items()},
        "acked": m.acked_total,
        "done": set(m.done_ids),
    }


def records(path: Path) -> list[tuple[int, dict[str, Any], bytes, int, int]]:
    """(kind, meta, blob, offset, size) of every record of a clean log, read without changing it."""
    data = path.read_bytes()
    assert data.startswith(MAGIC_V2)
    pos, out = len(MAGIC_V2) + 16 + 4, []
    while pos < len(data):
        _, kind, _, meta_len, blob_len, _, _ = struct.unpack_from("<4sBQIIII", data, pos)
        body = pos + FRAME_BYTES
        meta = json.loads(data[body : body + meta_len])
        blob = data[body + meta_len : body + meta_len + blob_len]
        out.append((kind, meta, blob, pos, FRAME_BYTES + meta_len + blob_len))
        pos = body + meta_len + blob_len
    return out


def busy_log(path: Path, n: int = 2400, every: int = 8) -> QueueState:
    """``n`` puts; after each ``every`` puts a lease of them is taken and acked. The last batch stays pending."""
    q = open_state(path)
    for i in range(n):
        q.put(group(f"g{i:05d}"))
        if i % every == every - 1 and i < n - every:
            res = q.get("trainer", max_groups=every)
            assert res.lease is not None
            q.ack(res.lease.lease_id)
    return q


def flip(path: Path, offset: int, mask: int = 0x10) -> bytes:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(data)
    return bytes(data)


# =========================================================================================
# A damaged middle
# =========================================================================================


@pytest.mark.parametrize("where", ["blob", "meta", "seq", "marker", "length"])
def test_one_damaged_byte_in_the_middle_refuses_then_recovers_every_later_record(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "queue.wal"
    q = busy_log(path)
    before = summary(q)
    close(q)
    recs = records(path)
    assert len(recs) > 2900  # puts, leases, acks
    # a PUT about half way whose group was later leased and acked
    k = next(i for i, r in enumerate(recs) if i > len(recs) // 2 and r[0] == PUT)
    _, meta, _, offset, size = recs[k]
    lost_gid = meta["g"]
    at = {
        "blob": offset + size - 3,
        "meta": offset + FRAME_BYTES + 2,
        "seq": offset + 5,
        "marker": offset,
        "length": offset + 13,  # meta length: a garbage length, never allocated
    }[where]
    damaged = flip(path, at, 0xFF if where == "length" else 0x10)

    # By default: refuse, say what was lost and how to proceed, change nothing.
    with caplog.at_level(logging.ERROR, logger="tauflow.queue.wal"), pytest.raises(WalDamaged) as err:
        open_state(path)
    message = str(err.value)
    assert "\n" not in message and "wal.on_corruption=proceed" in message
    assert f"seqs {k}-{k}" in message and "1 records lost" in message
    assert f"{len(recs) - k - 1} intact records after" in message
    assert path.read_bytes() == damaged and sorted(os.listdir(tmp_path)) == ["queue.wal"]
    lines = [r for r in caplog.records if r.getMessage() == "records lost to damage in the log"]
    assert len(lines) == 1 and lines[0].lost_records == 1 and lines[0].seqs == f"{k}-{k}"
    readable = where in ("blob", "seq", "marker")  # the damage spares the meta and its length and crc
    if readable:  # the lost record's meta can still be read (and checked against its crc): its group is named
        assert lost_gid in json.dumps(lines[0].readable)

    # Told to proceed: the damaged file is kept, every intact record after the damage is applied.
    q2 = open_state(path, OnCorruption.PROCEED)
    assert q2.wal is not None
    [loss] = q2.wal.losses
    assert (loss.first_seq, loss.last_seq, loss.start, loss.end) == (k, k, offset, offset + size)
    assert [r.meta["g"] if r.meta else None for r in loss.records] == [lost_gid if readable else None]
    [kept] = q2.wal.kept
    assert kept.name.startswith("queue.wal.corrupt-") and kept.read_bytes() == damaged
    # The lost PUT's group is gone; the lease that held it can no longer apply, nor its ack, so the
    # other groups of that lease are back in the queue (delivered again: at least once). All else is as before.
    lease_rec = next(r for r in recs[k:] if r[0] == LEASE and lost_gid in r[1]["gs"])
    mates = [g for g in lease_rec[1]["gs"] if g != lost_gid]
    assert any(r[0] == ACK and r[1]["l"] == lease_rec[1]["l"] for r in recs[k:])
    after = summary(q2)
    assert after["pending"] == mates + before["pending"]
    assert set(after["payloads"]) == set(mates) | set(before["pending"])
    assert after["acked"] == before["acked"] - len(mates) - 1
    assert after["done"] == before["done"] - set(mates) - {lost_gid}

    # The rewritten log is clean: a restart sees no damage and the same state, and work goes on.
    close(q2)
    q3 = open_state(path)
    assert q3.wal is not None and not q3.wal.losses and summary(q3) == after
    assert q3.put(group("new"))[0]
    close(q3)
    assert summary(open_state(path))["pending"][-1] == "new"


def test_a_zeroed_page_in_the_middle_loses_only_the_records_it_held(tmp_path: Path) -> None:
    path = tmp_path / "queue.wal"
    q = open_state(path)
    for i in range(3000):
        q.put(group(f"g{i:05d}", size=300))
    close(q)
    recs = records(path)
    data = bytearray(path.read_bytes())
    start = len(data) // 2 // 4096 * 4096
    data[start : start + 4096] = bytes(4096)  # e.g. a block lost by the disk
    path.write_bytes(data)
    hit = [i for i, r in enumerate(recs) if r[3] + r[4] > start and r[3] < start + 4096]
    with pytest.raises(WalDamaged):
        open_state(path)
    q2 = open_state(path, OnCorruption.PROCEED)
    assert q2.wal is not None
    [loss] = q2.wal.losses
    assert (loss.first_seq, loss.last_seq, loss.count) == (hit[0], hit[-1], len(hit))
    expected = [f"g{i:05d}" for i in range(3000) if i not in hit]
    assert list(q2.memory.pending) == expected


def test_two_damaged_stretches_are_both_reported(tmp_path: Path) -> None:
    path = tmp_path / "queue.wal"
    q = open_state(path)
    for i in range(200):
        q.put(group(f"g{i:03d}"))
    close(q)
    recs = records(path)
    flip(path, recs[50][3] + recs[50][4] - 1)
    flip(path, recs[150][3] + 20)
    with pytest.raises(WalDamaged, match="2 records lost in 2 damaged stretch"):
        open_state(path)
    q2 = open_state(path, OnCorruption.PROCEED)
    assert q2.wal is not None and [(x.first_seq, x.last_seq) for x in q2.wal.losses] == [(50, 50), (150, 150)]
    assert len(q2.memory.pending) == 198 and "g050" not in q2.memory.pending and "g150" not in q2.memory.pending


def test_a_damaged_file_header_is_refused_even_when_told_to_proceed(tmp_path: Path) -> None:
    path = tmp_path / "queue.wal"
    close(busy_log(path, n=40))
    damaged = flip(path, len(MAGIC_V2) + 3)  # in the key: no record could be checked
    for policy in OnCorruption:
        with pytest.raises(WalCorrupt, match="file header is damaged"):
            open_state(path, policy)
    assert path.read_bytes() == damaged


# =========================================================================================
# Payload bytes are not records
# =========================================================================================


def _fake_frames(path: Path) -> bytes:
    """A payload holding a run of would-be records: a PUT of group 'evil' and an ACK, framed with the
    file's own marker (the worst case: a client cannot even know the marker) but not its key."""
    data = path.read_bytes()
    real = FormatV2(data[len(MAGIC_V2) : len(MAGIC_V2) + 16])
    forger = FormatV2(os.urandom(16))
    forger.marker = real.marker
    out = b""
    for seq in range(0, 5000, 50):
        for kind, meta in ((PUT, {"g": "evil", "bv": 0, "nt": 1, "at": 0.0, "tk": "", "d": 0}), (ACK, {"l": "x"})):
            out += b"".join(forger.frame(kind, seq, json.dumps(meta).encode(), b"evil"))
    return out


def test_a_fake_frame_in_a_payload_is_not_taken_for_a_record(tmp_path: Path) -> None:
    path = tmp_path / "queue.wal"
    q = open_state(path)
    q.put(group("first"))
    payload = _fake_frames(path)
    q.put(group("carrier", payload=payload))
    q.put(group("after"))
    close(q)
    recs = records(path)
    assert [r[1]["g"] for r in recs] == ["first", "carrier", "after"]  # read in order: the frames are a payload
    flip(path, recs[1][3] + 2)  # damage the carrier's frame header: recovery must search through its payload
    with pytest.raises(WalDamaged, match="1 records lost"):
        open_state(path)
    q2 = open_state(path, OnCorruption.PROCEED)
    assert list(q2.memory.pending) == ["first", "after"] and "evil" not in q2.memory.groups


def test_a_torn_record_whose_payload_holds_fake_frames_is_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "queue.wal"
    q = open_state(path)
    q.put(group("first"))
    payload = _fake_frames(path)
    q.put(group("carrier", payload=payload))
    close(q)
    os.truncate(path, path.stat().st_size - 10)  # the carrier's put was torn by a crash: never acknowledged
    q2 = open_state(path)
    assert q2.wal is not None and not q2.wal.losses and not q2.wal.kept
    assert list(q2.memory.pending) == ["first"]


# =========================================================================================
# A torn tail
# =========================================================================================


@pytest.mark.parametrize(
    ("tail", "kept"),
    [
        ("partial", False),  # a record cut short: what a crash mid-append leaves
        ("zeros", False),  # a file extended but never written
        ("bad-last-record", True),  # a whole last record with a bad checksum: kept for inspection
        ("garbage", True),
    ],
)
def test_a_torn_tail_is_cut_and_kept_unless_it_is_a_partial_record_or_zeros(
    tmp_path: Path, tail: str, kept: bool, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "queue.wal"
    q = open_state(path)
    for g in ("a", "b", "c"):
        q.put(group(g))
    close(q)
    recs = records(path)
    size = path.stat().st_size
    if tail == "partial":
        os.truncate(path, size - 7)
    elif tail == "zeros":
        with open(path, "ab") as f:
            f.write(bytes(10000))
    elif tail == "bad-last-record":
        flip(path, size - 2)
    else:
        with open(path, "ab") as f:
            f.write(os.urandom(500))
    cut = size - recs[-1][4] if tail in ("partial", "bad-last-record") else size
    original = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="tauflow.queue.wal"):
        q2 = open_state(path)
    (warning,) = [r for r in caplog.records if r.getMessage() == "cutting torn tail of the log"]
    if tail in ("partial", "bad-last-record"):  # its meta still reads: the record cut is named (group c's Put)
        assert json.loads(warning.record)["g"] == "c"  # type: ignore[attr-defined]
    assert q2.wal is not None and not q2.wal.losses
    assert path.stat().st_size == cut == q2.stats().wal_bytes
    assert [p.name.startswith("queue.wal.tail-") for p in q2.wal.kept] == ([True] if kept else [])
    if kept:
        assert q2.wal.kept[0].read_bytes() == original[cut:]
    assert q2.put(group("d"))[0]
    close(q2)
    q3 = open_state(path)
    assert q3.wal is not None and not q3.wal.losses
    assert list(q3.memory.pending) == (["a", "b", "d"] if cut < size else ["a", "b", "c", "d"])


# =========================================================================================
# Format 1 logs still open
# =========================================================================================


def _as_format_1(path: Path) -> list[tuple[int, dict[str, Any], bytes, int, int]]:
    """Rewrites a format-2 log in format 1 (what earlier builds wrote); returns the records' v1 offsets."""
    out, recs, pos = bytearray(MAGIC_V1), [], len(MAGIC_V1)
    for kind, meta, blob, _, _ in records(path):
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
        frame = struct.pack("<BIII", kind, len(meta_bytes), len(blob), zlib.crc32(blob, zlib.crc32(meta_bytes)))
        out += frame + meta_bytes + blob
        size = len(frame) + len(meta_bytes) + len(blob)
        recs.append((kind, meta, blob, pos, size))
        pos += size
    path.write_bytes(out)
    return recs


def test_a_format_1_log_opens_and_is_rewritten_as_format_2(tmp_path: Path) -> None:
    path = tmp_path / "queue.wal"
    q = busy_log(path, n=400)
    before = summary(q)
    close(q)
    _as_format_1(path)
    with open(path, "ab") as f:
        f.write(b"\x01\x05\x00")  # and a torn tail
    q2 = open_state(path)
    assert summary(q2) == before and path.read_bytes().startswith(MAGIC_V2)
    assert q2.stats().wal_bytes == path.stat().st_size
    q2.put(group("new"))
    close(q2)
    assert summary(open_state(path))["pending"] == before["pending"] + ["new"]


def test_frame_checksums_are_zlibs_crc32_so_logs_stay_readable_by_any_build() -> None:
    # The frames' crcs come from zlib-ng (faster); they must be the values zlib.crc32 gives, which every
    # log written before, and every reader, uses.
    fmt = FormatV2.new()
    rng = random.Random(7)
    for size in (0, 1, 63, 4096, 1 << 20):
        meta, blob = b'{"k":1}', rng.randbytes(size)
        head = fmt.frame(PUT, 3, meta, blob)[0]
        *_, meta_crc, blob_crc = struct.unpack_from("<4sBQIIII", head)
        assert (meta_crc, blob_crc) == (zlib.crc32(meta), zlib.crc32(blob))
    assert fmt.file_header()[-4:] == struct.pack("<I", zlib.crc32(MAGIC_V2 + fmt.key))


def test_a_damaged_format_1_log_is_refused_then_recovered_past(tmp_path: Path) -> None:
    path = tmp_path / "queue.wal"
    q = open_state(path)
    for i in range(500):
        q.put(group(f"g{i:03d}"))
    close(q)
    recs = _as_format_1(path)
    damaged = flip(path, recs[250][3] + 3)  # a length field of g250's frame
    with pytest.raises(WalDamaged, match="records lost"):
        open_state(path)
    assert path.read_bytes() == damaged
    q2 = open_state(path, OnCorruption.PROCEED)
    assert q2.wal is not None and len(q2.wal.losses) == 1 and q2.wal.kept[0].read_bytes() == damaged
    assert list(q2.memory.pending) == [f"g{i:03d}" for i in range(500) if i != 250]
    assert path.read_bytes().startswith(MAGIC_V2)


# =========================================================================================
# Failed writes
# =========================================================================================


def _fail_writes(monkeypatch: pytest.MonkeyPatch, code: int, after_bytes: int = 50) -> list[int]:
    """Makes the next writev write ``after_bytes`` and then fail with ``code``, as a disk filling up does."""
    calls: list[int] = []
    real = os.writev

    def writev(fd: int, parts: list[bytes]) -> int:
        if not calls:
            calls.append(fd)
            os.write(fd, b"".join(parts)[:after_bytes])
            raise OSError(code, os.strerror(code))
        return real(fd, parts)

    monkeypatch.setattr(os, "writev", writev)
    return calls


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EIO])
def test_a_failed_write_is_rolled_back_and_later_puts_survive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    path = tmp_path / "queue.wal"
    q = open_state(path)
    acked = []
    for i in range(20):
        q.put(group(f"g{i}"))
        acked.append(f"g{i}")
    before, size = summary(q), path.stat().st_size
    _fail_writes(monkeypatch, code)
    with pytest.raises(WalWriteError) as err:
        q.put(group("failed"))
    assert err.value.errno == code and err.value.disk_full is (code != errno.EIO)
    assert ("disk is full" in str(err.value)) is (code != errno.EIO)
    assert summary(q) == before and path.stat().st_size == size  # nothing of it in memory or in the file
    assert q.wal is not None and q.wal.broken is None
    for i in range(20, 40):  # space came back
        assert q.put(group(f"g{i}"))[0]
        acked.append(f"g{i}")
    close(q)
    q2 = open_state(path)
    assert q2.wal is not None and not q2.wal.losses and not q2.wal.kept
    assert list(q2.memory.pending) == acked


def test_a_failed_rollback_breaks_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "queue.wal"
    q = open_state(path)
    q.put(group("a"))
    _fail_writes(monkeypatch, errno.ENOSPC)

    def ftruncate(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "ftruncate", ftruncate)
    with pytest.raises(WalWriteError):
        q.put(group("b"))
    monkeypatch.undo()
    assert q.wal is not None and q.wal.broken is not None and "rolled back" in q.wal.broken
    with pytest.raises(WalWriteError, match="restart the queue"):
        q.put(group("c"))  # the partial record is still there: nothing may follow it
    assert list(q.memory.pending) == ["a"]
    close(q)
    q2 = open_state(path)  # after a restart the partial record is a torn tail
    assert q2.wal is not None and not q2.wal.losses and list(q2.memory.pending) == ["a"]
    assert q2.put(group("b"))[0]


def test_a_failed_fsync_breaks_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    path = tmp_path / "queue.wal"
    wal = WriteAheadLog(path, FsyncPolicy.ALWAYS)
    q = QueueState(QueueConfig(max_staleness=-1), wal, clock=Clock())
    q.put(group("a"))
    asyncio.run(wal.commit())

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", fsync)
    q.put(group("b"))
    with pytest.raises(WalWriteError) as err:
        asyncio.run(wal.commit())
    assert err.value.errno == errno.EIO and not err.value.disk_full
    monkeypatch.undo()  # a retried fsync could succeed without the lost pages: it must not be trusted
    with pytest.raises(WalWriteError, match="fsync"):
        asyncio.run(wal.commit())
    with pytest.raises(WalWriteError, match="fsync"):
        q.put(group("c"))
    with pytest.raises(WalWriteError):
        wal.rewrite([])
    assert "c" not in q.memory.groups


def test_a_failed_compaction_keeps_the_old_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "queue.wal"
    q = busy_log(path, n=100)
    before, original = summary(q), path.read_bytes()
    _fail_writes(monkeypatch, errno.ENOSPC, after_bytes=0)
    with pytest.raises(WalWriteError, match="disk is full"):
        q.compact()
    monkeypatch.undo()
    assert path.read_bytes() == original and not (tmp_path / "queue.wal.compact").exists()
    assert q.put(group("more"))[0]
    close(q)
    assert summary(open_state(path))["pending"] == before["pending"] + ["more"]


_FSIZE_CHILD = """
import json, resource, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tauflow.queue.config import QueueConfig
from tauflow.queue.model import GroupRecord
from tauflow.queue.state import QueueState
from tauflow.queue.wal import FsyncPolicy, WalWriteError, WriteAheadLog

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
path = Path(sys.argv[1])
q = QueueState(QueueConfig(max_staleness=-1), WriteAheadLog(path, FsyncPolicy.ALWAYS))
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
acked, failed = [], []
for i in range(60):
    if i == 20:  # the disk fills up in the middle of the next record
        resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 300, hard))
    if i == 40:  # space returns
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        q.put(GroupRecord(f"g{i:02d}", b"p" * 1000, 0, 10))
    except WalWriteError as e:
        failed.append([f"g{i:02d}", e.errno, e.disk_full])
        continue
    acked.append(f"g{i:02d}")
print(json.dumps({"acked": acked, "failed": failed}))
"""


def test_a_real_file_size_limit_mid_record_loses_no_acknowledged_put(tmp_path: Path) -> None:
    path = tmp_path / "queue.wal"
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(path), str(SRC)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [f[0] for f in result["failed"]] == [f"g{i:02d}" for i in range(20, 40)]
    assert all(code == errno.EFBIG and full for _, code, full in result["failed"])
    assert len(result["acked"]) == 40
    q = open_state(path)
    assert q.wal is not None and not q.wal.losses and not q.wal.kept
    assert list(q.memory.pending) == result["acked"]  # every acknowledged put, nothing else


# =========================================================================================
# The service process
# =========================================================================================


def _start(wal_dir: Path, *extra: str) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        "-m",
        "tauflow.queue",
        "--set",
        f"wal.dir={wal_dir}",
        "--set",
        "server.port=0",
        "--set",
        "metrics.port=0",
        "--ready-file",
        str(wal_dir / "ready.json"),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_the_service_refuses_a_damaged_log_in_one_line_and_proceeds_when_told(tmp_path: Path) -> None:
    path = tmp_path / "queue.wal"
    q = open_state(path)
    for i in range(100):
        q.put(group(f"g{i:03d}"))
    close(q)
    recs = records(path)
    flip(path, recs[40][3] + recs[40][4] - 1)

    proc = _start(tmp_path)
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()  # a queue that started after all is not left running
        proc.wait(10)
    assert proc.returncode != 0, output
    assert "Traceback" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith("tauflow-queue: ") and "wal.on_corruption=proceed" in last and "seqs 40-40" in last
    assert not (tmp_path / "ready.json").exists() and not list(tmp_path.glob("queue.wal.corrupt-*"))

    proc = _start(tmp_path, "--set", "wal.on_corruption=proceed")
    try:
        for _ in range(600):
            if (tmp_path / "ready.json").exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "ready.json").exists(), proc.communicate(timeout=10)[0]
    finally:
        proc.kill()
        proc.wait(10)
    assert len(list(tmp_path.glob("queue.wal.corrupt-*"))) == 1
    q2 = open_state(path)
    assert q2.wal is not None and not q2.wal.losses
    assert list(q2.memory.pending) == [f"g{i:03d}" for i in range(100) if i != 40]
