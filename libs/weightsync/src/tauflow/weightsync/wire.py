"""The manifest on the wire (tauflow.api.weights.v1.WeightManifest): shared by the trainer, which publishes,
and the sidecar, which receives. Protobuf only, never grpc."""

from __future__ import annotations

from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.core.protobuf import timestamp
from tauflow.weightsync.manifest import BucketSpec, Manifest, TensorSpec


def manifest_from_proto(m: pb.WeightManifest) -> Manifest:
    return Manifest(
        policy_version=m.policy_version,
        buckets=tuple(
            BucketSpec(
                index=b.index,
                tensors=tuple(TensorSpec(t.name, t.dtype, tuple(t.shape), t.offset_bytes, t.size_bytes)
                              for t in b.tensors),
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
                tensors=[pb.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape),
                                       offset_bytes=t.offset_bytes, size_bytes=t.size_bytes) for t in b.tensors],
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


