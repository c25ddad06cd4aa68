"""The reward service's typed configuration (``tauflow-reward --print-config`` shows it resolved)."""

from __future__ import annotations

import os
from enum import Enum
from typing import Any, Literal

from pydantic import Field

from tauflow.core.config import MetricsConfig, ServerConfig, ServiceConfig, StrictModel


class Executor(str, Enum):
    """Where a reward function runs."""

    INLINE = "inline"  # in the service process, on a thread of the call: cheapest, but a hang is not interrupted
    PROCESS = "process"  # in the killable worker pool: per-sample timeout enforced by killing the worker


class FunctionSettings(StrictModel):
    """Per-function overrides, ``functions.<name>.<key>``; unset keys keep the function's own defaults."""

    enabled: bool = True
    timeout_s: float | None = Field(None, gt=0, description="per-sample (or per-group) time limit")
    fallback_score: float | None = Field(None, description="score of a sample whose call failed or timed out")
    executor: Executor | None = Field(
        None, description="inline or process; default: inline for exact_match and format, process for everything else"
    )
    config: dict[str, Any] = Field(default_factory=dict, description="merged over the function's default config")


def _default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class PoolConfig(StrictModel):
    """The pool of worker processes that runs ``process`` functions."""

    workers: int = Field(default_factory=_default_workers, ge=1, description="worker processes")
    call_share: float = Field(
        0.75,
        gt=0,
        le=1,
        description="the fraction of the workers one Score call holds at once (at least one): the others stay "
        "free for other calls, so that a call of slow samples cannot make them wait; 1 lets one call take all",
    )
    max_tasks_per_worker: int = Field(
        10_000, ge=0, description="a worker is replaced after this many calls (bounds leaks); 0 never"
    )
    worker_memory_mb: int = Field(
        4096,
        ge=0,
        le=1 << 30,
        description="address space of a worker process (RLIMIT_AS, its soft limit): a sample that needs more fails "
        "with MemoryError (REWARD_STATUS_ERROR) instead of taking the host's memory; 0 sets none",
    )
    start_method: Literal["forkserver", "spawn"] = Field(
        "forkserver", description="forkserver: workers fork from a clean, preloaded server process"
    )
    preload: list[str] = Field(
        default_factory=lambda: ["math_verify"],
        description="modules imported once by the fork server, so that a replaced worker starts warm",
    )


class LimitsConfig(StrictModel):
    """Bounds of a Score request's fields (every string and list; see the README's table). A request over
    one is refused with INVALID_ARGUMENT naming the field and the key."""

    max_id_chars: int = Field(
        256, ge=1, description="group_id, prompt_id, producer_id, sample_id, reward_fn, metadata and component keys"
    )
    max_text_chars: int = Field(1 << 20, ge=1, description="completion_text and metadata values")
    max_map_entries: int = Field(64, ge=0, description="entries of each metadata map and of reward.components")
    max_tokens_per_sample: int = Field(
        1 << 20, ge=0, description="each per-token list of a sample (token ids, log-probs, versions, loss mask)"
    )
    max_config_bytes: int = Field(
        64 * 1024, ge=0, description="ScoreRequest.config: its bytes as sent (before the decode) and serialized"
    )


class RewardConfig(ServiceConfig):
    server: ServerConfig = ServerConfig(port=50053)
    metrics: MetricsConfig = MetricsConfig(port=9463)
    default_reward_fn: str = Field(
        "exact_match", description="used when ScoreRequest.reward_fn is empty; '' makes reward_fn required"
    )
    load_entry_points: bool = Field(True, description="register the functions of the 'tauflow.rewards' entry points")
    default_timeout_s: float = Field(10.0, gt=0, description="timeout of functions that declare none")
    default_fallback_score: float = Field(0.0, description="fallback of functions that declare none")
    max_sample_timeout_s: float = Field(
        600.0,
        gt=0,
        description="largest ScoreRequest.sample_timeout accepted (a request may also never raise a function's "
        "own timeout: functions.<name>.timeout_s)",
    )
    max_inline_call_s: float = Field(
        60.0,
        gt=0,
        description="the most time an inline Score call runs, deadline or none: its budget is the lesser of this "
        "and its samples (groups, for a group-level function) x its timeout; the samples not scored within it "
        "get REWARD_STATUS_TIMEOUT and the fallback score",
    )
    max_pool_call_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="the most time a Score call of a function that runs in the worker pool holds its workers, "
        "deadline or none (a call without a deadline was bounded only by its samples x its timeout); the samples "
        "not scored within it get REWARD_STATUS_TIMEOUT and the fallback score",
    )
    max_samples_per_request: int = Field(65_536, ge=1, description="more samples in one Score: RESOURCE_EXHAUSTED")
    max_concurrent_requests: int = Field(64, ge=1, description="more Score calls in flight: RESOURCE_EXHAUSTED")
    run_reserved_requests: int = Field(
        16,
        ge=0,
        description="of max_concurrent_requests, the Score calls only the run's own callers (those with the run "
        "token) may hold, at most half of them; a caller without it is refused RESOURCE_EXHAUSTED past the rest. "
        "No effect without a run token (auth.token_file): every call is then the run's",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    functions: dict[str, FunctionSettings] = Field(default_factory=dict)
