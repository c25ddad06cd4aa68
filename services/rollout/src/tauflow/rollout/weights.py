"""Receiving new weights from the weight sidecar: the control plane it drives on this server (SGLang's
init_weights_update_group / update_weights_from_distributed / destroy_weights_update_group).

A version arrives in buckets over the weight group; the receiver verifies it against the manifest's
checksum (whose algorithm the sidecar's manifest names), the engine swaps it in at its next safe point,
and the sidecar is told (confirm). Each version's load is one ``weights.load`` span, linked to the
trainer's ``weights.publish`` of it. Colocated with the trainer (the sidecar's ``ipc`` backend), a version
arrives whole instead, as a buffer the trainer shares on this machine (``load_shared``). No grpc here: the sidecar is reached through ``SidecarPort``.

Three threads of their own, so that one kind of call never waits in another's line: a group's build (its
rendezvous may take its whole timeout, a store nobody serves included) and destroy, a bucket's receive, and
a shared load. One group is built at a time: another build asked for meanwhile is refused
(``GroupBuildBusy``), one with the same arguments gets that build's outcome. A load that waited past its
caller's deadline is not made (``LoadExpired``): its caller has given up and will send the version again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from opentelemetry import trace

from tauflow.core.telemetry import set_error, span_context_of, traceparent_of
from tauflow.core.threads import started_executor
from tauflow.rollout.engine.base import GenerationEngine, WeightUpdateError, check_policy_version
from tauflow.rollout.ports import SidecarPort, UnknownVersion
from tauflow.weightsync import (
    ALIGN_BYTES,
    BucketRequest,
    ChecksumMismatch,
    GroupSpec,
    PhaseError,
    ReceivedVersion,
    ReceiveError,
    SharedReader,
    SharedRequest,
    WeightGroup,
    WeightReceiver,
)

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tauflow.rollout")
T = TypeVar("T")


class LoadExpired(Exception):
    """A weight load whose caller's deadline passed before it could start or be swapped in: nothing is loaded
    (the service answers DEADLINE_EXCEEDED; the caller, gone, sends the version again)."""


class GroupBuildBusy(Exception):
    """InitWeightsUpdateGroup while another group (other arguments) is being built here: one build at a time
    (the service answers RESOURCE_EXHAUSTED)."""


LOAD_ERRORS = (ReceiveError, PhaseError, ChecksumMismatch, WeightUpdateError, LoadExpired)  # what refuses a bucket
# Versions whose checksum algorithm is remembered: the sidecar sends one version at a time, the newest.
CHECKSUM_ALGORITHMS_KEPT = 8


@dataclasses.dataclass(frozen=True)
class _SpanKey:
    """What a ``weights.load`` span records of its request (a bucket's, or a shared load's)."""

    policy_version: int
    membership_epoch: int
    bucket_count: int
    traceparent: str
    tracestate: str


class WeightLoader:
    """The weight group of this server and the versions received over it, swapped into ``engine``.
    Without a sidecar (``None``: weights never change) buckets carry no checksum algorithm and nothing
    is confirmed."""

    def __init__(self, engine: GenerationEngine, member_id: str, sidecar: SidecarPort | None) -> None:
        self.engine = engine
        self.member_id = member_id
        self.sidecar = sidecar
        self.receiver = WeightReceiver(label=member_id)
        self.shared_reader = SharedReader(label=member_id)
        # One shared load at a time: the reader's buffer is reused, and the engine copies out of it while staging.
        self._shared_lock = asyncio.Lock()
        self._shared_bound: int | None = None
        # The receiver's calls are serialized by its lock and may block for a whole rendezvous: on threads of
        # their own they never take the default pool's threads, which Generate's waits need. A group's build
        # (a rendezvous that may last its whole timeout), a bucket's receive and a shared load (which takes no
        # receiver lock) each have one: a load never waits in line behind a build. Started now, not at the first
        # version: a thread that cannot start mid-run (memory short for a moment) would leave that load never made.
        self._receiver_thread = started_executor(1, "weights")
        self._group_thread = started_executor(1, "weights-group")
        self._shared_thread = started_executor(1, "weights-shared")
        self._building: tuple[GroupSpec, asyncio.Future[int]] | None = None  # the group build under way
        self._checksum_algorithms: dict[tuple[int, str], str] = {}  # (version, manifest checksum) -> name
        self._load_started: dict[tuple[int, int], int] = {}  # (version, epoch) -> first bucket's time, ns
        self._confirms: set[asyncio.Task[None]] = set()

    @property
    def group(self) -> WeightGroup | None:
        return self.receiver.group

    @property
    def receiving_version(self) -> int | None:
        return self.receiver.receiving_version

    def close(self) -> None:
        """Lets the three threads go (at the service's end); a call still on one runs to its end alone."""
        for thread in (self._receiver_thread, self._group_thread, self._shared_thread):
            thread.shutdown(wait=False, cancel_futures=True)

    def forget_group(self) -> None:
        """Drops the weight group (before a re-join); blocking: it waits for a receive in progress."""
        self.receiver.reset()

    async def init_group(self, spec: GroupSpec) -> int:
        """Joins the weight group ``spec`` names; the number of ranks this server holds in it. One build at a
        time, on its own thread: while one is under way, a call with the same arguments gets its outcome and
        one with others raises GroupBuildBusy. A caller that goes away leaves the build to finish alone."""
        held = self.receiver.group
        if held is not None and not held.destroyed and held.spec == spec:
            return 1  # (the receiver's answer, without waiting for the lock a build in progress holds)
        if self._building is not None:
            pending_spec, pending = self._building
            if pending_spec != spec:
                raise GroupBuildBusy(
                    f"weight group {pending_spec.group_name!r} is being built on this server (one build at a "
                    f"time, for at most its timeout of {pending_spec.timeout_s:g}s); call again once it ends"
                )
            return await asyncio.shield(pending)
        build = asyncio.get_running_loop().run_in_executor(self._group_thread, self.receiver.init_group, spec)
        self._building = (spec, build)
        build.add_done_callback(self._build_ended)
        return await asyncio.shield(build)  # (cancelling the caller does not stop the thread's build)

    def _build_ended(self, build: asyncio.Future[int]) -> None:
        spec = self._building[0] if self._building is not None and self._building[1] is build else None
        if spec is not None:
            self._building = None
        # (retrieved: a build whose callers all went away logs no "never retrieved"; said here, as the sidecar
        # sees only its call's outcome: the rollout's log said only "joining again" during a store attack)
        error = None if build.cancelled() else build.exception()
        if error is not None:
            log.warning(
                "weight group build failed",
                extra={"group": spec.group_name if spec else "", "error": f"{type(error).__name__}: {error}"[:300]},
            )

    async def destroy_group(self, group_name: str) -> bool:
        return await asyncio.get_running_loop().run_in_executor(
            self._group_thread, self.receiver.destroy_group, group_name
        )

    async def receive(self, bucket: BucketRequest, deadline: float | None = None) -> ReceivedVersion | None:
        """Receives one bucket; the version once its last bucket is in, verified and swapped in (then it
        is confirmed in the background), else None. Raises one of LOAD_ERRORS when refused (LoadExpired when
        ``deadline``, a ``time.monotonic()`` instant, the caller's, passed before the receive started or the
        version was swapped in), or SidecarUnavailable when the sidecar cannot name the version's checksum
        algorithm now."""
        # A version out of bounds, a request for no group held, another epoch, or out of order is refused
        # before the sidecar is asked or anything is recorded for it.
        check_policy_version(bucket.policy_version)
        self.receiver.check_bucket(bucket)
        key = (bucket.policy_version, bucket.membership_epoch)
        first = key not in self._load_started
        self._load_started.setdefault(key, time.time_ns())
        try:
            algorithm = await self._checksum_algorithm(bucket.policy_version, bucket.manifest_checksum)
            bucket = dataclasses.replace(bucket, checksum_algorithm=algorithm)
            version = await self._in_time(self._receiver_thread, deadline, self.receiver.receive_bucket, bucket)
            if version is not None:
                _check_deadline(deadline, "its version was received")
                # Swapped in at the engine's next safe point, between two decoding steps (a re-base drops
                # what was staged after it: see stage_broadcast).
                await asyncio.wrap_future(self.engine.stage_broadcast(version.policy_version, version.tensors))
        except LOAD_ERRORS as e:
            self._load_span(bucket, None, e)
            raise
        except BaseException:  # the sidecar unavailable, or the call cancelled: no load to record
            if first:
                self._load_started.pop(key, None)
            raise
        if version is not None:
            self._confirm_in_background(version, *self._load_span(bucket, version))
        return version

    async def load_shared(self, request: SharedRequest, deadline: float | None = None) -> ReceivedVersion:
        """Loads a version from the trainer's shared buffer (UpdateWeightsFromTensor): copied and checked, then
        swapped in at the engine's next safe point and confirmed in the background. Raises one of LOAD_ERRORS
        when refused (the version being served is kept): LoadExpired when ``deadline`` (``time.monotonic()``,
        the caller's) passed before the copy started or before the swap was asked for."""
        check_policy_version(request.policy_version)  # before anything is read or recorded
        span_key = _SpanKey(
            request.policy_version, request.membership_epoch, 1, request.traceparent, request.tracestate
        )
        started = time.time_ns()
        try:
            async with self._shared_lock:
                read = functools.partial(self.shared_reader.read, max_bytes=self._max_shared_bytes())
                version = await self._in_time(self._shared_thread, deadline, read, request)
                _check_deadline(deadline, "the buffer was copied")
                await asyncio.wrap_future(self.engine.stage_broadcast(version.policy_version, version.tensors))
        except LOAD_ERRORS as e:
            self._load_span(span_key, None, e, started_ns=started)
            raise
        self._confirm_in_background(version, *self._load_span(span_key, version, started_ns=started))
        return version

    def _max_shared_bytes(self) -> int:
        """The most bytes a shared version may name: every weight the engine takes, at 8 bytes an element (a
        version may come in a wider dtype than the engine's, which casts it), and each tensor's alignment."""
        if self._shared_bound is None:
            specs = self.engine.weight_spec().values()
            self._shared_bound = sum(8 * math.prod(s.shape) + ALIGN_BYTES for s in specs)
        return self._shared_bound

    async def _in_time(self, thread: ThreadPoolExecutor, deadline: float | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on ``thread``, unless ``deadline`` has passed by the time the thread gets to it (it
        waited in line): then LoadExpired, and nothing is done."""

        def run() -> T:
            _check_deadline(deadline, "it started (it waited for an earlier weight call)")
            return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(thread, run)

    async def _checksum_algorithm(self, version: int, checksum: str) -> str:
        if self.sidecar is None:
            return ""
        key = (version, checksum)
        algorithm = self._checksum_algorithms.get(key)
        if algorithm is None:
            try:
                algorithm = await self.sidecar.checksum_algorithm(version)
            except UnknownVersion as e:
                raise ReceiveError("precondition", str(e)) from None
            if len(self._checksum_algorithms) >= CHECKSUM_ALGORITHMS_KEPT:
                del self._checksum_algorithms[next(iter(self._checksum_algorithms))]  # the oldest
            self._checksum_algorithms[key] = algorithm
        return algorithm

    def _load_span(
        self,
        bucket: BucketRequest | _SpanKey,
        version: ReceivedVersion | None,
        error: BaseException | None = None,
        started_ns: int | None = None,
    ) -> tuple[str, str]:
        """Records ``weights.load`` (first bucket received, or ``started_ns`` -> version swapped in, or the
        failure) with a link to the trainer's ``weights.publish`` of the version; returns its trace context."""
        key = (bucket.policy_version, bucket.membership_epoch)
        started = self._load_started.pop(key, None) or started_ns or time.time_ns()
        for older in [k for k in self._load_started if k[0] <= key[0]]:  # older or failed versions' leftovers
            del self._load_started[older]
        publish = span_context_of(bucket.traceparent, bucket.tracestate)
        span = tracer.start_span(
            "weights.load",
            start_time=started,
            links=[trace.Link(publish)] if publish is not None else [],
            attributes={
                "rl.policy_version": bucket.policy_version,
                "weights.member_id": self.member_id,
                "weights.membership_epoch": bucket.membership_epoch,
                "weights.buckets": bucket.bucket_count,
            },
        )
        if version is not None:
            span.set_attribute("weights.bytes", version.nbytes)
        if error is not None:
            set_error(span, error)
        span.end()
        return traceparent_of(span)

    def _confirm_in_background(self, version: ReceivedVersion, traceparent: str, tracestate: str) -> None:
        # Off the reply's path: the sidecar is waiting for this bucket's reply, and a confirm is best effort.
        if self.sidecar is None:
            return
        task = asyncio.get_running_loop().create_task(
            self.sidecar.confirm(self.member_id, version, traceparent, tracestate)
        )
        self._confirms.add(task)
        task.add_done_callback(self._confirms.discard)


def _check_deadline(deadline: float | None, when: str) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise LoadExpired(f"the call's deadline passed before {when}; nothing was loaded")
