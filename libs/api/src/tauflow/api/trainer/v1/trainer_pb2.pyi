import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINER_STATE_UNSPECIFIED: _ClassVar[TrainerState]
    TRAINER_STATE_STARTING: _ClassVar[TrainerState]
    TRAINER_STATE_WAITING_FOR_DATA: _ClassVar[TrainerState]
    TRAINER_STATE_TRAINING: _ClassVar[TrainerState]
    TRAINER_STATE_CHECKPOINTING: _ClassVar[TrainerState]
    TRAINER_STATE_PAUSED: _ClassVar[TrainerState]
    TRAINER_STATE_STOPPING: _ClassVar[TrainerState]
    TRAINER_STATE_FAILED: _ClassVar[TrainerState]
    TRAINER_STATE_FINISHED: _ClassVar[TrainerState]
TRAINER_STATE_UNSPECIFIED: TrainerState
TRAINER_STATE_STARTING: TrainerState
TRAINER_STATE_WAITING_FOR_DATA: TrainerState
TRAINER_STATE_TRAINING: TrainerState
TRAINER_STATE_CHECKPOINTING: TrainerState
TRAINER_STATE_PAUSED: TrainerState
TRAINER_STATE_STOPPING: TrainerState
TRAINER_STATE_FAILED: TrainerState
TRAINER_STATE_FINISHED: TrainerState

class StepMetrics(_message.Message):
    __slots__ = ("step", "policy_version", "groups", "samples", "trained_tokens", "max_staleness", "mean_staleness", "mean_reward", "loss", "duration", "committed_at", "metrics", "groups_by_staleness")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class GroupsByStalenessEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_BY_STALENESS_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    groups: int
    samples: int
    trained_tokens: int
    max_staleness: int
    mean_staleness: float
    mean_reward: float
    loss: float
    duration: _duration_pb2.Duration
    committed_at: _timestamp_pb2.Timestamp
    metrics: _containers.ScalarMap[str, float]
    groups_by_staleness: _containers.ScalarMap[int, int]
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., groups: _Optional[int] = ..., samples: _Optional[int] = ..., trained_tokens: _Optional[int] = ..., max_staleness: _Optional[int] = ..., mean_staleness: _Optional[float] = ..., mean_reward: _Optional[float] = ..., loss: _Optional[float] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., committed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., groups_by_staleness: _Optional[_Mapping[int, int]] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("path", "policy_version", "created_at", "size_bytes", "trained_groups")
    PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    path: str
    policy_version: int
    created_at: _timestamp_pb2.Timestamp
    size_bytes: int
    trained_groups: int
    def __init__(self, path: _Optional[str] = ..., policy_version: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., size_bytes: _Optional[int] = ..., trained_groups: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("state", "policy_version", "published_policy_version", "last_step", "max_staleness", "last_checkpoint", "backend", "algorithm", "world_size", "last_error")
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    state: TrainerState
    policy_version: int
    published_policy_version: int
    last_step: StepMetrics
    max_staleness: int
    last_checkpoint: CheckpointInfo
    backend: str
    algorithm: str
    world_size: int
    last_error: str
    def __init__(self, state: _Optional[_Union[TrainerState, str]] = ..., policy_version: _Optional[int] = ..., published_policy_version: _Optional[int] = ..., last_step: _Optional[_Union[StepMetrics, _Mapping]] = ..., max_staleness: _Optional[int] = ..., last_checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., backend: _Optional[str] = ..., algorithm: _Optional[str] = ..., world_size: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class ListStepsRequest(_message.Message):
    __slots__ = ("from_step", "max_steps")
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    from_step: int
    max_steps: int
    def __init__(self, from_step: _Optional[int] = ..., max_steps: _Optional[int] = ...) -> None: ...

class ListStepsResponse(_message.Message):
    __slots__ = ("steps", "dropped_steps")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    dropped_steps: int
    def __init__(self, steps: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ..., dropped_steps: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: CheckpointInfo
    def __init__(self, checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class SetMaxStalenessRequest(_message.Message):
    __slots__ = ("max_staleness",)
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    max_staleness: int
    def __init__(self, max_staleness: _Optional[int] = ...) -> None: ...

class SetMaxStalenessResponse(_message.Message):
    __slots__ = ("previous_max_staleness", "max_staleness")
    PREVIOUS_MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    previous_max_staleness: int
    max_staleness: int
    def __init__(self, previous_max_staleness: _Optional[int] = ..., max_staleness: _Optional[int] = ...) -> None: ...
