"""The reward service, as the producer's ``RewardPort``: Score retried while the service is down or full
(scoring is idempotent)."""

from __future__ import annotations

from collections.abc import Sequence

from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.config import ChannelConfig
from tauflow.rollout.adapters.convert import group_to_proto
from tauflow.rollout.adapters.retry import call_until_it_works
from tauflow.rollout.ports import ProducedGroup


class GrpcReward:
    def __init__(self, address: str, reward_fn: str, channel: ChannelConfig) -> None:
        self.channel = create_channel(address, [reward_pb2.DESCRIPTOR.services_by_name["RewardService"]], channel)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.reward_fn = reward_fn

    async def score(self, groups: Sequence[ProducedGroup]) -> None:
        request = reward_pb2.ScoreRequest(groups=[group_to_proto(g) for g in groups], reward_fn=self.reward_fn)
        resp = await call_until_it_works(lambda: self.stub.Score(request))
        for group, scored in zip(groups, resp.groups, strict=True):
            group.rewards = [s.reward for s in scored.samples]

    async def close(self) -> None:
        await self.channel.close()
