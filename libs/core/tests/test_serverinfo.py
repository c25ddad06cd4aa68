"""ServerInfoService on the shared server bootstrap, and the compatibility rule a peer applies."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from tauflow.api.info.v1 import info_pb2
from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.api.revisions import REVISIONS
from tauflow.core.channel import create_channel
from tauflow.core.config import ServerConfig
from tauflow.core.server import GrpcServer, ServiceBinding
from tauflow.core.serverinfo import (
    SERVICE,
    IncompatibleService,
    Requirement,
    check_compatible,
    fetch_server_info,
)

QUEUE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]
PEER = "tauflow-controller 0.1.0"


async def test_every_server_reports_its_role_build_and_the_revision_of_each_contract_it_serves() -> None:
    binding = ServiceBinding(
        QUEUE, queue_pb2_grpc.QueueServiceServicer(), queue_pb2_grpc.add_QueueServiceServicer_to_server
    )
    server = GrpcServer([binding], ServerConfig(host="127.0.0.1", port=0), role="queue", version="0.1.0")
    port = await server.start()
    try:
        address = f"127.0.0.1:{port}"
        async with create_channel(address, [SERVICE]) as channel:
            info = await fetch_server_info(channel, address)
        assert (info.role, info.build_version) == ("queue", "0.1.0")
        contracts = {c.package: (c.revision, list(c.services)) for c in info.contracts}
        assert contracts == {
            "tauflow.api.queue.v1": (REVISIONS["tauflow.api.queue.v1"], ["tauflow.api.queue.v1.QueueService"]),
            "tauflow.api.info.v1": (REVISIONS["tauflow.api.info.v1"], ["tauflow.api.info.v1.ServerInfoService"]),
        }
        assert info.started_at.seconds > 0
        check_compatible(info, Requirement.of("queue", QUEUE), address=address, peer=PEER)  # no error
    finally:
        await server.drain()


def _info(role: str, build: str, **packages: int) -> info_pb2.GetServerInfoResponse:
    info = info_pb2.GetServerInfoResponse(role=role, build_version=build)
    for package, revision in packages.items():
        info.contracts.add(package=package.replace("_", "."), revision=revision)
    return info


@pytest.mark.parametrize(
    ("info", "need", "words"),
    [
        # the queue was upgraded to a v2-only build: the controller is the older side
        (
            _info("queue", "0.9.0", tauflow_api_queue_v2=1),
            {"tauflow.api.queue.v1": 1},
            ["0.9.0", PEER, "tauflow.api.queue.v2", "speaks tauflow.api.queue.v1", f"upgrade {PEER}"],
        ),
        # the controller speaks v2; the queue is still v1: upgrade the queue
        (
            _info("queue", "0.1.0", tauflow_api_queue_v1=3),
            {"tauflow.api.queue.v2": 1},
            ["0.1.0", PEER, "tauflow.api.queue.v1", "upgrade the queue service"],
        ),
        # same major, but a revision older than the one the peer needs
        (
            _info("queue", "0.1.0", tauflow_api_queue_v1=1),
            {"tauflow.api.queue.v1": 2},
            ["0.1.0", PEER, "revision 1", "needs revision 2", "upgrade the queue service"],
        ),
    ],
)
def test_an_incompatible_server_is_refused_with_both_versions_named(info, need, words) -> None:
    with pytest.raises(IncompatibleService) as e:
        check_compatible(info, Requirement("queue", need), address="10.0.0.7:50051", peer=PEER)
    message = str(e.value)
    assert "10.0.0.7:50051" in message
    for word in words:
        assert word in message, (word, message)


def test_a_newer_revision_and_another_role_are_told_apart() -> None:
    newer = _info("queue", "0.2.0", tauflow_api_queue_v1=5)
    check_compatible(newer, Requirement("queue", {"tauflow.api.queue.v1": 2}), address="a", peer=PEER)  # additive
    with pytest.raises(IncompatibleService, match="is not a queue service"):
        check_compatible(
            _info("reward", "0.1.0", tauflow_api_reward_v1=1),
            Requirement("queue", {"tauflow.api.queue.v1": 1}),
            address="a",
            peer=PEER,
        )


async def test_a_server_without_the_info_contract_is_refused() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    queue_pb2_grpc.add_QueueServiceServicer_to_server(queue_pb2_grpc.QueueServiceServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        async with create_channel(address, [SERVICE]) as channel:
            with pytest.raises(IncompatibleService, match="does not serve tauflow.api.info.v1"):
                await fetch_server_info(channel, address)
    finally:
        server.stop(0)
