"""Builds the weight sidecar from its config: host the TCPStore, start the broadcast loop, serve."""

from __future__ import annotations

import torch

from tauflow.core.app import service_main
from tauflow.core.server import ServiceApp, ServiceBinding
from tauflow.weights import __version__
from tauflow.weights.clients import RolloutMemberClient
from tauflow.weights.config import WeightsConfig
from tauflow.weights.metrics import WeightsMetrics
from tauflow.weights.servicer import SERVICE, WeightsServicer, add_weights_servicer_to_server
from tauflow.weights.sidecar import Settings, Sidecar
from tauflow.weightsync import StoreHost


def settings_from(config: WeightsConfig, store_host: str) -> Settings:
    d = config.deadlines
    return Settings(
        backend=config.backend,
        device=config.device,
        load_format=config.load_format,
        flush_cache=config.flush_cache,
        max_members=config.max_members,
        max_retained_bytes=config.max_retained_bytes,
        handoff_s=d.handoff_s,
        group_s=d.group_s,
        confirm_s=d.confirm_s,
        destroy_s=d.destroy_s,
        rpc_margin_s=d.rpc_margin_s,
        advertise_host=config.store.advertise_host or store_host,
    )


async def build(config: WeightsConfig) -> ServiceApp:
    torch.set_num_threads(1)  # the sidecar moves bytes; it computes nothing
    if config.backend == "nccl" and config.device:
        torch.cuda.set_device(config.device)
    store = StoreHost(config.store.host, config.store.port, timeout_s=config.deadlines.group_s)
    metrics = WeightsMetrics()
    car = Sidecar(settings_from(config, config.store.host), store, RolloutMemberClient, metrics)
    servicer = WeightsServicer(car, metrics)
    return ServiceApp(
        bindings=[ServiceBinding(SERVICE, servicer, add_weights_servicer_to_server)],
        background=[car.run],
        info={"store_port": store.port, "backend": config.backend},
    )


main = service_main(
    "weights", WeightsConfig, build, __version__,
    description="tauflow weights: takes policy versions from the trainer and broadcasts them to rollout engines",
)
