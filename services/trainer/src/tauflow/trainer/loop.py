"""The trainer's loop: lease a batch, step, publish, checkpoint, ack — readable in one screen.

Exactly-once in effect (design.md §2): a lease is acked only after a checkpoint
holds the step that trained on it. A trainer that dies between a step and its
checkpoint restarts from the checkpoint; the queue redelivers the unacked
leases when they expire, and the checkpoint's trained ids keep any group from
being trained twice. The heavy work (forward, backward, checkpoint writes) runs
in a worker thread, so the service keeps answering while it trains.

Tracing (docs/observability.md): each step is a ``trainer.step`` span that links to
the stored trace context of every group it consumed (``rl.staleness`` on each
link) and holds ``queue.get``, ``forward_backward``, ``optimizer.step`` and
``weights.publish``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace

from tauflow.core.telemetry import set_error, span_context_of
from tauflow.trainer.backend import CheckpointInfo, StepResult, TorchBackend
from tauflow.trainer.ports import Batch, PublisherPort, QueuePort

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tauflow.trainer")


class State(enum.Enum):
    STARTING = 1
    WAITING_FOR_DATA = 2
    TRAINING = 3
    CHECKPOINTING = 4
    PAUSED = 5
    STOPPING = 6
    FAILED = 7
    FINISHED = 8


@dataclass
class LoopSettings:
    groups_per_step: int
    max_staleness: int
    total_steps: int  # 0: until stopped
    checkpoint_dir: Path
    checkpoint_every_steps: int
    lease_s: float
    get_wait_s: float
    history_steps: int


@dataclass
class HeldLease:
    lease_id: str
    renewed_at: float


class TrainerLoop:
    def __init__(
        self,
        backend: TorchBackend,
        queue: QueuePort,
        publisher: PublisherPort | None,
        settings: LoopSettings,
        on_step=None,  # type: ignore[no-untyped-def]
    ) -> None:
        self.backend = backend
        self.queue = queue
        self.publisher = publisher
        self.s = settings
        self.on_step = on_step
        self.state = State.STARTING
        self.published_version = backend.version if publisher is None else -1
        self.history: deque[StepResult] = deque(maxlen=settings.history_steps)
        self.staleness: dict[int, Counter[int]] = {}  # step -> groups by staleness
        self.last_checkpoint: CheckpointInfo | None = None
        self.last_error = ""
        self._held: list[HeldLease] = []
        self._running = asyncio.Event()
        self._running.set()
        self._lock = asyncio.Lock()  # one step or checkpoint at a time
        self._gets: list[tuple[int, int, int]] = []  # (start ns, end ns, groups) of the step's Gets
        self._step_span: trace.Span | None = None
        self._step_token: object = None

    @property
    def version(self) -> int:
        return self.backend.version

    def done(self) -> bool:
        return bool(self.s.total_steps) and self.version >= self.s.total_steps

    async def run(self) -> None:
        try:
            # The queue re-bases on our version: after a restart from a checkpoint it may be ahead. The
            # queue learns a version before any engine can generate with it: it refuses groups of
            # versions it has not heard of (from the future, to it).
            await self.queue.set_version(self.version, rebase=True)
            await self._publish(rebase=True)
            waited_from = time.monotonic()  # since the last step: a wait spans several long polls
            while not self.done():
                await self._running.wait()
                await self._renew(self._held)
                self.state = State.WAITING_FOR_DATA
                parts = await self._step_batch()
                if not parts:
                    continue
                groups = [g for part in parts for g in part.groups]
                self._open_step_span(parts)
                async with self._lock:
                    self.state = State.TRAINING
                    trained_from = time.monotonic()
                    result = await asyncio.to_thread(self.backend.train_step, groups, max_staleness=self._tau())
                    trained_s = time.monotonic() - trained_from
                    # Held only once trained, so a concurrent checkpoint never acks an untrained lease.
                    self._held += [HeldLease(part.lease_id, time.monotonic()) for part in parts]
                if result.committed:
                    await self.queue.set_version(self.version)  # before the weights: see run()'s start
                    published_from = time.monotonic()
                    await self._publish()
                    # Where a step's time goes: waiting for data, training, and the hand-off to the
                    # sidecar (the only part of a publish the trainer waits for). Set before the step
                    # is listed, so ListSteps never shows it without them.
                    result.metrics.update(
                        {
                            "time/wait_s": trained_from - waited_from,
                            "time/train_s": trained_s,
                            "time/publish_s": time.monotonic() - published_from,
                        }
                    )
                    trained = set(result.trained_group_ids)
                    self.staleness[result.step] = Counter(
                        g.staleness(result.step) for g in groups if g.group_id in trained
                    )
                    if len(self.staleness) > self.s.history_steps:
                        self.staleness.pop(min(self.staleness))
                    result.committed_at = time.time()
                    self.history.append(result)
                    if self.on_step is not None:
                        self.on_step(result)
                self._close_step_span(result)
                waited_from = time.monotonic()
                if self.version % self.s.checkpoint_every_steps == 0 or self.done():
                    await self.checkpoint()
            self.state = State.FINISHED
            log.info("finished", extra={"version": self.version})
        except asyncio.CancelledError:
            self.state = State.STOPPING
            self._close_step_span(None)
            raise
        except Exception as e:
            self._close_step_span(None, e)
            self.state = State.FAILED
            self.last_error = f"{type(e).__name__}: {e}"
            raise

    async def _step_batch(self) -> list[Batch]:
        """One step's groups, in one lease or several: the queue cuts a batch that would not fit in one
        response (message size limit) and keeps the rest at its head, so further Gets complete the step."""
        parts: list[Batch] = []
        leases: list[HeldLease] = []
        missing = self.s.groups_per_step
        self._gets = []
        while missing > 0:
            get_started = time.time_ns()
            part = await self.queue.get_batch(missing, self.version, self.s.get_wait_s, self.s.lease_s)
            if part is not None:
                self._gets.append((get_started, time.time_ns(), len(part.groups)))
            if part is None:
                if not parts:
                    return []
                await self._renew(self._held + leases)  # the rest may take a while: keep every lease
                continue
            parts.append(part)
            leases.append(HeldLease(part.lease_id, time.monotonic()))
            missing -= len(part.groups)
        return parts

    def _tau(self) -> int | None:
        return None if self.s.max_staleness < 0 else self.s.max_staleness

    async def _publish(self, rebase: bool = False) -> None:
        if self.publisher is None or self.published_version == self.version:
            return
        with tracer.start_as_current_span(
            "weights.publish", attributes={"rl.policy_version": self.version, "weights.rebase": rebase}
        ):
            await self.publisher.publish(self.version, self.backend.state_dict_for_publish(), rebase=rebase)
        self.published_version = self.version

    # -- tracing -------------------------------------------------------------------------

    def _open_step_span(self, parts: list[Batch]) -> None:
        """Starts ``trainer.step`` (from the first Get that brought data) with a link to each consumed
        group's rollout, records the step's Gets as ``queue.get`` children, and makes it current, so the
        training thread's spans and the publish are its children."""
        step = self.version
        links = []
        for part in parts:
            for g, traceparent in zip(part.groups, part.trace_contexts, strict=False):
                span_context = span_context_of(traceparent)
                if span_context is not None:
                    links.append(trace.Link(span_context, {"rl.group_id": g.group_id, "rl.staleness": g.staleness(step)}))
        start = self._gets[0][0] if self._gets else time.time_ns()
        span = tracer.start_span(
            "trainer.step", context=trace.set_span_in_context(trace.INVALID_SPAN), links=links, start_time=start,
            attributes={"rl.step": step, "rl.groups": sum(len(p.groups) for p in parts)},
        )
        ctx = trace.set_span_in_context(span)
        for get_start, get_end, n in self._gets:
            tracer.start_span("queue.get", context=ctx, start_time=get_start, attributes={"rl.groups": n}).end(
                end_time=get_end
            )
        self._step_span, self._step_token = span, otel_context.attach(ctx)

    def _close_step_span(self, result: StepResult | None, error: BaseException | None = None) -> None:
        span, token = self._step_span, self._step_token
        if span is None:
            return
        self._step_span = self._step_token = None
        if result is not None:
            span.set_attributes({
                "rl.policy_version": result.policy_version,
                "rl.committed": result.committed,
                "rl.samples": result.samples,
                "rl.trained_tokens": result.trained_tokens,
                "rl.loss": result.loss,
                "rl.reward_mean": result.mean_reward,
                "rl.max_staleness": result.max_staleness,
                "rl.mean_staleness": result.mean_staleness,
            })
        if error is not None:
            set_error(span, error)
        otel_context.detach(token)  # type: ignore[arg-type]
        span.end()

    async def checkpoint(self, directory: Path | None = None) -> CheckpointInfo:
        """Writes a checkpoint, then acks every lease whose steps it holds."""
        async with self._lock:
            previous = self.state
            self.state = State.CHECKPOINTING
            try:  # a failed write (a bad directory, a full disk) leaves the state as it was
                root = directory or self.s.checkpoint_dir
                info = await asyncio.to_thread(self.backend.save_checkpoint, root)
                self.last_checkpoint = info
                held, self._held = self._held, []
                for lease in held:
                    await self.queue.ack(lease.lease_id)
            finally:
                self.state = previous
            return info

    async def _renew(self, leases: list[HeldLease]) -> None:
        now = time.monotonic()
        for lease in leases:
            if now - lease.renewed_at > self.s.lease_s / 2:
                await self.queue.renew(lease.lease_id, self.s.lease_s)
                lease.renewed_at = now

    # -- control -------------------------------------------------------------------------

    async def pause(self) -> int:
        self._running.clear()
        async with self._lock:  # returns once no step is running
            self.state = State.PAUSED
        return self.version

    def resume(self) -> None:
        if self.state is State.PAUSED:
            self.state = State.WAITING_FOR_DATA
        self._running.set()

    def set_max_staleness(self, tau: int) -> int:
        if tau < -1:
            raise ValueError(f"max_staleness={tau} must be -1 (unbounded) or at least 0")
        self.s.max_staleness = tau
        return tau

    def steps_from(self, first: int, limit: int) -> tuple[list[StepResult], int]:
        steps = [r for r in self.history if r.step >= first]
        kept_from = self.history[0].step if self.history else first
        return steps[:limit], max(0, kept_from - first)
