"""A tiny gRPC bidirectional-streaming echo server: the baseline of bench/queue_throughput.py.

Raw bytes in, the same bytes out, on ``/tauflow.bench.Echo/Echo``; the service is
registered with a generic handler, so no proto is needed. It runs on the same
stack as the queue (grpc.aio, the same message-size limits), so the difference
between the two measures what the queue adds on top of plain gRPC.

    python bench/grpc_echo_server.py --ready-file F [--host 127.0.0.1] [--port 0]

Once serving it writes F as JSON: {"grpc_port": PORT, "pid": PID}. It stops on
SIGTERM/SIGINT, or when its parent process goes away.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

import grpc

SERVICE = "tauflow.bench.Echo"
METHOD = "Echo"
FULL_METHOD = f"/{SERVICE}/{METHOD}"
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # the same limit the tauflow servers and channels use


async def _echo(request_iterator, context):
    async for payload in request_iterator:
        yield payload


async def _serve(host: str, port: int, ready_file: str) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.stream_stream_rpc_method_handler(_echo)}  # no (de)serializers: raw bytes
    )
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    target = Path(ready_file)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"grpc_port": bound, "pid": os.getpid()}))
    os.replace(tmp, target)
    parent = os.getppid()

    async def orphan_watch() -> None:  # never outlive the benchmark, even if it was SIGKILLed
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        stop.set()

    watch = asyncio.create_task(orphan_watch())
    await stop.wait()
    watch.cancel()
    await server.stop(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args()
    asyncio.run(_serve(args.host, args.port, args.ready_file))


if __name__ == "__main__":
    main()
