"""Small network helpers every role may use (no gRPC here: domain modules import it too)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` now (whoever asked binds it right after: a gang's rendezvous,
    a server started for an engine)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
