"""The rollout service's Prometheus metrics (``tauflow_rollout_*``)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter


class RolloutMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.dropped_groups = Counter(
            "tauflow_rollout_dropped_groups",
            "Generated groups the queue refused for good, by reason",
            ["reason"],
            registry=registry,
        )
        self.released_tickets = Counter(
            "tauflow_rollout_released_tickets",
            "Tickets given back to the queue unfilled, by why",
            ["why"],
            registry=registry,
        )
        self.sidecar_joins = Counter(
            "tauflow_rollout_sidecar_joins",
            "Joins of the weight sidecar: the first and every re-join",
            registry=registry,
        )

    @classmethod
    def null(cls) -> RolloutMetrics:
        """Metrics in a registry of their own, for tests and tools that export nothing."""
        return cls(CollectorRegistry())
