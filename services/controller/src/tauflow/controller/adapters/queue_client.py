"""The controller's client of the queue (QueueService): its counters, and the staleness dial."""

from __future__ import annotations

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.controller.adapters import convert
from tauflow.controller.adapters.errors import POLL_TIMEOUT_S, peer_errors
from tauflow.controller.ports import QueueStats
from tauflow.core.channel import create_channel

SERVICE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]


class QueueClient:
    def __init__(self, address: str) -> None:
        self._channel = create_channel(address, [SERVICE])
        self._stub = queue_pb2_grpc.QueueServiceStub(self._channel)

    async def stats(self) -> QueueStats:
        with peer_errors("queue"):
            reply = await self._stub.Stats(queue_pb2.StatsRequest(), timeout=POLL_TIMEOUT_S)
        return convert.queue_stats(reply)

    async def set_max_staleness(self, tau: int) -> None:
        with peer_errors("queue"):  # idempotent by value: the channel retries it
            await self._stub.SetMaxStaleness(queue_pb2.SetMaxStalenessRequest(max_staleness=tau))

    async def close(self) -> None:
        await self._channel.close()
