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


def test_clear_drops_every_key_an_old_group_or_an_outsider_left() -> None:
    host = StoreHost("127.0.0.1", 0)
    host.store.set("tauflow-weights-e1-0123/tauflow/joined/1", "1")
    planted = dist.TCPStore("127.0.0.1", host.port, is_master=False, wait_for_workers=False)
    planted.set("tauflow-weights-e2/cpu//0/1", b"\x00" * 1024)  # an outsider's rendezvous key for later
    assert host.clear() == 2
    assert host.store.list_keys() == [] and host.clear() == 0


def _listening() -> set[tuple[str, int]]:
    """This process's listening TCP sockets, (address, port), from /proc (no tool needed)."""
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/self/net/{table}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # LISTEN
                    address, port = local.split(":")
                    found.add(
                        (address if width == 32 else socket.inet_ntoa(bytes.fromhex(address)[::-1]), int(port, 16))
                    )
    return found


def test_a_gloo_group_on_a_loopback_store_listens_on_loopback_only() -> None:
    # gloo listened where the hostname resolves (a LAN address for a run all on loopback), and takes no token
    from tauflow.weightsync.group import GroupSpec, WeightGroup

    host = StoreHost("127.0.0.1", 0)
    before = _listening()
    group = WeightGroup(host.store, GroupSpec("127.0.0.1", host.port, "alone-e1", 1, 0, "gloo", 1, 10.0))
    try:
        opened = _listening() - before
        assert opened and all(address == "127.0.0.1" for address, _ in opened), opened
    finally:
        group.destroy()
