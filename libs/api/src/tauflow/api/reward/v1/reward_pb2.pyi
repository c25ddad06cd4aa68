import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from tauflow.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("groups", "reward_fn", "config", "sample_timeout")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FN_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.Group]
    reward_fn: str
    config: _struct_pb2.Struct
    sample_timeout: _duration_pb2.Duration
    def __init__(self, groups: _Optional[_Iterable[_Union[_common_pb2.Group, _Mapping]]] = ..., reward_fn: _Optional[str] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., sample_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("groups", "reward_fn")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FN_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupRewards]
    reward_fn: str
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupRewards, _Mapping]]] = ..., reward_fn: _Optional[str] = ...) -> None: ...

class GroupRewards(_message.Message):
    __slots__ = ("group_id", "samples")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    samples: _containers.RepeatedCompositeFieldContainer[SampleReward]
    def __init__(self, group_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[SampleReward, _Mapping]]] = ...) -> None: ...

class SampleReward(_message.Message):
    __slots__ = ("sample_id", "reward", "duration")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    reward: _common_pb2.Reward
    duration: _duration_pb2.Duration
    def __init__(self, sample_id: _Optional[str] = ..., reward: _Optional[_Union[_common_pb2.Reward, _Mapping]] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ListRewardFunctionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRewardFunctionsResponse(_message.Message):
    __slots__ = ("reward_functions", "default_reward_fn")
    REWARD_FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_REWARD_FN_FIELD_NUMBER: _ClassVar[int]
    reward_functions: _containers.RepeatedCompositeFieldContainer[RewardFunctionInfo]
    default_reward_fn: str
    def __init__(self, reward_functions: _Optional[_Iterable[_Union[RewardFunctionInfo, _Mapping]]] = ..., default_reward_fn: _Optional[str] = ...) -> None: ...

class RewardFunctionInfo(_message.Message):
    __slots__ = ("name", "description", "default_config", "timeout", "fallback_score", "group_level")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CONFIG_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_SCORE_FIELD_NUMBER: _ClassVar[int]
    GROUP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    default_config: _struct_pb2.Struct
    timeout: _duration_pb2.Duration
    fallback_score: float
    group_level: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., default_config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., fallback_score: _Optional[float] = ..., group_level: _Optional[bool] = ...) -> None: ...
