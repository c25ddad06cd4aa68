"""Builds the trainer service: the torch backend (resumed from the newest checkpoint), its loop, its API.

With ``distributed.world_size`` N > 1 the role is N processes, each started with its rank (the launcher
starts them together). Each joins the others (``torch.distributed``) before it loads anything; rank 0
serves TrainerService and runs the loop, the others serve health and ServerInfo only and follow rank 0's
commands (parallel.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tauflow import media
from tauflow.api.trainer.v1 import trainer_pb2
from tauflow.core.app import service_main
from tauflow.core.decoding import servicer_adder
from tauflow.core.server import ServiceApp, ServiceBinding
from tauflow.trainer import __version__
from tauflow.trainer.adapters.queue_client import GrpcQueue
from tauflow.trainer.adapters.rollout_client import RolloutTeacher
from tauflow.trainer.adapters.servicer import TrainerServicer
from tauflow.trainer.adapters.weights_client import SidecarPublisher
from tauflow.trainer.backend import TorchBackend, backend_class
from tauflow.trainer.checkpoint import checkpoint_to_resume, hash_pool
from tauflow.trainer.config import TrainerConfig
from tauflow.trainer.loop import TrainerLoop
from tauflow.trainer.metrics import TrainerMetrics
from tauflow.trainer.parallel import RankGroup

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]
FOLLOWER_CLOSE_S = (
    10.0  # within the launcher's stop grace (15 s): how long a stopping rank other than 0 waits for rank 0's stop
)
T = TypeVar("T")


def quiet_progress_bars() -> None:
    """No progress bars in a service log: transformers draws one for every load ("Loading weights") and
    every save ("Writing model shards"), huggingface_hub for every download."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()


def in_daemon_thread(work: Callable[[], T], name: str) -> asyncio.Future[T]:
    """``work()`` in a daemon thread: a rank blocked in a collective must not hold its process's exit up."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]  # (None only with an error)

    def run() -> None:
        try:
            result, error = work(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task, which raises it
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop has closed (the process is exiting): nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


async def build(config: TrainerConfig) -> ServiceApp:
    import torch

    quiet_progress_bars()
    hash_pool()  # (its threads started before the run: none must start mid-run, when memory may be short)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    group = None
    if config.distributed.distributed:
        # Blocks until every rank has joined: the launcher starts the N ranks together.
        group = await in_daemon_thread(
            lambda: RankGroup(config.distributed, torch.device(config.backend.device)), "rendezvous"
        )
    leads = group is None or group.leads
    # Rank 0 alone reads the checkpoints (the others get their state from it): on Kubernetes they live on
    # rank 0's volume only.
    has_checkpoints = leads and Path(config.checkpoint_dir).exists()
    checkpoint = checkpoint_to_resume(config.checkpoint_dir) if has_checkpoints else None
    # A teacher served by its own deployment (on-policy distillation): rank 0 alone asks it.
    teacher = (
        RolloutTeacher(config.backend.teacher_address, config.channel, asyncio.get_running_loop())
        if config.backend.teacher_address and leads
        else None
    )
    backend = backend_class(config.backend)(
        config.backend, checkpoint=checkpoint, group=group, teacher=teacher,
        media_limits=media.MediaLimits.of(config.media.model_dump()),
    )  # fmt: skip
    if group is not None and not group.leads:
        return follower(backend, config)
    queue = GrpcQueue(config.queue_address, config.consumer_id, config.channel)
    publisher = (
        SidecarPublisher(
            config.weights_address, config.channel, model=config.backend.model_path, device=config.backend.device
        )
        if config.weights_address
        else None
    )
    metrics = TrainerMetrics()
    loop = TrainerLoop(backend, queue, publisher, config, on_step=metrics.observe, on_skip=metrics.observe_skipped)
    servicer = TrainerServicer(loop, config.backend.algorithm)

    async def train() -> None:
        await loop.run()
        # Finished: keep serving status (the controller reads the summary) until stopped.

    async def close() -> None:
        await queue.close()
        if publisher is not None:
            await publisher.close()
        if teacher is not None:
            await teacher.close()
        await in_daemon_thread(backend.close, "close")  # the other ranks stop

    return ServiceApp(
        bindings=[ServiceBinding(SERVICE, servicer, servicer_adder(SERVICE))],
        background=[train],
        close=close,
        info={
            "resumed_from": str(checkpoint) if checkpoint else None,
            "policy_version": backend.version,
            "rank": 0,
            "world_size": backend.world_size,
        },
    )


def follower(backend: TorchBackend, config: TrainerConfig) -> ServiceApp:
    """A rank other than 0: health and ServerInfo, and rank 0's commands until it says stop (then it
    stops serving too). Its collective fails when rank 0 is gone, and so does the process."""

    following: list[asyncio.Future[None]] = []

    async def follow() -> None:
        following.append(in_daemon_thread(backend.follow, "follow"))
        await asyncio.shield(following[0])  # a drain cancels this task, not the thread's work
        os.kill(os.getpid(), signal.SIGTERM)  # told to stop: drain and exit, as the launcher's stop would

    async def close() -> None:
        # Stopped with its role (every rank gets SIGTERM at once): wait, within a bound, for rank 0's stop,
        # so that this rank leaves the process group with the others. A process that exits while its gloo
        # threads still run aborts ("terminate called without an active exception").
        if following and not following[0].done():
            with contextlib.suppress(Exception):
                async with asyncio.timeout(FOLLOWER_CLOSE_S):  # (not wait_for: it can swallow a cancellation)
                    await asyncio.shield(following[0])

    return ServiceApp(
        bindings=[],
        background=[follow],
        close=close,
        info={"rank": config.distributed.rank, "world_size": config.distributed.world_size},
    )


main = service_main(
    "trainer",
    TrainerConfig,
    build,
    __version__,
    description="tauflow trainer: leases batches from the queue, trains (GRPO), publishes weights, checkpoints",
)
