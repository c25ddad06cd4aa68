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

class EvictionReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVICTION_REASON_UNSPECIFIED: _ClassVar[EvictionReason]
    EVICTION_REASON_STALE: _ClassVar[EvictionReason]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_QUEUE_FULL: _ClassVar[ErrorReason]
    ERROR_REASON_GROUP_TOO_LARGE: _ClassVar[ErrorReason]

class PutOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_OUTCOME_UNSPECIFIED: _ClassVar[PutOutcome]
    PUT_OUTCOME_ACCEPTED: _ClassVar[PutOutcome]
    PUT_OUTCOME_DUPLICATE: _ClassVar[PutOutcome]
EVICTION_REASON_UNSPECIFIED: EvictionReason
EVICTION_REASON_STALE: EvictionReason
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_QUEUE_FULL: ErrorReason
ERROR_REASON_GROUP_TOO_LARGE: ErrorReason
PUT_OUTCOME_UNSPECIFIED: PutOutcome
PUT_OUTCOME_ACCEPTED: PutOutcome
PUT_OUTCOME_DUPLICATE: PutOutcome

class Ticket(_message.Message):
    __slots__ = ("ticket_id", "n_groups", "min_policy_version", "expires_at")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    N_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    n_groups: int
    min_policy_version: int
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, ticket_id: _Optional[str] = ..., n_groups: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "producer_id", "n_groups", "wait")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    N_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    producer_id: str
    n_groups: int
    wait: _duration_pb2.Duration
    def __init__(self, request_id: _Optional[str] = ..., producer_id: _Optional[str] = ..., n_groups: _Optional[int] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("granted", "ticket", "trainer_version")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    ticket: Ticket
    trainer_version: int
    def __init__(self, granted: _Optional[bool] = ..., ticket: _Optional[_Union[Ticket, _Mapping]] = ..., trainer_version: _Optional[int] = ...) -> None: ...

class ReleaseReservationRequest(_message.Message):
    __slots__ = ("ticket_id",)
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    def __init__(self, ticket_id: _Optional[str] = ...) -> None: ...

class ReleaseReservationResponse(_message.Message):
    __slots__ = ("released_groups",)
    RELEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    released_groups: int
    def __init__(self, released_groups: _Optional[int] = ...) -> None: ...

class ReleaseProducerReservationsRequest(_message.Message):
    __slots__ = ("producer_id",)
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    producer_id: str
    def __init__(self, producer_id: _Optional[str] = ...) -> None: ...

class ReleaseProducerReservationsResponse(_message.Message):
    __slots__ = ("released_tickets", "released_groups")
    RELEASED_TICKETS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    released_tickets: int
    released_groups: int
    def __init__(self, released_tickets: _Optional[int] = ..., released_groups: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("group", "ticket_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.Group
    ticket_id: str
    def __init__(self, group: _Optional[_Union[_common_pb2.Group, _Mapping]] = ..., ticket_id: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("outcome", "depth_groups")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DEPTH_GROUPS_FIELD_NUMBER: _ClassVar[int]
    outcome: PutOutcome
    depth_groups: int
    def __init__(self, outcome: _Optional[_Union[PutOutcome, str]] = ..., depth_groups: _Optional[int] = ...) -> None: ...

class PutStreamRequest(_message.Message):
    __slots__ = ("group", "ticket_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.Group
    ticket_id: str
    def __init__(self, group: _Optional[_Union[_common_pb2.Group, _Mapping]] = ..., ticket_id: _Optional[str] = ...) -> None: ...

class PutStreamResponse(_message.Message):
    __slots__ = ("outcome", "depth_groups", "code", "message", "reason")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DEPTH_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: PutOutcome
    depth_groups: int
    code: int
    message: str
    reason: ErrorReason
    def __init__(self, outcome: _Optional[_Union[PutOutcome, str]] = ..., depth_groups: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[_Union[ErrorReason, str]] = ...) -> None: ...

class PutBatchRequest(_message.Message):
    __slots__ = ("puts",)
    PUTS_FIELD_NUMBER: _ClassVar[int]
    puts: _containers.RepeatedCompositeFieldContainer[PutRequest]
    def __init__(self, puts: _Optional[_Iterable[_Union[PutRequest, _Mapping]]] = ...) -> None: ...

class PutBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutStreamResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[PutStreamResponse, _Mapping]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("consumer_id", "max_groups", "min_groups", "max_tokens", "lease_duration", "wait", "consumer_version")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MIN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_VERSION_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    max_groups: int
    min_groups: int
    max_tokens: int
    lease_duration: _duration_pb2.Duration
    wait: _duration_pb2.Duration
    consumer_version: int
    def __init__(self, consumer_id: _Optional[str] = ..., max_groups: _Optional[int] = ..., min_groups: _Optional[int] = ..., max_tokens: _Optional[int] = ..., lease_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., consumer_version: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "deadline")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    deadline: _timestamp_pb2.Timestamp
    def __init__(self, lease_id: _Optional[str] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class DeliveredGroup(_message.Message):
    __slots__ = ("group", "behaviour_version", "staleness", "redeliveries", "accepted_at")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    REDELIVERIES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_AT_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.Group
    behaviour_version: int
    staleness: int
    redeliveries: int
    accepted_at: _timestamp_pb2.Timestamp
    def __init__(self, group: _Optional[_Union[_common_pb2.Group, _Mapping]] = ..., behaviour_version: _Optional[int] = ..., staleness: _Optional[int] = ..., redeliveries: _Optional[int] = ..., accepted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("lease", "groups", "evicted_stale", "trainer_version", "max_staleness")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_STALE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    groups: _containers.RepeatedCompositeFieldContainer[DeliveredGroup]
    evicted_stale: int
    trainer_version: int
    max_staleness: int
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[DeliveredGroup, _Mapping]]] = ..., evicted_stale: _Optional[int] = ..., trainer_version: _Optional[int] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class DeliverRequest(_message.Message):
    __slots__ = ("get",)
    GET_FIELD_NUMBER: _ClassVar[int]
    get: GetRequest
    def __init__(self, get: _Optional[_Union[GetRequest, _Mapping]] = ...) -> None: ...

class DeliverResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: GetResponse
    def __init__(self, batch: _Optional[_Union[GetResponse, _Mapping]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("acked_groups",)
    ACKED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    acked_groups: int
    def __init__(self, acked_groups: _Optional[int] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class NackResponse(_message.Message):
    __slots__ = ("requeued_groups",)
    REQUEUED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    requeued_groups: int
    def __init__(self, requeued_groups: _Optional[int] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_duration")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_duration: _duration_pb2.Duration
    def __init__(self, lease_id: _Optional[str] = ..., lease_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class SetTrainerVersionRequest(_message.Message):
    __slots__ = ("policy_version", "rebase")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REBASE_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    rebase: bool
    def __init__(self, policy_version: _Optional[int] = ..., rebase: _Optional[bool] = ...) -> None: ...

class SetTrainerVersionResponse(_message.Message):
    __slots__ = ("trainer_version",)
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    trainer_version: int
    def __init__(self, trainer_version: _Optional[int] = ...) -> None: ...

class SetMaxStalenessRequest(_message.Message):
    __slots__ = ("max_staleness",)
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    max_staleness: int
    def __init__(self, max_staleness: _Optional[int] = ...) -> None: ...

class SetMaxStalenessResponse(_message.Message):
    __slots__ = ("max_staleness",)
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    max_staleness: int
    def __init__(self, max_staleness: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("trainer_version", "max_staleness", "groups_per_step", "depth_groups", "depth_bytes", "leased_groups", "reserved_groups", "accepted_groups", "acked_groups", "evicted_groups", "expired_leases", "capacity_groups", "capacity_bytes", "wal_bytes")
    class EvictedGroupsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    DEPTH_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACKED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    trainer_version: int
    max_staleness: int
    groups_per_step: int
    depth_groups: int
    depth_bytes: int
    leased_groups: int
    reserved_groups: int
    accepted_groups: int
    acked_groups: int
    evicted_groups: _containers.ScalarMap[str, int]
    expired_leases: int
    capacity_groups: int
    capacity_bytes: int
    wal_bytes: int
    def __init__(self, trainer_version: _Optional[int] = ..., max_staleness: _Optional[int] = ..., groups_per_step: _Optional[int] = ..., depth_groups: _Optional[int] = ..., depth_bytes: _Optional[int] = ..., leased_groups: _Optional[int] = ..., reserved_groups: _Optional[int] = ..., accepted_groups: _Optional[int] = ..., acked_groups: _Optional[int] = ..., evicted_groups: _Optional[_Mapping[str, int]] = ..., expired_leases: _Optional[int] = ..., capacity_groups: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., wal_bytes: _Optional[int] = ...) -> None: ...
