"""The rollout servers' side of the ``MemberClient`` port (ports.py): the sidecar drives each server's
weight-receiving RPCs."""

from __future__ import annotations

import time

import grpc

from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.weights.ports import MemberCallFailed
from tauflow.weightsync import BucketRequest, GroupSpec, SharedRequest
from tauflow.weightsync.wire import bucket_request_to_proto, group_spec_to_proto, shared_request_to_proto

ROLLOUT = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]


class RolloutMemberClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = create_channel(address, [ROLLOUT])
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    async def _call(self, method: str, request, timeout_s: float):
        started = time.monotonic()
        try:
            return await getattr(self.stub, method)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            # The member's own verdict that the collective failed (it waited for another rank),
            # as opposed to our deadline passing on a member that did not answer at all.
            answered_in_time = time.monotonic() - started < timeout_s * 0.98
            collateral = code == grpc.StatusCode.ABORTED or (
                code == grpc.StatusCode.DEADLINE_EXCEEDED and answered_in_time
            )
            raise MemberCallFailed(method, self.address, code.name, e.details() or "", collateral) from None

    async def init_group(self, spec: GroupSpec, timeout_s: float) -> None:
        await self._call(
            "InitWeightsUpdateGroup",
            group_spec_to_proto(spec),
            timeout_s,
        )

    async def update_bucket(self, request: BucketRequest, timeout_s: float) -> None:
        await self._call(
            "UpdateWeightsFromDistributed",
            bucket_request_to_proto(request),
            timeout_s,
        )

    async def destroy_group(self, group_name: str, timeout_s: float) -> None:
        await self._call(
            "DestroyWeightsUpdateGroup", rollout_pb2.DestroyWeightsUpdateGroupRequest(group_name=group_name), timeout_s
        )

    async def update_from_shared(self, request: SharedRequest, timeout_s: float) -> None:
        await self._call("UpdateWeightsFromTensor", shared_request_to_proto(request), timeout_s)

    async def probe(self, timeout_s: float) -> None:
        await self._call("GetStatus", rollout_pb2.GetStatusRequest(), timeout_s)

    async def close(self) -> None:
        await self.channel.close()
