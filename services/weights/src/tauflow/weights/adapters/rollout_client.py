"""The rollout servers' side of the ``MemberClient`` port (ports.py): the sidecar drives each server's
weight-receiving RPCs."""

from __future__ import annotations

import time

import grpc

from tauflow.api.common.v1 import common_pb2
from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.protobuf import duration
from tauflow.weights.ports import MemberCallFailed
from tauflow.weightsync import BucketRequest, GroupSpec

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
            rollout_pb2.InitWeightsUpdateGroupRequest(
                master_address=spec.master_address,
                master_port=spec.master_port,
                rank_offset=spec.rank,
                world_size=spec.world_size,
                group_name=spec.group_name,
                backend=spec.backend,
                membership_epoch=spec.membership_epoch,
                timeout=duration(spec.timeout_s),
            ),
            timeout_s,
        )

    async def update_bucket(self, request: BucketRequest, timeout_s: float) -> None:
        await self._call(
            "UpdateWeightsFromDistributed",
            rollout_pb2.UpdateWeightsFromDistributedRequest(
                names=list(request.names),
                dtypes=list(request.dtypes),
                shapes=[rollout_pb2.TensorShape(dims=list(s)) for s in request.shapes],
                group_name=request.group_name,
                flush_cache=request.flush_cache,
                policy_version=request.policy_version,
                membership_epoch=request.membership_epoch,
                bucket_index=request.bucket_index,
                bucket_count=request.bucket_count,
                load_format=request.load_format,
                manifest_checksum=request.manifest_checksum,
                trace_context=common_pb2.TraceContext(traceparent=request.traceparent, tracestate=request.tracestate),
            ),
            timeout_s,
        )

    async def destroy_group(self, group_name: str, timeout_s: float) -> None:
        await self._call(
            "DestroyWeightsUpdateGroup", rollout_pb2.DestroyWeightsUpdateGroupRequest(group_name=group_name), timeout_s
        )

    async def close(self) -> None:
        await self.channel.close()
