"""The controller's check of a peer, against a real server on the shared bootstrap."""

from __future__ import annotations

import pytest

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.api.revisions import REVISIONS
from tauflow.controller.adapters.compat import IncompatiblePeer, check_peer
from tauflow.core.config import ServerConfig
from tauflow.core.server import GrpcServer, ServiceBinding


async def test_a_peer_is_checked_recorded_and_refused_when_it_is_not_what_the_role_needs(channels) -> None:
    binding = ServiceBinding(
        queue_pb2.DESCRIPTOR.services_by_name["QueueService"],
        queue_pb2_grpc.QueueServiceServicer(),
        queue_pb2_grpc.add_QueueServiceServicer_to_server,
    )
    server = GrpcServer([binding], ServerConfig(host="127.0.0.1", port=0), role="queue", version="0.1.0")
    address = f"127.0.0.1:{await server.start()}"
    records: dict = {}
    try:
        await check_peer("queue", address, records)
        await check_peer("queue", address, records)  # again, as after a restart
        assert records["queue"] == {
            "checks": 2,
            "build_version": "0.1.0",
            "contracts": {"tauflow.api.queue.v1": REVISIONS["tauflow.api.queue.v1"], "tauflow.api.info.v1": 1},
        }
        # a queue where the controller expects the reward service: refused, naming what answered
        with pytest.raises(IncompatiblePeer, match=r"the queue service at .* \(build 0.1.0\) is not a reward service"):
            await check_peer("reward", address, records)
        assert "reward" not in records
        assert len(channels) == 3 and all(channel.closed for channel in channels)  # one per check, refused or not
    finally:
        await server.drain()
