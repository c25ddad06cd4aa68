"""Test support for tauflow's own suites and benchmarks: a real service process on loopback, and a
well-formed trajectory group. Every package's tests use these (so each suite runs alone, without the
repository's root tests), as do the cross-service tests under tests/."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class ServiceProcess:
    """One tauflow service in its own process (``python -m tauflow.<name>``), on a free port."""

    def __init__(
        self, name: str, workdir: Path, settings: dict[str, object], env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.env = env or {}
        self.workdir = workdir
        self.settings = {"server.port": 0, "metrics.port": 0, **settings}
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, object] = {}
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.info['grpc_port']}"

    def start(self, timeout_s: float = 30.0) -> ServiceProcess:
        self.starts += 1
        ready = self.workdir / f"{self.name}.ready.json"
        ready.unlink(missing_ok=True)
        args = [sys.executable, "-m", f"tauflow.{self.name}", "--ready-file", str(ready)]
        for key, value in self.settings.items():
            args += ["--set", f"{key}={value}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.workdir / f"{self.name}.{self.starts}.log", "wb") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout_s}s:\n{self.log_text()}")
            time.sleep(0.05)
        self.info = json.loads(ready.read_text())
        return self

    def log_text(self) -> str:
        return (self.workdir / f"{self.name}.{self.starts}.log").read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def queue_stub(address: str, timeout_s: float = 10.0) -> Any:
    """A blocking QueueService client made by the project's one channel factory."""
    from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
    from tauflow.core.channel import ChannelConfig, create_sync_channel

    channel = create_sync_channel(
        address,
        [queue_pb2.DESCRIPTOR.services_by_name["QueueService"]],
        ChannelConfig(default_timeout_s=timeout_s),
    )
    return queue_pb2_grpc.QueueServiceStub(channel)


def make_group(group_id: str, version: int = 0, payload_tokens: int = 8, samples: int = 2) -> Any:
    """A well-formed group whose samples were generated at ``version``."""
    from tauflow.api.common.v1 import common_pb2

    return common_pb2.Group(
        group_id=group_id,
        prompt_id=group_id,
        samples=[
            common_pb2.Sample(
                sample_id=str(i),
                prompt_token_ids=[1, 2, 3],
                completion_token_ids=list(range(4, 4 + payload_tokens)),
                behaviour_logprobs=[-0.5] * payload_tokens,
                token_versions=[version] * payload_tokens,
                reward=common_pb2.Reward(score=float(i % 2)),
            )
            for i in range(samples)
        ],
        trace_context=common_pb2.TraceContext(traceparent=f"00-{'ab' * 16}-{'cd' * 8}-01"),
    )


def self_signed_certificate(cert: Path, key: Path) -> tuple[Path, Path]:
    """Writes a self-signed certificate for localhost and 127.0.0.1 (it is its own CA) and its EC key, with
    ``openssl``; returns (cert, key)."""
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def raw_http2_request(
    port: int,
    path: bytes,
    extra: tuple[tuple[bytes, bytes], ...] = (),
    *,
    message: bytes | None = None,
    requests: int = 1,
    settings: bytes = b"",
    close_after_s: float | None = None,
) -> None:
    """HTTP/2 requests written by hand (HPACK literals): gRPC clients cannot send a path that is not UTF-8, nor
    open a connection with a zero flow-control window (``settings``) and leave ``close_after_s`` later without
    reading. ``message``: each request's gRPC message (none: headers only, the stream ended)."""
    import socket
    import struct
    import time
    from contextlib import suppress

    def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload

    def literal(name: bytes, value: bytes) -> bytes:
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", b"x"),
               (b"content-type", b"application/grpc"), (b"te", b"trailers"), *extra]  # fmt: skip
    block = b"".join(literal(n, v) for n, v in headers)
    streams = []
    for i in range(requests):
        sid = 2 * i + 1
        if message is None:
            streams.append(frame(1, 0x4 | 0x1, sid, block))
        else:
            body = b"\x00" + struct.pack(">I", len(message)) + message
            streams.append(frame(1, 0x4, sid, block) + frame(0, 0x1, sid, body))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, settings) + b"".join(streams))
        if close_after_s is not None:
            time.sleep(close_after_s)
            return
        with suppress(OSError):
            s.recv(65536)
