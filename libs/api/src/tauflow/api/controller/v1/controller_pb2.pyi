import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_STARTING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_STOPPING: _ClassVar[RunState]
    RUN_STATE_COMPLETED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]

class ServiceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_KIND_UNSPECIFIED: _ClassVar[ServiceKind]
    SERVICE_KIND_QUEUE: _ClassVar[ServiceKind]
    SERVICE_KIND_ROLLOUT: _ClassVar[ServiceKind]
    SERVICE_KIND_REWARD: _ClassVar[ServiceKind]
    SERVICE_KIND_TRAINER: _ClassVar[ServiceKind]
    SERVICE_KIND_WEIGHTS: _ClassVar[ServiceKind]

class ServiceHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_HEALTH_UNSPECIFIED: _ClassVar[ServiceHealth]
    SERVICE_HEALTH_STARTING: _ClassVar[ServiceHealth]
    SERVICE_HEALTH_SERVING: _ClassVar[ServiceHealth]
    SERVICE_HEALTH_NOT_SERVING: _ClassVar[ServiceHealth]
    SERVICE_HEALTH_RESTARTING: _ClassVar[ServiceHealth]
    SERVICE_HEALTH_FAILED: _ClassVar[ServiceHealth]
    SERVICE_HEALTH_STOPPED: _ClassVar[ServiceHealth]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_STARTING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_STOPPING: RunState
RUN_STATE_COMPLETED: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_FAILED: RunState
SERVICE_KIND_UNSPECIFIED: ServiceKind
SERVICE_KIND_QUEUE: ServiceKind
SERVICE_KIND_ROLLOUT: ServiceKind
SERVICE_KIND_REWARD: ServiceKind
SERVICE_KIND_TRAINER: ServiceKind
SERVICE_KIND_WEIGHTS: ServiceKind
SERVICE_HEALTH_UNSPECIFIED: ServiceHealth
SERVICE_HEALTH_STARTING: ServiceHealth
SERVICE_HEALTH_SERVING: ServiceHealth
SERVICE_HEALTH_NOT_SERVING: ServiceHealth
SERVICE_HEALTH_RESTARTING: ServiceHealth
SERVICE_HEALTH_FAILED: ServiceHealth
SERVICE_HEALTH_STOPPED: ServiceHealth

class StalenessStats(_message.Message):
    __slots__ = ("max_observed", "mean_observed", "histogram", "evicted_groups", "violations")
    class HistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    MAX_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    MEAN_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    max_observed: int
    mean_observed: float
    histogram: _containers.ScalarMap[int, int]
    evicted_groups: int
    violations: int
    def __init__(self, max_observed: _Optional[int] = ..., mean_observed: _Optional[float] = ..., histogram: _Optional[_Mapping[int, int]] = ..., evicted_groups: _Optional[int] = ..., violations: _Optional[int] = ...) -> None: ...

class RunSummary(_message.Message):
    __slots__ = ("run_id", "name", "state", "launcher", "config", "started_at", "ended_at", "policy_version", "total_steps", "max_staleness", "staleness", "groups_generated", "groups_trained", "tokens_generated", "tokens_trained", "last_step_metrics", "last_checkpoint_path", "last_checkpoint_policy_version", "message")
    class LastStepMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_METRICS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    name: str
    state: RunState
    launcher: str
    config: _struct_pb2.Struct
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    policy_version: int
    total_steps: int
    max_staleness: int
    staleness: StalenessStats
    groups_generated: int
    groups_trained: int
    tokens_generated: int
    tokens_trained: int
    last_step_metrics: _containers.ScalarMap[str, float]
    last_checkpoint_path: str
    last_checkpoint_policy_version: int
    message: str
    def __init__(self, run_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., launcher: _Optional[str] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., policy_version: _Optional[int] = ..., total_steps: _Optional[int] = ..., max_staleness: _Optional[int] = ..., staleness: _Optional[_Union[StalenessStats, _Mapping]] = ..., groups_generated: _Optional[int] = ..., groups_trained: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., tokens_trained: _Optional[int] = ..., last_step_metrics: _Optional[_Mapping[str, float]] = ..., last_checkpoint_path: _Optional[str] = ..., last_checkpoint_policy_version: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: RunSummary
    def __init__(self, run: _Optional[_Union[RunSummary, _Mapping]] = ...) -> None: ...

class SetMaxStalenessRequest(_message.Message):
    __slots__ = ("max_staleness",)
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    max_staleness: int
    def __init__(self, max_staleness: _Optional[int] = ...) -> None: ...

class SetMaxStalenessResponse(_message.Message):
    __slots__ = ("previous_max_staleness", "max_staleness", "policy_version")
    PREVIOUS_MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    previous_max_staleness: int
    max_staleness: int
    policy_version: int
    def __init__(self, previous_max_staleness: _Optional[int] = ..., max_staleness: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("name", "kind", "address", "health", "restarts", "started_at", "last_checked_at", "last_error", "launcher_handle", "role", "replica", "build_version", "contract_revisions", "replicas")
    class ContractRevisionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    BUILD_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_REVISIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: ServiceKind
    address: str
    health: ServiceHealth
    restarts: int
    started_at: _timestamp_pb2.Timestamp
    last_checked_at: _timestamp_pb2.Timestamp
    last_error: str
    launcher_handle: str
    role: str
    replica: int
    build_version: str
    contract_revisions: _containers.ScalarMap[str, int]
    replicas: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[ServiceKind, str]] = ..., address: _Optional[str] = ..., health: _Optional[_Union[ServiceHealth, str]] = ..., restarts: _Optional[int] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_checked_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_error: _Optional[str] = ..., launcher_handle: _Optional[str] = ..., role: _Optional[str] = ..., replica: _Optional[int] = ..., build_version: _Optional[str] = ..., contract_revisions: _Optional[_Mapping[str, int]] = ..., replicas: _Optional[int] = ...) -> None: ...

class ListServicesRequest(_message.Message):
    __slots__ = ("kind",)
    KIND_FIELD_NUMBER: _ClassVar[int]
    kind: ServiceKind
    def __init__(self, kind: _Optional[_Union[ServiceKind, str]] = ...) -> None: ...

class ListServicesResponse(_message.Message):
    __slots__ = ("services",)
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    services: _containers.RepeatedCompositeFieldContainer[ServiceInfo]
    def __init__(self, services: _Optional[_Iterable[_Union[ServiceInfo, _Mapping]]] = ...) -> None: ...

class ScaleRolloutRequest(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    def __init__(self, replicas: _Optional[int] = ...) -> None: ...

class ScaleRolloutResponse(_message.Message):
    __slots__ = ("previous_replicas", "replicas")
    PREVIOUS_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    previous_replicas: int
    replicas: int
    def __init__(self, previous_replicas: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("reason", "immediate", "grace_period")
    REASON_FIELD_NUMBER: _ClassVar[int]
    IMMEDIATE_FIELD_NUMBER: _ClassVar[int]
    GRACE_PERIOD_FIELD_NUMBER: _ClassVar[int]
    reason: str
    immediate: bool
    grace_period: _duration_pb2.Duration
    def __init__(self, reason: _Optional[str] = ..., immediate: _Optional[bool] = ..., grace_period: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class StopRunResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    def __init__(self, state: _Optional[_Union[RunState, str]] = ...) -> None: ...
