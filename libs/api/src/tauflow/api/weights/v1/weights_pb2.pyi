import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tauflow.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BroadcastPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BROADCAST_PHASE_UNSPECIFIED: _ClassVar[BroadcastPhase]
    BROADCAST_PHASE_HANDOFF: _ClassVar[BroadcastPhase]
    BROADCAST_PHASE_GROUP_INIT: _ClassVar[BroadcastPhase]
    BROADCAST_PHASE_TRANSFER: _ClassVar[BroadcastPhase]
    BROADCAST_PHASE_CONFIRM: _ClassVar[BroadcastPhase]
    BROADCAST_PHASE_GROUP_DESTROY: _ClassVar[BroadcastPhase]

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_JOINING: _ClassVar[MemberState]
    MEMBER_STATE_ACTIVE: _ClassVar[MemberState]
    MEMBER_STATE_LEAVING: _ClassVar[MemberState]
    MEMBER_STATE_FAILED: _ClassVar[MemberState]
BROADCAST_PHASE_UNSPECIFIED: BroadcastPhase
BROADCAST_PHASE_HANDOFF: BroadcastPhase
BROADCAST_PHASE_GROUP_INIT: BroadcastPhase
BROADCAST_PHASE_TRANSFER: BroadcastPhase
BROADCAST_PHASE_CONFIRM: BroadcastPhase
BROADCAST_PHASE_GROUP_DESTROY: BroadcastPhase
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_JOINING: MemberState
MEMBER_STATE_ACTIVE: MemberState
MEMBER_STATE_LEAVING: MemberState
MEMBER_STATE_FAILED: MemberState

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset_bytes", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset_bytes: int
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("index", "tensors", "offset_bytes", "size_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    offset_bytes: int
    size_bytes: int
    def __init__(self, index: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("policy_version", "buckets", "total_bytes", "checksum_algorithm", "checksum", "model", "created_at")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    total_bytes: int
    checksum_algorithm: str
    checksum: str
    model: str
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, policy_version: _Optional[int] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., checksum_algorithm: _Optional[str] = ..., checksum: _Optional[str] = ..., model: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PhaseError(_message.Message):
    __slots__ = ("phase", "peer", "policy_version", "membership_epoch", "bucket_index", "deadline", "message", "occurred_at")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OCCURRED_AT_FIELD_NUMBER: _ClassVar[int]
    phase: BroadcastPhase
    peer: str
    policy_version: int
    membership_epoch: int
    bucket_index: int
    deadline: _duration_pb2.Duration
    message: str
    occurred_at: _timestamp_pb2.Timestamp
    def __init__(self, phase: _Optional[_Union[BroadcastPhase, str]] = ..., peer: _Optional[str] = ..., policy_version: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., bucket_index: _Optional[int] = ..., deadline: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., message: _Optional[str] = ..., occurred_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("manifest", "staging_uri", "rebase", "trace_context")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STAGING_URI_FIELD_NUMBER: _ClassVar[int]
    REBASE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    staging_uri: str
    rebase: bool
    trace_context: _common_pb2.TraceContext
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., staging_uri: _Optional[str] = ..., rebase: _Optional[bool] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("policy_version", "superseded_policy_version", "handoff_duration")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_DURATION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    superseded_policy_version: int
    handoff_duration: _duration_pb2.Duration
    def __init__(self, policy_version: _Optional[int] = ..., superseded_policy_version: _Optional[int] = ..., handoff_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("member_id", "address", "num_ranks", "backends", "loaded_policy_version", "model")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    LOADED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    address: str
    num_ranks: int
    backends: _containers.RepeatedScalarFieldContainer[str]
    loaded_policy_version: int
    model: str
    def __init__(self, member_id: _Optional[str] = ..., address: _Optional[str] = ..., num_ranks: _Optional[int] = ..., backends: _Optional[_Iterable[str]] = ..., loaded_policy_version: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("membership_epoch", "latest_policy_version", "phase_deadlines")
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_DEADLINES_FIELD_NUMBER: _ClassVar[int]
    membership_epoch: int
    latest_policy_version: int
    phase_deadlines: _containers.RepeatedCompositeFieldContainer[PhaseDeadline]
    def __init__(self, membership_epoch: _Optional[int] = ..., latest_policy_version: _Optional[int] = ..., phase_deadlines: _Optional[_Iterable[_Union[PhaseDeadline, _Mapping]]] = ...) -> None: ...

class PhaseDeadline(_message.Message):
    __slots__ = ("phase", "deadline")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    phase: BroadcastPhase
    deadline: _duration_pb2.Duration
    def __init__(self, phase: _Optional[_Union[BroadcastPhase, str]] = ..., deadline: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("member_id", "reason")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    reason: str
    def __init__(self, member_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("membership_epoch",)
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    membership_epoch: int
    def __init__(self, membership_epoch: _Optional[int] = ...) -> None: ...

class ConfirmVersionRequest(_message.Message):
    __slots__ = ("member_id", "policy_version", "manifest_checksum", "loaded_checksum", "membership_epoch", "load_duration", "trace_context")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LOADED_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOAD_DURATION_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    policy_version: int
    manifest_checksum: str
    loaded_checksum: str
    membership_epoch: int
    load_duration: _duration_pb2.Duration
    trace_context: _common_pb2.TraceContext
    def __init__(self, member_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., manifest_checksum: _Optional[str] = ..., loaded_checksum: _Optional[str] = ..., membership_epoch: _Optional[int] = ..., load_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class ConfirmVersionResponse(_message.Message):
    __slots__ = ("latest_policy_version",)
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_policy_version: int
    def __init__(self, latest_policy_version: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Member(_message.Message):
    __slots__ = ("member_id", "address", "num_ranks", "rank_offset", "state", "confirmed_policy_version", "joined_at", "last_error")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    address: str
    num_ranks: int
    rank_offset: int
    state: MemberState
    confirmed_policy_version: int
    joined_at: _timestamp_pb2.Timestamp
    last_error: PhaseError
    def __init__(self, member_id: _Optional[str] = ..., address: _Optional[str] = ..., num_ranks: _Optional[int] = ..., rank_offset: _Optional[int] = ..., state: _Optional[_Union[MemberState, str]] = ..., confirmed_policy_version: _Optional[int] = ..., joined_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_error: _Optional[_Union[PhaseError, _Mapping]] = ...) -> None: ...

class BroadcastProgress(_message.Message):
    __slots__ = ("policy_version", "membership_epoch", "phase", "buckets_sent", "bucket_count", "bytes_sent", "started_at", "phase_deadline")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_SENT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    PHASE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    membership_epoch: int
    phase: BroadcastPhase
    buckets_sent: int
    bucket_count: int
    bytes_sent: int
    started_at: _timestamp_pb2.Timestamp
    phase_deadline: _timestamp_pb2.Timestamp
    def __init__(self, policy_version: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., phase: _Optional[_Union[BroadcastPhase, str]] = ..., buckets_sent: _Optional[int] = ..., bucket_count: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., phase_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("latest_policy_version", "confirmed_policy_version", "broadcast", "membership_epoch", "members", "last_error", "backend", "phase_deadlines")
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PHASE_DEADLINES_FIELD_NUMBER: _ClassVar[int]
    latest_policy_version: int
    confirmed_policy_version: int
    broadcast: BroadcastProgress
    membership_epoch: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    last_error: PhaseError
    backend: str
    phase_deadlines: _containers.RepeatedCompositeFieldContainer[PhaseDeadline]
    def __init__(self, latest_policy_version: _Optional[int] = ..., confirmed_policy_version: _Optional[int] = ..., broadcast: _Optional[_Union[BroadcastProgress, _Mapping]] = ..., membership_epoch: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., last_error: _Optional[_Union[PhaseError, _Mapping]] = ..., backend: _Optional[str] = ..., phase_deadlines: _Optional[_Iterable[_Union[PhaseDeadline, _Mapping]]] = ...) -> None: ...
