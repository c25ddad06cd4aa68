"""The domain's refusals; the servicer maps each to one gRPC status code."""

from __future__ import annotations


class RewardError(Exception):
    """Base of the errors a Score or ListRewardFunctions call is refused with."""


class InvalidRequest(RewardError):
    """Maps to INVALID_ARGUMENT; the message names the field."""


class NotFound(RewardError):
    """Maps to NOT_FOUND: no reward function of that name."""


class Exhausted(RewardError):
    """Maps to RESOURCE_EXHAUSTED: a per-request or concurrency limit."""


class DeadlineExceeded(RewardError):
    """Maps to DEADLINE_EXCEEDED: the call's deadline passed before every sample was scored."""
