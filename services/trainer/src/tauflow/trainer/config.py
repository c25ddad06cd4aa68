"""The trainer service's typed configuration (``tauflow-trainer --print-config`` shows it resolved)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tauflow.core.config import ChannelConfig, MediaConfig, MetricsConfig, ServerConfig, ServiceConfig
from tauflow.core.staleness import UNBOUNDED
from tauflow.trainer.backend import TorchBackendConfig
from tauflow.trainer.parallel import DistributedConfig


class TrainerConfig(ServiceConfig):
    server: ServerConfig = ServerConfig(port=50054)
    metrics: MetricsConfig = MetricsConfig(port=9464)
    backend: TorchBackendConfig
    queue_address: str = Field("127.0.0.1:50051", description="the queue service")
    weights_address: str = Field("", description="the weight sidecar; empty: versions are not published")
    publish_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="the dtype floating-point weights are published in (bfloat16 halves the bytes a version "
        "moves; the engines cast to their own dtype anyway); None: the trainer's own (float32)",
    )
    consumer_id: str = "trainer-0"
    groups_per_step: int = Field(8, ge=1, description="groups per optimizer step (one batch = one version)")
    max_staleness: int = Field(1, ge=UNBOUNDED, description="tau: groups staler than this are never trained on")
    total_steps: int = Field(0, ge=0, description="stop after this policy version; 0 runs until stopped")
    checkpoint_dir: str = "./tauflow-trainer-checkpoints"
    checkpoint_every_steps: int = Field(
        20, ge=1, description="leases are acked only once a checkpoint holds their steps (exactly-once)"
    )
    lease_s: float = Field(120.0, gt=0, description="lease length; held leases are renewed at half of it")
    get_wait_s: float = Field(5.0, gt=0, description="long poll of each Get")
    history_steps: int = Field(100_000, ge=1, description="step metrics kept for ListSteps")
    start_paused: bool = Field(
        False,
        description="begin paused, taking no step until Resume: tauflow run sets it so that its first "
        "evaluation is of the weights the run starts from",
    )
    channel: ChannelConfig = ChannelConfig()
    media: MediaConfig = Field(MediaConfig(), description="media URIs' roots and decoded bounds (a multimodal policy)")
    distributed: DistributedConfig = Field(
        DistributedConfig(),
        description="this process's rank in a data-parallel role (world_size > 1): the launcher sets it per rank",
    )
