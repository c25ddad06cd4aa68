"""tauflow queue service: the durable, staleness-bounded bus from rollout to trainer."""

__version__ = "0.1.0"
