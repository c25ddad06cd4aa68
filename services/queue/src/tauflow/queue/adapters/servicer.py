"""The thin gRPC layer of the queue: protobuf in, domain calls, protobuf out.

Long polls (Reserve and Get with ``wait``) wait in line (one line for Gets, one
for Reserves), capped by ``max_wait_s`` and by the caller's deadline, so a poll
returns an empty answer rather than DEADLINE_EXCEEDED. A state change wakes only
the waiters it can serve: Get waiters while the groups waiting (less those
promised to waiters woken before) cover their ``min_groups``, Reserve waiters
while the pacing rule has room for them, in arrival order (so 200 waiting
consumers cost a Put one comparison each, not 200 rescans of the queue; with no
room left, waiting Reserves cost nothing). A woken waiter whose attempt still
gets nothing (its ``max_tokens`` cut the batch, say) gives back what it was
promised and passes the wake-up on: the change's pass over the line goes on
where it stopped (each waiter is looked at once per change), so what it could
not use is not lost to the others; it is itself woken again only after a later
change, so it does not spin.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory

from tauflow import media
from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core.decoding import Undecodable, check_bounds, checked_deserializer, refusing_undecodable
from tauflow.core.logs import LogLimit
from tauflow.core.protobuf import duration_seconds
from tauflow.core.status import error_info_trailer
from tauflow.queue.adapters import convert, wire
from tauflow.queue.config import QueueConfig
from tauflow.queue.metrics import QueueMetrics
from tauflow.queue.model import (
    MAX_ID_CHARS,
    ClientLimit,
    FailedPrecondition,
    GetResult,
    GroupOverCapacity,
    InvalidRequest,
    NotFound,
    QueueError,
    QueueFull,
    Ticket,
)
from tauflow.queue.state import QueueState
from tauflow.queue.wal import WalWriteError

log = logging.getLogger(__name__)
T = TypeVar("T")

_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}
_MARGIN_S = 0.05  # answer this long before the caller's deadline
_DOMAIN = queue_pb2.DESCRIPTOR.package


class _Wants(enum.Enum):
    GROUPS = "groups"  # a Get: waits for `need` groups to be waiting
    ROOM = "room"  # a Reserve: waits for room for `need` groups


@dataclass(eq=False)
class _Waiter:
    wants: _Wants
    need: int
    producer_id: str = ""  # (a Reserve's)
    external: bool = False  # a Reserve of the external port: room within the external clients' share only
    seq: int = 0  # arrival order
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    abandoned: bool = False  # its producer released all it holds: answer ungranted
    tried_at: int = -1  # the state's ``changes`` when its last attempt got nothing: not woken until it moves on
    promised: int = 0  # groups (or room) its wake-up promised it, until its next attempt


class _Line:
    """The waiters of one kind, in arrival order, and the current change's pass over them.

    A change (the state's ``changes``) starts a pass: waiters are woken in arrival order while the budget (the
    groups waiting, or the room) less what earlier wake-ups promised covers their need. A woken waiter that
    gets nothing gives its promise back (``settle``) and the same pass goes on where it stopped, first with
    the waiters it had passed over for lack of budget (smallest need first), so that a pass costs each waiter
    one look however many wake-ups are passed on (restarted from the head, 1,000 waiters that can never be
    served cost each Put 500,000 looks). A pass starts only when there is budget: with none, a change costs
    nothing however many wait."""

    def __init__(self) -> None:
        self.waiters: dict[_Waiter, None] = {}  # (a dict: ordered, and O(1) to leave)
        self.promised = 0
        self.promised_external = 0
        self._pass = -1  # the ``changes`` of the current pass
        self._order: list[_Waiter] | None = None  # the waiters when the pass began (None: not begun)
        self._next = 0
        self._passed_over: list[tuple[int, int, _Waiter]] = []  # heaps of (need, seq, waiter)
        self._passed_over_external: list[tuple[int, int, _Waiter]] = []

    def __len__(self) -> int:
        return len(self.waiters)

    def __iter__(self) -> Iterator[_Waiter]:
        return iter(list(self.waiters))

    def settle(self, waiter: _Waiter) -> None:
        """Gives back what ``waiter``'s wake-up promised it (it is about to try, or gone)."""
        self.promised -= waiter.promised
        if waiter.external:
            self.promised_external -= waiter.promised
        waiter.promised = 0

    def wake(self, changes: int, budget: int, external_budget: int = 0) -> None:
        """Wakes the waiters that ``budget`` (and, for external ones, ``external_budget`` too) can serve."""
        if changes != self._pass:
            self._pass, self._order, self._next = changes, None, 0
            self._passed_over.clear()
            self._passed_over_external.clear()
        budget -= self.promised
        external_budget -= self.promised_external
        if budget <= 0:
            return
        if self._order is None:  # the first wake-up with budget since the change
            self._order = list(self.waiters)
        for heap in (self._passed_over, self._passed_over_external):
            while heap and budget > 0:
                need, _, w = heap[0]
                if need > (min(budget, external_budget) if w.external else budget):
                    break
                heapq.heappop(heap)
                if self._may_wake(w, changes):
                    budget, external_budget = self._wake(w, budget, external_budget)
        order = self._order
        while budget > 0 and self._next < len(order):
            w = order[self._next]
            self._next += 1
            if not self._may_wake(w, changes):
                continue
            if w.need <= (min(budget, external_budget) if w.external else budget):
                budget, external_budget = self._wake(w, budget, external_budget)
            else:
                heapq.heappush(self._passed_over_external if w.external else self._passed_over, (w.need, w.seq, w))

    def _may_wake(self, w: _Waiter, changes: int) -> bool:
        return w in self.waiters and not w.woken.is_set() and w.tried_at != changes

    def _wake(self, w: _Waiter, budget: int, external_budget: int) -> tuple[int, int]:
        w.woken.set()
        w.promised = w.need
        self.promised += w.need
        if w.external:
            self.promised_external += w.need
            external_budget -= w.need
        return budget - w.need, external_budget


def _seconds(value: Any, name: str) -> float:
    try:
        return duration_seconds(value, name)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


_LOG_EVERY_S = 10.0  # a failure repeated in the background (a sweep on a full disk) is logged this often
COMPACT_RETRY_S = 30.0  # after a failed compaction, the next is not tried sooner
OFF_LOOP_CHECKS = 2  # large groups and media that Put checks at once, off the event loop
OFF_LOOP_BYTES = 1 << 20  # a group this large is decoded off the event loop (64 MiB: about 1 s of full decode)
_PUT_LIMITS = {"group": 2**31, "ticket_id": MAX_ID_CHARS}  # (the group's own bounds are the queue's: convert.py)
MAX_PUT_BATCH = 1024  # entries of one PutBatch (queue.proto)
_PUT_BATCH_LIMITS = {"puts": MAX_PUT_BATCH, "puts.group": 2**31, "puts.ticket_id": MAX_ID_CHARS}


class QueueServicer(queue_pb2_grpc.QueueServiceServicer):
    def __init__(self, queue: QueueState, config: QueueConfig, metrics: QueueMetrics) -> None:
        self.state = queue
        self.config = config
        self.metrics = metrics
        self._gets = _Line()
        self._reserves = _Line()
        self._arrivals = itertools.count()
        self._external_waiting: Counter[str] = Counter()  # an external client's Reserves in a long poll
        self.max_group_bytes = wire.group_limit(config.max_group_bytes, config.server.max_message_bytes)
        self.media_limits = media.MediaLimits.of(config.media.model_dump())
        self.off_loop_checks = asyncio.Semaphore(OFF_LOOP_CHECKS)
        self.draining = asyncio.Event()  # set when the service drains: the streams end
        self._compact_after = 0.0  # (time.monotonic) no compaction before: one failed
        self.compacting: asyncio.Task[None] | None = None  # the compaction under way
        self._readers: set[_Reading] = set()  # the PutStreams' readers
        metrics.watch(queue.stats)
        metrics.waiting_calls.labels("Get").set_function(lambda: len(self._gets))
        metrics.waiting_calls.labels("Reserve").set_function(lambda: len(self._reserves))

    # -- plumbing ----------------------------------------------------------------------

    @property
    def waiters(self) -> list[_Waiter]:
        """Every long poll waiting now (Gets, then Reserves)."""
        return [*self._gets, *self._reserves]

    def _notify(self) -> None:
        """After a state change, or a wake-up given back: wakes the waiters that it may serve."""
        changes = self.state.changes
        if self._gets.waiters:
            self._gets.wake(changes, self.state.depth_groups)
        if self._reserves.waiters:
            self._reserves.wake(changes, self.state.free_room(), self.state.external_room())

    def _classify(
        self, method: str, err: QueueError | convert.InvalidGroup | WalWriteError
    ) -> tuple[grpc.StatusCode, queue_pb2.ErrorReason | None, str]:
        """The status code, ErrorReason (or None) and message of a refusal; counted and, for the log's
        failures, logged."""
        reason: queue_pb2.ErrorReason | None = (
            None  # RESOURCE_EXHAUSTED says why, so that producers retry only what can succeed
        )
        if isinstance(err, (convert.GroupTooLarge, GroupOverCapacity)):
            code, reason = grpc.StatusCode.RESOURCE_EXHAUSTED, queue_pb2.ERROR_REASON_GROUP_TOO_LARGE
        elif isinstance(err, QueueFull):
            code, reason = grpc.StatusCode.RESOURCE_EXHAUSTED, queue_pb2.ERROR_REASON_QUEUE_FULL
        elif isinstance(err, ClientLimit):  # (no reason: the contract's two do not fit a client's own bound)
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
        elif isinstance(err, WalWriteError):
            # A full disk is worth retrying once space returns (the failed record was rolled back);
            # any other write error makes the queue unavailable until it is restarted.
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if err.disk_full else grpc.StatusCode.UNAVAILABLE
            if err.disk_full:
                reason = queue_pb2.ERROR_REASON_QUEUE_FULL
            log.error("the write-ahead log refused a write", extra={"method": method, "error": str(err)})
        elif isinstance(err, convert.InvalidGroup):
            code = grpc.StatusCode.INVALID_ARGUMENT
        else:
            code = _STATUS[type(err)]
        self.metrics.rejected.labels(method, code.name).inc()
        return code, reason, str(err)

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        err: QueueError | convert.InvalidGroup | WalWriteError,
    ) -> None:
        code, reason, message = self._classify(method, err)
        trailer = (
            () if reason is None else error_info_trailer(code, message, queue_pb2.ErrorReason.Name(reason), _DOMAIN)
        )
        await context.abort(code, message, trailing_metadata=trailer)

    async def _poll(
        self,
        context: grpc.aio.ServicerContext,
        wait_s: float,
        attempt: Callable[[], T | None],
        wants: _Wants,
        need: int,
        producer_id: str = "",
        external: bool = False,
    ) -> T | None:
        """Calls ``attempt`` until it returns a value or the wait runs out; between attempts the call
        waits in line until a change may serve it (``wants`` ``need`` groups or room)."""
        loop = asyncio.get_running_loop()
        wait_s = min(wait_s, self.config.max_wait_s)
        remaining = context.time_remaining()
        if remaining is not None:
            wait_s = min(wait_s, remaining - _MARGIN_S)
        until = loop.time() + wait_s
        line = self._gets if wants is _Wants.GROUPS else self._reserves
        waiter = _Waiter(wants, max(need, 1), producer_id, external, next(self._arrivals))
        try:
            while True:
                if waiter.abandoned:
                    # (before settling: what a wake-up promised it, the finally passes on to the next. Settled
                    # here and returned, it was lost: the pass that promised it had counted it spent, and the
                    # waiter behind waited on free room until its wait ended or another change came)
                    return None
                woken = waiter.promised > 0
                line.settle(waiter)
                before = self.state.changes
                try:
                    result = attempt()
                except BaseException:
                    if woken:  # (refused, e.g. an external client at its bound: what it was woken for is the next's)
                        self._notify()
                    raise
                if result is not None:
                    return result
                waiter.tried_at = self.state.changes
                if woken or waiter.tried_at != before:
                    # What it was woken for, or what its attempt changed (a lease it swept back), may serve
                    # those behind it.
                    self._notify()
                left = until - loop.time()
                if left <= 0 or self.draining.is_set():  # (a draining queue answers its long polls now)
                    return None
                deadline = self.state.next_deadline()  # wake for a lease or ticket expiry too
                if deadline is not None:
                    left = min(left, max(deadline - self.state.clock(), 0.0) + 0.01)
                waiter.woken.clear()
                line.waiters[waiter] = None  # (in line already: its place stays)
                try:
                    # (not asyncio.wait_for: on 3.11 it swallows a cancellation that comes after the wake-up, and
                    # the caller gone took what it was woken for, a ticket held until its TTL, a lease until it
                    # expired, instead of passing it on)
                    async with asyncio.timeout(left):
                        await waiter.woken.wait()
                except TimeoutError:
                    pass
        finally:
            line.waiters.pop(waiter, None)
            if waiter.promised:  # its caller gave up once woken: the wake-up goes to the next
                line.settle(waiter)
                self._notify()

    async def _call(self, context: grpc.aio.ServicerContext, method: str, fn: Callable[[], Awaitable[T]]) -> T:
        with self.metrics.rpc_duration.labels(method).time():
            try:
                return await fn()
            except (QueueError, convert.InvalidGroup, WalWriteError) as err:
                await self._refuse(context, method, err)
                raise AssertionError("unreachable") from err

    # -- RPCs --------------------------------------------------------------------------

    async def Reserve(
        self, request: queue_pb2.ReserveRequest, context: grpc.aio.ServicerContext, external: bool = False
    ) -> queue_pb2.ReserveResponse:
        """``external``: a client of the external port (its name in ``producer_id``), held to ``external.*``."""

        async def run() -> queue_pb2.ReserveResponse:
            def attempt() -> Ticket | None:
                ticket = self.state.reserve(request.request_id, request.producer_id, request.n_groups, external)
                if ticket is not None:
                    self._notify()
                return ticket

            wait_s = _seconds(request.wait, "wait")
            client, cap = request.producer_id, self.config.external.max_waiting_reserves
            over_cap = external and wait_s > 0 and self._external_waiting[client] >= cap
            if over_cap:  # answered at once: one client's long polls must not pile up (each costs every change)
                wait_s = 0.0
            counted = external and wait_s > 0
            if counted:
                self._external_waiting[client] += 1
            try:
                ticket = await self._poll(
                    context, wait_s, attempt, _Wants.ROOM, request.n_groups, request.producer_id, external
                )
            finally:
                if counted:
                    self._external_waiting[client] -= 1
                    if not self._external_waiting[client]:
                        del self._external_waiting[client]
            if ticket is None and over_cap:
                raise ClientLimit(
                    f"client {client!r} has {cap} Reserves waiting for room already (external.max_waiting_reserves)"
                    " and there is no room now: wait for their answers"
                )
            resp = queue_pb2.ReserveResponse(granted=ticket is not None, trainer_version=self.state.trainer_version)
            if ticket is not None:
                resp.ticket.CopyFrom(convert.ticket_to_proto(ticket))
            return resp

        return await self._call(context, "Reserve", run)

    async def ReleaseReservation(
        self,
        request: queue_pb2.ReleaseReservationRequest,
        context: grpc.aio.ServicerContext,
        owner: str | None = None,
    ) -> queue_pb2.ReleaseReservationResponse:
        async def run() -> queue_pb2.ReleaseReservationResponse:
            released = self.state.release_reservation(request.ticket_id, owner)
            self._notify()
            return queue_pb2.ReleaseReservationResponse(released_groups=released)

        return await self._call(context, "ReleaseReservation", run)

    async def ReleaseProducerReservations(
        self, request: queue_pb2.ReleaseProducerReservationsRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.ReleaseProducerReservationsResponse:
        async def run() -> queue_pb2.ReleaseProducerReservationsResponse:
            tickets, groups = self.state.release_producer(request.producer_id)
            # The producer's Reserves still waiting were given up on (its process stops, or was killed) but
            # may not be cancelled here yet: granted now, a ticket would hold room that no one fills.
            # What a wake-up promised such a waiter goes to the next in line now (the _notify below), not once
            # its task runs.
            for waiter in self._reserves:
                if waiter.producer_id == request.producer_id:
                    waiter.abandoned = True
                    waiter.woken.set()
                    self._reserves.settle(waiter)
            if tickets:
                log.info(
                    "released a producer's tickets",
                    extra={"producer_id": request.producer_id, "tickets": tickets, "groups": groups},
                )
            self._notify()
            return queue_pb2.ReleaseProducerReservationsResponse(released_tickets=tickets, released_groups=groups)

        return await self._call(context, "ReleaseProducerReservations", run)

    async def _put(self, request: wire.RawPutRequest, owner: str | None) -> tuple[bool, int]:
        """Validates and stores one group; returns (newly accepted, groups waiting). Put and PutStream."""
        if not request.group:
            raise convert.InvalidGroup("group must be set")
        if not OFF_LOOP_BYTES < len(request.group) <= self.max_group_bytes:  # (over the limit: refused undecoded)
            record = wire.group_record(request.group, self.max_group_bytes)
        else:  # a large group's decode must not hold the event loop (every other call waits on it)
            async with self.off_loop_checks:  # nor take every core: a few at once, the rest wait their turn
                record = await asyncio.to_thread(wire.group_record, request.group, self.max_group_bytes)
        weights = media.PartCounts()
        if record.media_parts:  # decoding images, sounds and videos: off the loop too
            async with self.off_loop_checks:
                weights = await asyncio.to_thread(wire.check_media, request.group, self.media_limits)
        if self.state.wal is not None and self.state.wal.broken is not None:
            # (a DUPLICATE answer would vouch for a group whose record may never reach the disk)
            raise WalWriteError(errno.EIO, self.state.wal.broken)
        accepted, depth = self.state.put(record, request.ticket_id, owner)
        if self.state.wal is not None:
            # (a duplicate too: its first copy's record may still await its fsync, and DUPLICATE vouches
            # for it as OK does)
            await self.state.wal.commit()
        if accepted:
            self.metrics.put_groups.inc()
            self.metrics.put_bytes.inc(record.size)
            for kind, n in weights.parts.items():
                if kind != "text":
                    self.metrics.put_media_parts.labels(kind).inc(n)
                    self.metrics.put_media_bytes.labels(kind).inc(weights.bytes[kind])
            self._notify()
        return accepted, depth

    async def Put(
        self, request: wire.RawPutRequest, context: grpc.aio.ServicerContext, owner: str | None = None
    ) -> queue_pb2.PutResponse:
        async def run() -> queue_pb2.PutResponse:
            accepted, depth = await self._put(request, owner)
            outcome = queue_pb2.PUT_OUTCOME_ACCEPTED if accepted else queue_pb2.PUT_OUTCOME_DUPLICATE
            return queue_pb2.PutResponse(outcome=outcome, depth_groups=depth)

        return await self._call(context, "Put", run)

    async def PutStream(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Put for many groups on one stream: up to ``stream_window`` groups are validated and appended
        ahead of their answers (so that they share an fsync, as concurrent Puts do); the answers go out
        in the order the groups came in, each once its group is durable or refused."""
        window = asyncio.Semaphore(self.config.stream_window)
        answers: asyncio.Queue[asyncio.Future[bytes] | None] = asyncio.Queue()  # bounded by `window`

        reading = _Reading()

        async def read() -> None:
            # (a drain cancels the read that waits for the client, not what was read: see drain())
            it = aiter(requests)
            try:
                while not self.draining.is_set():
                    reading.waiting = True
                    try:
                        request = await anext(it)
                    except StopAsyncIteration:
                        return
                    except asyncio.CancelledError:
                        if self.draining.is_set():
                            return
                        raise
                    finally:
                        reading.waiting = False
                    await window.acquire()
                    answers.put_nowait(asyncio.ensure_future(self._put_answer(request)))
            finally:
                answers.put_nowait(None)

        reader = reading.task = asyncio.create_task(read())
        self._readers.add(reading)
        reader.add_done_callback(lambda _: self._readers.discard(reading))
        try:
            while (answer := await answers.get()) is not None:
                yield await answer
                window.release()
            await reader  # (a failed read of the client's stream ends the call with its error)
        finally:
            reader.cancel()
            while not answers.empty():  # the call ended early: what was appended stays, unanswered
                pending = answers.get_nowait()
                if pending is not None:
                    pending.cancel()

    async def PutBatch(self, request: Any, context: grpc.aio.ServicerContext) -> queue_pb2.PutBatchResponse:
        """Put for several groups in one call: each entry answered as PutStream answers a group, in order.
        Each is validated and stored as Put stores it (an entry with media after its media are checked),
        and they share one fsync."""

        async def run() -> queue_pb2.PutBatchResponse:
            if not request.puts:
                raise convert.InvalidGroup("puts must have at least one entry")
            results = await asyncio.gather(*(self._put_result(put, "PutBatch") for put in request.puts))
            return queue_pb2.PutBatchResponse(results=results)

        return await self._call(context, "PutBatch", run)

    async def _put_answer(self, request: Any) -> bytes:
        """One group of PutStream, its answer serialized."""
        with self.metrics.rpc_duration.labels("PutStream").time():
            return (await self._put_result(request, "PutStream")).SerializeToString()

    async def _put_result(self, request: Any, method: str) -> queue_pb2.PutStreamResponse:
        """One group of PutStream or PutBatch: stored or refused, its answer (a refusal changes nothing)."""
        try:
            if isinstance(request, Undecodable):
                raise convert.InvalidGroup(f"request does not decode as {request.message}: {request.reason}")
            try:
                check_bounds(request, _PUT_LIMITS)
            except ValueError as e:
                raise convert.InvalidGroup(str(e)) from None
            accepted, depth = await self._put(request, None)
        except (QueueError, convert.InvalidGroup, WalWriteError) as err:
            code, reason, message = self._classify(method, err)
            return queue_pb2.PutStreamResponse(code=code.value[0], message=message, reason=reason)
        outcome = queue_pb2.PUT_OUTCOME_ACCEPTED if accepted else queue_pb2.PUT_OUTCOME_DUPLICATE
        return queue_pb2.PutStreamResponse(outcome=outcome, depth_groups=depth)

    async def _get(self, request: queue_pb2.GetRequest, context: grpc.aio.ServicerContext) -> list[bytes]:
        """Leases one batch (or none within the wait); the GetResponse serialized, in pieces. Get and Deliver."""
        consumer_version = request.consumer_version if request.HasField("consumer_version") else None
        lease_s = _seconds(request.lease_duration, "lease_duration")
        wait_s = _seconds(request.wait, "wait")
        evicted = 0

        def attempt() -> GetResult | None:
            nonlocal evicted
            result = self.state.get(
                request.consumer_id,
                request.max_groups,
                request.min_groups,
                request.max_tokens,
                lease_s,
                consumer_version,
                # the batch must fit the response message (the groups are spliced in as they are)
                max_bytes=self.config.server.max_message_bytes - wire.RESPONSE_HEAD_BYTES,
                overhead_bytes=wire.DELIVERY_OVERHEAD_BYTES,
            )
            evicted += result.evicted_stale
            if result.evicted_stale:
                self.metrics.evicted.labels("stale").inc(result.evicted_stale)
            if result.quarantined:
                self.metrics.evicted.labels("invalid").inc(result.quarantined)
            if result.evicted_stale or result.quarantined:
                self._notify()
            return result if result.lease is not None else None

        result = await self._poll(context, wait_s, attempt, _Wants.GROUPS, request.min_groups)
        if result is None:
            empty = queue_pb2.GetResponse(evicted_stale=evicted, trainer_version=self.state.trainer_version)
            return [empty.SerializeToString()]
        result.evicted_stale = evicted
        self.metrics.delivered_groups.inc(len(result.deliveries))
        for d in result.deliveries:
            self.metrics.delivered_staleness.observe(d.staleness)
        self._notify()
        return wire.get_response_parts(result, self.state.trainer_version)

    async def Get(self, request: queue_pb2.GetRequest, context: grpc.aio.ServicerContext) -> bytes:
        return b"".join(await self._call(context, "Get", lambda: self._get(request, context)))

    async def Deliver(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Get on one stream: each request is answered, in turn, by the batch it asks for."""
        async for request in _until(requests, self.draining):
            if isinstance(request, Undecodable):
                self.metrics.rejected.labels("Deliver", "INVALID_ARGUMENT").inc()
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"request does not decode as {request.message}: {request.reason}"
                )
            try:
                check_bounds(request)
            except ValueError as e:
                self.metrics.rejected.labels("Deliver", "INVALID_ARGUMENT").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            batch = await self._call(context, "Deliver", lambda: self._get(request.get, context))  # noqa: B023
            yield wire.delivery(batch)

    async def Ack(self, request: queue_pb2.AckRequest, context: grpc.aio.ServicerContext) -> queue_pb2.AckResponse:
        async def run() -> queue_pb2.AckResponse:
            n = self.state.ack(request.lease_id)
            if self.state.wal is not None:
                # Durable before the answer: docs/reliability.md says why. A repeat too (n == 0): the first
                # Ack's record may still await its fsync, and this OK vouches for it as that one's does.
                await self.state.wal.commit()
            if n:
                self.metrics.acked_groups.inc(n)
                self._notify()
                await self._maybe_compact()
            return queue_pb2.AckResponse(acked_groups=n)

        return await self._call(context, "Ack", run)

    async def Nack(self, request: queue_pb2.NackRequest, context: grpc.aio.ServicerContext) -> queue_pb2.NackResponse:
        async def run() -> queue_pb2.NackResponse:
            n = self.state.nack(request.lease_id)
            self._notify()
            return queue_pb2.NackResponse(requeued_groups=n)

        return await self._call(context, "Nack", run)

    async def RenewLease(
        self, request: queue_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.RenewLeaseResponse:
        async def run() -> queue_pb2.RenewLeaseResponse:
            lease = self.state.renew(request.lease_id, _seconds(request.lease_duration, "lease_duration"))
            return queue_pb2.RenewLeaseResponse(lease=convert.lease_to_proto(lease))

        return await self._call(context, "RenewLease", run)

    async def SetTrainerVersion(
        self, request: queue_pb2.SetTrainerVersionRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.SetTrainerVersionResponse:
        async def run() -> queue_pb2.SetTrainerVersionResponse:
            version = self.state.set_trainer_version(request.policy_version, request.rebase)
            if self.state.wal is not None:
                # Durable before the answer: a version lost at a power cut would make the queue refuse
                # the groups of the weights the trainer already published (from the future, to it).
                await self.state.wal.commit()
            self._notify()
            return queue_pb2.SetTrainerVersionResponse(trainer_version=version)

        return await self._call(context, "SetTrainerVersion", run)

    async def SetMaxStaleness(
        self, request: queue_pb2.SetMaxStalenessRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.SetMaxStalenessResponse:
        async def run() -> queue_pb2.SetMaxStalenessResponse:
            tau = self.state.set_max_staleness(request.max_staleness)
            log.info("max_staleness set", extra={"max_staleness": tau})
            self._notify()
            return queue_pb2.SetMaxStalenessResponse(max_staleness=tau)

        return await self._call(context, "SetMaxStaleness", run)

    async def Stats(
        self, request: queue_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.StatsResponse:
        async def run() -> queue_pb2.StatsResponse:
            return convert.stats_to_proto(self.state.stats())

        return await self._call(context, "Stats", run)

    def drain(self) -> None:
        """The service drains: each stream answers what it has read and ends (OK), so that its client goes
        on with a new stream (the restarted queue) at once rather than when the drain grace runs out."""
        self.draining.set()
        for w in self.waiters:  # long polls answer now, empty, and their streams end
            w.woken.set()
        for reading in self._readers:  # PutStreams stop waiting for their clients' next groups
            if reading.waiting and reading.task is not None:
                reading.task.cancel()

    # -- background ----------------------------------------------------------------------

    async def sweep_forever(self) -> None:
        """Redelivers expired leases and releases expired tickets between calls.

        A record the log refuses (a full disk) is logged, at most every ``_LOG_EVERY_S``, and tried again at
        the next interval: what it was for is left as it was. Only a broken log ends the service
        (``watch_log``); before, a lease expiring while the disk was full ended the process, and each restart
        again while the disk stayed full."""
        failures = LogLimit(_LOG_EVERY_S)
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            result = self.state.sweep()
            if result.error is not None and (failed_sweeps := failures.due()):
                log.error(
                    "expired leases or tickets could not be released (the log refused the record); trying "
                    "again every sweep",
                    extra={"error": str(result.error), "failed_sweeps": failed_sweeps},
                )
            if result.expired_leases or result.expired_tickets:
                self.metrics.lease_expired.inc(result.expired_leases)
                log.info(
                    "expired",
                    extra={
                        "leases": result.expired_leases,
                        "groups": result.expired_groups,
                        "tickets": result.expired_tickets,
                    },
                )
                self._notify()

    async def watch_log(self) -> None:
        """Ends the service once the log is broken (a failed rollback or fsync): what memory holds may
        then be ahead of the disk, and only a restart, recovering from the file, is sure of it. The
        launcher restarts the queue; callers see UNAVAILABLE meanwhile and retry."""
        wal = self.state.wal
        while wal is not None:
            await asyncio.sleep(self.config.sweep_interval_s)
            if wal.broken is not None:
                raise RuntimeError(
                    f"the write-ahead log is broken ({wal.broken}): stopping so that a restart recovers it"
                )

    async def _maybe_compact(self) -> None:
        """Starts a compaction when one is due; it runs beside the calls (the Ack that found it due answers
        at once), one at a time."""
        if time.monotonic() < self._compact_after or self.compacting is not None:
            return
        if self.state.compaction_due(self.config.wal.compact_min_bytes):
            self.compacting = asyncio.create_task(self._compact(), name="compaction")

    async def _compact(self) -> None:
        try:
            await self.state.compact_in_background()
        except Exception as e:  # noqa: BLE001 - WalWriteError (the old log is kept whole, with what came
            # meanwhile), or anything unforeseen: never an unobserved task error, and never a rewrite at every Ack
            # Not again at the next Ack: each try writes up to the whole log (on a full disk, every Ack).
            self._compact_after = time.monotonic() + COMPACT_RETRY_S
            log.error(
                "compaction failed; the log stays as it is",
                extra={"error": str(e), "retry_in_s": COMPACT_RETRY_S},
            )
        finally:
            self.compacting = None

    async def close(self) -> None:
        """After the drain: a compaction under way finishes (or fails, keeping the old log), then the log closes."""
        if self.compacting is not None:
            with contextlib.suppress(Exception):
                await self.compacting
        if self.state.wal is not None:
            self.state.wal.close()


class _Reading:
    """A PutStream's reader: its task, and whether it waits for the client's next message."""

    __slots__ = ("task", "waiting")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.waiting = False


async def _until(requests: AsyncIterator[Any], stop: asyncio.Event) -> AsyncIterator[Any]:
    """The messages of a stream until ``stop`` is set (then the stream is read no further)."""
    it = aiter(requests)
    stopped = asyncio.ensure_future(stop.wait())
    message: asyncio.Future[Any] | None = None
    try:
        while not stop.is_set():
            message = asyncio.ensure_future(anext(it))
            await asyncio.wait((message, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not message.done():
                return
            try:
                item = message.result()
            except StopAsyncIteration:
                return
            message = None
            yield item
    finally:
        stopped.cancel()
        if message is not None:  # a read left pending (or ended): its outcome is nobody's
            message.cancel()
            message.add_done_callback(_ignore_outcome)


def _ignore_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


SERVICE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]


def add_queue_servicer_to_server(
    servicer: Any, server: grpc.aio.Server, methods: Collection[str] | None = None
) -> None:
    """Registers the servicer like the generated function does, with the two wire fast paths:
    Put, PutStream and PutBatch receive groups as bytes, Get and Deliver return their responses already
    serialized (see wire.py).
    ``methods`` limits the registration to those methods (the others answer UNIMPLEMENTED)."""
    handlers = {}
    for method in SERVICE.methods:
        if methods is not None and method.name not in methods:
            continue
        request_class: Any = message_factory.GetMessageClass(method.input_type)
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        limits = None
        if method.name == "Put":
            request_class = wire.PutRequestView
            limits = _PUT_LIMITS
        if method.name in ("Get", "PutStream", "Deliver"):
            serialize = bytes
        if method.name == "PutStream":
            request_class = wire.PutRequestView  # (the same fields as PutRequest)
        if method.name == "PutBatch":
            request_class = wire.PutBatchRequestView
            limits = _PUT_BATCH_LIMITS
        if method.client_streaming:  # the method answers each undecodable message itself
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                getattr(servicer, method.name),
                request_deserializer=checked_deserializer(request_class),
                response_serializer=serialize,
            )
            continue
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            # A request that does not decode in full is INVALID_ARGUMENT, not UNKNOWN (tauflow.core.decoding).
            refusing_undecodable(getattr(servicer, method.name), limits),
            request_deserializer=checked_deserializer(request_class),
            response_serializer=serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
