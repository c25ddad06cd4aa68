"""The queue's live operations: pacing, leases, stale eviction and durability, without gRPC.

Every change is a record (records.py): it is appended to the write-ahead log first and then applied
to memory by ``records.apply``. Recovery replays the same records through the same ``apply``, so the
state after a restart is the state before it.

Pacing (docs/design.md §2, tauflow.core.staleness): a reservation of ``n`` groups is granted only while
``accepted + in_flight + n <= (trainer_version + tau + 1) * groups_per_step``, where ``accepted``
counts every group accepted since the run began minus those evicted before a step used them (a group
evicted after the step it was delivered for committed keeps its count: ``records.used_by_a_step``), and
``in_flight`` the reserved groups not yet put. The safety net evicts, at ``get`` time, any group too
stale for the consumer.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable

from tauflow.core import staleness
from tauflow.queue import records
from tauflow.queue.config import QueueConfig
from tauflow.queue.model import (
    MAX_VERSION,
    ClientLimit,
    Delivery,
    FailedPrecondition,
    GetResult,
    GroupOverCapacity,
    GroupRecord,
    InvalidRequest,
    Lease,
    NotFound,
    QueueFull,
    Stats,
    SweepResult,
    Ticket,
    check_id,
)
from tauflow.queue.records import (
    ACK,
    EVICT,
    LEASE,
    PUT,
    RELEASE,
    RENEW,
    RESERVE,
    UNRESERVE,
    VERSION,
    Key,
    Memory,
    Meta,
)
from tauflow.queue.wal import Record, WalWriteError, WriteAheadLog

log = logging.getLogger(__name__)

# Why a stored payload cannot be delivered (None: it can): app.py wires the wire's full decode.
Validate = Callable[[bytes], str | None]
# Keeps a group that failed ``Validate`` aside, with the reason, before it is evicted.
Quarantine = Callable[[GroupRecord, str], None]
# PUT meta key: 1 when an external client put the group without a ticket (absent: 0). It counts against the
# external share while stored (``QueueState.external_held_now``), after a restart and a compaction as before.
EXTERNAL_LOOSE = Key.EXTERNAL_LOOSE


class QueueState:
    def __init__(
        self,
        config: QueueConfig,
        wal: WriteAheadLog | None = None,
        clock: Callable[[], float] = time.time,
        validate: Validate | None = None,
        quarantine: Quarantine | None = None,
        pause_after_s: float | None = None,
    ) -> None:
        """``validate`` says why a stored payload cannot be delivered (None: it can); groups recovered
        from the log are checked with it before their first delivery, and ``quarantine`` is given each
        one that fails (to keep it aside) before it is evicted, so that no consumer is ever blocked by it.

        ``pause_after_s``: the service sweeps at least this often while it runs (its sweep loop), so a longer
        gap between two sweeps is time the process did not run (SIGSTOP, a frozen VM) or a jump of the wall
        clock: leases and tickets get that time back (``_excuse_a_pause``). None: not watched (a test's clock)."""
        self.config = config
        self.pause_after_s = pause_after_s
        self._ran_at, self._wall_at = time.monotonic(), clock()
        self.max_staleness = config.max_staleness  # tau in force (SetMaxStaleness; the config's at a restart)
        self.clock = clock
        self.validate = validate
        self.quarantine = quarantine
        self.memory = Memory()
        # The external clients' groups put without a ticket and still stored (not acked nor evicted): group id
        # to its bytes. They count against external.reserved_share with the external tickets (a client that
        # never reserved filled the whole capacity). Rebuilt at recovery from the PUT records' EXTERNAL_LOOSE.
        self.external_loose: dict[str, int] = {}
        self.external_loose_bytes = 0
        self.changes = 0  # changes made so far: a long poll that found nothing retries only after one
        self.wal: WriteAheadLog | None = None
        if wal is not None:
            self._recover(wal)
        self._ran_at, self._wall_at = time.monotonic(), clock()  # (the recovery's time is no pause)

    def _recover(self, wal: WriteAheadLog) -> None:
        skipped = 0
        for kind, meta, blob, size in wal.replay():
            if wal.losses and not records.still_applies(self.memory, kind, meta):
                skipped += 1  # it needed a record lost to damage (wal.on_corruption: proceed)
                continue
            self._forget_loose(kind, meta)
            records.apply(self.memory, self.config, kind, meta, blob, size)
            if kind == PUT and meta.get(EXTERNAL_LOOSE):
                self._hold_loose(meta[Key.GROUP_ID], len(blob))
        log.info(
            "recovered",
            extra={
                "groups": len(self.memory.groups),
                "leases": len(self.memory.leases),
                "version": self.memory.trainer_version,
            },
        )
        self.wal = wal
        self._grant_recovered_leases()
        if wal.losses:
            log.error("recovered past damage in the log", extra={"records_needing_lost_ones_skipped": skipped})
            self.compact()  # the log then holds exactly the recovered state

    def _grant_recovered_leases(self) -> None:
        """Gives each recovered lease its duration anew from now (in memory: the next recovery does the same).
        Its holder could not renew while the queue was down, and it reconnects with a backoff; a lease kept
        to its old deadline would expire at once after a long restart, its groups going round again after
        the trainer had trained them (found by the chaos test)."""
        now = self.clock()
        granted = 0
        for lease in self.memory.leases.values():
            duration = lease.duration_s or self.config.default_lease_s  # format-1 logs say no duration
            if lease.deadline < now + duration:
                lease.deadline = now + duration
                granted += 1
        if granted:
            log.info("recovered leases get their duration anew", extra={"leases": granted})

    # -- reading ---------------------------------------------------------------------------

    @property
    def trainer_version(self) -> int:
        return self.memory.trainer_version

    @property
    def depth_groups(self) -> int:
        return len(self.memory.pending)

    def stats(self) -> Stats:
        memory, config = self.memory, self.config
        return Stats(
            trainer_version=memory.trainer_version,
            max_staleness=self.max_staleness,
            groups_per_step=config.groups_per_step,
            depth_groups=len(memory.pending),
            depth_bytes=memory.pending_bytes,
            leased_groups=memory.leased_groups,
            reserved_groups=memory.in_flight,
            accepted_groups=memory.accepted,
            acked_groups=memory.acked_total,
            evicted_groups=dict(memory.evicted),
            expired_leases=memory.expired_leases,
            capacity_groups=config.capacity_groups,
            capacity_bytes=config.capacity_bytes,
            wal_bytes=self.wal.size if self.wal else 0,
        )

    def pacing_limit(self) -> int | None:
        """Most groups (accepted + in flight) the rule allows now; None when unbounded."""
        return staleness.pacing_limit(self.memory.trainer_version, self.max_staleness, self.config.groups_per_step)

    def has_room(self, n: int) -> bool:
        return n <= self.free_room()

    def free_room(self) -> int:
        """Groups a Reserve could be granted now (capacity and the pacing rule); 0 or less: none."""
        memory = self.memory
        room = self.config.capacity_groups - len(memory.groups) - memory.in_flight
        limit = self.pacing_limit()
        if limit is not None:
            room = min(room, limit - memory.accepted - memory.in_flight)
        return room

    def external_limit(self) -> int:
        """Most groups the external clients' tickets may hold together now: ``external.reserved_share`` of the
        pacing window and of the capacity, each rounded down but at least 1 group (a window of one group,
        tau = 0 and groups_per_step = 1, left them none: every external Reserve was refused). The rest is kept
        for tauflow's own producers. The window's share follows tau, which SetMaxStaleness changes live."""
        share, config = self.config.external.reserved_share, self.config
        limit = _share(share, config.capacity_groups)
        ahead = staleness.most_ahead(self.max_staleness, config.groups_per_step)
        if ahead is not None:
            limit = min(limit, _share(share, ahead))
        return limit

    def external_held_now(self) -> int:
        """Groups of the external share in use: the external tickets' reserved groups not yet put, and the
        external clients' groups put without a ticket and still stored (acked or evicted, they leave it)."""
        return self.memory.external_in_flight + len(self.external_loose)

    def external_room(self) -> int:
        """Groups an external client's Reserve could be granted now, as far as the external share goes."""
        return self.external_limit() - self.external_held_now()

    def _check_external_loose_put(self, group: GroupRecord) -> None:
        """Refuses an external client's Put without a ticket beyond the external share: with the external
        tickets, at most ``external.reserved_share`` of the pacing window and of capacity_groups (as a Reserve),
        and of capacity_bytes. Over the share of the window it is QueueFull (the trainer's steps make room); a
        group larger than the whole share of capacity_bytes can never come in that way (GroupOverCapacity)."""
        share, config = self.config.external.reserved_share, self.config
        limit = self.external_limit()
        if self.external_held_now() + 1 > limit:
            raise QueueFull(
                f"the external clients hold {len(self.external_loose)} groups put without a ticket and still "
                f"stored, and {self.memory.external_in_flight} reserved: external.reserved_share={share:g} of the "
                f"pacing window and of capacity_groups={config.capacity_groups} allows them {limit} groups; "
                "retry once the trainer has taken some (or Reserve, and wait for a ticket)"
            )
        byte_limit = _share(share, config.capacity_bytes)
        if group.size > byte_limit:
            raise GroupOverCapacity(
                f"group {group.group_id} is {group.size} bytes, more than external.reserved_share={share:g} of "
                f"capacity_bytes={config.capacity_bytes} ({byte_limit} bytes): it can never fit without a ticket"
            )
        if self.external_loose_bytes + group.size > byte_limit:
            raise QueueFull(
                f"the external clients' groups put without a ticket hold {self.external_loose_bytes} bytes: "
                f"{group.size} more would pass external.reserved_share={share:g} of capacity_bytes="
                f"{config.capacity_bytes} ({byte_limit} bytes); retry once the trainer has taken some"
            )

    def _hold_loose(self, group_id: str, size: int) -> None:
        self.external_loose[group_id] = size
        self.external_loose_bytes += size

    def _forget_loose(self, kind: int, meta: Meta) -> None:
        """Before an ACK or EVICT record applies: its groups leave the external share."""
        if not self.external_loose:
            return
        if kind == ACK:
            lease = self.memory.leases.get(meta[Key.LEASE_ID])
            gone = lease.group_ids if lease is not None else []
        elif kind == EVICT:
            gone = meta[Key.GROUP_IDS]
        else:
            return
        for g in gone:
            size = self.external_loose.pop(g, None)
            if size is not None:
                self.external_loose_bytes -= size

    # -- producers -------------------------------------------------------------------------

    def reserve(self, request_id: str, producer_id: str, n_groups: int, external: bool = False) -> Ticket | None:
        """A ticket for ``n_groups`` when the pacing rule and capacity allow, else None. ``external``: a client
        of the external port (``producer_id`` its name), held to ``external.*`` as well: at most
        ``max_reserve_groups`` a Reserve and the external clients' share of the capacity (INVALID_ARGUMENT: fixed
        bounds), ``max_reserved_groups`` held at a time (ClientLimit: RESOURCE_EXHAUSTED), and room only within
        the external clients' share of the pacing window (else None: it waits, even for an ``n_groups`` over the
        whole share at the current tau, which SetMaxStaleness may raise)."""
        config = self.config
        if not request_id:
            raise InvalidRequest("request_id must be set (it makes Reserve idempotent)")
        check_id(request_id, "request_id")
        check_id(producer_id, "producer_id")
        if n_groups < 1:
            raise InvalidRequest("n_groups must be at least 1")
        ahead = staleness.most_ahead(self.max_staleness, config.groups_per_step)
        # (not on the external port: a Reserve over the window's share there waits, as the window follows tau)
        if not external and ahead is not None and n_groups > ahead:
            raise InvalidRequest(
                f"n_groups={n_groups} can never be granted: max_staleness={self.max_staleness} and "
                f"groups_per_step={config.groups_per_step} allow at most {ahead} groups ahead of the trainer"
            )
        if n_groups > config.capacity_groups:
            raise InvalidRequest(f"n_groups={n_groups} exceeds the queue capacity of {config.capacity_groups} groups")
        if external:
            self._check_external_reserve(n_groups)
        earlier = self.memory.reservations.get(request_id)
        if earlier is not None:
            granted = records.ticket_from_meta(earlier)
            if (granted.n_groups, granted.producer_id, granted.external) != (n_groups, producer_id, external):
                # (answered with the first ticket, the caller believed it had room for n_groups it never got)
                raise InvalidRequest(
                    f"request_id {request_id!r} was already used for a Reserve of n_groups={granted.n_groups} by "
                    f"producer_id {granted.producer_id!r}: a retry must repeat it exactly (n_groups={n_groups}, "
                    f"producer_id {producer_id!r} here); a new Reserve needs a new request_id"
                )
            return granted
        self._sweep()
        if external:
            held = self.memory.external_held.get(producer_id, 0)
            if held + n_groups > config.external.max_reserved_groups:
                raise ClientLimit(
                    f"client {producer_id!r} holds {held} reserved groups not yet put: {n_groups} more would pass "
                    f"external.max_reserved_groups={config.external.max_reserved_groups}; put or release some first"
                )
            if n_groups > self.external_room():
                return None
        if not self.has_room(n_groups):
            return None
        ticket = Ticket(
            uuid.uuid4().hex,
            request_id,
            producer_id,
            n_groups,
            self.memory.trainer_version,
            self.clock() + config.reservation_ttl_s,
            remaining=n_groups,
            external=external,
        )
        self._log(RESERVE, records.reserve_meta(ticket))
        return ticket

    def _check_external_reserve(self, n_groups: int) -> None:
        """Refuses an external Reserve larger than an external client can ever be granted: over the bounds that
        never change while the queue runs. Over the share of the pacing window it waits instead: that share
        follows tau, which SetMaxStaleness changes live (lowered, it refused for good a Reserve valid before)."""
        config = self.config
        bound = config.external.max_reserve_groups
        if n_groups > bound:
            raise InvalidRequest(
                f"n_groups={n_groups} is over external.max_reserve_groups={bound}, the most one Reserve on the "
                "external port may ask for"
            )
        limit = _share(config.external.reserved_share, config.capacity_groups)
        if n_groups > limit:
            raise InvalidRequest(
                f"n_groups={n_groups} can never be granted on the external port: external.reserved_share="
                f"{config.external.reserved_share:g} of capacity_groups={config.capacity_groups} allows the "
                f"external clients {limit} groups reserved at a time"
            )

    def release_reservation(self, ticket_id: str, owner: str | None = None) -> int:
        """Gives back a ticket's unused room. With ``owner`` (an authenticated client) only that
        producer's tickets are found: another client's ticket is as unknown as a made-up one."""
        check_id(ticket_id, "ticket_id")
        ticket = self.memory.tickets.get(ticket_id)
        if ticket is not None and owner is not None and ticket.producer_id != owner:
            raise NotFound(f"ticket {ticket_id!r} is unknown")
        if ticket is None:
            # (a ticket gone is known, to tell a retry it is done, only to its owner: to another client, or
            # with its owner not recorded, as unknown as a made-up one)
            if ticket_id in self.memory.outcomes and (
                owner is None or self.memory.ticket_owners.get(ticket_id) == owner
            ):
                return 0
            raise NotFound(f"ticket {ticket_id!r} is unknown")
        self._log(UNRESERVE, records.unreserve_meta(ticket_id, "released"))
        return ticket.remaining

    def release_producer(self, producer_id: str) -> tuple[int, int]:
        """Gives back every ticket ``producer_id`` holds (a restarted producer's predecessor's); returns
        (tickets, groups) released."""
        if not producer_id:
            raise InvalidRequest("producer_id must be set")
        check_id(producer_id, "producer_id")
        held = [t for t in self.memory.tickets.values() if t.producer_id == producer_id]
        for ticket in held:
            self._log(UNRESERVE, records.unreserve_meta(ticket.ticket_id, "released"))
        return len(held), sum(t.remaining for t in held)

    def put(self, group: GroupRecord, ticket_id: str = "", owner: str | None = None) -> tuple[bool, int]:
        """Accepts ``group``; returns (newly accepted, depth). A known group id is a no-op. With ``owner``
        (an authenticated client) a ticket of another producer is ignored, as an unknown one is."""
        memory, config = self.memory, self.config
        check_id(ticket_id, "ticket_id")
        self._excuse_a_pause()  # (a Put reads its ticket's expiry without a sweep)
        if group.group_id in memory.groups or group.group_id in memory.done_ids:
            return False, len(memory.pending)
        newest = max(group.behaviour_version, group.newest_version)
        if newest > memory.trainer_version:
            raise FailedPrecondition(
                f"group {group.group_id}: a sample claims policy version {newest} (behaviour_version or "
                f"token_versions), newer than the trainer's version {memory.trainer_version}: a group can only "
                "come from weights the trainer has published"
            )
        if group.size > config.capacity_bytes:
            raise GroupOverCapacity(
                f"group {group.group_id} is {group.size} bytes, larger than the queue's capacity of "
                f"{config.capacity_bytes} bytes: it can never fit"
            )
        ticket = memory.tickets.get(ticket_id) if ticket_id else None
        if ticket is not None and owner is not None and ticket.producer_id != owner:
            ticket = None
        if ticket is not None and ticket.expires_at <= self.clock():
            ticket = None  # an expired ticket's room was given back; the group comes in untickted
        own_room = 1 if ticket is not None and ticket.remaining > 0 else 0
        if len(memory.groups) + memory.in_flight - own_room + 1 > config.capacity_groups:
            raise QueueFull(
                f"queue is full: {len(memory.groups)} groups stored and {memory.in_flight} reserved "
                f"of capacity {config.capacity_groups}"
            )
        if memory.live_bytes + group.size > config.capacity_bytes:
            raise QueueFull(
                f"queue is full: {memory.live_bytes} bytes stored, group of {group.size} bytes "
                f"exceeds capacity {config.capacity_bytes}"
            )
        loose = owner is not None and not own_room  # an external client's group without a (usable) ticket
        if loose:
            self._check_external_loose_put(group)
        used_ticket = ticket.ticket_id if ticket is not None and own_room else ""
        meta = records.put_meta(group, self.clock(), used_ticket, 0)
        if loose:
            meta[EXTERNAL_LOOSE] = 1
        self._log(PUT, meta, group.payload)
        memory.groups[group.group_id].checked = True  # validated on its way in
        if loose:
            self._hold_loose(group.group_id, group.size)
        return True, len(memory.pending)

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
        memory = self.memory
        if max_groups == 0 and max_tokens == 0:
            raise InvalidRequest("set max_groups or max_tokens (both are 0)")
        if max_groups and min_groups > max_groups:
            raise InvalidRequest(f"min_groups={min_groups} is larger than max_groups={max_groups}")
        if max_tokens and min_groups > max_tokens:
            # (every group has at least one token, so no batch within max_tokens holds more than max_tokens groups:
            # such a long poll was woken by every Put and never served)
            raise InvalidRequest(
                f"min_groups={min_groups} can never be met within max_tokens={max_tokens}: every group has at "
                "least one token"
            )
        check_id(consumer_id, "consumer_id")
        self._check_lease_s(lease_s)
        if consumer_version is not None and consumer_version > MAX_VERSION:
            raise InvalidRequest(f"consumer_version={consumer_version} is above the largest version {MAX_VERSION}")
        if consumer_version is not None and consumer_version > memory.trainer_version:
            # Staleness against a version no trainer has reached would evict every waiting group (2^53 emptied
            # the queue). The trainer tells the queue its version before it asks for the step's batch.
            raise FailedPrecondition(
                f"consumer_version={consumer_version} is above the trainer's version {memory.trainer_version} "
                "known to the queue: SetTrainerVersion first"
            )
        self._sweep()
        version = memory.trainer_version if consumer_version is None else consumer_version
        stale: list[str] = []
        invalid: list[tuple[str, str]] = []
        batch: list[str] = []
        tokens = nbytes = 0
        cut_by_bytes = False
        for gid in memory.pending:
            group = memory.groups[gid]
            if staleness.too_stale(version, group.behaviour_version, self.max_staleness):
                stale.append(gid)
                continue
            if max_groups and len(batch) >= max_groups:
                break
            if not group.checked and self.validate is not None:
                reason = self.validate(group.payload)
                if reason is not None:
                    invalid.append((gid, reason))
                    continue
                group.checked = True
            if max_tokens and batch and tokens + group.n_tokens > max_tokens:
                break
            if max_bytes and batch and nbytes + group.size + overhead_bytes > max_bytes:
                cut_by_bytes = True
                break
            batch.append(gid)
            tokens += group.n_tokens
            nbytes += group.size + overhead_bytes
        if stale:
            self._log(EVICT, records.evict_meta(stale, "stale"))
        if invalid:
            self._quarantine(invalid)
        if not batch or (len(batch) < min_groups and not (cut_by_bytes and self._deliverable(min_groups, version))):
            return GetResult(None, [], len(stale), len(invalid))
        duration = lease_s or self.config.default_lease_s
        granted = Lease(uuid.uuid4().hex, batch, self.clock() + duration, consumer_id, version, duration)
        self._log(LEASE, records.lease_meta(granted))
        lease = memory.leases[granted.lease_id]
        deliveries = [
            Delivery(
                memory.groups[g],
                staleness.staleness(version, memory.groups[g].behaviour_version),
                memory.groups[g].deliveries - 1,
            )
            for g in batch
        ]
        return GetResult(lease, deliveries, len(stale), len(invalid), max_staleness=self.max_staleness)

    def _quarantine(self, invalid: list[tuple[str, str]]) -> None:
        """Sets aside stored groups that no consumer can decode, so that they never block a Get again."""
        for gid, reason in invalid:
            log.error("a stored group cannot be delivered: quarantined", extra={"group_id": gid, "why": reason})
            if self.quarantine is not None:
                self.quarantine(self.memory.groups[gid], reason)
        self._log(EVICT, records.evict_meta([gid for gid, _ in invalid], "invalid"))

    def _check_lease_s(self, lease_s: float) -> None:
        if not 0 <= lease_s <= self.config.max_lease_s:
            raise InvalidRequest(
                f"lease_duration={lease_s:g}s must be between 0 (the default of "
                f"{self.config.default_lease_s:g}s) and {self.config.max_lease_s:g}s"
            )

    def _deliverable(self, n: int, version: int) -> bool:
        """Whether at least ``n`` waiting groups are fresh enough for ``version``."""
        count = 0
        for gid in self.memory.pending:
            if not staleness.too_stale(version, self.memory.groups[gid].behaviour_version, self.max_staleness):
                count += 1
                if count >= n:
                    return True
        return False

    def ack(self, lease_id: str) -> int:
        check_id(lease_id, "lease_id")
        self._sweep()
        lease = self.memory.leases.get(lease_id)
        if lease is not None:
            self._log(ACK, records.ack_meta(lease_id))
            return len(lease.group_ids)
        outcome = self.memory.outcomes.get(lease_id)
        if outcome == "acked":
            return 0
        if outcome is not None:
            raise FailedPrecondition(
                f"lease {lease_id} was {outcome} before this ack; its groups went back to the queue"
            )
        raise NotFound(f"lease {lease_id!r} is unknown")

    def nack(self, lease_id: str) -> int:
        check_id(lease_id, "lease_id")
        self._sweep()
        lease = self.memory.leases.get(lease_id)
        if lease is not None:
            self._log(RELEASE, records.release_meta(lease_id, "nacked"))
            return len(lease.group_ids)
        outcome = self.memory.outcomes.get(lease_id)
        if outcome == "acked":
            raise FailedPrecondition(f"lease {lease_id} was already acked; its groups are gone")
        if outcome is not None:
            return 0
        raise NotFound(f"lease {lease_id!r} is unknown")

    def renew(self, lease_id: str, lease_s: float = 0.0) -> Lease:
        check_id(lease_id, "lease_id")
        self._check_lease_s(lease_s)
        self._sweep()
        lease = self.memory.leases.get(lease_id)
        if lease is None:
            outcome = self.memory.outcomes.get(lease_id)
            if outcome is not None:
                raise FailedPrecondition(f"lease {lease_id} is no longer held: it was {outcome}")
            raise NotFound(f"lease {lease_id!r} is unknown")
        duration = lease_s or self.config.default_lease_s
        self._log(RENEW, records.renew_meta(lease_id, self.clock() + duration, duration))
        return lease

    def set_trainer_version(self, version: int, rebase: bool = False) -> int:
        """The trainer's version. ``rebase``: a trainer (re)started from its checkpoint, which may be older; the
        leases still held are its predecessor's, and come back to the head of the queue now (what its checkpoint
        holds it skips and acks) instead of when they expire (``lease_s``: the run stalled that long)."""
        if not 0 <= version <= MAX_VERSION:
            raise InvalidRequest(f"policy_version={version} must be between 0 and {MAX_VERSION}")
        if version > self.memory.trainer_version or (rebase and version != self.memory.trainer_version):
            self._log(VERSION, records.version_meta(version, rebase))
        if rebase:
            for lease in reversed(list(self.memory.leases.values())):  # (the oldest ends up at the very head)
                self._log(RELEASE, records.release_meta(lease.lease_id, "rebased"))
        return self.memory.trainer_version

    def set_max_staleness(self, max_staleness: int) -> int:
        """Changes tau for deliveries and reservations from now on (not logged: config wins on restart)."""
        try:
            self.max_staleness = staleness.check_tau(max_staleness, largest=MAX_VERSION)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        self.changes += 1
        return max_staleness

    # -- time ------------------------------------------------------------------------------

    def sweep(self) -> SweepResult:
        """Returns expired leases to the head of the queue and releases expired tickets.

        A record the log refuses (a full disk) stops the sweep there: what was swept before it stays swept
        (each record is written, then applied), the lease or ticket it was for is left exactly as it was, and
        ``error`` says why; the next sweep tries again."""
        self._excuse_a_pause()
        now = self.clock()
        result = SweepResult()
        try:
            # Newest first, so that the oldest expired lease ends up at the very head.
            for lease in reversed([x for x in self.memory.leases.values() if x.deadline <= now]):
                self._log(RELEASE, records.release_meta(lease.lease_id, "expired"))
                result.expired_leases += 1
                result.expired_groups += len(lease.group_ids)
            for ticket in [t for t in self.memory.tickets.values() if t.expires_at <= now]:
                self._log(UNRESERVE, records.unreserve_meta(ticket.ticket_id, "expired"))
                result.expired_tickets += 1
        except WalWriteError as e:
            result.error = e
        return result

    def _excuse_a_pause(self) -> None:
        """Leases and tickets get back the time the process did not run (a gap past ``pause_after_s`` since the
        last sweep, on the monotonic clock) or the wall clock jumped forward: their holders could not renew
        meanwhile; a step back of the wall clock is taken off them (their time left is kept either way).
        A queue stopped 12 s with 4 s leases expired every lease the instant it ran again, ahead of the acks
        already waiting in its sockets: 74 trained groups were evicted as stale, 146 more generated for nothing.
        In memory only, as at a recovery (``_grant_recovered_leases``)."""
        ran, wall = time.monotonic(), self.clock()
        gap, wall_gap = ran - self._ran_at, wall - self._wall_at
        self._ran_at, self._wall_at = ran, wall
        if self.pause_after_s is None:
            return
        lost = gap if gap > self.pause_after_s else 0.0  # the process did not run
        step = wall_gap - gap
        if abs(step) > self.pause_after_s:
            # the wall clock (the deadlines' clock) was stepped: forward, the holders' time is given back;
            # back, it is taken back (else a lease whose holder is gone would last an hour past a step of an
            # hour back, twice that if the clock was then stepped forward again)
            lost += step
        if not lost:
            return
        for lease in self.memory.leases.values():
            lease.deadline += lost
        for ticket in self.memory.tickets.values():
            ticket.expires_at += lost
        log.warning(
            "the queue did not run for a while, or its clock was stepped: leases and tickets keep the time they had",
            extra={"lost_s": round(lost, 1), "leases": len(self.memory.leases), "tickets": len(self.memory.tickets)},
        )

    def _sweep(self) -> None:
        """The sweep before a call: a record the log refuses refuses the call (its own record would be too)."""
        result = self.sweep()
        if result.error is not None:
            raise result.error

    def next_deadline(self) -> float | None:
        deadlines = [x.deadline for x in self.memory.leases.values()]
        deadlines += [t.expires_at for t in self.memory.tickets.values()]
        return min(deadlines, default=None)

    # -- durability ------------------------------------------------------------------------

    def compaction_due(self, min_bytes: int) -> bool:
        if self.wal is None:
            return False
        dead = self.wal.size - self.memory.live_wal_bytes
        return dead >= min_bytes and dead >= self.memory.live_wal_bytes

    async def compact_in_background(self) -> None:
        """Rewrites the log as a snapshot of the live state while the state goes on changing
        (``WriteAheadLog.rewrite_in_background``): what changes meanwhile follows the snapshot in the new file."""
        assert self.wal is not None
        order, snapshot = self._compaction_records()
        before = self.wal.size
        sizes = await self.wal.rewrite_in_background(snapshot)
        for g, size in zip(order, sizes[1 : 1 + len(order)], strict=True):
            group = self.memory.groups.get(g)
            if group is not None:  # (acked or evicted meanwhile: its PUT in the new file is dead weight)
                group.wal_bytes = size
        # Live: the snapshot and each stored group's PUT (a group put meanwhile has the same size in both files).
        self.memory.live_wal_bytes = sizes[0] + sum(group.wal_bytes for group in self.memory.groups.values())
        log.info("compacted the log", extra={"bytes_before": before, "bytes_after": self.wal.size})

    def compact(self) -> None:
        """Rewrites the log as a snapshot of the live state (call ``wal.idle()`` first)."""
        assert self.wal is not None
        order, snapshot = self._compaction_records()
        before = self.wal.size
        sizes = self.wal.rewrite(snapshot)
        for g, size in zip(order, sizes[1 : 1 + len(order)], strict=True):
            self.memory.groups[g].wal_bytes = size
        # The snapshot is live too (records.apply counts it so at recovery): counted dead, it made the very next
        # change look due for compaction once it alone passed compact_min_bytes, and every Ack rewrote the log.
        self.memory.live_wal_bytes = sizes[0] + sum(sizes[1 : 1 + len(order)])
        log.info("compacted the log", extra={"bytes_before": before, "bytes_after": self.wal.size})

    def _compaction_records(self) -> tuple[list[str], list[Record]]:
        """``records.compaction_records``, each external group put without a ticket still marked so (its PUT
        in the new file says no ticket for every group): a restart after a compaction counts the same."""
        order, snapshot = records.compaction_records(self.memory)
        if self.external_loose:
            for kind, meta, _ in snapshot:
                if kind == PUT and meta[Key.GROUP_ID] in self.external_loose:
                    meta[EXTERNAL_LOOSE] = 1
        return order, snapshot

    def _log(self, kind: int, meta: Meta, blob: bytes = b"") -> None:
        size = self.wal.append(kind, meta, blob) if self.wal is not None else 0
        self._forget_loose(kind, meta)
        records.apply(self.memory, self.config, kind, meta, blob, size)
        self.changes += 1


def _share(share: float, n: int) -> int:
    """``share`` of ``n``, rounded down (0.5 of 16 is 8, not 7 by a rounding error), but at least 1."""
    return max(1, math.floor(share * n + 1e-9))
