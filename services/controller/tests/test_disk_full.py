"""A full disk under out_dir (ENOSPC) while the run trains: the roles survive it (they wait and retry), so the
controller must too. Before, the first role restart on a full disk ended the run: the restart's settings file
(launcher.write_settings) or the new prometheus-targets.json raised out of the follow loop, a `tauflow scale`
raised out of the reconciliation, and summary.json, written in place, was left at 0 bytes, beside a
prometheus-targets.json.tmp (docs/reliability.md).

The disk is made full by failing the writes under the test's folder as a full disk fails them (FullDisk): a
rename into place raises ENOSPC, and ``Path.write_text`` truncates its file and then raises ENOSPC.
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import tauflow.controller.launcher as launcher_module
from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.launcher import (
    LocalLauncher,
    ManagedService,
    ProcessLauncher,
    Rendezvous,
    ServiceFailed,
    ServiceSpec,
    instance_name,
    replace_file,
    spawn_service,
    write_settings,
)
from tauflow.controller.metrics import TARGETS_FILE
from tauflow.controller.run import Following
from tauflow.controller.scaling import ROLLOUT, RolloutScaler
from tauflow.controller.summary import RunSummary, StepRecord

NO_SPACE = os.strerror(errno.ENOSPC)


class FullDisk:
    """While ``full``, the writes under ``root`` whose path ``refuses`` (default: all) fail as on a full disk."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.root = root.resolve()
        self.full = False
        self.only: Callable[[Path], bool] = lambda path: True
        real_replace, real_write_text = os.replace, Path.write_text

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if self.refuses(dst):
                raise OSError(errno.ENOSPC, NO_SPACE, str(dst))
            real_replace(src, dst, *args, **kwargs)

        def write_text(path: Path, data: str, *args: Any, **kwargs: Any) -> int:
            if self.refuses(path):
                path.open("w").close()  # (opened, so truncated, before the write finds no room)
                raise OSError(errno.ENOSPC, NO_SPACE, str(path))
            return real_write_text(path, data, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(Path, "write_text", write_text)

    def refuses(self, path: Any) -> bool:
        path = Path(os.fspath(path)).absolute()
        return self.full and path.is_relative_to(self.root) and self.only(path)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FullDisk:
    return FullDisk(monkeypatch, tmp_path)


def _leftovers(folder: Path) -> list[str]:
    """Temporary files left in ``folder`` and below."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name.endswith(".tmp"))


# -- prometheus-targets.json ---------------------------------------------------------------------------------


def test_prometheus_targets_that_cannot_be_written_are_logged_once_retried_and_never_end_the_run(
    tmp_path: Path, disk: FullDisk, caplog: pytest.LogCaptureFixture
) -> None:
    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path)), serve_metrics=False)
    reward = SimpleNamespace(role="reward", address="127.0.0.1:1", index=0, info={"metrics_port": 9001}, up=True)
    restarts: list[list[str]] = [["reward"], ["reward"], [], []]
    run.launcher = SimpleNamespace(  # type: ignore[assignment]
        services={"reward": reward}, starts_services=True, check=lambda: restarts.pop(0)
    )
    run.scaler.reconcile = lambda *args: ([], [])  # type: ignore[method-assign]

    async def serves(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}

    run.check_peer = serves
    run._write_targets()
    targets = tmp_path / TARGETS_FILE
    before = targets.read_text()
    assert json.loads(before)[0]["targets"] == ["127.0.0.1:9001"]

    async def passes(n: int) -> None:
        following = Following(progressed_at=time.monotonic())
        for _ in range(n):
            await run._supervise(None, following)  # type: ignore[arg-type]

    disk.full = True
    caplog.set_level(logging.WARNING, logger="tauflow.controller.run")
    reward.info = {"metrics_port": 9002}  # (restarted: the file is behind it)
    asyncio.run(passes(3))  # two restarts, then a pass with none: each one writes, none ends the run
    failures = [r for r in caplog.records if "could not write the Prometheus targets" in r.getMessage()]
    assert len(failures) == 1 and "disk full" in str(failures[0].__dict__["error"])  # one line, not one a pass
    assert targets.read_text() == before and _leftovers(tmp_path) == []  # the previous file whole; no .tmp
    disk.full = False  # room again: the next pass writes it, though nothing changed since
    asyncio.run(passes(1))
    assert json.loads(targets.read_text())[0]["targets"] == ["127.0.0.1:9002"]
    assert any("written again" in r.getMessage() for r in caplog.records) and not run._targets_due
    assert _leftovers(tmp_path) == []


def test_a_file_replaced_whole_is_as_it_was_when_its_write_fails_midway(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "f.json"
    replace_file(path, b"old")

    def no_room(fd: int) -> None:
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(os, "fsync", no_room)  # (the data written, its blocks not: a full disk's late refusal)
    with pytest.raises(OSError, match=NO_SPACE):
        replace_file(path, b"new, longer")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


# -- summary.json ----------------------------------------------------------------------------------------------


def _summary(status: str = "completed") -> RunSummary:
    summary = RunSummary("r", 1, 2)
    summary.add_step(StepRecord(0, 1, 1.0, 0.5, 0, 0.0, 0.1, 10, 4, groups_by_staleness={0: 4}))
    summary.status = status
    return summary


def test_a_summary_that_cannot_be_written_leaves_the_previous_one_whole_and_no_temporary_file(
    tmp_path: Path, disk: FullDisk
) -> None:
    out = tmp_path / "out"
    _summary("interrupted").write(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"summary.json", "summary.png"} and before["summary.png"].startswith(b"\x89PNG")
    disk.full = True
    with pytest.raises(OSError, match=NO_SPACE):
        _summary().write(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # never 0 bytes, never half; nothing left
    disk.only = lambda path: path.name == "summary.png"  # room for the JSON, not the PNG
    with pytest.raises(OSError, match=NO_SPACE):
        _summary().write(out)
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    assert (out / "summary.png").read_bytes() == before["summary.png"] and _leftovers(out) == []
    disk.full = False
    _summary().write(out)
    assert (out / "summary.png").read_bytes().startswith(b"\x89PNG") and _leftovers(out) == []


def test_a_run_whose_summary_cannot_be_written_ends_as_it_ended_and_says_so(
    tmp_path: Path, disk: FullDisk, caplog: pytest.LogCaptureFixture
) -> None:
    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path)), serve_metrics=False)
    _summary("interrupted").write(tmp_path)  # a previous run's
    before = (tmp_path / "summary.json").read_bytes()

    async def follow(addresses: Any) -> RunSummary:
        return run.summary

    run.launch = dict  # type: ignore[method-assign]
    run.follow = follow  # type: ignore[method-assign]
    disk.full = True
    summary = asyncio.run(run.execute())  # (it raised the OSError of its summary's write, a run completed)
    assert summary.status == "completed"
    assert (tmp_path / "summary.json").read_bytes() == before and _leftovers(tmp_path) == []
    [error] = [r for r in caplog.records if "could not write the run summary" in r.getMessage()]
    assert error.levelno == logging.ERROR and "disk full" in str(error.__dict__["error"])
    assert not run.summary_written  # (tauflow run says so and exits 4; it said "summary in ...", exit 0)

    # room in logs/ (out_dir made read-only, a quota on it): the run's metrics are kept there
    caplog.clear()
    disk.full, disk.only = True, lambda path: path.parent == tmp_path
    run.summary_written = True
    run._write_summary()
    assert not run.summary_written
    assert json.loads((tmp_path / "logs" / "summary.json").read_text())["status"] == "completed"
    # only the plot failing: summary.json is written, no loss to report
    disk.only = lambda path: path.name == "summary.png"
    run.summary_written = True
    run._write_summary()
    assert run.summary_written and json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


# -- settings files, restarts, scaling --------------------------------------------------------------------------


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid, self.code = pid, None

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.code = -sig


class FakeLauncher(ProcessLauncher):
    """The supervision of the process launchers with "processes" that serve at once; each start writes its
    settings file as the local launcher does (write_settings)."""

    def __init__(self, run_dir: Path, **kwargs: Any) -> None:
        super().__init__(run_dir, **kwargs)
        self.pids = 100
        self.ports: dict[str, int] = {}

    def _spawn(self, svc: ManagedService) -> None:
        write_settings(svc.settings_file, self._settings(svc))
        self.pids += 1
        svc.proc = FakeProc(self.pids)
        self._started(svc)

    def _read_ready(self, svc: ManagedService) -> dict[str, Any] | None:
        port = self.ports.setdefault(svc.name, 5000 + 2 * len(self.ports))
        return {"grpc_port": port, "metrics_port": port + 1, "pid": svc.proc.pid}

    def _kill(self, svc: ManagedService) -> None:
        svc.proc.code = -9


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _settings_of(svc: ManagedService) -> dict[str, Any]:
    return dict(json.loads(svc.settings_file.read_text()))


def _is_settings(path: Path) -> bool:
    return path.parent.name == "settings"


def test_a_restart_whose_settings_cannot_be_written_is_a_failed_start_retried_after_its_backoff(
    tmp_path: Path, disk: FullDisk, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    launcher = FakeLauncher(tmp_path, max_restarts=3, backoff_s=1.0, clock=clock)
    reward = launcher.start(ServiceSpec("reward", {"default_reward_fn": "exact"}))
    reward.proc.code = -9  # it dies, the disk full
    disk.full, disk.only = True, _is_settings
    assert launcher.check() == []  # death seen: its restart due in 1 s
    clock.now += 1.0
    assert launcher.check() == []  # the restart could not write its settings: a failed start, not a crash
    assert reward.restarts == 1 and reward.starts == 1 and reward.next_restart_at == clock.now + 2.0
    [line] = [r for r in caplog.records if "a restart could not start its process" in r.getMessage()]
    assert "disk full" in line.__dict__["reason"] and NO_SPACE in line.__dict__["reason"]
    assert _settings_of(reward)["server"]["port"] == 0 and _leftovers(tmp_path) == []  # the first start's, whole
    clock.now += 1.0
    assert launcher.check() == []  # (not before its backoff)
    disk.full = False  # room again
    clock.now += 1.0
    assert launcher.check() == []  # begun
    assert launcher.check() == ["reward"]  # and serving: back on its ports
    assert reward.restarts == 2 and reward.starts == 2 and reward.up
    assert _settings_of(reward)["server"]["port"] == reward.info["grpc_port"] == 5000


def test_a_restart_that_cannot_start_its_process_past_the_budget_fails_the_run_saying_so(
    tmp_path: Path, disk: FullDisk
) -> None:
    clock = Clock()
    launcher = FakeLauncher(tmp_path, max_restarts=2, backoff_s=1.0, clock=clock)
    reward = launcher.start(ServiceSpec("reward", {}))
    reward.proc.code = -9
    disk.full = True
    with pytest.raises(ServiceFailed) as err:
        for _ in range(10):
            launcher.check()
            clock.now += 4.0
    assert str(err.value).splitlines()[0] == (
        f"service 'reward' failed: could not start its process (disk full: OSError: [Errno {errno.ENOSPC}] "
        f"{NO_SPACE}: '{reward.settings_file}') while restarting, after 2 restarts (max_restarts 2):"
    )
    assert reward.starts == 1  # (no process ever started on the full disk)


def test_a_restart_with_the_settings_of_the_one_before_uses_the_file_there_on_a_full_disk(
    tmp_path: Path, disk: FullDisk, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    launcher = FakeLauncher(tmp_path, max_restarts=4, backoff_s=1.0, clock=clock)
    queue = launcher.start(ServiceSpec("queue", {"max_staleness": 1}))
    for full in (False, True):  # a restart writes its settings (its ports pinned); the next one, on a full disk,
        queue.proc.code = -9  # has the same
        disk.full = full
        launcher.check()
        clock.now += 1.0 + 2.0 * full
        assert launcher.check() == []
        assert launcher.check() == ["queue"]
    assert queue.restarts == 2 and queue.up and _leftovers(tmp_path) == []
    assert any("the one there holds the same settings" in r.getMessage() for r in caplog.records)
    launcher.update_settings("queue", {"max_staleness": 2})  # a live τ: the file there no longer says it
    queue.proc.code = -9
    launcher.check()
    clock.now += 4.0
    assert launcher.check() == [] and queue.restarts == 3 and not queue.restarting  # a failed start
    assert _settings_of(queue)["max_staleness"] == 1 and _leftovers(tmp_path) == []


def test_a_settings_file_is_kept_on_a_full_disk_only_when_it_holds_the_same_settings(
    tmp_path: Path, disk: FullDisk
) -> None:
    path = tmp_path / "settings" / "svc.json"
    write_settings(path, {"a.b": 1, "token": "secret"})
    before = path.read_bytes()
    disk.full = True
    write_settings(path, {"a.b": 1, "token": "secret"})  # the same: the file there is used
    with pytest.raises(OSError) as err:
        write_settings(path, {"a.b": 2, "token": "secret"})
    assert err.value.errno == errno.ENOSPC
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ["svc.json"]
    os.chmod(path, 0o644)  # (a file another user may read is not one to trust with the run's secrets)
    with pytest.raises(OSError):
        write_settings(path, {"a.b": 1, "token": "secret"})


def test_a_gang_whose_member_cannot_be_started_restarts_whole_after_its_backoff(tmp_path: Path, disk: FullDisk) -> None:
    clock = Clock()
    launcher = FakeLauncher(tmp_path, max_restarts=3, backoff_s=1.0, clock=clock)
    specs = [ServiceSpec(instance_name("trainer", rank), {}, role="trainer", index=rank) for rank in (0, 1)]
    rank0, rank1 = launcher.start_gang(specs, Rendezvous("distributed.master_address"))
    rank1.proc.code = -9
    launcher.check()  # rank 0 killed with it
    assert rank0.proc.poll() is not None
    disk.full, disk.only = True, lambda path: path.name == "trainer-1.json"
    clock.now += 1.0
    assert launcher.check() == []
    assert rank0.proc.poll() is not None  # rank 0's new process did not stay without its peer
    assert rank0.restarts == 1 and rank0.next_restart_at == clock.now + 2.0 and not rank0.restarting
    disk.full = False
    clock.now += 2.0
    launcher.check()
    assert launcher.check() == ["trainer", "trainer-1"] and rank0.up and rank1.up


def test_a_start_that_cannot_write_its_settings_fails_naming_the_service(tmp_path: Path, disk: FullDisk) -> None:
    disk.full = True
    with pytest.raises(ServiceFailed, match=r"^service 'queue' failed: could not start its process \(disk full"):
        FakeLauncher(tmp_path).start(ServiceSpec("queue", {}))


def test_scaling_out_on_a_full_disk_gives_the_new_replica_up_and_the_run_goes_on(
    tmp_path: Path, disk: FullDisk
) -> None:
    launcher = FakeLauncher(tmp_path)
    launcher.start(ServiceSpec(ROLLOUT, {}, role=ROLLOUT))
    scaler = RolloutScaler(1, 8)
    scaler.set_target(launcher, 2)
    disk.full = True

    def spec(index: int) -> ServiceSpec:
        return ServiceSpec(instance_name(ROLLOUT, index), {}, role=ROLLOUT, index=index)

    assert scaler.reconcile(launcher, spec) == ([], ["rollout-1"])  # (it raised OSError out of the run's loop)
    assert scaler.target == 1 and "disk full" in scaler.last_error and list(launcher.services) == [ROLLOUT]
    assert _leftovers(tmp_path) == []
    disk.full = False
    scaler.set_target(launcher, 2)  # room again: a new scale-out starts it
    assert scaler.reconcile(launcher, spec) == ([], [])
    assert scaler.reconcile(launcher, spec) == (["rollout-1"], [])


def test_a_service_starts_though_its_log_cannot_take_the_start_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class NoRoom(io.FileIO):  # a log file on a full disk: every write refused
        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(launcher_module, "open", lambda path, mode, buffering=-1: NoRoom(path, mode), raising=False)
    log_file = tmp_path / "svc.log"
    proc = spawn_service([sys.executable, "-c", "print('up')"], dict(os.environ), log_file, "=== start 1 ===\n")
    assert proc.wait(60) == 0 and log_file.read_text() == "up\n"  # (the child's own writes: here there is room)
    assert any("could not write a service's start to its log" in r.getMessage() for r in caplog.records)


# -- with a real process ------------------------------------------------------------------------------------------


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_a_queue_killed_on_a_full_disk_is_restarted_once_there_is_room(
    tmp_path: Path, disk: FullDisk, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = LocalLauncher(tmp_path, max_restarts=3, backoff_s=0.2)
    try:
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        address = queue.address
        disk.full, disk.only = True, _is_settings
        os.kill(queue.proc.pid, signal.SIGKILL)
        queue.proc.wait(30)
        deadline = time.monotonic() + 30
        while queue.restarts < 1:  # its restart tried, and failed to write the settings
            assert launcher.check() == [] and time.monotonic() < deadline
            time.sleep(0.05)
        assert queue.starts == 1 and any("could not start its process" in r.getMessage() for r in caplog.records)
        disk.full = False
        while not (restarted := launcher.check()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert restarted == ["queue"] and queue.restarts == 2 and queue.address == address and _serving(address)
    finally:
        codes = launcher.stop()
    assert codes == {"queue": 0}


def test_a_summary_with_a_nan_loss_is_standard_json(tmp_path: Path) -> None:
    """A step's NaN loss or infinite mean reward was written as NaN/Infinity, which is not JSON: JavaScript's
    JSON.parse refused the whole summary. They are null now."""
    from tauflow.controller.summary import StepRecord

    summary = RunSummary("r", 1, 2)
    summary.add_step(StepRecord(1, 1, 0.5, float("inf"), 0, 0.0, float("nan"), 10, 2, {"grad_norm": float("-inf")}))
    text = summary.write(tmp_path)[0].read_text()
    assert "NaN" not in text and "Infinity" not in text

    def strict(name: str) -> None:
        raise ValueError(name)

    step = json.loads(text, parse_constant=strict)["steps"][0]
    assert (step["mean_reward"], step["loss"], step["metrics"]["grad_norm"]) == (None, None, None)
