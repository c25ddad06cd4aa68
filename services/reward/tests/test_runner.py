"""The scorer: inline calls, and the killable worker pool (raise, hang, crash, deadline, group-level)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tauflow.reward import runner, worker
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

    import threading
    release = threading.Event()
    called = []

    def stall(sample, config):
        # blocks on 'block' until the test releases it (inline only: the Event is the test process's)
        called.append(sample.completion_text)
        if sample.completion_text == "block":
            release.wait(30)
        return float(len(sample.completion_text))

    stall.fallback_score = -1.0
    stall.timeout_s = 10.0

    class StallGroups:
        group_level = True
        timeout_s = 10.0
        fallback_score = -1.0
        def __call__(self, group, config):
            return [stall(s, config) for s in group.samples]
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
    reg.register("stall", load_object("runner_fns:stall"), ref="runner_fns:stall", executor=Executor.INLINE)
    reg.register(
        "stall_groups", load_object("runner_fns:StallGroups"), ref="runner_fns:StallGroups", executor=Executor.INLINE
    )
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


def test_a_pool_call_without_a_deadline_ends_at_max_pool_call_s_with_the_rest_timed_out(
    env: tuple[Scorer, Registry],
) -> None:
    # (a call with no deadline held its workers for samples x timeout: 64 such calls held every slot for minutes)
    scorer, reg = env
    scorer.max_pool_call_s = 1.0
    try:
        start = time.monotonic()
        ((fast, slow, unstarted),) = score(scorer, reg.get("picky"), groups(["ab", "sleep 5", "sleep 5"]), timeout_s=10)
        assert time.monotonic() - start < 4
        assert fast.status is Status.OK and fast.score == 2.0
        for r in (slow, unstarted):
            assert r.status is Status.TIMEOUT and r.score == -1.0 and r.reason == "timeout"
            assert r.message.startswith("this call's time budget (max_pool_call_s, 1 s) passed"), r.message
        # a deadline before the budget is still the caller's: DEADLINE_EXCEEDED
        with pytest.raises(DeadlineExceeded, match="deadline passed after 0.3 s"):
            score(scorer, reg.get("picky"), groups(["sleep 5"]), timeout_s=10, deadline_s=0.3)
    finally:
        scorer.max_pool_call_s = 600.0
    ((r,),) = score(scorer, reg.get("picky"), groups(["abcd"]))  # the stopped workers were replaced
    assert r.score == 4.0


def test_the_runs_own_call_takes_the_next_free_worker_before_calls_waiting_longer(
    env: tuple[Scorer, Registry],
) -> None:
    # (callers without the run token cannot starve the run: its call is not queued behind theirs)
    _, reg = env
    fn = reg.get("picky")
    scorer = Scorer(PoolConfig(workers=1, call_share=1.0, preload=[]), ["runner_fns:picky"])

    async def scenario() -> dict[str, float]:
        await scorer.start()
        ended: dict[str, float] = {}
        start = time.monotonic()

        async def call(name: str, texts: list[str], first: bool) -> None:
            await scorer.score(fn, groups(texts), {}, 10.0, first=first)
            ended[name] = time.monotonic() - start

        anyone = asyncio.create_task(call("anyone", ["sleep 0.4"] * 4, False))
        await asyncio.sleep(0.1)  # its first sample runs; three wait
        others = asyncio.create_task(call("others", ["sleep 0.4"] * 2, False))
        await asyncio.sleep(0.05)
        await call("run", ["abc"], True)
        await asyncio.gather(anyone, others)
        return ended

    try:
        ended = asyncio.run(scenario())
    finally:
        scorer.close()
    assert ended["run"] < ended["others"] < ended["anyone"], ended
    assert ended["run"] < 1.0, ended  # one sample of 0.4 s ahead of it, not five


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
    # the sample in progress ends (its 0.5 s spin); the thread sees the stop and scores no more (the nine
    # samples left would take 4.5 s: gone well before that, it stopped between samples)
    deadline = time.monotonic() + 2.5
    while _inline_threads("inline_picky") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _inline_threads("inline_picky")


@pytest.fixture
def stall(env: tuple[Scorer, Registry]) -> Iterator[Any]:
    """The ``stall`` functions' module, reset, and released at the end (its blocked threads end)."""
    fns = sys.modules["runner_fns"]
    fns.release.clear()
    fns.called.clear()
    yield fns
    fns.release.set()


def _inline_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"inline-{name}"]


def test_an_inline_call_without_a_deadline_ends_at_its_budget_with_the_rest_timed_out(
    env: tuple[Scorer, Registry], stall: Any
) -> None:
    # Without a deadline from the caller nothing ended an inline call: a request whose samples cost seconds
    # each (a 1 MiB reference normalised per sample) held its slot and a thread for hours.
    _, reg = env
    fn = reg.get("stall")
    scorer = Scorer(
        PoolConfig(workers=1, preload=[]), max_inline_call_s=3.0
    )  # (seconds: a loaded machine scores the quick samples within it)
    (results,) = asyncio.run(scorer.score(fn, groups(["ab", "cde", "block", "f", "g"]), {}, fn.timeout_s))
    assert [r.status for r in results] == [Status.OK, Status.OK, Status.TIMEOUT, Status.TIMEOUT, Status.TIMEOUT]
    assert [r.score for r in results] == [2.0, 3.0, -1.0, -1.0, -1.0]  # the fallback, as a pool timeout gives
    assert {r.reason for r in results[2:]} == {"timeout"}
    assert "runs inline and this call's time budget (3 s: at most max_inline_call_s, 3 s" in results[2].message
    # the thread stops at its next sample: the two after the blocked one are never scored
    stall.release.set()
    for _ in range(200):
        if not _inline_threads("stall"):
            break
        time.sleep(0.01)
    assert not _inline_threads("stall")
    assert stall.called == ["ab", "cde", "block"]


def test_an_inline_calls_budget_is_its_samples_times_their_timeout_when_that_is_less(
    env: tuple[Scorer, Registry], stall: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, reg = env
    fn, by_group = reg.get("stall"), reg.get("stall_groups")
    scorer = Scorer(PoolConfig(workers=1, preload=[]), max_inline_call_s=60.0)
    assert scorer.inline_budget_s(fn, groups(["a"] * 3, ["b"] * 2), 10.0) == 50.0  # 5 samples x 10 s
    assert scorer.inline_budget_s(fn, groups(["a"] * 3, ["b"] * 4), 10.0) == 60.0  # max_inline_call_s
    assert scorer.inline_budget_s(by_group, groups(["a"] * 3, ["b"] * 4), 10.0) == 20.0  # 2 groups x 10 s
    # a call of one sample of a 1 s function: a loaded machine must not time it out
    assert scorer.inline_budget_s(fn, groups(["a"]), 1.0) == runner.MIN_INLINE_BUDGET_S == 10.0
    monkeypatch.setattr(runner, "MIN_INLINE_BUDGET_S", 0.0)  # (for the short budgets below)
    # the request's sample_timeout is the timeout: 3 samples at 1 s each
    (results,) = asyncio.run(scorer.score(fn, groups(["a", "block", "c"]), {}, 1.0))
    assert [r.status for r in results] == [Status.OK, Status.TIMEOUT, Status.TIMEOUT]
    assert "time budget (3 s" in results[1].message
    # a group-level function: the groups scored keep their scores, the others time out whole
    (first, second) = asyncio.run(scorer.score(by_group, groups(["a", "bc"], ["block", "d"]), {}, 1.0))
    assert [r.score for r in first] == [1.0, 2.0] and {r.status for r in first} == {Status.OK}
    assert [(r.status, r.score) for r in second] == [(Status.TIMEOUT, -1.0)] * 2


def test_the_callers_deadline_still_answers_deadline_exceeded_when_it_comes_before_the_budget(
    env: tuple[Scorer, Registry], stall: Any
) -> None:
    _, reg = env
    fn = reg.get("stall")
    scorer = Scorer(PoolConfig(workers=1, preload=[]), max_inline_call_s=60.0)
    with pytest.raises(DeadlineExceeded, match="deadline passed after 0.2 s"):
        asyncio.run(scorer.score(fn, groups(["a", "block"]), {}, 10.0, deadline_s=0.2))
    stall.release.clear()
    # a deadline later than the budget: the budget ends the call, with its samples timed out
    (results,) = asyncio.run(scorer.score(fn, groups(["a", "block"]), {}, 0.2, deadline_s=30.0))
    assert [r.status for r in results] == [Status.OK, Status.TIMEOUT]


def test_a_large_shared_reference_is_normalised_once_per_call_inline(
    env: tuple[Scorer, Registry], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The probe's exact_match request at a smaller scale, through the real inline path (its own thread):
    # 2,000 samples sharing a group's 64 KiB reference normalised it 2,000 times (46 ms each at 1 MiB).
    from tauflow.reward import builtins

    scorer, _ = env
    em = build_registry(RewardConfig(load_entry_points=False)).get("exact_match")
    lengths: list[int] = []
    real = builtins._SPACES

    class Counting:
        def sub(self, repl: str, text: str) -> str:
            lengths.append(len(text))
            return real.sub(repl, text)

    monkeypatch.setattr(builtins, "_SPACES", Counting())
    reference = "x " * 32_768  # 65,536 characters: the default max_answer_chars
    shared = {"answer": reference}
    samples = tuple(SampleInput(sample_id=str(i), completion_text="x", group_metadata=shared) for i in range(2000))
    (results,) = asyncio.run(scorer.score(em, [GroupInput("g", "p", samples, shared)], em.default_config, 1.0))
    assert {(r.status, r.score) for r in results} == {(Status.OK, 0.0)}
    assert lengths.count(len(reference)) == 1 and len(lengths) == 1 + 2000
    # one character more is an error of each sample, found without normalising anything
    lengths.clear()
    shared = {"answer": reference + "x"}
    samples = tuple(SampleInput(sample_id=str(i), completion_text="x", group_metadata=shared) for i in range(100))
    (results,) = asyncio.run(scorer.score(em, [GroupInput("g", "p", samples, shared)], em.default_config, 1.0))
    assert {r.status for r in results} == {Status.ERROR} and lengths == []
    assert results[0].message == "ValueError: the reference is 65537 characters long; max_answer_chars is 65536"


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
        ({"score": 1.7e308}, "beyond ±1e\\+09"),  # (the queue refuses such a group)
        ({"score": -2e9}, "beyond"),
    ],
)
def test_non_finite_or_oversized_results_are_errors(result: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker.to_score(result)
