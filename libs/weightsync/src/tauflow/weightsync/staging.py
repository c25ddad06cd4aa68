"""The trainer → sidecar hand-off through a staging area on the host.

The trainer writes its state dict into one file in the tauflow layout (a POSIX
shared-memory object under ``/dev/shm``, or any file) with ``Stager.stage``, which
returns the manifest (with its checksum); it then calls ``WeightsService.Publish``
with the manifest and ``stager.uri``. The sidecar copies the bytes into its own
buffer with ``read_staged`` (checking the checksum on the way) and answers, so the
trainer blocks only for its own write plus that local copy. The stager keeps one
file and rewrites it in place for every version: no new pages are faulted in, and
the trainer owns (and finally unlinks) it.

A stager that names its own file (no ``uri`` given) holds an exclusive ``flock`` on it for as long as it
lives; the kernel drops the lock when the process dies, SIGKILL included. A new such stager removes every
file of that name pattern that it can lock: those of trainers that died without closing theirs (the
lock, unlike a pid, is not fooled by pid reuse or by another pid namespace sharing ``/dev/shm``).

URIs: ``shm://NAME`` is the POSIX shared-memory object NAME, i.e. ``/dev/shm/NAME``
on Linux; ``file:///abs/path`` is a file.

A stager that names its own file puts it in ``TAUFLOW_STAGING_DIR`` when that is set (a container whose
``/dev/shm`` is Docker's default 64 MB), else in ``/dev/shm`` (``default_staging_dir``). Before writing a
version it checks that the file system has room for it, and says so (StagingError) rather than failing half-way.

The reader (the sidecar) opens a staging file only inside its staging roots (``read_staged(..., roots=)``;
by default ``default_staging_dir()``, where a stager names its own file): a URI whose path is not below a root,
or that has a ``.``/``..`` component, is refused before anything is opened; below the root every component is
opened without following symbolic links, and the file must be a regular file with no other name (a hard
link). Its refusals never quote what the file holds (its checksum or its size).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from io import FileIO
from pathlib import Path
from stat import S_ISREG
from typing import BinaryIO

import numpy as np
import torch

from tauflow.weightsync.checksum import DEFAULT_ALGORITHM, new_hasher, update_zeros
from tauflow.weightsync.errors import ChecksumMismatch, Phase, PhaseError, StagingError, StagingNotFound
from tauflow.weightsync.manifest import (
    DEFAULT_BUCKET_BYTES,
    BucketSpec,
    Manifest,
    dtype_name,
    plan_buckets,
)

SHM_DIR = Path("/dev/shm")
_CHUNK = 16 * 1024 * 1024
STAGING_DIR_ENV = "TAUFLOW_STAGING_DIR"  # where a stager names its own file (default /dev/shm)
OWN_PREFIX = "tauflow-weights-"  # files a Stager names itself: locked while in use, removable once not

log = logging.getLogger(__name__)


def default_staging_dir() -> Path:
    """Where a stager names its own file: ``TAUFLOW_STAGING_DIR`` when set, else ``/dev/shm`` (``/tmp`` on a
    system without it). The reader's default staging root: the same process environment finds the same one."""
    override = os.environ.get(STAGING_DIR_ENV)
    return Path(override) if override else SHM_DIR if SHM_DIR.is_dir() else Path("/tmp")


def staging_path(uri: str) -> Path:
    """The local path of a staging URI; ``StagingError`` for an unknown scheme."""
    return Path(_uri_path(uri))


def _uri_path(uri: str) -> str:
    """The local path of a staging URI as written (pathlib would drop a ``.`` component); StagingError for an
    unknown scheme."""
    if uri.startswith("shm://"):
        name = uri[len("shm://") :].lstrip("/")
        if not name or "/" in name:
            raise StagingError(f"staging_uri {uri!r}: a shared-memory name is one path component (shm://NAME)")
        return f"{SHM_DIR}/{name}"
    if uri.startswith("file://"):
        path = uri[len("file://") :]
        if not path.startswith("/"):
            raise StagingError(f"staging_uri {uri!r}: file URIs need an absolute path (file:///path)")
        return path
    scheme = uri.split("://", 1)[0] if "://" in uri else uri
    raise StagingError(f"staging_uri {uri!r} has an unknown scheme {scheme!r}; use shm://NAME or file:///path")


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor as a flat uint8 array (a view when it is on CPU and contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class Stager:
    """Trainer side: writes state dicts into one staging area and describes them in a manifest.

    Without ``uri`` it names (and locks) a file of its own, after removing those of stagers that died."""

    def __init__(
        self,
        uri: str | None = None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksum_algorithm: str = DEFAULT_ALGORITHM,
        model: str = "",
    ) -> None:
        self._file = None  # our own file, held open (and locked) while this stager lives
        if uri is None:
            directory = default_staging_dir()
            remove_stale_staging(directory)
            self._file, own = _create_locked(directory)
            uri = f"shm://{own.name}" if directory == SHM_DIR else f"file://{own}"
        self.uri = uri
        self.path = staging_path(uri)
        self.bucket_bytes = bucket_bytes
        self.checksum_algorithm = checksum_algorithm
        self.model = model
        self._layout: tuple[tuple[tuple[str, str, tuple[int, ...]], ...], tuple[BucketSpec, ...]] | None = None

    def _buckets(self, state_dict: Mapping[str, torch.Tensor]) -> tuple[BucketSpec, ...]:
        key = tuple((name, dtype_name(t.dtype), tuple(t.shape)) for name, t in state_dict.items())
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, plan_buckets(key, self.bucket_bytes))
        return self._layout[1]

    def stage(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> Manifest:
        """Writes ``state_dict`` into the staging area; returns its manifest with the checksum."""
        buckets = self._buckets(state_dict)
        total = buckets[-1].offset_bytes + buckets[-1].size_bytes
        hasher = new_hasher(self.checksum_algorithm)
        if self._file is not None:
            fd = os.dup(self._file.fileno())  # closing the copy keeps the lock, held by self._file
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size < total:
                _check_room(fd, total - size, self.uri)
            if size != total:
                os.ftruncate(fd, total)
            for b in buckets:
                end = 0
                for spec in b.tensors:
                    pad = spec.offset_bytes - end
                    if pad:
                        _write_zeros(fd, b.offset_bytes + end, pad)
                        update_zeros(hasher, pad)
                    data = tensor_bytes(state_dict[spec.name])
                    _pwrite_all(fd, data.data, b.offset_bytes + spec.offset_bytes)
                    hasher.update(data.data)
                    end = spec.offset_bytes + spec.size_bytes
                if b.size_bytes > end:
                    _write_zeros(fd, b.offset_bytes + end, b.size_bytes - end)
                    update_zeros(hasher, b.size_bytes - end)
        finally:
            os.close(fd)
        return Manifest(
            policy_version=policy_version,
            buckets=buckets,
            total_bytes=total,
            checksum_algorithm=self.checksum_algorithm,
            checksum=hasher.hexdigest(),
            model=self.model,
            created_at=time.time(),
        )

    def close(self) -> None:
        """Removes the staging area."""
        self.path.unlink(missing_ok=True)  # before the lock goes: no other stager sees it unlocked
        if self._file is not None:
            self._file.close()
            self._file = None


def _check_room(fd: int, needed: int, uri: str) -> None:
    """StagingError unless the staging file's file system has ``needed`` more bytes free."""
    stat = os.fstatvfs(fd)
    free = stat.f_bavail * stat.f_frsize
    if free < needed:
        raise StagingError(
            f"staging area {uri!r}: its file system has {free / 2**20:.0f} MiB free and this version needs "
            f"{needed / 2**20:.0f} MiB more; give /dev/shm more room (a container's --shm-size) or set "
            f"{STAGING_DIR_ENV} to a directory that has it"
        )


def _create_locked(directory: Path) -> tuple[BinaryIO, Path]:
    """A new staging file of our own in ``directory``, open and locked; returns (file, path)."""
    while True:
        path = directory / f"{OWN_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), "r+b", buffering=0)
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # waits out a remover that opened it before we locked it
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                return f, path
        except FileNotFoundError:
            pass
        f.close()  # a remover took it for a dead stager's file in that instant: take another name


def remove_stale_staging(directory: Path = SHM_DIR) -> list[Path]:
    """Removes the staging files that stagers named themselves and no live process holds (their trainer
    died without closing them, e.g. SIGKILL); returns them. Files of other users are left alone."""
    removed = []
    for path in sorted(directory.glob(f"{OWN_PREFIX}*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live stager holds it
            # Unlocked: its owner is gone. Unlink it while holding the lock, and only if the name still
            # refers to what we locked.
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                path.unlink()
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        log.info("removed staging files of stagers that died", extra={"files": [p.name for p in removed]})
    return removed


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _write_zeros(fd: int, offset: int, n: int) -> None:
    _pwrite_all(fd, memoryview(bytes(n)), offset)


def _components(path: str) -> list[str] | None:
    """The components of an absolute path, or None when one is ``.`` or ``..`` (or it holds a NUL)."""
    parts = [c for c in path.split("/") if c]
    if "\x00" in path or any(c in (".", "..") for c in parts):
        return None
    return parts


def confined_staging_path(uri: str, roots: Sequence[str | os.PathLike[str]]) -> tuple[Path, tuple[str, ...]]:
    """``(root, parts)``: the staging root (its real path) that the file of ``uri`` lies below, and the file's
    path below it. StagingError naming ``staging_uri`` for a URI outside every root, one with a ``.`` or ``..``
    component, or an unknown scheme. Nothing is opened: the answer says nothing of what exists outside."""
    path = _uri_path(uri)
    parts = _components(path)
    if parts is None:
        raise StagingError(f"staging_uri {uri!r}: a staging path has no '.' or '..' component (nor a NUL)")
    best: tuple[Path, tuple[str, ...]] | None = None
    best_len = -1
    for root in roots:
        real = os.path.realpath(root)
        for form in (os.path.abspath(root), real):
            prefix = _components(form)
            if prefix is None or len(parts) <= len(prefix) or parts[: len(prefix)] != prefix:
                continue
            if len(prefix) > best_len:
                best, best_len = (Path(real), tuple(parts[len(prefix) :])), len(prefix)
    if best is None:
        shown = [os.fspath(r) for r in roots]
        raise StagingError(
            f"staging_uri {uri!r} is outside the staging roots {shown} (staging files lie in the trainer's "
            f"staging directory: {STAGING_DIR_ENV} when set, else /dev/shm)"
        )
    return best


def _open_confined(uri: str, root: Path, parts: tuple[str, ...]) -> FileIO:
    """The staging file ``root/parts`` open for reading, every component below ``root`` opened without following
    a symbolic link (no check-then-open race); refused (StagingError) unless it is a regular file with one name.
    The open does not block: a FIFO with no writer (or a device) would hold the reading thread, past any
    deadline, for ever."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StagingNotFound(f"staging area {uri!r} does not exist (its staging root {root} does not)") from None
    except OSError as e:
        raise StagingError(f"cannot open the staging root of {uri!r}: {e.strerror}") from None
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                next_fd = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                raise StagingNotFound(f"staging area {uri!r} does not exist") from None
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise StagingError(
                        f"staging_uri {uri!r}: {'/'.join(parts[: i + 1])} below the staging root {root} is a "
                        "symbolic link or not a directory (a staging area is a regular file in a staging root)"
                    ) from None
                raise StagingError(f"cannot open staging area {uri!r}: {e.strerror}") from None
            os.close(fd)
            fd = next_fd
        st = os.fstat(fd)
        if not S_ISREG(st.st_mode):
            raise StagingError(f"staging_uri {uri!r} is not a regular file (a staging area is one file)")
        if st.st_nlink != 1:
            raise StagingError(f"staging_uri {uri!r} has other names (hard links): a staging area has one")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_staged(
    uri: str,
    manifest: Manifest,
    out: torch.Tensor,
    *,
    deadline_s: float | None = None,
    verify: bool = True,
    roots: Sequence[str | os.PathLike[str]] | None = None,
) -> str:
    """Sidecar side: copies the staged bytes of ``manifest`` into ``out`` (uint8, CPU,
    ``total_bytes`` long) and returns their checksum.

    The staging file must lie inside one of ``roots`` (default: ``default_staging_dir()``) and be a regular file
    reached without a symbolic link (``confined_staging_path``). Raises ``StagingError``/``StagingNotFound``,
    ``ChecksumMismatch`` (when ``verify``), and ``PhaseError(HANDOFF, "trainer")`` when the copy passes
    ``deadline_s``. No message quotes the file's size or the checksum of what it holds.
    """
    root, parts = confined_staging_path(uri, (default_staging_dir(),) if roots is None else roots)
    if out.dtype != torch.uint8 or out.numel() < manifest.total_bytes:
        raise StagingError(f"buffer of {out.numel()} bytes cannot hold {manifest.total_bytes} bytes")
    start = time.monotonic()
    f = _open_confined(uri, root, parts)
    hasher = new_hasher(manifest.checksum_algorithm)
    dest = out.numpy()[: manifest.total_bytes].data
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < manifest.total_bytes:
            log.warning(
                "staging area shorter than its manifest",
                extra={"staging_uri": uri, "size_bytes": size, "total_bytes": manifest.total_bytes},
            )
            raise StagingError(
                f"staging area {uri!r} is shorter than the {manifest.total_bytes} bytes the manifest describes"
            )
        pos = 0
        while pos < manifest.total_bytes:
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                raise PhaseError(
                    Phase.HANDOFF,
                    "trainer",
                    f"copied {pos} of {manifest.total_bytes} bytes from {uri}",
                    deadline_s=deadline_s,
                    timed_out=True,
                    policy_version=manifest.policy_version,
                )
            chunk = dest[pos : min(pos + _CHUNK, manifest.total_bytes)]
            n = f.readinto(chunk)
            if not n:
                log.warning("staging area ended early", extra={"staging_uri": uri, "at_byte": pos})
                raise StagingError(
                    f"staging area {uri!r} ended before the {manifest.total_bytes} bytes the manifest describes"
                )
            if verify:
                hasher.update(chunk[:n])
            pos += n
    digest = hasher.hexdigest() if verify else ""
    if verify and digest != manifest.checksum:
        raise ChecksumMismatch(
            f"staged bytes of version {manifest.policy_version} at {uri}",
            manifest.checksum_algorithm,
            manifest.checksum,
            digest,
        )
    return digest
