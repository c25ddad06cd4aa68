"""Runs a reward function over groups: inline, or in a pool of worker processes that can be killed.

Inline functions are called in the service process, one sample after another, on a thread of their own
per call: no pickling, which is what cheap built-ins want (``exact_match`` and ``format``), and never on
the event loop, so that a large request or a slow sample cannot hold up other calls, health checks or
SIGTERM. A sample's timeout cannot be enforced there (a thread cannot be interrupted); the call's budget
is: the lesser of ``max_inline_call_s`` and its samples (groups, for a group-level function) times the
timeout (at least ``MIN_INLINE_BUDGET_S``), deadline or none. Past it the call answers at once: the samples
scored keep their scores, the
others (the one in progress included) get the fallback score and ``TIMEOUT``, as a pool sample past its
timeout does, and the thread stops at its next sample. The caller's deadline, when it comes first, stops
the call the same way but raises ``DeadlineExceeded``. Process functions run in a ``pebble.ProcessPool``:
one task per sample (or per group, for group-level functions) with the per-sample timeout, measured from
the moment a worker starts the task. A task that runs past it is stopped by terminating its worker
process, which the pool replaces; a worker that dies (a segfault, ``os._exit``) fails only its own task.
Either way the sample gets the function's fallback score and a status, and the service keeps serving.

The pool's workers are shared between calls: a call's tasks wait here, not in the pool's own first-come
queue, and a free worker takes the next task of the next call in turn (round robin), each call holding at
most ``pool.call_share`` of the workers at once. So a call of slow samples (up to its sample timeout
each) cannot make the other calls wait for it: theirs start on the workers it leaves free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import multiprocessing
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pebble import ProcessExpired, ProcessFuture, ProcessPool

from tauflow.reward import worker
from tauflow.reward.api import GroupInput
from tauflow.reward.config import Executor, PoolConfig
from tauflow.reward.errors import DeadlineExceeded
from tauflow.reward.registry import RewardFunction

log = logging.getLogger(__name__)


class Status(str, Enum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass(frozen=True, slots=True)
class SampleResult:
    status: Status
    score: float
    components: dict[str, float]
    message: str
    duration_s: float
    reason: str = ""  # for failures: "error", "timeout" or "crash" (the worker died)
    detail: str = ""  # the traceback of an error, for the log


def from_outcome(outcome: worker.Outcome, fallback: float) -> SampleResult:
    ok, score, parts, message, detail, duration = outcome
    if ok:
        return SampleResult(Status.OK, score, parts, "", duration)
    return SampleResult(Status.ERROR, fallback, {}, message, duration, "error", detail)


@dataclass(eq=False)
class _Task:
    """One sample's (or group's) call of a function in the pool: waiting for a worker, then running in one."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    timeout_s: float
    outcome: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    running: ProcessFuture[Any] | None = None


@dataclass(eq=False)
class _Call:
    """One Score call's tasks in the pool: those still waiting for a worker, and how many run now."""

    tasks: list[_Task]
    waiting: deque[_Task]
    running: int = 0
    first: bool = False  # one of the run's own calls: a free worker takes its tasks before anyone else's


def _settle(outcome: concurrent.futures.Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """A task's result or error, unless its call is over (then its outcome was cancelled)."""
    try:
        if error is not None:
            outcome.set_exception(error)
        else:
            outcome.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled: its call is over
        pass


# The least budget of an inline call (unless max_inline_call_s is less): a call of one sample of a 1 s function
# must not time out because a loaded machine started its thread late or held the GIL (2 cores, CI), only
# because its function was slow.
MIN_INLINE_BUDGET_S = 10.0


class Scorer:
    """Scores groups with a registered function; owns the worker pool and shares it between calls."""

    def __init__(
        self,
        pool_config: PoolConfig,
        preload_refs: Sequence[str] = (),
        max_inline_call_s: float = 60.0,
        max_pool_call_s: float = 600.0,
    ) -> None:
        self.pool_config = pool_config
        self.max_inline_call_s = max_inline_call_s
        self.max_pool_call_s = max_pool_call_s
        self.preload_refs = list(preload_refs)
        self._pool: ProcessPool | None = None
        self.pool_restarts = 0
        # Tasks are handed to the pool only when a worker is free, so that the next one is picked fairly.
        # The lock guards the pool and what follows (pebble reports finished tasks on its own thread).
        self._lock = threading.RLock()
        self._calls: deque[_Call] = deque()  # calls with tasks waiting, in turn
        self._running: dict[_Task, _Call] = {}  # tasks the pool holds
        self._per_call = max(1, int(pool_config.workers * pool_config.call_share))

    # -- the pool ------------------------------------------------------------------------------

    def _context(self) -> Any:
        ctx = multiprocessing.get_context(self.pool_config.start_method)
        if self.pool_config.start_method == "forkserver":
            modules = ["tauflow.reward.worker", "tauflow.reward.builtins", *self.pool_config.preload]
            modules += [ref.partition(":")[0] for ref in self.preload_refs]
            ctx.set_forkserver_preload(list(dict.fromkeys(modules)))
        return ctx

    def _new_pool(self) -> ProcessPool:
        return ProcessPool(
            max_workers=self.pool_config.workers,
            max_tasks=self.pool_config.max_tasks_per_worker,
            initializer=worker.init_worker,
            initargs=(list(sys.path), self.preload_refs, os.getpid(), self.pool_config.worker_memory_mb),
            context=self._context(),
        )

    def pool(self) -> ProcessPool:
        """The pool, made anew if it broke (pebble stops a pool whose workers cannot be started)."""
        with self._lock:
            if self._pool is None or not self._pool.active:
                if self._pool is not None:
                    log.warning("worker pool is not active; starting a new one")
                    self.pool_restarts += 1
                    self._pool.stop()
                    self._lose_running()
                self._pool = self._new_pool()
            return self._pool

    async def start(self) -> None:
        """Starts the workers and waits until each answers, so the first Score pays no start-up."""
        pool = self.pool()
        futures = [asyncio.wrap_future(pool.schedule(worker.ping)) for _ in range(self.pool_config.workers)]
        await asyncio.gather(*futures)

    def close(self) -> None:
        with self._lock:
            waiting = [t for c in self._calls for t in c.waiting]
            self._calls.clear()
        for task in waiting:
            task.outcome.cancel()
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None

    # -- sharing the pool between calls ---------------------------------------------------------

    def _submit(self, tasks: list[_Task], first: bool = False) -> _Call:
        call = _Call(tasks, deque(tasks), first=first)
        with self._lock:
            self._calls.append(call)
        self._dispatch()
        return call

    def _dispatch(self) -> None:
        """Hands waiting tasks to free workers: the next call's in turn, each call up to its share; the run's own
        calls (``first``) before the others, so that callers without the run token cannot starve it."""
        started: list[tuple[_Task, ProcessFuture[Any]]] = []
        with self._lock:
            while len(self._running) < self.pool_config.workers:
                ready = [c for c in self._calls if c.running < self._per_call]
                call = next((c for c in ready if c.first), ready[0] if ready else None)
                if call is None:
                    break
                self._calls.remove(call)
                task = call.waiting.popleft()
                if call.waiting:
                    self._calls.append(call)  # behind the other calls
                if task.outcome.cancelled():
                    continue
                try:
                    task.running = self.pool().schedule(task.fn, task.args, timeout=task.timeout_s)
                except Exception as e:  # noqa: BLE001 - e.g. no worker can start: the task's failure, reported
                    _settle(task.outcome, error=e)
                    continue
                self._running[task] = call
                call.running += 1
                started.append((task, task.running))
        for task, running in started:  # (outside the lock: a done future calls back at once)
            running.add_done_callback(functools.partial(self._finished, task))

    def _finished(self, task: _Task, running: ProcessFuture[Any]) -> None:
        with self._lock:
            call = self._running.pop(task, None)
            if call is not None:
                call.running -= 1
        if running.cancelled():
            task.outcome.cancel()
        elif running.exception() is not None:
            _settle(task.outcome, error=running.exception())
        else:
            _settle(task.outcome, result=running.result())
        self._dispatch()

    def _lose_running(self) -> None:
        """The pool broke with tasks in it that it may never report: they fail, and free their workers."""
        lost, self._running = self._running, {}
        for task, call in lost.items():
            call.running -= 1
            _settle(task.outcome, error=RuntimeError("the worker pool broke while it ran this task"))

    def _withdraw(self, call: _Call) -> None:
        """The call is over (answered, past its deadline or cancelled): its waiting tasks never start, and its
        running ones are stopped (pebble ends their workers), which frees their workers for the others."""
        with self._lock:
            if call in self._calls:
                self._calls.remove(call)
            call.waiting.clear()
        for task in call.tasks:
            if task.running is not None:
                task.running.cancel()
            task.outcome.cancel()

    # -- scoring -------------------------------------------------------------------------------

    async def score(
        self,
        fn: RewardFunction,
        groups: Sequence[GroupInput],
        config: dict[str, Any],
        timeout_s: float,
        deadline_s: float | None = None,
        executor: Executor | None = None,
        first: bool = False,
    ) -> list[list[SampleResult]]:
        """One list of results per group, in order. ``deadline_s`` (seconds from now) bounds the call:
        past it the unfinished work is cancelled and ``DeadlineExceeded`` raised. An inline call is also
        bounded by its budget (``inline_budget_s``), past which its unscored samples time out. ``executor``
        replaces the function's for this call (``RewardFunction.executor_for``); ``first``: the run's own call,
        whose tasks a free worker takes before other calls'."""
        if (executor or fn.executor) is Executor.INLINE:
            return await self._inline_off_loop(fn, groups, config, timeout_s, deadline_s)
        return await self._in_pool(fn, groups, config, timeout_s, deadline_s, first)

    def inline_budget_s(self, fn: RewardFunction, groups: Sequence[GroupInput], timeout_s: float) -> float:
        """How long an inline call may run: ``max_inline_call_s``, or less for a call of few samples (groups,
        for a group-level function) at ``timeout_s`` each, but not less than ``MIN_INLINE_BUDGET_S``."""
        units = len(groups) if fn.group_level else sum(len(g.samples) for g in groups)
        return min(self.max_inline_call_s, max(MIN_INLINE_BUDGET_S, units * timeout_s))

    async def _inline_off_loop(
        self,
        fn: RewardFunction,
        groups: Sequence[GroupInput],
        config: dict[str, Any],
        timeout_s: float,
        deadline_s: float | None,
    ) -> list[list[SampleResult]]:
        # A daemon thread, not an executor's: a thread stuck in a function that never returns must not keep
        # the process from exiting after SIGTERM (executor threads are joined at exit).
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[list[SampleResult]]] = loop.create_future()
        stop = threading.Event()
        scored: list[list[SampleResult]] = []  # filled as the thread goes: what the budget's end keeps
        lock = threading.Lock()

        def settle(result: Any, error: BaseException | None) -> None:
            if done.done():  # the caller left (its deadline, the budget, or a cancelled call)
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        def run() -> None:
            try:
                result, error = self._inline(fn, groups, config, stop, scored, lock), None
            except worker.Stopped:
                return
            except BaseException as e:  # noqa: BLE001 - handed to the caller, whatever it is
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop is closed: the service stopped meanwhile
                pass

        budget_s = self.inline_budget_s(fn, groups, timeout_s)
        limit_s = budget_s if deadline_s is None else min(deadline_s, budget_s)
        threading.Thread(target=run, name=f"inline-{fn.name}", daemon=True).start()
        try:
            async with asyncio.timeout(limit_s):  # (not wait_for: on 3.11 it can swallow a cancellation)
                return await done
        except TimeoutError:
            if deadline_s is not None and deadline_s <= budget_s:
                raise DeadlineExceeded(
                    f"the call's deadline passed after {deadline_s:.3g} s before reward function {fn.name!r} "
                    "had scored every sample"
                ) from None
            stop.set()  # (before the copy: the thread adds at most the sample it is scoring)
            with lock:
                so_far = [list(g) for g in scored]
            return self._past_budget(fn, groups, so_far, budget_s)
        finally:
            stop.set()  # a deadline, the budget or a cancelled call: the thread stops at its next sample

    def _past_budget(
        self,
        fn: RewardFunction,
        groups: Sequence[GroupInput],
        so_far: list[list[SampleResult]],
        budget_s: float,
    ) -> list[list[SampleResult]]:
        """The results of an inline call whose budget passed: those scored, then ``TIMEOUT`` for the rest."""
        message = (
            f"reward function {fn.name!r} runs inline and this call's time budget ({budget_s:.3g} s: at most "
            f"max_inline_call_s, {self.max_inline_call_s:g} s, and the call's samples x the timeout) passed "
            "before it scored this sample"
        )
        timed_out = SampleResult(Status.TIMEOUT, fn.fallback_score, {}, message, 0.0, "timeout")
        out = []
        for i, g in enumerate(groups):
            have = so_far[i] if i < len(so_far) else []
            out.append(have + [timed_out] * (len(g.samples) - len(have)))
        return out

    @staticmethod
    def _inline(
        fn: RewardFunction,
        groups: Sequence[GroupInput],
        config: dict[str, Any],
        stop: threading.Event | None = None,
        out: list[list[SampleResult]] | None = None,
        lock: threading.Lock | None = None,
    ) -> list[list[SampleResult]]:
        """Scores the groups in order, appending each result to ``out`` as soon as it is known (under
        ``lock``); ``worker.Stopped`` once ``stop`` is set, checked between samples (or groups)."""
        fallback = fn.fallback_score
        out = [] if out is None else out
        lock = lock or threading.Lock()
        for g in groups:
            if stop is not None and stop.is_set():
                raise worker.Stopped
            if fn.group_level:
                results = [from_outcome(o, fallback) for o in worker.call_group(fn.ref, g, config)]
                with lock:
                    out.append(results)
                continue
            group: list[SampleResult] = []
            with lock:
                out.append(group)
            for s in g.samples:
                if stop is not None and stop.is_set():
                    raise worker.Stopped
                result = from_outcome(worker.call_sample(fn.ref, s, config), fallback)
                with lock:
                    group.append(result)
        return out

    async def _in_pool(
        self,
        fn: RewardFunction,
        groups: Sequence[GroupInput],
        config: dict[str, Any],
        timeout_s: float,
        deadline_s: float | None,
        first: bool = False,
    ) -> list[list[SampleResult]]:
        if not groups:
            return []
        if fn.group_level:
            tasks = [_Task(worker.call_group, (fn.ref, g, config), timeout_s) for g in groups]
        else:
            tasks = [_Task(worker.call_sample, (fn.ref, s, config), timeout_s) for g in groups for s in g.samples]
        call = self._submit(tasks, first)
        waiting = [asyncio.wrap_future(t.outcome) for t in tasks]
        budget_s = self.max_pool_call_s  # (a call without a deadline held its workers for samples x timeout)
        try:
            _, pending = await asyncio.wait(
                waiting, timeout=budget_s if deadline_s is None else min(deadline_s, budget_s)
            )
        finally:
            self._withdraw(call)  # a cancelled call (or a deadline) stops its queued and running tasks
            for w in waiting:  # failures are read below or dropped with the call; never "never retrieved"
                if w.done() and not w.cancelled():
                    w.exception()
        unit = "groups" if fn.group_level else "samples"
        if pending and deadline_s is not None and deadline_s <= budget_s:
            raise DeadlineExceeded(
                f"the call's deadline passed after {deadline_s:.3g} s with {len(pending)} of {len(tasks)} "
                f"{unit} of reward function {fn.name!r} unscored"
            )
        if pending:
            log.warning(
                "a Score call's time budget (max_pool_call_s) passed: its unscored samples time out",
                extra={"fn": fn.name, "unscored": len(pending), "of": len(tasks), "budget_s": budget_s},
            )
        past_budget = (
            f"this call's time budget (max_pool_call_s, {budget_s:g} s) passed before reward function {fn.name!r} "
            f"scored this {unit[:-1]}"
        )

        def collected(w: asyncio.Future[Any], n: int) -> list[SampleResult]:
            if w in pending:
                return [SampleResult(Status.TIMEOUT, fn.fallback_score, {}, past_budget, 0.0, "timeout")] * n
            return self._collect(w, fn, timeout_s, n)

        if fn.group_level:
            return [collected(w, len(g.samples)) for g, w in zip(groups, waiting, strict=True)]
        it = iter(waiting)
        return [[collected(next(it), 1)[0] for _ in g.samples] for g in groups]

    @staticmethod
    def _collect(task: asyncio.Future[Any], fn: RewardFunction, timeout_s: float, n: int) -> list[SampleResult]:
        fallback = fn.fallback_score
        error = task.exception()
        if error is None:
            result = task.result()
            outcomes = result if fn.group_level else [result]
            return [from_outcome(o, fallback) for o in outcomes]
        if isinstance(error, TimeoutError):
            what = "group" if fn.group_level else "sample"
            message = (
                f"reward function {fn.name!r} did not finish this {what} within {timeout_s:g} s; "
                "its worker process was stopped"
            )
            return [SampleResult(Status.TIMEOUT, fallback, {}, message, timeout_s / n, "timeout")] * n
        if isinstance(error, ProcessExpired):
            message = (
                f"the worker process running reward function {fn.name!r} died "
                f"(exit code {error.exitcode}) while scoring this {'group' if fn.group_level else 'sample'}"
            )
            return [SampleResult(Status.ERROR, fallback, {}, message, 0.0, "crash")] * n
        message = f"reward function {fn.name!r} could not be run in a worker: {type(error).__name__}: {error}"
        return [SampleResult(Status.ERROR, fallback, {}, message[:500], 0.0, "error")] * n
