"""The one retry policy of tauflow's clients (hand-written; the rest of this package is generated).

A method's retry class is in its contract (``option idempotency_level``): only ``IDEMPOTENT`` and
``NO_SIDE_EFFECTS`` methods may be sent again, and only on ``RETRY_STATUS_CODES`` (the server was not
reached, is restarting, or was stopping as the call came). The services' channel factory (``tauflow.core.channel``, where the attempts and backoff are
configurable) and the outside client (``tauflow.client``, which cannot depend on tauflow-core) both build
their gRPC service config here, so the two can never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.descriptor_pb2 import MethodOptions

RETRYABLE_LEVELS = (MethodOptions.IDEMPOTENT, MethodOptions.NO_SIDE_EFFECTS)
# The answers of a server that was not there for the call: not reached or restarting (UNAVAILABLE), or
# stopping as it came (CANCELLED: grpcio's asyncio server cancels a call that arrives while it shuts down,
# before any handler has run; seen in the chaos run at a queue's drain). A client's own cancellation is not
# an answer from the server, and gRPC never retries it.
RETRY_STATUS_CODES = ("UNAVAILABLE", "CANCELLED")


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 5  # gRPC caps attempts at 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    status_codes: tuple[str, ...] = field(default=RETRY_STATUS_CODES)


def is_retryable(method: MethodDescriptor) -> bool:
    """Whether the contract marks ``method`` safe to send again."""
    return method.GetOptions().idempotency_level in RETRYABLE_LEVELS


def retryable_methods(services: Sequence[ServiceDescriptor]) -> list[tuple[str, str]]:
    """(service, method) of every method of ``services`` that the contracts mark safe to send again."""
    return [(s.full_name, m.name) for s in services for m in s.methods if is_retryable(m)]


def service_config_json(services: Sequence[ServiceDescriptor], policy: RetryPolicy = RetryPolicy()) -> str:
    """The ``grpc.service_config`` channel option: ``policy`` for the retryable methods, none for the rest."""
    names = [{"service": service, "method": method} for service, method in retryable_methods(services)]
    retry = {
        "maxAttempts": policy.max_attempts,
        "initialBackoff": f"{policy.initial_backoff_s}s",
        "maxBackoff": f"{policy.max_backoff_s}s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": list(policy.status_codes),
    }
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": retry}] if names else []})
