import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class RewardStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REWARD_STATUS_UNSPECIFIED: _ClassVar[RewardStatus]
    REWARD_STATUS_OK: _ClassVar[RewardStatus]
    REWARD_STATUS_ERROR: _ClassVar[RewardStatus]
    REWARD_STATUS_TIMEOUT: _ClassVar[RewardStatus]

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
REWARD_STATUS_UNSPECIFIED: RewardStatus
REWARD_STATUS_OK: RewardStatus
REWARD_STATUS_ERROR: RewardStatus
REWARD_STATUS_TIMEOUT: RewardStatus
MODALITY_UNSPECIFIED: Modality
MODALITY_IMAGE: Modality
MODALITY_AUDIO: Modality
MODALITY_VIDEO: Modality

class TraceContext(_message.Message):
    __slots__ = ("traceparent", "tracestate")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    tracestate: str
    def __init__(self, traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class Reward(_message.Message):
    __slots__ = ("score", "components", "status", "message")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCORE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    score: float
    components: _containers.ScalarMap[str, float]
    status: RewardStatus
    message: str
    def __init__(self, score: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., status: _Optional[_Union[RewardStatus, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("sample_id", "prompt_token_ids", "completion_token_ids", "behaviour_logprobs", "token_versions", "loss_mask", "behaviour_version", "reward", "finish_reason", "completion_text", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TEXT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    behaviour_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    behaviour_version: int
    reward: Reward
    finish_reason: FinishReason
    completion_text: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, sample_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., behaviour_logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., behaviour_version: _Optional[int] = ..., reward: _Optional[_Union[Reward, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., completion_text: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "prompt_id", "samples", "trace_context", "producer_id", "created_at", "metadata", "baseline_reward", "prompt_parts")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BASELINE_REWARD_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PARTS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_id: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    trace_context: TraceContext
    producer_id: str
    created_at: _timestamp_pb2.Timestamp
    metadata: _containers.ScalarMap[str, str]
    baseline_reward: float
    prompt_parts: _containers.RepeatedCompositeFieldContainer[PromptPart]
    def __init__(self, group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., trace_context: _Optional[_Union[TraceContext, _Mapping]] = ..., producer_id: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., baseline_reward: _Optional[float] = ..., prompt_parts: _Optional[_Iterable[_Union[PromptPart, _Mapping]]] = ...) -> None: ...

class Media(_message.Message):
    __slots__ = ("modality", "media_type", "data", "uri", "sha256", "width", "height", "sample_rate", "num_samples", "num_frames", "fps", "grid_thw", "num_tokens")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    modality: Modality
    media_type: str
    data: bytes
    uri: str
    sha256: str
    width: int
    height: int
    sample_rate: int
    num_samples: int
    num_frames: int
    fps: float
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, modality: _Optional[_Union[Modality, str]] = ..., media_type: _Optional[str] = ..., data: _Optional[bytes] = ..., uri: _Optional[str] = ..., sha256: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., sample_rate: _Optional[int] = ..., num_samples: _Optional[int] = ..., num_frames: _Optional[int] = ..., fps: _Optional[float] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PromptPart(_message.Message):
    __slots__ = ("text", "media")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    text: str
    media: Media
    def __init__(self, text: _Optional[str] = ..., media: _Optional[_Union[Media, _Mapping]] = ...) -> None: ...
