"""The queue's Prometheus metrics (``tauflow_queue_*``, units in the names)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from tauflow.core.staleness import pacing_limit
from tauflow.queue.model import Stats

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, float("inf"))


class QueueMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=registry)

        self.depth_groups = gauge("tauflow_queue_depth_groups", "Groups waiting to be delivered")
        self.depth_bytes = gauge("tauflow_queue_depth_bytes", "Bytes of the groups waiting to be delivered")
        self.leased_groups = gauge("tauflow_queue_leased_groups", "Groups held by unacked leases")
        self.reserved_groups = gauge("tauflow_queue_reserved_groups", "Groups reserved and not yet put (in flight)")
        self.accepted_groups = gauge(
            "tauflow_queue_accepted_groups",
            "Groups accepted since the run began minus those evicted before a step used them (the pacing sum)",
        )
        self.trainer_version = gauge("tauflow_queue_trainer_version", "Trainer policy version known to the queue")
        self.wal_bytes = gauge("tauflow_queue_wal_bytes", "Size of the write-ahead log")
        self.max_staleness = gauge("tauflow_queue_max_staleness_steps", "The staleness bound tau (-1: unbounded)")
        self.groups_per_step = gauge("tauflow_queue_groups_per_step", "Groups the trainer consumes per step")
        self.pacing_limit = gauge(
            "tauflow_queue_pacing_limit_groups",
            "The pacing rule's bound on accepted + reserved groups: (trainer_version + tau + 1) x groups_per_step "
            "(the group capacity when tau is unbounded)",
        )
        self.capacity_groups = gauge("tauflow_queue_capacity_groups", "Groups the queue may hold (reserved included)")
        self.capacity_bytes = gauge("tauflow_queue_capacity_bytes", "Bytes the queue may hold")
        self.waiting_calls = Gauge(
            "tauflow_queue_waiting_calls",
            "Long polls waiting in line now, by method (Get: the trainer's; Reserve: producers waiting for room)",
            ["method"],
            registry=registry,
        )
        self.put_groups = Counter("tauflow_queue_put_groups", "Groups newly accepted by Put", registry=registry)
        self.put_bytes = Counter("tauflow_queue_put_bytes", "Bytes of groups newly accepted by Put", registry=registry)
        self.put_media_parts = Counter(
            "tauflow_queue_put_media_parts",
            "Media parts of the prompts of groups newly accepted by Put, by modality (image, audio, video)",
            ["modality"],
            registry=registry,
        )
        self.put_media_bytes = Counter(
            "tauflow_queue_put_media_bytes",
            "Bytes of media carried in groups newly accepted by Put (URIs count 0), by modality",
            ["modality"],
            registry=registry,
        )
        self.delivered_groups = Counter(
            "tauflow_queue_delivered_groups", "Groups delivered by Get (redeliveries included)", registry=registry
        )
        self.acked_groups = Counter("tauflow_queue_acked_groups", "Groups acknowledged", registry=registry)
        self.evicted = Counter(
            "tauflow_queue_evicted", "Groups evicted without delivery, by reason", ["reason"], registry=registry
        )
        self.lease_expired = Counter(
            "tauflow_queue_lease_expired", "Leases that expired and went back to the queue", registry=registry
        )
        self.rejected = Counter(
            "tauflow_queue_rejected_requests",
            "Requests refused, by method and status code",
            ["method", "code"],
            registry=registry,
        )
        # The external port, per client (a name from the tokens file; "unknown" for a missing or unknown token).
        self.external_put_groups = Counter(
            "tauflow_queue_external_put_groups",
            "Groups newly accepted from each client of the external port",
            ["client"],
            registry=registry,
        )
        self.external_rejected = Counter(
            "tauflow_queue_external_rejected_requests",
            "Requests refused on the external port, by client, method and status code",
            ["client", "method", "code"],
            registry=registry,
        )
        self.delivered_staleness = Histogram(
            "tauflow_queue_delivered_staleness_steps",
            "Staleness of delivered groups (consumer version minus oldest behaviour version)",
            buckets=STALENESS_BUCKETS,
            registry=registry,
        )
        self.rpc_duration = Histogram(
            "tauflow_queue_rpc_duration_seconds",
            "Server-side latency of each RPC, long-poll waits included",
            ["method"],
            registry=registry,
        )

    def watch(self, stats: Callable[[], Stats]) -> None:
        """The gauges read ``stats()`` when scraped (not on every change: a put is too frequent for that)."""

        def read(field: str) -> Callable[[], float]:
            return lambda: getattr(stats(), field)

        for field in (
            "depth_groups", "depth_bytes", "leased_groups", "reserved_groups", "accepted_groups", "trainer_version",
            "wal_bytes", "max_staleness", "groups_per_step", "capacity_groups", "capacity_bytes",
        ):  # fmt: skip
            getattr(self, field).set_function(read(field))

        def limit() -> float:
            now = stats()
            bound = pacing_limit(now.trainer_version, now.max_staleness, now.groups_per_step)
            return now.capacity_groups if bound is None else bound

        self.pacing_limit.set_function(limit)
