"""The trainer's side of the queue service (implements ports.QueuePort): lease batches, ack and renew
them, report versions.

Batches come on one long-lived Deliver stream (queue.v1 revision 4): each get_batch asks for one batch on
it, as a Get would. A queue older than revision 4 answers UNIMPLEMENTED: the client then uses Get."""

from __future__ import annotations

import asyncio
import logging

import grpc

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.config import ChannelConfig
from tauflow.core.protobuf import duration as _duration
from tauflow.core.streams import OrderedStream
from tauflow.trainer.adapters.convert import group_from_proto
from tauflow.trainer.adapters.retry import TRANSIENT, note_failure, until_it_works
from tauflow.trainer.ports import Batch

log = logging.getLogger(__name__)
# What the trainer waits out at the queue: a restart (TRANSIENT), and a full disk under its write-ahead log,
# which it answers RESOURCE_EXHAUSTED until space comes back (a trainer that exited on it crash-looped).
QUEUE_TRANSIENT = (*TRANSIENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


class GrpcQueue:
    def __init__(self, address: str, consumer_id: str, channel: ChannelConfig) -> None:
        self.channel = create_channel(address, [queue_pb2.DESCRIPTOR.services_by_name["QueueService"]], channel)
        self.stub = queue_pb2_grpc.QueueServiceStub(self.channel)
        self.consumer_id = consumer_id
        self.streaming = True  # until the queue says it has no Deliver
        self.deliver = OrderedStream(lambda lifetime_s: self.stub.Deliver(timeout=lifetime_s))

    async def set_version(self, version: int, rebase: bool = False) -> None:
        request = queue_pb2.SetTrainerVersionRequest(policy_version=version, rebase=rebase)
        async for attempt in until_it_works(QUEUE_TRANSIENT):
            with attempt:
                await self.stub.SetTrainerVersion(request)

    async def get_batch(self, n_groups: int, consumer_version: int, wait_s: float, lease_s: float) -> Batch | None:
        request = queue_pb2.GetRequest(
            consumer_id=self.consumer_id,
            max_groups=n_groups,
            min_groups=n_groups,
            consumer_version=consumer_version,
            lease_duration=_duration(lease_s),
            wait=_duration(wait_s),
        )
        try:
            resp = await self._get(request, timeout_s=wait_s + 30)
        except grpc.aio.AioRpcError as e:
            if e.code() in QUEUE_TRANSIENT and "larger than max" not in (e.details() or ""):
                # (a batch over this channel's message limit never fits: raised, naming the limit)
                log.warning("queue unavailable; retrying", extra={"code": e.code().name, "details": e.details()})
                note_failure(e.code().name, f"queue Get: {e.details() or ''}")
                await asyncio.sleep(0.5)
                return None  # Get is not retried by the channel: a lost lease expires and comes back
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "consumer_version" in (e.details() or ""):
                # the queue lost the trainer's version (a power cut under wal.fsync interval): told again
                log.warning(
                    "the queue's trainer version is behind; setting it again", extra={"version": consumer_version}
                )
                await self.set_version(consumer_version)
                return None
            raise
        if not resp.groups:
            return None
        # A group the queue took that the trainer cannot (a sample without its log-probs, an empty prompt) is
        # skipped, not raised: raised, it ended the trainer, and each restart was handed it again until the
        # run failed, and its --resume too (one external Put ended a run).
        groups, contexts, invalid = [], [], {}
        for delivered in resp.groups:
            try:
                groups.append(group_from_proto(delivered.group))
            except ValueError as e:
                invalid[delivered.group.group_id] = str(e)[:300]
                continue
            contexts.append(delivered.group.trace_context.traceparent)
        for group_id, why in invalid.items():
            log.warning("group skipped: the trainer cannot take it", extra={"group_id": group_id[:200], "why": why})
        return Batch(
            lease_id=resp.lease.lease_id,
            groups=groups,
            trace_contexts=contexts,
            max_staleness=resp.max_staleness if resp.HasField("max_staleness") else None,
            invalid=invalid,
        )

    async def _get(self, request: queue_pb2.GetRequest, timeout_s: float) -> queue_pb2.GetResponse:
        if self.streaming:
            try:
                answer = await self.deliver.request(queue_pb2.DeliverRequest(get=request), timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("the queue has no Deliver (older than queue.v1 revision 4): leasing with Get")
                self.streaming = False
            else:
                return answer.batch
        return await self.stub.Get(request, timeout=timeout_s)

    async def ack(self, lease_id: str) -> None:
        try:
            async for attempt in until_it_works(QUEUE_TRANSIENT):
                with attempt:
                    await self.stub.Ack(queue_pb2.AckRequest(lease_id=lease_id))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # The lease expired before our checkpoint: its groups were redelivered, and the trained
            # ids in the checkpoint make the trainer skip them.
            log.warning("lease expired before its ack", extra={"lease": lease_id})

    async def nack(self, lease_id: str) -> None:
        try:
            async for attempt in until_it_works(QUEUE_TRANSIENT):
                with attempt:
                    await self.stub.Nack(queue_pb2.NackRequest(lease_id=lease_id))
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                raise
            # Expired (or unknown to a queue that restarted) already: its groups are back either way.
            log.warning("lease expired before it was given back", extra={"lease": lease_id})

    async def renew(self, lease_id: str, lease_s: float) -> None:
        request = queue_pb2.RenewLeaseRequest(lease_id=lease_id, lease_duration=_duration(lease_s))
        try:
            async for attempt in until_it_works(QUEUE_TRANSIENT):
                with attempt:
                    await self.stub.RenewLease(request)
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                raise
            # Expired already: its groups were redelivered, and the trained ids in the next
            # checkpoint make the trainer skip them; the ack will say so too.
            log.warning("lease expired before its renewal", extra={"lease": lease_id})

    async def close(self) -> None:
        await self.deliver.close()
        await self.channel.close()
