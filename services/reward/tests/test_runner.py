"""The scorer: inline calls, and the killable worker pool (raise, hang, crash, deadline, group-level)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from tauflow.reward import worker
from tauflow.reward.api import GroupInput, SampleInput
from tauflow.reward.config import Executor, PoolConfig, RewardConfig
from tauflow.reward.errors import DeadlineExceeded
from tauflow.reward.registry import Registry, RewardFunction, build_registry
from tauflow.reward.runner import Scorer, Status
from tauflow.reward.worker import load_object

FUNCTIONS = textwrap.dedent(
    """
    import os, time

    def picky(sample, config):
        text = sample.completion_text
        if text == "boom":
            raise RuntimeError("cannot score " + text)
        if text == "hang":          # CPU-bound: only killing the process stops it
            while True:
                pass
        if text == "die":
            os._exit(3)
        if text.startswith("sleep"):
            time.sleep(float(text.split()[1]))
        if text.startswith("spin"):  # pure Python, holding the GIL but for the interpreter's switches
            end = time.monotonic() + float(text.split()[1])
            while time.monotonic() < end:
                pass
        return float(len(text))

    picky.fallback_score = -1.0
    picky.timeout_s = 0.3

    class Ranker:
        group_level = True
        def __call__(self, group, config):
            if group.group_id == "slow":
                time.sleep(5)
            return [float(i) for i, _ in enumerate(group.samples)]

    def pid(sample, config):
        return float(os.getpid())
    """
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Scorer, Registry]]:
    root = tmp_path_factory.mktemp("runner")
    (root / "runner_fns.py").write_text(FUNCTIONS)
    sys.path.insert(0, str(root))
    reg = Registry()
    for name, ref in [("picky", "runner_fns:picky"), ("ranker", "runner_fns:Ranker"), ("pid", "runner_fns:pid")]:
        reg.register(name, load_object(ref), ref=ref, executor=Executor.PROCESS)
    reg.register("inline_picky", load_object("runner_fns:picky"), ref="runner_fns:picky", executor=Executor.INLINE)
    scorer = Scorer(PoolConfig(workers=2, preload=[]), ["runner_fns:picky"])
    asyncio.run(scorer.start())
    yield scorer, reg
    scorer.close()
    sys.path.remove(str(root))


def groups(*texts: list[str], ids: list[str] | None = None) -> list[GroupInput]:
    out = []
    for i, ts in enumerate(texts):
        gid = ids[i] if ids else f"g{i}"
        samples = tuple(SampleInput(sample_id=str(j), completion_text=t, group_id=gid) for j, t in enumerate(ts))
        out.append(GroupInput(gid, gid, samples))
    return out


def score(
    scorer: Scorer,
    fn: RewardFunction,
    gs: list[GroupInput],
    timeout_s: float | None = None,
    deadline_s: float | None = None,
):
    return asyncio.run(scorer.score(fn, gs, {}, timeout_s or fn.timeout_s, deadline_s))


def test_results_come_back_per_group_in_order(env: tuple[Scorer, Registry]) -> None:
    scorer, reg = env
    results = score(scorer, reg.get("picky"), groups(["a", "bb", "ccc"], ["dddd"]))
    assert [[r.score for r in g] for g in results] == [[1.0, 2.0, 3.0], [4.0]]
    assert all(r.status is Status.OK and r.message == "" for g in results for r in g)


def test_a_raise_fails_only_its_sample(env: tuple[Scorer, Registry]) -> None:
    scorer, reg = env
    for name in ("picky", "inline_picky"):
        ((ok1, bad, ok2),) = score(scorer, reg.get(name), groups(["a", "boom", "cc"]))
        assert (ok1.score, ok2.score) == (1.0, 2.0) and ok1.status is Status.OK
        assert bad.status is Status.ERROR and bad.score == -1.0 and bad.reason == "error"
        assert bad.message == "RuntimeError: cannot score boom"
        assert "picky" in bad.detail  # the traceback, for the log


def test_a_hang_times_out_and_the_pool_recovers(env: tuple[Scorer, Registry]) -> None:
    scorer, reg = env
    fn = reg.get("picky")
    start = time.monotonic()
    ((hung, fine),) = score(scorer, fn, groups(["hang", "abc"]))
    assert time.monotonic() - start < 3
    assert hung.status is Status.TIMEOUT and hung.score == -1.0 and hung.reason == "timeout"
    assert "within 0.3 s" in hung.message and "stopped" in hung.message
    assert fine.status is Status.OK and fine.score == 3.0
    # the killed worker was replaced: both workers serve again
    results = score(scorer, reg.get("pid"), groups(["x"] * 8))
    assert all(r.status is Status.OK for r in results[0])


def test_the_request_timeout_overrides_the_functions(env: tuple[Scorer, Registry]) -> None:
    scorer, reg = env
    ((r,),) = score(scorer, reg.get("picky"), groups(["sleep 0.5"]), timeout_s=2.0)
    assert r.status is Status.OK and r.score == 9.0 and r.duration_s >= 0.5


def test_a_dying_worker_fails_only_its_sample(env: tuple[Scorer, Registry]) -> None:
    scorer, reg = env
    ((died, fine),) = score(scorer, reg.get("picky"), groups(["die", "ok"]))
    assert died.status is Status.ERROR and died.reason == "crash" and "exit code 3" in died.message
    assert died.score == -1.0 and fine.score == 2.0


def test_group_level_functions_score_whole_groups(env: tuple[Scorer, Registry]) -> None:
    scorer, reg = env
    fn = reg.get("ranker")
    results = score(scorer, fn, groups(["a", "b", "c"], ["d", "e"], ["f"], ids=["g0", "slow", "g2"]), timeout_s=0.3)
    assert [r.score for r in results[0]] == [0.0, 1.0, 2.0]
    assert [r.status for r in results[1]] == [Status.TIMEOUT, Status.TIMEOUT]
    assert [r.score for r in results[2]] == [0.0]


def test_a_passed_deadline_cancels_the_work(env: tuple[Scorer, Registry]) -> None:
    scorer, reg = env
    with pytest.raises(DeadlineExceeded, match="1 of 2 samples"):
        score(scorer, reg.get("picky"), groups(["a", "sleep 3"]), timeout_s=10, deadline_s=0.3)
    ((r,),) = score(scorer, reg.get("picky"), groups(["abcd"]))  # still serving
    assert r.score == 4.0


def test_a_call_of_slow_samples_leaves_workers_for_the_other_calls(env: tuple[Scorer, Registry]) -> None:
    # Two workers, a call of four samples that each take seconds: another call's sample starts at once on the
    # worker the slow call leaves free, instead of queueing behind all four.
    scorer, reg = env
    fn = reg.get("picky")

    async def main() -> tuple[list[list[object]], float]:
        slow = asyncio.create_task(scorer.score(fn, groups(["sleep 3"] * 4), {}, 10.0))
        await asyncio.sleep(0.3)  # the slow call has taken what it may
        started = time.monotonic()
        quick = await scorer.score(fn, groups(["abc"], ["de"]), {}, fn.timeout_s)
        took = time.monotonic() - started
        slow.cancel()  # its running samples are stopped, its waiting ones never start
        await asyncio.gather(slow, return_exceptions=True)
        return quick, took

    quick, took = asyncio.run(main())
    assert [[r.score for r in g] for g in quick] == [[3.0], [2.0]] and took < 2.0  # (sleeping: 2.7 s at least)
    assert not scorer._running and not scorer._calls
    ((r,),) = score(scorer, reg.get("picky"), groups(["abcd"]))  # and the pool serves on
    assert r.score == 4.0


async def _ticks_while(work, every_s: float = 0.01) -> tuple[object, list[float]]:
    """Runs ``work`` while a task on the same event loop records the gaps between its wake-ups."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.monotonic()
        while not done:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        result = await work
    finally:
        done = True
        await ticker
    return result, gaps


def test_inline_functions_run_off_the_event_loop(env: tuple[Scorer, Registry]) -> None:
    scorer, reg = env
    fn = reg.get("inline_picky")
    (results,), gaps = asyncio.run(_ticks_while(scorer.score(fn, groups(["spin 0.4", "spin 0.4", "ab"]), {}, 1.0)))
    assert [r.score for r in results] == [8.0, 8.0, 2.0]
    # 0.8 s of pure-Python work, and the loop still woke up every ~10 ms (on the loop: one gap of 0.8 s)
    assert len(gaps) > 20 and max(gaps) < 0.2, gaps


def test_an_inline_call_past_its_deadline_is_refused_and_stops_between_samples(env: tuple[Scorer, Registry]) -> None:
    scorer, reg = env
    fn = reg.get("inline_picky")
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="deadline passed after 0.3 s"):
        score(scorer, fn, groups(["spin 0.5"] * 10), deadline_s=0.3)
    assert time.monotonic() - start < 1.0
    time.sleep(0.4)  # the sample in progress ends; the thread sees the stop and scores no more
    assert not [t for t in threading.enumerate() if t.name == "inline-inline_picky"]


def test_a_request_pattern_moves_an_inline_builtin_into_the_pool() -> None:
    reg = build_registry(RewardConfig(load_entry_points=False))
    fmt, em, math = reg.get("format"), reg.get("exact_match"), reg.get("math")
    assert fmt.executor_for({}) is Executor.INLINE and fmt.executor_for({"mode": "search"}) is Executor.INLINE
    assert fmt.executor_for({"pattern": "x"}) is Executor.PROCESS
    assert em.executor_for({"extract_pattern": "(x)"}) is Executor.PROCESS
    assert math.executor_for({}) is Executor.PROCESS


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ({"score": 1.0, "components": {"x": float("nan")}}, "non-finite component 'x'"),
        ({"score": 1.0, "components": {f"c{i}": 1.0 for i in range(65)}}, "65 components"),
        ({"score": 1.0, "components": {"": 1.0}}, "component name of 0 characters"),
        ({"score": float("inf")}, "non-finite score"),
    ],
)
def test_non_finite_or_oversized_results_are_errors(result: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker.to_score(result)
