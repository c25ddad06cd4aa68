"""The thin gRPC layer of the sidecar: protobuf in, domain calls, protobuf out; domain errors → status codes."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.api.weights.v1 import weights_pb2_grpc
from tauflow.core.decoding import servicer_adder
from tauflow.core.protobuf import duration, seconds
from tauflow.weights import convert, sidecar
from tauflow.weights.metrics import WeightsMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE = pb.DESCRIPTOR.services_by_name["WeightsService"]
_STATUS = {
    sidecar.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    sidecar.NotFound: grpc.StatusCode.NOT_FOUND,
    sidecar.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    sidecar.DataLoss: grpc.StatusCode.DATA_LOSS,
    sidecar.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    sidecar.HandoffDeadline: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class WeightsServicer(weights_pb2_grpc.WeightsServiceServicer):
    def __init__(self, car: sidecar.Sidecar, metrics: WeightsMetrics) -> None:
        self.car = car
        self.metrics = metrics

    async def _call(self, context: grpc.aio.ServicerContext, method: str, fn: Callable[[], Awaitable[T]]) -> T:
        with self.metrics.rpc_duration.labels(method).time():
            try:
                return await fn()
            except sidecar.WeightsError as err:
                code = _STATUS[type(err)]
                self.metrics.rejected.labels(method, code.name).inc()
                await context.abort(code, f"{method}: {err}")
                raise AssertionError("unreachable") from err

    async def Publish(self, request, context):  # type: ignore[no-untyped-def]
        async def run() -> pb.PublishResponse:
            if not request.HasField("manifest"):
                raise sidecar.InvalidRequest("manifest must be set")
            out = await self.car.publish(
                convert.manifest_from_proto(request.manifest), request.staging_uri, request.rebase,
                request.trace_context.traceparent, request.trace_context.tracestate,
            )
            resp = pb.PublishResponse(policy_version=out.policy_version, handoff_duration=duration(out.handoff_s))
            if out.superseded_policy_version is not None:
                resp.superseded_policy_version = out.superseded_policy_version
            return resp

        return await self._call(context, "Publish", run)

    async def GetManifest(self, request, context):  # type: ignore[no-untyped-def]
        async def run() -> pb.GetManifestResponse:
            version = request.policy_version if request.HasField("policy_version") else None
            return pb.GetManifestResponse(manifest=convert.manifest_to_proto(self.car.manifest(version)))

        return await self._call(context, "GetManifest", run)

    async def Join(self, request, context):  # type: ignore[no-untyped-def]
        async def run() -> pb.JoinResponse:
            epoch = self.car.join(
                request.member_id, request.address, request.num_ranks, tuple(request.backends),
                request.loaded_policy_version if request.HasField("loaded_policy_version") else None,
                request.model,
            )
            resp = pb.JoinResponse(membership_epoch=epoch, phase_deadlines=convert.phase_deadlines(self.car))
            if self.car.latest is not None:
                resp.latest_policy_version = self.car.latest.manifest.policy_version
            return resp

        return await self._call(context, "Join", run)

    async def Leave(self, request, context):  # type: ignore[no-untyped-def]
        async def run() -> pb.LeaveResponse:
            return pb.LeaveResponse(membership_epoch=self.car.leave(request.member_id, request.reason))

        return await self._call(context, "Leave", run)

    async def ConfirmVersion(self, request, context):  # type: ignore[no-untyped-def]
        async def run() -> pb.ConfirmVersionResponse:
            latest = self.car.confirm(
                request.member_id, request.policy_version, request.manifest_checksum, request.loaded_checksum,
                seconds(request.load_duration) if request.HasField("load_duration") else None,
            )
            resp = pb.ConfirmVersionResponse()
            if latest is not None:
                resp.latest_policy_version = latest
            return resp

        return await self._call(context, "ConfirmVersion", run)

    async def GetStatus(self, request, context):  # type: ignore[no-untyped-def]
        async def run() -> pb.GetStatusResponse:
            return convert.status_to_proto(self.car)

        return await self._call(context, "GetStatus", run)


add_weights_servicer_to_server = servicer_adder(SERVICE)  # undecodable requests: INVALID_ARGUMENT
