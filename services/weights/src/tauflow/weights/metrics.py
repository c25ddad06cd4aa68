"""The sidecar's Prometheus metrics (``tauflow_weights_*``, units in the names)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

HANDOFF_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class WeightsMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        r = registry
        self.latest_version = Gauge("tauflow_weights_latest_policy_version", "Newest accepted version", registry=r)
        self.confirmed_version = Gauge(
            "tauflow_weights_confirmed_policy_version", "Newest version every active member confirmed", registry=r
        )
        self.epoch = Gauge("tauflow_weights_membership_epoch", "Current membership epoch", registry=r)
        self.members = Gauge("tauflow_weights_members", "Members by state", ["state"], registry=r)
        self.retained_bytes = Gauge(
            "tauflow_weights_retained_bytes", "Bytes of versions held (newest accepted + being broadcast)", registry=r
        )
        self.handoff_seconds = Histogram(
            "tauflow_weights_handoff_duration_seconds",
            "Publish: time to copy a staged version",
            buckets=HANDOFF_BUCKETS,
            registry=r,
        )
        self.handoff_failures = Counter(
            "tauflow_weights_handoff_failures", "Publish calls that copied nothing", registry=r
        )
        self.published_bytes = Counter("tauflow_weights_published_bytes", "Bytes of versions accepted", registry=r)
        self.superseded_versions = Counter(
            "tauflow_weights_superseded_versions",
            "Versions replaced by a newer one before their broadcast",
            registry=r,
        )
        self.broadcast_bytes = Counter(
            "tauflow_weights_broadcast_bytes",
            "Bucket bytes broadcast (once per bucket, whatever the member count)",
            registry=r,
        )
        self.versions_broadcast = Counter(
            "tauflow_weights_versions_broadcast", "Versions confirmed by every member of their group", registry=r
        )
        self.bandwidth = Gauge(
            "tauflow_weights_broadcast_bandwidth_bytes_per_second",
            "Bytes per second of the last transfer phase",
            registry=r,
        )
        self.phase_seconds = Histogram(
            "tauflow_weights_phase_duration_seconds",
            "Duration of each successful phase",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.phase_failures = Counter(
            "tauflow_weights_phase_failures", "Failures (missed deadlines included) by phase", ["phase"], registry=r
        )
        self.load_seconds = Histogram(
            "tauflow_weights_member_load_duration_seconds",
            "Members' reported time from first bucket to swap",
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.broadcast_seconds = Histogram(
            "tauflow_weights_broadcast_duration_seconds",
            "One broadcast of a version, from its start (group rebuild included) to every member's confirmation "
            "or the failure",
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.broadcasts = Counter(
            "tauflow_weights_broadcasts",
            "Broadcasts of a version by outcome (ok, failed: retried with backoff)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("ok", "failed"):
            self.broadcasts.labels(outcome)
        self.rejected = Counter(
            "tauflow_weights_rejected_requests",
            "Requests refused, by method and status code",
            ["method", "code"],
            registry=r,
        )
        self.rpc_duration = Histogram(
            "tauflow_weights_rpc_duration_seconds", "Server-side latency of each RPC", ["method"], registry=r
        )

    @classmethod
    def null(cls) -> WeightsMetrics:
        """Metrics on a private registry (tests, embedding)."""
        return cls(CollectorRegistry())

    def broadcast_done(self, ok: bool, seconds: float) -> None:
        self.broadcasts.labels("ok" if ok else "failed").inc()
        self.broadcast_seconds.observe(seconds)

    def observe(
        self, *, latest: int | None, confirmed: int | None, epoch: int, members: dict[str, int], retained_bytes: int
    ) -> None:
        if latest is not None:
            self.latest_version.set(latest)
        if confirmed is not None:
            self.confirmed_version.set(confirmed)
        self.epoch.set(epoch)
        for state, n in members.items():
            self.members.labels(state).set(n)
        self.retained_bytes.set(retained_bytes)
