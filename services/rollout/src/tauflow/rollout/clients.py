"""gRPC implementations of the rollout's ports: the queue and the reward service (the producer's), and
the weight sidecar's membership calls."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.api.weights.v1 import weights_pb2, weights_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_channel
from tauflow.core.protobuf import duration as _duration
from tauflow.core.status import error_reason
from tauflow.rollout.convert import group_to_proto
from tauflow.rollout.membership import SidecarUnavailable
from tauflow.rollout.producer import GroupRejected, ProducedGroup, Ticket

log = logging.getLogger(__name__)
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
_TOO_LARGE = queue_pb2.ErrorReason.Name(queue_pb2.ERROR_REASON_GROUP_TOO_LARGE)


def _transient(e: BaseException) -> bool:
    return isinstance(e, grpc.aio.AioRpcError) and e.code() in _TRANSIENT and not _never_fits(e)


def _never_fits(e: grpc.aio.AioRpcError) -> bool:
    """A RESOURCE_EXHAUSTED that no retry can cure: the queue says the group is too large, or gRPC's own
    message-size limit refused it (on either side; that status carries no reason)."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    reason = error_reason(e)
    return reason == _TOO_LARGE if reason else "larger than max" in (e.details() or "")


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
        try:
            async for attempt in _until_it_works():
                with attempt:
                    await self.stub.Put(request)
        except grpc.aio.AioRpcError as e:
            if _never_fits(e):
                raise GroupRejected("too_large", f"{request.ByteSize()} bytes: {e.details()}") from None
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # Weights newer than the trainer's version: the trainer was resumed from an older
                # checkpoint, and this group comes from a line of weights it abandoned.
                raise GroupRejected("future_version", e.details() or "") from None
            raise

    async def release(self, ticket_id: str, timeout_s: float | None = None) -> None:
        try:
            await self.stub.ReleaseReservation(
                queue_pb2.ReleaseReservationRequest(ticket_id=ticket_id), timeout=timeout_s
            )
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


class GrpcSidecar:
    """The membership calls to the weight sidecar, each under ``timeout_s``; SidecarUnavailable when the
    sidecar is down, slow or full, so that the membership check simply comes again."""

    _MEMBER = (weights_pb2.MEMBER_STATE_JOINING, weights_pb2.MEMBER_STATE_ACTIVE)

    def __init__(
        self, stub: weights_pb2_grpc.WeightsServiceStub, model: str, num_ranks: int = 1, timeout_s: float = 5.0
    ) -> None:
        self.stub = stub
        self.model = model
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s

    async def is_member(self, member_id: str, address: str) -> bool:
        try:
            status = await self.stub.GetStatus(weights_pb2.GetStatusRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise (SidecarUnavailable(f"GetStatus: {e.code().name}: {e.details()}") if _transient(e) else e) from None
        return any(
            m.member_id == member_id and m.address == address and m.state in self._MEMBER for m in status.members
        )

    async def join(self, member_id: str, address: str, loaded_version: int) -> None:
        request = weights_pb2.JoinRequest(
            member_id=member_id,
            address=address,
            num_ranks=self.num_ranks,
            backends=["gloo", "nccl"],
            loaded_policy_version=loaded_version,
            model=self.model,
        )
        try:
            await self.stub.Join(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise (SidecarUnavailable(f"Join: {e.code().name}: {e.details()}") if _transient(e) else e) from None
