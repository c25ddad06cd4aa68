"""The weight sidecar, as ``SidecarPort``: membership (GetStatus, Join, Leave) under a short deadline each,
SidecarUnavailable when the sidecar is down, slow or full (so that the membership check simply comes
again); the manifest's checksum algorithm, and the confirm of a loaded version (best effort)."""

from __future__ import annotations

import logging

import grpc

from tauflow.api.common.v1 import common_pb2
from tauflow.api.weights.v1 import weights_pb2, weights_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.config import ChannelConfig
from tauflow.rollout.adapters.retry import transient
from tauflow.rollout.ports import SidecarUnavailable, UnknownVersion
from tauflow.weightsync import ReceivedVersion

log = logging.getLogger(__name__)


class GrpcSidecar:
    _MEMBER = (weights_pb2.MEMBER_STATE_JOINING, weights_pb2.MEMBER_STATE_ACTIVE)

    def __init__(
        self, address: str, channel: ChannelConfig, model: str, num_ranks: int = 1, timeout_s: float = 5.0
    ) -> None:
        self.channel = create_channel(address, [weights_pb2.DESCRIPTOR.services_by_name["WeightsService"]], channel)
        self.stub = weights_pb2_grpc.WeightsServiceStub(self.channel)
        self.model = model
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s

    async def is_member(self, member_id: str, address: str) -> bool:
        try:
            status = await self.stub.GetStatus(weights_pb2.GetStatusRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise (SidecarUnavailable(f"GetStatus: {e.code().name}: {e.details()}") if transient(e) else e) from None
        return any(
            m.member_id == member_id and m.address == address and m.state in self._MEMBER for m in status.members
        )

    async def join(self, member_id: str, address: str, loaded_version: int) -> None:
        request = weights_pb2.JoinRequest(
            member_id=member_id,
            address=address,
            num_ranks=self.num_ranks,
            backends=["gloo", "nccl", "ipc"],
            loaded_policy_version=loaded_version,
            model=self.model,
        )
        try:
            await self.stub.Join(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise (SidecarUnavailable(f"Join: {e.code().name}: {e.details()}") if transient(e) else e) from None

    async def checksum_algorithm(self, policy_version: int) -> str:
        request = weights_pb2.GetManifestRequest(policy_version=policy_version)
        try:
            resp = await self.stub.GetManifest(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise UnknownVersion(f"the weight sidecar holds no manifest of version {policy_version}") from None
            raise SidecarUnavailable(f"GetManifest: {e.code().name}: {e.details()}") from None
        return resp.manifest.checksum_algorithm

    async def confirm(self, member_id: str, version: ReceivedVersion, traceparent: str, tracestate: str) -> None:
        request = weights_pb2.ConfirmVersionRequest(
            member_id=member_id,
            policy_version=version.policy_version,
            manifest_checksum=version.manifest_checksum,
            loaded_checksum=version.loaded_checksum,
            membership_epoch=version.membership_epoch,
            trace_context=common_pb2.TraceContext(traceparent=traceparent, tracestate=tracestate),
        )
        request.load_duration.FromNanoseconds(int(version.load_duration_s * 1e9))
        try:
            await self.stub.ConfirmVersion(request)
        except grpc.aio.AioRpcError as e:
            log.warning(
                "confirm failed",
                extra={"version": version.policy_version, "code": e.code().name, "details": (e.details() or "")[:200]},
            )

    async def leave(self, member_id: str, reason: str) -> None:
        """Best effort: the sidecar drops dead members by itself."""
        try:
            await self.stub.Leave(weights_pb2.LeaveRequest(member_id=member_id, reason=reason), timeout=self.timeout_s)
        except Exception:  # noqa: BLE001, S110 - whatever failed, the sidecar drops dead members by itself
            pass

    async def close(self) -> None:
        await self.channel.close()
