"""``tauflow-controller``: a run as a service — it runs ``run`` from its config and serves ControllerService
(``tauflow run`` is the same run with a terminal view)."""

from __future__ import annotations

import asyncio

from tauflow.api.controller.v1 import controller_pb2
from tauflow.controller import __version__
from tauflow.controller.config import ControllerConfig
from tauflow.controller.run import Run
from tauflow.controller.servicer import ControllerServicer
from tauflow.core.app import service_main
from tauflow.core.decoding import servicer_adder
from tauflow.core.server import ServiceApp, ServiceBinding


async def build(config: ControllerConfig) -> ServiceApp:
    run = Run(config.run, serve_metrics=False)  # its metrics are on this service's /metrics
    servicer = ControllerServicer(run)

    async def execute() -> None:
        servicer.task = asyncio.current_task()
        try:
            await run.execute()
        except asyncio.CancelledError:
            if not servicer.stop_requested:
                raise  # the service is draining
            servicer.task.uncancel()  # StopRun ended the run, not the service
        await asyncio.Event().wait()  # keep serving the summary until stopped

    return ServiceApp(
        bindings=[
            ServiceBinding(
                controller_pb2.DESCRIPTOR.services_by_name["ControllerService"],
                servicer,
                # (a request that does not decode in full is INVALID_ARGUMENT, not UNKNOWN)
                servicer_adder(controller_pb2.DESCRIPTOR.services_by_name["ControllerService"]),
            )
        ],
        background=[execute],
    )


main = service_main("controller", ControllerConfig, build, __version__, description=__doc__ or "")
