"""Builds the trainer service: the torch backend (resumed from the newest checkpoint), its loop, its API."""

from __future__ import annotations

from pathlib import Path

from tauflow.api.trainer.v1 import trainer_pb2
from tauflow.core.app import service_main
from tauflow.core.decoding import servicer_adder
from tauflow.core.server import ServiceApp, ServiceBinding
from tauflow.trainer import __version__
from tauflow.trainer.backend import TorchBackend, latest_checkpoint
from tauflow.trainer.clients import GrpcQueue, SidecarPublisher
from tauflow.trainer.config import TrainerConfig
from tauflow.trainer.loop import LoopSettings, TrainerLoop
from tauflow.trainer.metrics import TrainerMetrics
from tauflow.trainer.servicer import TrainerServicer

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]


async def build(config: TrainerConfig) -> ServiceApp:
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    checkpoint = latest_checkpoint(config.checkpoint_dir) if Path(config.checkpoint_dir).exists() else None
    backend = TorchBackend(config.backend, checkpoint=checkpoint)
    queue = GrpcQueue(config.queue_address, config.consumer_id, config.channel)
    publisher = (
        SidecarPublisher(config.weights_address, config.channel, model=config.backend.model_path)
        if config.weights_address
        else None
    )
    metrics = TrainerMetrics()
    loop = TrainerLoop(
        backend,
        queue,
        publisher,
        LoopSettings(
            groups_per_step=config.groups_per_step,
            max_staleness=config.max_staleness,
            total_steps=config.total_steps,
            checkpoint_dir=Path(config.checkpoint_dir),
            checkpoint_every_steps=config.checkpoint_every_steps,
            lease_s=config.lease_s,
            get_wait_s=config.get_wait_s,
            history_steps=config.history_steps,
        ),
        on_step=metrics.observe,
    )
    servicer = TrainerServicer(loop, config.backend.algorithm)

    async def train() -> None:
        await loop.run()
        # Finished: keep serving status (the controller reads the summary) until stopped.

    async def close() -> None:
        await queue.close()
        if publisher is not None:
            await publisher.close()

    return ServiceApp(
        bindings=[
            ServiceBinding(SERVICE, servicer, servicer_adder(SERVICE))
        ],
        background=[train],
        close=close,
        info={"resumed_from": str(checkpoint) if checkpoint else None, "policy_version": backend.version},
    )


main = service_main(
    "trainer", TrainerConfig, build, __version__,
    description="tauflow trainer: leases batches from the queue, trains (GRPO), publishes weights, checkpoints",
)
