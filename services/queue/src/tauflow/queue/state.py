"""The queue's domain: pacing, leases, stale eviction and durability, without gRPC.

Every change is a record: it is appended to the write-ahead log first and then
applied to memory by ``_apply``. Recovery replays the same records through the
same ``_apply``, so the state after a restart is the state before it.

Pacing (design.md §2): a reservation of ``n`` groups is granted only while
``accepted + in_flight + n <= (trainer_version + tau + 1) * groups_per_step``,
where ``accepted`` counts every group accepted since the run began minus those
evicted, and ``in_flight`` the reserved groups not yet put. The safety net
evicts, at ``get`` time, any group whose staleness for the consumer exceeds tau.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tauflow.queue.wal import Record, WriteAheadLog

log = logging.getLogger(__name__)

# Record kinds in the write-ahead log.
PUT, LEASE, ACK, RELEASE, EVICT, VERSION, RESERVE, UNRESERVE, RENEW, SNAPSHOT = range(1, 11)

MAX_VERSION = 2**53  # policy versions and tau: exact in a double (metrics) and in any JSON reader of the log


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


@dataclass
class Settings:
    max_staleness: int = 1  # tau; -1 is unbounded
    groups_per_step: int = 8
    capacity_groups: int = 100_000
    capacity_bytes: int = 8 * 1024**3
    default_lease_s: float = 600.0
    reservation_ttl_s: float = 600.0
    dedup_window: int = 1_000_000  # ids of acked/evicted groups remembered for idempotent Put
    outcome_window: int = 100_000  # lease and ticket outcomes remembered for idempotent Ack/Nack
    max_lease_s: float = 7 * 86400.0  # longest lease a consumer may ask for (Get, RenewLease)

    @property
    def bounded(self) -> bool:
        return self.max_staleness >= 0


@dataclass
class GroupRecord:
    group_id: str
    payload: bytes  # the serialized tauflow.api.common.v1.Group
    behaviour_version: int
    n_tokens: int
    accepted_at: float = 0.0
    deliveries: int = 0
    wal_bytes: int = 0
    newest_version: int = 0  # newest policy version of any token (Put refuses one from the future)
    checked: bool = False  # validated by this build (groups recovered from a log are checked at Get)

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


@dataclass
class SweepResult:
    expired_leases: int = 0
    expired_groups: int = 0
    expired_tickets: int = 0


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


MAX_ID_CHARS = 256  # every id a request carries (the contract's bound)


def _check_id(value: str, field: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequest(f"{field} is {len(value)} characters, longer than {MAX_ID_CHARS}")


def _bounded_put(d: OrderedDict[str, Any], key: str, value: Any, limit: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > limit:
        d.popitem(last=False)


@dataclass
class _Memory:
    """Everything ``_apply`` changes; kept apart so a snapshot is easy to write."""

    trainer_version: int = 0
    accepted: int = 0
    in_flight: int = 0
    acked_total: int = 0
    expired_leases: int = 0
    evicted: dict[str, int] = field(default_factory=dict)
    groups: dict[str, GroupRecord] = field(default_factory=dict)
    pending: OrderedDict[str, None] = field(default_factory=OrderedDict)  # delivery order, head first
    pending_bytes: int = 0
    live_bytes: int = 0
    live_wal_bytes: int = 0
    leases: dict[str, Lease] = field(default_factory=dict)
    leased_groups: int = 0
    tickets: dict[str, Ticket] = field(default_factory=dict)
    done_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)  # acked or evicted groups
    outcomes: OrderedDict[str, str] = field(default_factory=OrderedDict)  # lease/ticket id -> outcome
    reservations: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)  # request id -> ticket


class QueueState:
    def __init__(
        self,
        settings: Settings,
        wal: WriteAheadLog | None = None,
        clock: Callable[[], float] = time.time,
        validate: Callable[[bytes], str | None] | None = None,
        quarantine: Callable[[GroupRecord, str], None] | None = None,
    ) -> None:
        """``validate`` says why a stored payload cannot be delivered (None: it can); groups recovered
        from the log are checked with it before their first delivery, and ``quarantine`` is given each
        one that fails (to keep it aside) before it is evicted, so that no consumer is ever blocked by it."""
        self.settings = settings
        self.clock = clock
        self.validate = validate
        self.quarantine = quarantine
        self.m = _Memory()
        self.wal: WriteAheadLog | None = None
        if wal is not None:
            skipped = 0
            for kind, meta, blob, size in wal.replay():
                if wal.losses and not self._still_applies(kind, meta):
                    skipped += 1  # it needed a record lost to damage (wal.on_corruption: proceed)
                    continue
                self._apply(kind, meta, blob, size)
            log.info(
                "recovered",
                extra={"groups": len(self.m.groups), "leases": len(self.m.leases), "version": self.m.trainer_version},
            )
        self.wal = wal
        if wal is not None:
            self._grant_recovered_leases()
        if wal is not None and wal.losses:
            log.error("recovered past damage in the log", extra={"records_needing_lost_ones_skipped": skipped})
            self.compact()  # the log then holds exactly the recovered state

    def _grant_recovered_leases(self) -> None:
        """Gives each recovered lease its duration anew from now (in memory: the next recovery does the same).
        Its holder could not renew while the queue was down, and it reconnects with a backoff; a lease kept
        to its old deadline would expire at once after a long restart, its groups going round again after
        the trainer had trained them (found by the chaos test)."""
        now = self.clock()
        granted = 0
        for lease in self.m.leases.values():
            duration = lease.duration_s or self.settings.default_lease_s  # format-1 logs say no duration
            if lease.deadline < now + duration:
                lease.deadline = now + duration
                granted += 1
        if granted:
            log.info("recovered leases get their duration anew", extra={"leases": granted})

    # -- reading ---------------------------------------------------------------------------

    @property
    def trainer_version(self) -> int:
        return self.m.trainer_version

    @property
    def depth_groups(self) -> int:
        return len(self.m.pending)

    def stats(self) -> Stats:
        m, s = self.m, self.settings
        return Stats(
            trainer_version=m.trainer_version,
            max_staleness=s.max_staleness,
            groups_per_step=s.groups_per_step,
            depth_groups=len(m.pending),
            depth_bytes=m.pending_bytes,
            leased_groups=m.leased_groups,
            reserved_groups=m.in_flight,
            accepted_groups=m.accepted,
            acked_groups=m.acked_total,
            evicted_groups=dict(m.evicted),
            expired_leases=m.expired_leases,
            capacity_groups=s.capacity_groups,
            capacity_bytes=s.capacity_bytes,
            wal_bytes=self.wal.size if self.wal else 0,
        )

    def pacing_limit(self) -> int | None:
        """Most groups (accepted + in flight) the rule allows now; None when unbounded."""
        if not self.settings.bounded:
            return None
        return (self.m.trainer_version + self.settings.max_staleness + 1) * self.settings.groups_per_step

    def has_room(self, n: int) -> bool:
        m = self.m
        if len(m.groups) + m.in_flight + n > self.settings.capacity_groups:
            return False
        limit = self.pacing_limit()
        return limit is None or m.accepted + m.in_flight + n <= limit

    # -- producers -------------------------------------------------------------------------

    def reserve(self, request_id: str, producer_id: str, n_groups: int) -> Ticket | None:
        """A ticket for ``n_groups`` when the pacing rule and capacity allow, else None."""
        s = self.settings
        if not request_id:
            raise InvalidRequest("request_id must be set (it makes Reserve idempotent)")
        _check_id(request_id, "request_id")
        _check_id(producer_id, "producer_id")
        if n_groups < 1:
            raise InvalidRequest("n_groups must be at least 1")
        if s.bounded and n_groups > (s.max_staleness + 1) * s.groups_per_step:
            raise InvalidRequest(
                f"n_groups={n_groups} can never be granted: max_staleness={s.max_staleness} and "
                f"groups_per_step={s.groups_per_step} allow at most "
                f"{(s.max_staleness + 1) * s.groups_per_step} groups ahead of the trainer"
            )
        if n_groups > s.capacity_groups:
            raise InvalidRequest(f"n_groups={n_groups} exceeds the queue capacity of {s.capacity_groups} groups")
        earlier = self.m.reservations.get(request_id)
        if earlier is not None:
            return self._ticket_from_meta(earlier)
        self.sweep()
        if not self.has_room(n_groups):
            return None
        meta = {
            "t": uuid.uuid4().hex,
            "r": request_id,
            "p": producer_id,
            "n": n_groups,
            "mv": self.m.trainer_version,
            "exp": self.clock() + s.reservation_ttl_s,
        }
        self._log(RESERVE, meta)
        return self._ticket_from_meta(meta)

    def release_reservation(self, ticket_id: str, owner: str | None = None) -> int:
        """Gives back a ticket's unused room. With ``owner`` (an authenticated client) only that
        producer's tickets are found: another client's ticket is as unknown as a made-up one."""
        _check_id(ticket_id, "ticket_id")
        ticket = self.m.tickets.get(ticket_id)
        if ticket is not None and owner is not None and ticket.producer_id != owner:
            raise NotFound(f"ticket {ticket_id!r} is unknown")
        if ticket is None:
            if ticket_id in self.m.outcomes:
                return 0
            raise NotFound(f"ticket {ticket_id!r} is unknown")
        self._log(UNRESERVE, {"t": ticket_id, "why": "released"})
        return ticket.remaining

    def put(self, group: GroupRecord, ticket_id: str = "", owner: str | None = None) -> tuple[bool, int]:
        """Accepts ``group``; returns (newly accepted, depth). A known group id is a no-op. With ``owner``
        (an authenticated client) a ticket of another producer is ignored, as an unknown one is."""
        m, s = self.m, self.settings
        _check_id(ticket_id, "ticket_id")
        if group.group_id in m.groups or group.group_id in m.done_ids:
            return False, len(m.pending)
        newest = max(group.behaviour_version, group.newest_version)
        if newest > m.trainer_version:
            raise FailedPrecondition(
                f"group {group.group_id}: a sample claims policy version {newest} (behaviour_version or "
                f"token_versions), newer than the trainer's version {m.trainer_version}: a group can only "
                "come from weights the trainer has published"
            )
        if group.size > s.capacity_bytes:
            raise GroupOverCapacity(
                f"group {group.group_id} is {group.size} bytes, larger than the queue's capacity of "
                f"{s.capacity_bytes} bytes: it can never fit"
            )
        ticket = m.tickets.get(ticket_id) if ticket_id else None
        if ticket is not None and owner is not None and ticket.producer_id != owner:
            ticket = None
        if ticket is not None and ticket.expires_at <= self.clock():
            ticket = None  # an expired ticket's room was given back; the group comes in untickted
        own_room = 1 if ticket is not None and ticket.remaining > 0 else 0
        if len(m.groups) + m.in_flight - own_room + 1 > s.capacity_groups:
            raise QueueFull(
                f"queue is full: {len(m.groups)} groups stored and {m.in_flight} reserved "
                f"of capacity {s.capacity_groups}"
            )
        if m.live_bytes + group.size > s.capacity_bytes:
            raise QueueFull(
                f"queue is full: {m.live_bytes} bytes stored, group of {group.size} bytes "
                f"exceeds capacity {s.capacity_bytes}"
            )
        meta = {
            "g": group.group_id,
            "bv": group.behaviour_version,
            "nt": group.n_tokens,
            "at": self.clock(),
            "tk": ticket.ticket_id if own_room else "",
            "d": 0,
        }
        self._log(PUT, meta, group.payload)
        m.groups[group.group_id].checked = True  # validated on its way in
        return True, len(m.pending)

    # -- consumers -------------------------------------------------------------------------

    def get(
        self,
        consumer_id: str,
        max_groups: int,
        min_groups: int = 0,
        max_tokens: int = 0,
        lease_s: float = 0.0,
        consumer_version: int | None = None,
        max_bytes: int = 0,
        overhead_bytes: int = 0,
    ) -> GetResult:
        """Leases the oldest deliverable groups: up to ``max_groups``, within ``max_tokens`` and within
        ``max_bytes`` (each group counting its payload plus ``overhead_bytes``: the message limit), at
        least one group. A batch cut by ``max_bytes`` is delivered below ``min_groups`` once at least
        ``min_groups`` deliverable groups are waiting: the rest stays at the head for the next Get, so
        waiting would never make this batch larger, and the consumer completes its step at once."""
        s, m = self.settings, self.m
        if max_groups == 0 and max_tokens == 0:
            raise InvalidRequest("set max_groups or max_tokens (both are 0)")
        if max_groups and min_groups > max_groups:
            raise InvalidRequest(f"min_groups={min_groups} is larger than max_groups={max_groups}")
        _check_id(consumer_id, "consumer_id")
        self._check_lease_s(lease_s)
        if consumer_version is not None and consumer_version > MAX_VERSION:
            raise InvalidRequest(f"consumer_version={consumer_version} is above the largest version {MAX_VERSION}")
        self.sweep()
        version = m.trainer_version if consumer_version is None else consumer_version
        stale: list[str] = []
        invalid: list[tuple[str, str]] = []
        batch: list[str] = []
        tokens = nbytes = 0
        cut_by_bytes = False
        for gid in m.pending:
            rec = m.groups[gid]
            if s.bounded and version - rec.behaviour_version > s.max_staleness:
                stale.append(gid)
                continue
            if max_groups and len(batch) >= max_groups:
                break
            if not rec.checked and self.validate is not None:
                reason = self.validate(rec.payload)
                if reason is not None:
                    invalid.append((gid, reason))
                    continue
                rec.checked = True
            if max_tokens and batch and tokens + rec.n_tokens > max_tokens:
                break
            if max_bytes and batch and nbytes + rec.size + overhead_bytes > max_bytes:
                cut_by_bytes = True
                break
            batch.append(gid)
            tokens += rec.n_tokens
            nbytes += rec.size + overhead_bytes
        if stale:
            self._log(EVICT, {"gs": stale, "why": "stale"})
        if invalid:
            self._quarantine(invalid)
        if not batch or (
            len(batch) < min_groups and not (cut_by_bytes and self._deliverable(min_groups, version))
        ):
            return GetResult(None, [], len(stale), len(invalid))
        duration = lease_s or s.default_lease_s
        meta = {"l": uuid.uuid4().hex, "gs": batch, "dl": self.clock() + duration, "ls": duration, "c": consumer_id,
                "cv": version}
        self._log(LEASE, meta)
        lease = m.leases[meta["l"]]
        deliveries = [
            Delivery(m.groups[g], max(0, version - m.groups[g].behaviour_version), m.groups[g].deliveries - 1)
            for g in batch
        ]
        return GetResult(lease, deliveries, len(stale), len(invalid))

    def _quarantine(self, invalid: list[tuple[str, str]]) -> None:
        """Sets aside stored groups that no consumer can decode, so that they never block a Get again."""
        for gid, reason in invalid:
            log.error("a stored group cannot be delivered: quarantined", extra={"group_id": gid, "why": reason})
            if self.quarantine is not None:
                self.quarantine(self.m.groups[gid], reason)
        self._log(EVICT, {"gs": [gid for gid, _ in invalid], "why": "invalid"})

    def _check_lease_s(self, lease_s: float) -> None:
        if not 0 <= lease_s <= self.settings.max_lease_s:
            raise InvalidRequest(
                f"lease_duration={lease_s:g}s must be between 0 (the default of "
                f"{self.settings.default_lease_s:g}s) and {self.settings.max_lease_s:g}s"
            )

    def _deliverable(self, n: int, version: int) -> bool:
        """Whether at least ``n`` waiting groups are fresh enough for ``version``."""
        s, count = self.settings, 0
        for gid in self.m.pending:
            if not (s.bounded and version - self.m.groups[gid].behaviour_version > s.max_staleness):
                count += 1
                if count >= n:
                    return True
        return False

    def ack(self, lease_id: str) -> int:
        _check_id(lease_id, "lease_id")
        self.sweep()
        lease = self.m.leases.get(lease_id)
        if lease is not None:
            self._log(ACK, {"l": lease_id})
            return len(lease.group_ids)
        outcome = self.m.outcomes.get(lease_id)
        if outcome == "acked":
            return 0
        if outcome is not None:
            raise FailedPrecondition(
                f"lease {lease_id} was {outcome} before this ack; its groups went back to the queue"
            )
        raise NotFound(f"lease {lease_id!r} is unknown")

    def nack(self, lease_id: str) -> int:
        _check_id(lease_id, "lease_id")
        self.sweep()
        lease = self.m.leases.get(lease_id)
        if lease is not None:
            self._log(RELEASE, {"l": lease_id, "why": "nacked"})
            return len(lease.group_ids)
        outcome = self.m.outcomes.get(lease_id)
        if outcome == "acked":
            raise FailedPrecondition(f"lease {lease_id} was already acked; its groups are gone")
        if outcome is not None:
            return 0
        raise NotFound(f"lease {lease_id!r} is unknown")

    def renew(self, lease_id: str, lease_s: float = 0.0) -> Lease:
        _check_id(lease_id, "lease_id")
        self._check_lease_s(lease_s)
        self.sweep()
        lease = self.m.leases.get(lease_id)
        if lease is None:
            outcome = self.m.outcomes.get(lease_id)
            if outcome is not None:
                raise FailedPrecondition(f"lease {lease_id} is no longer held: it was {outcome}")
            raise NotFound(f"lease {lease_id!r} is unknown")
        duration = lease_s or self.settings.default_lease_s
        self._log(RENEW, {"l": lease_id, "dl": self.clock() + duration, "ls": duration})
        return lease

    def set_trainer_version(self, version: int, rebase: bool = False) -> int:
        if not 0 <= version <= MAX_VERSION:
            raise InvalidRequest(f"policy_version={version} must be between 0 and {MAX_VERSION}")
        if version > self.m.trainer_version or (rebase and version != self.m.trainer_version):
            self._log(VERSION, {"v": version, "rb": rebase})
        return self.m.trainer_version

    def set_max_staleness(self, max_staleness: int) -> int:
        """Changes tau for deliveries and reservations from now on (not logged: config wins on restart)."""
        if not -1 <= max_staleness <= MAX_VERSION:
            raise InvalidRequest(
                f"max_staleness={max_staleness} must be -1 (unbounded) or between 0 and {MAX_VERSION}"
            )
        self.settings.max_staleness = max_staleness
        return max_staleness

    # -- time ------------------------------------------------------------------------------

    def sweep(self) -> SweepResult:
        """Returns expired leases to the head of the queue and releases expired tickets."""
        now = self.clock()
        result = SweepResult()
        # Newest first, so that the oldest expired lease ends up at the very head.
        for lease in reversed([x for x in self.m.leases.values() if x.deadline <= now]):
            self._log(RELEASE, {"l": lease.lease_id, "why": "expired"})
            result.expired_leases += 1
            result.expired_groups += len(lease.group_ids)
        for ticket in [t for t in self.m.tickets.values() if t.expires_at <= now]:
            self._log(UNRESERVE, {"t": ticket.ticket_id, "why": "expired"})
            result.expired_tickets += 1
        return result

    def next_deadline(self) -> float | None:
        deadlines = [x.deadline for x in self.m.leases.values()] + [t.expires_at for t in self.m.tickets.values()]
        return min(deadlines, default=None)

    # -- durability ------------------------------------------------------------------------

    def compaction_due(self, min_bytes: int) -> bool:
        if self.wal is None:
            return False
        dead = self.wal.size - self.m.live_wal_bytes
        return dead >= min_bytes and dead >= self.m.live_wal_bytes

    def compact(self) -> None:
        """Rewrites the log as a snapshot of the live state (call ``wal.idle()`` first)."""
        assert self.wal is not None
        m = self.m
        order = list(m.pending) + [g for lease in m.leases.values() for g in lease.group_ids]
        records: list[Record] = [(SNAPSHOT, self._snapshot_meta(), b"")]
        records += [
            (
                PUT,
                {"g": g, "bv": r.behaviour_version, "nt": r.n_tokens, "at": r.accepted_at, "tk": "", "d": r.deliveries},
                r.payload,
            )
            for g in order
            for r in (m.groups[g],)
        ]
        records += [
            (LEASE, {"l": x.lease_id, "gs": x.group_ids, "dl": x.deadline, "ls": x.duration_s, "c": x.consumer_id, "cv": x.consumer_version, "re": 1}, b"")
            for x in m.leases.values()
        ]
        records += [
            (RESERVE, {"t": t.ticket_id, "r": t.request_id, "p": t.producer_id, "n": t.remaining, "mv": t.min_policy_version, "exp": t.expires_at, "n0": t.n_groups}, b"")
            for t in m.tickets.values()
        ]
        before = self.wal.size
        sizes = self.wal.rewrite(records)
        for g, size in zip(order, sizes[1 : 1 + len(order)], strict=True):
            m.groups[g].wal_bytes = size
        m.live_wal_bytes = sum(sizes[1 : 1 + len(order)])
        log.info("compacted the log", extra={"bytes_before": before, "bytes_after": self.wal.size})

    def _snapshot_meta(self) -> dict[str, Any]:
        m = self.m
        return {
            "v": m.trainer_version,
            "acc": m.accepted - len(m.groups),  # the PUT records that follow add the live groups back
            "ackd": m.acked_total,
            "ev": m.evicted,
            "exl": m.expired_leases,
            "done": list(m.done_ids),
            "out": dict(m.outcomes),
            "res": dict(m.reservations),
        }

    def _still_applies(self, kind: int, meta: dict[str, Any]) -> bool:
        """Whether a record recovered after lost ones applies: a lost one may have made what it refers to."""
        m = self.m
        if kind in (LEASE, EVICT):
            return all(g in m.pending for g in meta["gs"])
        if kind in (ACK, RELEASE, RENEW):
            return meta["l"] in m.leases
        if kind == UNRESERVE:
            return meta["t"] in m.tickets
        return kind != PUT or meta["g"] not in m.groups

    # -- the one place state changes -------------------------------------------------------

    def _log(self, kind: int, meta: dict[str, Any], blob: bytes = b"") -> None:
        size = self.wal.append(kind, meta, blob) if self.wal is not None else 0
        self._apply(kind, meta, blob, size)

    def _apply(self, kind: int, meta: dict[str, Any], blob: bytes, size: int) -> None:
        m, s = self.m, self.settings
        if kind == PUT:
            rec = GroupRecord(meta["g"], blob, meta["bv"], meta["nt"], meta["at"], meta.get("d", 0), size)
            m.groups[rec.group_id] = rec
            m.pending[rec.group_id] = None
            m.pending_bytes += rec.size
            m.live_bytes += rec.size
            m.live_wal_bytes += size
            m.accepted += 1
            ticket = m.tickets.get(meta["tk"]) if meta["tk"] else None
            if ticket is not None and ticket.remaining > 0:
                ticket.remaining -= 1
                m.in_flight -= 1
                if ticket.remaining == 0:
                    del m.tickets[ticket.ticket_id]
                    _bounded_put(m.outcomes, ticket.ticket_id, "used", s.outcome_window)
        elif kind == LEASE:
            lease = Lease(meta["l"], list(meta["gs"]), meta["dl"], meta["c"], meta["cv"], meta.get("ls", 0.0))
            for g in lease.group_ids:
                del m.pending[g]
                m.pending_bytes -= m.groups[g].size
                if not meta.get("re"):
                    m.groups[g].deliveries += 1
            m.leases[lease.lease_id] = lease
            m.leased_groups += len(lease.group_ids)
        elif kind == RENEW:
            lease = m.leases[meta["l"]]
            lease.deadline, lease.duration_s = meta["dl"], meta.get("ls", lease.duration_s)
        elif kind == ACK:
            lease = m.leases.pop(meta["l"])
            m.leased_groups -= len(lease.group_ids)
            for g in lease.group_ids:
                rec = m.groups.pop(g)
                m.live_bytes -= rec.size
                m.live_wal_bytes -= rec.wal_bytes
                _bounded_put(m.done_ids, g, None, s.dedup_window)
            m.acked_total += len(lease.group_ids)
            _bounded_put(m.outcomes, lease.lease_id, "acked", s.outcome_window)
        elif kind == RELEASE:
            lease = m.leases.pop(meta["l"])
            m.leased_groups -= len(lease.group_ids)
            for g in reversed(lease.group_ids):  # back to the head, in their original order
                m.pending[g] = None
                m.pending.move_to_end(g, last=False)
                m.pending_bytes += m.groups[g].size
            if meta["why"] == "expired":
                m.expired_leases += 1
            _bounded_put(m.outcomes, lease.lease_id, meta["why"], s.outcome_window)
        elif kind == EVICT:
            for g in meta["gs"]:
                del m.pending[g]
                rec = m.groups.pop(g)
                m.pending_bytes -= rec.size
                m.live_bytes -= rec.size
                m.live_wal_bytes -= rec.wal_bytes
                _bounded_put(m.done_ids, g, None, s.dedup_window)
            m.accepted -= len(meta["gs"])
            m.evicted[meta["why"]] = m.evicted.get(meta["why"], 0) + len(meta["gs"])
        elif kind == VERSION:
            m.trainer_version = meta["v"]
            if meta["rb"]:
                # A trainer resumed from an older checkpoint: pace as if every step so far
                # consumed one batch, plus what is stored now.
                m.accepted = m.trainer_version * s.groups_per_step + len(m.groups)
        elif kind == RESERVE:
            ticket = Ticket(meta["t"], meta["r"], meta["p"], meta.get("n0", meta["n"]), meta["mv"], meta["exp"], meta["n"])
            m.tickets[ticket.ticket_id] = ticket
            m.in_flight += ticket.remaining
            _bounded_put(m.reservations, ticket.request_id, meta, s.outcome_window)
        elif kind == UNRESERVE:
            ticket = m.tickets.pop(meta["t"])
            m.in_flight -= ticket.remaining
            _bounded_put(m.outcomes, ticket.ticket_id, meta["why"], s.outcome_window)
        elif kind == SNAPSHOT:
            m.trainer_version = meta["v"]
            m.accepted = meta["acc"]
            m.acked_total = meta["ackd"]
            m.evicted = dict(meta["ev"])
            m.expired_leases = meta["exl"]
            m.done_ids = OrderedDict.fromkeys(meta["done"])
            m.outcomes = OrderedDict(meta["out"])
            m.reservations = OrderedDict(meta["res"])
        else:
            raise ValueError(f"unknown log record kind {kind}")

    @staticmethod
    def _ticket_from_meta(meta: dict[str, Any]) -> Ticket:
        return Ticket(meta["t"], meta["r"], meta["p"], meta.get("n0", meta["n"]), meta["mv"], meta["exp"], meta["n"])
