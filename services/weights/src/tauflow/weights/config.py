"""The sidecar's typed configuration (``tauflow-weights --print-config`` shows it resolved)."""

from __future__ import annotations

import os

from pydantic import Field, field_validator

from tauflow.core.config import MetricsConfig, ServerConfig, ServiceConfig, StrictModel
from tauflow.weightsync.staging import default_staging_dir

GiB = 1024**3


class DeadlinesConfig(StrictModel):
    """The deadline of each phase; a missed one is an error naming the phase and the peer."""

    handoff_s: float = Field(60.0, gt=0, description="Publish: copying the staged version")
    group_s: float = Field(
        60.0,
        gt=0,
        description="the weight group's timeout: its rendezvous (group_init) and every bucket's collectives (transfer)",
    )
    confirm_s: float = Field(60.0, gt=0, description="from the last bucket to every member's ConfirmVersion")
    destroy_s: float = Field(10.0, gt=0, description="DestroyWeightsUpdateGroup on each member of an old group")
    rpc_margin_s: float = Field(
        2.0, ge=0, description="extra time on member RPCs, so that the member's own deadline error arrives first"
    )


class StoreConfig(StrictModel):
    """The TCPStore the weight groups rendezvous on (hosted by the sidecar)."""

    host: str = Field("127.0.0.1", description="address the store listens on")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    advertise_host: str = Field("", description="address members connect to; empty means `host`")

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host


class WeightsConfig(ServiceConfig):
    server: ServerConfig = ServerConfig(port=50055)
    metrics: MetricsConfig = MetricsConfig(port=9465)
    backend: str = Field(
        "gloo",
        pattern="^(gloo|nccl|ipc)$",
        description="collective backend: gloo (CPU) or nccl (GPU); ipc: colocated, the members read the trainer's "
        "shared buffer on their machine (no group, no copy here; docs/gpu.md)",
    )
    device: str = Field("", description="device of the sender's buffers for nccl (e.g. cuda:0); empty: cpu / cuda")
    load_format: str = Field(
        "tauflow_flat_v1",
        pattern="^(tauflow_flat_v1|)$",
        description="tauflow_flat_v1: one broadcast per bucket; empty: one per tensor (SGLang's layout)",
    )
    flush_cache: bool = Field(True, description="ask engines to flush their prefix cache on the swap")
    max_members: int = Field(256, ge=1, description="Join answers RESOURCE_EXHAUSTED above this")
    max_group_ranks: int = Field(
        4096,
        ge=1,
        description="most member ranks in one weight group (the sum of num_ranks); Join answers "
        "RESOURCE_EXHAUSTED above it (a group build for thousands of ranks stalls the sidecar)",
    )
    max_retained_bytes: int = Field(
        64 * GiB, ge=1, description="bytes of versions held at once (newest accepted + being broadcast)"
    )
    staging_roots: list[str] = Field(
        default_factory=lambda: [os.path.abspath(default_staging_dir())],
        description="directories a Publish's staging file may lie in (absolute; a file below one, reached "
        "without a symbolic link); default: where the trainer stages, TAUFLOW_STAGING_DIR as this process "
        "sees it, else /dev/shm; none: every staging_uri is refused",
    )
    store: StoreConfig = StoreConfig()
    deadlines: DeadlinesConfig = DeadlinesConfig()

    @field_validator("staging_roots")
    @classmethod
    def _absolute_roots(cls, roots: list[str]) -> list[str]:
        for root in roots:
            if not os.path.isabs(root):
                raise ValueError(f"staging_roots: {root!r} is not an absolute path")
        return roots
