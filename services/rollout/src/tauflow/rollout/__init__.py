"""tauflow rollout service: generation engines that sample completions with behaviour log-probs."""

__version__ = "0.1.0"
