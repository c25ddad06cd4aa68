"""``tauflow-controller``: a run as a service — it runs ``run`` from its config and serves ControllerService
(``tauflow run`` is the same run with a terminal view)."""

from __future__ import annotations

import asyncio

from tauflow.api.controller.v1 import controller_pb2, controller_pb2_grpc
from tauflow.controller import __version__
from tauflow.controller.config import ControllerConfig
from tauflow.controller.run import Run
from tauflow.controller.servicer import ControllerServicer
from tauflow.core.app import service_main
from tauflow.core.server import ServiceApp, ServiceBinding


async def build(config: ControllerConfig) -> ServiceApp:
    run = Run(config.run, serve_metrics=False)  # its metrics are on this service's /metrics
    servicer = ControllerServicer(run)

    async def execute() -> None:
        servicer.task = asyncio.current_task()
        await run.execute()
        await asyncio.Event().wait()  # keep serving the summary until stopped

    return ServiceApp(
        bindings=[
            ServiceBinding(
                controller_pb2.DESCRIPTOR.services_by_name["ControllerService"],
                servicer,
                controller_pb2_grpc.add_ControllerServiceServicer_to_server,
            )
        ],
        background=[execute],
    )


main = service_main("controller", ControllerConfig, build, __version__, description=__doc__ or "")
