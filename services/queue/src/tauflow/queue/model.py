"""The queue's domain objects (a stored group, a ticket, a lease, what Get and Stats answer) and the
refusals the servicer maps to gRPC statuses. No grpc here."""

from __future__ import annotations

from dataclasses import dataclass

MAX_VERSION = 2**53  # policy versions and tau: exact in a double (metrics) and in any JSON reader of the log
MAX_ID_CHARS = 256  # every id a request carries (the contract's bound)


class QueueError(Exception):
    """A request the queue refuses; the servicer maps the subclass to a gRPC status."""


class InvalidRequest(QueueError):
    pass


class NotFound(QueueError):
    pass


class FailedPrecondition(QueueError):
    pass


class QueueFull(QueueError):
    """No room now; the same request can succeed once groups are taken out."""


class GroupOverCapacity(QueueFull):
    """A group larger than the queue's whole byte capacity: no amount of waiting makes room."""


class ClientLimit(QueueError):
    """An external client at one of its own bounds (``external.*``): RESOURCE_EXHAUSTED, no ErrorReason. The
    same request can succeed once that client has put or released what it holds, not by waiting for others."""


def check_id(value: str, field: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequest(f"{field} is {len(value)} characters, longer than {MAX_ID_CHARS}")


@dataclass
class GroupRecord:
    group_id: str
    payload: bytes  # the serialized tauflow.api.common.v1.Group
    behaviour_version: int
    n_tokens: int
    accepted_at: float = 0.0
    deliveries: int = 0
    # The consumer version of its last delivery since the pacing count was last re-based (None: none). Once the
    # trainer's version is past it, the step it was delivered for has committed and used up its pacing room:
    # evicted after that (its lease expired or was nacked before the ack), it gives no room back.
    delivered_for: int | None = None
    wal_bytes: int = 0
    newest_version: int = 0  # newest policy version of any token (Put refuses one from the future)
    checked: bool = False  # validated by this build (groups recovered from a log are checked at Get)
    media_parts: int = 0  # media parts of its prompt, decoded by Put off the event loop (not logged)

    @property
    def size(self) -> int:
        return len(self.payload)


@dataclass
class Ticket:
    ticket_id: str
    request_id: str
    producer_id: str
    n_groups: int
    min_policy_version: int
    expires_at: float
    remaining: int = 0
    external: bool = False  # reserved through the external port (counts against ``external.*``)


@dataclass
class Lease:
    lease_id: str
    group_ids: list[str]
    deadline: float
    consumer_id: str
    consumer_version: int
    duration_s: float = 0.0  # its last Get's or RenewLease's lease_s: what recovery grants it anew


@dataclass(frozen=True)
class Delivery:
    group: GroupRecord
    staleness: int
    redeliveries: int


@dataclass
class GetResult:
    lease: Lease | None
    deliveries: list[Delivery]
    evicted_stale: int
    quarantined: int = 0  # stored groups that no consumer could decode, set aside (``Quarantine``)
    max_staleness: int | None = None  # the tau the batch was delivered under (None: nothing delivered)


@dataclass
class SweepResult:
    expired_leases: int = 0
    expired_groups: int = 0
    expired_tickets: int = 0
    error: Exception | None = None  # the log refused a record (a WalWriteError): the sweep stopped there


@dataclass
class Stats:
    trainer_version: int
    max_staleness: int
    groups_per_step: int
    depth_groups: int
    depth_bytes: int
    leased_groups: int
    reserved_groups: int
    accepted_groups: int
    acked_groups: int
    evicted_groups: dict[str, int]
    expired_leases: int
    capacity_groups: int
    capacity_bytes: int
    wal_bytes: int
