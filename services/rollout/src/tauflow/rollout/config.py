"""The rollout service's typed configuration (``tauflow-rollout --print-config`` shows it resolved)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from tauflow.core.config import (
    ChannelConfig,
    DataConfig,
    MediaConfig,
    MetricsConfig,
    ServerConfig,
    ServiceConfig,
    StrictModel,
)


class SamplingConfig(StrictModel):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(16, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    stop: list[str] = Field(
        default_factory=list, max_length=16, description="stop strings: a completion ends when its text holds one"
    )


class DynamicSamplingConfig(StrictModel):
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal for a group baseline,
    so they are filtered out before the queue and the room they held is refilled (docs/algorithms.md)."""

    enabled: bool = Field(False, description="filter groups whose rewards are all equal; refill their room")
    oversample: float = Field(
        1.0,
        ge=1.0,
        le=8.0,
        description="prompts generated per group of a ticket (ceil(n x oversample)); the first n that pass "
        "the filter are put, the rest dropped as surplus",
    )


class RolloutConfig(ServiceConfig):
    server: ServerConfig = ServerConfig(port=50052)
    metrics: MetricsConfig = MetricsConfig(port=9462)
    server_id: str = Field("rollout-0", description="unique per rollout server in a run")
    model_path: str = Field(..., description="Hugging Face folder of the initial policy")
    engine: str = Field("hf", description="generation backend: hf, or sglang (experimental: docs/gpu.md)")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="passed to the engine")
    dataset: str = Field("", description="training prompts (JSONL/Parquet); empty: serve Generate only")
    data: DataConfig = Field(
        DataConfig(), description="the data set's columns, and the chat template's use (docs/data.md)"
    )
    media: MediaConfig = Field(MediaConfig(), description="media URIs' roots and decoded bounds (multimodal prompts)")
    max_prompt_tokens: int = Field(
        0, ge=0, description="a drawn prompt of more tokens is skipped and counted (reason too_long); 0: no limit"
    )
    group_size: int = Field(8, ge=1, description="samples per prompt (G)")
    groups_per_ticket: int = Field(8, ge=1, description="groups reserved and generated together")
    tickets_in_flight: int = Field(
        2,
        ge=1,
        description="tickets generated at once; as many more are reserved ahead or being scored and put",
    )
    sampling: SamplingConfig = SamplingConfig()
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    greedy_baseline: bool = Field(
        False,
        description="also decode each prompt greedily (temperature 0), score it, and send its reward with "
        "the group as baseline_reward: REMAX's baseline (the trainer's algorithm remax needs it)",
    )
    seed: int = 0
    queue_address: str = "127.0.0.1:50051"
    reward_address: str = "127.0.0.1:50053"
    reward_fn: str = ""
    weights_address: str = Field("", description="the weight sidecar to join; empty: weights never change")
    advertise_host: str = Field(
        "",
        description="host the weight sidecar calls this server back on (a pod IP, a service name); "
        "empty: server.host. The port is the bound one",
    )
    weights_check_s: float = Field(
        3.0, gt=0, description="how often to check that the sidecar still lists this server (re-join if not)"
    )
    max_n: int = Field(64, ge=1, description="Generate: completions per call at most (RESOURCE_EXHAUSTED above)")
    max_in_flight: int = Field(
        64, ge=1, description="Generate and ComputeLogprobs: calls admitted at once (RESOURCE_EXHAUSTED above)"
    )
    max_version_waiters: int = Field(
        32,
        ge=1,
        description="Generate: calls waiting for their min_policy_version at once (RESOURCE_EXHAUSTED above); "
        "a waiting call holds none of max_in_flight's slots, and takes one (over it, if need be) once its "
        "version is loaded",
    )
    max_version_lead: int = Field(
        64,
        ge=0,
        description="Generate: a min_policy_version more than this many versions ahead of the engine's is "
        "refused at once (UNAVAILABLE: the server has not loaded that version) instead of waiting for it",
    )
    max_score_tokens: int = Field(
        262_144,
        ge=1,
        description="ComputeLogprobs: prompt and completion tokens per call at most (RESOURCE_EXHAUSTED above)",
    )
    max_wait_s: float = Field(
        600.0,
        gt=0,
        description="longest wait of a call (min_policy_version, a weight group's rendezvous), "
        "whatever its deadline or timeout says",
    )
    channel: ChannelConfig = ChannelConfig()

    @model_validator(mode="after")
    def _a_filtered_group_can_hold_a_signal(self) -> RolloutConfig:
        if self.dynamic_sampling.enabled and self.group_size < 2:
            raise ValueError("dynamic_sampling needs group_size >= 2: a group of one always has equal rewards")
        return self
