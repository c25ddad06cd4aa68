import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("role", "build_version", "contracts", "started_at")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BUILD_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTRACTS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    role: str
    build_version: str
    contracts: _containers.RepeatedCompositeFieldContainer[Contract]
    started_at: _timestamp_pb2.Timestamp
    def __init__(self, role: _Optional[str] = ..., build_version: _Optional[str] = ..., contracts: _Optional[_Iterable[_Union[Contract, _Mapping]]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Contract(_message.Message):
    __slots__ = ("package", "revision", "services")
    PACKAGE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    package: str
    revision: int
    services: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, package: _Optional[str] = ..., revision: _Optional[int] = ..., services: _Optional[_Iterable[str]] = ...) -> None: ...
