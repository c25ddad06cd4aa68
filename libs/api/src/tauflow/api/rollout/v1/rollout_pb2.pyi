import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from tauflow.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_STARTING: _ClassVar[EngineState]
    ENGINE_STATE_WAITING_FOR_WEIGHTS: _ClassVar[EngineState]
    ENGINE_STATE_SERVING: _ClassVar[EngineState]
    ENGINE_STATE_DRAINING: _ClassVar[EngineState]
    ENGINE_STATE_FAILED: _ClassVar[EngineState]
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_STARTING: EngineState
ENGINE_STATE_WAITING_FOR_WEIGHTS: EngineState
ENGINE_STATE_SERVING: EngineState
ENGINE_STATE_DRAINING: EngineState
ENGINE_STATE_FAILED: EngineState

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop", "ignore_eos", "seed")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    seed: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt_text", "sampling", "min_policy_version", "prompt_parts", "prompt_messages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PARTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    sampling: SamplingParams
    min_policy_version: int
    prompt_parts: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptPart]
    prompt_messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., prompt_parts: _Optional[_Iterable[_Union[_common_pb2.PromptPart, _Mapping]]] = ..., prompt_messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "samples", "engine_id", "queue_duration", "generation_duration")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DURATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DURATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    engine_id: str
    queue_duration: _duration_pb2.Duration
    generation_duration: _duration_pb2.Duration
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ..., engine_id: _Optional[str] = ..., queue_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., generation_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ScoredSequence(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("sequences", "temperature")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ScoredSequence]
    temperature: float
    def __init__(self, sequences: _Optional[_Iterable[_Union[ScoredSequence, _Mapping]]] = ..., temperature: _Optional[float] = ...) -> None: ...

class CompletionLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("sequences", "policy_version", "engine_id")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[CompletionLogprobs]
    policy_version: int
    engine_id: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[CompletionLogprobs, _Mapping]]] = ..., policy_version: _Optional[int] = ..., engine_id: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("server_id", "engines", "in_flight_requests", "in_flight_groups", "groups_produced", "membership_epoch", "weights_group_name", "groups_filtered")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PRODUCED_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    in_flight_requests: int
    in_flight_groups: int
    groups_produced: int
    membership_epoch: int
    weights_group_name: str
    groups_filtered: int
    def __init__(self, server_id: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., in_flight_requests: _Optional[int] = ..., in_flight_groups: _Optional[int] = ..., groups_produced: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., weights_group_name: _Optional[str] = ..., groups_filtered: _Optional[int] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "backend", "model", "state", "policy_version", "weight_update_in_progress", "receiving_policy_version", "num_ranks", "in_flight_requests", "running_sequences", "waiting_sequences", "last_error")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATE_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RECEIVING_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WAITING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    backend: str
    model: str
    state: EngineState
    policy_version: int
    weight_update_in_progress: bool
    receiving_policy_version: int
    num_ranks: int
    in_flight_requests: int
    running_sequences: int
    waiting_sequences: int
    last_error: str
    def __init__(self, engine_id: _Optional[str] = ..., backend: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[_Union[EngineState, str]] = ..., policy_version: _Optional[int] = ..., weight_update_in_progress: _Optional[bool] = ..., receiving_policy_version: _Optional[int] = ..., num_ranks: _Optional[int] = ..., in_flight_requests: _Optional[int] = ..., running_sequences: _Optional[int] = ..., waiting_sequences: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class InitWeightsUpdateGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "membership_epoch", "timeout")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    membership_epoch: int
    timeout: _duration_pb2.Duration
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ..., membership_epoch: _Optional[int] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class InitWeightsUpdateGroupResponse(_message.Message):
    __slots__ = ("num_ranks",)
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    num_ranks: int
    def __init__(self, num_ranks: _Optional[int] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsFromDistributedRequest(_message.Message):
    __slots__ = ("names", "dtypes", "shapes", "group_name", "flush_cache", "policy_version", "membership_epoch", "bucket_index", "bucket_count", "load_format", "manifest_checksum", "trace_context")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    FLUSH_CACHE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    group_name: str
    flush_cache: bool
    policy_version: int
    membership_epoch: int
    bucket_index: int
    bucket_count: int
    load_format: str
    manifest_checksum: str
    trace_context: _common_pb2.TraceContext
    def __init__(self, names: _Optional[_Iterable[str]] = ..., dtypes: _Optional[_Iterable[str]] = ..., shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., group_name: _Optional[str] = ..., flush_cache: _Optional[bool] = ..., policy_version: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., bucket_index: _Optional[int] = ..., bucket_count: _Optional[int] = ..., load_format: _Optional[str] = ..., manifest_checksum: _Optional[str] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class UpdateWeightsFromDistributedResponse(_message.Message):
    __slots__ = ("policy_version", "bucket_index", "version_complete")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERSION_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    bucket_index: int
    version_complete: bool
    def __init__(self, policy_version: _Optional[int] = ..., bucket_index: _Optional[int] = ..., version_complete: _Optional[bool] = ...) -> None: ...

class UpdateWeightsFromTensorRequest(_message.Message):
    __slots__ = ("names", "dtypes", "shapes", "staging_uri", "flush_cache", "policy_version", "membership_epoch", "manifest_checksum", "checksum_algorithm", "trace_context")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    STAGING_URI_FIELD_NUMBER: _ClassVar[int]
    FLUSH_CACHE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    staging_uri: str
    flush_cache: bool
    policy_version: int
    membership_epoch: int
    manifest_checksum: str
    checksum_algorithm: str
    trace_context: _common_pb2.TraceContext
    def __init__(self, names: _Optional[_Iterable[str]] = ..., dtypes: _Optional[_Iterable[str]] = ..., shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., staging_uri: _Optional[str] = ..., flush_cache: _Optional[bool] = ..., policy_version: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., manifest_checksum: _Optional[str] = ..., checksum_algorithm: _Optional[str] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class UpdateWeightsFromTensorResponse(_message.Message):
    __slots__ = ("policy_version", "loaded_bytes")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    loaded_bytes: int
    def __init__(self, policy_version: _Optional[int] = ..., loaded_bytes: _Optional[int] = ...) -> None: ...

class DestroyWeightsUpdateGroupRequest(_message.Message):
    __slots__ = ("group_name",)
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    def __init__(self, group_name: _Optional[str] = ...) -> None: ...

class DestroyWeightsUpdateGroupResponse(_message.Message):
    __slots__ = ("destroyed",)
    DESTROYED_FIELD_NUMBER: _ClassVar[int]
    destroyed: bool
    def __init__(self, destroyed: _Optional[bool] = ...) -> None: ...
