"""The controller's client of the reward service (RewardService): the scores of held-out answers."""

from __future__ import annotations

from collections.abc import Sequence

from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.controller.adapters import convert
from tauflow.controller.adapters.errors import peer_errors
from tauflow.controller.ports import ToScore
from tauflow.core.channel import create_channel

SERVICE = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]


class RewardClient:
    def __init__(self, address: str) -> None:
        self._channel = create_channel(address, [SERVICE])
        self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)

    async def score(self, groups: Sequence[ToScore], reward_fn: str, timeout_s: float) -> list[float]:
        request = reward_pb2.ScoreRequest(groups=[convert.group(g) for g in groups], reward_fn=reward_fn)
        with peer_errors("reward"):
            reply = await self._stub.Score(request, timeout=timeout_s)
        return [s.reward.score for g in reply.groups for s in g.samples]

    async def close(self) -> None:
        await self._channel.close()
