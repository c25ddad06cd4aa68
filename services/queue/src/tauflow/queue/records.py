"""The write-ahead log's records: their kinds, their meta keys, and what each one does to the queue's memory.

Every change to the queue is one record (kind, JSON meta, blob): ``QueueState`` (state.py) appends it
to the log and then applies it with ``apply``, the one place the memory changes; recovery replays the
same records through the same ``apply``, so the state after a restart is the state before it.
Compaction rewrites the log as a SNAPSHOT record and the records that rebuild the live state
(``compaction_records``).

The meta keys are short because every record carries them, and fixed because old logs must still
open: a key is never renamed. ``Key`` names each one; this is the table of what each kind holds.

=========  ====  ==================  ===============================================================
kind       key   ``Key.``            meaning
=========  ====  ==================  ===============================================================
PUT        g     GROUP_ID            the group's id (the blob is its serialized Group)
           bv    BEHAVIOUR_VERSION   oldest policy version of its samples
           nt    N_TOKENS            prompt and completion tokens of all its samples
           at    ACCEPTED_AT         when Put accepted it (Unix seconds)
           tk    PUT_TICKET          the ticket whose room it used, "" if none
           d     DELIVERIES          times delivered before (0 but in compaction; absent: 0)
           cv    CONSUMER_VERSION    the version its last delivery was for, since the last rebase (compaction
                                     only; absent: none): ``_apply_evict`` gives its pacing room back or not
           xl    EXTERNAL_LOOSE      1: put by an external client without a ticket; counts against
                                     ``external.reserved_share`` while stored (absent: 0)
LEASE      l     LEASE_ID            the lease's id
           gs    GROUP_IDS           its groups, in delivery order
           dl    DEADLINE            when it expires (Unix seconds)
           ls    LEASE_S             its duration, granted anew at recovery (absent in format 1: 0)
           c     CONSUMER_ID         who holds it
           cv    CONSUMER_VERSION    the policy version it was delivered for
           re    RECOVERED           1 when written by compaction: not a new delivery (absent: 0)
RENEW      l     LEASE_ID
           dl    DEADLINE            the new deadline
           ls    LEASE_S             the new duration (absent: unchanged)
ACK        l     LEASE_ID            its groups are done
RELEASE    l     LEASE_ID            its groups go back to the head of the queue
           why   WHY                 "nacked", "expired" or "rebased" (its trainer restarted)
EVICT      gs    GROUP_IDS           groups taken out without delivery; each gives its pacing room back unless
                                     the step it was last delivered for has committed (``_apply_evict``)
           why   WHY                 "stale" or "invalid" (quarantined)
VERSION    v     VERSION             the trainer's policy version
           rb    REBASE              true: the trainer resumed from an older checkpoint (re-paces: ``apply``)
RESERVE    t     TICKET_ID           the ticket's id
           r     REQUEST_ID          the Reserve request id it answers (for idempotent retries)
           p     PRODUCER_ID         who reserved it
           n     REMAINING           groups it still holds room for
           mv    MIN_VERSION         the trainer's version when it was granted
           exp   EXPIRES_AT          when its room is released (Unix seconds)
           n0    N_GROUPS            groups it was granted, when compaction wrote it (absent: ``n``)
           x     EXTERNAL            1: reserved through the external port (absent: 0)
UNRESERVE  t     TICKET_ID
           why   WHY                 "released" or "expired"
SNAPSHOT   v     VERSION             the trainer's policy version
           acc   ACCEPTED            the pacing sum, less the groups whose PUT records follow
                                     (every group accepted, less those evicted before a step used them)
           ackd  ACKED               groups acked in the run
           ev    EVICTED             groups evicted, by reason
           exl   EXPIRED_LEASES      leases expired in the run
           done  DONE                ids of acked or evicted groups (for idempotent Put)
           out   OUTCOMES            lease or ticket id: "acked", "nacked", "expired", "released", "used"
           own   TICKET_OWNERS       ticket id of ``out``: its producer (absent: none known)
           res   RESERVATIONS        request id: the meta of the RESERVE record that answered it
=========  ====  ==================  ===============================================================
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tauflow.queue.config import QueueConfig
from tauflow.queue.model import GroupRecord, Lease, Ticket
from tauflow.queue.wal import Record

PUT, LEASE, ACK, RELEASE, EVICT, VERSION, RESERVE, UNRESERVE, RENEW, SNAPSHOT = range(1, 11)

OUTCOME_WINDOW = 100_000  # lease and ticket outcomes (and reservations) remembered for idempotent retries

Meta = dict[str, Any]


class Key:
    """The meta keys of the records (the table above)."""

    GROUP_ID = "g"
    BEHAVIOUR_VERSION = "bv"
    N_TOKENS = "nt"
    ACCEPTED_AT = "at"
    PUT_TICKET = "tk"
    DELIVERIES = "d"
    LEASE_ID = "l"
    GROUP_IDS = "gs"
    DEADLINE = "dl"
    LEASE_S = "ls"
    CONSUMER_ID = "c"
    CONSUMER_VERSION = "cv"
    RECOVERED = "re"
    WHY = "why"
    VERSION = "v"
    REBASE = "rb"
    TICKET_ID = "t"
    REQUEST_ID = "r"
    PRODUCER_ID = "p"
    REMAINING = "n"
    MIN_VERSION = "mv"
    EXPIRES_AT = "exp"
    N_GROUPS = "n0"
    EXTERNAL = "x"
    EXTERNAL_LOOSE = "xl"
    ACCEPTED = "acc"
    ACKED = "ackd"
    EVICTED = "ev"
    EXPIRED_LEASES = "exl"
    DONE = "done"
    OUTCOMES = "out"
    TICKET_OWNERS = "own"
    RESERVATIONS = "res"


@dataclass
class Memory:
    """Everything ``apply`` changes; kept apart so a snapshot is easy to write."""

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
    # Of ``in_flight``, what external clients' tickets hold: all of them, and each client's (its producer id).
    external_in_flight: int = 0
    external_held: dict[str, int] = field(default_factory=dict)
    done_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)  # acked or evicted groups
    outcomes: OrderedDict[str, str] = field(default_factory=OrderedDict)  # lease/ticket id -> outcome
    # ticket id -> producer, for the tickets of ``outcomes``: only its owner learns a ticket's outcome
    ticket_owners: OrderedDict[str, str] = field(default_factory=OrderedDict)
    reservations: OrderedDict[str, Meta] = field(default_factory=OrderedDict)  # request id -> RESERVE meta


# -- the metas, one builder per kind (key order as the log has always had it) ------------------------


def put_meta(
    group: GroupRecord, accepted_at: float, ticket_id: str, deliveries: int, delivered_for: int | None = None
) -> Meta:
    """``deliveries`` and ``delivered_for``: what compaction carries over (a new group: 0 and None)."""
    meta = {
        Key.GROUP_ID: group.group_id,
        Key.BEHAVIOUR_VERSION: group.behaviour_version,
        Key.N_TOKENS: group.n_tokens,
        Key.ACCEPTED_AT: accepted_at,
        Key.PUT_TICKET: ticket_id,
        Key.DELIVERIES: deliveries,
    }
    if delivered_for is not None:
        meta[Key.CONSUMER_VERSION] = delivered_for
    return meta


def lease_meta(lease: Lease, *, recovered: bool = False) -> Meta:
    meta = {
        Key.LEASE_ID: lease.lease_id,
        Key.GROUP_IDS: lease.group_ids,
        Key.DEADLINE: lease.deadline,
        Key.LEASE_S: lease.duration_s,
        Key.CONSUMER_ID: lease.consumer_id,
        Key.CONSUMER_VERSION: lease.consumer_version,
    }
    if recovered:
        meta[Key.RECOVERED] = 1
    return meta


def renew_meta(lease_id: str, deadline: float, duration_s: float) -> Meta:
    return {Key.LEASE_ID: lease_id, Key.DEADLINE: deadline, Key.LEASE_S: duration_s}


def ack_meta(lease_id: str) -> Meta:
    return {Key.LEASE_ID: lease_id}


def release_meta(lease_id: str, why: str) -> Meta:
    return {Key.LEASE_ID: lease_id, Key.WHY: why}


def evict_meta(group_ids: list[str], why: str) -> Meta:
    return {Key.GROUP_IDS: group_ids, Key.WHY: why}


def version_meta(version: int, rebase: bool) -> Meta:
    return {Key.VERSION: version, Key.REBASE: rebase}


def reserve_meta(ticket: Ticket, *, with_n_groups: bool = False) -> Meta:
    """``with_n_groups``: also the granted count (compaction, where ``remaining`` may be less)."""
    meta = {
        Key.TICKET_ID: ticket.ticket_id,
        Key.REQUEST_ID: ticket.request_id,
        Key.PRODUCER_ID: ticket.producer_id,
        Key.REMAINING: ticket.remaining,
        Key.MIN_VERSION: ticket.min_policy_version,
        Key.EXPIRES_AT: ticket.expires_at,
    }
    if with_n_groups:
        meta[Key.N_GROUPS] = ticket.n_groups
    if ticket.external:
        meta[Key.EXTERNAL] = 1
    return meta


def unreserve_meta(ticket_id: str, why: str) -> Meta:
    return {Key.TICKET_ID: ticket_id, Key.WHY: why}


def snapshot_meta(memory: Memory) -> Meta:
    return {
        Key.VERSION: memory.trainer_version,
        Key.ACCEPTED: memory.accepted - len(memory.groups),  # the PUT records that follow add the live groups back
        Key.ACKED: memory.acked_total,
        Key.EVICTED: memory.evicted,
        Key.EXPIRED_LEASES: memory.expired_leases,
        Key.DONE: list(memory.done_ids),
        Key.OUTCOMES: dict(memory.outcomes),
        Key.TICKET_OWNERS: dict(memory.ticket_owners),
        Key.RESERVATIONS: dict(memory.reservations),
    }


def ticket_from_meta(meta: Meta) -> Ticket:
    remaining: int = meta[Key.REMAINING]
    return Ticket(
        meta[Key.TICKET_ID],
        meta[Key.REQUEST_ID],
        meta[Key.PRODUCER_ID],
        meta.get(Key.N_GROUPS, remaining),
        meta[Key.MIN_VERSION],
        meta[Key.EXPIRES_AT],
        remaining,
        external=bool(meta.get(Key.EXTERNAL, 0)),
    )


def compaction_records(memory: Memory) -> tuple[list[str], list[Record]]:
    """The live state as records: a SNAPSHOT, a PUT per stored group (waiting ones first, in delivery
    order), then the leases and tickets. Also returns the group ids in the order of their PUTs."""
    order = list(memory.pending) + [g for lease in memory.leases.values() for g in lease.group_ids]
    records: list[Record] = [(SNAPSHOT, snapshot_meta(memory), b"")]
    for group_id in order:
        group = memory.groups[group_id]
        meta = put_meta(group, group.accepted_at, "", group.deliveries, group.delivered_for)
        records.append((PUT, meta, group.payload))
    records += [(LEASE, lease_meta(lease, recovered=True), b"") for lease in memory.leases.values()]
    records += [(RESERVE, reserve_meta(ticket, with_n_groups=True), b"") for ticket in memory.tickets.values()]
    return order, records


def still_applies(memory: Memory, kind: int, meta: Meta) -> bool:
    """Whether a record recovered after lost ones applies: a lost one may have made what it refers to."""
    if kind in (LEASE, EVICT):
        return all(g in memory.pending for g in meta[Key.GROUP_IDS])
    if kind in (ACK, RELEASE, RENEW):
        return meta[Key.LEASE_ID] in memory.leases
    if kind == UNRESERVE:
        return meta[Key.TICKET_ID] in memory.tickets
    return kind != PUT or meta[Key.GROUP_ID] not in memory.groups


def _bounded_put(d: OrderedDict[str, Any], key: str, value: Any, limit: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > limit:
        d.popitem(last=False)


# -- the one place state changes ---------------------------------------------------------------------


def apply(memory: Memory, config: QueueConfig, kind: int, meta: Meta, blob: bytes, size: int) -> None:
    """Applies one record of ``size`` bytes in the log (0 without a log) to ``memory``."""
    if kind == PUT:
        _apply_put(memory, meta, blob, size)
    elif kind == LEASE:
        lease = Lease(
            meta[Key.LEASE_ID],
            list(meta[Key.GROUP_IDS]),
            meta[Key.DEADLINE],
            meta[Key.CONSUMER_ID],
            meta[Key.CONSUMER_VERSION],
            meta.get(Key.LEASE_S, 0.0),
        )
        for g in lease.group_ids:
            del memory.pending[g]
            memory.pending_bytes -= memory.groups[g].size
            if not meta.get(Key.RECOVERED):  # (a compaction's PUT records carry both)
                memory.groups[g].deliveries += 1
                memory.groups[g].delivered_for = lease.consumer_version
        memory.leases[lease.lease_id] = lease
        memory.leased_groups += len(lease.group_ids)
    elif kind == RENEW:
        lease = memory.leases[meta[Key.LEASE_ID]]
        lease.deadline, lease.duration_s = meta[Key.DEADLINE], meta.get(Key.LEASE_S, lease.duration_s)
    elif kind == ACK:
        lease = memory.leases.pop(meta[Key.LEASE_ID])
        memory.leased_groups -= len(lease.group_ids)
        for g in lease.group_ids:
            group = memory.groups.pop(g)
            memory.live_bytes -= group.size
            memory.live_wal_bytes -= group.wal_bytes
            _bounded_put(memory.done_ids, g, None, config.dedup_window)
        memory.acked_total += len(lease.group_ids)
        _bounded_put(memory.outcomes, lease.lease_id, "acked", OUTCOME_WINDOW)
    elif kind == RELEASE:
        lease = memory.leases.pop(meta[Key.LEASE_ID])
        memory.leased_groups -= len(lease.group_ids)
        for g in reversed(lease.group_ids):  # back to the head, in their original order
            memory.pending[g] = None
            memory.pending.move_to_end(g, last=False)
            memory.pending_bytes += memory.groups[g].size
        if meta[Key.WHY] == "expired":
            memory.expired_leases += 1
        _bounded_put(memory.outcomes, lease.lease_id, meta[Key.WHY], OUTCOME_WINDOW)
    elif kind == EVICT:
        _apply_evict(memory, config, meta)
    elif kind == VERSION:
        memory.trainer_version = meta[Key.VERSION]
        if meta[Key.REBASE]:
            # A trainer resumed from an older checkpoint: pace as if every step so far
            # consumed one batch, plus what is stored now. So every stored group counts as not yet
            # used by a step (its deliveries were to steps the checkpoint does not hold): evicted, it
            # gives its room back.
            memory.accepted = memory.trainer_version * config.groups_per_step + len(memory.groups)
            for group in memory.groups.values():
                group.delivered_for = None
    elif kind == RESERVE:
        ticket = ticket_from_meta(meta)
        memory.tickets[ticket.ticket_id] = ticket
        memory.in_flight += ticket.remaining
        _hold_external(memory, ticket, ticket.remaining)
        _bounded_put(memory.reservations, ticket.request_id, meta, OUTCOME_WINDOW)
    elif kind == UNRESERVE:
        ticket = memory.tickets.pop(meta[Key.TICKET_ID])
        memory.in_flight -= ticket.remaining
        _hold_external(memory, ticket, -ticket.remaining)
        _ticket_outcome(memory, ticket, meta[Key.WHY])
    elif kind == SNAPSHOT:
        # Live: a compaction writes it again (at least as large), so it is no dead weight to compact away. Not
        # counted, it made every later change look due for compaction once it alone passed compact_min_bytes.
        memory.live_wal_bytes += size
        memory.trainer_version = meta[Key.VERSION]
        memory.accepted = meta[Key.ACCEPTED]
        memory.acked_total = meta[Key.ACKED]
        memory.evicted = dict(meta[Key.EVICTED])
        memory.expired_leases = meta[Key.EXPIRED_LEASES]
        memory.done_ids = OrderedDict.fromkeys(meta[Key.DONE])
        memory.outcomes = OrderedDict(meta[Key.OUTCOMES])
        memory.ticket_owners = OrderedDict(meta.get(Key.TICKET_OWNERS, {}))
        memory.reservations = OrderedDict(meta[Key.RESERVATIONS])
    else:
        raise ValueError(f"unknown log record kind {kind}")


def _apply_put(memory: Memory, meta: Meta, blob: bytes, size: int) -> None:
    group = GroupRecord(
        meta[Key.GROUP_ID],
        blob,
        meta[Key.BEHAVIOUR_VERSION],
        meta[Key.N_TOKENS],
        meta[Key.ACCEPTED_AT],
        meta.get(Key.DELIVERIES, 0),
        delivered_for=meta.get(Key.CONSUMER_VERSION),
        wal_bytes=size,
    )
    memory.groups[group.group_id] = group
    memory.pending[group.group_id] = None
    memory.pending_bytes += group.size
    memory.live_bytes += group.size
    memory.live_wal_bytes += size
    memory.accepted += 1
    ticket = memory.tickets.get(meta[Key.PUT_TICKET]) if meta[Key.PUT_TICKET] else None
    if ticket is not None and ticket.remaining > 0:
        ticket.remaining -= 1
        memory.in_flight -= 1
        _hold_external(memory, ticket, -1)
        if ticket.remaining == 0:
            del memory.tickets[ticket.ticket_id]
            _ticket_outcome(memory, ticket, "used")


def _hold_external(memory: Memory, ticket: Ticket, groups: int) -> None:
    """Counts ``groups`` more (or fewer) reserved groups held by an external client's ticket."""
    if not ticket.external:
        return
    memory.external_in_flight += groups
    held = memory.external_held.get(ticket.producer_id, 0) + groups
    if held:
        memory.external_held[ticket.producer_id] = held
    else:
        memory.external_held.pop(ticket.producer_id, None)


def _ticket_outcome(memory: Memory, ticket: Ticket, outcome: str) -> None:
    _bounded_put(memory.outcomes, ticket.ticket_id, outcome, OUTCOME_WINDOW)
    _bounded_put(memory.ticket_owners, ticket.ticket_id, ticket.producer_id, OUTCOME_WINDOW)


def used_by_a_step(memory: Memory, group: GroupRecord) -> bool:
    """Whether ``group`` has used up its pacing room: it was delivered (since the last rebase) for a version
    the trainer has since passed, so the step it was delivered for has committed (the trainer tells the queue
    its new version only after the step). Such a group is part of ``trainer_version * groups_per_step``, the
    groups the steps so far consumed: back in the queue only because its lease expired or was nacked before the
    ack (a trainer killed after its checkpoint, stopped past its lease, or resumed), it must not give its room
    back when evicted, or the pacing sum falls short by one for the rest of the run and the rollout makes a group
    more each step that only ages past tau and is evicted in turn (found by fault injection: 8 such groups, then
    1,336 groups evicted as stale over 400 steps). A group delivered for the trainer's current version (nacked,
    or its trainer gone before the step committed) has used nothing: evicted (tau lowered), it gives its room
    back, or the rollout could be held below a step's batch for good."""
    return group.delivered_for is not None and group.delivered_for < memory.trainer_version


def _apply_evict(memory: Memory, config: QueueConfig, meta: Meta) -> None:
    group_ids, why = meta[Key.GROUP_IDS], meta[Key.WHY]
    room_back = 0  # groups no step has used: their pacing room comes back
    for g in group_ids:
        del memory.pending[g]
        group = memory.groups.pop(g)
        memory.pending_bytes -= group.size
        memory.live_bytes -= group.size
        memory.live_wal_bytes -= group.wal_bytes
        _bounded_put(memory.done_ids, g, None, config.dedup_window)
        if not used_by_a_step(memory, group):
            room_back += 1
    memory.accepted -= room_back
    memory.evicted[why] = memory.evicted.get(why, 0) + len(group_ids)
