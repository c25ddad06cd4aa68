"""The thin gRPC layer of the sidecar: protobuf in, domain calls, protobuf out; domain errors → status codes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.api.weights.v1 import weights_pb2_grpc
from tauflow.core.decoding import servicer_adder
from tauflow.core.protobuf import duration, seconds
from tauflow.weights import errors
from tauflow.weights.adapters import convert
from tauflow.weights.metrics import WeightsMetrics
from tauflow.weights.sidecar import Sidecar
from tauflow.weightsync.wire import manifest_from_proto, manifest_to_proto

T = TypeVar("T")

SERVICE = pb.DESCRIPTOR.services_by_name["WeightsService"]
_STATUS = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.HandoffDeadline: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class WeightsServicer(weights_pb2_grpc.WeightsServiceServicer):
    def __init__(self, sidecar: Sidecar, metrics: WeightsMetrics) -> None:
        self.sidecar = sidecar
        self.metrics = metrics

    async def _call(self, context: grpc.aio.ServicerContext, method: str, fn: Callable[[], Awaitable[T]]) -> T:
        with self.metrics.rpc_duration.labels(method).time():
            try:
                return await fn()
            except errors.WeightsError as err:
                code = _STATUS[type(err)]
                self.metrics.rejected.labels(method, code.name).inc()
                await context.abort(code, f"{method}: {err}")
                raise AssertionError("unreachable") from err

    async def Publish(self, request, context):
        async def run() -> pb.PublishResponse:
            if not request.HasField("manifest"):
                raise errors.InvalidRequest("manifest must be set")
            out = await self.sidecar.retention.publish(
                manifest_from_proto(request.manifest),
                request.staging_uri,
                request.rebase,
                request.trace_context.traceparent,
                request.trace_context.tracestate,
            )
            resp = pb.PublishResponse(policy_version=out.policy_version, handoff_duration=duration(out.handoff_s))
            if out.superseded_policy_version is not None:
                resp.superseded_policy_version = out.superseded_policy_version
            return resp

        return await self._call(context, "Publish", run)

    async def GetManifest(self, request, context):
        async def run() -> pb.GetManifestResponse:
            version = request.policy_version if request.HasField("policy_version") else None
            return pb.GetManifestResponse(manifest=manifest_to_proto(self.sidecar.retention.manifest(version)))

        return await self._call(context, "GetManifest", run)

    async def Join(self, request, context):
        async def run() -> pb.JoinResponse:
            epoch = self.sidecar.membership.join(
                request.member_id,
                request.address,
                request.num_ranks,
                tuple(request.backends),
                request.loaded_policy_version if request.HasField("loaded_policy_version") else None,
                request.model,
            )
            resp = pb.JoinResponse(
                membership_epoch=epoch, phase_deadlines=convert.phase_deadlines(self.sidecar.phase_deadlines())
            )
            latest = self.sidecar.retention.latest_version
            if latest is not None:
                resp.latest_policy_version = latest
            return resp

        return await self._call(context, "Join", run)

    async def Leave(self, request, context):
        async def run() -> pb.LeaveResponse:
            return pb.LeaveResponse(membership_epoch=self.sidecar.membership.leave(request.member_id, request.reason))

        return await self._call(context, "Leave", run)

    async def ConfirmVersion(self, request, context):
        async def run() -> pb.ConfirmVersionResponse:
            latest = self.sidecar.membership.confirm(
                request.member_id,
                request.policy_version,
                request.manifest_checksum,
                request.loaded_checksum,
                seconds(request.load_duration) if request.HasField("load_duration") else None,
            )
            resp = pb.ConfirmVersionResponse()
            if latest is not None:
                resp.latest_policy_version = latest
            return resp

        return await self._call(context, "ConfirmVersion", run)

    async def GetStatus(self, request, context):
        async def run() -> pb.GetStatusResponse:
            return convert.status_to_proto(self.sidecar.status())

        return await self._call(context, "GetStatus", run)


add_weights_servicer_to_server = servicer_adder(SERVICE)  # undecodable requests: INVALID_ARGUMENT
