"""Random interleavings of producers, a trainer, time, restarts and compaction against QueueState.

One run draws tau in {-1, 0, 1, 2}, groups_per_step, whether only honest producers write (ticketed
puts whose behaviour version is at least the ticket's), and whether the trainer takes exact batches
of groups_per_step. The machine keeps its own record of every accepted, acked and evicted group and
checks the queue against it after every step.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tauflow.core.staleness import is_bounded
from tauflow.queue.config import QueueConfig
from tauflow.queue.model import FailedPrecondition, GroupRecord, InvalidRequest, QueueFull
from tauflow.queue.state import QueueState
from tauflow.queue.wal import FsyncPolicy, WriteAheadLog

LEASE_S = 10.0
TICKET_TTL_S = 15.0


def fingerprint(q: QueueState) -> dict[str, Any]:
    m = q.memory
    stats = vars(q.stats()).copy()
    stats.pop("wal_bytes")
    return {
        "stats": stats,
        "pending": list(m.pending),
        "groups": {
            g: (r.payload, r.behaviour_version, r.n_tokens, r.accepted_at, r.deliveries, r.delivered_for)
            for g, r in m.groups.items()
        },
        "leases": {
            i: (x.group_ids, x.deadline, x.duration_s, x.consumer_id, x.consumer_version) for i, x in m.leases.items()
        },
        "tickets": {
            i: (t.request_id, t.n_groups, t.remaining, t.min_policy_version, t.expires_at) for i, t in m.tickets.items()
        },
        "counters": (m.accepted, m.in_flight, m.pending_bytes, m.live_bytes, m.leased_groups),
        "done": list(m.done_ids),
        "outcomes": dict(m.outcomes),
    }


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tauflow-queue-prop-")
        self.path = os.path.join(self.dir, "queue.wal")
        self.t = [1000.0]
        self.q: QueueState | None = None

    # -- setup ---------------------------------------------------------------------------

    @initialize(
        tau=st.sampled_from([0, -1, 0, 1, 2]),  # tau = 0 (synchronous) twice as often
        gps=st.integers(1, 3),
        honest=st.booleans(),
        exact=st.booleans(),
        capacity=st.sampled_from([6, 1000]),
    )
    def setup(self, tau: int, gps: int, honest: bool, exact: bool, capacity: int) -> None:
        self.tau, self.gps, self.honest, self.exact = tau, gps, honest, exact
        self.config = QueueConfig(
            max_staleness=tau,
            groups_per_step=gps,
            capacity_groups=capacity,
            capacity_bytes=1 << 30,
            default_lease_s=LEASE_S,
            reservation_ttl_s=TICKET_TTL_S,
        )
        self.q = self._open()
        self.accepted: dict[str, int] = {}  # group id -> behaviour version
        self.acked: set[str] = set()
        self.evicted: set[str] = set()
        # Of ``evicted``, those a trainer step had used: delivered for a version the trainer had passed when
        # they were evicted (a lease back unacked). They keep their count in the pacing sum.
        self.evicted_used: set[str] = set()
        self.deliveries: dict[str, int] = {}
        self.delivered_for: dict[str, int] = {}  # group id -> the version its last delivery was for
        self.tickets: dict[str, list[Any]] = {}  # ticket id -> [min version, groups left, expires_at]
        self.requests: dict[str, tuple[int, str]] = {}  # request id -> (n, ticket id)
        self.leases: dict[str, tuple[list[str], float, float]] = {}  # held by the trainer: ids, deadline, duration
        self.done_leases: list[str] = []  # acked by the trainer
        self.counter = 0

    def _open(self) -> QueueState:
        return QueueState(self.config, WriteAheadLog(self.path, FsyncPolicy.NEVER), clock=lambda: self.t[0])

    def teardown(self) -> None:
        if self.q is not None and self.q.wal is not None:
            self.q.wal.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def now(self) -> float:
        return self.t[0]

    def _new_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def _group(self, bv: int) -> GroupRecord:
        gid = self._new_id("g")
        return GroupRecord(gid, gid.encode() * 3, bv, 5 + self.counter % 7)

    def _usable_tickets(self) -> list[str]:
        return [t for t, (_, left, exp) in self.tickets.items() if left > 0 and self.now < exp]

    # -- producers -----------------------------------------------------------------------

    @precondition(lambda self: self.q is not None)
    @rule(n=st.integers(1, 4))
    def reserve(self, n: int) -> None:
        self._reserve(n)

    # ``consume`` and ``produce`` take no arguments on purpose: hypothesis tries rules with fewer
    # arguments first, so runs get far enough (several trainer steps) to mean something.

    @precondition(lambda self: self.q is not None)
    @rule()
    def produce(self) -> None:
        """Fast honest producers: reserve batches while granted, generate with the current weights."""
        assert self.q is not None
        for _ in range(self.tau + 1 if self.tau >= 0 else 2):
            tid = self._reserve(self.gps)
            if tid is None:
                return
            for _ in range(self.gps):
                self._put_ticketed(tid, self.q.trainer_version)

    def _reserve(self, n: int) -> str | None:
        q, config = self.q, self.config
        assert q is not None
        rid = self._new_id("r")
        bounded = is_bounded(config.max_staleness)
        if (bounded and n > (config.max_staleness + 1) * config.groups_per_step) or n > config.capacity_groups:
            try:
                q.reserve(rid, "p", n)
            except InvalidRequest:
                return None
            raise AssertionError("an ungrantable reservation was not refused")
        q.sweep()  # what reserve does first; makes the expected answer computable here
        st_ = q.stats()
        room = len(q.memory.groups) + st_.reserved_groups + n <= config.capacity_groups
        if bounded:
            room = (
                room
                and st_.accepted_groups + st_.reserved_groups + n
                <= (st_.trainer_version + config.max_staleness + 1) * config.groups_per_step
            )
        ticket = q.reserve(rid, "p", n)
        assert (ticket is not None) == room
        if ticket is None:
            event("reserve denied")
            assert q.stats().reserved_groups == st_.reserved_groups
            return None
        assert ticket.n_groups == n and ticket.min_policy_version == q.trainer_version
        assert ticket.expires_at == self.now + TICKET_TTL_S
        assert q.stats().reserved_groups == st_.reserved_groups + n
        self.tickets[ticket.ticket_id] = [ticket.min_policy_version, n, ticket.expires_at]
        self.requests[rid] = (n, ticket.ticket_id)
        return ticket.ticket_id

    @precondition(lambda self: self.q is not None and self.requests)
    @rule(data=st.data())
    def reserve_retry(self, data: st.DataObject) -> None:
        assert self.q is not None
        rid = data.draw(st.sampled_from(list(self.requests)))
        n, tid = self.requests[rid]
        before = self.q.stats().reserved_groups
        ticket = self.q.reserve(rid, "p", n)
        assert ticket is not None and ticket.ticket_id == tid and ticket.n_groups == n
        assert self.q.stats().reserved_groups <= before  # never reserved twice (a sweep may free some)

    @precondition(lambda self: self.q is not None and self._usable_tickets())
    @rule(data=st.data())
    def put_ticketed(self, data: st.DataObject) -> None:
        """An honest producer: weights of at least the ticket's version, at most the trainer's."""
        q = self.q
        assert q is not None
        tid = data.draw(st.sampled_from(self._usable_tickets()))
        mv = self.tickets[tid][0]
        self._put_ticketed(tid, data.draw(st.integers(mv, q.trainer_version)))

    def _put_ticketed(self, tid: str, bv: int) -> None:
        q = self.q
        assert q is not None
        group = self._group(bv)
        before = q.stats()
        new, _ = q.put(group, tid)  # never QueueFull: the ticket holds its room
        assert new
        after = q.stats()
        assert after.accepted_groups == before.accepted_groups + 1
        assert after.reserved_groups == before.reserved_groups - 1
        self.accepted[group.group_id] = bv
        self.tickets[tid][1] -= 1
        if self.tickets[tid][1] == 0:
            del self.tickets[tid]
            assert tid not in q.memory.tickets

    @precondition(lambda self: self.q is not None and not self.honest)
    @rule(back=st.integers(0, 4))
    def put_external(self, back: int) -> None:
        """An untickted source with possibly old data."""
        q = self.q
        assert q is not None
        bv = max(0, q.trainer_version - back)
        group = self._group(bv)
        full = len(q.memory.groups) + q.memory.in_flight + 1 > self.config.capacity_groups
        try:
            new, _ = q.put(group)
        except QueueFull:
            event("put: queue full")
            assert full
            assert group.group_id not in q.memory.groups
            return
        assert new and not full
        self.accepted[group.group_id] = bv

    @precondition(lambda self: self.q is not None and self.accepted)
    @rule(data=st.data())
    def put_duplicate(self, data: st.DataObject) -> None:
        q = self.q
        assert q is not None
        gid = data.draw(st.sampled_from(list(self.accepted)))
        before = fingerprint(q)
        new, depth = q.put(GroupRecord(gid, b"other", q.trainer_version, 1))
        assert not new and depth == len(q.memory.pending)
        assert fingerprint(q) == before

    @precondition(lambda self: self.q is not None and self.tickets)
    @rule(data=st.data())
    def release_ticket(self, data: st.DataObject) -> None:
        assert self.q is not None
        tid = data.draw(st.sampled_from(list(self.tickets)))
        _, left, exp = self.tickets.pop(tid)
        got = self.q.release_reservation(tid)
        if self.now < exp:
            assert got == left
        else:
            assert got in (0, left)
        assert tid not in self.q.memory.tickets
        assert self.q.release_reservation(tid) == 0

    # -- the trainer ---------------------------------------------------------------------

    def _live_leases(self) -> list[str]:
        return [i for i, (_, dl, _) in self.leases.items() if self.now < dl]

    def _can_get(self) -> bool:
        if self.q is None or (self.exact and self._live_leases()):
            return False  # an exact-batch trainer holds one batch at a time
        return bool(self.q.memory.pending) or len(self._live_leases()) < len(self.leases)

    @precondition(lambda self: self._can_get())
    @rule(
        max_groups=st.integers(1, 4),
        min_frac=st.integers(0, 4),
        max_tokens=st.sampled_from([0, 0, 8, 20]),
        lease_s=st.sampled_from([0.0, 4.0, 30.0]),
    )
    def get(self, max_groups: int, min_frac: int, max_tokens: int, lease_s: float) -> None:
        self._get(max_groups, min_frac, max_tokens, lease_s)

    @precondition(lambda self: self._can_get())
    @rule()
    def consume(self) -> None:
        """Trainer steps: a batch of (up to) groups_per_step, acked, then the version moves on."""
        for _ in range(2):
            lid = self._get(self.gps, 0, 0, 0.0)
            if lid is None:
                return
            self._ack(lid, True)

    def _get(self, max_groups: int, min_frac: int, max_tokens: int, lease_s: float) -> str | None:
        q = self.q
        assert q is not None
        if self.exact:
            max_groups = min_groups = self.gps
            max_tokens = 0
        else:
            min_groups = min(min_frac, max_groups)
        version = q.trainer_version
        expired = [i for i, (_, dl, _) in self.leases.items() if dl <= self.now]
        candidates = list(q.memory.pending)
        for i in expired:
            candidates += self.leases.pop(i)[0]
        pending_before = list(q.memory.pending)

        res = q.get(
            "trainer",
            max_groups=max_groups,
            min_groups=min_groups,
            max_tokens=max_tokens,
            lease_s=lease_s,
            consumer_version=version,
        )

        delivered = [d.group.group_id for d in res.deliveries]
        evicted = set(candidates) - set(q.memory.pending) - set(delivered)
        assert res.evicted_stale == len(evicted)
        for g in evicted:
            assert self.tau >= 0 and version - self.accepted[g] > self.tau, "evicted a fresh group"
        self.evicted |= evicted
        used = {g for g in evicted if self.delivered_for.get(g, version) < version}
        self.evicted_used |= used
        if evicted:
            event("get: evicted stale groups")
        if used:
            event("get: evicted stale groups a step had used")
        if res.lease is None:
            assert delivered == []
            if not max_tokens or min_groups <= 1:  # the whole queue was scanned: not enough fresh groups
                assert len(q.memory.pending) < max(min_groups, 1)
            return None
        assert res.lease.group_ids == delivered
        assert min_groups <= len(delivered) <= max_groups
        assert res.lease.deadline == self.now + (lease_s or LEASE_S)
        assert res.lease.consumer_version == version
        if not expired:  # FIFO: the batch is the head of the queue, minus what was evicted
            assert delivered == [g for g in pending_before if g not in evicted][: len(delivered)]
        for d in res.deliveries:
            g = d.group.group_id
            assert g in self.accepted and g not in self.acked and g not in self.evicted
            assert d.group.behaviour_version == self.accepted[g]
            assert d.staleness == max(0, version - self.accepted[g])
            if self.tau >= 0:
                assert d.staleness <= self.tau, f"delivered a group of staleness {d.staleness} > tau {self.tau}"
            if self.tau == 0 and self.honest:
                assert d.staleness == 0
            assert d.redeliveries == self.deliveries.get(g, 0)
            if d.redeliveries:
                event("get: redelivery")
            self.deliveries[g] = self.deliveries.get(g, 0) + 1
            self.delivered_for[g] = version
        if max_tokens and len(delivered) > 1:
            assert sum(d.group.n_tokens for d in res.deliveries) <= max_tokens
        self.leases[res.lease.lease_id] = (delivered, res.lease.deadline, lease_s or LEASE_S)
        return res.lease.lease_id

    @precondition(lambda self: self.q is not None and self.leases)
    @rule(data=st.data(), step=st.sampled_from([True, True, False]))
    def ack(self, data: st.DataObject, step: bool) -> None:
        q = self.q
        assert q is not None
        self._ack(data.draw(st.sampled_from(list(self.leases))), step)

    def _ack(self, lid: str, step: bool) -> None:
        q = self.q
        assert q is not None
        gids, deadline, _ = self.leases.pop(lid)
        if deadline <= self.now:
            try:
                q.ack(lid)
            except FailedPrecondition:
                event("ack: lease had expired")
                return
            raise AssertionError("ack of an expired lease succeeded")
        assert q.ack(lid) == len(gids)
        for g in gids:
            assert g not in self.acked, f"group {g} acked twice"
            assert g not in q.memory.groups
        self.acked.update(gids)
        self.done_leases.append(lid)
        if step or self.exact:  # the optimizer step is committed: the trainer's version moves on
            event(f"trainer step (tau={self.tau}, honest={self.honest}, exact={self.exact})")
            v = q.trainer_version
            assert q.set_trainer_version(v + 1) == v + 1

    @precondition(lambda self: self.q is not None and self.done_leases)
    @rule(data=st.data())
    def ack_again(self, data: st.DataObject) -> None:
        q = self.q
        assert q is not None
        lid = data.draw(st.sampled_from(self.done_leases))
        before = q.stats().acked_groups
        assert q.ack(lid) == 0
        try:
            q.nack(lid)
        except FailedPrecondition:
            pass
        else:
            raise AssertionError("nack after ack succeeded")
        assert q.stats().acked_groups == before

    @precondition(lambda self: self.q is not None and self.leases)
    @rule(data=st.data())
    def nack(self, data: st.DataObject) -> None:
        q = self.q
        assert q is not None
        lid = data.draw(st.sampled_from(list(self.leases)))
        gids, deadline, _ = self.leases.pop(lid)
        if deadline <= self.now:
            assert q.nack(lid) == 0
            return
        assert q.nack(lid) == len(gids)
        assert list(q.memory.pending)[: len(gids)] == gids  # back at the head, in their order
        assert q.nack(lid) == 0

    @precondition(lambda self: self.q is not None and self.leases)
    @rule(data=st.data(), lease_s=st.sampled_from([0.0, 3.0, 25.0]))
    def renew(self, data: st.DataObject, lease_s: float) -> None:
        q = self.q
        assert q is not None
        lid = data.draw(st.sampled_from(list(self.leases)))
        gids, deadline, _ = self.leases[lid]
        if deadline <= self.now:
            del self.leases[lid]
            try:
                q.renew(lid, lease_s)
            except FailedPrecondition:
                return
            raise AssertionError("renew of an expired lease succeeded")
        lease = q.renew(lid, lease_s)
        assert lease.deadline == self.now + (lease_s or LEASE_S)
        self.leases[lid] = (gids, lease.deadline, lease_s or LEASE_S)

    # -- time and restarts ---------------------------------------------------------------

    @precondition(lambda self: self.q is not None)
    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 4.0, 11.0, 16.0]))
    def advance(self, dt: float) -> None:
        self.t[0] += dt

    @precondition(lambda self: self.q is not None and self.q.next_deadline() is not None)
    @rule()
    def sweep(self) -> None:
        assert self.q is not None
        res = self.q.sweep()
        expired = [i for i, (_, dl, _) in self.leases.items() if dl <= self.now]
        assert res.expired_leases <= len(expired)
        for i in self.leases:
            assert (i in self.q.memory.leases) == (i not in expired)
        assert all(t.expires_at > self.now for t in self.q.memory.tickets.values())

    @precondition(lambda self: self.q is not None)
    @rule(compact=st.booleans())
    def restart(self, compact: bool) -> None:
        q = self.q
        assert q is not None and q.wal is not None
        if compact:
            self._compact()
        before = fingerprint(q)
        q.wal.close()
        self.q = self._open()
        # Every lease the queue still held gets its duration anew from the restart (expired ones too, if no
        # call had swept them yet); the rest of the state is exactly what it was.
        for i in q.memory.leases:
            gids, dl, duration = self.leases[i]
            self.leases[i] = (gids, max(dl, self.now + duration), duration)
        before["leases"] = {
            i: (gids, max(dl, self.now + duration), duration, *rest)
            for i, (gids, dl, duration, *rest) in before["leases"].items()
        }
        assert fingerprint(self.q) == before
        assert self.q.stats().wal_bytes == os.path.getsize(self.path)

    @precondition(lambda self: self.q is not None and self.q.compaction_due(256))
    @rule()
    def compact(self) -> None:
        event("compacted")
        self._compact()

    def _compact(self) -> None:
        q = self.q
        assert q is not None
        before = fingerprint(q)
        q.compact()
        assert fingerprint(q) == before
        assert q.stats().wal_bytes == os.path.getsize(self.path)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def no_group_is_lost(self) -> None:
        q = self.q
        if q is None:
            return
        pending = list(q.memory.pending)
        leased = [g for lease in q.memory.leases.values() for g in lease.group_ids]
        assert len(set(pending)) == len(pending) and len(set(leased)) == len(leased)
        p, ls = set(pending), set(leased)
        assert not (p & ls) and p | ls == set(q.memory.groups)
        assert not (self.acked & self.evicted) and not ((p | ls) & (self.acked | self.evicted))
        assert p | ls | self.acked | self.evicted == set(self.accepted), "an accepted group went missing"
        s = q.stats()
        assert s.depth_groups == len(p) and s.leased_groups == len(ls)
        assert s.acked_groups == len(self.acked)
        assert s.evicted_groups.get("stale", 0) == len(self.evicted)
        assert s.accepted_groups == len(self.accepted) - len(self.evicted - self.evicted_used)
        assert s.depth_bytes == sum(q.memory.groups[g].size for g in p)

    @invariant()
    def leases_and_tickets_agree(self) -> None:
        q = self.q
        if q is None:
            return
        assert set(q.memory.leases) <= set(self.leases)
        for i, (gids, dl, _) in self.leases.items():
            if self.now < dl:
                assert (
                    i in q.memory.leases and q.memory.leases[i].group_ids == gids and q.memory.leases[i].deadline == dl
                )
        assert set(q.memory.tickets) <= set(self.tickets)
        for tid in self._usable_tickets():
            assert q.memory.tickets[tid].remaining == self.tickets[tid][1]
        assert q.stats().reserved_groups == sum(t.remaining for t in q.memory.tickets.values())

    @invariant()
    def bounds_hold(self) -> None:
        q = self.q
        if q is None:
            return
        s = q.stats()
        assert len(q.memory.groups) + s.reserved_groups <= self.config.capacity_groups
        if self.honest and self.tau >= 0:
            # Pacing: with honest producers the rule holds at all times, not only when granting.
            limit = (s.trainer_version + self.tau + 1) * self.gps
            assert s.accepted_groups + s.reserved_groups <= limit
        if self.honest and self.tau == 0 and self.exact:
            # Synchronous training: production and consumption alternate, nothing is ever too stale.
            assert s.accepted_groups + s.reserved_groups <= (s.trainer_version + 1) * self.gps
            assert not self.evicted


QueueMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestQueueStateMachine = QueueMachine.TestCase
