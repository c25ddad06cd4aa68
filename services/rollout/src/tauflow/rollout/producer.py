"""The rollout loop: reserve room in the queue, generate G samples per prompt, score them, put the groups.

    ticket = reserve(k)                     # pacing: never generate what would be too stale
    engine.wait_for_version(ticket.min_policy_version)
    completions = generate(k prompts, n=G)  # tokens carry the version that sampled them
    rewards = score(groups)                 # the reward service (and the greedy baselines', for REMAX)
    keep = filter(groups)                   # dynamic sampling (DAPO): groups of equal rewards go
    put(group, ticket) for each kept group  # idempotent by group id: retried until the queue has it
    release(ticket) if fewer than k         # the room of what was filtered or dropped is refilled

Tracing (docs/observability.md): one trace per ticket, as the work is batched: a root span
``rollout.ticket`` holding one ``rollout.generate`` and one ``reward.score`` for its groups, and one
``queue.put`` per group. A group's ``queue.put`` context goes into its ``trace_context``, so the queue
stores it and the trainer links to it: from the link, the group's trace leads back to the generation and
the scoring that made it. (A span per group per phase cost 9 % of a step on 2 cores: bench/README.md.)

Up to ``tickets_in_flight`` tickets generate at once, and a ticket gives up its place as soon as its
generation ends: the next ticket generates while the last one is scored and put, so the engine is not idle
while the reward service and the queue work (at most ``tickets_in_flight`` more tickets are being scored
and put meanwhile). A group the queue can
never take (larger than its bounds) is dropped, logged and counted, and the rest of its ticket released;
production goes on. With dynamic sampling (``dynamic_sampling.enabled``, DAPO's), a group whose rewards
are all equal is filtered before it reaches the queue (it would train nothing under a group baseline) and
counted; the rest of its ticket is released, so the next Reserve refills that room with new prompts: the
steps stay full of groups with a signal, and the queue counts only what it accepted. With ``oversample``
the producer generates more prompts than the ticket's groups and puts the first that pass. A ticket that fails otherwise is released and stops the loop (the service exits and
is restarted). When the producer stops, the tickets it has not filled are released at once, so their
room does not wait for the queue's ticket TTL. The loop never imports grpc: it talks to the queue and
the reward service through ``ports.QueuePort`` and ``ports.RewardPort``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from tauflow.core.telemetry import set_error, traceparent_of
from tauflow.media import InvalidMedia, PromptPart, counts
from tauflow.models.processor import Processed
from tauflow.rollout.config import RolloutConfig, SamplingConfig
from tauflow.rollout.dataset import Prompt
from tauflow.rollout.engine.base import Completion, GenerationEngine, SamplingParams
from tauflow.rollout.metrics import RolloutMetrics
from tauflow.rollout.ports import GroupRejected, ProducedGroup, QueuePort, RewardPort, Ticket

log = logging.getLogger(__name__)
MAX_SKIPPED_IN_A_ROW = 1000  # prompts the model cannot take, drawn in a row, before the producer gives up
EMPTY_TICKET_WARNING_S = 60.0  # at most one warning this often when dynamic sampling filters a whole ticket
tracer = trace.get_tracer("tauflow.rollout")


class Producer:
    def __init__(
        self,
        engine: GenerationEngine,
        prompts: Iterator[Prompt],
        queue: QueuePort,
        reward: RewardPort,
        config: RolloutConfig,
        *,
        decode: Callable[[list[int]], str] | None = None,
        metrics: RolloutMetrics | None = None,
        processor: Callable[[list[PromptPart]], Processed] | None = None,
        reserve_wait_s: float = 5.0,
        release_timeout_s: float = 2.0,  # deadline of the releases on shutdown, which must not hold the stop up
    ) -> None:
        self.engine = engine
        self.prompts = prompts
        self.queue = queue
        self.reward = reward
        self.producer_id = config.server_id
        self.group_size = config.group_size
        self.groups_per_ticket = config.groups_per_ticket
        self.tickets_in_flight = config.tickets_in_flight
        self.sampling = sampling_params(config.sampling, n=config.group_size)
        # REMAX: one greedy completion per prompt, whose reward is the group's baseline
        self.greedy = dataclasses.replace(self.sampling, temperature=0.0, n=1) if config.greedy_baseline else None
        self.dynamic_sampling = config.dynamic_sampling
        self.decode = decode or (lambda ids: "")
        self.metrics = metrics or RolloutMetrics.null()
        self.processor = processor
        """A multimodal model's processor: a drawn prompt's parts -> its token ids and encoder inputs."""
        self.max_prompt_tokens = config.max_prompt_tokens
        self.prompts_skipped = 0
        """Prompts this model cannot take (undecodable media, a modality it lacks, too long), not generated."""
        self.reserve_wait_s = reserve_wait_s
        self.release_timeout_s = release_timeout_s
        self.groups_produced = 0
        self.groups_dropped = 0
        self.groups_filtered = 0
        """Groups of equal rewards that dynamic sampling kept out of the queue."""
        self.groups_surplus = 0
        """Groups that passed the filter beyond their ticket's room (with oversample > 1), dropped."""
        self.groups_in_flight = 0
        self._last_empty_warning = -math.inf
        self._serial = itertools.count()
        self._open_tickets: set[str] = set()  # granted and not yet filled or released

    async def run(self) -> None:
        """Generates ``tickets_in_flight`` tickets at once (and scores and puts as many more) until
        cancelled, or until a ticket fails."""
        workers = _Workers(generating=self.tickets_in_flight, finishing=self.tickets_in_flight)
        # A process with this producer id that was killed left its tickets behind: give them back first.
        released = await self.queue.release_producer()
        if released:
            log.info("released the tickets of this producer's previous process", extra={"tickets": released})
        # A Reserve per open ticket waits in the queue at once: when the trainer's new version opens room,
        # the tickets are granted together, the first prefilled in one batch, the next ready to start as
        # soon as a place to generate frees (no Reserve in between).
        places = self.tickets_in_flight * 2
        reservers = [asyncio.create_task(self._reserve_forever(workers)) for _ in range(places)]
        try:
            done, _ = await asyncio.wait(reservers, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # (the ticket that failed)
        finally:
            for task in reservers:
                task.cancel()
            # Runs while the producer is being cancelled (the service stops): shielded, so that a second
            # cancellation does not cut the releases short.
            await asyncio.shield(self._stop(reservers + workers.cancel_all()))

    async def _reserve_forever(self, workers: _Workers) -> None:
        while True:
            await workers.open_slot()
            ticket = await self.queue.reserve(uuid.uuid4().hex, self.groups_per_ticket, self.reserve_wait_s)
            if ticket is None:
                workers.slot_unused()
                continue
            self._open_tickets.add(ticket.ticket_id)
            await workers.generate_slot()
            workers.start(functools.partial(self._produce, ticket))

    async def _produce(self, ticket: Ticket, generated: Callable[[], None] = lambda: None) -> None:
        """Generates, scores and puts the ticket's groups; ``generated()`` is called once its generation
        is done (the next ticket may generate meanwhile)."""
        n_prompts = ticket.n_groups
        if self.dynamic_sampling.enabled:
            n_prompts = math.ceil(ticket.n_groups * self.dynamic_sampling.oversample)
        prompts = [await self._draw() for _ in range(n_prompts)]
        async with self._working_on(ticket, prompts) as root:
            await self._wait_for_version(ticket.min_policy_version)
            with _child("rollout.generate", root) as span:
                token_ids = [p.token_ids for p in prompts]
                inputs = [p.media for p in prompts] if any(p.media for p in prompts) else None
                completions, greedy = await asyncio.gather(
                    self.engine.generate(token_ids, self.sampling, inputs),
                    self.engine.generate(token_ids, self.greedy, inputs) if self.greedy is not None else _nothing(),
                )
                span.set_attributes(_generation_attributes(completions))
            generated()
            groups = self._groups(ticket, prompts, completions)
            baselines = self._groups(ticket, prompts, greedy) if greedy else []
            with _child("reward.score", root, **{"rl.groups": len(groups)}):
                await self.reward.score(groups + baselines)
            for group, baseline in zip(groups, baselines, strict=False):
                group.baseline_reward = reward_scores(baseline)[0]
            groups = self._filter(groups, ticket, root)
            accepted = await asyncio.gather(*(self._put(g, ticket.ticket_id, root) for g in groups))
            self.groups_produced += sum(accepted)
            if sum(accepted) < ticket.n_groups:
                # the room of the groups filtered or dropped would otherwise be held until the ticket's TTL;
                # released, the next Reserve refills it
                await self.queue.release(ticket.ticket_id)
                self.metrics.released_tickets.labels("dropped" if not all(accepted) else "filtered").inc()
            self._open_tickets.discard(ticket.ticket_id)

    async def _draw(self) -> Prompt:
        """The next prompt, a multimodal one processed (off the event loop: it decodes media). A prompt the
        model cannot take is skipped, logged and counted; a data set of nothing else stops the producer."""
        for _ in range(MAX_SKIPPED_IN_A_ROW):
            prompt = next(self.prompts)
            reason = why = ""
            processor = self.processor
            if prompt.needs_processing and processor is None:
                reason, why = "invalid_media", "the prompt has parts and the model has no processor (a text model)"
            elif prompt.needs_processing and processor is not None:
                try:
                    processed = await asyncio.to_thread(processor, prompt.parts)
                except (InvalidMedia, ValueError) as e:
                    reason, why = "invalid_media", str(e)
                else:
                    prompt = dataclasses.replace(
                        prompt, token_ids=processed.token_ids, parts=processed.parts, media=processed.inputs
                    )
            if not reason and self.max_prompt_tokens and len(prompt.token_ids) > self.max_prompt_tokens:
                reason, why = (
                    "too_long",
                    f"{len(prompt.token_ids)} tokens, over max_prompt_tokens {self.max_prompt_tokens}",
                )
            if not reason:
                return prompt
            self.prompts_skipped += 1
            self.metrics.skipped_prompts.labels(reason).inc()
            log.warning("prompt skipped: %s", why, extra={"prompt_id": prompt.prompt_id})
        raise RuntimeError(f"{MAX_SKIPPED_IN_A_ROW} prompts in a row could not be taken; see the log")

    def _filter(self, groups: list[ProducedGroup], ticket: Ticket, root: trace.Span) -> list[ProducedGroup]:
        """Dynamic sampling: the groups with a signal (rewards not all equal), at most the ticket's room."""
        if not self.dynamic_sampling.enabled:
            return groups
        kept = [g for g in groups if not equal_rewards(g)]
        filtered = len(groups) - len(kept)
        surplus = max(0, len(kept) - ticket.n_groups)
        kept = kept[: ticket.n_groups]
        self.groups_filtered += filtered
        self.groups_surplus += surplus
        self.metrics.filtered_groups.labels("equal_rewards").inc(filtered)
        self.metrics.filtered_groups.labels("surplus").inc(surplus)
        root.set_attributes({"rl.filtered_groups": filtered, "rl.surplus_groups": surplus})
        if not kept and time.monotonic() - self._last_empty_warning > EMPTY_TICKET_WARNING_S:
            # every prompt all right or all wrong: the trainer waits until groups with a signal come
            self._last_empty_warning = time.monotonic()
            log.warning(
                "dynamic sampling filtered every group of a ticket (rewards all equal); generating more",
                extra={"ticket": ticket.ticket_id, "groups": len(groups), "filtered_total": self.groups_filtered},
            )
        return kept

    @contextlib.asynccontextmanager
    async def _working_on(self, ticket: Ticket, prompts: list[Prompt]) -> AsyncIterator[trace.Span]:
        """The ticket's root span and in-flight count, meanwhile; a ticket that fails is released."""
        self.groups_in_flight += len(prompts)
        root = tracer.start_span(
            "rollout.ticket",
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            attributes={
                "rl.ticket_id": ticket.ticket_id,
                "rl.producer_id": self.producer_id,
                "rl.groups": len(prompts),
                "rl.group_size": self.group_size,
                "rl.ticket_min_policy_version": ticket.min_policy_version,
            },
        )
        try:
            yield root
        except Exception as e:  # (not a cancellation: the producer stops, and run() releases the open tickets)
            set_error(root, e)
            log.exception("a ticket failed; releasing it", extra={"ticket": ticket.ticket_id})
            self._open_tickets.discard(ticket.ticket_id)
            await self.queue.release(ticket.ticket_id)
            raise
        finally:
            self.groups_in_flight -= len(prompts)
            root.end()

    async def _wait_for_version(self, version: int) -> None:
        """Until the engine serves the ticket's version: data generated with older weights could be too
        stale to train on. In short waits, so that a shutdown never waits on a blocked worker thread."""
        while not await asyncio.to_thread(self.engine.wait_for_version, version, 1.0):
            pass

    def _groups(
        self, ticket: Ticket, prompts: list[Prompt], completions: list[list[Completion]]
    ) -> list[ProducedGroup]:
        now = time.time()
        return [
            ProducedGroup(
                group_id=f"{self.producer_id}-{ticket.ticket_id[:12]}-{next(self._serial)}",
                prompt=prompt,
                completions=group,
                texts=[self.decode(c.token_ids) for c in group],
                producer_id=self.producer_id,
                created_at=now,
            )
            for prompt, group in zip(prompts, completions, strict=True)
        ]

    async def _put(self, group: ProducedGroup, ticket_id: str, root: trace.Span = trace.INVALID_SPAN) -> bool:
        """Puts one group; False when the queue refused it for good (dropped: production goes on). The
        group's ``queue.put`` span is the one its trace context names (the trainer links to it)."""
        # (not made current: a put makes no traced call, and attaching a context per group costs)
        span = tracer.start_span(
            "queue.put", context=trace.set_span_in_context(root), attributes=_group_attributes(group)
        )
        try:
            group.traceparent, group.tracestate = traceparent_of(span)
            await self.queue.put(group, ticket_id)
        except GroupRejected as e:
            set_error(span, e)
            self.groups_dropped += 1
            self.metrics.dropped_groups.labels(e.reason).inc()
            log.error(
                "the queue refused a group for good; dropped",
                extra={"group_id": group.group_id, "reason": e.reason, "error": str(e)},
            )
            return False
        except Exception as e:
            set_error(span, e)
            raise
        finally:
            span.end()
        return True

    async def _stop(self, tasks: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._release_open_tickets()

    async def _release_open_tickets(self) -> None:
        """Gives the queue back the room of the tickets not filled, under a short deadline so that an
        unreachable queue does not hold the stop up (an unreleased ticket expires by its TTL). All of this
        producer's at once: a Reserve given up on at the stop may have been granted a ticket it never
        heard of, and a release of its own tickets could grant one to such a Reserve."""
        open_tickets, self._open_tickets = sorted(self._open_tickets), set()
        released = await self.queue.release_producer(self.release_timeout_s)
        if released is None:  # (a queue without ReleaseProducerReservations: the tickets known, one by one)
            await asyncio.gather(
                *(self.queue.release(t, self.release_timeout_s) for t in open_tickets), return_exceptions=True
            )
            released = len(open_tickets)
        if released:
            self.metrics.released_tickets.labels("stopped").inc(released)
            log.info("released the unfilled tickets", extra={"tickets": released})


async def _nothing() -> list[list[Completion]]:
    return []


def reward_scores(group: ProducedGroup) -> list[float]:
    return [float(r) if isinstance(r, int | float) else r.score for r in group.rewards]


def equal_rewards(group: ProducedGroup) -> bool:
    """Every sample of the group scored the same (DAPO: accuracy 0 or 1): no signal for a group baseline."""
    scores = reward_scores(group)
    return len(set(scores)) <= 1


def sampling_params(config: SamplingConfig, n: int = 1) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop_token_ids=tuple(config.stop_token_ids),
        stop=tuple(config.stop),
        n=n,
    )


class _Workers:
    """The tickets worked on: at most ``generating`` of them generate at once, and at most ``finishing``
    more are reserved ahead or scored and put after their generation. The first that failed is raised by
    the next wait for a slot: the producer stops, so that the service exits and is restarted."""

    def __init__(self, generating: int, finishing: int) -> None:
        self._generating = asyncio.Semaphore(generating)
        self._open = asyncio.Semaphore(generating + finishing)
        self._tasks: set[asyncio.Task[None]] = set()
        self._failures: list[BaseException] = []

    async def open_slot(self) -> None:
        """Until one more ticket may be open (reserved, generated, scored or put)."""
        await self._open.acquire()
        self._raise_failure()

    async def generate_slot(self) -> None:
        """Until an open ticket may start generating (then ``start`` it)."""
        await self._generating.acquire()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failures:
            raise self._failures[0]

    def slot_unused(self) -> None:
        """The open slot taken for a Reserve that granted nothing."""
        self._open.release()

    def start(self, work: Callable[[Callable[[], None]], Coroutine[Any, Any, None]]) -> None:
        """Runs ``work(generated)``, which calls ``generated()`` when its generation is done; it gives
        up its place to generate then, or when it ends, whichever comes first."""
        done_generating = False

        def generated() -> None:
            nonlocal done_generating
            if not done_generating:
                done_generating = True
                self._generating.release()

        def done(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            generated()
            self._open.release()
            if not task.cancelled() and task.exception() is not None:
                self._failures.append(task.exception())  # type: ignore[arg-type]

        task = asyncio.create_task(work(generated))
        self._tasks.add(task)
        task.add_done_callback(done)

    def cancel_all(self) -> list[asyncio.Task[None]]:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks


@contextlib.contextmanager
def _child(name: str, parent: trace.Span, **attributes: AttributeValue) -> Iterator[trace.Span]:
    """A span ``name`` under ``parent``, current meanwhile (so a gRPC call made inside lands in the
    ticket's trace); an error sets its status."""
    with tracer.start_as_current_span(
        name,
        context=trace.set_span_in_context(parent),
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except Exception as e:
            set_error(span, e)
            raise


def _generation_attributes(completions: list[list[Completion]]) -> dict[str, AttributeValue]:
    return {
        "rl.samples": sum(len(group) for group in completions),
        "rl.completion_tokens": sum(len(c.token_ids) for group in completions for c in group),
        "rl.policy_version": min((v for group in completions for c in group for v in c.versions), default=0),
    }


def _group_attributes(g: ProducedGroup) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "rl.group_id": g.group_id,
        "rl.prompt_id": g.prompt.prompt_id,
        "rl.policy_version": g.behaviour_version,
        "rl.samples": len(g.completions),
        "rl.prompt_tokens": len(g.prompt.token_ids) * len(g.completions),
        "rl.completion_tokens": sum(len(c.token_ids) for c in g.completions),
    }
    if g.prompt.parts:  # what the group's media weigh, by modality (the queue carries them once per group)
        weights = counts(g.prompt.parts)
        for kind, n in weights.parts.items():
            if kind != "text":
                attributes[f"rl.media.{kind}_parts"] = n
                attributes[f"rl.media.{kind}_bytes"] = weights.bytes[kind]
    if g.rewards:
        scores = reward_scores(g)
        attributes["rl.reward_mean"] = sum(scores) / len(scores)
    return attributes
