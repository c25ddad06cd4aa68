"""The gRPC health check of a role (grpc.health.v1, ``tauflow.core.healthcheck``): the launchers'
HealthCheck port."""

from __future__ import annotations

from tauflow.core.healthcheck import check


def check_health(address: str, timeout_s: float) -> tuple[bool, str]:
    """``(serving, answer)`` of the whole server at ``address``, within ``timeout_s``."""
    return check(address, timeout_s=timeout_s)
