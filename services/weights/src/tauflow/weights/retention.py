"""The versions the sidecar holds, and Publish: the hand-off of a staged version, idempotent per version.

The sidecar retains the newest accepted version and the one being broadcast (the same one, or an
older one while a newer waits); a newer publish supersedes a version whose broadcast has not started.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tauflow.weights.config import WeightsConfig
from tauflow.weights.errors import (
    DataLoss,
    FailedPrecondition,
    HandoffDeadline,
    InvalidRequest,
    NotFound,
    ResourceExhausted,
)
from tauflow.weights.events import Events, log
from tauflow.weights.metrics import WeightsMetrics
from tauflow.weightsync import (
    ChecksumMismatch,
    Manifest,
    ManifestError,
    Phase,
    PhaseError,
    StagingError,
    StagingNotFound,
    confined_staging_path,
    read_staged,
    validate,
)
from tauflow.weightsync.ipc import CHECKSUM as IPC_CHECKSUM
from tauflow.weightsync.ipc import MAX_URI_CHARS
from tauflow.weightsync.ipc import SCHEME as IPC_SCHEME

_KEEP_OUTCOMES = 32  # versions whose Publish outcome a repeat gets back


@dataclass
class Version:
    manifest: Manifest
    buffer: torch.Tensor | None  # None: the ipc backend holds no bytes (members read staging_uri)
    accepted_at: float
    handoff_s: float
    traceparent: str = ""
    tracestate: str = ""
    broadcast_started: bool = False
    staging_uri: str = ""  # the ipc backend's: the trainer's shared buffer
    superseded: int | None = None  # the version this one replaced before its broadcast began

    def log_fields(self) -> dict[str, object]:
        """What the hand-off of this version was, for the one INFO line of its broadcast."""
        return {
            "policy_version": self.manifest.policy_version,
            "bytes": self.manifest.total_bytes,
            "handoff_ms": round(self.handoff_s * 1000, 1),
            "superseded": self.superseded,
        }


@dataclass(frozen=True)
class PublishOutcome:
    policy_version: int
    superseded_policy_version: int | None
    handoff_s: float


def check_shared_uri(staging_uri: str) -> None:
    """The ipc backend takes the trainer's ``ipc://`` URI as it is: its members open it (the sidecar has no
    device of its own to open a CUDA IPC handle on), and check the bytes there."""
    if not staging_uri.startswith(IPC_SCHEME) or len(staging_uri) > MAX_URI_CHARS:
        raise StagingError(
            f"staging_uri: the ipc backend takes an {IPC_SCHEME} URI of at most {MAX_URI_CHARS} characters "
            f"(the trainer's shared buffer), not {staging_uri[:32]!r}"
        )


class BufferPool:
    """Spare version buffers, reused so that a hand-off does not fault fresh pages in."""

    def __init__(self, pin: bool, spare: int = 2) -> None:
        self.pin = pin
        self.spare = spare
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        for i, buf in enumerate(self._free):
            if buf.numel() == nbytes:
                return self._free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)
        del self._free[: -self.spare]


class Retention:
    def __init__(self, config: WeightsConfig, events: Events, metrics: WeightsMetrics) -> None:
        self.config = config
        self.events = events
        self.metrics = metrics
        self.latest: Version | None = None
        self.broadcasting: Version | None = None
        self._outcomes: OrderedDict[int, tuple[str, PublishOutcome]] = OrderedDict()  # version -> (checksum, outcome)
        self._pool = BufferPool(pin=config.backend == "nccl" and torch.cuda.is_available())
        self._publish_lock = asyncio.Lock()
        self._abandoned_bytes = 0  # buffers still written by hand-offs whose deadline passed (a hung read)

    def _copy_abandoned(self, buf: torch.Tensor, copy: asyncio.Future[str]) -> None:
        """A hand-off's read that ended after its deadline: its buffer is free again."""
        _ignore_outcome(copy)
        self._abandoned_bytes -= buf.numel()
        self._pool.give(buf)

    @property
    def latest_version(self) -> int | None:
        return self.latest.manifest.policy_version if self.latest else None

    def retained_bytes(self) -> int:
        versions = {id(v): v for v in (self.latest, self.broadcasting) if v is not None}
        return sum(v.manifest.total_bytes for v in versions.values() if v.buffer is not None)

    def _release(self, version: Version | None) -> None:
        if (
            version is not None
            and version.buffer is not None
            and version is not self.latest
            and version is not self.broadcasting
        ):
            self._pool.give(version.buffer)

    # -- the broadcast holds the version it sends --

    def start_broadcast(self) -> Version:
        """The newest version, now being broadcast (a later publish no longer supersedes it)."""
        version = self.latest
        assert version is not None
        self.broadcasting = version
        version.broadcast_started = True
        return version

    def end_broadcast(self, version: Version) -> None:
        self.broadcasting = None
        self._release(version)

    # -- Publish / GetManifest --

    async def publish(
        self, manifest: Manifest, staging_uri: str, rebase: bool = False, traceparent: str = "", tracestate: str = ""
    ) -> PublishOutcome:
        shared = self.config.backend == "ipc"
        try:
            validate(manifest)
            if shared:
                check_shared_uri(staging_uri)
                if manifest.checksum_algorithm != IPC_CHECKSUM:
                    raise StagingError(
                        f"manifest.checksum_algorithm: the ipc backend's members check {IPC_CHECKSUM!r}, "
                        f"not {manifest.checksum_algorithm!r}"
                    )
            else:
                # Only a file in the staging roots: the port has no authentication, and any other file the
                # sidecar can read would otherwise be a version a caller names (and a Join receives).
                confined_staging_path(staging_uri, self.config.staging_roots)
        except (ManifestError, StagingError) as e:
            raise InvalidRequest(str(e)) from None
        version = manifest.policy_version
        async with self._publish_lock:
            prior = self._outcomes.get(version)
            if prior is not None and prior[0] == manifest.checksum and not rebase:
                return prior[1]
            latest = self.latest
            if latest is not None and not rebase:
                newest = latest.manifest.policy_version
                if version < newest:
                    raise FailedPrecondition(
                        f"version {version} is older than the newest accepted version {newest} "
                        "(set rebase to replace it)"
                    )
                if version == newest and manifest.checksum != latest.manifest.checksum:
                    raise FailedPrecondition(
                        f"version {version} was accepted with checksum {latest.manifest.checksum}, this one has "
                        f"{manifest.checksum} (set rebase to replace it)"
                    )
            held = self.broadcasting.manifest.total_bytes if self.broadcasting is not None else 0
            held += self._abandoned_bytes  # (their memory is held until their reads end)
            limit = self.config.max_retained_bytes
            if not shared and held + manifest.total_bytes > limit:
                raise ResourceExhausted(
                    f"version {version} needs {manifest.total_bytes} bytes; with the {held} bytes of the version "
                    "being broadcast and of hand-offs still reading past their deadline that exceeds "
                    f"max_retained_bytes {limit}"
                )
            buf = None if shared else self._pool.take(manifest.total_bytes)
            started = time.monotonic()
            copy: asyncio.Future[str] | None = None
            try:
                if buf is not None:  # (ipc: nothing to copy; the members read the trainer's buffer)
                    deadline_s = self.config.deadlines.handoff_s
                    copy = asyncio.ensure_future(
                        asyncio.to_thread(
                            read_staged,
                            staging_uri,
                            manifest,
                            buf,
                            deadline_s=deadline_s,
                            roots=self.config.staging_roots,
                        )
                    )
                    # The copy checks the deadline between chunks; a read that blocks must not hold the
                    # publish lock (every later Publish waits on it) past the deadline all the same.
                    try:
                        async with asyncio.timeout(deadline_s):  # (not wait_for: it can swallow a cancellation)
                            await asyncio.shield(copy)
                    except TimeoutError:
                        raise PhaseError(
                            Phase.HANDOFF,
                            "trainer",
                            f"reading {staging_uri} did not finish",
                            deadline_s=deadline_s,
                            timed_out=True,
                            policy_version=version,
                        ) from None
            except BaseException as e:
                if copy is not None and not copy.done():
                    # Its thread still writes into the buffer: the buffer is not reused until it ends (and counts
                    # against max_retained_bytes meanwhile); the outcome is nobody's.
                    assert buf is not None
                    self._abandoned_bytes += buf.numel()
                    copy.add_done_callback(functools.partial(self._copy_abandoned, buf))
                elif buf is not None:
                    self._pool.give(buf)
                self.metrics.handoff_failures.inc()
                if isinstance(e, ChecksumMismatch):  # (the answer names the manifest's checksum only)
                    log.warning(
                        "staged bytes do not match the manifest's checksum",
                        extra={
                            "policy_version": version,
                            "staging_uri": staging_uri,
                            "algorithm": e.algorithm,
                            "expected": e.expected,
                            "actual": e.actual,
                        },
                    )
                if isinstance(e, StagingNotFound):
                    raise NotFound(str(e)) from None
                if isinstance(e, ChecksumMismatch):
                    raise DataLoss(str(e)) from None
                if isinstance(e, PhaseError):
                    self.events.record(e)
                    raise HandoffDeadline(str(e)) from None
                if isinstance(e, StagingError):
                    raise InvalidRequest(str(e)) from None
                raise
            handoff_s = time.monotonic() - started
            superseded = None
            if latest is not None and not latest.broadcast_started and latest.manifest.policy_version < version:
                superseded = latest.manifest.policy_version
                self.metrics.superseded_versions.inc()
            if rebase:
                for k in [k for k in self._outcomes if k >= version]:
                    del self._outcomes[k]
            self.latest = Version(
                manifest,
                buf,
                self.events.clock(),
                handoff_s,
                traceparent,
                tracestate,
                staging_uri=staging_uri if shared else "",
                superseded=superseded,
            )
            self._release(latest)
            outcome = PublishOutcome(version, superseded, handoff_s)
            self._outcomes[version] = (manifest.checksum, outcome)
            while len(self._outcomes) > _KEEP_OUTCOMES:
                self._outcomes.popitem(last=False)
            self.metrics.handoff_seconds.observe(handoff_s)
            self.metrics.published_bytes.inc(manifest.total_bytes)
            # (DEBUG: the line of its broadcast says the same at INFO; one INFO line per version, not two)
            log.debug("accepted version", extra=self.latest.log_fields())
            self.events.notify()
            return outcome

    def manifest(self, version: int | None) -> Manifest:
        if version is None:
            if self.latest is None:
                raise NotFound("no version has been published yet")
            return self.latest.manifest
        for held in (self.latest, self.broadcasting):
            if held is not None and held.manifest.policy_version == version:
                return held.manifest
        raise NotFound(f"version {version} was never published or is no longer retained")


def _ignore_outcome(future: asyncio.Future[str]) -> None:
    if not future.cancelled():
        future.exception()
