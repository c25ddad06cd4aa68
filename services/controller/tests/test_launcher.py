"""The local launcher with real services: ready files, health, restart in place, clean stop; a service whose
controller is killed stops by itself; a new controller waits for the previous run's processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.controller.adapters.health_client import check_health
from tauflow.controller.launcher import LocalLauncher, ServiceFailed, ServiceSpec


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
