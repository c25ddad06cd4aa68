"""The trainer's Prometheus metrics (``tauflow_trainer_*``, units in the names)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from tauflow.trainer.backend import StepResult


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.policy_version = Gauge("tauflow_trainer_policy_version", "Committed optimizer steps", registry=registry)
        self.step_duration = Histogram(
            "tauflow_trainer_step_duration_seconds", "Wall time of a step, batch delivery to commit", registry=registry
        )
        self.trained_tokens = Counter("tauflow_trainer_trained_tokens", "Completion tokens trained on", registry=registry)
        self.loss = Gauge("tauflow_trainer_loss", "Loss of the last step", registry=registry)
        self.reward = Gauge("tauflow_trainer_reward_mean", "Mean reward of the last batch", registry=registry)
        self.grad_norm = Gauge("tauflow_trainer_grad_norm", "Gradient norm of the last step", registry=registry)
        self.staleness = Histogram(
            "tauflow_trainer_batch_max_staleness_steps", "Largest staleness in each batch",
            buckets=(0, 1, 2, 3, 4, 8, 16, float("inf")), registry=registry,
        )

    def observe(self, r: StepResult) -> None:
        self.policy_version.set(r.policy_version)
        self.step_duration.observe(r.duration_s)
        self.trained_tokens.inc(r.trained_tokens)
        self.loss.set(r.loss)
        self.reward.set(r.mean_reward)
        self.grad_norm.set(r.metrics.get("grad_norm", 0.0))
        self.staleness.observe(r.max_staleness)
