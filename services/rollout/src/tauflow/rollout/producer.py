"""The rollout loop: reserve room in the queue, generate G samples per prompt, score them, put the groups.

    ticket = reserve(k)                     # pacing: never generate what would be too stale
    engine.wait_for_version(ticket.min_policy_version)
    completions = generate(k prompts, n=G)  # tokens carry the version that sampled them
    rewards = score(groups)                 # the reward service
    put(group, ticket) for each group       # idempotent by group id: retried until the queue has it

Tracing (docs/observability.md): one trace per ticket, as the work is batched: a root span
``rollout.ticket`` holding one ``rollout.generate`` and one ``reward.score`` for its groups, and one
``queue.put`` per group. A group's ``queue.put`` context goes into its ``trace_context``, so the queue
stores it and the trainer links to it: from the link, the group's trace leads back to the generation and
the scoring that made it. (A span per group per phase cost 9 % of a step on 2 cores: bench/README.md.)

Several tickets are worked on at once, so generation overlaps scoring and puts. A group the queue can
never take (larger than its bounds) is dropped, logged and counted, and the rest of its ticket released;
production goes on. When the producer stops, the tickets it has not filled are released at once, so
their room does not wait for the queue's ticket TTL. The loop never imports grpc: it talks to the queue
and the reward service through the ports below.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry import trace

from tauflow.core.telemetry import set_error, traceparent_of
from tauflow.rollout.dataset import Prompt
from tauflow.rollout.engine.base import Completion, GenerationEngine, SamplingParams
from tauflow.rollout.metrics import RolloutMetrics

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tauflow.rollout")


@contextlib.contextmanager
def _child(name: str, parent: trace.Span, **attributes: object) -> Iterator[trace.Span]:
    """A span ``name`` under ``parent``, current meanwhile (so a gRPC call made inside lands in the
    ticket's trace); an error sets its status."""
    with tracer.start_as_current_span(
        name, context=trace.set_span_in_context(parent), attributes=attributes,
        record_exception=False, set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except Exception as e:
            set_error(span, e)
            raise


class GroupRejected(Exception):
    """The queue refused a group for good (``reason``, e.g. ``too_large``): sending it again cannot help."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Ticket:
    ticket_id: str
    n_groups: int
    min_policy_version: int


@dataclass
class ProducedGroup:
    group_id: str
    prompt: Prompt
    completions: list[Completion]
    texts: list[str]
    rewards: list = field(default_factory=list)  # type: ignore[type-arg]  # filled by the reward port
    producer_id: str = ""
    created_at: float = 0.0
    traceparent: str = ""  # W3C context of the group's `queue.put` span, stored with the group
    tracestate: str = ""

    @property
    def behaviour_version(self) -> int:
        """The oldest policy version of any token of the group (0 when it has none)."""
        return min((v for c in self.completions for v in c.versions), default=0)


class QueuePort(Protocol):
    async def reserve(self, request_id: str, n_groups: int, wait_s: float) -> Ticket | None: ...

    async def put(self, group: ProducedGroup, ticket_id: str) -> None:
        """Returns once the queue holds the group (retrying while it is unavailable or full); raises
        GroupRejected when the queue can never take it."""

    async def release(self, ticket_id: str, timeout_s: float | None = None) -> None:
        """Gives back the unused part of a ticket; best effort (an unreleased ticket expires by itself)."""


class RewardPort(Protocol):
    async def score(self, groups: Sequence[ProducedGroup]) -> None:
        """Fills ``rewards`` of every group."""


@dataclass
class ProducerSettings:
    producer_id: str
    group_size: int
    groups_per_ticket: int
    tickets_in_flight: int
    sampling: SamplingParams
    reserve_wait_s: float = 5.0
    release_timeout_s: float = 2.0  # deadline of the releases on shutdown, which must not hold the stop up


class Producer:
    def __init__(
        self,
        engine: GenerationEngine,
        prompts: Iterator[Prompt],
        queue: QueuePort,
        reward: RewardPort,
        settings: ProducerSettings,
        decode=None,  # type: ignore[no-untyped-def]
        metrics: RolloutMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.prompts = prompts
        self.queue = queue
        self.reward = reward
        self.s = settings
        self.decode = decode or (lambda ids: "")
        self.metrics = metrics or RolloutMetrics.null()
        self.groups_produced = 0
        self.groups_dropped = 0
        self.groups_in_flight = 0
        self._serial = itertools.count()
        self._open_tickets: set[str] = set()  # granted and not yet filled or released

    async def run(self) -> None:
        slots = asyncio.Semaphore(self.s.tickets_in_flight)
        tasks: set[asyncio.Task[None]] = set()
        failures: list[BaseException] = []

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            slots.release()
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())  # type: ignore[arg-type]

        try:
            while True:
                await slots.acquire()
                if failures:
                    raise failures[0]  # a ticket failed: stop, so the service exits and is restarted
                ticket = await self.queue.reserve(uuid.uuid4().hex, self.s.groups_per_ticket, self.s.reserve_wait_s)
                if ticket is None:
                    slots.release()
                    continue
                self._open_tickets.add(ticket.ticket_id)
                task = asyncio.create_task(self._produce(ticket))
                tasks.add(task)
                task.add_done_callback(done)
        finally:
            for t in tasks:
                t.cancel()
            # Runs while the producer is being cancelled (the service stops): shielded, so that a second
            # cancellation does not cut the releases short.
            await asyncio.shield(self._stop(list(tasks)))

    async def _stop(self, tasks: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._release_open_tickets()

    async def _release_open_tickets(self) -> None:
        """Gives the queue back the room of the tickets not filled, each under a short deadline so that an
        unreachable queue does not hold the stop up (an unreleased ticket expires by its TTL)."""
        open_tickets, self._open_tickets = sorted(self._open_tickets), set()
        if not open_tickets:
            return
        await asyncio.gather(
            *(self.queue.release(t, self.s.release_timeout_s) for t in open_tickets), return_exceptions=True
        )
        self.metrics.released_tickets.labels("stopped").inc(len(open_tickets))
        log.info("released the unfilled tickets", extra={"tickets": len(open_tickets)})

    async def _produce(self, ticket: Ticket) -> None:
        prompts = [next(self.prompts) for _ in range(ticket.n_groups)]
        self.groups_in_flight += len(prompts)
        root = tracer.start_span(
            "rollout.ticket", context=trace.set_span_in_context(trace.INVALID_SPAN),
            attributes={"rl.ticket_id": ticket.ticket_id, "rl.producer_id": self.s.producer_id,
                        "rl.groups": len(prompts), "rl.group_size": self.s.group_size,
                        "rl.ticket_min_policy_version": ticket.min_policy_version},
        )
        try:
            # The ticket's version: data generated with older weights could be too stale to train on.
            # (in short waits, so that a shutdown never waits on a blocked worker thread)
            while not await asyncio.to_thread(self.engine.wait_for_version, ticket.min_policy_version, 1.0):
                pass
            params = dataclasses.replace(self.s.sampling, n=self.s.group_size)
            with _child("rollout.generate", root) as span:
                completions = await self.engine.generate([p.token_ids for p in prompts], params)
                span.set_attributes({
                    "rl.samples": sum(len(cs) for cs in completions),
                    "rl.completion_tokens": sum(len(c.token_ids) for cs in completions for c in cs),
                    "rl.policy_version": min((v for cs in completions for c in cs for v in c.versions), default=0),
                })
            now = time.time()
            groups = [
                ProducedGroup(
                    group_id=f"{self.s.producer_id}-{ticket.ticket_id[:12]}-{next(self._serial)}",
                    prompt=p,
                    completions=cs,
                    texts=[self.decode(c.token_ids) for c in cs],
                    producer_id=self.s.producer_id,
                    created_at=now,
                )
                for p, cs in zip(prompts, completions, strict=True)
            ]
            with _child("reward.score", root, **{"rl.groups": len(groups)}):
                await self.reward.score(groups)
            accepted = await asyncio.gather(*(self._put(g, ticket.ticket_id, root) for g in groups))
            self.groups_produced += sum(accepted)
            if not all(accepted):  # the dropped groups' room would otherwise be held until the ticket's TTL
                await self.queue.release(ticket.ticket_id)
                self.metrics.released_tickets.labels("dropped").inc()
            self._open_tickets.discard(ticket.ticket_id)
        except asyncio.CancelledError:
            raise  # the producer stops; run() releases the open tickets
        except Exception as e:
            set_error(root, e)
            log.exception("a ticket failed; releasing it", extra={"ticket": ticket.ticket_id})
            self._open_tickets.discard(ticket.ticket_id)
            await self.queue.release(ticket.ticket_id)
            raise
        finally:
            self.groups_in_flight -= len(prompts)
            root.end()

    async def _put(self, group: ProducedGroup, ticket_id: str, root: trace.Span = trace.INVALID_SPAN) -> bool:
        """Puts one group; False when the queue refused it for good (dropped: production goes on). The
        group's ``queue.put`` span is the one its trace context names (the trainer links to it)."""
        try:
            with _child("queue.put", root, **_group_attributes(group)) as span:
                group.traceparent, group.tracestate = traceparent_of(span)
                await self.queue.put(group, ticket_id)
        except GroupRejected as e:
            self.groups_dropped += 1
            self.metrics.dropped_groups.labels(e.reason).inc()
            log.error(
                "the queue refused a group for good; dropped",
                extra={"group_id": group.group_id, "reason": e.reason, "error": str(e)},
            )
            return False
        return True


def _group_attributes(g: ProducedGroup) -> dict[str, object]:
    attributes: dict[str, object] = {
        "rl.group_id": g.group_id,
        "rl.prompt_id": g.prompt.prompt_id,
        "rl.policy_version": g.behaviour_version,
        "rl.samples": len(g.completions),
        "rl.prompt_tokens": len(g.prompt.token_ids) * len(g.completions),
        "rl.completion_tokens": sum(len(c.token_ids) for c in g.completions),
    }
    if g.rewards:
        scores = [float(getattr(r, "score", r)) for r in g.rewards]  # common.v1.Reward (or a number)
        attributes["rl.reward_mean"] = sum(scores) / len(scores)
    return attributes
