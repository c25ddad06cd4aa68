"""The trainer's Prometheus metrics (``tauflow_trainer_*``, units in the names), updated once per step."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from tauflow.trainer.backend import StepResult

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
# The parts of a step (the loop's time/<phase>_s step metrics): waiting for the batch, training on it, and
# handing the new weights to the sidecar.
PHASES = ("wait", "train", "publish")
# Step metrics exported as gauges: StepResult.metrics key -> (metric name, help).
STEP_GAUGES = {
    "grad_norm": ("tauflow_trainer_grad_norm", "Gradient norm of the last step (before clipping)"),
    "clip_fraction": (
        "tauflow_trainer_clipped_tokens_ratio",
        "Fraction of the last step's tokens whose importance ratio was clipped",
    ),
    "kl_behaviour": (
        "tauflow_trainer_kl_behaviour_nats",
        "KL estimate (k3) between the behaviour policy and the trained policy, last step",
    ),
    "kl_ref": ("tauflow_trainer_kl_ref_nats", "KL estimate to the reference policy, last step (0 without one)"),
    "entropy": ("tauflow_trainer_entropy_nats", "Mean token entropy of the policy on the last batch"),
    "is_truncated_fraction": (
        "tauflow_trainer_is_truncated_tokens_ratio",
        "Fraction of tokens whose importance weight was truncated, last step",
    ),
    "lr": ("tauflow_trainer_learning_rate", "Learning rate of the last step"),
}
SKIPPED = {
    "zero_advantage": "skipped_zero_advantage_groups",
    "duplicate": "skipped_duplicate_groups",
    "stale": "skipped_stale_groups",
    "invalid": "skipped_invalid_groups",
    "invalid_media": "skipped_invalid_media_groups",
}


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.policy_version = Gauge("tauflow_trainer_policy_version", "Committed optimizer steps", registry=registry)
        self.step_duration = Histogram(
            "tauflow_trainer_step_duration_seconds",
            "The backend's time of a step: forward, backward, optimizer",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.phase_duration = Histogram(
            "tauflow_trainer_step_phase_duration_seconds",
            "Where a step's time goes, by phase: wait (for the batch), train (forward, backward, optimizer), "
            "publish (hand-off of the new weights to the sidecar)",
            ["phase"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.steps = Counter(
            "tauflow_trainer_steps", "Committed optimizer steps since the process started", registry=registry
        )
        self.trained_tokens = Counter(
            "tauflow_trainer_trained_tokens", "Completion tokens trained on", registry=registry
        )
        self.trained_groups = Counter(
            "tauflow_trainer_trained_groups", "Groups consumed by committed steps", registry=registry
        )
        self.trained_samples = Counter(
            "tauflow_trainer_trained_samples", "Samples consumed by committed steps", registry=registry
        )
        self.skipped_groups = Counter(
            "tauflow_trainer_skipped_groups",
            "Groups delivered but not trained on, by reason (zero_advantage, duplicate, stale)",
            ["reason"],
            registry=registry,
        )
        self.loss = Gauge("tauflow_trainer_loss", "Loss of the last step", registry=registry)
        self.reward = Gauge("tauflow_trainer_reward_mean", "Mean reward of the last batch", registry=registry)
        self.step_gauges = {key: Gauge(name, doc, registry=registry) for key, (name, doc) in STEP_GAUGES.items()}
        self.grad_norm = self.step_gauges["grad_norm"]
        self.staleness = Histogram(
            "tauflow_trainer_batch_max_staleness_steps",
            "Largest staleness in each batch",
            buckets=(0, 1, 2, 3, 4, 8, 16, float("inf")),
            registry=registry,
        )
        self.mean_staleness = Gauge(
            "tauflow_trainer_batch_mean_staleness_steps", "Mean staleness of the last batch's groups", registry=registry
        )
        for phase in PHASES:
            self.phase_duration.labels(phase)
        for reason in SKIPPED:
            self.skipped_groups.labels(reason)

    def observe_skipped(self, r: StepResult) -> None:
        """The groups a step skipped, by reason: every step's, one that committed nothing too (a batch of
        groups trained before, too stale, or no step can train)."""
        for reason, key in SKIPPED.items():
            n = r.metrics.get(key)
            if n:
                self.skipped_groups.labels(reason).inc(n)

    def observe(self, r: StepResult) -> None:
        self.policy_version.set(r.policy_version)
        self.step_duration.observe(r.duration_s)
        for phase in PHASES:
            seconds = r.metrics.get(f"time/{phase}_s")
            if seconds is not None:
                self.phase_duration.labels(phase).observe(seconds)
        if r.committed:
            self.steps.inc()
        self.trained_tokens.inc(r.trained_tokens)
        self.trained_groups.inc(r.groups)
        self.trained_samples.inc(r.samples)
        self.observe_skipped(r)
        self.loss.set(r.loss)
        self.reward.set(r.mean_reward)
        for key, gauge in self.step_gauges.items():
            if key in r.metrics:
                gauge.set(r.metrics[key])
        self.staleness.observe(r.max_staleness)
        self.mean_staleness.set(r.mean_staleness)
