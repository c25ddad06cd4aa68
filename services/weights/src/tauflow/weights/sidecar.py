"""The sidecar's domain: retained versions, the membership, and the broadcast loop.

No grpc here: rollout servers are reached through ``MemberClient`` (``clients.py`` is
the gRPC one), and the servicer maps the errors below to status codes.

One loop broadcasts the newest accepted version to every member that has not
confirmed it:

1. group init, when membership changed since the group was built (a member joined,
   left or failed): DestroyWeightsUpdateGroup of the old group on its members, a new
   membership epoch, InitWeightsUpdateGroup on every member (rank offsets 1, 1+k1, …)
   while the sidecar joins the same group as rank 0 on its own TCPStore;
2. transfer: for each bucket, UpdateWeightsFromDistributed on all members at once while
   the sidecar broadcasts the bucket;
3. confirm: every member's ConfirmVersion, within the confirm deadline.

A member that fails a phase is dropped (state FAILED, with the error) and the others
go on from the same version in a rebuilt group. A version published while another is
being broadcast waits; a newer publish supersedes a waiting one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tauflow.weights.metrics import WeightsMetrics
from tauflow.weightsync import (
    ChecksumMismatch,
    GroupSpec,
    Manifest,
    ManifestError,
    Phase,
    PhaseError,
    StagingError,
    StagingNotFound,
    StoreHost,
    WeightGroup,
    bucket_requests,
    read_staged,
    send_bucket,
    staging_path,
    validate,
)
from tauflow.weightsync.transfer import BucketRequest

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tauflow.weights")

_KEEP_OUTCOMES = 32
_KEEP_SENT = 8


# -- errors (the servicer maps them to status codes) -------------------------------------


class WeightsError(Exception):
    pass


MAX_RANKS_PER_MEMBER = 1024  # devices of one rollout server; a client's num_ranks sizes the next weight group


class InvalidRequest(WeightsError):
    pass


class NotFound(WeightsError):
    pass


class FailedPrecondition(WeightsError):
    pass


class DataLoss(WeightsError):
    pass


class ResourceExhausted(WeightsError):
    pass


class HandoffDeadline(WeightsError):
    pass


# -- members ----------------------------------------------------------------------------


class MemberCallFailed(Exception):
    """A member RPC that failed; ``code`` is the status name (e.g. ``UNAVAILABLE``).

    ``collateral`` is true when the member answered that the collective itself failed
    (ABORTED, or its own DEADLINE_EXCEEDED before the call's deadline): it waited for
    another rank, so it is a victim of that rank's failure, not the cause.
    """

    def __init__(self, method: str, address: str, code: str, detail: str, collateral: bool = False) -> None:
        super().__init__(f"{method} at {address}: {code}: {detail}")
        self.code = code
        self.timed_out = code == "DEADLINE_EXCEEDED"
        self.collateral = collateral


class MemberClient(Protocol):
    """The weight-receiving RPCs of one rollout server; failures raise ``MemberCallFailed``."""

    async def init_group(self, spec: GroupSpec, timeout_s: float) -> None: ...

    async def update_bucket(self, request: BucketRequest, timeout_s: float) -> None: ...

    async def destroy_group(self, group_name: str, timeout_s: float) -> None: ...

    async def close(self) -> None: ...


class MemberState(enum.Enum):
    JOINING = 1
    ACTIVE = 2
    LEAVING = 3
    FAILED = 4


@dataclass
class Member:
    member_id: str
    address: str
    num_ranks: int
    backends: tuple[str, ...]
    model: str
    joined_at: float
    client: MemberClient
    state: MemberState = MemberState.JOINING
    rank_offset: int = 0
    confirmed_version: int | None = None
    confirmed_checksum: str | None = None
    sent: OrderedDict[int, str] = field(default_factory=OrderedDict)  # version -> checksum broadcast to it
    last_error: PhaseError | None = None
    error_at: float | None = None

    def has(self, version: Version) -> bool:
        return self.confirmed_version == version.manifest.policy_version and (
            self.confirmed_checksum is None or self.confirmed_checksum == version.manifest.checksum
        )


@dataclass
class Version:
    manifest: Manifest
    buffer: torch.Tensor
    accepted_at: float
    handoff_s: float
    traceparent: str = ""
    tracestate: str = ""
    broadcast_started: bool = False


@dataclass(frozen=True)
class PublishOutcome:
    policy_version: int
    superseded_policy_version: int | None
    handoff_s: float


@dataclass
class Progress:
    policy_version: int
    membership_epoch: int
    phase: Phase
    bucket_count: int
    started_at: float
    buckets_sent: int = 0
    bytes_sent: int = 0
    phase_deadline: float | None = None


@dataclass(frozen=True)
class Settings:
    backend: str = "gloo"
    device: str = ""
    load_format: str = "tauflow_flat_v1"
    flush_cache: bool = True
    max_members: int = 256
    max_retained_bytes: int = 64 * 1024**3
    handoff_s: float = 60.0
    group_s: float = 60.0
    confirm_s: float = 60.0
    destroy_s: float = 10.0
    rpc_margin_s: float = 2.0
    advertise_host: str = "127.0.0.1"

    def deadlines(self) -> dict[Phase, float]:
        return {
            Phase.HANDOFF: self.handoff_s,
            Phase.GROUP_INIT: self.group_s,
            Phase.TRANSFER: self.group_s,
            Phase.CONFIRM: self.confirm_s,
            Phase.GROUP_DESTROY: self.destroy_s,
        }


class _BufferPool:
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


# -- the sidecar ------------------------------------------------------------------------


class Sidecar:
    def __init__(
        self,
        settings: Settings,
        store: StoreHost,
        client_factory: Callable[[str], MemberClient],
        metrics: WeightsMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.store = store
        self.client_factory = client_factory
        self.metrics = metrics or WeightsMetrics.null()
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.latest: Version | None = None
        self.broadcasting: Version | None = None
        self.confirmed_version: int | None = None
        self.epoch = 0
        self.progress: Progress | None = None
        self.last_error: PhaseError | None = None
        self.last_error_at: float | None = None
        self._group: WeightGroup | None = None
        self._group_members: list[str] = []
        self._group_broken = False
        self._outcomes: OrderedDict[int, tuple[str, PublishOutcome]] = OrderedDict()
        self._pool = _BufferPool(pin=settings.backend == "nccl" and torch.cuda.is_available())
        self._publish_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- plumbing --

    def _notify(self) -> None:
        self._wake.set()
        self._changed.set()
        self._changed = asyncio.Event()
        self._observe()

    def _observe(self) -> None:
        counts = {s: 0 for s in MemberState}
        for m in self.members.values():
            counts[m.state] += 1
        self.metrics.observe(
            latest=self.latest.manifest.policy_version if self.latest else None,
            confirmed=self.confirmed_version,
            epoch=self.epoch,
            members={s.name.lower(): n for s, n in counts.items()},
            retained_bytes=self.retained_bytes(),
        )

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def retained_bytes(self) -> int:
        versions = {id(v): v for v in (self.latest, self.broadcasting) if v is not None}
        return sum(v.manifest.total_bytes for v in versions.values())

    def _release(self, version: Version | None) -> None:
        if version is not None and version is not self.latest and version is not self.broadcasting:
            self._pool.give(version.buffer)

    def _record(self, err: PhaseError) -> None:
        self.last_error = err
        self.last_error_at = self.clock()
        self.metrics.phase_failures.labels(err.phase.value).inc()
        log.warning("%s", err, extra={"phase": err.phase.value, "peer": err.peer})

    def _drop(self, m: Member, err: PhaseError) -> None:
        """A member that failed a phase leaves the membership; it must Join again."""
        m.state = MemberState.FAILED
        m.last_error = err
        m.error_at = self.clock()
        self._record(err)
        if m.member_id in self._group_members:
            self._group_broken = True
        self._notify()

    def deadline_of(self, phase: Phase) -> float:
        return self.settings.deadlines()[phase]

    # -- Publish --

    async def publish(
        self, manifest: Manifest, staging_uri: str, rebase: bool = False, traceparent: str = "", tracestate: str = ""
    ) -> PublishOutcome:
        try:
            validate(manifest)
            staging_path(staging_uri)
        except (ManifestError, StagingError) as e:
            raise InvalidRequest(str(e)) from None
        v = manifest.policy_version
        async with self._publish_lock:
            prior = self._outcomes.get(v)
            if prior is not None and prior[0] == manifest.checksum and not rebase:
                return prior[1]
            latest = self.latest
            if latest is not None and not rebase:
                newest = latest.manifest.policy_version
                if v < newest:
                    raise FailedPrecondition(
                        f"version {v} is older than the newest accepted version {newest} (set rebase to replace it)"
                    )
                if v == newest and manifest.checksum != latest.manifest.checksum:
                    raise FailedPrecondition(
                        f"version {v} was accepted with checksum {latest.manifest.checksum}, this one has "
                        f"{manifest.checksum} (set rebase to replace it)"
                    )
            held = self.broadcasting.manifest.total_bytes if self.broadcasting is not None else 0
            if held + manifest.total_bytes > self.settings.max_retained_bytes:
                raise ResourceExhausted(
                    f"version {v} needs {manifest.total_bytes} bytes; with the {held} bytes of the version being "
                    f"broadcast that exceeds max_retained_bytes {self.settings.max_retained_bytes}"
                )
            buf = self._pool.take(manifest.total_bytes)
            started = time.monotonic()
            try:
                await asyncio.to_thread(
                    read_staged, staging_uri, manifest, buf, deadline_s=self.settings.handoff_s
                )
            except BaseException as e:
                self._pool.give(buf)
                self.metrics.handoff_failures.inc()
                if isinstance(e, StagingNotFound):
                    raise NotFound(str(e)) from None
                if isinstance(e, ChecksumMismatch):
                    raise DataLoss(str(e)) from None
                if isinstance(e, PhaseError):
                    self._record(e)
                    raise HandoffDeadline(str(e)) from None
                if isinstance(e, StagingError):
                    raise InvalidRequest(str(e)) from None
                raise
            handoff_s = time.monotonic() - started
            superseded = None
            if latest is not None and not latest.broadcast_started and latest.manifest.policy_version < v:
                superseded = latest.manifest.policy_version
                self.metrics.superseded_versions.inc()
            if rebase:
                for k in [k for k in self._outcomes if k >= v]:
                    del self._outcomes[k]
            self.latest = Version(manifest, buf, self.clock(), handoff_s, traceparent, tracestate)
            self._release(latest)
            outcome = PublishOutcome(v, superseded, handoff_s)
            self._outcomes[v] = (manifest.checksum, outcome)
            while len(self._outcomes) > _KEEP_OUTCOMES:
                self._outcomes.popitem(last=False)
            self.metrics.handoff_seconds.observe(handoff_s)
            self.metrics.published_bytes.inc(manifest.total_bytes)
            log.info("accepted version", extra={"policy_version": v, "bytes": manifest.total_bytes,
                                                "handoff_ms": round(handoff_s * 1000, 1), "superseded": superseded})
            self._notify()
            return outcome

    def manifest(self, version: int | None) -> Manifest:
        if version is None:
            if self.latest is None:
                raise NotFound("no version has been published yet")
            return self.latest.manifest
        for v in (self.latest, self.broadcasting):
            if v is not None and v.manifest.policy_version == version:
                return v.manifest
        raise NotFound(f"version {version} was never published or is no longer retained")

    # -- membership --

    def join(
        self,
        member_id: str,
        address: str,
        num_ranks: int,
        backends: tuple[str, ...],
        loaded_version: int | None,
        model: str,
    ) -> int:
        """Adds (or re-adds) a member; returns the epoch from which it takes part."""
        if not member_id or not address:
            raise InvalidRequest("member_id and address must be set")
        if not 1 <= num_ranks <= MAX_RANKS_PER_MEMBER:
            raise InvalidRequest(f"num_ranks must be in 1..{MAX_RANKS_PER_MEMBER}, not {num_ranks}")
        if self.settings.backend not in backends:
            raise FailedPrecondition(
                f"member {member_id!r} supports backends {list(backends)}, the sidecar uses {self.settings.backend!r}"
            )
        if model and self.latest is not None and self.latest.manifest.model and model != self.latest.manifest.model:
            raise FailedPrecondition(
                f"member {member_id!r} serves model {model!r}, the published weights are for {self.latest.manifest.model!r}"
            )
        old = self.members.get(member_id)
        # A Join repeated by a live member changes nothing. A LEAVING member said it was going: a Join under its
        # id is its restarted process (a rolling restart reuses the id and the port), a new member to bring up
        # to date, which must not be mistaken for the old one (it would never get a broadcast).
        if old is not None and old.state in (MemberState.JOINING, MemberState.ACTIVE) and old.address == address:
            return self.epoch if old.state is MemberState.ACTIVE else self.epoch + 1
        live = [m for m in self.members.values() if m.state is not MemberState.FAILED and m.member_id != member_id]
        if len(live) >= self.settings.max_members:
            raise ResourceExhausted(f"the membership is at its maximum of {self.settings.max_members} members")
        if old is not None:
            self._spawn(old.client.close())
            if old.member_id in self._group_members:
                self._group_broken = True
        self.members[member_id] = Member(
            member_id, address, num_ranks, tuple(backends), model, self.clock(), self.client_factory(address),
            confirmed_version=loaded_version,
        )
        log.info("member joined", extra={"member_id": member_id, "address": address, "num_ranks": num_ranks})
        self._notify()
        return self.epoch + 1

    def leave(self, member_id: str, reason: str = "") -> int:
        if not member_id:
            raise InvalidRequest("member_id must be set")
        m = self.members.get(member_id)
        if m is None:
            return self.epoch
        log.info("member leaves", extra={"member_id": member_id, "reason": reason})
        if m.member_id in self._group_members and m.state is MemberState.ACTIVE:
            m.state = MemberState.LEAVING  # removed when the next group is built
        else:
            del self.members[member_id]
            self._spawn(m.client.close())
        self._notify()
        return self.epoch

    def confirm(
        self, member_id: str, version: int, manifest_checksum: str, loaded_checksum: str, load_s: float | None = None
    ) -> int | None:
        if not member_id:
            raise InvalidRequest("member_id must be set")
        m = self.members.get(member_id)
        if m is None:
            raise NotFound(f"{member_id!r} is not a member (Join first)")
        if m.state is MemberState.FAILED:
            raise NotFound(f"{member_id!r} was dropped ({m.last_error}); Join again")
        latest = self.latest.manifest.policy_version if self.latest else None
        sent = m.sent.get(version)
        if sent is None:
            raise FailedPrecondition(f"version {version} was never broadcast to {member_id!r}")
        if m.confirmed_version == version and m.confirmed_checksum == sent:
            return latest
        if manifest_checksum != sent or (loaded_checksum and loaded_checksum != sent):
            err = PhaseError(
                Phase.CONFIRM, member_id,
                f"checksum mismatch: the manifest of version {version} has {sent}, the member reports "
                f"manifest_checksum {manifest_checksum!r} and loaded_checksum {loaded_checksum!r}",
                policy_version=version, membership_epoch=self.epoch,
            )
            self._drop(m, err)
            raise DataLoss(str(err))
        if m.confirmed_version is not None and version < m.confirmed_version and version != latest:
            raise FailedPrecondition(f"version {version} is older than version {m.confirmed_version} it confirmed")
        m.confirmed_version = version
        m.confirmed_checksum = sent
        if load_s is not None:
            self.metrics.load_seconds.observe(load_s)
        self._notify()
        return latest

    # -- the broadcast loop --

    def _eligible(self) -> list[Member]:
        return sorted(
            (m for m in self.members.values() if m.state in (MemberState.JOINING, MemberState.ACTIVE)),
            key=lambda m: (m.joined_at, m.member_id),
        )

    def _needs_rebuild(self) -> bool:
        return (
            self._group is None
            or self._group_broken
            or self._group_members != [m.member_id for m in self._eligible()]
        )

    def _work(self) -> bool:
        v = self.latest
        return v is not None and any(not m.has(v) for m in self._eligible())

    async def run(self) -> None:
        """The broadcast loop (a background job of the service)."""
        backoff = 0.2
        try:
            while True:
                if not self._work():
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), 1.0)
                    except TimeoutError:
                        pass
                    continue
                started = time.monotonic()
                ok = await self._broadcast_latest()
                self.metrics.broadcast_done(ok, time.monotonic() - started)
                if ok:
                    backoff = 0.2
                else:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
        finally:
            await self._teardown()

    async def _teardown(self) -> None:
        if self._group is not None:
            self._group.destroy()
            self._group = None
        for m in self.members.values():
            await m.client.close()

    async def _broadcast_latest(self) -> bool:
        v = self.latest
        assert v is not None
        self.broadcasting = v
        v.broadcast_started = True
        links = []
        if v.traceparent:
            ctx = TraceContextTextMapPropagator().extract({"traceparent": v.traceparent, "tracestate": v.tracestate})
            span_context = trace.get_current_span(ctx).get_span_context()
            if span_context.is_valid:
                links.append(trace.Link(span_context))
        try:
            with tracer.start_as_current_span("weights.broadcast", links=links) as span:
                span.set_attribute("rl.policy_version", v.manifest.policy_version)
                span.set_attribute("weights.bytes", v.manifest.total_bytes)
                if self._needs_rebuild() and not await self._rebuild():
                    span.set_status(trace.Status(trace.StatusCode.ERROR, str(self.last_error or "group init failed")))
                    return False
                members = [self.members[i] for i in self._group_members]
                if not members or all(m.has(v) for m in members):
                    return True
                span.set_attribute("weights.membership_epoch", self.epoch)
                span.set_attribute("weights.members", len(members))
                ok = await self._transfer(v, members) and await self._confirm(v, members)
                if not ok:  # a member failed a phase; the others get the version again in a rebuilt group
                    span.set_status(trace.Status(trace.StatusCode.ERROR, str(self.last_error or "broadcast failed")))
                return ok
        finally:
            self.broadcasting = None
            self.progress = None
            self._release(v)
            self._observe()

    def _set_phase(self, phase: Phase, deadline_s: float | None) -> None:
        if self.progress is not None:
            self.progress.phase = phase
            self.progress.phase_deadline = self.clock() + deadline_s if deadline_s else None

    def _member_error(self, phase: Phase, m: Member, e: BaseException, **ctx: int) -> PhaseError:
        if isinstance(e, PhaseError):
            detail = e.detail
        else:
            detail = str(e)
        timed_out = getattr(e, "timed_out", False)
        return PhaseError(phase, m.member_id, detail, deadline_s=self.deadline_of(phase), timed_out=timed_out, **ctx)

    def _culprits(
        self, phase: Phase, members: list[Member], results: list[object], own: object, **ctx: int
    ) -> dict[str, PhaseError]:
        """The members to drop after a failed phase: those that failed on their own (unreachable,
        refused, hung past the call's deadline); when every failure is collateral, the ranks the
        sidecar's own error names (those that never arrived)."""
        culprits = {
            m.member_id: self._member_error(phase, m, r, **ctx)
            for m, r in zip(members, results, strict=True)
            if isinstance(r, BaseException) and not getattr(r, "collateral", False)
        }
        if not culprits and isinstance(own, PhaseError) and own.ranks:
            for m in members:
                if any(m.rank_offset <= r < m.rank_offset + m.num_ranks for r in own.ranks):
                    culprits[m.member_id] = PhaseError(phase, m.member_id, own.detail, deadline_s=own.deadline_s,
                                                       timed_out=own.timed_out, **ctx)
        if not culprits:
            failures = [r for r in (own, *results) if isinstance(r, BaseException)]
            if failures:
                first = failures[0]
                self._record(first if isinstance(first, PhaseError) else PhaseError(phase, "sidecar", str(first), **ctx))
        return culprits

    async def _destroy_old(self) -> None:
        group, names = self._group, self._group_members
        self._group, self._group_members, self._group_broken = None, [], False
        if group is None:
            return
        self._set_phase(Phase.GROUP_DESTROY, self.settings.destroy_s)
        started = time.monotonic()
        olds = [self.members[i] for i in names if i in self.members]
        calls = [m.client.destroy_group(group.name, self.settings.destroy_s) for m in olds]
        results = await asyncio.gather(asyncio.to_thread(group.destroy), *calls, return_exceptions=True)
        for m, r in zip(olds, results[1:], strict=True):
            if isinstance(r, BaseException) and m.state is not MemberState.FAILED:  # keep a failure's first cause
                err = self._member_error(Phase.GROUP_DESTROY, m, r, membership_epoch=group.spec.membership_epoch)
                if m.state in (MemberState.ACTIVE, MemberState.JOINING) and getattr(r, "code", "") == "UNAVAILABLE":
                    self._drop(m, err)  # unreachable: it would fail the next group's rendezvous anyway
                else:
                    m.last_error, m.error_at = err, self.clock()
        for m in olds:
            if m.state is MemberState.LEAVING:
                del self.members[m.member_id]
                self._spawn(m.client.close())
            elif m.state is MemberState.ACTIVE:
                m.state = MemberState.JOINING
        self.metrics.phase_seconds.labels(Phase.GROUP_DESTROY.value).observe(time.monotonic() - started)

    async def _rebuild(self) -> bool:
        """Builds the group of a new membership epoch; False when a member failed (dropped)."""
        await self._destroy_old()
        members = self._eligible()
        if not members:
            self._notify()
            return True
        self.epoch += 1
        epoch = self.epoch
        offsets, rank = {}, 1
        for m in members:
            offsets[m.member_id] = rank
            rank += m.num_ranks
        name = f"tauflow-weights-e{epoch}"
        spec = GroupSpec(self.settings.advertise_host, self.store.port, name, rank, 0, self.settings.backend,
                         epoch, self.settings.group_s)
        labels = {r: m.member_id for m in members for r in range(offsets[m.member_id],
                                                                 offsets[m.member_id] + m.num_ranks)}
        v = self.latest
        self.progress = Progress(v.manifest.policy_version if v else 0, epoch, Phase.GROUP_INIT,
                                 len(v.manifest.buckets) if v else 0, self.clock())
        self._set_phase(Phase.GROUP_INIT, self.settings.group_s)
        log.info("building weight group", extra={"group": name, "world_size": rank, "members": len(members)})
        started = time.monotonic()
        timeout = self.settings.group_s + self.settings.rpc_margin_s
        calls = [
            m.client.init_group(GroupSpec(spec.master_address, spec.master_port, name, rank, offsets[m.member_id],
                                          spec.backend, epoch, spec.timeout_s), timeout)
            for m in members
        ]
        results = await asyncio.gather(
            asyncio.to_thread(WeightGroup, self.store.store, spec, labels), *calls, return_exceptions=True
        )
        own = results[0]
        for m in members:
            m.rank_offset = offsets[m.member_id]
        failed = any(isinstance(r, BaseException) for r in results)
        if not isinstance(own, BaseException):
            self._group = own
        self._group_members = [m.member_id for m in members]
        if failed:
            for mid, err in self._culprits(Phase.GROUP_INIT, members, results[1:], own,
                                           membership_epoch=epoch).items():
                self._drop(self.members[mid], err)
            self._group_broken = True
            return False
        for m in members:
            m.state = MemberState.ACTIVE
        self.metrics.phase_seconds.labels(Phase.GROUP_INIT.value).observe(time.monotonic() - started)
        self._notify()
        return True

    async def _transfer(self, v: Version, members: list[Member]) -> bool:
        group = self._group
        assert group is not None
        m_ = v.manifest
        self.progress = Progress(m_.policy_version, self.epoch, Phase.TRANSFER, len(m_.buckets), self.clock())
        self._set_phase(Phase.TRANSFER, self.settings.group_s)
        requests = bucket_requests(m_, group_name=group.name, membership_epoch=self.epoch,
                                   load_format=self.settings.load_format, flush_cache=self.settings.flush_cache)
        # Each member's `weights.load` links to the trainer's `weights.publish` of the version, as this
        # broadcast does.
        requests = [dataclasses.replace(r, traceparent=v.traceparent, tracestate=v.tracestate) for r in requests]
        for m in members:
            m.sent[m_.policy_version] = m_.checksum
            while len(m.sent) > _KEEP_SENT:
                m.sent.popitem(last=False)
        timeout = self.settings.group_s + self.settings.rpc_margin_s
        started = time.monotonic()
        for b, req in zip(m_.buckets, requests, strict=True):
            if any(m.state is not MemberState.ACTIVE for m in members):
                log.info("membership changed during the transfer; resending in a rebuilt group",
                         extra={"policy_version": m_.policy_version})
                self._group_broken = True
                return False
            self._set_phase(Phase.TRANSFER, self.settings.group_s)
            data = v.buffer[b.offset_bytes : b.offset_bytes + b.size_bytes]
            send = asyncio.to_thread(send_bucket, group, b, data, policy_version=m_.policy_version,
                                     load_format=self.settings.load_format)
            calls = [m.client.update_bucket(req, timeout) for m in members]
            results = await asyncio.gather(send, *calls, return_exceptions=True)
            ctx = {"policy_version": m_.policy_version, "membership_epoch": self.epoch, "bucket_index": b.index}
            if any(isinstance(r, BaseException) for r in results):
                for mid, err in self._culprits(Phase.TRANSFER, members, results[1:], results[0], **ctx).items():
                    self._drop(self.members[mid], err)
                self._group_broken = True
                return False
            self.progress.buckets_sent += 1
            self.progress.bytes_sent += b.size_bytes
            self.metrics.broadcast_bytes.inc(b.size_bytes)
        took = time.monotonic() - started
        self.metrics.phase_seconds.labels(Phase.TRANSFER.value).observe(took)
        if took > 0:
            self.metrics.bandwidth.set(m_.total_bytes / took)
        log.info("broadcast version", extra={"policy_version": m_.policy_version, "members": len(members),
                                             "seconds": round(took, 3)})
        return True

    async def _confirm(self, v: Version, members: list[Member]) -> bool:
        self._set_phase(Phase.CONFIRM, self.settings.confirm_s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        until = started + self.settings.confirm_s
        while True:
            pending = [m for m in members if m.state is MemberState.ACTIVE and not m.has(v)]
            if not pending:
                break
            left = until - loop.time()
            if left <= 0:
                for m in pending:
                    self._drop(m, PhaseError(
                        Phase.CONFIRM, m.member_id, f"no ConfirmVersion for version {v.manifest.policy_version}",
                        deadline_s=self.settings.confirm_s, timed_out=True,
                        policy_version=v.manifest.policy_version, membership_epoch=self.epoch,
                    ))
                return False
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                pass
        self.metrics.phase_seconds.labels(Phase.CONFIRM.value).observe(loop.time() - started)
        if all(m.has(v) for m in members if m.state is MemberState.ACTIVE):
            self.confirmed_version = v.manifest.policy_version
            self.metrics.versions_broadcast.inc()
        self._notify()
        return True
