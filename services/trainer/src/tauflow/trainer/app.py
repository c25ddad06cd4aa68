"""Builds the trainer service: the torch backend (resumed from the newest checkpoint), its loop, its API."""

from __future__ import annotations

from pathlib import Path

from tauflow.api.trainer.v1 import trainer_pb2
from tauflow.core.app import service_main
from tauflow.core.decoding import servicer_adder
from tauflow.core.server import ServiceApp, ServiceBinding
from tauflow.trainer import __version__
from tauflow.trainer.adapters.queue_client import GrpcQueue
from tauflow.trainer.adapters.servicer import TrainerServicer
from tauflow.trainer.adapters.weights_client import SidecarPublisher
from tauflow.trainer.backend import TorchBackend
from tauflow.trainer.checkpoint import latest_checkpoint
from tauflow.trainer.config import TrainerConfig
from tauflow.trainer.loop import TrainerLoop
from tauflow.trainer.metrics import TrainerMetrics

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]


def quiet_progress_bars() -> None:
    """No progress bars in a service log: transformers draws one for every load ("Loading weights") and
    every save ("Writing model shards"), huggingface_hub for every download."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()


async def build(config: TrainerConfig) -> ServiceApp:
    import torch

    quiet_progress_bars()
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
    loop = TrainerLoop(backend, queue, publisher, config, on_step=metrics.observe)
    servicer = TrainerServicer(loop, config.backend.algorithm)

    async def train() -> None:
        await loop.run()
        # Finished: keep serving status (the controller reads the summary) until stopped.

    async def close() -> None:
        await queue.close()
        if publisher is not None:
            await publisher.close()

    return ServiceApp(
        bindings=[ServiceBinding(SERVICE, servicer, servicer_adder(SERVICE))],
        background=[train],
        close=close,
        info={"resumed_from": str(checkpoint) if checkpoint else None, "policy_version": backend.version},
    )


main = service_main(
    "trainer",
    TrainerConfig,
    build,
    __version__,
    description="tauflow trainer: leases batches from the queue, trains (GRPO), publishes weights, checkpoints",
)
