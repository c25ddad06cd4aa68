"""The domain's refusals; the servicer maps each to one gRPC status code."""

from __future__ import annotations


class RewardError(Exception):
    """Base of the errors a Score or ListRewardFunctions call is refused with."""


class InvalidRequest(RewardError):
    """Maps to INVALID_ARGUMENT. ``field`` is the request field at fault, as a path with indices
    (``groups[3].samples[0].completion_text``, ``config.pattern``); the message starts with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(RewardError):
    """Maps to NOT_FOUND: no reward function of that name."""


class Exhausted(RewardError):
    """Maps to RESOURCE_EXHAUSTED: a per-request or concurrency limit."""


class DeadlineExceeded(RewardError):
    """Maps to DEADLINE_EXCEEDED: the call's deadline passed before every sample was scored."""


def cut(text: str, limit: int = 64) -> str:
    """A client-supplied name as a message or a field path quotes it: cut to ``limit`` characters, so that a
    refusal never echoes a megabyte back (or into a log)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown(text: str, limit: int = 64) -> str:
    """``cut``, quoted."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"
