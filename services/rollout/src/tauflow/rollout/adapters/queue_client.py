"""The queue, as the producer's ``QueuePort``: reserve and put retried while the queue is down or full
(both idempotent), release best effort.

The groups put together (a ticket's, put by one ``asyncio.gather``) go out as one PutBatch (queue.v1
revision 5), so that the burst pays one call's cost and one fsync; a group refused in the batch fails as
the same unary Put would (its status and reason), so the retry policy is the same. A queue older than
revision 5 answers UNIMPLEMENTED: the client then puts on one long-lived PutStream (revision 4) shared by
every concurrent put, and with unary calls where that is missing too."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core.batching import CallBatcher
from tauflow.core.channel import create_channel
from tauflow.core.config import ChannelConfig
from tauflow.core.protobuf import duration, length_delimited
from tauflow.core.status import error_info_trailer, error_reason
from tauflow.core.streams import OrderedStream, rpc_error
from tauflow.rollout.adapters.convert import group_to_proto
from tauflow.rollout.adapters.retry import call_until_it_works, over_message_limit, until_it_works
from tauflow.rollout.ports import GroupRejected, ProducedGroup, Ticket

log = logging.getLogger(__name__)
_TOO_LARGE = queue_pb2.ErrorReason.Name(queue_pb2.ERROR_REASON_GROUP_TOO_LARGE)
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_SERVICE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]
MAX_PUT_BATCH = 1024  # entries of one PutBatch (queue.proto)
_PUTS_FIELD = 1  # PutBatchRequest.puts
_BATCH_HEAD_BYTES = 4096  # room in the message limit for the batch's framing


def _refusal(answer: queue_pb2.PutStreamResponse) -> grpc.aio.AioRpcError:
    """A group refused on the stream, as the error the unary Put raises (its ErrorInfo reason included)."""
    code = _CODES.get(answer.code, grpc.StatusCode.UNKNOWN)
    trailer: tuple[tuple[str, bytes], ...] = ()
    if answer.reason:
        reason = queue_pb2.ErrorReason.Name(answer.reason)
        trailer = error_info_trailer(code, answer.message, reason, queue_pb2.DESCRIPTOR.package)
    return rpc_error(code, answer.message, trailer)


def _never_fits(e: grpc.aio.AioRpcError) -> bool:
    """A RESOURCE_EXHAUSTED that no retry can cure: the queue says the group is too large, or gRPC's own
    message-size limit refused it."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    reason = error_reason(e)
    return reason == _TOO_LARGE if reason else over_message_limit(e)


class GrpcQueue:
    def __init__(self, address: str, producer_id: str, channel: ChannelConfig) -> None:
        self.channel = create_channel(address, [_SERVICE], channel)
        self.stub = queue_pb2_grpc.QueueServiceStub(self.channel)
        self.producer_id = producer_id
        self.put_timeout_s = channel.default_timeout_s
        self.max_send_bytes = channel.max_message_bytes
        self.batching = True  # until the queue says it has no PutBatch
        self.streaming = True  # until the queue says it has no PutStream
        put_batch = self.channel.unary_unary(
            f"/{_SERVICE.full_name}/PutBatch",
            request_serializer=bytes,
            response_deserializer=queue_pb2.PutBatchResponse.FromString,
        )

        async def send_batch(puts: list[bytes]) -> Sequence[queue_pb2.PutStreamResponse]:
            # (a PutBatchRequest is its PutRequests, each field 1: the serialized puts spliced in as they are)
            batch = b"".join(part for put in puts for part in length_delimited(_PUTS_FIELD, put))
            return (await put_batch(batch, timeout=self.put_timeout_s)).results

        self.put_batch = CallBatcher(
            send_batch, max_items=MAX_PUT_BATCH, max_bytes=self.max_send_bytes - _BATCH_HEAD_BYTES
        )
        # Requests go out serialized by put(), which must know their size (see _put_once).
        put_stream = self.channel.stream_stream(
            f"/{_SERVICE.full_name}/PutStream",
            request_serializer=bytes,
            response_deserializer=queue_pb2.PutStreamResponse.FromString,
        )
        self.put_stream = OrderedStream(lambda lifetime_s: put_stream(timeout=lifetime_s))

    async def reserve(self, request_id: str, n_groups: int, wait_s: float) -> Ticket | None:
        request = queue_pb2.ReserveRequest(
            request_id=request_id, producer_id=self.producer_id, n_groups=n_groups, wait=duration(wait_s)
        )
        async for attempt in until_it_works(_never_fits):
            with attempt:
                resp = await self.stub.Reserve(request, timeout=wait_s + 30)
        if not resp.granted:
            return None
        return Ticket(resp.ticket.ticket_id, resp.ticket.n_groups, resp.ticket.min_policy_version)

    async def put(self, group: ProducedGroup, ticket_id: str) -> None:
        request = queue_pb2.PutStreamRequest(group=group_to_proto(group), ticket_id=ticket_id)
        raw = request.SerializeToString()
        try:
            await call_until_it_works(lambda: self._put_once(request, raw), _never_fits)
        except grpc.aio.AioRpcError as e:
            if _never_fits(e):
                raise GroupRejected("too_large", f"{len(raw)} bytes: {e.details()}") from None
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # Weights newer than the trainer's version: the trainer was resumed from an older
                # checkpoint, and this group comes from a line of weights it abandoned.
                raise GroupRejected("future_version", e.details() or "") from None
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # The queue refuses this group for good (a bound of a queue newer than this server, a reward
                # function's value it does not take): dropped, the reason logged; the producer goes on (raised,
                # it ended the rollout service, restart after restart, and the run).
                raise GroupRejected("invalid", e.details() or "") from None
            raise

    async def _put_once(self, request: queue_pb2.PutStreamRequest, raw: bytes) -> None:
        # The ways, best first: in a batch, on the stream, alone. A group over a way's byte bound takes the
        # next (a message over gRPC's limit would fail every group of its batch or stream); one whose batch
        # or stream the message limit ended all the same goes alone as a unary Put, which fails with the
        # right error for it only.
        ways = (
            ("batching", "PutBatch", 5, self.put_batch.max_bytes, lambda: self.put_batch.request(raw)),
            (
                "streaming",
                "PutStream",
                4,
                self.max_send_bytes,
                lambda: self.put_stream.request(raw, self.put_timeout_s),
            ),
        )
        for switch, method, revision, max_bytes, send in ways:
            if not getattr(self, switch) or len(raw) > max_bytes:
                continue
            try:
                answer = await send()
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info(f"the queue has no {method} (older than queue.v1 revision {revision}): the next way")
                    setattr(self, switch, False)
                    continue
                if not over_message_limit(e):
                    raise
                break
            if answer.code:
                raise _refusal(answer)
            return
        await self._put_unary(request)

    async def _put_unary(self, request: queue_pb2.PutStreamRequest) -> None:
        await self.stub.Put(queue_pb2.PutRequest(group=request.group, ticket_id=request.ticket_id))

    async def release(self, ticket_id: str, timeout_s: float | None = None) -> None:
        try:
            await self.stub.ReleaseReservation(
                queue_pb2.ReleaseReservationRequest(ticket_id=ticket_id), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            log.warning("could not release a ticket; it expires by itself", extra={"code": e.code().name})

    async def release_producer(self, timeout_s: float | None = None) -> int | None:
        request = queue_pb2.ReleaseProducerReservationsRequest(producer_id=self.producer_id)
        try:
            if timeout_s is not None:  # (at the stop: one try, under a short deadline)
                resp = await self.stub.ReleaseProducerReservations(request, timeout=timeout_s)
            else:
                async for attempt in until_it_works():
                    with attempt:
                        resp = await self.stub.ReleaseProducerReservations(request)
        except grpc.aio.AioRpcError as e:  # e.g. UNIMPLEMENTED: a queue older than revision 2
            log.warning("could not release this producer's tickets", extra={"code": e.code().name})
            return None
        return resp.released_tickets

    async def close(self) -> None:
        await self.put_batch.close()
        await self.put_stream.close()
        await self.channel.close()
