"""gRPC implementations of the producer's ports: the queue and the reward service."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_channel
from tauflow.core.protobuf import duration as _duration
from tauflow.rollout.convert import group_to_proto
from tauflow.rollout.producer import ProducedGroup, Ticket

log = logging.getLogger(__name__)
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)


def _transient(e: BaseException) -> bool:
    return isinstance(e, grpc.aio.AioRpcError) and e.code() in _TRANSIENT


def _until_it_works():  # type: ignore[no-untyped-def]
    """Retries an idempotent call while its service is down or full (e.g. restarting): data is never dropped."""
    return AsyncRetrying(retry=retry_if_exception(_transient), wait=wait_exponential(0.1, max=5.0), reraise=True)


class GrpcQueue:
    def __init__(self, address: str, producer_id: str, channel: ChannelConfig) -> None:
        self.channel = create_channel(address, [queue_pb2.DESCRIPTOR.services_by_name["QueueService"]], channel)
        self.stub = queue_pb2_grpc.QueueServiceStub(self.channel)
        self.producer_id = producer_id

    async def reserve(self, request_id: str, n_groups: int, wait_s: float) -> Ticket | None:
        request = queue_pb2.ReserveRequest(
            request_id=request_id, producer_id=self.producer_id, n_groups=n_groups, wait=_duration(wait_s)
        )
        async for attempt in _until_it_works():
            with attempt:
                resp = await self.stub.Reserve(request, timeout=wait_s + 30)
        if not resp.granted:
            return None
        return Ticket(resp.ticket.ticket_id, resp.ticket.n_groups, resp.ticket.min_policy_version)

    async def put(self, group: ProducedGroup, ticket_id: str) -> None:
        request = queue_pb2.PutRequest(group=group_to_proto(group), ticket_id=ticket_id)
        async for attempt in _until_it_works():
            with attempt:
                await self.stub.Put(request)

    async def release(self, ticket_id: str) -> None:
        try:
            await self.stub.ReleaseReservation(queue_pb2.ReleaseReservationRequest(ticket_id=ticket_id))
        except grpc.aio.AioRpcError as e:
            log.warning("could not release a ticket; it expires by itself", extra={"code": e.code().name})

    async def close(self) -> None:
        await self.channel.close()


class GrpcReward:
    def __init__(self, address: str, reward_fn: str, channel: ChannelConfig) -> None:
        self.channel = create_channel(address, [reward_pb2.DESCRIPTOR.services_by_name["RewardService"]], channel)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.reward_fn = reward_fn

    async def score(self, groups: Sequence[ProducedGroup]) -> None:
        request = reward_pb2.ScoreRequest(groups=[group_to_proto(g) for g in groups], reward_fn=self.reward_fn)
        async for attempt in _until_it_works():
            with attempt:
                resp = await self.stub.Score(request)
        for group, scored in zip(groups, resp.groups, strict=True):
            group.rewards = [s.reward for s in scored.samples]

    async def close(self) -> None:
        await self.channel.close()
