"""The queue's typed configuration (``tauflow-queue --print-config`` shows it resolved)."""

from __future__ import annotations

from pydantic import Field

from tauflow.core.config import MetricsConfig, ServerConfig, ServiceConfig, StrictModel
from tauflow.queue.wal import FsyncPolicy

GiB = 1024**3
MiB = 1024**2


class WalConfig(StrictModel):
    dir: str = Field("./tauflow-queue-data", description="directory of the write-ahead log")
    fsync: FsyncPolicy = Field(
        FsyncPolicy.ALWAYS,
        description="always: fsync before Put returns; interval/never: written before Put returns "
        "(survives SIGKILL, not a power loss)",
    )
    fsync_interval_s: float = Field(0.05, gt=0, description="period of the 'interval' policy")
    compact_min_bytes: int = Field(64 * MiB, ge=0, description="compact once this many bytes are dead")


class QueueConfig(ServiceConfig):
    server: ServerConfig = ServerConfig(port=50051)
    metrics: MetricsConfig = MetricsConfig(port=9461)
    max_staleness: int = Field(1, ge=-1, description="tau: 0 on-policy, N bounded, -1 unbounded")
    groups_per_step: int = Field(8, ge=1, description="groups the trainer consumes per step")
    capacity_groups: int = Field(100_000, ge=1)
    capacity_bytes: int = Field(8 * GiB, ge=1)
    max_group_bytes: int = Field(64 * MiB, ge=1, description="largest group Put accepts")
    default_lease_s: float = Field(600.0, gt=0)
    reservation_ttl_s: float = Field(600.0, gt=0, description="unused tickets are released after this")
    max_wait_s: float = Field(60.0, ge=0, description="cap on the long-poll of Reserve and Get")
    sweep_interval_s: float = Field(0.5, gt=0, description="how often expired leases are redelivered")
    dedup_window: int = Field(1_000_000, ge=0, description="acked group ids remembered for idempotent Put")
    wal: WalConfig = WalConfig()
