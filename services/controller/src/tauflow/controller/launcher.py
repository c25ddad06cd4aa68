"""The `local` launcher: every service a subprocess on loopback, supervised.

Each service runs as ``python -m tauflow.<name> --set server.port=0 ...
--ready-file <run>/<name>.ready.json``; its ports are read back from the ready
file (no port races), its output goes to ``<run>/logs/<name>.log``. A service
that exits unexpectedly is restarted in place with exponential backoff; one
that keeps dying (``max_restarts``) fails the run with a message that names it
and quotes the end of its log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class ServiceFailed(RuntimeError):
    """A service died and could not be brought back."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"service '{name}' failed: {message}")
        self.name = name


@dataclass
class ServiceSpec:
    name: str  # the role: python -m tauflow.<name>
    settings: dict[str, Any] = field(default_factory=dict)  # --set key=value
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ManagedService:
    spec: ServiceSpec
    run_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    starts: int = 0  # processes started, restarts included (never reset: the restarts metric)
    next_restart_at: float = 0.0
    started_at: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.info['grpc_port']}"

    @property
    def ready_file(self) -> Path:
        return self.run_dir / f"{self.name}.ready.json"

    @property
    def log_file(self) -> Path:
        return self.run_dir / "logs" / f"{self.name}.log"

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


class LocalLauncher:
    def __init__(
        self,
        run_dir: Path,
        *,
        max_restarts: int = 3,
        restart_window_s: float = 600.0,
        backoff_s: float = 1.0,
        start_timeout_s: float = 120.0,
        stop_grace_s: float = 15.0,
    ) -> None:
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.backoff_s = backoff_s
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.services: dict[str, ManagedService] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    # -- starting ------------------------------------------------------------------------

    def start(self, spec: ServiceSpec) -> ManagedService:
        """Starts one service and waits for its ready file (it serves gRPC health then)."""
        svc = self.services.get(spec.name) or ManagedService(spec, self.run_dir)
        svc.spec = spec
        self.services[spec.name] = svc
        self._spawn(svc)
        self._wait_ready(svc)
        return svc

    def _command(self, svc: ManagedService) -> list[str]:
        settings = {"server.port": 0, "metrics.port": 0, **svc.spec.settings}
        for key, port in svc.info.get("pinned", {}).items():
            if port:
                settings[key] = port
        cmd = [sys.executable, "-m", f"tauflow.{svc.name}", "--ready-file", str(svc.ready_file)]
        for key, value in settings.items():
            cmd += ["--set", f"{key}={_format(value)}"]
        return cmd

    def _spawn(self, svc: ManagedService) -> None:
        svc.ready_file.unlink(missing_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **svc.spec.env}
        with open(svc.log_file, "ab") as out:
            out.write(f"\n=== start {svc.restarts} of {svc.name} at {time.ctime()} ===\n".encode())
            out.flush()
            svc.proc = subprocess.Popen(
                self._command(svc), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                # prctl only, no Python-level locks: safe between fork and exec even with threads
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
        svc.started_at = time.monotonic()
        svc.starts += 1
        log.info("started", extra={"service": svc.name, "pid": svc.proc.pid})

    def _wait_ready(self, svc: ManagedService) -> None:
        assert svc.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while not svc.ready_file.exists():
            code = svc.proc.poll()
            if code is not None:
                raise ServiceFailed(svc.name, f"exited with code {code} while starting:\n{svc.log_tail()}")
            if time.monotonic() > deadline:
                raise ServiceFailed(svc.name, f"not ready after {self.start_timeout_s:.0f}s:\n{svc.log_tail()}")
            time.sleep(0.05)
        info = json.loads(svc.ready_file.read_text())
        # A restarted service comes back on the same ports, so its peers' channels reconnect (and Prometheus
        # keeps scraping the same target).
        svc.info = {**info, "pinned": {"server.port": info["grpc_port"], "metrics.port": info.get("metrics_port")}}

    # -- supervising ---------------------------------------------------------------------

    def check(self) -> list[str]:
        """Restarts services that died; returns the names restarted. Raises ServiceFailed
        when one died more than ``max_restarts`` times in a row; a service that stayed up for
        ``restart_window_s`` since its last start has its count reset (one crash a day is not a crash loop)."""
        restarted = []
        now = time.monotonic()
        for svc in self.services.values():
            if svc.proc is None or svc.proc.poll() is None:
                continue
            code = svc.proc.returncode
            if svc.next_restart_at == 0.0 and now - svc.started_at >= self.restart_window_s:
                svc.restarts = 0
            if svc.restarts >= self.max_restarts:
                raise ServiceFailed(
                    svc.name, f"exited with code {code} after {svc.restarts} restarts:\n{svc.log_tail()}"
                )
            if svc.next_restart_at == 0.0:
                delay = self.backoff_s * 2**svc.restarts
                svc.next_restart_at = now + delay
                log.warning("service died; restarting", extra={"service": svc.name, "code": code, "in_s": delay})
            if now >= svc.next_restart_at:
                svc.restarts += 1
                svc.next_restart_at = 0.0
                self._spawn(svc)
                self._wait_ready(svc)
                restarted.append(svc.name)
        return restarted

    # -- stopping ------------------------------------------------------------------------

    def stop(self, order: list[str] | None = None) -> dict[str, int | None]:
        """SIGTERM (graceful drain) in ``order``, then SIGKILL whatever is left; returns exit codes."""
        names = order or list(reversed(self.services))
        for name in names:
            svc = self.services.get(name)
            if svc and svc.proc and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        codes: dict[str, int | None] = {}
        for name in names:
            svc = self.services.get(name)
            if not svc or not svc.proc:
                continue
            try:
                codes[name] = svc.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(svc.proc.pid, signal.SIGKILL)
                codes[name] = svc.proc.wait()
                log.warning("killed after the grace period", extra={"service": name})
        return codes

    def addresses(self) -> Mapping[str, str]:
        return {name: svc.address for name, svc in self.services.items() if svc.info}


def _die_with_parent() -> None:
    """A service gets SIGTERM (graceful drain) when the controller dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)
