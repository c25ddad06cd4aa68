"""A client of a running controller's ControllerService, for ``tauflow scale``, ``set`` and ``status``: the
run is found by its address, or by its run directory (``<out_dir>/controller.ready.json`` names it)."""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tauflow.api.controller.v1 import controller_pb2, controller_pb2_grpc
from tauflow.controller.metrics import READY_FILE
from tauflow.controller.run import LOCK_FILE
from tauflow.core.channel import create_channel
from tauflow.core.runtoken import TokenFileError, read_token_file

SERVICE = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"]
CALL_TIMEOUT_S = 30.0


class ControlError(RuntimeError):
    """The run cannot be found or reached, or refused the call (the message says why)."""


def control_address(run: str) -> str:
    """The ControllerService address of ``run``: a host:port as it is, or a run directory whose
    controller.ready.json records it (``tauflow run`` writes it when it starts)."""
    path = Path(run)
    if not path.is_dir():
        host, _, port = run.rpartition(":")
        if host and port.isdigit():
            return run
        raise ControlError(f"{run!r} is neither a run directory nor a host:port")
    try:
        info = json.loads((path / READY_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ControlError(f"{path} holds no running tauflow run ({READY_FILE}: {e})") from None
    if not isinstance(info, dict):  # ([], null: a damaged file, not an older tauflow's)
        raise ControlError(f"{path / READY_FILE} is damaged (not a JSON object)")
    pid = _pid(info)
    if _ended_for_sure(path, pid):
        # the run has ended (its ready file stays): say so, rather than gRPC's "connection refused"
        raise ControlError(f"the run in {path} is not running: its controller (pid {pid}) has ended{_ended(path)}")
    address = info.get("control_address", "")
    if not address or not isinstance(address, str):
        raise ControlError(f"the run in {path} serves no ControllerService (started by an older tauflow)")
    return str(address)


def _ended_for_sure(path: Path, pid: int | None) -> bool:
    """Whether the run's controller is gone: nobody holds its run.lock (which its controller holds to the end,
    seen from any process, a container's too); without a lock file (an older run, a filesystem without
    flock), its pid is no process here."""
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return pid is not None and Path("/proc/self").exists() and not Path(f"/proc/{pid}").exists()
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # held: the run goes on
    except OSError:
        return False  # (cannot tell: the call will)
    else:
        return True
    finally:
        os.close(fd)


def _pid(info: dict[str, Any]) -> int | None:
    try:
        pid = int(info["pid"])
    except (KeyError, ValueError, TypeError, OverflowError):
        return None
    return pid if pid > 0 else None


def _ended(path: Path) -> str:
    """How its summary says the run ended, where it says."""
    try:
        summary = json.loads((path / "summary.json").read_text())
        status = summary["status"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f" ({status}; see {path / 'summary.json'})" if isinstance(status, str) and status.isidentifier() else ""


def live_runs(root: Path = Path("runs")) -> list[Path]:
    """Run directories under ``root`` whose controller is alive (its pid, in controller.ready.json, runs)."""
    found = []
    for ready in sorted(root.glob(f"*/{READY_FILE}")):
        try:
            info = json.loads(ready.read_text())
        except (OSError, ValueError):
            continue
        pid = _pid(info) if isinstance(info, dict) else None
        if pid is not None and Path(f"/proc/{pid}").exists():
            found.append(ready.parent)
    return found


def control_token_file(run: str) -> str:
    """The run token's file of the run in directory ``run`` (controller.ready.json names it); "" for a
    host:port or a run that records none."""
    path = Path(run)
    if not path.is_dir():
        return ""
    try:
        return str(json.loads((path / READY_FILE).read_text()).get("token_file", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def find_run(run: str | None) -> tuple[str, str]:
    """The address and the token file of the run named (a directory or host:port), or of the only live run
    under ./runs."""
    if not run:
        live = live_runs()
        if len(live) != 1:
            where = ", ".join(str(p) for p in live) or "none"
            raise ControlError(f"say which run (--run DIR or --run HOST:PORT): live runs under ./runs: {where}")
        run = str(live[0])
    return control_address(run), control_token_file(run)


@dataclass(frozen=True)
class Status:
    run: dict[str, Any]
    services: list[dict[str, Any]]


class ControllerClient:
    """``token_file``: the run token's file, which the control calls (scale, set) need (tauflow.core.auth)."""

    def __init__(self, address: str, token_file: str = "") -> None:
        self.address = address
        self.token_file = token_file  # read at the first control call: `tauflow status` needs none
        self._channel = create_channel(address, [SERVICE])
        self._stub = controller_pb2_grpc.ControllerServiceStub(self._channel)

    async def scale_rollout(self, replicas: int) -> tuple[int, int]:
        request = controller_pb2.ScaleRolloutRequest(replicas=replicas)
        reply = await self._call(self._stub.ScaleRollout, request, self._bearer())
        return reply.previous_replicas, reply.replicas

    async def set_max_staleness(self, tau: int) -> tuple[int, int, int]:
        request = controller_pb2.SetMaxStalenessRequest(max_staleness=tau)
        reply = await self._call(self._stub.SetMaxStaleness, request, self._bearer())
        return reply.previous_max_staleness, reply.max_staleness, reply.policy_version

    async def stop_run(self, reason: str, immediate: bool = False, grace_s: float | None = None) -> str:
        """Asks the run to stop (a control method); returns its state after the call (stopping, or a final one)."""
        request = controller_pb2.StopRunRequest(reason=reason, immediate=immediate)
        if grace_s is not None:
            request.grace_period.FromNanoseconds(int(grace_s * 1e9))
        reply = await self._call(self._stub.StopRun, request, self._bearer())
        return controller_pb2.RunState.Name(reply.state).removeprefix("RUN_STATE_").lower()

    async def status(self) -> Status:
        run = await self._call(self._stub.GetRun, controller_pb2.GetRunRequest())
        services = await self._call(self._stub.ListServices, controller_pb2.ListServicesRequest())
        return Status(
            {
                "name": run.run.name,
                "state": controller_pb2.RunState.Name(run.run.state).removeprefix("RUN_STATE_").lower(),
                "launcher": run.run.launcher,
                "policy_version": run.run.policy_version,
                "total_steps": run.run.total_steps,
                "max_staleness": run.run.max_staleness,
                "groups_trained": run.run.groups_trained,
                "staleness_violations": run.run.staleness.violations,
                "last_step_metrics": dict(run.run.last_step_metrics),
            },
            [
                {
                    "name": s.name,
                    "role": s.role,
                    "replica": s.replica,
                    "replicas": s.replicas,
                    "address": s.address,
                    "health": controller_pb2.ServiceHealth.Name(s.health).removeprefix("SERVICE_HEALTH_").lower(),
                    "restarts": s.restarts,
                    "build": s.build_version,
                    "contracts": dict(s.contract_revisions),
                    "pid": s.launcher_handle,
                }
                for s in services.services
            ],
        )

    def _bearer(self) -> tuple[tuple[str, str], ...]:
        """The run token as call metadata, for the control methods (none without a token file)."""
        if not self.token_file:
            return ()
        try:
            return (("authorization", f"Bearer {read_token_file(self.token_file)}"),)
        except TokenFileError as e:
            raise ControlError(str(e)) from None

    async def _call(self, method: Any, request: Any, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
        try:
            return await method(request, timeout=CALL_TIMEOUT_S, metadata=metadata or None)
        except grpc.aio.AioRpcError as e:
            raise ControlError(f"{e.code().name}: {e.details() or 'no details'} ({self.address})") from None

    async def close(self) -> None:
        await self._channel.close()
