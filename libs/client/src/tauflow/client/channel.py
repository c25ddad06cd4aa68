"""The client's channels: message-size limits, keepalive, TLS, and gRPC retries for idempotent methods only.

tauflow's services build their channels with ``tauflow.core.channel``; this package cannot depend on
tauflow-core (pydantic, OpenTelemetry, Prometheus: more than an agent should install), so it builds its
channel here, with the one retry policy both share (``tauflow.api.retry``): the retry class of each method
is read from the contract (``idempotency_level``), and only ``IDEMPOTENT`` and ``NO_SIDE_EFFECTS`` methods
are retried, on ``UNAVAILABLE``. Deadlines are not set here: every call of the clients passes its own.

Sending and receiving have separate limits: a client whose answers are small (the queue's Stats, Reserve,
Put, ReleaseReservation) takes no answer over ``SMALL_ANSWER_BYTES``, so a hostile or broken server cannot
make it hold hundreds of MiB; a client whose answers grow with its request (Score, Generate) takes what
the services may send (``DEFAULT_MAX_MESSAGE_BYTES``). An answer over the limit fails the call with
RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from tauflow.api.retry import service_config_json

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # the services' default limit
SMALL_ANSWER_BYTES = 4 * 1024 * 1024  # the receive limit of a client whose answers are under a KiB


@dataclass(frozen=True)
class Tls:
    """How to verify a server that speaks TLS. ``root_certificates``: PEM of the certificate authority
    (None: the system's roots); ``server_name``: the name the certificate must carry when it is not the
    host of the address (e.g. an address by IP)."""

    root_certificates: bytes | None = None
    server_name: str = ""

    @classmethod
    def from_file(cls, ca_file: str | Path, server_name: str = "") -> Tls:
        return cls(Path(ca_file).read_bytes(), server_name)


def open_channel(
    address: str,
    services: Sequence[ServiceDescriptor],
    *,
    tls: Tls | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_receive_bytes: int | None = None,
) -> grpc.Channel:
    """A blocking channel to ``address`` for calling ``services``: it sends messages up to
    ``max_message_bytes`` and takes answers up to ``max_receive_bytes`` (None: ``max_message_bytes``)."""
    for name, value in (("max_message_bytes", max_message_bytes), ("max_receive_bytes", max_receive_bytes)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, not {value}")
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", max_message_bytes if max_receive_bytes is None else max_receive_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),  # tauflow's servers accept a ping every 10 s
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config_json(services)),
        ("grpc.max_reconnect_backoff_ms", 5_000),  # (gRPC's default grows to 120 s: blind long after a restart)
    ]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.root_certificates)
    return grpc.secure_channel(address, credentials, options=options)
