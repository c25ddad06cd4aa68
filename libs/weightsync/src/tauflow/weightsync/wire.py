"""The manifest on the wire (tauflow.api.weights.v1.WeightManifest): shared by the trainer, which publishes,
and the sidecar, which receives. Protobuf only, never grpc."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tauflow.api.common.v1 import common_pb2
from tauflow.api.rollout.v1 import rollout_pb2
from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.core.protobuf import duration, timestamp
from tauflow.weightsync.manifest import BucketSpec, Manifest, TensorSpec

if TYPE_CHECKING:  # (imported where used: they bring torch)
    from tauflow.weightsync.group import GroupSpec
    from tauflow.weightsync.ipc import SharedRequest
    from tauflow.weightsync.transfer import BucketRequest


def manifest_from_proto(m: pb.WeightManifest) -> Manifest:
    return Manifest(
        policy_version=m.policy_version,
        buckets=tuple(
            BucketSpec(
                index=b.index,
                tensors=tuple(
                    TensorSpec(t.name, t.dtype, tuple(t.shape), t.offset_bytes, t.size_bytes) for t in b.tensors
                ),
                offset_bytes=b.offset_bytes,
                size_bytes=b.size_bytes,
            )
            for b in m.buckets
        ),
        total_bytes=m.total_bytes,
        checksum_algorithm=m.checksum_algorithm,
        checksum=m.checksum,
        model=m.model,
        created_at=m.created_at.ToNanoseconds() / 1e9 if m.HasField("created_at") else None,
    )


def manifest_to_proto(m: Manifest) -> pb.WeightManifest:
    out = pb.WeightManifest(
        policy_version=m.policy_version,
        buckets=[
            pb.Bucket(
                index=b.index,
                tensors=[
                    pb.TensorSpec(
                        name=t.name,
                        dtype=t.dtype,
                        shape=list(t.shape),
                        offset_bytes=t.offset_bytes,
                        size_bytes=t.size_bytes,
                    )
                    for t in b.tensors
                ],
                offset_bytes=b.offset_bytes,
                size_bytes=b.size_bytes,
            )
            for b in m.buckets
        ],
        total_bytes=m.total_bytes,
        checksum_algorithm=m.checksum_algorithm,
        checksum=m.checksum,
        model=m.model,
    )
    if m.created_at is not None:
        out.created_at.CopyFrom(timestamp(m.created_at))
    return out


# -- the rollout side of the control plane (tauflow.api.rollout.v1), shared by every receiver ---------


def group_spec_from_proto(
    request: rollout_pb2.InitWeightsUpdateGroupRequest, default_timeout_s: float = 60.0
) -> GroupSpec:
    """GroupSpec of an InitWeightsUpdateGroupRequest (SGLang's init_weights_update_group arguments)."""
    from tauflow.weightsync.group import GroupSpec

    timeout = request.timeout.ToNanoseconds() / 1e9 if request.HasField("timeout") else default_timeout_s
    return GroupSpec(
        request.master_address,
        request.master_port,
        request.group_name,
        request.world_size,
        request.rank_offset,
        request.backend or "gloo",
        request.membership_epoch,
        timeout,
    )


def bucket_request_from_proto(
    request: rollout_pb2.UpdateWeightsFromDistributedRequest, checksum_algorithm: str
) -> BucketRequest:
    """BucketRequest of an UpdateWeightsFromDistributedRequest (SGLang's names/dtypes/shapes and ours)."""
    from tauflow.weightsync.transfer import BucketRequest

    return BucketRequest(
        names=list(request.names),
        dtypes=list(request.dtypes),
        shapes=[list(s.dims) for s in request.shapes],
        group_name=request.group_name,
        policy_version=request.policy_version,
        membership_epoch=request.membership_epoch,
        bucket_index=request.bucket_index,
        bucket_count=request.bucket_count,
        load_format=request.load_format,
        manifest_checksum=request.manifest_checksum,
        checksum_algorithm=checksum_algorithm,
        flush_cache=request.flush_cache,
        traceparent=request.trace_context.traceparent,
        tracestate=request.trace_context.tracestate,
    )


def group_spec_to_proto(spec: GroupSpec) -> rollout_pb2.InitWeightsUpdateGroupRequest:
    """The InitWeightsUpdateGroupRequest that gives a member ``spec`` (the inverse of group_spec_from_proto)."""
    return rollout_pb2.InitWeightsUpdateGroupRequest(
        master_address=spec.master_address,
        master_port=spec.master_port,
        rank_offset=spec.rank,
        world_size=spec.world_size,
        group_name=spec.group_name,
        backend=spec.backend,
        membership_epoch=spec.membership_epoch,
        timeout=duration(spec.timeout_s),
    )


def bucket_request_to_proto(request: BucketRequest) -> rollout_pb2.UpdateWeightsFromDistributedRequest:
    """The UpdateWeightsFromDistributedRequest of ``request`` (the inverse of bucket_request_from_proto; the
    checksum algorithm travels in the manifest, not here)."""
    return rollout_pb2.UpdateWeightsFromDistributedRequest(
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
    )


def shared_request_from_proto(request: rollout_pb2.UpdateWeightsFromTensorRequest) -> SharedRequest:
    """SharedRequest of an UpdateWeightsFromTensorRequest (the colocated hand-off)."""
    from tauflow.weightsync.ipc import CHECKSUM, SharedRequest

    return SharedRequest(
        names=list(request.names),
        dtypes=list(request.dtypes),
        shapes=[list(s.dims) for s in request.shapes],
        staging_uri=request.staging_uri,
        policy_version=request.policy_version,
        manifest_checksum=request.manifest_checksum,
        membership_epoch=request.membership_epoch,
        checksum_algorithm=request.checksum_algorithm or CHECKSUM,
        flush_cache=request.flush_cache,
        traceparent=request.trace_context.traceparent,
        tracestate=request.trace_context.tracestate,
    )


def shared_request_to_proto(request: SharedRequest) -> rollout_pb2.UpdateWeightsFromTensorRequest:
    """The UpdateWeightsFromTensorRequest of ``request`` (the inverse of shared_request_from_proto)."""
    return rollout_pb2.UpdateWeightsFromTensorRequest(
        names=list(request.names),
        dtypes=list(request.dtypes),
        shapes=[rollout_pb2.TensorShape(dims=list(s)) for s in request.shapes],
        staging_uri=request.staging_uri,
        flush_cache=request.flush_cache,
        policy_version=request.policy_version,
        membership_epoch=request.membership_epoch,
        manifest_checksum=request.manifest_checksum,
        checksum_algorithm=request.checksum_algorithm,
        trace_context=common_pb2.TraceContext(traceparent=request.traceparent, tracestate=request.tracestate),
    )
