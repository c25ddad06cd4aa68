"""tauflow weight sidecar: takes policy versions from the trainer and broadcasts them to the rollout engines."""

__version__ = "0.1.0"
