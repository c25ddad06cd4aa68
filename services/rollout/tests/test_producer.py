"""The producer loop against fake ports: groups the queue can never take are dropped while production goes on,
and a stopped producer gives its unfilled tickets back at once instead of leaving them to the queue's TTL."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tauflow.rollout.config import DynamicSamplingConfig, RolloutConfig, SamplingConfig
from tauflow.rollout.dataset import Prompt
from tauflow.rollout.engine.base import Completion, FinishReason, SamplingParams
from tauflow.rollout.metrics import RolloutMetrics
from tauflow.rollout.ports import GroupRejected, ProducedGroup, Ticket
from tauflow.rollout.producer import Producer


class FakeEngine:
    policy_version = 0

    def __init__(self, block: bool = False) -> None:
        self.block = block
        self.media: list[Any] = []  # the media of each generate call

    def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
        return True

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, media: Any = None
    ) -> list[list[Completion]]:
        self.media.append(media)
        if self.block:
            await asyncio.Event().wait()  # generation never ends: the service stops mid-ticket
        token = 7 if params.temperature == 0 else 5  # greedy decoding says 7, sampling 5
        return [[Completion([token], [-0.1], [0], FinishReason.STOP) for _ in range(params.n)] for _ in prompts]


class FakeQueue:
    def __init__(
        self, too_large: frozenset[str] = frozenset(), release_s: float = 0.0, release_by_producer: bool = True
    ) -> None:
        self.groups: list[ProducedGroup] = []
        self.too_large = too_large
        self.release_s = release_s
        self.tickets: list[str] = []
        self.puts: list[tuple[str, str]] = []  # (prompt id, ticket id)
        self.released: list[tuple[str, float | None]] = []
        self.predecessors_released: int | None = None  # tickets reserved when release_producer was first called
        self.release_by_producer = release_by_producer  # False: a queue without ReleaseProducerReservations
        self.released_by_producer: list[tuple[list[str], float | None]] = []

    async def reserve(self, request_id: str, n_groups: int, wait_s: float) -> Ticket | None:
        await asyncio.sleep(0)
        self.tickets.append(f"t{len(self.tickets)}")
        return Ticket(self.tickets[-1], n_groups, 0)

    async def put(self, group: ProducedGroup, ticket_id: str) -> None:
        if group.prompt.prompt_id in self.too_large:
            raise GroupRejected("too_large", f"group {group.group_id} is over the limit")
        self.puts.append((group.prompt.prompt_id, ticket_id))
        self.groups.append(group)

    async def release(self, ticket_id: str, timeout_s: float | None = None) -> None:
        await asyncio.sleep(self.release_s)
        self.released.append((ticket_id, timeout_s))

    async def release_producer(self, timeout_s: float | None = None) -> int | None:
        if self.predecessors_released is None:
            self.predecessors_released = len(self.tickets)  # before any Reserve of this producer
        await asyncio.sleep(self.release_s)
        if not self.release_by_producer:
            return None
        done = {t for t, _ in self.released} | {t for _, t in self.puts}
        for earlier, _ in self.released_by_producer:
            done |= set(earlier)
        held = [t for t in self.tickets if t not in done]  # (a ticket with a put counts as filled)
        self.released_by_producer.append((held, timeout_s))
        return len(held)


class FakeReward:
    async def score(self, groups: Sequence[ProducedGroup]) -> None:
        for g in groups:
            g.rewards = [1.0] * len(g.completions)


class FlatReward:
    """Prompts whose id starts with "flat" score the same for every sample (no signal); others 0 and 1."""

    async def score(self, groups: Sequence[ProducedGroup]) -> None:
        for g in groups:
            flat = g.prompt.prompt_id.startswith("flat")
            g.rewards = [1.0 if flat else float(i % 2) for i in range(len(g.completions))]


def producer(
    engine: FakeEngine, queue: FakeQueue, prompt_ids: list[str], **kw: Any
) -> tuple[Producer, CollectorRegistry]:
    registry = CollectorRegistry()
    prompts = kw.pop("prompts", None) or itertools.cycle([Prompt(p, [1, 2]) for p in prompt_ids])
    config = RolloutConfig(
        model_path="unused",
        server_id="r0",
        group_size=2,
        groups_per_ticket=2,
        tickets_in_flight=kw.pop("tickets", 1),
        sampling=SamplingConfig(max_new_tokens=1),
        dynamic_sampling=DynamicSamplingConfig(**kw.pop("dynamic_sampling", {})),
        greedy_baseline=kw.pop("greedy_baseline", False),
        max_prompt_tokens=kw.pop("max_prompt_tokens", 0),
    )
    return Producer(
        engine,
        prompts,
        queue,
        kw.pop("reward", FakeReward()),
        config,
        metrics=RolloutMetrics(registry),
        **kw,
    ), registry


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_group_the_queue_can_never_take_is_dropped_and_production_goes_on() -> None:
    queue = FakeQueue(too_large=frozenset({"big"}))
    p, registry = producer(FakeEngine(), queue, ["a", "big", "b", "c"])  # tickets: (a, big), (b, c), (a, big), …
    task = asyncio.create_task(p.run())
    await wait_until(lambda: len(queue.puts) >= 6 and len(queue.released) >= 2)
    while_running = {t for t, _ in queue.released}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "big" not in {pid for pid, _ in queue.puts}
    assert queue.predecessors_released == 0  # asked before the first Reserve
    assert {"a", "b", "c"} <= {pid for pid, _ in queue.puts}  # the loop did not stop at the first refusal
    dropped = registry.get_sample_value("tauflow_rollout_dropped_groups_total", {"reason": "too_large"})
    assert dropped == p.groups_dropped >= 2
    assert len(queue.puts) - 2 <= p.groups_produced <= len(queue.puts)  # the ticket cut by the stop may not count
    # one ticket at a time, prompts in order: t0 = (a, big), t1 = (b, c), t2 = (a, big), … Only the tickets
    # that held a dropped group gave room back while the loop ran.
    assert while_running <= {t for t in queue.tickets if int(t[1:]) % 2 == 0}
    assert registry.get_sample_value("tauflow_rollout_released_tickets_total", {"why": "dropped"}) >= 2


@pytest.mark.parametrize("by_producer", [True, False], ids=["by_producer", "one_by_one"])
async def test_a_stopped_producer_releases_its_unfilled_tickets_even_if_cancelled_again(by_producer: bool) -> None:
    queue = FakeQueue(release_s=0.2, release_by_producer=by_producer)
    p, registry = producer(FakeEngine(block=True), queue, ["a", "b"], tickets=2, release_timeout_s=1.5)
    task = asyncio.create_task(p.run())
    await wait_until(lambda: len(queue.tickets) == 4)  # two generating, two reserved ahead
    await asyncio.sleep(0.05)
    assert len(queue.tickets) == 4  # and no more
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()  # a second cancellation while the releases are under way does not cut them short
    with pytest.raises(asyncio.CancelledError):
        await task
    # (the count follows the last release by one turn of the event loop: wait for it)
    await wait_until(
        lambda: registry.get_sample_value("tauflow_rollout_released_tickets_total", {"why": "stopped"}) is not None
    )
    if by_producer:  # all at once, with the short deadline (the first call, at the start, had none)
        assert queue.released_by_producer == [([], None), ([f"t{i}" for i in range(4)], 1.5)]
        assert queue.released == []
    else:  # a queue without ReleaseProducerReservations: each ticket known, with the short deadline
        assert sorted(queue.released) == [(f"t{i}", 1.5) for i in range(4)]
    assert registry.get_sample_value("tauflow_rollout_released_tickets_total", {"why": "stopped"}) == 4
    assert p.groups_in_flight == 0


def _memory_exporter():
    """Spans of this process, in memory (the global provider is set once per process)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    exporter = InMemorySpanExporter()
    trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def test_each_ticket_is_one_trace_generate_score_and_a_put_per_group_whose_context_the_group_stores() -> None:
    import dataclasses

    from opentelemetry.trace import StatusCode

    from tauflow.rollout.adapters.convert import group_to_proto

    exporter = _memory_exporter()

    class RecordingQueue(FakeQueue):
        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.groups: list[ProducedGroup] = []

        async def put(self, group: ProducedGroup, ticket_id: str) -> None:
            self.groups.append(group)
            await super().put(group, ticket_id)

    queue = RecordingQueue(too_large=frozenset({"big"}))
    p, _ = producer(FakeEngine(), queue, ["ok", "big"])
    task = asyncio.create_task(p.run())
    await wait_until(lambda: len(queue.groups) >= 4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith(("rollout.", "reward.", "queue."))]
    tickets = {s.context.span_id: s for s in spans if s.name == "rollout.ticket"}
    for g in queue.groups[:4]:
        (put,) = [s for s in spans if s.name == "queue.put" and s.attributes["rl.group_id"] == g.group_id]
        ctx = put.context
        assert g.traceparent.startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")  # stored with the group
        wire = group_to_proto(dataclasses.replace(g, rewards=[]))  # (the fake rewards are plain numbers)
        assert wire.trace_context.traceparent == g.traceparent  # in the Put request
        ticket = tickets[put.parent.span_id]  # the group's trace is its ticket's
        assert ticket.parent is None and ticket.attributes["rl.groups"] == 2
        phases = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == ticket.context.span_id}
        assert {"rollout.generate", "reward.score", "queue.put"} == set(phases)
        assert all(s.context.trace_id == ctx.trace_id for s in phases.values())
        gen, score = phases["rollout.generate"], phases["reward.score"]
        assert ticket.start_time <= gen.start_time <= gen.end_time <= score.start_time <= score.end_time
        assert score.end_time <= put.start_time <= put.end_time <= ticket.end_time
        assert gen.attributes["rl.samples"] == 4 and gen.attributes["rl.completion_tokens"] == 4
        assert put.attributes["rl.policy_version"] == 0 and put.attributes["rl.completion_tokens"] == 2
        assert put.attributes["rl.samples"] == 2 and put.attributes["rl.reward_mean"] == 1.0
        assert put.attributes["rl.prompt_id"] == g.prompt.prompt_id
        # refused by the queue: its put failed; the ticket's other group went in
        refused = g.prompt.prompt_id == "big"
        assert put.status.status_code is (StatusCode.ERROR if refused else StatusCode.UNSET)
        assert ticket.status.status_code is StatusCode.UNSET
    assert {g.prompt.prompt_id for g in queue.groups[:4]} == {"ok", "big"}


async def test_dynamic_sampling_keeps_groups_of_equal_rewards_out_and_refills_their_room() -> None:
    # tickets of 2: (a, flat1), (b, flat2), ...: each ticket puts one group, and gives the other's room
    # back, which the next Reserve takes
    queue = FakeQueue()
    p, registry = producer(
        FakeEngine(), queue, ["a", "flat1", "b", "flat2"], reward=FlatReward(), dynamic_sampling={"enabled": True}
    )
    task = asyncio.create_task(p.run())
    await wait_until(lambda: len(queue.puts) >= 6 and len(queue.released) >= 6)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert {pid for pid, _ in queue.puts} == {"a", "b"}  # no group without a signal reached the queue
    per_ticket = {t: sum(1 for _, tt in queue.puts if tt == t) for t in queue.tickets}
    assert all(n <= 1 for n in per_ticket.values())
    filtered = registry.get_sample_value("tauflow_rollout_filtered_groups_total", {"reason": "equal_rewards"})
    assert filtered == p.groups_filtered >= 6
    released = registry.get_sample_value("tauflow_rollout_released_tickets_total", {"why": "filtered"})
    assert released is not None and released >= 6  # each ticket's unfilled room went back at once
    assert {t for t, _ in queue.released} <= set(queue.tickets)
    # every reserved group was put or released: the queue's pacing holds no room for a filtered group
    assert p.groups_produced + p.groups_filtered >= len(queue.puts)


async def test_oversampling_generates_more_prompts_and_puts_at_most_the_tickets_room() -> None:
    queue = FakeQueue()
    p, registry = producer(
        FakeEngine(),
        queue,
        ["a", "flat", "b", "c"],
        reward=FlatReward(),
        dynamic_sampling={"enabled": True, "oversample": 2.0},
    )
    task = asyncio.create_task(p.run())
    await wait_until(lambda: len(queue.puts) >= 6)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # 4 prompts a ticket of 2: a, flat, b, c -> 3 pass the filter, 2 are put, 1 is surplus; no release
    per_ticket = {t: sum(1 for _, tt in queue.puts if tt == t) for t in queue.tickets}
    assert set(per_ticket.values()) <= {0, 2}
    assert registry.get_sample_value("tauflow_rollout_filtered_groups_total", {"reason": "surplus"}) == p.groups_surplus
    assert p.groups_surplus >= 3 and p.groups_filtered >= 3
    assert "flat" not in {pid for pid, _ in queue.puts}


def test_dynamic_sampling_needs_groups_that_can_differ() -> None:
    with pytest.raises(ValueError, match="group_size >= 2"):
        RolloutConfig(model_path="m", group_size=1, dynamic_sampling=DynamicSamplingConfig(enabled=True))


async def test_the_greedy_completions_reward_travels_with_its_group_as_the_baseline() -> None:
    class TokenReward:  # scores what was generated: 1 for the greedy token 7, 0.5 for the sampled 5
        async def score(self, groups: Sequence[ProducedGroup]) -> None:
            for g in groups:
                g.rewards = [1.0 if c.token_ids == [7] else 0.5 for c in g.completions]

    class RecordingQueue(FakeQueue):
        def __init__(self) -> None:
            super().__init__()
            self.groups: list[ProducedGroup] = []

        async def put(self, group: ProducedGroup, ticket_id: str) -> None:
            self.groups.append(group)
            await super().put(group, ticket_id)

    queue = RecordingQueue()
    p, _ = producer(FakeEngine(), queue, ["a", "b"], reward=TokenReward(), greedy_baseline=True)
    task = asyncio.create_task(p.run())
    await wait_until(lambda: len(queue.groups) >= 4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for g in queue.groups:
        assert g.baseline_reward == 1.0  # the greedy completion's reward ...
        assert [c.token_ids for c in g.completions] == [[5], [5]]  # ... which is not one of the samples
    plain, _ = producer(FakeEngine(), FakeQueue(), ["a"])
    assert plain.greedy is None  # off by default: no extra generation


async def test_multimodal_prompts_are_processed_when_drawn_and_carry_their_parts() -> None:
    from dataclasses import replace

    from tauflow import media
    from tauflow.models.processor import Processed

    image = media.Media(media.Modality.IMAGE, "image/png", data=b"png bytes")

    def process(parts: list[media.PromptPart]) -> Processed:
        if any(isinstance(p, media.Text) and p.text == "bad" for p in parts):
            raise media.InvalidMedia("prompt_parts[0].media: the data does not decode as image/png")
        placed = [replace(p, grid_thw=(1, 2, 2), num_tokens=1) if isinstance(p, media.Media) else p for p in parts]
        return Processed([1, 9, 2], {"pixel_values": "tensor"}, placed)

    prompts = itertools.cycle([Prompt("mm", [], parts=[image, media.Text("=")]), Prompt("text", [1, 2]),
                               Prompt("broken", [], parts=[media.Text("bad")])])  # fmt: skip
    engine, queue = FakeEngine(), FakeQueue()
    p, registry = producer(engine, queue, [], prompts=prompts, processor=process)
    task = asyncio.create_task(p.run())
    await wait_until(lambda: len(queue.groups) >= 4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    by_prompt = {g.prompt.prompt_id: g for g in queue.groups}
    assert set(by_prompt) == {"mm", "text"}  # the broken prompt was never generated
    assert by_prompt["mm"].prompt.token_ids == [1, 9, 2]
    assert by_prompt["mm"].prompt.parts[0] == replace(image, grid_thw=(1, 2, 2), num_tokens=1)
    assert by_prompt["text"].prompt.parts == [] and by_prompt["text"].prompt.media is None
    assert {"pixel_values": "tensor"} in engine.media[0] and None in engine.media[0]  # per prompt, in order
    assert p.prompts_skipped >= 1
    assert registry.get_sample_value("tauflow_rollout_skipped_prompts_total", {"reason": "invalid_media"}) >= 1


async def test_prompts_over_max_prompt_tokens_are_skipped_and_counted() -> None:
    prompts = itertools.cycle([Prompt("short", [1, 2]), Prompt("long", [1, 2, 3, 4, 5])])
    queue = FakeQueue()
    p, registry = producer(FakeEngine(), queue, [], prompts=prompts, max_prompt_tokens=4)
    task = asyncio.create_task(p.run())
    await wait_until(lambda: len(queue.groups) >= 4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert {g.prompt.prompt_id for g in queue.groups} == {"short"}
    assert registry.get_sample_value("tauflow_rollout_skipped_prompts_total", {"reason": "too_long"}) >= 1


async def test_the_next_ticket_generates_while_the_last_is_scored_and_at_most_as_many_more_wait_to_finish() -> None:
    class BlockedReward(FakeReward):
        def __init__(self) -> None:
            self.go = asyncio.Event()
            self.waiting = 0

        async def score(self, groups: Sequence[ProducedGroup]) -> None:
            self.waiting += 1
            await self.go.wait()
            await super().score(groups)

    engine, queue, reward = FakeEngine(), FakeQueue(), BlockedReward()
    p, _ = producer(engine, queue, ["a", "b"], tickets=1, reward=reward)
    task = asyncio.create_task(p.run())
    # one ticket generates at a time; the first, scored (blocked), lets the second generate; the third
    # waits until one of the two open tickets is done
    await wait_until(lambda: reward.waiting == 2)
    await asyncio.sleep(0.05)
    assert (len(engine.media), len(queue.tickets), queue.puts) == (2, 2, [])
    reward.go.set()
    await wait_until(lambda: len(queue.puts) >= 8)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert p.groups_in_flight == 0
