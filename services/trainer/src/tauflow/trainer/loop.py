"""The trainer's loop: lease a batch, step, publish, checkpoint, ack — readable in one screen.

Exactly-once in effect (docs/design.md §2): a lease is acked only after a checkpoint
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
import errno
import logging
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable
from contextvars import Token
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context

from tauflow.core.staleness import check_tau, loosest
from tauflow.core.telemetry import set_error, span_context_of
from tauflow.trainer.backend import StepResult, TorchBackend
from tauflow.trainer.checkpoint import CheckpointInfo, latest_checkpoint
from tauflow.trainer.config import TrainerConfig
from tauflow.trainer.ports import Batch, PublisherPort, QueuePort

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tauflow.trainer")
CHECKPOINT_RETRY_S = 5.0  # the last checkpoint, refused by the disk: tried again this often
SIDECAR_CHECK_S = 10.0  # while waiting for data: how often the sidecar is asked whether it lost the version
NOT_WRITTEN = "checkpoint not written"
REFUSED_FOR_AT_MOST_S = (
    600.0  # a checkpoint folder that was usable and is refused (read-only, denied): waited this long
)


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
class HeldLease:
    lease_id: str
    renewed_at: float


class QueueGet(NamedTuple):
    """One Get of a step that brought groups (wall-clock ns, for its ``queue.get`` span)."""

    started_ns: int
    ended_ns: int
    groups: int


@dataclass
class StepTiming:
    """Where a step's time goes (monotonic seconds): waiting for data, training, and the hand-off to the
    sidecar (the only part of a publish the trainer waits for)."""

    waited_from: float  # since the last step: a wait spans several long polls
    trained_from: float = 0.0
    trained_until: float = 0.0

    def metrics(self, publish_s: float) -> dict[str, float]:
        return {
            "time/wait_s": self.trained_from - self.waited_from,
            "time/train_s": self.trained_until - self.trained_from,
            "time/publish_s": publish_s,
        }


class CheckpointBusy(Exception):
    """An export asked for while another one is being written: they run one at a time, so that exports cannot
    hold training up without bound."""


class ExportRefused(Exception):
    """An export that would take what the trainer's own checkpoints need: a second export of one version (one
    per version bounds their count by the steps), or one that would leave the disk too little room."""

    def __init__(self, message: str, *, out_of_space: bool = False) -> None:
        super().__init__(message)
        self.out_of_space = out_of_space


EXPORT_HEADROOM = 2  # an export must leave room for this many checkpoints of the last one's size


class TrainerLoop:
    def __init__(
        self,
        backend: TorchBackend,
        queue: QueuePort,
        publisher: PublisherPort | None,
        config: TrainerConfig,
        on_step: Callable[[StepResult], None] | None = None,
        on_skip: Callable[[StepResult], None] | None = None,
    ) -> None:
        self.backend = backend
        self.queue = queue
        self.publisher = publisher
        self.config = config
        self.checkpoint_dir = Path(config.checkpoint_dir)
        self.max_staleness = config.max_staleness  # τ: SetMaxStaleness turns it while the loop runs
        self.on_step = on_step
        self.on_skip = on_skip
        self.state = State.STARTING
        self.published_version = backend.version if publisher is None else -1
        self.history: deque[StepResult] = deque(maxlen=config.history_steps)
        self.groups_by_staleness: dict[int, Counter[int]] = {}  # step -> its trained groups by staleness
        self.last_checkpoint: CheckpointInfo | None = None
        self.last_error = ""
        self._held: list[HeldLease] = []  # trained, not yet held by a checkpoint: not acked
        self._since_checkpoint: set[str] = set()  # group ids trained after the last checkpoint
        self._running = asyncio.Event()
        if not config.start_paused:
            self._running.set()
        self._lock = asyncio.Lock()  # one step or checkpoint at a time
        self._sidecar_asked = time.monotonic()  # (see _republish_if_lost)
        self._writes: dict[Path, asyncio.Task[CheckpointInfo]] = {}  # the checkpoint writes under way, by folder
        self._refused_since: float | None = None  # when checkpoints began to be refused (read-only, denied)
        self._exported: dict[int, Path] = {}  # the export of each version (one per version), by version
        self._gets: list[QueueGet] = []  # the current step's
        self._offloaded_once = False  # (logged once)
        self._step_span: trace.Span | None = None
        self._step_token: Token[Context] | None = None

    @property
    def version(self) -> int:
        return self.backend.version

    def done(self) -> bool:
        return bool(self.config.total_steps) and self.version >= self.config.total_steps

    async def run(self) -> None:
        try:
            await self._start()
            waited_from = time.monotonic()
            while not self.done():
                await self._renew(self._held)
                if self.backend.config.offload_model:  # (no thread hop per poll otherwise)
                    async with self._lock:
                        await self._release_memory()  # (before a pause too: the engine has the device meanwhile)
                if not self._running.is_set():
                    self.state = State.PAUSED
                    await self._wait_while_paused()
                self.state = State.WAITING_FOR_DATA
                parts = await self._lease_batch()
                if parts and not self._running.is_set():  # paused during the long poll: nothing trains
                    for part in parts:
                        await self.queue.nack(part.lease_id)  # (its groups back at the head of the queue)
                    continue
                if not parts:
                    await self._republish_if_lost()
                    continue
                self._open_step_span(parts)
                result, timing = await self._train(parts, waited_from)
                if result.committed:
                    await self._commit(result, parts, timing)
                elif self.on_skip is not None:  # (nothing committed: the skipped groups are still counted)
                    self.on_skip(result)
                self._close_step_span(result)
                waited_from = time.monotonic()
                if self._checkpoint_due():
                    await self._checkpoint_when_due()
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

    async def _start(self) -> None:
        # The queue re-bases on our version: after a restart from a checkpoint it may be ahead. The queue
        # learns a version before any engine can generate with it: it refuses groups of versions it has
        # not heard of (from the future, to it).
        await self.queue.set_version(self.version, rebase=True)
        await self._publish(rebase=True)

    async def _release_memory(self) -> None:
        """Colocated mode (backend.offload_model): the engine's turn; the weights wait in host memory. The
        caller holds the loop's lock (no step or checkpoint beside it)."""
        try:
            moved = await asyncio.to_thread(self.backend.release_memory)
        except (RuntimeError, OSError) as e:  # e.g. no pinned host memory left: the weights stay (or come back)
            log.warning("could not offload the model's weights", extra={"error": f"{type(e).__name__}: {e}"})
            return
        if moved and not self._offloaded_once:
            self._offloaded_once = True
            log.info("model weights offloaded to host memory while waiting for data", extra={"bytes": moved})

    async def _lease_batch(self) -> list[Batch]:
        """One step's groups, in one lease or several: the queue cuts a batch that would not fit in one
        response (message size limit) and keeps the rest at its head, so further Gets complete the step."""
        parts: list[Batch] = []
        leases: list[HeldLease] = []
        missing = self.config.groups_per_step
        self._gets = []
        while missing > 0:
            started_ns = time.time_ns()
            # While leases are held, a long poll is cut short enough for their renewal to come in time.
            wait_s = (
                min(self.config.get_wait_s, self.config.lease_s / 4) if self._held or leases else self.config.get_wait_s
            )
            part = await self.queue.get_batch(missing, self.version, wait_s, self.config.lease_s)
            if part is None:
                await asyncio.to_thread(self.backend.keepalive)  # the other ranks wait meanwhile
                if not parts:
                    return []
                await self._renew(self._held + leases)  # the rest may take a while: keep every lease
                continue
            self._gets.append(QueueGet(started_ns, time.time_ns(), len(part.groups)))
            parts.append(part)
            leases.append(HeldLease(part.lease_id, time.monotonic()))
            missing -= len(part.groups)
            if not self._running.is_set():  # paused: what came goes back (run) without waiting for the rest
                break
        return parts

    async def _train(self, parts: list[Batch], waited_from: float) -> tuple[StepResult, StepTiming]:
        """One optimizer step on the groups of ``parts``, in a worker thread; their leases are held from then on."""
        groups = [g for part in parts for g in part.groups]
        async with self._lock:
            self.state = State.TRAINING
            timing = StepTiming(waited_from, trained_from=time.monotonic())
            result = await asyncio.to_thread(self.backend.train_step, groups, max_staleness=self.delivered_tau(parts))
            timing.trained_until = time.monotonic()
            if undecodable := sum(len(p.invalid) for p in parts):  # (consumed with their leases: acked)
                result.metrics["skipped_invalid_groups"] = (
                    result.metrics.get("skipped_invalid_groups", 0.0) + undecodable
                )
            self._since_checkpoint.update(result.trained_group_ids)
            # Held only once trained, so a concurrent checkpoint never acks an untrained lease. A part with
            # nothing to make durable (every group skipped as too stale, or trained before and already in a
            # checkpoint: redelivered after a restart) is acked now: held, it would wait for a checkpoint that
            # a step with no new data never brings, and keep its room in the pacing (a stall seen in chaos).
            done_now = {p.lease_id for p in parts if not any(g.group_id in self._since_checkpoint for g in p.groups)}
            self._held += [HeldLease(p.lease_id, time.monotonic()) for p in parts if p.lease_id not in done_now]
        for lease_id in done_now:
            await self.queue.ack(lease_id)
        return result, timing

    async def _commit(self, result: StepResult, parts: list[Batch], timing: StepTiming) -> None:
        """A committed step: the queue learns the version, the weights go out, then the step is listed."""
        await self.queue.set_version(self.version)  # before the weights: see _start
        published_from = time.monotonic()
        await self._publish()
        # Set before the step is listed, so ListSteps never shows it without them.
        result.metrics.update(timing.metrics(publish_s=time.monotonic() - published_from))
        self._count_staleness(result, parts)
        result.committed_at = time.time()
        self.history.append(result)
        if self.on_step is not None:
            self.on_step(result)

    def _count_staleness(self, result: StepResult, parts: list[Batch]) -> None:
        trained = set(result.trained_group_ids)
        self.groups_by_staleness[result.step] = Counter(
            g.staleness(result.step) for part in parts for g in part.groups if g.group_id in trained
        )
        if len(self.groups_by_staleness) > self.config.history_steps:
            self.groups_by_staleness.pop(min(self.groups_by_staleness))

    async def _checkpoint_when_due(self) -> None:
        """The periodic checkpoint, and the last one. A write the disk refuses (full, read-only) does not end
        the trainer (it crash-looped so): the steps' leases stay held and renewed, and the write is tried again
        at the next one due; the last one until it is written (a run ends with every step durable). A full disk
        is waited out for as long as it lasts; a folder that held checkpoints and is now refused (remounted
        read-only, its permissions changed) for REFUSED_FOR_AT_MOST_S; a folder never usable fails at once."""
        while True:
            try:
                await self.checkpoint()
                if self.last_error.startswith(NOT_WRITTEN):
                    self.last_error = ""
                self._refused_since = None
                return
            except OSError as e:
                if not self._waits_out(e):
                    raise
                self.last_error = f"{NOT_WRITTEN}: {type(e).__name__}: {e}"
                log.warning("checkpoint not written; training goes on and tries again",
                            extra={"version": self.version, "error": self.last_error})  # fmt: skip
                if not self.done():
                    return
            await asyncio.sleep(CHECKPOINT_RETRY_S)
            await self._renew(self._held)

    def _waits_out(self, error: OSError) -> bool:
        """Whether a refused checkpoint write is waited out (see _checkpoint_when_due) rather than ending the
        trainer, saying why."""
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            return False
        if latest_checkpoint(self.checkpoint_dir) is None:
            return False  # (never usable: a wrong path or mount, not a passing fault)
        now = time.monotonic()
        if self._refused_since is None:
            self._refused_since = now
        if now - self._refused_since <= REFUSED_FOR_AT_MOST_S:
            return True
        log.error("checkpoint folder refused for too long", extra={"seconds": REFUSED_FOR_AT_MOST_S})
        return False

    def _checkpoint_due(self) -> bool:
        return self.version % self.config.checkpoint_every_steps == 0 or self.done()

    async def _publish(self, rebase: bool = False) -> None:
        if self.publisher is None or self.published_version == self.version:
            return
        with tracer.start_as_current_span(
            "weights.publish", attributes={"rl.policy_version": self.version, "weights.rebase": rebase}
        ):
            # In a thread: with FSDP2 the full weights are gathered from every rank.
            dtype = getattr(torch, self.config.publish_dtype) if self.config.publish_dtype else None
            tensors = await asyncio.to_thread(self.backend.state_dict_for_publish, dtype)
            await self.publisher.publish(self.version, tensors, rebase=rebase)
        self.published_version = self.version

    async def _republish_if_lost(self) -> None:
        """A sidecar that restarted after it took a version and before the engines loaded it holds none: the
        engines waited for that version, the queue for their groups, and the run stalled. While it waits for
        data, the trainer asks the sidecar every ``SIDECAR_CHECK_S`` and publishes its version again."""
        now = time.monotonic()
        if (
            self.publisher is None
            or self.published_version != self.version
            or now - self._sidecar_asked < SIDECAR_CHECK_S
        ):
            return
        self._sidecar_asked = now
        try:
            latest = await self.publisher.latest_version()
        except ConnectionError:
            return  # restarting: asked again next time
        if latest is not None and latest >= self.version:
            return
        log.warning("the weight sidecar lost the trainer's version; publishing it again",
                    extra={"version": self.version, "sidecar_version": latest})  # fmt: skip
        async with self._lock:
            self.published_version = -1
            try:
                await self._publish()
            except Exception as e:  # noqa: BLE001 - a trainer waiting for data must not fail on it: asked again
                self.published_version = self.version  # (so the next check asks again)
                log.warning(
                    "could not publish the version again", extra={"version": self.version, "error": repr(e)[:300]}
                )

    async def _wait_while_paused(self) -> None:
        """Until resumed, telling the other ranks now and then that rank 0 lives (they give up on a silent one)
        and keeping its held leases."""
        while not self._running.is_set():
            try:
                await asyncio.wait_for(self._running.wait(), self.config.get_wait_s)
            except TimeoutError:
                await asyncio.to_thread(self.backend.keepalive)
                await self._renew(self._held)

    async def _renew(self, leases: list[HeldLease]) -> None:
        """Renews each lease held for more than half of its length."""
        now = time.monotonic()
        for lease in leases:
            if now - lease.renewed_at > self.config.lease_s / 2:
                await self.queue.renew(lease.lease_id, self.config.lease_s)
                lease.renewed_at = now

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
                    links.append(
                        trace.Link(span_context, {"rl.group_id": g.group_id, "rl.staleness": g.staleness(step)})
                    )
        start = self._gets[0].started_ns if self._gets else time.time_ns()
        span = tracer.start_span(
            "trainer.step",
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            links=links,
            start_time=start,
            attributes={"rl.step": step, "rl.groups": sum(len(p.groups) for p in parts)},
        )
        ctx = trace.set_span_in_context(span)
        for get in self._gets:
            tracer.start_span(
                "queue.get", context=ctx, start_time=get.started_ns, attributes={"rl.groups": get.groups}
            ).end(end_time=get.ended_ns)
        self._step_span, self._step_token = span, otel_context.attach(ctx)

    def _close_step_span(self, result: StepResult | None, error: BaseException | None = None) -> None:
        span, token = self._step_span, self._step_token
        if span is None:
            return
        self._step_span = self._step_token = None
        if result is not None:
            span.set_attributes(
                {
                    "rl.policy_version": result.policy_version,
                    "rl.committed": result.committed,
                    "rl.samples": result.samples,
                    "rl.trained_tokens": result.trained_tokens,
                    "rl.loss": result.loss,
                    "rl.reward_mean": result.mean_reward,
                    "rl.max_staleness": result.max_staleness,
                    "rl.mean_staleness": result.mean_staleness,
                }
            )
        if error is not None:
            set_error(span, error)
        if token is not None:
            otel_context.detach(token)
        span.end()

    # -- checkpoints and control --------------------------------------------------------

    async def checkpoint(self, directory: Path | None = None) -> CheckpointInfo:
        """Writes a checkpoint into ``directory`` (default: the trainer's own checkpoint directory). There it
        then acks every lease whose steps it holds and becomes ``last_checkpoint``. Anywhere else it is an
        export, a copy that acks nothing: a restart resumes from the own directory only, so only a checkpoint
        there makes a step durable.

        Once begun, a write finishes (and acks) even if the caller stops waiting (its deadline): it holds the
        lock until then, so no step runs beside it. A call for a folder whose write is under way waits for
        that write; an export asked for while another export is under way raises CheckpointBusy. Exports are
        bounded (ExportRefused): one per version (again into its folder: the same checkpoint), and none that would
        leave its disk less room than EXPORT_HEADROOM checkpoints of the last one's size, so that exports cannot
        fill the disk the trainer's own checkpoints need."""
        target = directory or self.checkpoint_dir
        key, own_key = target.resolve(), self.checkpoint_dir.resolve()
        write = self._writes.get(key)
        if write is None:
            if key != own_key:
                if any(folder != own_key for folder in self._writes):
                    raise CheckpointBusy(f"another export is being written ({len(self._writes)} write(s) under way)")
                self._check_export(key)
            write = asyncio.ensure_future(self._write_checkpoint(target, own=key == own_key))
            self._writes[key] = write
            write.add_done_callback(lambda done: self._write_done(key, done))
        return await asyncio.shield(write)

    def _check_export(self, key: Path) -> None:
        version = self.version
        earlier = self._exported.get(version)
        if earlier is not None:
            if earlier != key:
                raise ExportRefused(
                    f"version {version} was exported already (to {str(earlier)!r}): one export per version"
                )
            return  # (a retry: the same checkpoint, already on the disk)
        if self.last_checkpoint is None:
            return
        size = self.last_checkpoint.size_bytes
        existing = next((p for p in (key, *key.parents) if p.exists()), None)
        own = next((p for p in (self.checkpoint_dir, *self.checkpoint_dir.parents) if p.exists()), None)
        if existing is None or own is None or existing.stat().st_dev != own.stat().st_dev:
            return  # (another disk than the own checkpoints': theirs is not at stake)
        free = shutil.disk_usage(existing).free
        if free - size < EXPORT_HEADROOM * size:
            raise ExportRefused(
                f"an export of {size} bytes would leave {max(free - size, 0)} bytes free, less than the "
                f"{EXPORT_HEADROOM} checkpoints' room the trainer keeps for its own",
                out_of_space=True,
            )

    def _write_done(self, key: Path, write: asyncio.Task[CheckpointInfo]) -> None:
        if self._writes.get(key) is write:
            del self._writes[key]
        if not write.cancelled() and write.exception() is not None:  # (seen here even if its caller left)
            log.warning("checkpoint write failed", extra={"directory": str(key), "error": repr(write.exception())})

    async def _write_checkpoint(self, target: Path, own: bool) -> CheckpointInfo:
        async with self._lock:
            previous = self.state
            self.state = State.CHECKPOINTING
            try:  # a failed write (a bad directory, a full disk) leaves the state as it was
                info = await asyncio.to_thread(self.backend.save_checkpoint, target, own=own)
                await self._release_memory()  # (one asked for while the loop waits)
                if not own:
                    self._exported[info.policy_version] = target.resolve()
                if own:
                    self.last_checkpoint = info
                    held, self._held = self._held, []
                    self._since_checkpoint.clear()
                    for lease in held:
                        await self.queue.ack(lease.lease_id)
            finally:
                if self.state is State.CHECKPOINTING:  # (not if the loop finished or stopped meanwhile)
                    self.state = previous
            return info

    async def pause(self) -> int:
        """Returns once no step is running; a batch leased meanwhile goes back untrained (run). A finished (or
        stopping, failed) trainer stays as it is."""
        self._running.clear()
        async with self._lock:
            if self.state not in (State.FINISHED, State.STOPPING, State.FAILED):
                self.state = State.PAUSED
        return self.version

    def resume(self) -> None:
        if self.state is State.PAUSED:
            self.state = State.WAITING_FOR_DATA
        self._running.set()

    def delivered_tau(self, parts: list[Batch]) -> int:
        """The τ a step's groups are judged by: the one in force when the queue delivered them (it says so
        with each batch; this trainer's own τ where it does not), the loosest of the step's parts. So a τ
        lowered between a delivery and its step never drops a group delivered under the old one, and the
        invariant holds: no group trained with a staleness above the τ in force at its delivery."""
        return loosest(self.max_staleness if p.max_staleness is None else p.max_staleness for p in parts)

    def set_max_staleness(self, tau: int) -> int:
        self.max_staleness = check_tau(tau)
        return self.max_staleness

    def steps_from(self, first: int, limit: int) -> tuple[list[StepResult], int]:
        steps = [r for r in self.history if r.step >= first]
        kept_from = self.history[0].step if self.history else first
        return steps[:limit], max(0, kept_from - first)
