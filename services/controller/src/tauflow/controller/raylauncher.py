"""``launcher: ray``: every service a subprocess of a Ray actor, on a node of an existing Ray cluster.

Each role gets one actor (:class:`ServiceHost`) that Ray places with the role's resources (CPUs; one GPU
for the rollout, the trainer and the weight sidecar when the run puts them on a GPU). The actor starts
the same ``python -m tauflow.<role>`` as the local launcher, on its node, bound to the node's IP, and
reports on it; the controller supervises through the actors with the local launcher's own code
(:class:`~tauflow.controller.launcher.ProcessLauncher`): a process that dies is started again by its
actor, on the same ports, with backoff, and a crash loop fails the run naming the role; a restarted process
that dies (or loses its actor) before it serves, or does not serve within ``start_timeout_s``, is one more
death, restarted again and counted against ``max_restarts``.

- The trainer's actor (its rank 0's, with several ranks) goes on the weight sidecar's node: they hand the
  weights over in ``/dev/shm``. A data-parallel trainer's other ranks go wherever their resources are, and
  rendezvous at a port that rank 0's actor found free on its node.
- An actor that is lost (its worker or its node died) is created again on the same node, and its new
  process takes the same ports once the old one (it stops by itself when its actor is gone) has exited.
  A node that is gone fails the run, naming the role that cannot be placed: its peers hold its address.
- The actors belong to the controller's job: when the controller dies (even by SIGKILL) Ray ends them,
  and each service, whose ``TAUFLOW_PARENT_PID`` is its actor, drains and exits (``tauflow.core.lifeline``).
  Ray's own clean-up, which SIGKILLs an exiting worker's children (``kill_child_processes_on_worker_exit``),
  is turned off for these actors: it would kill the services without their drain.
- Paths (model, dataset, and out_dir: logs, ready and settings files, checkpoints, queue log) are used as
  they are on every node, relative ones from the controller's working directory: on a cluster of several
  machines they must be on a file system that every node mounts at the same path. A service's settings go
  to it through the Ray call, and its actor writes them to its settings file (this user's only), not onto
  its command line.
- A service's environment is its actor's (Ray sets ``CUDA_VISIBLE_DEVICES`` and ``OMP_NUM_THREADS``)
  plus the controller's ``OTEL_*`` and ``TAUFLOW_*`` variables.

Ray is imported here only, only when the run uses this launcher (``pip install 'tauflow-controller[ray]'``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tauflow.controller.config import RayConfig
from tauflow.controller.launcher import (
    LaunchFailed,
    ManagedService,
    ProcessLauncher,
    SpawnFailed,
    describe_os_error,
    is_service_process,
    log_header,
    service_command,
    service_env,
    spawn_service,
    write_settings,
)
from tauflow.controller.secrets import redact_text
from tauflow.core.net import free_port
from tauflow.core.runtoken import TokenFileError, read_token_file, run_token, run_token_file, write_token_file

log = logging.getLogger(__name__)

FORWARDED_ENV = ("OTEL_", "TAUFLOW_")
COLOCATED = {"trainer": "weights"}  # role -> the role whose node it shares (the /dev/shm weight hand-off)
LOST = -1  # what poll() says of a process whose actor was lost
# Ray SIGKILLs the children of a worker that exits; a service ends by itself, drained, when its actor is gone.
HOST_RUNTIME_ENV = {"env_vars": {"RAY_kill_child_processes_on_worker_exit": "0"}}


def role_resources(role: str, settings: Mapping[str, Any], config: RayConfig) -> dict[str, float]:
    """The Ray resources of a role's actor: ``ray.num_cpus``/``ray.num_gpus`` where set, else 1 CPU, and
    1 GPU for a role whose own settings put it on a GPU."""
    on_gpu = {
        "trainer": str(settings.get("backend.device", "cpu")).startswith("cuda"),
        "rollout": str(settings.get("engine_options.device", "cpu")).startswith("cuda"),
        "teacher": str(settings.get("engine_options.device", "cpu")).startswith("cuda"),
        "judge": str(settings.get("engine_options.device", "cpu")).startswith("cuda"),
        "weights": settings.get("backend") == "nccl",
    }.get(role, False)
    return {
        "num_cpus": float(config.num_cpus.get(role, 1.0)),
        "num_gpus": float(config.num_gpus.get(role, 1.0 if on_gpu else 0.0)),
    }


class RayLauncher(ProcessLauncher):
    def __init__(self, run_dir: Path, config: RayConfig, *, call_timeout_s: float = 30.0, **supervision: Any) -> None:
        super().__init__(run_dir, **supervision)
        self.config = config
        self.call_timeout_s = call_timeout_s  # every call to an actor has this deadline
        self._ray: Any = None
        self._connected_here = False
        self._host_class: Any = None
        self._cwd = os.getcwd()
        self._env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}

    def _connect(self) -> Any:
        if self._ray is not None:
            return self._ray
        try:
            import ray
        except ImportError as e:
            raise LaunchFailed(
                "launcher 'ray' needs Ray on the controller and every node: pip install 'tauflow-controller[ray]'"
            ) from e
        if not ray.is_initialized():
            _probe(self.config.address)
            try:
                ray.init(
                    address=self.config.address,
                    namespace=self.config.namespace or None,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
            except Exception as e:  # Ray raises ConnectionError, ValueError or RuntimeError here
                raise LaunchFailed(  # (the address may hold credentials: ray://user:password@head)
                    redact_text(f"launcher 'ray': cannot connect to the Ray cluster at {self.config.address!r}: {e}")
                ) from e
            self._connected_here = True
        self._ray = ray
        self._host_class = ray.remote(ServiceHost)
        return ray

    # -- ProcessLauncher's hooks ----------------------------------------------------------

    def _actor(self, svc: ManagedService) -> tuple[RayProcess, int | None]:
        """``svc``'s actor, created (again, on the same node) when it has none or lost it; and the pid of the
        process a lost actor left behind."""
        self._connect()
        proc: RayProcess | None = svc.proc
        previous_pid = None
        if proc is None or proc.lost:
            node_id = proc.node_id if proc is not None else self._colocated_node(svc)
            previous_pid = proc.pid if proc is not None else None
            proc = svc.proc = RayProcess(self._create_actor(svc, node_id), self.call_timeout_s, node_id)
        return proc, previous_pid

    def _rendezvous_host(self, svc: ManagedService) -> str:
        proc, _ = self._actor(svc)
        host = proc.call_or_fail("node_host", svc.name)
        return str(host)

    def _free_port(self, svc: ManagedService) -> int:
        proc, _ = self._actor(svc)
        return int(proc.call_or_fail("free_port", svc.name))

    def _spawn(self, svc: ManagedService) -> None:
        ray = self._connect()
        proc, previous_pid = self._actor(svc)
        env = {"PYTHONUNBUFFERED": "1", **self._env, **svc.spec.env}
        call = proc.actor.spawn.remote(
            svc.spec.module,
            self._settings(svc),
            env,
            self._cwd,
            os.path.abspath(svc.log_file),
            os.path.abspath(svc.ready_file),
            os.path.abspath(svc.settings_file),
            svc.restarts,
            previous_pid,
            self.stop_grace_s,
            run_token(),  # (through Ray's object store: written on the node for the process, never logged)
            run_token_file(),
        )
        # Each failure is a SpawnFailed: in a restart, one more failed start (counted against max_restarts and
        # retried after its backoff), not the end of the run.
        try:
            placed = ray.get(call, timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            # Given up: were it placed later, its queued spawn would start a process no one supervises.
            with contextlib.suppress(Exception):
                ray.kill(proc.actor)
            proc.lost = "not placed in time"  # (the next start creates a new actor)
            where = f" on node {proc.node_id}" if proc.node_id else ""
            raise SpawnFailed(
                svc.name,
                f"its Ray actor was not placed within {self.start_timeout_s:.0f}s: it needs "
                f"{role_resources(svc.role, svc.spec.settings, self.config)}{where}; the cluster has "
                f"{ray.available_resources()} free",
            ) from None
        except ray.exceptions.RayActorError as e:
            proc.lost = _first_line(e)  # (the next start creates a new actor on the node)
            raise SpawnFailed(svc.name, f"its Ray actor died while starting it: {proc.lost}") from None
        except ray.exceptions.RayTaskError as e:  # raised on the node: its settings file, log or token, the fork
            raise SpawnFailed(svc.name, f"its Ray actor could not start it: {_cause(e)}") from None
        proc.started(placed)
        self._started(svc)

    def _create_actor(self, svc: ManagedService, node_id: str) -> Any:
        options: dict[str, Any] = {
            **role_resources(svc.role, svc.spec.settings, self.config),
            "runtime_env": HOST_RUNTIME_ENV,
        }
        if node_id:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return self._host_class.options(**options).remote()

    def _colocated_node(self, svc: ManagedService) -> str:
        """The node of the role ``svc`` must share one with (the trainer's rank 0: the sidecar's; with the
        sidecar's ``ipc`` backend every rollout server's too, as they read the trainer's buffer); "" for any."""
        weights = self.services.get("weights")
        shared = weights is not None and weights.spec.settings.get("backend") == "ipc"
        if svc.role == "rollout" and shared:
            other = weights
        else:
            other = self.services.get(COLOCATED.get(svc.role, "")) if svc.index == 0 else None
        return other.proc.node_id if other is not None and other.proc is not None else ""

    def _read_ready(self, svc: ManagedService) -> dict[str, Any] | None:
        return svc.proc.ready()

    def _kill(self, svc: ManagedService) -> None:
        svc.proc.kill_group()

    def _exit_reason(self, svc: ManagedService, code: int) -> str:
        if svc.proc is not None and svc.proc.lost:
            return f"lost its Ray actor ({svc.proc.lost})"
        return super()._exit_reason(svc, code)

    def _forget(self, svc: ManagedService) -> None:
        # a replica scaled in: its actor goes too, or it would keep its resources (a GPU) for the whole run
        if self._ray is not None and svc.proc is not None:
            with contextlib.suppress(Exception):  # an actor already gone is what we want
                self._ray.kill(svc.proc.actor)

    def _release(self) -> None:
        if self._ray is None:
            return
        for svc in list(self.services.values()):
            if svc.proc is not None:
                with contextlib.suppress(Exception):  # an actor already gone is what we want
                    self._ray.kill(svc.proc.actor)
        if self._connected_here:
            self._ray.shutdown()
        self._ray = None


class RayProcess:
    """A service process held by a Ray actor, seen through Popen's pid, poll, wait and send_signal."""

    def __init__(self, actor: Any, call_timeout_s: float, node_id: str = "") -> None:
        self.actor = actor
        self.call_timeout_s = call_timeout_s
        self.node_id = node_id
        self.pid = 0  # 0 until the actor has started a process
        self.host = ""
        self.lost = ""  # why the actor is gone; "" while it lives
        self.returncode: int | None = None

    def started(self, placed: Mapping[str, Any]) -> None:
        self.pid, self.host, self.node_id = placed["pid"], placed["host"], placed["node_id"]
        self.returncode = None

    def _call(self, method: str, *args: Any, lost: Any = None) -> Any:
        """Calls the actor with a deadline. ``lost`` is the answer once the actor is gone; an actor that
        does not answer in time gets None (unknown)."""
        import ray

        if self.lost:
            return lost
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.call_timeout_s)
        except ray.exceptions.RayActorError as e:
            self.lost = _first_line(e)
            log.warning("Ray actor lost", extra={"pid": self.pid, "node_id": self.node_id, "error": self.lost})
            return lost
        except ray.exceptions.GetTimeoutError:
            log.warning("Ray actor did not answer", extra={"call": method, "pid": self.pid, "node_id": self.node_id})
            return None

    def call_or_fail(self, method: str, name: str) -> Any:
        """The actor's answer to ``method`` (asked before a start); a SpawnFailed naming ``name`` when it gives
        none."""
        answer = self._call(method)
        if answer is None:
            raise SpawnFailed(name, f"its Ray actor did not answer {method} ({self.lost or 'no answer in time'})")
        return answer

    def poll(self) -> int | None:
        if self.returncode is None:
            # None from an actor that does not answer: unknown, taken as running (the run's stall timeout
            # catches a service that really is stuck). No process started yet: nothing to wait for.
            self.returncode = self._call("poll", lost=LOST) if self.pid else LOST
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid} on {self.host}", timeout or 0.0)
            time.sleep(0.05)
        return code

    def send_signal(self, sig: int) -> None:
        self._call("signal", int(sig))

    def kill_group(self) -> None:
        self._call("kill_group")

    def ready(self) -> dict[str, Any] | None:
        return self._call("ready")


class ServiceHost:
    """The Ray actor that runs one service process on its node (used as ``ray.remote(ServiceHost)``).

    Every method returns at once: the controller polls, so no call waits behind another."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_file = ""
        self.host = ""

    def spawn(
        self,
        role: str,
        settings: dict[str, Any],
        env: dict[str, str],
        cwd: str,
        log_file: str,
        ready_file: str,
        settings_file: str,
        restarts: int,
        previous_pid: int | None,
        grace_s: float,
        token: str = "",
        token_file: str = "",
    ) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        self.host = ray.util.get_node_ip_address()
        if previous_pid:
            _end_previous(previous_pid, role, grace_s)
        bind = {"server.host": self.host, "metrics.host": self.host}  # reachable from the other nodes
        if role == "weights":
            bind["store.host"] = self.host  # the TCPStore rollout engines rendezvous on
        Path(ready_file).unlink(missing_ok=True)
        self.ready_file = ready_file
        if token and token_file:  # the run's token at the (absolute) path the controller's node has it
            _place_token(token_file, token)
        file_settings, child_env = service_env(role, {**bind, **settings}, {**os.environ, **env})
        write_settings(settings_file, file_settings)  # (on this node: not on the command line, which anyone reads)
        self.proc = spawn_service(
            service_command(sys.executable, role, ready_file, settings_file),
            child_env,
            log_file,
            log_header(role, restarts, f" on {self.host}, Ray actor {context.get_actor_id()}"),
            cwd=cwd if os.path.isdir(cwd) else None,
        )
        return {"pid": self.proc.pid, "host": self.host, "node_id": context.get_node_id()}

    def node_host(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def free_port(self) -> int:
        return free_port(self.node_host())

    def ready(self) -> dict[str, Any] | None:
        try:
            info = json.loads(Path(self.ready_file).read_text())
        except FileNotFoundError:
            return None
        return {**info, "host": self.host}

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill_group(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _end_previous(pid: int, role: str, grace_s: float) -> None:
    """A lost actor's process stops by itself when its actor is gone (its lifeline); its ports are free once
    it has exited (SIGKILL after ``grace_s``)."""
    for wait_s, then in ((grace_s, signal.SIGKILL), (5.0, None)):
        deadline = time.monotonic() + wait_s
        while is_service_process(pid, role) and time.monotonic() < deadline:
            time.sleep(0.1)
        if then is None or not is_service_process(pid, role):
            return
        try:
            os.killpg(pid, then)
        except ProcessLookupError:
            return


def _probe(address: str) -> None:
    """Fails at once, naming the address, where nothing listens at a cluster address given as host:port
    (``ray.init`` would retry for minutes)."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # auto, local: Ray finds the cluster, or says it found none
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise LaunchFailed(
            redact_text(
                f"launcher 'ray': no Ray cluster answers at {address} (`ray start --head` prints the address): {e}"
            )
        ) from e


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _cause(error: Any) -> str:
    """The exception a Ray task raised on its node, in one line (RayTaskError's own text is a remote traceback)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        text = describe_os_error(cause) if isinstance(cause, OSError) else f"{type(cause).__name__}: {cause}"
        return _first_line(ValueError(text))
    return _first_line(error)


def _place_token(path: str, token: str) -> None:
    """Writes the run token at ``path`` on this node unless it is there already: a file that holds it (the
    controller's own node, a mounted Secret) is left as it is, read-only or not."""
    try:
        if read_token_file(path) == token:
            return
    except TokenFileError:
        pass
    write_token_file(path, token)
