"""What a server is (``info.v1.ServerInfoService``), and whether a peer can talk to it.

The shared server bootstrap serves ``GetServerInfo`` on every service: its role, its build version and,
for each contract package it serves, the package's revision (``tauflow.api.revisions``) and services.
``check_compatible`` is the rule a peer applies (docs/contracts.md): the server must serve the package
the peer speaks, at its major version, at least at the revision the peer needs. A refusal names both
sides' versions, so an operator sees at once which of the two to upgrade.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from google.protobuf.descriptor import ServiceDescriptor

from tauflow.api.info.v1 import info_pb2, info_pb2_grpc
from tauflow.api.revisions import REVISIONS

SERVICE = info_pb2.DESCRIPTOR.services_by_name["ServerInfoService"]


class IncompatibleService(RuntimeError):
    """A peer's server cannot be talked to: another major version, an older revision, another role."""


def server_info(role: str, build_version: str, services: Sequence[ServiceDescriptor]) -> info_pb2.GetServerInfoResponse:
    """The answer of a server of ``role`` that serves ``services`` (its own contract; info itself too)."""
    info = info_pb2.GetServerInfoResponse(role=role, build_version=build_version)
    info.started_at.GetCurrentTime()
    by_package: dict[str, list[str]] = {}
    for s in [*services, SERVICE]:
        by_package.setdefault(s.file.package, []).append(s.full_name)
    for package, names in sorted(by_package.items()):
        info.contracts.add(package=package, revision=REVISIONS.get(package, 0), services=sorted(set(names)))
    return info


class ServerInfoServicer(info_pb2_grpc.ServerInfoServiceServicer):
    def __init__(self, info: info_pb2.GetServerInfoResponse) -> None:
        self.info = info

    async def GetServerInfo(self, request, context):
        return self.info


@dataclass(frozen=True)
class Requirement:
    """What a peer needs of a server: its role, and per contract package the lowest revision."""

    role: str
    packages: Mapping[str, int]

    @classmethod
    def of(cls, role: str, *services: ServiceDescriptor, revisions: Mapping[str, int] | None = None) -> Requirement:
        """Needs ``services``' packages at the revisions given (default: revision 1, all of v1)."""
        revisions = revisions or {}
        return cls(role, {s.file.package: revisions.get(s.file.package, 1) for s in services})


def _major(package: str) -> tuple[str, str]:
    """ "tauflow.api.queue.v1" -> ("tauflow.api.queue", "v1")."""
    base, _, major = package.rpartition(".")
    return base, major


def check_compatible(info: info_pb2.GetServerInfoResponse, need: Requirement, *, address: str, peer: str) -> None:
    """Raises IncompatibleService unless the server ``info`` describes (at ``address``) serves what
    ``need`` asks for; ``peer`` names the asking side and its build, e.g. "tauflow-controller 0.1.0"."""
    server = f"the {info.role or '?'} service at {address} (build {info.build_version or '?'})"
    if info.role != need.role:
        raise IncompatibleService(f"{server} is not a {need.role} service; {peer} expected one there")
    served = {c.package: c.revision for c in info.contracts}
    for package, revision in sorted(need.packages.items()):
        if package in served:
            if served[package] < revision:
                raise IncompatibleService(
                    f"{server} serves {package} revision {served[package]}; {peer} needs revision {revision} or "
                    f"newer: upgrade the {info.role} service"
                )
            continue
        base, major = _major(package)
        others = sorted(p for p in served if _major(p)[0] == base)
        if others:
            older = f"the {info.role} service" if all(_major(p)[1] < major for p in others) else peer
            raise IncompatibleService(
                f"{server} serves {', '.join(others)}; {peer} speaks {package}: upgrade {older}, or run a "
                "build that serves both majors"
            )
        raise IncompatibleService(f"{server} does not serve {package}, which {peer} speaks")


async def fetch_server_info(channel, address: str, timeout_s: float = 30.0) -> info_pb2.GetServerInfoResponse:
    """``GetServerInfo`` on ``channel`` (a channel from ``tauflow.core.channel`` to ``address``), waiting
    up to ``timeout_s`` for the server to accept connections (a peer just restarted may not yet). A server
    that answers UNIMPLEMENTED predates the info contract: IncompatibleService."""
    import grpc

    try:
        return await info_pb2_grpc.ServerInfoServiceStub(channel).GetServerInfo(
            info_pb2.GetServerInfoRequest(), timeout=timeout_s, wait_for_ready=True
        )
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise IncompatibleService(
                f"the server at {address} does not serve tauflow.api.info.v1 (a build older than the contract "
                "checks, or not a tauflow service)"
            ) from e
        raise
