"""The sidecar's per-broadcast metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tauflow.weights.metrics import WeightsMetrics


def test_each_broadcast_counts_its_outcome_and_duration() -> None:
    registry = CollectorRegistry()
    metrics = WeightsMetrics(registry)
    metrics.broadcast_done(True, 0.4)
    metrics.broadcast_done(False, 2.0)
    metrics.broadcast_done(True, 0.6)
    v = registry.get_sample_value
    assert v("tauflow_weights_broadcasts_total", {"outcome": "ok"}) == 2
    assert v("tauflow_weights_broadcasts_total", {"outcome": "failed"}) == 1
    assert v("tauflow_weights_broadcast_duration_seconds_count") == 3
    assert abs(v("tauflow_weights_broadcast_duration_seconds_sum") - 3.0) < 1e-9
