"""The sidecar's refusals, by kind; the servicer maps each kind to its status code."""

from __future__ import annotations


class WeightsError(Exception):
    pass


class InvalidRequest(WeightsError):
    pass


class NotFound(WeightsError):
    pass


class FailedPrecondition(WeightsError):
    pass


class DataLoss(WeightsError):
    pass


class ResourceExhausted(WeightsError):
    pass


class HandoffDeadline(WeightsError):
    pass
