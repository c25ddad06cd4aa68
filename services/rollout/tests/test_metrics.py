"""The rollout's scrape-time metrics: tokens, versions and load read from the engine, servicer and producer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from tauflow.rollout.engine.base import EngineState, EngineStats
from tauflow.rollout.metrics import RolloutMetrics


class Engine:
    def __init__(self) -> None:
        self.tokens = 0

    def stats(self) -> EngineStats:
        return EngineStats(
            "e0",
            "fake",
            "m",
            EngineState.SERVING,
            3,
            2,
            5,
            1,
            False,
            0,
            counters={"tokens": self.tokens, "sequences": 4, "decode_steps": 9},
        )


class Servicer:
    in_flight = 1
    version_waiters = 2


class Producer:
    groups_in_flight = 6
    groups_produced = 11


def _value(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name)


def test_engine_counters_and_state_are_read_at_every_scrape() -> None:
    registry = CollectorRegistry()
    metrics = RolloutMetrics(registry)
    assert "tauflow_rollout_generated_tokens_total" not in generate_latest(registry).decode()  # no engine yet
    engine = Engine()
    metrics.watch(engine, Servicer(), Producer())
    engine.tokens = 120
    assert _value(registry, "tauflow_rollout_generated_tokens_total") == 120
    engine.tokens = 250
    assert _value(registry, "tauflow_rollout_generated_tokens_total") == 250
    assert _value(registry, "tauflow_rollout_generated_sequences_total") == 4
    assert _value(registry, "tauflow_rollout_decode_steps_total") == 9
    assert _value(registry, "tauflow_rollout_engine_policy_version") == 3
    assert _value(registry, "tauflow_rollout_engine_inflight_requests") == 2
    assert _value(registry, "tauflow_rollout_engine_state") == int(EngineState.SERVING)
    assert _value(registry, "tauflow_rollout_inflight_requests") == 3  # waiting for a version too
    assert _value(registry, "tauflow_rollout_inflight_groups") == 6
    assert _value(registry, "tauflow_rollout_produced_groups_total") == 11
    # A counter the engine does not keep is absent rather than a made-up zero.
    assert _value(registry, "tauflow_rollout_weight_swaps_total") is None
