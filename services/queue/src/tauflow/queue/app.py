"""Builds the queue service from its config: recover the log, then serve (and, when enabled, the
authenticated external port for producers outside tauflow, on the same state)."""

from __future__ import annotations

from pathlib import Path

from tauflow.core.app import service_main
from tauflow.core.server import ServiceApp, ServiceBinding
from tauflow.queue import __version__
from tauflow.queue.adapters import wire
from tauflow.queue.adapters.external import external_server
from tauflow.queue.adapters.servicer import SERVICE, QueueServicer, add_queue_servicer_to_server
from tauflow.queue.config import QueueConfig
from tauflow.queue.metrics import QueueMetrics
from tauflow.queue.quarantine import QuarantineFolder
from tauflow.queue.state import QueueState
from tauflow.queue.wal import FsyncPolicy, WriteAheadLog

PAUSE_AFTER_S = 5.0


async def build(config: QueueConfig) -> ServiceApp:
    wal = WriteAheadLog(Path(config.wal.dir) / "queue.wal", config.wal.fsync, config.wal.on_corruption)
    group_limit = wire.group_limit(config.max_group_bytes, config.server.max_message_bytes)
    queue = QueueState(
        config,
        wal,
        # the domain cannot decode protobuf: a stored group is checked by the wire's full decode
        validate=lambda payload: wire.invalid_reason(payload, group_limit),
        quarantine=QuarantineFolder(Path(config.wal.dir) / "quarantine"),
        # the sweep loop runs every sweep_interval_s: a gap of several seconds more is a pause of the process
        pause_after_s=max(PAUSE_AFTER_S, 10 * config.sweep_interval_s),
    )
    metrics = QueueMetrics()
    servicer = QueueServicer(queue, config, metrics)
    background = [servicer.sweep_forever, servicer.watch_log]
    if config.wal.fsync is FsyncPolicy.INTERVAL:
        interval = config.wal.fsync_interval_s
        background.append(lambda: wal.sync_every(interval))
    return ServiceApp(
        bindings=[ServiceBinding(SERVICE, servicer, add_queue_servicer_to_server)],
        background=background,
        close=servicer.close,  # (a compaction under way finishes first)
        info={"wal": str(wal.path)},
        extra_servers=[external_server(config.external, servicer, metrics)] if config.external.enabled else [],
        on_drain=servicer.drain,
    )


main = service_main(
    "queue",
    QueueConfig,
    build,
    __version__,
    description="tauflow queue: durable, staleness-bounded trajectory-group bus between rollout and trainer",
)
