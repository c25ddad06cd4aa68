"""The lifeline: a server whose launcher (``TAUFLOW_PARENT_PID``) dies drains as on SIGTERM and exits; one
whose drain hangs exits anyway; a server without the variable never stops this way; a bad value is refused
naming the variable; a watched process that is not the parent is followed by pid and start time."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tauflow.core.lifeline import PARENT_PID_ENV, Lifeline, parent_pid_from_env, watch_parent

# A server that writes a marker from its close hook (the app's shutdown ran).
SERVER = """
import asyncio, sys
from tauflow.core.config import ServerConfig
from tauflow.core.logs import setup_logging
from tauflow.core.server import ServiceApp, serve
setup_logging("lifeline-test", "INFO")
def close():
    open(sys.argv[1], "w").write("closed")
app, config = ServiceApp(bindings=[], close=close), ServerConfig(port=0, drain_grace_s=0.2)
asyncio.run(serve(app, config, ready_file=sys.argv[2]))
"""

# Whatever follows its parent's death: it hangs for ever (a drain that never ends), with a fast hard exit.
HANGING = """
import time
from tauflow.core.lifeline import Lifeline, parent_pid_from_env
Lifeline(parent_pid_from_env()).watch(lambda: None, every_s=0.1, exit_after_s=0.5)
print("armed", flush=True)
time.sleep(120)
"""

# A launcher: starts the child (with TAUFLOW_PARENT_PID set to itself after "--lifeline"), prints its pid, waits.
PARENT = """
import os, subprocess, sys, time
lifeline = sys.argv[1] == "--lifeline"
env = {**os.environ, **({"TAUFLOW_PARENT_PID": str(os.getpid())} if lifeline else {})}
child = subprocess.Popen(sys.argv[2:], env=env)
print(child.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _launch(*child: str, lifeline: bool = True, log: Path | None = None) -> tuple[subprocess.Popen[str], int]:
    """A launcher process and the pid of the child it started."""
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "--lifeline" if lifeline else "--", *child],
        stdout=subprocess.PIPE,
        stderr=log.open("w") if log else subprocess.DEVNULL,
        text=True,
        env=env,
    )
    return parent, int(parent.stdout.readline())


def _wait_gone(pid: int, timeout_s: float) -> float:
    started = time.monotonic()
    while _running(pid):
        if time.monotonic() - started > timeout_s:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"pid {pid} still runs {timeout_s}s after its parent died")
        time.sleep(0.05)
    return time.monotonic() - started


def _wait_file(path: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_server_whose_launcher_is_killed_drains_and_exits(tmp_path: Path) -> None:
    marker, ready = tmp_path / "closed", tmp_path / "ready.json"
    parent, child = _launch(sys.executable, "-c", SERVER, str(marker), str(ready), log=tmp_path / "server.log")
    _wait_file(ready)
    assert json.loads(ready.read_text())["pid"] == child
    parent.kill()  # SIGKILL: no chance to stop its child
    parent.wait()
    took = _wait_gone(child, timeout_s=10)
    assert took < 1.0 + 0.2 + 2.0  # one check a second, the drain grace, and the exit itself
    assert marker.read_text() == "closed"  # the SIGTERM path: drained, the app's close ran
    text = (tmp_path / "server.log").read_text()
    assert f"controller {parent.pid} gone: stopping" in text and "draining" in text and "stopped" in text


def test_a_drain_that_hangs_ends_in_a_hard_exit(tmp_path: Path) -> None:
    parent, child = _launch(sys.executable, "-c", HANGING)
    assert parent.stdout.readline() == "armed\n"
    parent.kill()
    parent.wait()
    assert _wait_gone(child, timeout_s=10) < 0.1 + 0.5 + 2.0


def test_a_server_without_a_launcher_keeps_serving(tmp_path: Path) -> None:
    marker, ready = tmp_path / "closed", tmp_path / "ready.json"
    parent, child = _launch(sys.executable, "-c", SERVER, str(marker), str(ready), lifeline=False)
    try:
        _wait_file(ready)
        parent.kill()
        parent.wait()
        time.sleep(2.5)  # more than two checks
        assert _running(child) and not marker.exists()
    finally:
        os.kill(child, signal.SIGTERM)  # and it still drains on SIGTERM
        _wait_gone(child, timeout_s=10)
    assert marker.read_text() == "closed"


@pytest.mark.parametrize("value", ["abc", "-5", "0", "12.5", "1e3", "\u0663", "99999999999", " 7 x"])
def test_a_bad_parent_pid_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=f"{PARENT_PID_ENV} must be the pid"):
        parent_pid_from_env({PARENT_PID_ENV: value})


def test_no_parent_pid_means_no_watch() -> None:
    assert parent_pid_from_env({}) is None and parent_pid_from_env({PARENT_PID_ENV: " "}) is None
    assert parent_pid_from_env({PARENT_PID_ENV: " 4242 "}) == 4242

    async def returns_at_once() -> None:
        await asyncio.wait_for(watch_parent(asyncio.Event(), 1.0, environ={}), timeout=1)

    asyncio.run(returns_at_once())


def test_a_process_that_is_not_the_parent_is_followed_by_pid_and_start_time() -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watched = Lifeline(other.pid)
        assert not watched.is_parent and watched.alive()
        reused = Lifeline(other.pid)
        reused._started = "0"  # what a new process under the same pid looks like: another start time
        assert not reused.alive()
        fired: list[int] = []
        watched.watch(lambda: fired.append(1), every_s=0.05)
        cancelled = Lifeline(other.pid).watch(lambda: fired.append(2), every_s=0.05)
        cancelled.set()  # given up before the process ended: never fires
        time.sleep(0.2)
        other.kill()  # not reaped yet: a zombie is gone too
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not watched.alive()
        time.sleep(0.2)
        assert fired == [1]
    finally:
        other.kill()
        other.wait()
    assert not Lifeline(other.pid).alive()  # reaped: no such process
