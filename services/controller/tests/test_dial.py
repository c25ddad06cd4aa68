"""The live τ's accounting: a run counts its staleness violations once per step as the steps come, exactly as
the definition (dial.violations over every change) says, and a client that toggles τ without end makes
GetRun no slower and the summary no bigger."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tauflow.api.controller.v1 import controller_pb2 as pb
from tauflow.controller import dial
from tauflow.controller.adapters.servicer import ControllerServicer
from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.dial import TauChange, violations
from tauflow.controller.ports import PeerUnavailable, QueueStats, TrainerStatus, TrainerStep
from tauflow.controller.run import Following, Poll, Run
from tauflow.controller.summary import MAX_TAU_CHANGES_KEPT


class Trainer:
    """A trainer that trains a step whenever the test says, even while a change of τ is under way (the run's
    follow loop records what it lists meanwhile)."""

    def __init__(self, run: Run, rng: random.Random) -> None:
        self.run, self.rng = run, rng
        self.version = 0
        self.following = Following(progressed_at=0.0)
        self.steps: list[tuple[int, dict[int, int]]] = []  # every step, as dial.violations takes them
        self.during_change = 0  # steps to train (and have listed) while the next change is under way
        self.fail_next = False

    def train(self, count: int = 1) -> None:
        listed = []
        for _ in range(count):
            counts = {s: self.rng.randint(1, 8) for s in self.rng.sample(range(5), self.rng.randint(1, 3))}
            listed.append(TrainerStep(self.version, self.version + 1, 0.5, max(counts), 0.0, 0.1, 10,
                                      sum(counts.values()), {}, counts, None))  # fmt: skip
            self.steps.append((self.version, counts))
            self.version += 1
        self.run._record_steps(self.following, Poll(listed, QueueStats(0, 0, self.version), 0.0))

    async def status(self) -> TrainerStatus:
        return TrainerStatus("TRAINER_STATE_TRAINING", self.version, False)

    async def set_max_staleness(self, tau: int) -> None:
        await asyncio.sleep(0)
        self.train(self.during_change)
        if self.fail_next:
            self.fail_next = False
            raise PeerUnavailable("trainer", "UNAVAILABLE")


class Queue:
    async def set_max_staleness(self, tau: int) -> None:
        await asyncio.sleep(0)


def _run(tmp_path: Path, tau: int, rng: random.Random) -> tuple[Run, Trainer]:
    config = RunConfig(model="m", dataset="d", steps=10**6, max_staleness=tau, out_dir=str(tmp_path / "run"))
    run = build_run(config, serve_metrics=False)
    trainer = Trainer(run, rng)
    run._peers = SimpleNamespace(trainer=trainer, queue=Queue())  # type: ignore[assignment]
    return run, trainer


class Context:
    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(code, details)


@pytest.mark.parametrize("seed", range(8))
def test_the_violations_counted_as_steps_come_are_those_of_the_definition(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    run, trainer = _run(tmp_path / str(seed), rng.choice([-1, 0, 1, 2]), rng)
    recorded: list[TauChange] = []  # every change, as the old summary kept them

    async def scenario() -> None:
        for _ in range(60):
            if rng.random() < 0.5:
                trainer.train(rng.randint(0, 3))
                continue
            trainer.during_change = rng.choice([0, 0, 1, 2])  # steps that race the change
            trainer.fail_next = rng.random() < 0.1  # a role that cannot be reached: no change
            before = len(run.summary.max_staleness_changes)
            try:
                await run.set_max_staleness(rng.choice([-1, 0, 1, 2, 3]))
            except PeerUnavailable:
                assert len(run.summary.max_staleness_changes) == before
            if len(run.summary.max_staleness_changes) > before:
                recorded.append(run.summary.max_staleness_changes[-1])
        trainer.during_change = 0
        trainer.train(3)

    asyncio.run(scenario())
    assert recorded, "the scenario changed τ"
    assert any(c.from_version < c.to_version for c in recorded), "some steps raced a change"
    expected = violations(trainer.steps, run.config.max_staleness, recorded)  # (100 to 250 here)
    assert run.summary.staleness_violations == expected
    assert run.summary.ledger.judged == len(trainer.steps) == len(run.summary.steps)  # each step once


def test_a_set_to_the_tau_in_force_records_nothing(tmp_path: Path) -> None:
    run, trainer = _run(tmp_path, 1, random.Random(0))
    trainer.train(2)
    assert asyncio.run(run.set_max_staleness(1)) == (1, 2)
    assert run.summary.max_staleness_changes == [] and run.summary.max_staleness_changes_total == 0


def test_toggling_tau_keeps_getrun_and_the_summary_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, trainer = _run(tmp_path, 1, random.Random(1))
    servicer = ControllerServicer(run)
    toggles = 1000
    work = {"judged": 0}

    def counted_exceeds(staleness: int, tau: int) -> bool:
        work["judged"] += 1
        return staleness > tau >= 0

    monkeypatch.setattr(dial, "exceeds", counted_exceeds)

    async def scenario() -> None:
        trainer.train(200)
        for i in range(toggles):
            await run.set_max_staleness(2 + i % 2)
            if i % 300 == 299:
                trainer.train(5)  # the run goes on meanwhile
        work["judged"] = 0
        reply = (await servicer.GetRun(pb.GetRunRequest(), Context())).run
        assert reply.max_staleness == 3  # (an odd number of toggles after 2: 2, 3, ..., 3)
        assert reply.staleness.violations == run.summary.staleness_violations

    asyncio.run(scenario())
    assert work["judged"] == 0  # GetRun reads the count: no step, no change looked at again
    ledger = run.summary.ledger
    assert ledger.judged == 215  # each step judged once (200, then 5 after each 300 changes)
    assert ledger.windows <= 2  # changes made at one version are one window; those past are folded
    assert ledger.looked_at <= 2 * ledger.judged  # judging a step looks at the changes it may race only
    summary = run.summary
    assert len(summary.max_staleness_changes) == MAX_TAU_CHANGES_KEPT and summary.max_staleness_changes_total == toggles
    assert summary.max_staleness_changes[-1].tau == 3
    written = json.loads((summary.write(tmp_path / "out")[0]).read_text())
    assert written["max_staleness_changes_total"] == toggles
    assert len(written["max_staleness_changes"]) == MAX_TAU_CHANGES_KEPT
    assert written["staleness_violations"] == summary.staleness_violations


class Role:
    """A queue or trainer that holds the τ it was given; it can wait on ``gate`` or fail the next ``failures`` sets."""

    def __init__(self, tau: int) -> None:
        self.tau = tau
        self.gate: asyncio.Event | None = None
        self.failures = 0
        self.late = False
        self.version = 0

    async def status(self) -> TrainerStatus:
        return TrainerStatus("TRAINER_STATE_TRAINING", self.version, False)

    async def set_max_staleness(self, tau: int) -> None:
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if self.late:  # applies it, but its answer comes too late (a deadline, a broken connection)
            self.late, self.tau = False, tau
            raise PeerUnavailable("role", "DEADLINE_EXCEEDED")
        if self.failures:
            self.failures -= 1
            raise PeerUnavailable("role", "UNAVAILABLE")
        self.tau = tau


def _roles_run(tmp_path: Path, tau: int) -> tuple[Run, Role, Role]:
    config = RunConfig(model="m", dataset="d", steps=10**6, max_staleness=tau, out_dir=str(tmp_path / "run"))
    run = build_run(config, serve_metrics=False)
    trainer, queue = Role(tau), Role(tau)
    run._peers = SimpleNamespace(trainer=trainer, queue=queue)  # type: ignore[assignment]
    return run, trainer, queue


def test_a_change_whose_caller_is_cancelled_between_the_roles_still_reaches_both(tmp_path: Path) -> None:
    """A caller's deadline cancelled the change between the trainer and the queue: they kept different τ, the
    controller recorded neither, and a later set of its record answered OK and changed nothing (a probe left
    the roles unbounded while every status said τ = 3)."""
    run, trainer, queue = _roles_run(tmp_path, 3)

    async def scenario() -> None:
        queue.gate = asyncio.Event()  # raising τ: the trainer first, then the queue, which waits
        caller = asyncio.ensure_future(run.set_max_staleness(-1))
        while trainer.tau != -1:
            await asyncio.sleep(0)
        caller.cancel()  # the caller's deadline passes with the trainer changed and the queue not yet
        with pytest.raises(asyncio.CancelledError):
            await caller
        queue.gate.set()
        while run._tau_changes:
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert (run.tau, trainer.tau, queue.tau) == (-1, -1, -1)
    assert run.summary.max_staleness_changes_total == 1


def test_a_change_that_fails_half_way_puts_the_first_role_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run, trainer, queue = _roles_run(tmp_path, 3)
    queue.failures = 1  # lowering: the queue first, then the trainer; raising: the trainer, then the queue
    with pytest.raises(PeerUnavailable):
        asyncio.run(run.set_max_staleness(5))
    assert (run.tau, trainer.tau, queue.tau) == (3, 3, 3)
    assert run.summary.max_staleness_changes_total == 0 and not run._tau_diverged
    # (the caller may have left: the log tells the outcome)
    [failed] = [r for r in caplog.records if r.getMessage().startswith("a change of max_staleness failed")]
    assert (failed.tau, failed.kept) == (5, 3)


def test_a_role_that_cannot_be_put_back_gets_the_tau_in_force_again(tmp_path: Path) -> None:
    run, trainer, queue = _roles_run(tmp_path, 3)
    queue.failures = 1
    trainer_fails_after_its_change = {"left": 1}
    real_set = trainer.set_max_staleness

    async def set_then_unreachable(tau: int) -> None:
        if tau == 3 and trainer_fails_after_its_change["left"]:  # the put-back fails too
            trainer_fails_after_its_change["left"] -= 1
            raise PeerUnavailable("trainer", "UNAVAILABLE")
        await real_set(tau)

    trainer.set_max_staleness = set_then_unreachable  # type: ignore[method-assign]
    with pytest.raises(PeerUnavailable):
        asyncio.run(run.set_max_staleness(-1))
    assert (run.tau, trainer.tau, queue.tau) == (3, -1, 3) and run._tau_diverged
    # A set of the τ in force gives it to both roles (before, it answered OK and changed nothing).
    assert asyncio.run(run.set_max_staleness(3)) == (3, 0)
    assert (run.tau, trainer.tau, queue.tau) == (3, 3, 3) and not run._tau_diverged
    # And the follow loop does the same by itself.
    trainer.tau = -1
    run._tau_diverged = True
    asyncio.run(run._reapply_tau(run._peers, {"queue", "trainer"}))  # type: ignore[arg-type]
    assert (trainer.tau, queue.tau) == (3, 3) and not run._tau_diverged


@pytest.mark.parametrize(("tau", "late"), [(1, "queue"), (1, "trainer"), (9, "queue")])
def test_a_role_that_applied_the_change_but_answered_too_late_is_put_back(tmp_path: Path, tau: int, late: str) -> None:
    """Counted as changed only once it answered, a role that applied the τ and answered too late kept it: the
    queue looser than the trainer, the record on the old τ, and nothing to repair it (a reviewer's finding)."""
    run, trainer, queue = _roles_run(tmp_path, 5)
    (queue if late == "queue" else trainer).late = True
    with pytest.raises(PeerUnavailable):
        asyncio.run(run.set_max_staleness(tau))
    assert (run.tau, trainer.tau, queue.tau) == (5, 5, 5)


def test_a_second_change_while_one_is_under_way_is_refused_to_be_retried(tmp_path: Path) -> None:
    """A change runs to its end, so against a hung role callers that retry must not pile changes up."""
    from tauflow.controller.run import TauChangeUnderWay

    run, trainer, queue = _roles_run(tmp_path, 3)

    async def scenario() -> None:
        queue.gate = asyncio.Event()  # lowering: the queue first, which hangs
        first = asyncio.ensure_future(run.set_max_staleness(1))
        while not run._tau_changes:
            await asyncio.sleep(0)
        with pytest.raises(TauChangeUnderWay):
            await run.set_max_staleness(0)
        queue.gate.set()
        assert await first == (3, 0)

    asyncio.run(scenario())
    assert (run.tau, trainer.tau, queue.tau) == (1, 1, 1)


def test_step_times_stay_within_the_run_whatever_the_trainers_wall_clock(tmp_path: Path) -> None:
    # committed_at is the trainer's wall clock: a step of it (or another host's clock) put steps an hour
    # before the run began, or after the controller saw them
    run, _ = _run(tmp_path, 1, random.Random(0))
    following = Following(progressed_at=0.0)
    wall0 = run._wall0

    def listed(step: int, committed_at: float) -> TrainerStep:
        return TrainerStep(step, step + 1, 0.5, 0, 0.0, 0.1, 10, 1, {}, {0: 1}, committed_at)

    run._record_steps(following, Poll([listed(0, wall0 + 2.0)], QueueStats(0, 0, 1), 3.0))
    run._record_steps(following, Poll([listed(1, wall0 - 3600.0), listed(2, wall0 + 4.5)], QueueStats(0, 0, 3), 5.0))
    run._record_steps(following, Poll([listed(3, wall0 + 3600.0)], QueueStats(0, 0, 4), 7.0))
    assert [s.committed_s for s in run.summary.steps] == [2.0, 2.0, 4.5, 7.0]
