"""``python -m tauflow.core.healthcheck ADDRESS [--service NAME] [--timeout S]``: one gRPC health check.

Exits 0 when the service at ``ADDRESS`` answers SERVING and 1 otherwise (not serving yet, draining,
unknown service, unreachable, no answer within ``--timeout``), saying why on stderr. It is the
health check of the container images (Docker ``HEALTHCHECK``, compose ``healthcheck``), where no
``grpc_health_probe`` binary is installed; Kubernetes uses its native gRPC probes instead. Every
service reports NOT_SERVING until it is ready (``tauflow.core.server``), so SERVING means ready.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.core.channel import ChannelConfig, create_sync_channel

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]


def check(address: str, service: str = "", timeout_s: float = 5.0) -> tuple[bool, str]:
    """``(serving, message)`` for ``service`` ('' is the whole server) at ``address``."""
    what = f"service '{service}'" if service else "server"
    channel = create_sync_channel(address, [HEALTH], ChannelConfig(default_timeout_s=timeout_s))
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.NOT_FOUND:
            return False, f"{address}: no health status for {what} (NOT_FOUND: it is not served there)"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return False, f"{address}: no answer within {timeout_s:g}s (DEADLINE_EXCEEDED)"
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return False, f"{address}: serves no gRPC health service (UNIMPLEMENTED)"
        return False, f"{address}: health check failed ({code.name}: {e.details()})"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {what} is {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tauflow.core.healthcheck",
        description="gRPC health check: exit 0 when SERVING, 1 otherwise (the reason on stderr)",
    )
    parser.add_argument("address", help="host:port of the service, e.g. 127.0.0.1:50051")
    parser.add_argument("--service", default="", help="a service's full name; default '': the whole server")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    serving, message = check(args.address, args.service, args.timeout)
    print(message, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
