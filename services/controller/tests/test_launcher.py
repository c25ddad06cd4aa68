"""The local launcher with real services: ready files, health, restart in place, clean stop; a service whose
controller is killed stops by itself; a new controller waits for the previous run's processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.controller.adapters.health_client import check_health
from tauflow.controller.config import RayConfig
from tauflow.controller.launcher import LocalLauncher, Rendezvous, ServiceFailed, ServiceSpec, instance_name
from tauflow.controller.raylauncher import RayLauncher
from tauflow.controller.scaling import health_of


class Clock:
    """The launcher's supervision time, moved on by the test: the real time, plus what the test skipped."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skipped

    def advance(self, seconds: float) -> None:
        self.skipped += seconds


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_starts_restarts_in_place_and_stops(tmp_path) -> None:
    launcher = LocalLauncher(tmp_path, max_restarts=2, backoff_s=0.1)
    tokens = tmp_path / "tokens"
    tokens.write_text("agent: 0123456789abcdef0123\n")
    try:
        queue = launcher.start(
            ServiceSpec(
                "queue",
                {
                    "wal.dir": str(tmp_path / "wal"),
                    "external.enabled": True,
                    "external.port": 0,
                    "external.tokens_file": str(tokens),
                },
            )
        )
        assert _serving(queue.address)
        address, external_port = queue.address, queue.info["external_port"]
        os.kill(queue.proc.pid, signal.SIGKILL)
        queue.proc.wait()
        deadline = time.monotonic() + 30
        restarted: list[str] = []
        while not restarted and time.monotonic() < deadline:
            restarted = launcher.check()
            time.sleep(0.05)
        assert restarted == ["queue"]
        assert queue.address == address and _serving(address)  # same port: peers reconnect
        assert queue.info["external_port"] == external_port  # and so do the producers outside the run
        assert "=== start 1 of queue" in queue.log_file.read_text()
    finally:
        codes = launcher.stop()
    assert codes == {"queue": 0}  # SIGTERM drains and exits cleanly


def test_a_stopped_service_is_seen_not_answering_and_then_answering_again(tmp_path, caplog) -> None:
    """A SIGSTOPped process is alive (no restart), but no longer serves: the health probe logs and counts
    it, and logs its return; nothing is restarted."""
    launcher = LocalLauncher(tmp_path, health_check=check_health, health_timeout_s=0.5, health_every_s=0.0)
    caplog.set_level("WARNING", logger="tauflow.controller.health")
    try:
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        assert launcher.check() == [] and launcher.health.answering("queue")
        os.kill(queue.proc.pid, signal.SIGSTOP)
        try:
            assert launcher.check() == []  # alive: nothing to restart
            assert not launcher.health.answering("queue") and launcher.health.unanswered("queue") == 1
            assert "DEADLINE_EXCEEDED" in launcher.health.roles["queue"].answer
            launcher.check()  # still stopped: counted once per outage
            assert launcher.health.unanswered("queue") == 1
        finally:
            os.kill(queue.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not launcher.health.answering("queue") and time.monotonic() < deadline:
            launcher.check()
        assert launcher.health.answering("queue") and queue.starts == 1
        said = [r.getMessage() for r in caplog.records]
        assert said == ["service not answering health", "service answers health again"], said
    finally:
        codes = launcher.stop()
    assert codes == {"queue": 0}


def test_a_service_that_keeps_dying_fails_the_run_with_its_name(tmp_path) -> None:
    launcher = LocalLauncher(tmp_path, max_restarts=0, backoff_s=0.1)
    with pytest.raises(ServiceFailed, match="service 'queue' failed: exited with code 2 while starting") as err:
        launcher.start(ServiceSpec("queue", {"no_such_key": 1}))
    assert "unknown config key 'no_such_key'" in str(err.value)
    launcher.stop()


def test_a_begun_start_returns_before_the_service_serves_and_is_polled_until_it_does(tmp_path) -> None:
    # How the run scales out: begin_start returns once the process runs (a rollout server's model may take
    # minutes to load), poll_start says when it serves; check() leaves it alone meanwhile. One that dies while
    # starting fails its poll, naming it, and is not restarted by check().
    launcher = LocalLauncher(tmp_path, max_restarts=2, backoff_s=0.1)
    try:
        queue = launcher.begin_start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        assert not queue.info and not queue.up  # not serving yet: no port known
        assert launcher.addresses() == {}
        deadline = time.monotonic() + 60
        while not launcher.poll_start("queue"):
            assert time.monotonic() < deadline
            assert launcher.check() == []
            time.sleep(0.05)
        assert queue.up and _serving(queue.address) and queue.ready_by == 0.0
        broken = launcher.begin_start(ServiceSpec("reward", {"no_such_key": 1}))
        broken.proc.wait(60)  # it exits at once: its config is refused
        for _ in range(2):  # (past the restart backoff: a died service would be restarted by now)
            assert launcher.check() == []
            time.sleep(0.3)
        assert broken.starts == 1  # not restarted: still starting as far as check goes
        with pytest.raises(ServiceFailed, match="service 'reward' failed: exited with code 2 while starting"):
            launcher.poll_start("reward")
    finally:
        codes = launcher.stop()
    assert codes["queue"] == 0


def test_once_stopped_the_launcher_starts_and_restarts_nothing(tmp_path) -> None:
    # (a scale-out or a restart still under way in a thread of a cancelled run must not leave a process behind)
    launcher = LocalLauncher(tmp_path)
    assert launcher.stop() == {}
    for start in (launcher.start, launcher.begin_start):
        with pytest.raises(ServiceFailed, match="the run is stopping"):
            start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
    assert launcher.services == {} and not (tmp_path / "logs" / "queue.log").exists()
    assert launcher.check() == []


class DrainingProcess:
    """A service process that drains on SIGTERM (at once, or never: ``ignores_term``) and records what the
    launcher did to it in ``events``."""

    def __init__(self, name: str, events: list[tuple[str, str]], ignores_term: bool = False) -> None:
        self.name, self.events, self.ignores_term, self.code = name, events, ignores_term, None
        self.pid = 0

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.events.append(("term", self.name))
        if not self.ignores_term:
            self.code = 0

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            time.sleep(timeout or 0)
            raise subprocess.TimeoutExpired(self.name, timeout or 0)
        self.events.append(("exited", self.name))
        return self.code


def test_the_stop_drains_the_rollout_and_trainer_before_the_services_they_call(tmp_path) -> None:
    # The run's stop order (run.STOP_ORDER): the rollout gives its unused tickets back to the queue and the
    # trainer's last acknowledgements land only while the queue, the sidecar and the reward still answer.
    from tauflow.controller.launcher import ManagedService
    from tauflow.controller.run import STOP_ORDER

    class Launcher(LocalLauncher):
        def _kill(self, svc: ManagedService) -> None:
            events.append(("kill", svc.name))
            if svc.name != "rollout-1":  # (one that outlives its SIGKILL: in uninterruptible sleep, say)
                svc.proc.code = -9

    events: list[tuple[str, str]] = []
    launcher = Launcher(tmp_path, stop_grace_s=0.1)
    roles = ["queue", "reward", "weights", "trainer", "rollout", "rollout-1", "metrics-agent"]
    for name in roles:
        svc = ManagedService(ServiceSpec(name, role=name.split("-")[0] if name != "metrics-agent" else name), tmp_path)
        svc.proc = DrainingProcess(name, events, ignores_term=name in ("trainer", "rollout-1"))
        launcher.services[name] = svc
    codes = launcher.stop(order=STOP_ORDER, grace_s=0.2)
    assert codes == {**dict.fromkeys(roles, 0), "trainer": -9, "rollout-1": None}
    first = {"rollout", "rollout-1", "trainer"}
    # the first stage at once; the next once each of the first has exited (the trainer killed after the grace;
    # rollout-1 outlived its SIGKILL, and the services stop all the same)
    assert {name for _, name in events[:3]} == first and {what for what, _ in events[:3]} == {"term"}
    assert ("kill", "trainer") in events[3:7] and ("kill", "rollout-1") in events[3:7]
    assert {name for _, name in events[3:7]} == first
    services = [name for what, name in events[7:] if what == "term"]
    assert set(services[:3]) == {"queue", "reward", "weights"} and services[3:] == ["metrics-agent"]


def test_a_process_spawned_as_the_run_stopped_is_killed_by_its_starter(tmp_path) -> None:
    # stop() looks at the services once: a launch thread that registered a service before it and spawned the
    # process after it would leave that process behind; the starter, told the run is stopping, kills it.
    launcher = LocalLauncher(tmp_path)
    svc = launcher.begin_start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
    assert svc.proc is not None and svc.proc.poll() is None
    launcher.stopping = True  # (as stop() sets it, after its look)
    with pytest.raises(ServiceFailed, match="the run is stopping"):
        launcher.poll_start("queue")
    assert svc.proc.wait(10) is not None


def _kill_and_check(launcher: LocalLauncher, name: str) -> list[str]:
    svc = launcher.services[name]
    os.kill(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        restarted = launcher.check()
        if restarted:
            return restarted
        time.sleep(0.05)
    return []


def test_the_restart_budget_counts_crashes_in_a_row_not_over_the_run(tmp_path) -> None:
    clock = Clock()
    launcher = LocalLauncher(tmp_path, max_restarts=1, backoff_s=0.05, restart_window_s=600.0, clock=clock)
    try:
        launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        assert _kill_and_check(launcher, "queue") == ["queue"]
        clock.advance(600.0)  # up for the whole window: the next crash is not part of a loop
        assert _kill_and_check(launcher, "queue") == ["queue"]
        # Within the window of its last start: the second crash in a row, past the budget.
        with pytest.raises(ServiceFailed, match="service 'queue' failed: exited with code -9 after 1 restarts"):
            _kill_and_check(launcher, "queue")
    finally:
        launcher.stop()


# A controller in a process of its own: starts a queue through the local launcher, prints its pid, waits.
CONTROLLER = """
import sys, time
from pathlib import Path
from tauflow.controller.launcher import LocalLauncher, ServiceSpec
run = Path(sys.argv[1])
queue = LocalLauncher(run).start(ServiceSpec("queue", {"wal.dir": str(run / "wal"), "server.drain_grace_s": 0.5}))
print(queue.proc.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_service_stops_by_itself_drained_when_its_controller_is_killed(tmp_path: Path) -> None:
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(controller.stdout.readline())
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"TAUFLOW_PARENT_PID={controller.pid}".encode() in environ  # told whom it belongs to
    finally:
        controller.kill()  # SIGKILL: the controller stops nothing
        controller.wait()
    deadline = time.monotonic() + 10
    while _running(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the queue outlived its controller by 10 s")
        time.sleep(0.05)
    log = (tmp_path / "logs" / "queue.log").read_text()
    assert f"controller {controller.pid} gone: stopping" in log and log.rstrip().endswith("stopped")  # drained


def test_a_new_controller_waits_for_the_previous_runs_process_to_stop(tmp_path) -> None:
    # What a previous controller's queue looks like while it drains: a tauflow.queue process named by the
    # queue's ready file in the run folder. It ends after 1.5 s; the new queue starts only then.
    previous = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)", "-m", "tauflow.queue"])
    (tmp_path / "queue.ready.json").write_text(json.dumps({"pid": previous.pid, "grpc_port": 1}))
    launcher = LocalLauncher(tmp_path)
    started = time.monotonic()
    try:
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        assert previous.poll() is not None and time.monotonic() - started >= 1.0
        assert queue.info["pid"] != previous.pid
    finally:
        launcher.stop()
        previous.wait()
    # One that does not stop fails the start, naming it, and starts nothing.
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "tauflow.queue"])
    (tmp_path / "queue.ready.json").write_text(json.dumps({"pid": stuck.pid, "grpc_port": 1}))
    launcher = LocalLauncher(tmp_path)
    launcher.previous_wait_s = 0.5
    try:
        with pytest.raises(
            ServiceFailed,
            match=f"service 'queue' failed: its process {stuck.pid} from a previous "
            "run in .* still runs after 0.5s: is another tauflow run using this out_dir",
        ):
            launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        assert launcher.services["queue"].proc is None
    finally:
        stuck.kill()
        stuck.wait()
        launcher.stop()


def test_a_services_settings_are_in_a_file_of_its_user_not_on_its_command_line(tmp_path) -> None:
    # A setting's value (here the queue's log folder, as an engine's API key would be) is not in the process's
    # command line, which any local user reads; the service gets it from its settings file, mode 0600, and
    # the run's setting wins over the environment's (as it did on the command line).
    secret = "wal-sk-SECRET0123456789"
    launcher = LocalLauncher(tmp_path)
    spec = ServiceSpec(
        "queue", {"wal.dir": str(tmp_path / secret)}, env={"TAUFLOW_QUEUE_WAL__DIR": str(tmp_path / "env")}
    )
    try:
        queue = launcher.start(spec)
        cmdline = Path(f"/proc/{queue.proc.pid}/cmdline").read_bytes().decode()
        assert secret not in cmdline and "--set" not in cmdline
        assert f"--config\0{queue.settings_file}" in cmdline
        assert (queue.settings_file.stat().st_mode & 0o777) == 0o600
        assert json.loads(queue.settings_file.read_text())["wal"] == {"dir": str(tmp_path / secret)}
        assert (tmp_path / secret).is_dir() and not (tmp_path / "env").exists()
    finally:
        launcher.stop()


# -- a restart that fails before its process serves (found by fault injection: the queue SIGKILLed, then its
# new process SIGKILLed before its ready file, failed the run with max_restarts=10 and 1 restart used) ------


def _on_next_process(svc: Any, act: Callable[[int], None]) -> dict[str, Any]:
    """Calls ``act(pid)`` on the next process of ``svc`` as soon as it appears, from a thread of its own (so that
    it happens even while the launcher waits for that process); what it saw: ``pid``, and ``served``, whether
    the process had written its ready file by then (it had not, or the test does not test what it says)."""
    old_pid = svc.proc.pid
    seen: dict[str, Any] = {}

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            proc = svc.proc
            if proc is not None and proc.pid and proc.pid != old_pid:
                seen["served"] = svc.ready_file.exists()
                act(proc.pid)
                seen["pid"] = proc.pid
                return
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()
    return seen


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _check_until(launcher: Any, done: Callable[[list[str]], bool], timeout_s: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        restarted = launcher.check()
        if done(restarted):
            return restarted
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


def test_a_restarted_process_that_dies_before_it_serves_is_one_more_death(tmp_path) -> None:
    # The queue dies; its new process is SIGKILLed before it serves: restarted again after the backoff, counted
    # against max_restarts, and back on the same port, serving and reported healthy.
    launcher = LocalLauncher(
        tmp_path, max_restarts=3, backoff_s=0.1, health_check=check_health, health_timeout_s=2.0, health_every_s=0.0
    )
    try:
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        address = queue.address
        seen = _on_next_process(queue, _kill)
        _kill(queue.proc.pid)
        assert _check_until(launcher, bool) == ["queue"]
        assert seen["pid"] and not seen["served"]  # (the process killed had not served)
        assert queue.starts == 3 and queue.restarts == 2  # two restarts in a row: both count
        assert queue.info["pid"] != seen["pid"] and queue.up and queue.address == address and _serving(address)
        assert health_of(launcher, queue) == "serving" and launcher.health.answering("queue")
        log = queue.log_file.read_text()
        assert "=== start 1 of queue" in log and "=== start 2 of queue" in log
    finally:
        codes = launcher.stop()
    assert codes == {"queue": 0}


def test_a_restart_that_dies_before_it_serves_past_the_budget_fails_the_run_saying_so(tmp_path) -> None:
    launcher = LocalLauncher(tmp_path, max_restarts=1, backoff_s=0.05)
    try:
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        seen = _on_next_process(queue, _kill)
        _kill(queue.proc.pid)
        with pytest.raises(ServiceFailed) as err:
            _check_until(launcher, bool)
        assert not seen["served"]
        assert str(err.value).splitlines()[0] == (
            "service 'queue' failed: exited with code -9 while restarting, after 1 restarts (max_restarts 1):"
        )
        assert queue.proc.poll() is not None  # nothing left running
    finally:
        launcher.stop()


def test_a_restart_that_does_not_serve_in_time_is_killed_and_restarted_again(tmp_path, caplog) -> None:
    # Its new process hangs (SIGSTOP) before it serves: past start_timeout_s it is killed, and restarted again.
    launcher = LocalLauncher(tmp_path, max_restarts=3, backoff_s=0.1)
    caplog.set_level("WARNING", logger="tauflow.controller.launcher")
    try:
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        launcher.start_timeout_s = 1.0
        seen = _on_next_process(queue, lambda pid: os.kill(pid, signal.SIGSTOP))
        _kill(queue.proc.pid)

        def back(restarted: list[str]) -> bool:
            if seen.get("pid") and not _running(seen["pid"]):  # the hung one killed: the next start may take long
                launcher.start_timeout_s = 60.0
            return bool(restarted)

        assert _check_until(launcher, back) == ["queue"]
        assert not seen["served"] and not _running(seen["pid"])
        assert queue.starts == 3 and queue.up and _serving(queue.address)
        failed = [
            r for r in caplog.records if r.getMessage() == "a restarted service failed before it served; restarting"
        ]
        assert [r.reason for r in failed] == ["not ready after 1s while restarting"]  # type: ignore[attr-defined]
    finally:
        launcher.stop()


def test_a_role_hanging_in_its_restart_delays_no_other_roles_restart(tmp_path) -> None:
    # Two processes; the first's restart hangs before it serves (its new process SIGSTOPped). The second dies
    # meanwhile: the next check() sees it, and it is restarted and back while the first still hangs.
    launcher = LocalLauncher(tmp_path, max_restarts=3, backoff_s=0.05, start_timeout_s=60.0)
    try:
        first = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        second = launcher.start(ServiceSpec("queue-1", {"wal.dir": str(tmp_path / "wal-1")}, role="queue", index=1))
        seen = _on_next_process(first, lambda pid: os.kill(pid, signal.SIGSTOP))
        _kill(first.proc.pid)
        first.proc.wait()
        _check_until(launcher, lambda restarted: first.starts == 2, timeout_s=10)  # its restart has begun
        deadline = time.monotonic() + 10
        while "pid" not in seen:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not seen["served"] and not first.up  # hung before it served
        hung = first.proc
        _kill(second.proc.pid)
        second.proc.wait()
        assert launcher.check() == [] and second.next_restart_at > 0  # its death seen in the very next pass
        assert _check_until(launcher, bool) == ["queue-1"]
        assert second.up and _serving(second.address) and second.starts == 2
        assert first.proc is hung and hung.poll() is None and not first.up  # the first one still hangs
        os.kill(hung.pid, signal.SIGCONT)  # and serves, once it goes on: its restart completes
        assert _check_until(launcher, bool) == ["queue"]
        assert first.starts == 2 and first.up and _serving(first.address)
    finally:
        codes = launcher.stop()
    assert codes == {"queue": 0, "queue-1": 0}


def test_a_gang_whose_restart_loses_a_member_before_it_serves_restarts_whole_again(tmp_path) -> None:
    # A gang (as the ranks of a trainer): rank 1 dies; at the gang's restart rank 0's new process is SIGKILLed
    # before it serves. What is left of the gang is killed, and the gang restarts together once more (each
    # start with its rendezvous).
    launcher = LocalLauncher(tmp_path, max_restarts=3, backoff_s=0.1)
    specs = [
        ServiceSpec(instance_name("queue", rank), {"wal.dir": str(tmp_path / f"wal-{rank}")}, role="queue", index=rank)
        for rank in range(2)
    ]
    rendezvous = Rendezvous("external.tokens_file")  # (a setting the queue takes and, external port off, ignores)
    try:
        rank0, rank1 = launcher.start_gang(specs, rendezvous)
        addresses = [rank0.spec.settings[rendezvous.key]]
        seen = _on_next_process(rank0, _kill)
        rank1_pids = [rank1.proc.pid]

        def back(restarted: list[str]) -> bool:
            if rank1.proc.pid not in rank1_pids:
                rank1_pids.append(rank1.proc.pid)
                addresses.append(rank1.spec.settings[rendezvous.key])
            return bool(restarted)

        _kill(rank1.proc.pid)
        assert _check_until(launcher, back) == ["queue", "queue-1"]
        assert not seen["served"]
        assert rank0.starts == rank1.starts == 3 and rank0.restarts == rank1.restarts == 2
        assert len(rank1_pids) == 3 and not _running(rank1_pids[1])  # its process of the failed restart: killed
        assert len(addresses) == 3 and all(address.startswith("127.0.0.1:") for address in addresses)
        assert rank0.up and rank1.up and _serving(rank0.address) and _serving(rank1.address)
    finally:
        launcher.stop()


class _FakeRay:
    """Ray as the Ray launcher and its host actor use it, in this process: an actor is its ServiceHost here,
    each call answered at once (the processes the hosts start are real)."""

    class RayActorError(Exception):
        pass

    class GetTimeoutError(Exception):
        pass

    def __init__(self) -> None:
        self.exceptions = SimpleNamespace(RayActorError=self.RayActorError, GetTimeoutError=self.GetTimeoutError)
        self.util = SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")

    def is_initialized(self) -> bool:
        return True

    def remote(self, cls: type) -> Any:
        class Actor:
            def __init__(self) -> None:
                self.host = cls()

            def __getattr__(self, method: str) -> Any:
                return SimpleNamespace(remote=getattr(self.host, method))

        return SimpleNamespace(options=lambda **options: SimpleNamespace(remote=Actor))

    def get(self, value: Any, timeout: float | None = None) -> Any:
        return value

    def kill(self, actor: Any) -> None:
        pass

    def get_runtime_context(self) -> Any:
        return SimpleNamespace(get_actor_id=lambda: "actor-1", get_node_id=lambda: "")


def test_on_ray_a_restarted_process_that_dies_before_it_serves_is_one_more_death(tmp_path, monkeypatch) -> None:
    # The Ray launcher supervises with the same code: the same restart, through the service's actor.
    monkeypatch.setitem(sys.modules, "ray", _FakeRay())
    launcher = RayLauncher(tmp_path, RayConfig(address="auto"), max_restarts=2, backoff_s=0.1)
    try:
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        address = queue.address
        seen = _on_next_process(queue, _kill)
        _kill(queue.proc.pid)
        assert _check_until(launcher, bool) == ["queue"]
        assert not seen["served"] and queue.starts == 3 and queue.up and queue.address == address
        assert _serving(address)
        pid = queue.proc.pid
        _kill(pid)  # and once more: past max_restarts, the run fails
        with pytest.raises(ServiceFailed, match=r"^service 'queue' failed: exited with code -9 after 2 restarts"):
            _check_until(launcher, bool)
        assert queue.proc.pid == pid  # (nothing restarted past the budget)
    finally:
        launcher.stop()


def test_a_failure_quotes_the_log_of_the_newest_process_only(tmp_path: Path) -> None:
    """A failed restart's message began with the previous process's traceback, its own reason after it."""
    from tauflow.controller.launcher import ManagedService, log_header

    svc = ManagedService(ServiceSpec("trainer", {}), tmp_path)
    svc.log_file.parent.mkdir(parents=True, exist_ok=True)
    svc.log_file.write_text(
        log_header("trainer", 0) + "Traceback (most recent call last):\n  grpc INTERNAL\n"
        + log_header("trainer", 1) + "ValueError: v00000063/model.safetensors is damaged\n"
    )  # fmt: skip
    assert svc.log_tail() == "ValueError: v00000063/model.safetensors is damaged"
    svc.log_file.write_text("no header: " + "x" * 100_000 + "\nthe last line\n")  # (a log's end is read)
    assert svc.log_tail(1) == "the last line"


def test_the_restart_backoff_doubles_up_to_a_minute(tmp_path: Path) -> None:
    """With max_restarts of 10 or more the doubling passed stall_timeout_s (600 s): the run ended "stalled"
    while its controller was still waiting to restart the role."""
    from tauflow.controller.launcher import MAX_BACKOFF_S, ManagedService, ProcessLauncher, ServiceSpec

    launcher = ProcessLauncher(tmp_path, max_restarts=10_000, backoff_s=1.0)
    svc = ManagedService(ServiceSpec("reward", role="reward"), tmp_path)
    delays = []
    for restarts in (0, 1, 2, 5, 6, 9, 40, 9_999):
        svc.restarts = restarts
        delays.append(launcher._schedule_restart([svc], svc, "exited with code 1", now=100.0))
    assert delays == [1, 2, 4, 32, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S] and MAX_BACKOFF_S == 60
    assert svc.next_restart_at == 160.0
