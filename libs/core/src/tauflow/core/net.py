"""Small network helpers every role may use (no gRPC here: domain modules import it too)."""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` now (whoever asked binds it right after: a gang's rendezvous,
    a server started for an engine)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, maybe in brackets) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
