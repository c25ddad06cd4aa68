"""QueueState without gRPC: pacing, puts, gets, leases, stale eviction and durability.

Time is a fake clock (``t[0]``); durability tests use a real WriteAheadLog under tmp_path.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tauflow.queue.config import QueueConfig
from tauflow.queue.model import (
    ClientLimit,
    FailedPrecondition,
    GroupOverCapacity,
    GroupRecord,
    InvalidRequest,
    NotFound,
    QueueFull,
)
from tauflow.queue.state import QueueState
from tauflow.queue.wal import FsyncPolicy, WalCorrupt, WriteAheadLog


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = [start]

    def __call__(self) -> float:
        return self.t[0]

    def advance(self, dt: float) -> None:
        self.t[0] += dt


def rec(gid: str, bv: int = 0, n_tokens: int = 10, size: int = 16) -> GroupRecord:
    payload = (gid.encode() + b":" + b"x" * size)[:size] if size >= len(gid) + 1 else b"x" * size
    return GroupRecord(gid, payload, bv, n_tokens)


def make(clock: Clock | None = None, wal: WriteAheadLog | None = None, **kw: Any) -> tuple[QueueState, Clock]:
    clock = clock or Clock()
    kw.setdefault("default_lease_s", 10.0)
    kw.setdefault("reservation_ttl_s", 20.0)
    return QueueState(QueueConfig(**kw), wal, clock=clock), clock


def pending(q: QueueState) -> list[str]:
    return list(q.memory.pending)


def fingerprint(q: QueueState) -> dict[str, Any]:
    """Everything observable about the state (and the bookkeeping that pacing/dedup depend on)."""
    m = q.memory
    return {
        "stats": q.stats(),
        "pending": list(m.pending),
        "groups": {
            g: (r.payload, r.behaviour_version, r.n_tokens, r.accepted_at, r.deliveries, r.delivered_for)
            for g, r in m.groups.items()
        },
        "leases": {
            lid: (x.group_ids, x.deadline, x.duration_s, x.consumer_id, x.consumer_version)
            for lid, x in m.leases.items()
        },
        "tickets": {
            tid: (t.request_id, t.producer_id, t.n_groups, t.remaining, t.min_policy_version, t.expires_at, t.external)
            for tid, t in m.tickets.items()
        },
        "in_flight": m.in_flight,
        "external": (m.external_in_flight, dict(m.external_held)),
        "accepted": m.accepted,
        "pending_bytes": m.pending_bytes,
        "live_bytes": m.live_bytes,
        "live_wal_bytes": m.live_wal_bytes,
        "done_ids": list(m.done_ids),
        "outcomes": dict(m.outcomes),
        "ticket_owners": dict(m.ticket_owners),
        "reservations": sorted(m.reservations),
        "next_deadline": q.next_deadline(),
    }


def recovered(before: dict[str, Any], now: float) -> dict[str, Any]:
    """What ``before`` becomes once recovered at ``now``: each held lease gets its duration anew (a deadline
    of at least now + its duration); everything else is exactly as it was."""
    leases = {
        lid: (gids, max(deadline, now + duration), duration, *rest)
        for lid, (gids, deadline, duration, *rest) in before["leases"].items()
    }
    deadlines = [x[1] for x in leases.values()] + [t[5] for t in before["tickets"].values()]
    return {**before, "leases": leases, "next_deadline": min(deadlines, default=None)}


def open_wal(path: Path) -> WriteAheadLog:
    return WriteAheadLog(path, FsyncPolicy.NEVER)


def restart(q: QueueState, path: Path, clock: Clock) -> QueueState:
    assert q.wal is not None
    q.wal.close()
    return QueueState(q.config, open_wal(path), clock=clock)


# =========================================================================================
# Pacing: Reserve
# =========================================================================================


def test_capacity_rule_grants_up_to_the_exact_boundary() -> None:
    q, _ = make(max_staleness=1, groups_per_step=4)  # limit (0 + 1 + 1) * 4 = 8
    assert q.pacing_limit() == 8
    a = q.reserve("r1", "p", 5)
    assert a is not None and a.n_groups == 5 and a.min_policy_version == 0
    assert q.reserve("r2", "p", 4) is None  # 5 + 4 > 8
    b = q.reserve("r3", "p", 3)  # 5 + 3 == 8: granted
    assert b is not None
    assert q.stats().reserved_groups == 8
    assert q.reserve("r4", "p", 1) is None


def test_capacity_rule_counts_accepted_groups_even_after_ack() -> None:
    q, _ = make(max_staleness=0, groups_per_step=2)  # limit (v + 1) * 2
    t = q.reserve("r1", "p", 2)
    assert t is not None
    for i in range(2):
        assert q.put(rec(f"g{i}"), t.ticket_id)[0]
    s = q.stats()
    assert (s.accepted_groups, s.reserved_groups) == (2, 0)
    assert q.reserve("r2", "p", 1) is None  # accepted 2 + 1 > 2
    lease = q.get("c", max_groups=2).lease
    assert lease is not None
    q.ack(lease.lease_id)
    assert q.reserve("r3", "p", 1) is None  # acked groups still count as accepted
    q.set_trainer_version(1)
    assert q.pacing_limit() == 4
    t2 = q.reserve("r4", "p", 2)
    assert t2 is not None and t2.min_policy_version == 1
    assert q.reserve("r5", "p", 1) is None


def test_unticketed_puts_count_toward_pacing() -> None:
    q, _ = make(max_staleness=1, groups_per_step=2)  # limit 4
    for i in range(3):
        q.put(rec(f"x{i}"))
    assert q.reserve("r1", "p", 2) is None  # 3 + 2 > 4
    assert q.reserve("r2", "p", 1) is not None


def test_stale_eviction_gives_pacing_room_back() -> None:
    q, _ = make(max_staleness=0, groups_per_step=4)
    for i in range(4):
        q.put(rec(f"old{i}", bv=0))
    assert q.reserve("r1", "p", 1) is None
    q.set_trainer_version(1)  # limit 8
    for i in range(3):
        q.put(rec(f"new{i}", bv=1))
    assert q.reserve("r2", "p", 2) is None  # 7 + 2 > 8
    res = q.get("c", max_groups=1)
    assert res.evicted_stale == 4 and [d.group.group_id for d in res.deliveries] == ["new0"]
    assert q.stats().accepted_groups == 3
    assert q.reserve("r3", "p", 4) is not None  # 3 + 4 <= 8
    assert q.reserve("r4", "p", 2) is None  # 3 + 4 + 2 > 8


def test_capacity_groups_limits_reserve_too() -> None:
    q, _ = make(max_staleness=5, groups_per_step=10, capacity_groups=5)
    q.put(rec("a"))
    q.put(rec("b"))
    assert q.reserve("r1", "p", 4) is None  # 2 stored + 4 > 5
    assert q.reserve("r2", "p", 3) is not None


def test_unbounded_tau_uses_capacity_only() -> None:
    q, _ = make(max_staleness=-1, groups_per_step=2, capacity_groups=10)
    assert q.pacing_limit() is None
    assert q.reserve("r1", "p", 7) is not None  # far beyond (v + tau + 1) * gps for any small tau
    assert q.reserve("r2", "p", 4) is None
    assert q.reserve("r3", "p", 3) is not None
    assert q.reserve("r4", "p", 1) is None
    with pytest.raises(InvalidRequest):
        q.reserve("r5", "p", 11)


def test_unbounded_tau_never_evicts() -> None:
    q, _ = make(max_staleness=-1)
    q.put(rec("a", bv=0))
    q.set_trainer_version(100)
    res = q.get("c", max_groups=5)
    assert res.evicted_stale == 0
    assert [(d.group.group_id, d.staleness) for d in res.deliveries] == [("a", 100)]


def test_reserve_is_idempotent_by_request_id() -> None:
    q, c = make(max_staleness=0, groups_per_step=4)
    t1 = q.reserve("req", "p", 3)
    assert t1 is not None
    t2 = q.reserve("req", "p", 3)  # no room for 3 more, but it is the same request
    assert t2 is not None and t2.ticket_id == t1.ticket_id and t2.expires_at == t1.expires_at
    assert q.stats().reserved_groups == 3
    q.set_trainer_version(2)
    c.advance(1)
    t3 = q.reserve("req", "p", 3)
    assert t3 is not None and (t3.ticket_id, t3.min_policy_version) == (t1.ticket_id, 0)
    assert q.stats().reserved_groups == 3


@pytest.mark.parametrize(
    ("request_id", "n"),
    [("", 1), ("r", 0), ("r", -1), ("r", 9)],  # (tau + 1) * gps = 8 is the most ever grantable
)
def test_invalid_reserve(request_id: str, n: int) -> None:
    q, _ = make(max_staleness=1, groups_per_step=4)
    with pytest.raises(InvalidRequest):
        q.reserve(request_id, "p", n)
    assert q.stats().reserved_groups == 0


def test_reserve_larger_than_capacity_is_invalid() -> None:
    q, _ = make(max_staleness=10, groups_per_step=10, capacity_groups=5)
    with pytest.raises(InvalidRequest):
        q.reserve("r", "p", 6)


def test_ticket_expiry_releases_room() -> None:
    q, c = make(max_staleness=0, groups_per_step=3, reservation_ttl_s=20.0)
    t = q.reserve("r1", "p", 3)
    assert t is not None and t.expires_at == c() + 20.0
    assert q.reserve("r2", "p", 1) is None
    c.advance(19.9)
    assert q.reserve("r3", "p", 1) is None
    c.advance(0.1)  # expires_at <= now: expired
    t2 = q.reserve("r4", "p", 3)
    assert t2 is not None
    assert q.stats().reserved_groups == 3
    assert q.release_reservation(t.ticket_id) == 0  # known outcome: idempotent


def test_sweep_reports_expired_tickets() -> None:
    q, c = make(reservation_ttl_s=5.0)
    q.reserve("r1", "p", 2)
    assert q.next_deadline() == c() + 5.0
    c.advance(5.0)
    res = q.sweep()
    assert res.expired_tickets == 1
    assert q.stats().reserved_groups == 0
    assert q.next_deadline() is None


def test_release_reservation() -> None:
    q, _ = make(max_staleness=0, groups_per_step=3)
    t = q.reserve("r1", "p", 3)
    assert t is not None
    q.put(rec("a"), t.ticket_id)
    assert q.stats().reserved_groups == 2
    assert q.release_reservation(t.ticket_id) == 2
    assert q.stats().reserved_groups == 0
    assert q.release_reservation(t.ticket_id) == 0
    assert q.reserve("r2", "p", 2) is not None  # 1 accepted + 2
    with pytest.raises(NotFound):
        q.release_reservation("no-such-ticket")


def test_only_its_owner_learns_that_a_ticket_is_gone(tmp_path: Path) -> None:
    """With an owner (a client of the external port), another producer's released, expired or used-up
    ticket is NOT_FOUND, as a made-up one is: answering it OK would tell that it existed. Its owner's retry
    gets 0 groups; so does the internal port (no owner). Across a restart and a compaction."""
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=-1, reservation_ttl_s=5.0)
    released, used, expired = (q.reserve(f"r{i}", "alice", 1) for i in range(3))
    assert released and used and expired
    assert q.release_reservation(released.ticket_id, "alice") == 1
    q.put(rec("a"), used.ticket_id, "alice")
    c.advance(5.0)
    q.sweep()
    for check in ("live", "restarted", "compacted"):
        for ticket in (released, used, expired):
            with pytest.raises(NotFound):
                q.release_reservation(ticket.ticket_id, "bob")
            assert q.release_reservation(ticket.ticket_id, "alice") == 0, check
            assert q.release_reservation(ticket.ticket_id) == 0, check
        if check == "restarted":
            q.compact()
        q = restart(q, path, c)


def test_a_restarted_producer_releases_its_predecessors_tickets(tmp_path: Path) -> None:
    """The tickets of a SIGKILLed producer hold pacing room until their TTL; its successor (same producer id)
    gives them back at once, and only its own: another producer's ticket stays. Durable across a restart."""
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=2)
    mine = [q.reserve("r1", "rollout-0", 2), q.reserve("r2", "rollout-0", 1)]
    theirs = q.reserve("r3", "agent", 1)
    assert all(mine) and theirs is not None
    q.put(rec("a"), mine[0].ticket_id)
    assert q.reserve("r4", "rollout-0", 1) is None  # the pacing limit: (0 + 1 + 1) * 2 = 4 groups
    assert q.release_producer("rollout-0") == (2, 2)  # 1 + 1 unused groups, two tickets
    assert set(q.memory.tickets) == {theirs.ticket_id}
    assert q.release_producer("rollout-0") == (0, 0)  # idempotent
    assert q.reserve("r5", "rollout-0", 2) is not None  # the room is back
    with pytest.raises(InvalidRequest, match="producer_id must be set"):
        q.release_producer("")
    with pytest.raises(InvalidRequest, match="producer_id"):
        q.release_producer("p" * 10_000)
    before = fingerprint(q)
    assert fingerprint(restart(q, path, c)) == recovered(before, c())


# -- external clients (the external port): bounded, so that tauflow's own producers keep their room ----------


def test_external_clients_together_hold_at_most_their_share_of_the_pacing_window() -> None:
    """One external client held all 16 tickets of the window, for the ticket TTL and renewable: the run's own
    rollout got granted=False. External clients now share external.reserved_share (0.5) of it."""
    q, _ = make(max_staleness=1, groups_per_step=8)  # a window of (1 + 1) x 8 = 16 groups
    assert all(q.reserve(f"a/r{i}", "a", 1, external=True) for i in range(8))
    assert q.reserve("a/r8", "a", 1, external=True) is None  # no room for it now (it waits, as a Reserve does)
    assert q.reserve("b/r0", "b", 1, external=True) is None  # the share is all external clients'
    assert q.reserve("rollout-0/1", "rollout-0", 8) is not None  # tauflow's rollout keeps its half
    assert q.reserve("a/big", "a", 9, external=True) is None  # over the share at this tau: it waits (tau may rise)
    assert q.stats().reserved_groups == 16


def test_a_window_of_one_group_leaves_the_external_clients_one_group() -> None:
    """tau = 0 and groups_per_step = 1: 0.5 of a window of one group rounded down to 0, and every external
    Reserve was INVALID_ARGUMENT ("allows the external clients 0 groups")."""
    q, _ = make(max_staleness=0, groups_per_step=1)
    assert q.external_limit() == 1
    ticket = q.reserve("a/r0", "a", 1, external=True)
    assert ticket is not None and ticket.n_groups == 1
    assert q.reserve("b/r0", "b", 1, external=True) is None  # the share is held: it waits
    q, _ = make(max_staleness=-1, capacity_groups=1)  # 0.5 of a capacity of one group: one group too
    assert q.external_limit() == 1 and q.reserve("a/r0", "a", 1, external=True) is not None


def test_an_external_reserve_over_the_share_waits_for_tau_to_rise_not_refused_for_good() -> None:
    """The external clients' share of the pacing window follows tau, which SetMaxStaleness changes live: lowered,
    it made a previously valid n_groups INVALID_ARGUMENT (its retries too), although raising tau again grants it."""
    q, _ = make(max_staleness=1, groups_per_step=4)  # a window of 8 groups: 4 for the external clients
    first = q.reserve("a/r0", "a", 4, external=True)
    assert first is not None
    q.set_max_staleness(0)  # a window of 4: 2 for the external clients
    assert q.external_limit() == 2
    assert q.reserve("a/r0", "a", 4, external=True) == first  # a retry is still answered with its ticket
    q.release_reservation(first.ticket_id)
    assert q.reserve("a/r1", "a", 4, external=True) is None  # not granted now: it waits as any Reserve does
    assert q.reserve("a/r2", "a", 5, external=True) is None  # over the whole window too (internally: invalid)
    q.set_max_staleness(1)
    assert q.reserve("a/r1", "a", 4, external=True) is not None
    with pytest.raises(InvalidRequest, match=r"n_groups=9 can never be granted: max_staleness=1 .* at most 8 groups"):
        q.reserve("rollout-0/r0", "rollout-0", 9)  # (tauflow's own producers: as before)


def test_an_external_client_is_bounded_per_reserve_and_in_what_it_holds() -> None:
    """tau = -1: one external Reserve(n_groups=100,000) took the whole capacity, and every other Put was
    RESOURCE_EXHAUSTED ("0 groups stored and 100000 reserved")."""
    q, _ = make(max_staleness=-1, capacity_groups=100_000)
    with pytest.raises(InvalidRequest, match=r"n_groups=100000 is over external.max_reserve_groups=64"):
        q.reserve("a/hog", "a", 100_000, external=True)
    tickets = [q.reserve(f"a/r{i}", "a", 64, external=True) for i in range(4)]
    assert all(tickets)
    with pytest.raises(ClientLimit, match=r"'a' holds 256 reserved groups .* external.max_reserved_groups=256"):
        q.reserve("a/r4", "a", 1, external=True)
    assert q.reserve("a/r0", "a", 64, external=True) == tickets[0]  # a retry is still answered with its ticket
    assert q.reserve("b/r0", "b", 64, external=True) is not None  # another client's bound is its own
    assert q.put(rec("a/g0"), tickets[0].ticket_id, owner="a")[0]  # a group put frees room of its client
    assert q.reserve("a/r5", "a", 1, external=True) is not None
    assert q.put(rec("rollout-0/g0"))[0]  # tauflow's own groups still come in
    assert q.reserve("rollout-0/r0", "rollout-0", 100_000 - 2 - 320) is not None  # and its Reserves
    assert q.memory.external_held == {"a": 256, "b": 64}


def test_external_clients_together_hold_at_most_their_share_of_the_capacity() -> None:
    q, _ = make(max_staleness=-1, capacity_groups=100, external={"max_reserve_groups": 100, "reserved_share": 0.3})
    assert q.reserve("a/r0", "a", 30, external=True) is not None
    assert q.reserve("b/r0", "b", 1, external=True) is None
    with pytest.raises(
        InvalidRequest,
        match=r"external.reserved_share=0.3 of capacity_groups=100 allows the external clients 30 groups",
    ):
        q.reserve("b/r1", "b", 31, external=True)
    for i in range(70):
        assert q.put(rec(f"g{i}"))[0]


def test_what_external_clients_hold_survives_a_restart_and_a_compaction(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=8)
    ticket = q.reserve("a/r0", "a", 4, external=True)
    assert ticket is not None and q.reserve("rollout-0/r0", "rollout-0", 2) is not None
    q.put(rec("a/g0"), ticket.ticket_id, owner="a")
    assert (q.memory.in_flight, q.memory.external_in_flight, q.memory.external_held) == (5, 3, {"a": 3})
    before = fingerprint(q)
    q = restart(q, path, c)
    assert fingerprint(q) == recovered(before, c())
    q.compact()
    q = restart(q, path, c)
    assert {**fingerprint(q), "stats": None, "live_wal_bytes": None} == {
        **recovered(before, c()),
        "stats": None,
        "live_wal_bytes": None,
    }
    assert q.release_reservation(ticket.ticket_id, "a") == 3
    assert (q.memory.in_flight, q.memory.external_in_flight, q.memory.external_held) == (2, 0, {})


def test_ticketed_put_uses_the_ticket() -> None:
    q, _ = make(max_staleness=0, groups_per_step=2)
    t = q.reserve("r1", "p", 2)
    assert t is not None
    q.put(rec("a"), t.ticket_id)
    s = q.stats()
    assert (s.accepted_groups, s.reserved_groups) == (1, 1)
    q.put(rec("b"), t.ticket_id)
    s = q.stats()
    assert (s.accepted_groups, s.reserved_groups) == (2, 0)
    assert t.ticket_id not in q.memory.tickets
    assert q.release_reservation(t.ticket_id) == 0
    q.put(rec("c"), t.ticket_id)  # a used-up ticket: comes in untickted, reserved stays 0
    s = q.stats()
    assert (s.accepted_groups, s.reserved_groups) == (3, 0)


def test_put_on_expired_ticket_does_not_double_count() -> None:
    q, c = make(max_staleness=0, groups_per_step=2, reservation_ttl_s=5.0)
    t = q.reserve("r1", "p", 2)
    assert t is not None
    c.advance(6.0)
    assert q.put(rec("late"), t.ticket_id)[0]
    q.sweep()
    s = q.stats()
    assert (s.accepted_groups, s.reserved_groups) == (1, 0)


# =========================================================================================
# Put
# =========================================================================================


def test_put_is_idempotent_by_group_id() -> None:
    q, _ = make()
    assert q.put(rec("a")) == (True, 1)
    assert q.put(rec("a", bv=5)) == (False, 1)
    assert q.stats().accepted_groups == 1
    assert q.memory.groups["a"].behaviour_version == 0  # the first copy stays


def test_put_duplicate_while_leased_and_after_ack() -> None:
    q, _ = make()
    q.put(rec("a"))
    lease = q.get("c", max_groups=1).lease
    assert lease is not None
    assert q.put(rec("a")) == (False, 0)
    q.ack(lease.lease_id)
    assert q.put(rec("a")) == (False, 0)
    s = q.stats()
    assert (s.accepted_groups, s.depth_groups, s.acked_groups) == (1, 0, 1)


def test_put_duplicate_after_stale_eviction() -> None:
    q, _ = make(max_staleness=0)
    q.put(rec("a", bv=0))
    q.set_trainer_version(1)
    assert q.get("c", max_groups=1).evicted_stale == 1
    assert q.put(rec("a", bv=1)) == (False, 0)
    assert q.stats().accepted_groups == 0
    assert q.get("c", max_groups=1).lease is None


def test_queue_full_by_groups() -> None:
    q, _ = make(max_staleness=-1, capacity_groups=3)
    for g in "abc":
        q.put(rec(g))
    with pytest.raises(QueueFull, match="full"):
        q.put(rec("d"))
    assert q.stats().accepted_groups == 3 and "d" not in q.memory.groups
    lease = q.get("c", max_groups=1).lease
    assert lease is not None
    with pytest.raises(QueueFull):  # a leased group still takes room
        q.put(rec("d"))
    q.ack(lease.lease_id)
    assert q.put(rec("d"))[0]


def test_queue_full_by_bytes() -> None:
    q, _ = make(max_staleness=-1, capacity_bytes=100)
    q.put(rec("a", size=40))
    q.put(rec("b", size=40))
    with pytest.raises(QueueFull, match="bytes"):
        q.put(rec("c", size=40))
    assert q.put(rec("c", size=20))[0]  # exactly 100 bytes fits
    assert q.stats().depth_bytes == 100
    lease = q.get("c", max_groups=1).lease
    assert lease is not None and q.stats().depth_bytes == 60
    with pytest.raises(QueueFull):  # leased bytes are still stored
        q.put(rec("d", size=1))
    q.ack(lease.lease_id)
    assert q.put(rec("d", size=40))[0]


def test_a_group_larger_than_the_byte_capacity_can_never_fit() -> None:
    q, _ = make(max_staleness=-1, capacity_bytes=100)
    with pytest.raises(GroupOverCapacity, match="can never fit"):
        q.put(rec("huge", size=101))  # even into an empty queue
    assert q.stats().accepted_groups == 0
    q.put(rec("a", size=60))
    with pytest.raises(QueueFull) as full:
        q.put(rec("b", size=60))
    assert not isinstance(full.value, GroupOverCapacity)  # this one fits once "a" is gone


def test_reserved_room_is_respected_for_unticketed_puts() -> None:
    q, _ = make(max_staleness=-1, capacity_groups=4)
    t = q.reserve("r1", "p", 3)
    assert t is not None
    assert q.put(rec("ext1"))[0]
    with pytest.raises(QueueFull):
        q.put(rec("ext2"))  # 1 stored + 3 reserved + 1 > 4
    for g in ("t1", "t2", "t3"):  # the ticket's own room is there
        assert q.put(rec(g), t.ticket_id)[0]
    s = q.stats()
    assert (s.depth_groups, s.reserved_groups) == (4, 0)
    with pytest.raises(QueueFull):
        q.put(rec("t4"), t.ticket_id)


# =========================================================================================
# Get
# =========================================================================================


def test_get_by_max_groups_in_fifo_order() -> None:
    q, c = make()
    for g in "abcde":
        q.put(rec(g))
    res = q.get("c1", max_groups=2)
    assert res.lease is not None
    assert [d.group.group_id for d in res.deliveries] == ["a", "b"] == res.lease.group_ids
    assert res.lease.consumer_id == "c1" and res.lease.deadline == c() + 10.0
    assert [(d.staleness, d.redeliveries) for d in res.deliveries] == [(0, 0), (0, 0)]
    assert pending(q) == ["c", "d", "e"]
    s = q.stats()
    assert (s.depth_groups, s.leased_groups, s.depth_bytes) == (3, 2, 48)
    res2 = q.get("c2", max_groups=10, lease_s=3.0)
    assert res2.lease is not None and res2.lease.group_ids == ["c", "d", "e"]
    assert res2.lease.deadline == c() + 3.0
    assert q.get("c3", max_groups=1).lease is None


def test_get_min_groups_not_met_gives_no_lease() -> None:
    q, _ = make()
    q.put(rec("a"))
    q.put(rec("b"))
    res = q.get("c", max_groups=4, min_groups=3)
    assert res.lease is None and res.deliveries == []
    assert pending(q) == ["a", "b"] and q.stats().leased_groups == 0
    res = q.get("c", max_groups=4, min_groups=2)
    assert res.lease is not None and res.lease.group_ids == ["a", "b"]


def test_get_by_token_budget() -> None:
    q, _ = make()
    for g, n in (("a", 30), ("b", 30), ("c", 30), ("d", 5)):
        q.put(rec(g, n_tokens=n))
    res = q.get("c", max_groups=0, max_tokens=70)
    assert res.lease is not None and res.lease.group_ids == ["a", "b"]  # 90 > 70: stops, no skipping
    res = q.get("c", max_groups=0, max_tokens=10)
    assert res.lease is not None and res.lease.group_ids == ["c"]  # over budget alone: still one group
    res = q.get("c", max_groups=0, max_tokens=100)
    assert res.lease is not None and res.lease.group_ids == ["d"]


def test_get_token_budget_and_group_count_together() -> None:
    q, _ = make()
    for g in "abcd":
        q.put(rec(g, n_tokens=10))
    res = q.get("c", max_groups=2, max_tokens=1000)
    assert res.lease is not None and res.lease.group_ids == ["a", "b"]
    res = q.get("c", max_groups=5, max_tokens=10)
    assert res.lease is not None and res.lease.group_ids == ["c"]
    res = q.get("c", max_groups=5, min_groups=2, max_tokens=10)  # budget allows 1 < min 2
    assert res.lease is None and pending(q) == ["d"]


def test_get_caps_a_batch_at_the_byte_budget() -> None:
    q, _ = make()
    for g in "abcd":
        q.put(rec(g, size=40))
    q.put(rec("e", size=500))
    # 2 x (40 + 5) = 90 <= 100; a third would make 135: the batch stops there, no skipping
    res = q.get("c", max_groups=10, max_bytes=100, overhead_bytes=5)
    assert res.lease is not None and res.lease.group_ids == ["a", "b"]
    # cut by the message limit: delivered below min_groups (waiting would never make it larger)
    res = q.get("c", max_groups=3, min_groups=3, max_bytes=100, overhead_bytes=5)
    assert res.lease is not None and res.lease.group_ids == ["c", "d"]
    res = q.get("c", max_groups=10, max_bytes=100, overhead_bytes=5)
    assert res.lease is not None and res.lease.group_ids == ["e"]  # over the budget alone: still one group
    assert pending(q) == []


def test_min_groups_still_waits_when_the_byte_budget_is_not_what_limits() -> None:
    q, _ = make()
    q.put(rec("a", size=40))
    res = q.get("c", max_groups=3, min_groups=2, max_bytes=1000, overhead_bytes=5)
    assert res.lease is None and pending(q) == ["a"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_groups": 0, "max_tokens": 0},
        {"max_groups": 2, "min_groups": 3},
        {"max_groups": 2, "lease_s": -1.0},
    ],
)
def test_invalid_get(kwargs: dict) -> None:
    q, _ = make()
    q.put(rec("a"))
    with pytest.raises(InvalidRequest):
        q.get("c", **kwargs)
    assert pending(q) == ["a"]


def test_stale_groups_are_evicted_never_delivered() -> None:
    q, _ = make(max_staleness=1)
    q.set_trainer_version(3)
    for g, bv in (("v0", 0), ("v2", 2), ("v1", 1), ("v3", 3)):
        q.put(rec(g, bv=bv))
    res = q.get("c", max_groups=10)
    assert res.evicted_stale == 2  # staleness 3 and 2 > tau = 1
    assert res.lease is not None
    assert [(d.group.group_id, d.staleness) for d in res.deliveries] == [("v2", 1), ("v3", 0)]
    s = q.stats()
    assert s.evicted_groups == {"stale": 2}
    assert s.accepted_groups == 2 and s.depth_groups == 0
    assert "v0" not in q.memory.groups and "v1" not in q.memory.groups
    assert q.stats().depth_bytes == 0


def test_staleness_exactly_tau_is_delivered() -> None:
    q, _ = make(max_staleness=2)
    q.set_trainer_version(3)
    q.put(rec("a", bv=3))
    q.set_trainer_version(5)
    res = q.get("c", max_groups=1)
    assert res.evicted_stale == 0 and [d.staleness for d in res.deliveries] == [2]


def test_a_lowered_tau_evicts_at_the_next_get_and_each_batch_names_its_tau() -> None:
    """A live τ (SetMaxStaleness): groups queued under the old bound that the new one makes too stale are
    evicted and counted at the next Get, never delivered; every batch says the τ it was delivered under."""
    q, _ = make(max_staleness=2)
    q.set_trainer_version(2)
    for g, bv in (("v0", 0), ("v1", 1), ("v2", 2), ("w0", 0)):
        q.put(rec(g, bv=bv))
    res = q.get("c", max_groups=1)
    assert [d.group.group_id for d in res.deliveries] == ["v0"] and res.max_staleness == 2
    q.set_max_staleness(0)
    res = q.get("c", max_groups=5)
    assert [d.group.group_id for d in res.deliveries] == ["v2"] and res.max_staleness == 0
    assert res.evicted_stale == 2 and q.stats().evicted_groups == {"stale": 2}  # v1 and w0
    q.set_max_staleness(-1)
    q.put(rec("old", bv=0))
    res = q.get("c", max_groups=5)
    assert [d.group.group_id for d in res.deliveries] == ["old"] and res.max_staleness == -1
    assert q.get("c", max_groups=5).max_staleness is None  # nothing delivered: no tau to name


def test_eviction_happens_even_when_min_groups_is_not_met() -> None:
    q, _ = make(max_staleness=0)
    q.set_trainer_version(1)
    q.put(rec("old", bv=0))
    q.put(rec("new", bv=1))
    res = q.get("c", max_groups=5, min_groups=2)
    assert res.lease is None and res.evicted_stale == 1
    assert pending(q) == ["new"] and q.stats().evicted_groups == {"stale": 1}


def test_consumer_version_overrides_trainer_version() -> None:
    q, _ = make(max_staleness=1)
    q.set_trainer_version(3)
    q.put(rec("a", bv=0))
    q.put(rec("b", bv=2))
    res = q.get("c", max_groups=5, consumer_version=2)  # trainer is at 3, consumer at 2
    assert res.evicted_stale == 1
    assert res.lease is not None and res.lease.consumer_version == 2
    assert [(d.group.group_id, d.staleness) for d in res.deliveries] == [("b", 0)]
    q.put(rec("c", bv=2))
    res = q.get("c", max_groups=5)  # default: the trainer's version (3)
    assert res.lease is not None and res.lease.consumer_version == 3
    assert [(d.group.group_id, d.staleness) for d in res.deliveries] == [("c", 1)]


@pytest.mark.parametrize("ahead", [1, 2**53])
def test_a_consumer_version_above_the_trainers_is_refused_before_any_eviction(ahead: int) -> None:
    """A consumer_version no trainer has reached measured every group as stale: Get(consumer_version=2^53)
    with the trainer at 0 evicted the whole queue (and its ids went into the dedup window)."""
    q, _ = make(max_staleness=1)
    for g in ("a", "b", "c"):
        q.put(rec(g, bv=0))
    with pytest.raises(FailedPrecondition, match=f"consumer_version={ahead} is above the trainer's version 0"):
        q.get("c", max_groups=1, consumer_version=ahead)
    assert pending(q) == ["a", "b", "c"] and q.stats().evicted_groups == {}
    q.set_trainer_version(ahead)  # what the trainer does before it asks for the step's batch
    assert q.get("c", max_groups=1, consumer_version=ahead).evicted_stale == (3 if ahead > 1 else 0)


@pytest.mark.parametrize(("max_tokens", "min_groups"), [(1, 2), (5, 6)])
def test_a_get_whose_token_budget_cannot_hold_min_groups_is_refused(max_tokens: int, min_groups: int) -> None:
    """Every group has at least one token: no batch within max_tokens holds more than max_tokens groups, so
    such a long poll could never be served (and was woken, in vain, by every change)."""
    q, _ = make(max_staleness=-1)
    for g in "abcdefgh":
        q.put(rec(g, n_tokens=1))
    with pytest.raises(InvalidRequest, match=f"min_groups={min_groups} can never be met within max_tokens"):
        q.get("c", 0, max_tokens=max_tokens, min_groups=min_groups)
    res = q.get("c", 0, max_tokens=max_tokens, min_groups=max_tokens)  # at the bound: served
    assert res.lease is not None and len(res.lease.group_ids) == max_tokens


def test_newer_than_consumer_has_staleness_zero() -> None:
    q, _ = make(max_staleness=0)
    q.set_trainer_version(4)
    q.put(rec("a", bv=4))
    res = q.get("c", max_groups=1, consumer_version=2)
    assert [d.staleness for d in res.deliveries] == [0]


# =========================================================================================
# Ack / Nack / RenewLease
# =========================================================================================


def _leased(q: QueueState, n: int, **kw: Any) -> str:
    res = q.get("c", max_groups=n, **kw)
    assert res.lease is not None
    return res.lease.lease_id


def test_ack_removes_groups_and_is_idempotent() -> None:
    q, _ = make()
    for g in "abc":
        q.put(rec(g))
    lid = _leased(q, 2)
    assert q.ack(lid) == 2
    s = q.stats()
    assert (s.acked_groups, s.leased_groups, s.depth_groups, s.accepted_groups) == (2, 0, 1, 3)
    assert q.memory.live_bytes == 16
    assert q.ack(lid) == 0
    assert q.stats().acked_groups == 2
    with pytest.raises(FailedPrecondition):
        q.nack(lid)  # its groups are gone
    with pytest.raises(FailedPrecondition):
        q.renew(lid)


def test_unknown_lease_is_not_found() -> None:
    q, _ = make()
    for call in (q.ack, q.nack, q.renew):
        with pytest.raises(NotFound):
            call("nope")


def test_nack_returns_groups_to_the_head_in_order() -> None:
    q, _ = make()
    for g in "abcde":
        q.put(rec(g))
    l1 = _leased(q, 2)  # a b
    l2 = _leased(q, 2)  # c d
    assert q.nack(l1) == 2
    assert pending(q) == ["a", "b", "e"]
    assert q.nack(l2) == 2
    assert pending(q) == ["c", "d", "a", "b", "e"]  # the most recently returned lease is at the head
    assert q.nack(l1) == 0  # idempotent
    with pytest.raises(FailedPrecondition):
        q.ack(l1)
    with pytest.raises(FailedPrecondition):
        q.renew(l1)
    s = q.stats()
    assert (s.depth_groups, s.leased_groups, s.expired_leases, s.acked_groups) == (5, 0, 0, 0)
    assert s.depth_bytes == 5 * 16
    res = q.get("c", max_groups=5)
    assert [(d.group.group_id, d.redeliveries) for d in res.deliveries] == [
        ("c", 1),
        ("d", 1),
        ("a", 1),
        ("b", 1),
        ("e", 0),
    ]


def test_a_pause_of_the_queue_or_a_jump_of_its_clock_gives_leases_and_tickets_their_time_back() -> None:
    """A queue stopped 12 s with 4 s leases expired every lease the instant it ran again, ahead of the acks
    already waiting for it: trained groups were evicted as stale and generated again."""
    clock = Clock()
    q = QueueState(QueueConfig(default_lease_s=10.0, reservation_ttl_s=20.0), clock=clock, pause_after_s=5.0)
    for g in "abc":
        q.put(rec(g))
    lid = _leased(q, 2)
    ticket = q.reserve("r1", "p", 2)
    assert ticket is not None
    clock.advance(8.0)
    q.sweep()  # ran 8 s of its clock in no time: a jump of the wall clock, past 5 s
    clock.advance(4.0)  # 12 s of the lease's 10 by the clock, 4 of them watched
    assert q.sweep().expired_leases == 0
    q._ran_at -= 30.0  # the process did not run for 30 s (SIGSTOP), its clock ran with it
    clock.advance(30.0)
    result = q.sweep()
    assert (result.expired_leases, result.expired_tickets) == (0, 0)
    q.ack(lid)  # the holder's ack, waiting while the queue was stopped: still its lease
    assert pending(q) == ["c"]
    q._ran_at -= 30.0  # paused again; the first call after it is a Put on the ticket (no sweep before it)
    clock.advance(30.0)
    assert q.put(rec("d"), ticket_id=ticket.ticket_id)[0]
    assert q.memory.tickets[ticket.ticket_id].remaining == 1  # it came in on its ticket, still valid
    expired = 0
    for _ in range(20):  # watched time (both clocks, a sweep a second) runs out as before: 16 s left
        clock.advance(1.0)
        q._ran_at -= 1.0
        expired += q.sweep().expired_tickets
    assert expired == 1
    # not watched (a test's clock, pause_after_s None): the same 12 s expire the lease, as they always did
    q2, c2 = make(default_lease_s=10.0)
    q2.put(rec("a"))
    _leased(q2, 1)
    c2.advance(12.0)
    assert q2.sweep().expired_leases == 1


@pytest.mark.parametrize("forward_again", [False, True])
def test_a_step_back_of_the_queues_clock_leaves_leases_and_tickets_the_time_they_had(forward_again: bool) -> None:
    """An hour's step back of the wall clock (the deadlines' clock) left a lease whose holder was gone leased for
    an hour and ten seconds; the step forward again of an NTP correction added another hour."""
    clock = Clock()
    q = QueueState(QueueConfig(default_lease_s=10.0, reservation_ttl_s=20.0), clock=clock, pause_after_s=5.0)
    for g in "ab":
        q.put(rec(g))
    _leased(q, 1)
    assert q.reserve("r1", "p", 1) is not None
    clock.advance(3.0)
    q._ran_at -= 3.0
    q.sweep()
    clock.advance(-3600.0)
    q.sweep()
    if forward_again:
        clock.advance(3600.0)
        q.sweep()
    expired_leases_at = expired_tickets_at = None
    for second in range(4, 40):  # watched time, a sweep a second
        clock.advance(1.0)
        q._ran_at -= 1.0
        result = q.sweep()
        if result.expired_leases:
            expired_leases_at = second
        if result.expired_tickets:
            expired_tickets_at = second
    assert (expired_leases_at, expired_tickets_at) == (10, 20)


def test_lease_expiry_returns_groups_to_the_head_and_counts_redeliveries() -> None:
    q, c = make(default_lease_s=10.0)
    for g in "abcd":
        q.put(rec(g))
    lid = _leased(q, 3)
    q.put(rec("e"))
    c.advance(9.99)
    assert q.sweep().expired_leases == 0
    c.advance(0.01)  # deadline <= now
    res = q.sweep()
    assert (res.expired_leases, res.expired_groups) == (1, 3)
    assert pending(q) == ["a", "b", "c", "d", "e"]
    s = q.stats()
    assert (s.expired_leases, s.leased_groups, s.depth_groups) == (1, 0, 5)
    with pytest.raises(FailedPrecondition):
        q.ack(lid)
    assert q.nack(lid) == 0
    with pytest.raises(FailedPrecondition):
        q.renew(lid)
    lid2 = _leased(q, 2)
    c.advance(10.0)
    got = q.get("c", max_groups=5)  # get sweeps first
    assert [(d.group.group_id, d.redeliveries) for d in got.deliveries] == [
        ("a", 2),
        ("b", 2),
        ("c", 1),
        ("d", 0),
        ("e", 0),
    ]
    with pytest.raises(FailedPrecondition):
        q.ack(lid2)
    assert q.stats().expired_leases == 2


def test_ack_after_expiry_is_failed_precondition_without_explicit_sweep() -> None:
    q, c = make(default_lease_s=5.0)
    q.put(rec("a"))
    lid = _leased(q, 1)
    c.advance(5.0)
    with pytest.raises(FailedPrecondition):
        q.ack(lid)
    assert pending(q) == ["a"] and q.stats().acked_groups == 0


def test_renew_extends_the_deadline() -> None:
    q, c = make(default_lease_s=10.0)
    q.put(rec("a"))
    lid = _leased(q, 1)
    c.advance(8.0)
    lease = q.renew(lid, 30.0)
    assert lease.deadline == c() + 30.0
    c.advance(25.0)  # past the original deadline
    assert q.sweep().expired_leases == 0
    lease = q.renew(lid)  # default lease
    assert lease.deadline == c() + 10.0
    with pytest.raises(InvalidRequest):
        q.renew(lid, -1.0)
    c.advance(9.0)
    assert q.ack(lid) == 1


def test_stale_check_happens_again_on_redelivery() -> None:
    q, c = make(max_staleness=0, default_lease_s=5.0)
    q.put(rec("a", bv=0))
    _leased(q, 1)
    q.set_trainer_version(1)  # the consumer stepped without acking; the lease then expires
    c.advance(5.0)
    res = q.get("c", max_groups=1)
    assert res.lease is None and res.evicted_stale == 1


# =========================================================================================
# Pacing after a fault: a group a step used, evicted after its lease came back
# =========================================================================================


class Run:
    """A rollout and a trainer in lockstep on ``q`` (``groups_per_step`` G): each turn the rollout reserves all
    the room the pacing rule gives and puts that many groups made with the trainer's current weights; the
    trainer then leases a step's batch for its version, trains it and commits (acks, then the next version)."""

    def __init__(self, q: QueueState, clock: Clock) -> None:
        self.q, self.clock, self.made = q, clock, 0

    @property
    def gps(self) -> int:
        return self.q.config.groups_per_step

    def produce(self) -> int:
        room = self.q.free_room()
        if room <= 0:
            return 0
        ticket = self.q.reserve(f"r{self.made}", "rollout", room)
        assert ticket is not None
        for _ in range(room):
            assert self.q.put(rec(f"g{self.made}", bv=self.q.trainer_version), ticket.ticket_id)[0]
            self.made += 1
        return room

    def lease_step(self) -> str | None:
        """The lease of a whole step's batch for the trainer's version, or None (not enough fresh groups)."""
        v = self.q.trainer_version
        res = self.q.get("trainer", max_groups=self.gps, min_groups=self.gps, consumer_version=v, lease_s=5.0)
        return None if res.lease is None else res.lease.lease_id

    def step(self) -> None:
        """One step: the rollout fills the room, the trainer trains a batch (two turns at most: the first Get
        may only evict) and commits."""
        for _ in range(2):
            self.produce()
            lease_id = self.lease_step()
            if lease_id is not None:
                self.q.ack(lease_id)
                self.q.set_trainer_version(self.q.trainer_version + 1)
                return
        raise AssertionError(f"no batch at version {self.q.trainer_version}: {self.q.stats()}")

    def paced_as_steps_used(self, trained: tuple[str, ...] = ()) -> None:
        """The pacing sum is what the steps so far consumed plus what is stored and no step used yet (of the
        stored groups, ``trained`` were): no room lost or gained."""
        m = self.q.memory
        unused = len(set(m.groups) - set(trained))
        assert m.accepted == m.trainer_version * self.gps + unused, self.q.stats()


def _fault(q: QueueState, clock: Clock, lease_id: str, how: str) -> None:
    """The trained step's lease goes back to the queue without its ack."""
    if how == "expired":  # the trainer (or the queue, or its sidecar) stopped past the lease
        clock.advance(11.0)  # (past a lease granted anew by a recovery too)
        assert q.sweep().expired_leases == 1
    elif how == "nacked":
        assert q.nack(lease_id) > 0
    else:  # killed after its checkpoint, before its acks: resumed from that checkpoint, at the same version
        q.set_trainer_version(q.trainer_version, rebase=True)
    assert not q.memory.leases


@pytest.mark.parametrize("how", ["expired", "nacked", "rebased"])
@pytest.mark.parametrize("durability", ["live", "restarted", "compacted"])
@pytest.mark.parametrize("tau", [0, 1])
def test_a_group_evicted_after_the_step_it_was_delivered_for_gives_no_pacing_room_back(
    tmp_path: Path, how: str, durability: str, tau: int
) -> None:
    """Found by fault injection: groups trained whose lease was not acked (a trainer killed after its checkpoint
    and before its acks, a lease expiring while the trainer or the queue was stopped, a resumed run) come back
    older than tau and are evicted at the next Get. Each eviction took one off the pacing sum although its step
    had already used it up: the sum stayed short by that many for the rest of the run, so Reserve granted that
    many groups more each step, which only aged past tau and were evicted in turn (8 such groups: 1,336 groups
    evicted as stale over 400 steps). Now such a group keeps its count, the same after a restart (the log
    replayed) and a compaction, and the faulted groups are the only ones ever evicted."""
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=tau, groups_per_step=2)
    run = Run(q, c)
    for _ in range(4):
        run.step()
        run.paced_as_steps_used()
    room_before = q.free_room()  # the turn's room, before the rollout fills it
    run.produce()
    trained = run.lease_step()
    assert trained is not None
    lost = list(q.memory.leases[trained].group_ids)
    q.set_trainer_version(q.trainer_version + 1)  # the step committed (its checkpoint written); no ack comes
    if durability != "live":  # the queue restarts with the lease still held (compacted: from a snapshot)
        if durability == "compacted":
            q.compact()
        q = run.q = restart(q, path, c)
    _fault(q, c, trained, how)
    assert pending(q)[: len(lost)] == lost and q.free_room() == room_before  # back at the head; nothing gained
    run.paced_as_steps_used(tuple(lost))
    for _ in range(20):
        run.step()
        run.paced_as_steps_used()
        assert q.free_room() <= room_before
    assert q.stats().evicted_groups == {"stale": len(lost)}  # the faulted groups once, and nothing after them
    assert run.made == (4 + 1 + 20 + tau) * 2  # each step's batch, tau steps ahead: no group made in vain
    before = fingerprint(q)
    q = restart(q, path, c)
    assert fingerprint(q) == recovered(before, c())
    q.compact()
    q = restart(q, path, c)
    assert _but_the_log(fingerprint(q)) == _but_the_log(recovered(before, c()))


def _but_the_log(state: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint without the log's sizes (what a compaction changes)."""
    return {**state, "stats": {**vars(state["stats"]), "wal_bytes": 0}, "live_wal_bytes": None}


def test_a_group_that_no_step_used_still_gives_its_room_back_when_evicted(tmp_path: Path) -> None:
    """The other side of the rule: a group evicted before any step used it (never delivered, or delivered only
    for the trainer's current version and nacked, its step not committed) gives its room back, so that the
    rollout can make its replacement. Kept for the never-delivered one, which is what pacing always did; for
    the one delivered for the current version a kept count would hold the rollout below a step's batch for good
    (here with tau lowered to 0: one group of room, two needed). One EVICT record with both kinds of group."""
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=2)
    q.set_trainer_version(2, rebase=True)  # (paced as if two steps had consumed their batches)
    assert q.stats().accepted_groups == 4
    for g in ("used", "nacked", "never"):
        q.put(rec(g, bv=1))
    used = _leased(q, 1, consumer_version=1)  # delivered for step 1, which has since committed (trainer at 2)
    nacked = _leased(q, 1)  # delivered for step 2, not committed
    q.nack(nacked)
    c.advance(11.0)
    assert q.sweep().expired_leases == 1  # `used` comes back unacked
    assert pending(q) == ["used", "nacked", "never"] and used not in q.memory.leases
    assert q.memory.groups["used"].delivered_for == 1 and q.memory.groups["nacked"].delivered_for == 2
    assert q.memory.groups["never"].delivered_for is None
    for step in ("restarted", "compacted"):
        if step == "compacted":
            q.compact()
        before = fingerprint(q)
        q = restart(q, path, c)
        assert fingerprint(q) == recovered(before, c())
    assert q.stats().accepted_groups == 7
    q.set_max_staleness(0)
    res = q.get("trainer", max_groups=2)
    assert res.evicted_stale == 3 and res.lease is None
    s = q.stats()
    assert (s.accepted_groups, s.evicted_groups) == (5, {"stale": 3})  # only "used" keeps its count
    assert q.free_room() == 1 and q.reserve("r", "rollout", 2) is None
    assert q.reserve("r", "rollout", 1) is not None
    before = fingerprint(q)
    q = restart(q, path, c)
    q.set_max_staleness(0)  # (not logged: the controller sets it again)
    assert fingerprint(q) == recovered(before, c())


def test_a_rebase_counts_every_stored_group_as_unused_by_a_step(tmp_path: Path) -> None:
    """A trainer resumed from an older checkpoint re-paces (its version times groups_per_step, plus every group
    stored): the deliveries before it were to steps the checkpoint does not hold, so a stored group evicted
    after the rebase gives its room back, even one delivered for a version older than the checkpoint's."""
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=2, groups_per_step=1)
    q.set_trainer_version(1)
    q.put(rec("a", bv=1))
    _leased(q, 1)  # for step 1
    q.set_trainer_version(3)  # steps 1 and 2 committed, held unacked until a checkpoint
    assert q.set_trainer_version(2, rebase=True) == 2  # resumed from step 2's checkpoint: `a` is back
    assert pending(q) == ["a"] and q.memory.groups["a"].delivered_for is None
    assert q.stats().accepted_groups == 2 * 1 + 1
    q.compact()
    q = restart(q, path, c)
    q.set_max_staleness(0)
    assert q.get("trainer", max_groups=1).evicted_stale == 1  # bv 1 at version 2
    assert q.stats().accepted_groups == 2 and q.free_room() == 1  # the rollout can make step 2's batch
    before = fingerprint(q)
    q = restart(q, path, c)
    q.set_max_staleness(0)  # (not logged: the controller sets it again)
    assert fingerprint(q) == recovered(before, c())


# =========================================================================================
# Trainer version and tau
# =========================================================================================


def test_set_trainer_version_is_monotonic() -> None:
    q, _ = make()
    assert q.set_trainer_version(3) == 3
    assert q.set_trainer_version(2) == 3
    assert q.set_trainer_version(3) == 3
    assert q.trainer_version == 3
    with pytest.raises(InvalidRequest):
        q.set_trainer_version(-1)


def test_rebase_moves_version_back_and_repaces() -> None:
    q, _ = make(max_staleness=0, groups_per_step=2)
    q.set_trainer_version(5)
    q.put(rec("a", bv=5))
    for i in range(10):
        q.put(rec(f"x{i}", bv=5))
    lid = _leased(q, 10)
    q.ack(lid)
    assert q.stats().accepted_groups == 11
    assert q.set_trainer_version(2, rebase=True) == 2
    # pace as if every step consumed one batch, plus what is stored now: 2 * 2 + 1
    assert q.stats().accepted_groups == 5
    assert q.pacing_limit() == 6
    assert q.reserve("r1", "p", 2) is None
    assert q.reserve("r2", "p", 1) is not None
    assert q.set_trainer_version(2, rebase=True) == 2  # same version: no-op
    assert q.stats().accepted_groups == 5


def test_a_rebase_gives_the_previous_trainers_leases_back_at_once(tmp_path: Path) -> None:
    # A trainer restarted from its checkpoint rebases; the leases its predecessor held came back only when they
    # expired (lease_s, 120 s by default): their room in the pacing stalled the run that long.
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=2, groups_per_step=2)
    for g in ("a", "b", "c", "d"):
        q.put(rec(g))
    first, second = _leased(q, 2), _leased(q, 2)
    assert q.stats().leased_groups == 4 and q.stats().depth_groups == 0
    assert q.set_trainer_version(0, rebase=True) == 0  # (the same version: it still gives them back)
    stats = q.stats()
    assert stats.leased_groups == 0 and stats.depth_groups == 4
    with pytest.raises(FailedPrecondition, match="was rebased before this ack"):
        q.ack(first)
    before = fingerprint(q)
    q = restart(q, path, c)
    assert fingerprint(q) == recovered(before, c())  # (replayed from the log alike)
    again = _leased(q, 4)  # in their order: the oldest lease's groups first
    assert [g for g in q.memory.leases[again].group_ids] == ["a", "b", "c", "d"] and second != again


def test_set_max_staleness() -> None:
    q, _ = make(max_staleness=2, groups_per_step=2)
    assert q.reserve("r1", "p", 6) is not None
    with pytest.raises(InvalidRequest):
        q.set_max_staleness(-2)
    assert q.max_staleness == 2
    assert q.set_max_staleness(0) == 0
    with pytest.raises(InvalidRequest):
        q.reserve("r2", "p", 3)  # (0 + 1) * 2 is the most ever grantable now
    q.set_trainer_version(1)
    q.put(rec("a", bv=0))
    q.put(rec("b", bv=1))
    res = q.get("c", max_groups=5)
    assert res.evicted_stale == 1 and [d.group.group_id for d in res.deliveries] == ["b"]
    q.set_max_staleness(-1)
    assert q.pacing_limit() is None
    q.put(rec("old", bv=0))
    q.set_trainer_version(50)
    res = q.get("c", max_groups=5)
    assert res.evicted_stale == 0 and [d.staleness for d in res.deliveries] == [50]


# =========================================================================================
# Durability: recovery, torn tails, compaction
# =========================================================================================


def _busy_state(q: QueueState, c: Clock) -> dict[str, Any]:
    """Drives ``q`` through every kind of record; returns handles to what is still open."""
    q.set_trainer_version(1)
    t1 = q.reserve("req-1", "prod", 4)
    assert t1 is not None
    for i in range(3):
        assert q.put(rec(f"t{i}", bv=1, n_tokens=10 + i, size=20 + i), t1.ticket_id)[0]
    for i in range(6):
        q.put(rec(f"e{i}", bv=1 if i % 2 else 0, n_tokens=5, size=30))
    c.advance(1.0)
    q.set_trainer_version(2)
    acked = _leased(q, 2)  # t0 t1
    q.ack(acked)
    nacked = _leased(q, 1)  # t2
    q.nack(nacked)
    expiring = _leased(q, 1, lease_s=2.0)  # t2 again
    open_lease = _leased(q, 2, lease_s=50.0)  # e1 e3 (e0 and e2 are evicted: staleness 2 > 1)
    renewed = _leased(q, 1, lease_s=5.0)  # e5 (e4 evicted)
    q.renew(renewed, 40.0)
    c.advance(3.0)
    assert q.sweep().expired_leases == 1  # `expiring`
    t2 = q.reserve("req-2", "prod", 2)
    assert t2 is not None
    q.put(rec("late", bv=2), t2.ticket_id)
    t3 = q.reserve("req-3", "prod", 1)
    assert t3 is not None
    q.release_reservation(t3.ticket_id)
    return {
        "acked": acked,
        "nacked": nacked,
        "expiring": expiring,
        "open": open_lease,
        "renewed": renewed,
        "t1": t1,
        "t2": t2,
    }


def test_recovery_reproduces_the_state(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=4)
    h = _busy_state(q, c)
    before = fingerprint(q)
    assert before["stats"].evicted_groups == {"stale": 3}  # e0 e2 e4 (bv 0 at version 2)
    assert before["leases"] and before["tickets"] and before["pending"]
    assert before["groups"]["t2"][4] == 2  # delivered twice (nacked, then expired)

    q2 = restart(q, path, c)
    assert fingerprint(q2) == recovered(before, c())

    # Idempotency survives the restart.
    for gid in ("t0", "t1", "e0"):  # acked, acked, evicted
        assert q2.put(rec(gid, bv=2)) == (False, len(before["pending"]))
    assert q2.ack(h["acked"]) == 0
    assert q2.nack(h["nacked"]) == 0
    assert q2.nack(h["expiring"]) == 0
    with pytest.raises(FailedPrecondition):
        q2.ack(h["expiring"])
    t1 = q2.reserve("req-1", "prod", 4)
    assert t1 is not None and t1.ticket_id == h["t1"].ticket_id
    assert q2.stats().reserved_groups == before["stats"].reserved_groups
    # The ticket still works for its remaining room.
    assert q2.put(rec("t3", bv=2), h["t1"].ticket_id)[0]
    assert h["t1"].ticket_id not in q2.memory.tickets
    # Each held lease gets its duration anew from the restart: `open` (50 s, deadline 1051 before) is held
    # to 1004 + 50 = 1054, and expires then.
    assert c() == 1004.0 and q2.memory.leases[h["open"]].deadline == 1054.0
    assert q2.renew(h["renewed"], 100.0).deadline == c() + 100.0
    c.advance(49.0)  # t = 1053
    assert q2.sweep().expired_leases == 0
    c.advance(1.0)
    assert q2.sweep().expired_leases == 1
    assert h["open"] not in q2.memory.leases and pending(q2)[:2] == ["e1", "e3"]
    assert q2.ack(h["renewed"]) == 1


def test_a_recovered_lease_gets_its_duration_anew(tmp_path: Path) -> None:
    """A queue down longer than what was left of a lease must not expire it at once on restart: its holder
    could not renew meanwhile (the chaos test's trainer had trained the groups; they went round again)."""
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), default_lease_s=30.0)
    for g in ("a", "b", "c"):
        q.put(rec(g))
    short = _leased(q, 1, lease_s=4.0)  # a
    renewed = _leased(q, 1, lease_s=4.0)  # b, renewed to 8 s
    q.renew(renewed, 8.0)
    c.advance(3.0)
    q.wal.close()
    c.advance(10.0)  # down for 10 s: both deadlines passed
    q2 = QueueState(q.config, open_wal(path), clock=c)
    assert q2.memory.leases[short].deadline == c() + 4.0 and q2.memory.leases[renewed].deadline == c() + 8.0
    assert q2.sweep().expired_leases == 0
    c.advance(4.5)
    assert q2.sweep().expired_leases == 1 and pending(q2) == ["a", "c"]  # `short`, after 4 s anew
    assert q2.ack(renewed) == 1
    # A lease from a log that records no duration (format 1) gets the default.
    q3, c3 = make(wal=open_wal(tmp_path / "old.wal"), default_lease_s=30.0)
    q3.put(rec("x"))
    lid = _leased(q3, 1, lease_s=4.0)
    q3.memory.leases[lid].duration_s = 0.0
    q3.compact()
    q3.wal.close()
    c3.advance(100.0)
    q4 = QueueState(q3.config, open_wal(tmp_path / "old.wal"), clock=c3)
    assert q4.memory.leases[lid].deadline == c3() + 30.0


def test_recovery_after_restart_then_more_work(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=4)
    _busy_state(q, c)
    q = restart(q, path, c)
    q.put(rec("new1", bv=2))
    lid = _leased(q, 2)
    q.ack(lid)
    c.advance(100.0)
    q.sweep()  # every remaining lease and ticket expires
    before = fingerprint(q)
    q2 = restart(q, path, c)
    assert fingerprint(q2) == recovered(before, c())
    assert q2.stats().leased_groups == 0 and q2.stats().reserved_groups == 0


def test_recovery_of_an_empty_and_a_missing_log(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "q.wal"
    q, c = make(wal=open_wal(path))
    assert path.exists()
    q2 = restart(q, path, c)
    assert fingerprint(q2) == fingerprint(make()[0]) | {"stats": q2.stats()}
    assert q2.stats().wal_bytes == path.stat().st_size


def test_not_a_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    path.write_bytes(b"something else entirely")
    with pytest.raises(WalCorrupt):
        make(wal=open_wal(path))


def test_recovery_replays_rebase(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=0, groups_per_step=2)
    q.set_trainer_version(4)
    q.put(rec("a", bv=4))
    q.set_trainer_version(1, rebase=True)
    before = fingerprint(q)
    assert before["stats"].accepted_groups == 3 and before["stats"].trainer_version == 1
    assert fingerprint(restart(q, path, c)) == recovered(before, c())


def _three_puts(path: Path) -> tuple[QueueState, Clock, list[int]]:
    q, c = make(wal=open_wal(path))
    sizes = []
    for g in ("a", "b", "c"):
        q.put(rec(g, size=40))
        sizes.append(path.stat().st_size)
    return q, c, sizes


@pytest.mark.parametrize("cut", [1, 3, 20, 45])
def test_torn_tail_is_cut_and_earlier_records_survive(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "q.wal"
    q, c, sizes = _three_puts(path)
    q.wal.close()
    os.truncate(path, sizes[-1] - cut)  # the last record (c) is torn
    q2 = QueueState(q.config, open_wal(path), clock=c)
    assert pending(q2) == ["a", "b"]
    assert path.stat().st_size == sizes[1] == q2.stats().wal_bytes
    # The log keeps working after the cut: appends land after the good records.
    assert q2.put(rec("c", size=40))[0]
    q2.put(rec("d", size=40))
    before = fingerprint(q2)
    q3 = restart(q2, path, c)
    assert fingerprint(q3) == recovered(before, c())
    assert pending(q3) == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x07",
        b"\x01\x02\x03\x04\x05",
        b"\x01" + b"\xff" * 40,  # a header whose lengths point far past the end of the file
        b"\x01\x05\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00{}xyz",  # bad crc
        b"\x00" * 13,  # a zero-filled tail (e.g. a file extended but never written before a crash)
        b"\x00" * 4096,
    ],
    ids=["one-byte", "short-header", "huge-lengths", "bad-crc", "zero-header", "zero-block"],
)
def test_garbage_tail_is_cut(tmp_path: Path, garbage: bytes) -> None:
    path = tmp_path / "q.wal"
    q, c, sizes = _three_puts(path)
    before = fingerprint(q)
    q.wal.close()
    with open(path, "ab") as f:
        f.write(garbage)
    q2 = QueueState(q.config, open_wal(path), clock=c)
    assert fingerprint(q2) == recovered(before, c())
    assert path.stat().st_size == sizes[-1]
    q2.put(rec("d"))
    assert pending(restart(q2, path, c)) == ["a", "b", "c", "d"]


def test_garbage_lengths_are_not_allocated(tmp_path: Path) -> None:
    """Lengths in a garbage header (up to 8 GiB) must not be read into memory before the crc check."""
    path = tmp_path / "q.wal"
    q, _, _ = _three_puts(path)
    q.wal.close()
    with open(path, "ab") as f:
        f.write(b"\x01" + b"\xff" * 40)
    script = (
        "import resource, sys\n"
        "from tauflow.queue.wal import WriteAheadLog\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "print(sum(1 for _ in WriteAheadLog(sys.argv[1]).replay()))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def test_torn_ack_leaves_the_lease_open(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path))
    q.put(rec("a"))
    lid = _leased(q, 1)
    size = path.stat().st_size
    q.ack(lid)
    q.wal.close()
    os.truncate(path, size + 5)  # the ack was never durable, so never acknowledged
    q2 = QueueState(q.config, open_wal(path), clock=c)
    assert lid in q2.memory.leases and q2.stats().acked_groups == 0
    assert q2.ack(lid) == 1


def _compactable(q: QueueState, c: Clock) -> dict[str, Any]:
    h = _busy_state(q, c)
    for i in range(20):
        q.put(rec(f"bulk{i}", bv=2, size=200))
    while True:  # ack most of it: lots of dead bytes
        res = q.get("c", max_groups=7)
        if res.lease is None or len(q.memory.pending) < 3:
            break
        q.ack(res.lease.lease_id)
    return h


def test_compaction_keeps_the_state_and_shrinks_the_log(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=4)
    h = _compactable(q, c)
    assert q.memory.leases and q.memory.tickets and q.memory.pending
    assert not q.compaction_due(10**9)
    assert q.compaction_due(1024)
    before = fingerprint(q)
    size_before = path.stat().st_size
    q.compact()
    after = fingerprint(q)
    assert after["stats"].wal_bytes == path.stat().st_size < size_before
    assert {**after, "stats": None, "live_wal_bytes": None} == {**before, "stats": None, "live_wal_bytes": None}
    assert {**vars(after["stats"]), "wal_bytes": 0} == {**vars(before["stats"]), "wal_bytes": 0}
    assert after["live_wal_bytes"] <= after["stats"].wal_bytes  # all it wrote is live (header, leases, tickets aside)
    assert not q.compaction_due(0)
    assert not (tmp_path / "q.wal.compact").exists()

    q2 = restart(q, path, c)
    assert fingerprint(q2) == recovered(after, c())

    # Everything still behaves after compaction + recovery.
    assert q2.put(rec("t0", bv=2))[0] is False  # acked before compaction
    assert q2.put(rec("e0", bv=2))[0] is False  # evicted before compaction
    assert q2.ack(h["acked"]) == 0
    with pytest.raises(FailedPrecondition):
        q2.ack(h["expiring"])
    t1 = q2.reserve("req-1", "prod", 4)
    assert t1 is not None
    assert (t1.ticket_id, t1.n_groups, t1.min_policy_version, t1.expires_at) == (
        h["t1"].ticket_id,
        4,
        1,
        h["t1"].expires_at,
    )
    assert q2.put(rec("t3", bv=2), h["t1"].ticket_id)[0]
    assert q2.stats().reserved_groups == before["stats"].reserved_groups - 1
    assert q2.ack(h["renewed"]) == 1


def test_work_after_compaction_recovers_identically(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=4)
    h = _compactable(q, c)
    q.compact()
    # More records after the snapshot: ack an old lease, redeliver, put, evict.
    assert q.ack(h["open"]) == 2
    q.nack(h["renewed"])
    q.put(rec("post1", bv=2))
    q.put(rec("post-old", bv=0))
    q.set_trainer_version(3)
    q.get("c", max_groups=1)
    before = fingerprint(q)
    q2 = restart(q, path, c)
    assert fingerprint(q2) == recovered(before, c())
    # A second compaction of the recovered state, then recovery again.
    q2.compact()
    again = fingerprint(q2)
    q3 = restart(q2, path, c)
    assert fingerprint(q3) == recovered(again, c())
    assert {**again, "stats": None, "live_wal_bytes": None} == {
        **recovered(before, c()),
        "stats": None,
        "live_wal_bytes": None,
    }


def test_compaction_drops_dead_bytes_and_counts_live_ones(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=-1)
    for i in range(50):
        q.put(rec(f"g{i}", size=500))
    lid = _leased(q, 48)
    q.ack(lid)
    assert q.compaction_due(4096)
    q.compact()
    assert path.stat().st_size < 5 * 600
    assert q.stats().depth_groups == 2
    snapshot = q.memory.live_wal_bytes - sum(g.wal_bytes for g in q.memory.groups.values())
    assert snapshot > 0  # the snapshot record is live
    # Acking the survivors makes their bytes dead: compaction is due again.
    q.ack(_leased(q, 2))
    assert q.memory.live_wal_bytes == snapshot
    assert q.compaction_due(1)
    q.compact()
    q2 = restart(q, path, c)
    assert q2.stats().acked_groups == 50 and q2.stats().accepted_groups == 50
    assert q2.put(rec("g0"))[0] is False


def test_a_snapshot_over_compact_min_bytes_does_not_make_every_change_due_for_compaction(tmp_path: Path) -> None:
    """The snapshot carries every remembered done id (up to dedup_window of them, 256 characters each). Counted
    as dead, once it alone passed compact_min_bytes every Ack compacted again: rewrote and fsynced the whole log."""
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=-1)
    for i in range(300):
        q.put(rec(f"{i:04d}" + "i" * 240, size=300))
    q.ack(_leased(q, 300))
    min_bytes = 16 * 1024
    assert q.compaction_due(min_bytes)
    q.compact()
    assert path.stat().st_size > 4 * min_bytes  # the snapshot: 300 ids of 244 characters
    for i in range(3):  # a trainer's steps
        q.put(rec(f"new{i}"))
        q.ack(_leased(q, 1))
        assert not q.compaction_due(min_bytes)
    assert not restart(q, path, c).compaction_due(min_bytes)  # nor after recovery (it counts the snapshot live)


def test_compaction_due_without_a_log() -> None:
    q, _ = make()
    assert q.compaction_due(0) is False


def test_leases_expiring_together_return_oldest_first() -> None:
    q, clock = make(max_staleness=-1)
    for g in ("a", "b", "c", "d", "e"):
        q.put(rec(g))
    first = q.get("t", max_groups=2, lease_s=5).lease
    second = q.get("t", max_groups=2, lease_s=5).lease
    assert first is not None and second is not None
    clock.advance(6)
    assert q.sweep().expired_leases == 2
    assert pending(q) == ["a", "b", "c", "d", "e"]


def test_a_cut_batch_below_min_groups_waits_until_min_groups_are_waiting() -> None:
    q, _ = make()
    for g in "ab":
        q.put(rec(g, size=40))
    # the budget fits one group, but only 2 < min_groups=3 are waiting: the step is not complete yet,
    # so nothing is leased (a lease now would run while the rest is generated)
    res = q.get("c", max_groups=3, min_groups=3, max_bytes=50, overhead_bytes=5)
    assert res.lease is None and pending(q) == ["a", "b"]
    q.put(rec("c", size=40))
    res = q.get("c", max_groups=3, min_groups=3, max_bytes=50, overhead_bytes=5)
    assert res.lease is not None and res.lease.group_ids == ["a"]


# -- compaction beside the calls (QueueState.compact_in_background) ------------------------------------


def _held_rewrite(monkeypatch: pytest.MonkeyPatch, fail: OSError | None = None) -> tuple[Any, Any]:
    """Makes the background rewrite's first write in its thread wait for ``release`` (and then raise ``fail``)."""
    import threading

    from tauflow.queue import wal as wal_module

    writing, release = threading.Event(), threading.Event()
    real = wal_module._write_frames

    def held(out: Any, frames: Any) -> Any:
        if not writing.is_set():
            writing.set()
            assert release.wait(30)
            if fail is not None:
                raise fail
        return real(out, frames)

    monkeypatch.setattr(wal_module, "_write_frames", held)
    return writing, release


async def _until(event: Any) -> None:
    for _ in range(3000):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the rewrite's thread never started")


def test_work_during_a_background_compaction_follows_its_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls go on while the snapshot is written in a thread (it held the event loop: seconds for a large log);
    what they change is in the new file after it, and a restart recovers exactly the state."""
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=4)
    h = _compactable(q, c)
    size_before = path.stat().st_size
    writing, release = _held_rewrite(monkeypatch)

    async def scenario() -> None:
        compaction = asyncio.create_task(q.compact_in_background())
        await _until(writing)
        # Meanwhile: a snapshot group acked and one redelivered, many groups put (more than the loop writes
        # itself at the end), a version, a lease.
        assert q.ack(h["open"]) == 2
        q.nack(h["renewed"])
        for i in range(100):
            q.put(rec(f"during{i}", bv=2, size=50))
        q.set_trainer_version(3)
        q.get("c", max_groups=3)
        assert not compaction.done()
        release.set()
        await compaction

    asyncio.run(scenario())
    after = fingerprint(q)
    assert path.stat().st_size == after["stats"].wal_bytes < size_before + 100 * 200
    assert not (tmp_path / "q.wal.compact").exists()
    q2 = restart(q, path, c)
    assert fingerprint(q2) == recovered(after, c())  # live_wal_bytes included: the sizes add up
    assert q2.put(rec("during7", bv=3))[0] is False and q2.ack(h["open"]) == 0


def test_a_failed_background_compaction_keeps_the_old_log_and_what_came_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from tauflow.queue.wal import WalWriteError

    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=4)
    _compactable(q, c)
    writing, release = _held_rewrite(monkeypatch, fail=OSError(errno.ENOSPC, "No space left on device"))

    async def scenario() -> None:
        compaction = asyncio.create_task(q.compact_in_background())
        await _until(writing)
        q.put(rec("meanwhile", bv=2))
        release.set()
        with pytest.raises(WalWriteError, match="old log is kept"):
            await compaction

    asyncio.run(scenario())
    assert not (tmp_path / "q.wal.compact").exists()
    before = fingerprint(q)
    q.put(rec("after", bv=2))  # the old log takes appends as before
    q2 = restart(q, path, c)
    assert "meanwhile" in q2.memory.groups and "after" in q2.memory.groups
    assert fingerprint(q2)["done_ids"] == before["done_ids"]


# -- external clients' Puts without a ticket: within the external share (hostile5, item 6) ----------------------


def test_external_puts_without_a_ticket_count_against_the_external_share() -> None:
    """An external client filled the whole capacity with Puts without a ticket (20 of 20), and the run's own
    rollout then got Reserve not granted and Put RESOURCE_EXHAUSTED. Those groups now count against
    external.reserved_share together with the external tickets, while stored."""
    q, _ = make(max_staleness=1, groups_per_step=4, capacity_groups=20)  # a window of 8: 4 for the externals
    ticket = q.reserve("a/r0", "a", 1, external=True)
    assert ticket is not None
    for i in range(3):
        assert q.put(rec(f"a/g{i}"), owner="a")[0]
    with pytest.raises(
        QueueFull, match=r"3 groups put without a ticket .* and 1 reserved: external.reserved_share=0.5"
    ):
        q.put(rec("b/g0"), owner="b")  # the share is all external clients'
    assert q.external_room() == 0 and q.reserve("b/r0", "b", 1, external=True) is None
    assert q.put(rec("a/g3"), ticket.ticket_id, owner="a")[0]  # a ticket's group takes the room it held
    assert q.put(rec("b/g0"), owner="b")[0]  # (3 without a ticket, and this one: 4)
    assert q.put(rec("b/g0"), owner="b") == (False, 5)  # a repeat is still a duplicate, not refused
    with pytest.raises(QueueFull, match="external.reserved_share"):
        q.put(rec("b/g1"), owner="b")
    assert q.reserve("rollout-0/r0", "rollout-0", 3) is not None  # tauflow's rollout keeps the rest of the window
    assert q.put(rec("rollout-0/g0"))[0]  # and its Puts without a ticket come in as before
    res = q.get("trainer", max_groups=2)  # a/g0, a/g1: still stored while leased
    assert res.lease is not None
    with pytest.raises(QueueFull):
        q.put(rec("b/g1"), owner="b")
    q.ack(res.lease.lease_id)  # taken by the trainer: their room in the share comes back
    assert q.put(rec("b/g1"), owner="b")[0] and q.put(rec("b/g2"), owner="b")[0]
    assert sorted(q.external_loose) == ["a/g2", "b/g0", "b/g1", "b/g2"]
    with pytest.raises(QueueFull, match="external.reserved_share"):
        q.put(rec("b/g3"), owner="b")
    q.set_max_staleness(3)  # the window's share follows tau: 8 of 16 now
    assert q.put(rec("b/g3"), owner="b")[0]


def test_external_puts_without_a_ticket_hold_at_most_their_share_of_the_capacity() -> None:
    q, _ = make(max_staleness=-1, capacity_groups=10, capacity_bytes=1000, external={"reserved_share": 0.3})
    for i in range(3):
        assert q.put(rec(f"a/g{i}", size=10), owner="a")[0]
    with pytest.raises(QueueFull, match=r"external.reserved_share=0.3 of the pacing window and of capacity_groups=10"):
        q.put(rec("a/g3", size=10), owner="a")
    for i in range(7):
        assert q.put(rec(f"rollout/g{i}", size=10))[0]  # the rest of the capacity stays tauflow's own
    q, _ = make(max_staleness=-1, capacity_groups=10, capacity_bytes=1000, external={"reserved_share": 0.3})
    assert q.put(rec("a/g0", size=200), owner="a")[0]
    with pytest.raises(
        QueueFull, match=r"200 bytes: 200 more would pass external.reserved_share=0.3 of capacity_bytes"
    ):
        q.put(rec("a/g1", size=200), owner="a")
    with pytest.raises(GroupOverCapacity, match=r"can never fit without a ticket"):
        q.put(rec("a/g2", size=301), owner="a")
    assert q.put(rec("rollout/g0", size=700))[0]


def test_external_puts_without_a_ticket_count_the_same_after_a_restart_and_a_compaction(tmp_path: Path) -> None:
    path = tmp_path / "q.wal"
    q, c = make(wal=open_wal(path), max_staleness=1, groups_per_step=4)  # 4 for the external clients
    ticket = q.reserve("a/r0", "a", 2, external=True)
    assert ticket is not None
    assert q.put(rec("a/g0"), ticket.ticket_id, owner="a")[0]  # with its ticket: not counted once put
    assert q.put(rec("a/g1"), owner="a")[0] and q.put(rec("b/g0"), owner="b")[0]
    assert q.put(rec("rollout-0/g0"))[0]
    res = q.get("trainer", max_groups=3)  # a/g0, a/g1, b/g0
    assert res.lease is not None
    q.ack(res.lease.lease_id)
    assert q.put(rec("b/g1"), owner="b")[0] and q.put(rec("b/g2"), owner="b")[0]
    expected = ({"b/g1": 16, "b/g2": 16}, 32, 3)
    assert (q.external_loose, q.external_loose_bytes, q.external_held_now()) == expected
    q = restart(q, path, c)
    assert (q.external_loose, q.external_loose_bytes, q.external_held_now()) == expected
    q.compact()
    q = restart(q, path, c)
    assert (q.external_loose, q.external_loose_bytes, q.external_held_now()) == expected
    assert q.put(rec("c/g0"), owner="c")[0]  # (1 reserved and 3 stored: the share is full)
    with pytest.raises(QueueFull, match="external.reserved_share"):
        q.put(rec("c/g1"), owner="c")
    assert q.release_reservation(ticket.ticket_id, "a") == 1
    assert q.put(rec("c/g1"), owner="c")[0]


def test_a_reserve_reusing_a_request_id_with_other_content_is_refused_and_changes_nothing() -> None:
    """Reserve(r, n_groups=1), then Reserve(r, n_groups=5), answered OK with the 1-group ticket: the caller
    believed it had room for 5."""
    q, _ = make(max_staleness=1, groups_per_step=8)
    first = q.reserve("a/r", "a", 1, external=True)
    assert first is not None
    before = fingerprint(q)
    for n, producer, external in ((5, "a", True), (1, "b", True), (1, "a", False)):
        with pytest.raises(InvalidRequest, match=r"request_id 'a/r' was already used for a Reserve of n_groups=1"):
            q.reserve("a/r", producer, n, external=external)
    assert fingerprint(q) == before
    assert q.reserve("a/r", "a", 1, external=True) == first  # an identical repeat is still idempotent
