"""The sidecar's TCPStore listens where its host says: torch's master store bound every interface whatever its
host was, so a store configured for loopback (store.host 127.0.0.1, the default) was open to the network."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from tauflow.weightsync.group import StoreHost


def _other_address() -> str | None:
    """An address of this machine that is not loopback (None where it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # (no packet is sent: it only picks the outgoing interface)
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_a_loopback_store_is_not_reachable_on_other_addresses_and_serves_on_loopback() -> None:
    host = StoreHost("127.0.0.1", 0, timeout_s=10)
    client = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("key", "value")
    assert host.store.get("key") == b"value"
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no address but loopback")
    with pytest.raises(OSError):
        socket.create_connection((other, host.port), timeout=2).close()
