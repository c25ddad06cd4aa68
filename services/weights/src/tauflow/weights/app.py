"""Builds the weight sidecar from its config: host the TCPStore, start the broadcast loop, serve."""

from __future__ import annotations

import torch

from tauflow.core.app import service_main
from tauflow.core.server import ServiceApp, ServiceBinding
from tauflow.weights import __version__
from tauflow.weights.adapters.rollout_client import RolloutMemberClient
from tauflow.weights.adapters.servicer import SERVICE, WeightsServicer, add_weights_servicer_to_server
from tauflow.weights.config import WeightsConfig
from tauflow.weights.metrics import WeightsMetrics
from tauflow.weights.sidecar import Sidecar
from tauflow.weightsync import StoreHost


async def build(config: WeightsConfig) -> ServiceApp:
    torch.set_num_threads(1)  # the sidecar moves bytes; it computes nothing
    if config.backend == "nccl" and config.device and torch.device(config.device).index is not None:
        torch.cuda.set_device(config.device)  # ("cuda" alone: the current device; set_device wants an index)
    store = StoreHost(config.store.host, config.store.port, timeout_s=config.deadlines.group_s)
    metrics = WeightsMetrics()
    sidecar = Sidecar(config, store, RolloutMemberClient, metrics)
    servicer = WeightsServicer(sidecar, metrics)
    return ServiceApp(
        bindings=[ServiceBinding(SERVICE, servicer, add_weights_servicer_to_server)],
        background=[sidecar.broadcast.run],
        info={"store_port": store.port, "backend": config.backend},
    )


main = service_main(
    "weights",
    WeightsConfig,
    build,
    __version__,
    description="tauflow weights: takes policy versions from the trainer and broadcasts them to rollout engines",
)
