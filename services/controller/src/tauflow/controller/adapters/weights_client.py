"""The controller's client of the weight sidecar (WeightsService): the rollout servers it lists as members
(with launcher external, the replicas the controller did not start)."""

from __future__ import annotations

from tauflow.api.weights.v1 import weights_pb2, weights_pb2_grpc
from tauflow.controller.adapters.errors import peer_errors
from tauflow.controller.ports import SidecarMember
from tauflow.core.channel import create_channel

SERVICE = weights_pb2.DESCRIPTOR.services_by_name["WeightsService"]
LIVE = (weights_pb2.MEMBER_STATE_JOINING, weights_pb2.MEMBER_STATE_ACTIVE)  # not leaving, not dropped


class WeightsClient:
    def __init__(self, address: str) -> None:
        self._channel = create_channel(address, [SERVICE])
        self._stub = weights_pb2_grpc.WeightsServiceStub(self._channel)

    async def members(self) -> list[SidecarMember]:
        with peer_errors("weights"):
            reply = await self._stub.GetStatus(weights_pb2.GetStatusRequest())
        return [
            SidecarMember(
                m.member_id,
                m.address,
                m.confirmed_policy_version if m.HasField("confirmed_policy_version") else None,
            )
            for m in reply.members
            if m.state in LIVE
        ]

    async def close(self) -> None:
        await self._channel.close()
