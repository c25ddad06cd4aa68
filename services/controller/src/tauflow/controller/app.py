"""The controller's wiring: ``build_run`` makes a run with its launcher and the gRPC adapters as its ports
(``tauflow run`` and the service use it); ``main`` is ``tauflow-controller``, the run as a service."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from tauflow.api.controller.v1 import controller_pb2
from tauflow.controller import __version__
from tauflow.controller.adapters.compat import check_peer
from tauflow.controller.adapters.health_client import check_health
from tauflow.controller.adapters.queue_client import QueueClient
from tauflow.controller.adapters.reward_client import RewardClient
from tauflow.controller.adapters.rollout_client import RolloutClient
from tauflow.controller.adapters.servicer import ControllerServicer
from tauflow.controller.adapters.trainer_client import TrainerClient
from tauflow.controller.adapters.weights_client import WeightsClient
from tauflow.controller.config import ControllerConfig, RunConfig
from tauflow.controller.external import ExternalLauncher
from tauflow.controller.launcher import Launcher, LocalLauncher
from tauflow.controller.ports import Peers
from tauflow.controller.progress import Progress
from tauflow.controller.run import Run
from tauflow.controller.summary import RunSummary
from tauflow.core.app import service_main
from tauflow.core.config import ServerConfig
from tauflow.core.decoding import servicer_adder
from tauflow.core.server import GrpcServer, ServiceApp, ServiceBinding

DESCRIPTION = """``tauflow-controller``: a run as a service — it runs ``run`` from its config and serves ControllerService
(``tauflow run`` is the same run with a terminal view)."""

log = logging.getLogger(__name__)


def create_launcher(config: RunConfig) -> Launcher:
    """The run's launcher (``launcher``); Ray is imported only for ``ray``."""
    if config.launcher == "external":
        return ExternalLauncher(config.external, check_health, start_timeout_s=config.start_timeout_s)
    if config.launcher == "ray":
        from tauflow.controller.raylauncher import RayLauncher

        return RayLauncher(
            config.run_dir,
            config.ray,
            max_restarts=config.max_restarts,
            restart_window_s=config.restart_window_s,
            start_timeout_s=config.start_timeout_s,
            health_check=check_health,
        )
    return LocalLauncher(
        config.run_dir,
        max_restarts=config.max_restarts,
        restart_window_s=config.restart_window_s,
        start_timeout_s=config.start_timeout_s,
        health_check=check_health,
    )


def connect(addresses: Mapping[str, str]) -> Peers:
    """gRPC clients of the roles the run follows (each opens its channel; ``Peers.close`` closes them)."""
    return Peers(
        trainer=TrainerClient(addresses["trainer"]),
        queue=QueueClient(addresses["queue"]),
        rollout=RolloutClient(addresses["rollout"]),
        reward=RewardClient(addresses["reward"]),
        weights=WeightsClient(addresses["weights"]),
        rollout_at=RolloutClient,
    )


def build_run(
    config: RunConfig, *, on_progress: Callable[[Progress], None] | None = None, serve_metrics: bool = True
) -> Run:
    return Run(
        config,
        launcher=create_launcher(config),
        connect=connect,
        check_peer=check_peer,
        on_progress=on_progress,
        serve_metrics=serve_metrics,
    )


def controller_binding(servicer: ControllerServicer) -> ServiceBinding:
    descriptor = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"]
    # (a request that does not decode in full is INVALID_ARGUMENT, not UNKNOWN)
    return ServiceBinding(descriptor, servicer, servicer_adder(descriptor))


CONTROL_MESSAGE_BYTES = 4 * 1024 * 1024  # ControllerService's messages are small: a hostile one stays small too


async def execute_with_control(run: Run) -> RunSummary:
    """``tauflow run``: the run, with its ControllerService served on ``control`` (loopback by default) for
    ``tauflow scale``, ``set`` and ``status``; its address goes into ``<out_dir>/controller.ready.json``."""
    servicer = ControllerServicer(run)
    control = run.config.control
    server = GrpcServer(
        [controller_binding(servicer)],
        ServerConfig(host=control.host, port=control.port, max_message_bytes=CONTROL_MESSAGE_BYTES),
        role="controller",
        version=__version__,
        key="control",
        run_token=run.run_token,
    )
    port = await server.start()
    await server.set_serving(True)
    run.control_address = f"{control.host}:{port}"
    task = asyncio.create_task(run.execute())
    servicer.task = task
    try:
        return await task
    except asyncio.CancelledError:
        if servicer.stop_requested and not _cancelling():
            return run.summary  # StopRun ended the run: its summary is written
        raise
    finally:
        await server.server.stop(1.0)


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def build(config: ControllerConfig) -> ServiceApp:
    run_config = config.run
    if config.auth.token_file and not run_config.token_file:  # the service's token is the run's
        run_config = run_config.model_copy(update={"token_file": config.auth.token_file})
    run = build_run(run_config, serve_metrics=False)  # its metrics are on this service's /metrics
    servicer = ControllerServicer(run)

    async def execute() -> None:
        task = asyncio.current_task()
        assert task is not None  # a coroutine the service runs as a background task
        servicer.task = task
        try:
            await run.execute()
        except asyncio.CancelledError:
            if not servicer.stop_requested:
                raise  # the service is draining
            task.uncancel()  # StopRun ended the run, not the service
        summary = run.summary  # (said as `tauflow run` says it: the service goes on serving GetRun)
        log.info(
            "run ended; serving its summary until stopped",
            extra={"status": summary.status, "steps": len(summary.steps), "accuracy": summary.final_accuracy},
        )
        await asyncio.Event().wait()  # keep serving the summary until stopped

    return ServiceApp(bindings=[controller_binding(servicer)], background=[execute])


main = service_main("controller", ControllerConfig, build, __version__, description=DESCRIPTION)
