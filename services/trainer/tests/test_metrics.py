"""The trainer's metrics after a step: time by phase, learning signals, throughput counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tauflow.trainer.backend import StepResult
from tauflow.trainer.metrics import TrainerMetrics


def test_a_step_sets_phase_times_losses_and_counters() -> None:
    registry = CollectorRegistry()
    metrics = TrainerMetrics(registry)
    metrics.observe(
        StepResult(
            step=4,
            policy_version=5,
            committed=True,
            groups=8,
            samples=64,
            trained_tokens=300,
            max_staleness=1,
            mean_staleness=0.5,
            mean_reward=0.25,
            loss=-0.1,
            duration_s=0.2,
            metrics={
                "time/wait_s": 0.05,
                "time/train_s": 0.2,
                "time/publish_s": 0.01,
                "grad_norm": 1.5,
                "clip_fraction": 0.02,
                "kl_behaviour": 0.003,
                "lr": 1e-3,
                "skipped_zero_advantage_groups": 2.0,
            },
        )
    )
    v = registry.get_sample_value
    assert v("tauflow_trainer_policy_version") == 5
    assert v("tauflow_trainer_steps_total") == 1
    for phase, seconds in (("wait", 0.05), ("train", 0.2), ("publish", 0.01)):
        assert v("tauflow_trainer_step_phase_duration_seconds_sum", {"phase": phase}) == seconds
        assert v("tauflow_trainer_step_phase_duration_seconds_count", {"phase": phase}) == 1
    assert v("tauflow_trainer_trained_tokens_total") == 300
    assert v("tauflow_trainer_trained_groups_total") == 8
    assert v("tauflow_trainer_skipped_groups_total", {"reason": "zero_advantage"}) == 2
    assert v("tauflow_trainer_skipped_groups_total", {"reason": "stale"}) == 0
    assert v("tauflow_trainer_grad_norm") == 1.5
    assert v("tauflow_trainer_clipped_tokens_ratio") == 0.02
    assert v("tauflow_trainer_kl_behaviour_nats") == 0.003
    assert v("tauflow_trainer_learning_rate") == 1e-3
    assert v("tauflow_trainer_reward_mean") == 0.25
    assert v("tauflow_trainer_batch_mean_staleness_steps") == 0.5
