"""A restart on Ray that cannot start its process is one more failed start, as on the local launcher: an actor
not placed in time (the cluster full), an actor that dies while starting it, or an error raised on its node
(a full disk there) is retried after its backoff and counted against max_restarts; before, it ended the run.

The Ray calls are faked (no cluster: what fails here is what a cluster rarely does on demand); Ray's own
exception classes are used, as ``ray.get`` raises them."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import ray.exceptions

from tauflow.controller.config import RayConfig
from tauflow.controller.launcher import ServiceFailed, ServiceSpec
from tauflow.controller.raylauncher import RayLauncher

PLACED = {"pid": 4242, "host": "10.0.0.7", "node_id": "node-a"}


class Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeActor:
    """A ServiceHost actor: ``spawn`` answers the cluster's next outcome (a placement, or an exception that
    ``ray.get`` raises)."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.code: int | None = None  # the exit code of its process; None while it runs
        self.killed = False
        self.spawns = 0

        def spawn(*args: Any) -> Any:
            self.spawns += 1
            self.code = None
            return cluster.outcomes.pop(0)

        self.spawn = Method(spawn)
        self.poll = Method(lambda: self.code)
        self.ready = Method(lambda: {"grpc_port": 5000, "metrics_port": 5001, "pid": PLACED["pid"]})
        self.kill_group = Method(lambda: None)
        self.signal = Method(lambda sig: None)


class FakeCluster:
    """What the launcher asks of the ``ray`` module: get, kill, available_resources (patched in)."""

    def __init__(self) -> None:
        self.outcomes: list[Any] = []
        self.actors: list[FakeActor] = []

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if isinstance(ref, BaseException):
            raise ref
        return ref

    def kill(self, actor: FakeActor) -> None:
        actor.killed = True

    def available_resources(self) -> dict[str, float]:
        return {"CPU": 0.0}

    def new_actor(self, svc: Any, node_id: str) -> FakeActor:
        self.actors.append(FakeActor(self))
        return self.actors[-1]


def _launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cluster: FakeCluster, **supervision: Any) -> RayLauncher:
    for name in ("get", "kill", "available_resources"):
        monkeypatch.setattr(ray, name, getattr(cluster, name))
    launcher = RayLauncher(tmp_path, RayConfig(), backoff_s=1.0, **supervision)
    monkeypatch.setattr(launcher, "_connect", lambda: ray)
    monkeypatch.setattr(launcher, "_create_actor", cluster.new_actor)
    return launcher


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _disk_full_on_the_node() -> BaseException:
    cause = OSError(errno.ENOSPC, "No space left on device")
    return ray.exceptions.RayTaskError("spawn", "Traceback (most recent call last): ...", cause).as_instanceof_cause()


def test_a_restart_that_ray_cannot_place_or_start_is_a_failed_start_retried_then_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cluster, clock = FakeCluster(), Clock()
    launcher = _launcher(tmp_path, monkeypatch, cluster, max_restarts=4, clock=clock)
    cluster.outcomes = [dict(PLACED)]
    reward = launcher.start(ServiceSpec("reward", {}))
    first = cluster.actors[0]
    assert reward.up and first.spawns == 1

    first.code = -9  # its process dies
    caplog.set_level(logging.WARNING)
    cluster.outcomes = [
        ray.exceptions.GetTimeoutError(),  # the restart's actor is not placed in time (the cluster is full)
        _disk_full_on_the_node(),  # the next one raises on its node
        ray.exceptions.RayActorError(error_msg="the actor died"),  # the next one's actor dies
        dict(PLACED),
    ]
    assert launcher.check() == []  # death seen: its restart due after the backoff
    reasons = []
    for attempt in range(3):
        clock.now += 2.0**attempt
        assert launcher.check() == []  # a failed start, not the end of the run
        assert reward.restarts == attempt + 1 and reward.next_restart_at == clock.now + 2.0 ** (attempt + 1)
        [line] = [r for r in caplog.records if "a restart could not start its process" in r.getMessage()]
        reasons.append(line.__dict__["reason"])
        caplog.clear()
    assert "not placed within" in reasons[0] and first.killed  # (its queued spawn would start an orphan)
    assert "disk full: OSError" in reasons[1] and "No space left on device" in reasons[1]
    assert "Traceback" not in reasons[1]  # one line, not the node's traceback
    assert "died while starting it" in reasons[2]
    # The timed-out actor was replaced; the one whose node refused was asked again (then it died).
    assert len(cluster.actors) == 2 and cluster.actors[1].spawns == 2

    clock.now += 8.0
    assert launcher.check() == []  # begun, on a new actor (the dead one's replacement)
    assert launcher.check() == ["reward"]  # and serving
    assert reward.up and reward.restarts == 4 and len(cluster.actors) == 3


def test_a_restart_ray_cannot_place_past_the_budget_fails_the_run_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, clock = FakeCluster(), Clock()
    launcher = _launcher(tmp_path, monkeypatch, cluster, max_restarts=2, clock=clock)
    cluster.outcomes = [dict(PLACED)]
    launcher.start(ServiceSpec("reward", {}))
    cluster.actors[0].code = -9
    cluster.outcomes = [ray.exceptions.GetTimeoutError() for _ in range(3)]
    with pytest.raises(ServiceFailed) as failed:
        for _ in range(10):
            launcher.check()
            clock.now += 4.0
    assert "its Ray actor was not placed within" in str(failed.value)
    assert "after 2 restarts (max_restarts 2)" in str(failed.value)
