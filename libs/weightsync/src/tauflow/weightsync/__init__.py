"""tauflow weight transfer: shared by the weight sidecar (sender) and the rollout engines (receivers).

* ``manifest``: names, dtypes, shapes, bucket layout, version, checksum (``plan_buckets``, ``validate``).
* ``staging``: the trainer → sidecar hand-off through ``/dev/shm`` (``Stager``, ``read_staged`` inside staging roots).
* ``group``: process groups per membership epoch on a TCPStore (``StoreHost``, ``WeightGroup``).
* ``ipc``: the colocated hand-off (``DeviceStager`` on the trainer, ``SharedReader`` on the engine).
* ``transfer``: bucket broadcast (``send_bucket``) and the receiver (``WeightReceiver``).
* ``errors``: ``PhaseError`` names the phase and the peer of every failure.
* ``wire``: the protobuf messages of the above, for the services' adapters; the only module that
  touches the wire (not imported here, so that the rest stays wire-free).

No gRPC here: the services wrap these in their own RPCs.
"""

from tauflow.weightsync.checksum import ALGORITHMS, DEFAULT_ALGORITHM, new_hasher
from tauflow.weightsync.errors import (
    ChecksumMismatch,
    ManifestError,
    Phase,
    PhaseError,
    StagingError,
    StagingNotFound,
    WeightSyncError,
)
from tauflow.weightsync.group import BACKENDS, GroupSpec, StoreHost, WeightGroup, connect_store
from tauflow.weightsync.ipc import SharedReader, SharedRequest, shared_request
from tauflow.weightsync.manifest import (
    ALIGN_BYTES,
    DEFAULT_BUCKET_BYTES,
    MAX_DIMS,
    BucketSpec,
    Manifest,
    TensorSpec,
    canonical_layout,
    check_shape,
    dtype_from_name,
    dtype_name,
    plan_buckets,
    validate,
)
from tauflow.weightsync.staging import (
    Stager,
    confined_staging_path,
    default_staging_dir,
    read_staged,
    remove_stale_staging,
    staging_path,
)
from tauflow.weightsync.transfer import (
    LOAD_FORMAT_FLAT,
    LOAD_FORMAT_PER_TENSOR,
    LOAD_FORMATS,
    BucketRequest,
    ReceivedVersion,
    ReceiveError,
    WeightReceiver,
    bucket_requests,
    bucket_tensors,
    send_bucket,
)

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "ALIGN_BYTES",
    "BACKENDS",
    "DEFAULT_ALGORITHM",
    "DEFAULT_BUCKET_BYTES",
    "LOAD_FORMATS",
    "LOAD_FORMAT_FLAT",
    "LOAD_FORMAT_PER_TENSOR",
    "MAX_DIMS",
    "BucketRequest",
    "BucketSpec",
    "ChecksumMismatch",
    "GroupSpec",
    "Manifest",
    "ManifestError",
    "Phase",
    "PhaseError",
    "ReceiveError",
    "ReceivedVersion",
    "SharedReader",
    "SharedRequest",
    "Stager",
    "StagingError",
    "StagingNotFound",
    "StoreHost",
    "TensorSpec",
    "WeightGroup",
    "WeightReceiver",
    "WeightSyncError",
    "bucket_requests",
    "bucket_tensors",
    "canonical_layout",
    "check_shape",
    "confined_staging_path",
    "connect_store",
    "default_staging_dir",
    "dtype_from_name",
    "dtype_name",
    "new_hasher",
    "plan_buckets",
    "read_staged",
    "remove_stale_staging",
    "send_bucket",
    "shared_request",
    "staging_path",
    "validate",
]
