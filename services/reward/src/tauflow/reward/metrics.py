"""The reward service's Prometheus metrics (``tauflow_reward_*``, units in the names)."""

from __future__ import annotations

import re
from collections import Counter as Tally
from collections.abc import Iterable, Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Summary

from tauflow.reward.runner import SampleResult, Status

DURATION_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))


class RewardMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.scored_samples = Counter(
            "tauflow_reward_scored_samples",
            "Samples scored, by reward function and status (ok, error, timeout)",
            ["fn", "status"],
            registry=registry,
        )
        self.failures = Counter(
            "tauflow_reward_failures",
            "Samples given the fallback score, by reward function and reason (error: the function raised or "
            "returned no valid score; timeout: it ran past its timeout; crash: its worker process died)",
            ["fn", "reason"],
            registry=registry,
        )
        self.function_duration = Histogram(
            "tauflow_reward_function_duration_seconds",
            "Time a reward function spent on one sample (a group-level call's time is split over its samples)",
            ["fn"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.score = Summary(
            "tauflow_reward_score",
            "Scores returned by reward functions (fallbacks excluded): rate(_sum)/rate(_count) is the mean reward",
            ["fn"],
            registry=registry,
        )
        self.rpc_duration = Histogram(
            "tauflow_reward_rpc_duration_seconds",
            "Server-side latency of each RPC",
            ["method"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.rejected = Counter(
            "tauflow_reward_rejected_requests",
            "Requests refused, by method and status code",
            ["method", "code"],
            registry=registry,
        )
        self.invalid_requests = Counter(
            "tauflow_reward_invalid_requests",
            "Requests refused with INVALID_ARGUMENT, by method and the field at fault (its path without indices "
            "or keys, e.g. groups.samples.completion_text; config for any key of ScoreRequest.config)",
            ["method", "field"],
            registry=registry,
        )
        self.inflight = Gauge("tauflow_reward_inflight_requests", "Score calls in progress", registry=registry)
        self.pool_workers = Gauge(
            "tauflow_reward_pool_workers",
            "Worker processes of the pool that runs process functions",
            registry=registry,
        )

    def count_invalid(self, method: str, field: str) -> None:
        self.invalid_requests.labels(method, field_label(field)).inc()

    def observe(self, fn: str, results: Iterable[Sequence[SampleResult]]) -> None:
        statuses: Tally[Status] = Tally()
        reasons: Tally[str] = Tally()
        duration = self.function_duration.labels(fn)
        score = self.score.labels(fn)
        for group in results:
            for r in group:
                statuses[r.status] += 1
                duration.observe(r.duration_s)
                if r.status is Status.OK:
                    score.observe(r.score)
                else:
                    reasons[r.reason] += 1
        for status, n in statuses.items():
            self.scored_samples.labels(fn, status.value).inc(n)
        for reason, n in reasons.items():
            self.failures.labels(fn, reason).inc(n)


_INDEX = re.compile(r"\[\d+\]")
_SCHEMA_PATH = re.compile(r"[a-z_.]*")


def field_label(field: str) -> str:
    """``groups[3].samples[0].metadata['k']`` → ``groups.samples.metadata``: no index, map key or config key
    (a client's choice), so that the label takes only as many values as the contract has fields."""
    if field == "config" or field.startswith(("config.", "config[")):
        return "config"
    match = _SCHEMA_PATH.match(_INDEX.sub("", field))
    return (match.group(0) if match else "").strip(".") or "request"
