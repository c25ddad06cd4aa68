"""The broadcast loop: sends the newest accepted version to every member that has not confirmed it.

Each round, for the newest version:

1. group init, when membership changed since the group was built (a member joined, left or failed):
   DestroyWeightsUpdateGroup of the old group on its members, a new membership epoch,
   InitWeightsUpdateGroup on every member (rank offsets 1, 1+k1, …) while the sidecar joins the same
   group as rank 0 on its own TCPStore;
2. transfer: for each bucket, UpdateWeightsFromDistributed on all members at once while the sidecar
   broadcasts the bucket;
3. confirm: every member's ConfirmVersion (membership.py records them), within the confirm deadline.

With the ``ipc`` backend (colocated: the members share the trainer's machine) there is no group: a membership
change only starts a new epoch, and the transfer is one UpdateWeightsFromTensor per member, naming the
trainer's shared buffer, which each member copies and checks on its own device.

A member that fails a phase is dropped (state FAILED, with the error) and the others go on from the
same version in a rebuilt group. Failed rounds are retried with a backoff.

A dead member must not hold the others up for the group's timeout. Before a transfer in a group built
earlier, every member is probed (its status, one cheap call): one that is not there (UNAVAILABLE) is
dropped and the group rebuilt first (with no destroy sent to it). During a transfer, a member whose own call fails (not as a victim of
the collective) has the group aborted at once: the sidecar's send ends, the members still waiting get
``ABORT_GRACE_S`` to answer and are then left (the group's destroy ends their receive), and the survivors
get the version in a rebuilt group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tauflow.weights.config import DeadlinesConfig, WeightsConfig
from tauflow.weights.events import Events, log
from tauflow.weights.membership import Member, Membership, MemberState
from tauflow.weights.metrics import WeightsMetrics
from tauflow.weights.ports import MemberCallFailed
from tauflow.weights.retention import Retention, Version
from tauflow.weightsync import (
    GroupSpec,
    Phase,
    PhaseError,
    StoreHost,
    WeightGroup,
    bucket_requests,
    send_bucket,
    shared_request,
)

tracer = trace.get_tracer("tauflow.weights")

ABORT_GRACE_S = 1.0  # after a member failed on its own: how long the others' calls of the bucket may still answer
PROBE_S = 2.0  # the probe's deadline (at most deadlines.destroy_s); one that does not answer in time is not blamed


def phase_deadlines(deadlines: DeadlinesConfig) -> dict[Phase, float]:
    return {
        Phase.HANDOFF: deadlines.handoff_s,
        Phase.GROUP_INIT: deadlines.group_s,
        Phase.TRANSFER: deadlines.group_s,
        Phase.CONFIRM: deadlines.confirm_s,
        Phase.GROUP_DESTROY: deadlines.destroy_s,
    }


class FailureContext(TypedDict, total=False):
    """Where a phase failed, as PhaseError takes it."""

    policy_version: int
    membership_epoch: int
    bucket_index: int


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


async def _destroy_call(m: Member, group_name: str, timeout_s: float) -> None:
    if m.state is MemberState.FAILED and m.unreachable:
        return  # nothing answers there (each call would take the channel's retries to fail)
    await m.client.destroy_group(group_name, timeout_s)


def _own_failure(call: asyncio.Future[None]) -> bool:
    """A member call that failed on its own account, not as a victim of the collective."""
    err = call.exception()
    return err is not None and not getattr(err, "collateral", False)


def _overwritten(err: BaseException) -> bool:
    return isinstance(err, MemberCallFailed) and err.code == "DATA_LOSS"


class Broadcast:
    def __init__(
        self,
        config: WeightsConfig,
        store: StoreHost,
        retention: Retention,
        membership: Membership,
        events: Events,
        metrics: WeightsMetrics,
    ) -> None:
        self.config = config
        self.deadlines = config.deadlines
        self.store = store
        self.retention = retention
        self.membership = membership
        self.events = events
        self.metrics = metrics
        self.confirmed_version: int | None = None  # the newest version every active member confirmed
        self.progress: Progress | None = None
        self._group: WeightGroup | None = None
        self.shared = config.backend == "ipc"

    def _needs_rebuild(self) -> bool:
        return (self._group is None and not self.shared) or self.membership.group_outdated()

    def _work(self) -> bool:
        latest = self.retention.latest
        return latest is not None and any(not m.has(latest) for m in self.membership.eligible())

    async def run(self) -> None:
        """The broadcast loop (a background job of the service)."""
        backoff = 0.2
        try:
            while True:
                if not self._work():
                    self.events.wake.clear()
                    try:
                        # Not wait_for: on Python 3.11 a cancellation that comes as the event is set is
                        # swallowed, and this loop ran on forever (the sidecar's stop hung; seen in a test).
                        async with asyncio.timeout(1.0):
                            await self.events.wake.wait()
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
        for m in self.membership.members.values():
            await m.client.close()

    async def _broadcast_latest(self) -> bool:
        version = self.retention.start_broadcast()
        manifest = version.manifest
        links = []
        if version.traceparent:
            carrier = {"traceparent": version.traceparent, "tracestate": version.tracestate}
            span_context = trace.get_current_span(TraceContextTextMapPropagator().extract(carrier)).get_span_context()
            if span_context.is_valid:
                links.append(trace.Link(span_context))
        try:
            with tracer.start_as_current_span("weights.broadcast", links=links) as span:
                span.set_attribute("rl.policy_version", manifest.policy_version)
                span.set_attribute("weights.bytes", manifest.total_bytes)
                rebuild = self._new_roster if self.shared else self._rebuild
                if not self.shared and not self._needs_rebuild():
                    await self._drop_unreachable(version)
                if self._needs_rebuild() and not await rebuild():
                    span.set_status(
                        trace.Status(trace.StatusCode.ERROR, str(self.events.last_error or "group init failed"))
                    )
                    return False
                members = [self.membership.members[i] for i in self.membership.group_ids]
                if not members or all(m.has(version) for m in members):
                    return True
                span.set_attribute("weights.membership_epoch", self.membership.epoch)
                span.set_attribute("weights.members", len(members))
                transfer = self._transfer_shared if self.shared else self._transfer
                ok = await transfer(version, members) and await self._confirm(version, members)
                if not ok:  # a member failed a phase; the others get the version again in a rebuilt group
                    span.set_status(
                        trace.Status(trace.StatusCode.ERROR, str(self.events.last_error or "broadcast failed"))
                    )
                return ok
        finally:
            self.progress = None
            self.retention.end_broadcast(version)
            self.events.refresh_gauges()

    def _set_phase(self, phase: Phase, deadline_s: float | None) -> None:
        if self.progress is not None:
            self.progress.phase = phase
            self.progress.phase_deadline = self.events.clock() + deadline_s if deadline_s else None

    def _member_error(self, phase: Phase, m: Member, e: BaseException, **ctx: Unpack[FailureContext]) -> PhaseError:
        detail = e.detail if isinstance(e, PhaseError) else str(e)
        timed_out = getattr(e, "timed_out", False)
        return PhaseError(
            phase, m.member_id, detail, deadline_s=phase_deadlines(self.deadlines)[phase], timed_out=timed_out, **ctx
        )

    def _culprits(
        self,
        phase: Phase,
        members: list[Member],
        results: Sequence[object],
        own: object,
        **ctx: Unpack[FailureContext],
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
                    culprits[m.member_id] = PhaseError(
                        phase, m.member_id, own.detail, deadline_s=own.deadline_s, timed_out=own.timed_out, **ctx
                    )
        if not culprits:
            failures = [r for r in (own, *results) if isinstance(r, BaseException)]
            if failures:
                first = failures[0]
                self.events.record(
                    first if isinstance(first, PhaseError) else PhaseError(phase, "sidecar", str(first), **ctx)
                )
        return culprits

    def _drop_culprits(
        self, phase: Phase, members: list[Member], results: Sequence[object], **ctx: Unpack[FailureContext]
    ) -> None:
        """After a failed phase (``results``: the sidecar's own outcome, then each member's)."""
        outcomes = {m.member_id: r for m, r in zip(members, results[1:], strict=True)}
        for member_id, err in self._culprits(phase, members, results[1:], results[0], **ctx).items():
            m = self.membership.members[member_id]
            outcome = outcomes.get(member_id)
            m.unreachable = isinstance(outcome, MemberCallFailed) and outcome.code == "UNAVAILABLE"
            self.membership.drop(m, err)
        self.membership.group_broken = True

    async def _destroy_old(self) -> None:
        group, ids = self._group, self.membership.forget_group()
        self._group = None
        if group is None:
            return
        destroy_s = self.deadlines.destroy_s
        self._set_phase(Phase.GROUP_DESTROY, destroy_s)
        started = time.monotonic()
        old_members = [self.membership.members[i] for i in ids if i in self.membership.members]
        calls = [_destroy_call(m, group.name, destroy_s) for m in old_members]
        results = await asyncio.gather(asyncio.to_thread(group.destroy), *calls, return_exceptions=True)
        for m, r in zip(old_members, results[1:], strict=True):
            if isinstance(r, BaseException) and m.state is not MemberState.FAILED:  # keep a failure's first cause
                err = self._member_error(Phase.GROUP_DESTROY, m, r, membership_epoch=group.spec.membership_epoch)
                if m.state in (MemberState.ACTIVE, MemberState.JOINING) and getattr(r, "code", "") == "UNAVAILABLE":
                    self.membership.drop(m, err)  # unreachable: it would fail the next group's rendezvous anyway
                else:
                    m.last_error, m.error_at = err, self.events.clock()
        self.membership.settle_destroyed(old_members)
        self.metrics.phase_seconds.labels(Phase.GROUP_DESTROY.value).observe(time.monotonic() - started)

    async def _rebuild(self) -> bool:
        """Builds the group of a new membership epoch; False when a member failed (dropped)."""
        await self._destroy_old()
        try:  # (no group now: the old one's rendezvous keys, and anything an outsider wrote, are dropped)
            dropped = await asyncio.to_thread(self.store.clear)
            log.debug("store cleared between groups", extra={"keys": dropped})
        except Exception as e:  # noqa: BLE001 - best effort: a store that fails here fails the rendezvous, said there
            log.warning("could not clear the store between groups", extra={"error": f"{type(e).__name__}: {e}"})
        members = self.membership.eligible()
        if not members:
            self.events.notify()
            return True
        epoch = self.membership.next_epoch()
        offsets, world_size = {}, 1
        for m in members:
            offsets[m.member_id] = world_size
            world_size += m.num_ranks
        # The store takes no token: a name nobody can know before the build keeps rendezvous keys planted for
        # future epochs from being read by its ranks (members learn it from the authenticated call).
        name = f"tauflow-weights-e{epoch}-{secrets.token_hex(8)}"
        group_s = self.deadlines.group_s
        spec = GroupSpec(
            self.config.store.advertised_host, self.store.port, name, world_size, 0, self.config.backend, epoch, group_s
        )
        labels = {
            rank: m.member_id
            for m in members
            for rank in range(offsets[m.member_id], offsets[m.member_id] + m.num_ranks)
        }
        latest = self.retention.latest
        self.progress = Progress(
            latest.manifest.policy_version if latest else 0,
            epoch,
            Phase.GROUP_INIT,
            len(latest.manifest.buckets) if latest else 0,
            self.events.clock(),
        )
        self._set_phase(Phase.GROUP_INIT, group_s)
        log.info("building weight group", extra={"group": name, "world_size": world_size, "members": len(members)})
        started = time.monotonic()
        timeout = group_s + self.deadlines.rpc_margin_s
        calls = [m.client.init_group(dataclasses.replace(spec, rank=offsets[m.member_id]), timeout) for m in members]
        results = await asyncio.gather(
            asyncio.to_thread(WeightGroup, self.store.store, spec, labels), *calls, return_exceptions=True
        )
        own = results[0]
        for m in members:
            m.rank_offset = offsets[m.member_id]
        if not isinstance(own, BaseException):
            self._group = own
        self.membership.group_ids = [m.member_id for m in members]
        gone = [m.member_id for m in members if self.membership.members.get(m.member_id) is not m]
        if gone:  # left (or was replaced by a new Join) while the group was built: this group is short of it
            log.info("a member left while its group was built; rebuilding", extra={"members": gone, "group": name})
            self.membership.group_ids = [i for i in self.membership.group_ids if i not in gone]
            self.membership.group_broken = True
            return False
        if any(isinstance(r, BaseException) for r in results):
            self._drop_culprits(Phase.GROUP_INIT, members, results, membership_epoch=epoch)
            return False
        for m in members:
            m.state = MemberState.ACTIVE
        self.metrics.phase_seconds.labels(Phase.GROUP_INIT.value).observe(time.monotonic() - started)
        self.events.notify()
        return True

    async def _new_roster(self) -> bool:
        """ipc: the members of a new epoch; nothing to build (each reads the trainer's buffer on its own)."""
        ids = self.membership.forget_group()
        self.membership.settle_destroyed([self.membership.members[i] for i in ids if i in self.membership.members])
        members = self.membership.eligible()
        if members:
            self.membership.next_epoch()
            self.membership.group_ids = [m.member_id for m in members]
            for m in members:
                m.state = MemberState.ACTIVE
        self.events.notify()
        return True

    async def _drop_unreachable(self, version: Version) -> None:
        """Drops the members of the current group that no longer answer at their address (a process that died
        since the last version): a transfer with them would wait for the group's timeout."""
        members = [self.membership.members[i] for i in self.membership.group_ids]
        timeout = min(PROBE_S, self.deadlines.destroy_s)

        async def unreachable(m: Member) -> MemberCallFailed | None:
            try:
                await m.client.probe(timeout)  # (the channel tries an UNAVAILABLE status call again by itself)
            except MemberCallFailed as e:
                return e if e.code == "UNAVAILABLE" else None  # there, busy or refusing: the transfer will tell
            return None

        results = await asyncio.gather(*(unreachable(m) for m in members))
        for m, err in zip(members, results, strict=True):
            if err is not None and m.state is MemberState.ACTIVE:
                m.unreachable = True
                self.membership.drop(
                    m,
                    PhaseError(
                        Phase.TRANSFER,
                        m.member_id,
                        f"unreachable before the transfer: {err}",
                        policy_version=version.manifest.policy_version,
                        membership_epoch=self.membership.epoch,
                    ),
                )

    def _record_sent(self, manifest_version: int, checksum: str, members: list[Member]) -> None:
        for m in members:
            m.record_sent(manifest_version, checksum)

    async def _transfer_shared(self, version: Version, members: list[Member]) -> bool:
        """ipc: every member loads the version from the trainer's buffer at once."""
        manifest = version.manifest
        epoch = self.membership.epoch
        group_s = self.deadlines.group_s
        self.progress = Progress(manifest.policy_version, epoch, Phase.TRANSFER, 1, self.events.clock())
        self._set_phase(Phase.TRANSFER, group_s)
        request = shared_request(
            manifest,
            version.staging_uri,
            membership_epoch=epoch,
            flush_cache=self.config.flush_cache,
            traceparent=version.traceparent,
            tracestate=version.tracestate,
        )
        self._record_sent(manifest.policy_version, manifest.checksum, members)
        timeout = group_s + self.deadlines.rpc_margin_s
        started = time.monotonic()
        results = await asyncio.gather(
            *(m.client.update_from_shared(request, timeout) for m in members), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        latest = self.retention.latest
        overwritten = latest is not None and latest is not version and latest.staging_uri == version.staging_uri
        if failures and overwritten and all(_overwritten(r) for r in failures):
            # The trainer staged a newer version into this very buffer (its stager alternates two) before every
            # member read it: nobody's fault; the loop goes on with the newest.
            log.info(
                "shared buffer overwritten by a newer version before every member read it; sending the newest",
                extra={"policy_version": manifest.policy_version},
            )
            return False
        if failures:
            self._drop_culprits(
                Phase.TRANSFER,
                members,
                [None, *results],
                policy_version=manifest.policy_version,
                membership_epoch=epoch,
            )
            return False
        took = time.monotonic() - started
        self.progress.buckets_sent, self.progress.bytes_sent = 1, manifest.total_bytes
        self.metrics.phase_seconds.labels(Phase.TRANSFER.value).observe(took)
        self.metrics.broadcast_bytes.inc(manifest.total_bytes * len(members))
        log.info(
            "members loaded version from the shared buffer",
            extra={**version.log_fields(), "members": len(members), "seconds": round(took, 3)},
        )
        return True

    async def _transfer(self, version: Version, members: list[Member]) -> bool:
        group = self._group
        assert group is not None
        manifest = version.manifest
        epoch = self.membership.epoch
        group_s = self.deadlines.group_s
        load_format = self.config.load_format
        self.progress = Progress(
            manifest.policy_version, epoch, Phase.TRANSFER, len(manifest.buckets), self.events.clock()
        )
        self._set_phase(Phase.TRANSFER, group_s)
        requests = bucket_requests(
            manifest,
            group_name=group.name,
            membership_epoch=epoch,
            load_format=load_format,
            flush_cache=self.config.flush_cache,
        )
        # Each member's `weights.load` links to the trainer's `weights.publish` of the version, as this
        # broadcast does.
        requests = [
            dataclasses.replace(r, traceparent=version.traceparent, tracestate=version.tracestate) for r in requests
        ]
        self._record_sent(manifest.policy_version, manifest.checksum, members)
        timeout = group_s + self.deadlines.rpc_margin_s
        started = time.monotonic()
        for bucket, request in zip(manifest.buckets, requests, strict=True):
            if any(m.state is not MemberState.ACTIVE for m in members):
                log.info(
                    "membership changed during the transfer; resending in a rebuilt group",
                    extra={"policy_version": manifest.policy_version},
                )
                self.membership.group_broken = True
                return False
            self._set_phase(Phase.TRANSFER, group_s)
            assert version.buffer is not None
            data = version.buffer[bucket.offset_bytes : bucket.offset_bytes + bucket.size_bytes]
            send = asyncio.to_thread(
                send_bucket, group, bucket, data, policy_version=manifest.policy_version, load_format=load_format
            )
            calls = [m.client.update_bucket(request, timeout) for m in members]
            results = await self._bucket_outcome(group, send, calls, members)
            if any(isinstance(r, BaseException) for r in results):
                self._drop_culprits(
                    Phase.TRANSFER,
                    members,
                    results,
                    policy_version=manifest.policy_version,
                    membership_epoch=epoch,
                    bucket_index=bucket.index,
                )
                return False
            self.progress.buckets_sent += 1
            self.progress.bytes_sent += bucket.size_bytes
            self.metrics.broadcast_bytes.inc(bucket.size_bytes)
        took = time.monotonic() - started
        self.metrics.phase_seconds.labels(Phase.TRANSFER.value).observe(took)
        if took > 0:
            self.metrics.bandwidth.set(manifest.total_bytes / took)
        log.info(
            "broadcast version",
            extra={**version.log_fields(), "members": len(members), "seconds": round(took, 3)},
        )
        return True

    async def _bucket_outcome(
        self,
        group: WeightGroup,
        send: Coroutine[Any, Any, None],
        calls: list[Coroutine[Any, Any, None]],
        members: list[Member],
    ) -> list[object]:
        """The outcomes of one bucket: the sidecar's send, then each member's call (None or the exception).

        When a member's call fails on its own (unreachable, refused, past its deadline: not collateral) before
        the bucket is sent, the collective cannot complete: the group is aborted, so the sidecar's send ends at
        once; the calls still waiting get ``ABORT_GRACE_S`` to answer, then are cancelled and count as
        collateral failures (those members are not blamed; the group's destroy ends their receive). Once the
        sidecar's send has succeeded every other receive has its bytes: their calls are waited for."""
        sending = asyncio.ensure_future(send)
        receiving = [asyncio.ensure_future(c) for c in calls]
        pending: set[asyncio.Future[None]] = {sending, *receiving}
        loop = asyncio.get_running_loop()
        until: float | None = None
        try:
            while pending:
                if until is None:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                else:
                    done, pending = await asyncio.wait(
                        pending, timeout=max(until - loop.time(), 0.0), return_when=asyncio.FIRST_COMPLETED
                    )
                    if not done:
                        break
                sent = sending.done() and sending.exception() is None
                if until is None and not sent:  # (once the bucket is sent, nobody waits for a gone member)
                    failed = [
                        m.member_id
                        for m, call in zip(members, receiving, strict=True)
                        if call.done() and _own_failure(call)
                    ]
                    if failed:
                        group.abort(f"member {', '.join(failed)} failed")
                        until = loop.time() + ABORT_GRACE_S
        except BaseException:  # (the loop cancelled: the member calls go with it)
            for call in receiving:
                call.cancel()
            raise
        left = [m for m, call in zip(members, receiving, strict=True) if call in pending]
        for waiting in pending:
            waiting.cancel()
        if left:
            log.info(
                "member calls left waiting in an aborted group; the group is rebuilt",
                extra={"members": [m.member_id for m in left], "group": group.name},
            )
        if not sending.done():  # (the abort ends it at once)
            await asyncio.wait([sending])
        results: list[object] = [sending.exception()]
        for m, call in zip(members, receiving, strict=True):
            if call in pending:
                results.append(
                    MemberCallFailed(
                        "UpdateWeightsFromDistributed",
                        m.address,
                        "CANCELLED",
                        f"left waiting: group {group.name!r} was aborted after another member failed",
                        collateral=True,
                    )
                )
            else:
                results.append(call.exception())
        return results

    async def _confirm(self, version: Version, members: list[Member]) -> bool:
        confirm_s = self.deadlines.confirm_s
        policy_version = version.manifest.policy_version
        self._set_phase(Phase.CONFIRM, confirm_s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        until = started + confirm_s
        while True:
            pending = [m for m in members if m.state is MemberState.ACTIVE and not m.has(version)]
            if not pending:
                break
            left = until - loop.time()
            if left <= 0:
                for m in pending:
                    self.membership.drop(
                        m,
                        PhaseError(
                            Phase.CONFIRM,
                            m.member_id,
                            f"no ConfirmVersion for version {policy_version}",
                            deadline_s=confirm_s,
                            timed_out=True,
                            policy_version=policy_version,
                            membership_epoch=self.membership.epoch,
                        ),
                    )
                return False
            changed = self.events.changed
            try:
                async with asyncio.timeout(left):  # (not wait_for: on 3.11 it can swallow a cancellation)
                    await changed.wait()
            except TimeoutError:
                pass
        self.metrics.phase_seconds.labels(Phase.CONFIRM.value).observe(loop.time() - started)
        if all(m.has(version) for m in members if m.state is MemberState.ACTIVE):
            self.confirmed_version = policy_version
            self.metrics.versions_broadcast.inc()
        self.events.notify()
        return True
