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
from tauflow.weights.membership import (
    MAX_ADDRESS_CHARS,
    MAX_BACKEND_CHARS,
    MAX_BACKENDS,
    MAX_MEMBER_ID_CHARS,
    MAX_REASON_CHARS,
)
from tauflow.weights.metrics import WeightsMetrics
from tauflow.weights.sidecar import Sidecar
from tauflow.weightsync.checksum import MAX_CHECKSUM_CHARS
from tauflow.weightsync.errors import ManifestError
from tauflow.weightsync.manifest import MAX_DIMS, check_header
from tauflow.weightsync.wire import manifest_from_proto, manifest_to_proto

T = TypeVar("T")

SERVICE = pb.DESCRIPTOR.services_by_name["WeightsService"]
MAX_TENSOR_NAME_CHARS = 1024  # a parameter's name (a Hugging Face name has tens of characters)
MAX_NAME_CHARS = 64  # a dtype's or a checksum algorithm's name
# A manifest's size. Each list is within the generic 100,000 elements, but 1000 buckets of 10,000 empty tensors
# each (19 MiB) held the sidecar 41 s (10 M dataclasses built before a trivial refusal). MoE models have the
# most tensors: DeepSeek-V3 ~92 k (~184 k with FP8 scales); a 1-TB model is ~16 k buckets of 64 MiB.
MAX_BUCKETS = 100_000
MAX_BUCKET_TENSORS = 100_000  # tensors of one bucket
# Tensors of all buckets together (checked before the manifest is converted); under the wire walk's 2^20 fields
# (tauflow.core.decoding.MAX_WALK_TAGS), which a manifest of a million tensors in thousands of buckets passes.
MAX_TENSORS = 500_000
# The bounds of request fields tighter than the generic ones (tauflow.core.decoding: 4096 characters, 100000
# elements), checked before any handler runs (INVALID_ARGUMENT naming the field; README "Bounds"). The fields
# not named keep the generic bounds: a model is a path, a staging_uri a path or an ipc:// URI, and a trace
# context W3C's (a tracestate may be long; only the retained versions keep one).
LIMITS = {
    "Publish": {
        "manifest.buckets": MAX_BUCKETS,
        "manifest.buckets.tensors": MAX_BUCKET_TENSORS,
        "manifest.buckets.tensors.name": MAX_TENSOR_NAME_CHARS,
        "manifest.buckets.tensors.dtype": MAX_NAME_CHARS,
        "manifest.buckets.tensors.shape": MAX_DIMS,
        "manifest.checksum_algorithm": MAX_NAME_CHARS,
        "manifest.checksum": MAX_CHECKSUM_CHARS,
    },
    "Join": {
        "member_id": MAX_MEMBER_ID_CHARS,
        "address": MAX_ADDRESS_CHARS,
        "backends": MAX_BACKENDS,
        "backends[]": MAX_BACKEND_CHARS,
    },
    "Leave": {"member_id": MAX_MEMBER_ID_CHARS, "reason": MAX_REASON_CHARS},
    "ConfirmVersion": {
        "member_id": MAX_MEMBER_ID_CHARS,
        "manifest_checksum": MAX_CHECKSUM_CHARS,
        "loaded_checksum": MAX_CHECKSUM_CHARS,
    },
}
_STATUS = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.HandoffDeadline: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def check_manifest_proto(manifest: pb.WeightManifest) -> None:
    """The cheap checks of a Published manifest, on its wire form: its tensor count (``MAX_TENSORS``) and the
    fields ``manifest.check_header`` checks. Converting the manifest builds one object per tensor, and a refusal
    must not cost that (10 M empty tensors: 30 s before "unknown checksum_algorithm ''")."""
    tensors = sum(len(b.tensors) for b in manifest.buckets)
    if tensors > MAX_TENSORS:
        raise errors.InvalidRequest(f"manifest.buckets hold {tensors} tensors in all, over the limit of {MAX_TENSORS}")
    try:
        check_header(len(manifest.buckets), manifest.checksum_algorithm, manifest.checksum)
    except ManifestError as e:
        raise errors.InvalidRequest(str(e)) from None


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
            check_manifest_proto(request.manifest)
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


# undecodable requests, and requests out of their bounds (LIMITS): INVALID_ARGUMENT naming the field
add_weights_servicer_to_server = servicer_adder(SERVICE, LIMITS)
