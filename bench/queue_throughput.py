#!/usr/bin/env python
"""Throughput of the tauflow queue against a plain gRPC streaming echo, over loopback.

For each payload size (4 KB, 64 KB, 1 MB) and in several rounds, alternating:

* echo   - a bidirectional-streaming echo server (bench/grpc_echo_server.py, its
           own process) gets N payloads on one stream and sends them back;
* queue  - a real ``tauflow-queue`` process (temp WAL dir, max_staleness=-1):
           a producer Puts N groups (a tauflow.api.common.v1.Group whose
           serialized size is the payload size) while a consumer Gets batches
           of up to 8 and Acks them; timed from the first Put to the last Ack.

The echo payload is the very serialized group the queue carries, so both move
the same bytes twice over loopback (client -> server -> client). The queue runs
with its default fsync policy (``always``); 1 MB also gets a row with
``wal.fsync=never`` so that the cost of fsync is visible.

Prints a table of medians and the ratio queue/echo per size, then one line
``BENCH_JSON {...}`` for machines. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.protobuf import length_delimited
from tauflow.core.streams import OrderedStream

HERE = Path(__file__).resolve().parent
ECHO_SERVER = HERE / "grpc_echo_server.py"
ECHO_METHOD = "/tauflow.bench.Echo/Echo"
QUEUE_SERVICE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]
HOST = "127.0.0.1"

KiB = 1024
MiB = 1024 * 1024
SIZES: dict[str, int] = {"4KB": 4 * KiB, "64KB": 64 * KiB, "1MB": 1 * MiB}
# Messages per measurement, per size, as (full run, --quick). The echo is ~10x
# faster, so it gets more messages to be timed as precisely as the queue.
QUEUE_COUNTS: dict[str, tuple[int, int]] = {"4KB": (1500, 400), "64KB": (800, 200), "1MB": (200, 60)}
ECHO_COUNTS: dict[str, tuple[int, int]] = {"4KB": (3000, 1000), "64KB": (2000, 600), "1MB": (500, 150)}
SAMPLES_PER_GROUP = 8
VOCAB = 151_936
TARGET_RATIO = 0.7  # the target: queue >= 0.7 x echo at 1 MB
TARGET_RATIOS = {"1MB": TARGET_RATIO, "64KB": 0.5}  # (issue #17: the streaming path, >= 0.5 at 64 KB)
TRANSPORTS = {
    "unary": ("unary",),
    "stream": ("stream",),
    "batch": ("batch",),
    "both": ("unary", "stream"),
    "all": ("unary", "stream", "batch"),
}
BATCH_NAME = {"unary": "queue", "stream": "queue-stream", "batch": "queue-batch"}


# -- subprocesses ----------------------------------------------------------------------


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the benchmark dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0

    def cpu_s(self) -> float:
        """User + system CPU seconds the server process used so far."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class Servers:
    """Starts server processes and makes sure every one of them is gone at exit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.servers: list[Server] = []
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def start(self, name: str, cmd: Sequence[str], ready_file: Path, timeout_s: float = 60.0) -> Server:
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                list(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,  # Ctrl-C reaches only the benchmark, which then stops them
                preexec_fn=_die_with_parent,
            )
        server = Server(name, proc, log_path)
        self.servers.append(server)
        deadline = time.monotonic() + timeout_s
        while not ready_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} before serving:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not serve within {timeout_s:.0f}s:\n{server.log_tail()}")
            time.sleep(0.05)
        server.port = int(json.loads(ready_file.read_text())["grpc_port"])
        return server

    def stop_all(self) -> None:
        for s in self.servers:
            if s.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    s.proc.terminate()
        deadline = time.monotonic() + 5.0
        for s in self.servers:
            try:
                s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    s.proc.kill()
                s.proc.wait()
        self.servers.clear()


def queue_command(wal_dir: Path, ready_file: Path, fsync: str, extra_sets: Sequence[str]) -> list[str]:
    exe = Path(sys.executable).with_name("tauflow-queue")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tauflow.queue"]
    sets = [
        f"server.host={HOST}",
        "server.port=0",
        "server.drain_grace_s=1",
        f"metrics.host={HOST}",
        "metrics.port=0",
        f"wal.dir={wal_dir}",
        f"wal.fsync={fsync}",
        "max_staleness=-1",
        *extra_sets,
    ]
    for s in sets:
        cmd += ["--set", s]
    return cmd + ["--ready-file", str(ready_file)]


# -- payloads ---------------------------------------------------------------------------


def make_group(target_bytes: int, rng: random.Random) -> common_pb2.Group:
    """A group of SAMPLES_PER_GROUP samples whose serialized size is within 1% of ``target_bytes``.

    Token ids are random over a real vocabulary (so varints are 1-3 bytes as in
    practice) and every completion token has a behaviour log-probability.
    """

    def build(completion: int) -> common_pb2.Group:
        prompt = [rng.randrange(VOCAB) for _ in range(max(1, completion // 4))]
        g = common_pb2.Group(group_id="bench-00000000-000000", prompt_id="p", producer_id="bench")
        for i in range(SAMPLES_PER_GROUP):
            s = g.samples.add(sample_id=str(i), behaviour_version=0, finish_reason=common_pb2.FINISH_REASON_STOP)
            s.prompt_token_ids.extend(prompt)
            s.completion_token_ids.extend(rng.randrange(VOCAB) for _ in range(completion))
            s.behaviour_logprobs.extend(-rng.random() * 5.0 for _ in range(completion))
            s.reward.score = rng.random()
        return g

    completion = max(1, target_bytes // (SAMPLES_PER_GROUP * 8))
    group = build(completion)
    for _ in range(6):
        size = group.ByteSize()
        if abs(size - target_bytes) <= target_bytes * 0.01:
            break
        completion = max(1, round(completion * target_bytes / size))
        group = build(completion)
    return group


# -- measurements -------------------------------------------------------------------------


@dataclass
class Result:
    variant: str
    size: str
    round: int
    n: int
    payload_bytes: int
    elapsed_s: float
    server_cpu_s: float
    client_cpu_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def msgs_per_s(self) -> float:
        return self.n / self.elapsed_s

    @property
    def mb_per_s(self) -> float:
        return self.n * self.payload_bytes / self.elapsed_s / 1e6


async def run_echo(channel: grpc.aio.Channel, payload: bytes, n: int) -> tuple[float, dict[str, Any]]:
    """Sends ``n`` payloads on one bidi stream while reading them back; returns seconds."""
    call = channel.stream_stream(ECHO_METHOD)  # no (de)serializers: raw bytes

    async def requests():
        for _ in range(n):
            yield payload

    t0 = time.perf_counter()
    got = nbytes = 0
    async for reply in call(requests(), timeout=300):
        got += 1
        nbytes += len(reply)
    elapsed = time.perf_counter() - t0
    if got != n or nbytes != n * len(payload):
        raise RuntimeError(f"echo returned {got} messages / {nbytes} bytes, expected {n} / {n * len(payload)}")
    return elapsed, {}


@functools.cache
def _shadow_messages() -> dict[str, type]:
    """Wire-compatible views of the queue messages with the group as opaque bytes.

    Used by ``--client raw`` so that the benchmark's client never encodes or
    decodes a 1 MB group (like the echo client): what remains is the service's cost.
    """
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="tauflow_bench_shadow.proto", package="tauflow.bench", syntax="proto3")

    def msg(name: str, *fields: tuple[str, int, int, str, int]) -> None:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, type_name, label in fields:
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = type_name

    one, many = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    msg("GroupId", ("group_id", 1, f.TYPE_STRING, "", one))
    msg("LeaseId", ("lease_id", 1, f.TYPE_STRING, "", one))
    msg("DeliveredGroupRaw", ("group", 1, f.TYPE_BYTES, "", one))
    msg(
        "GetResponseRaw",
        ("lease", 1, f.TYPE_MESSAGE, ".tauflow.bench.LeaseId", one),
        ("groups", 2, f.TYPE_MESSAGE, ".tauflow.bench.DeliveredGroupRaw", many),
    )
    msg("DeliverResponseRaw", ("batch", 1, f.TYPE_MESSAGE, ".tauflow.bench.GetResponseRaw", one))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {
        m.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tauflow.bench.{m.name}"))
        for m in fdp.message_type
    }


def _length_delimited(field_number: int, data: bytes) -> bytes:
    return b"".join(length_delimited(field_number, data))


@dataclass
class QueueClient:
    """What the producer and the consumer call: generated stubs (``proto``) or raw bytes (``raw``); unary
    Put and Get, or (``streaming``) PutStream and Deliver through tauflow.core.streams.OrderedStream, as
    the rollout and the trainer call them."""

    channel: grpc.aio.Channel
    mode: str
    streaming: bool = False
    batch_groups: int = 0  # > 0: PutBatch of this many groups a call (and Deliver), as the rollout puts

    def __post_init__(self) -> None:
        self.stub = queue_pb2_grpc.QueueServiceStub(self.channel)
        base = "/tauflow.api.queue.v1.QueueService/"
        raw = self.mode == "raw"
        if raw:
            self.shadow = _shadow_messages()
            self.put_raw = self.channel.unary_unary(
                base + "Put", request_serializer=None, response_deserializer=queue_pb2.PutResponse.FromString
            )
            self.get_raw = self.channel.unary_unary(
                base + "Get", request_serializer=queue_pb2.GetRequest.SerializeToString,
                response_deserializer=self.shadow["GetResponseRaw"].FromString,
            )
        put_stream = self.channel.stream_stream(
            base + "PutStream", request_serializer=None if raw else queue_pb2.PutStreamRequest.SerializeToString,
            response_deserializer=queue_pb2.PutStreamResponse.FromString,
        )
        deliver = self.channel.stream_stream(
            base + "Deliver", request_serializer=queue_pb2.DeliverRequest.SerializeToString,
            response_deserializer=(self.shadow["DeliverResponseRaw"] if raw else queue_pb2.DeliverResponse).FromString,
        )
        self.put_stream = OrderedStream(lambda lifetime_s: put_stream(timeout=lifetime_s))
        self.deliver = OrderedStream(lambda lifetime_s: deliver(timeout=lifetime_s))
        self.put_batch = self.channel.unary_unary(
            base + "PutBatch", request_serializer=None if raw else queue_pb2.PutBatchRequest.SerializeToString,
            response_deserializer=queue_pb2.PutBatchResponse.FromString,
        )


async def run_queue(
    client: QueueClient,
    template: common_pb2.Group,
    n: int,
    prefix: str,
    put_concurrency: int,
    get_max_groups: int,
    get_wait_s: float,
) -> tuple[float, dict[str, Any]]:
    """Puts ``n`` groups (``put_concurrency`` in flight) while a consumer Gets and Acks them."""
    stub = client.stub
    wait = Duration()
    wait.FromNanoseconds(int(get_wait_s * 1e9))
    get_request = queue_pb2.GetRequest(
        consumer_id="bench", max_groups=get_max_groups, min_groups=1, wait=wait, lease_duration=Duration(seconds=300)
    )
    raw = client.mode == "raw"
    if raw:
        body = common_pb2.Group()
        body.CopyFrom(template)
        body.ClearField("group_id")
        body_bytes = body.SerializeToString()  # a group_id field is prepended per put (field order is free)
    next_index = 0

    async def producer() -> None:
        nonlocal next_index
        req = queue_pb2.PutStreamRequest() if client.streaming else queue_pb2.PutRequest()
        req.group.CopyFrom(template)  # once per producer: a real producer serializes its group, no more
        while next_index < n:
            if client.batch_groups:
                await put_batch()
                continue
            gid = f"{prefix}-{next_index:06d}"
            next_index += 1
            if raw:
                group = _length_delimited(1, gid.encode()) + body_bytes
                message: Any = _length_delimited(1, group)
            else:
                req.group.group_id = gid  # safe: the previous call was serialized before it returned
                message = req
            if client.streaming:
                resp = await client.put_stream.request(message, 120)
                if resp.code:
                    raise RuntimeError(f"put {gid}: status {resp.code} {resp.message}")
            elif raw:
                resp = await client.put_raw(message, timeout=120)
            else:
                resp = await stub.Put(message, timeout=120)
            if resp.outcome != queue_pb2.PUT_OUTCOME_ACCEPTED:
                raise RuntimeError(f"put {gid}: outcome {resp.outcome}")

    async def put_batch() -> None:
        nonlocal next_index
        ids = [f"{prefix}-{i:06d}" for i in range(next_index, min(n, next_index + client.batch_groups))]
        next_index += len(ids)
        if raw:  # a PutBatchRequest is its PutRequests (field 1), each a group (field 1)
            message: Any = b"".join(
                _length_delimited(1, _length_delimited(1, _length_delimited(1, gid.encode()) + body_bytes))
                for gid in ids
            )
        else:
            message = queue_pb2.PutBatchRequest()
            for gid in ids:
                put = message.puts.add()
                put.group.CopyFrom(template)
                put.group.group_id = gid
        resp = await client.put_batch(message, timeout=120)
        for gid, result in zip(ids, resp.results, strict=True):
            if result.code or result.outcome != queue_pb2.PUT_OUTCOME_ACCEPTED:
                raise RuntimeError(f"put {gid}: status {result.code} {result.message} outcome {result.outcome}")

    gets = 0
    seen: set[str] = set()

    async def consumer() -> None:
        nonlocal gets
        group_id = client.shadow["GroupId"].FromString if raw else None
        deliver_request = queue_pb2.DeliverRequest(get=get_request)
        while len(seen) < n:
            if client.streaming:
                resp = (await client.deliver.request(deliver_request, 120)).batch
            elif raw:
                resp = await client.get_raw(get_request, timeout=120)
            else:
                resp = await stub.Get(get_request, timeout=120)
            if raw:
                ids = [group_id(d.group).group_id for d in resp.groups]
            else:
                ids = [d.group.group_id for d in resp.groups]
            gets += 1
            if not ids:
                continue
            seen.update(ids)
            await stub.Ack(queue_pb2.AckRequest(lease_id=resp.lease.lease_id), timeout=120)

    t0 = time.perf_counter()
    await asyncio.gather(consumer(), *(producer() for _ in range(put_concurrency)))
    elapsed = time.perf_counter() - t0
    if len(seen) != n or not all(g.startswith(prefix) for g in seen):
        raise RuntimeError(f"consumer saw {len(seen)} distinct groups of this run, expected {n}")
    return elapsed, {"gets": gets, "groups_per_get": round(n / max(gets, 1), 2)}


async def measure(
    variant: str, size: str, rnd: int, server: Server, n: int, payload_bytes: int, fn: Callable[[], Any]
) -> Result:
    cpu0, cli0 = server.cpu_s(), time.process_time()
    elapsed, extra = await fn()
    return Result(
        variant, size, rnd, n, payload_bytes, elapsed,
        server.cpu_s() - cpu0, time.process_time() - cli0, extra,
    )


# -- reporting ----------------------------------------------------------------------------


def _fs_type(path: Path) -> str:
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
    return kind


def summarize(results: list[Result], variants: list[tuple[str, str]]) -> list[dict[str, Any]]:
    rows = []
    for variant, size in variants:
        rs = [r for r in results if r.variant == variant and r.size == size]
        if not rs:
            continue
        rows.append(
            {
                "variant": variant,
                "size": size,
                "payload_bytes": rs[0].payload_bytes,
                "n": rs[0].n,
                "rounds": len(rs),
                "msgs_per_s": statistics.median(r.msgs_per_s for r in rs),
                "mb_per_s": statistics.median(r.mb_per_s for r in rs),
                "mb_per_s_min": min(r.mb_per_s for r in rs),
                "mb_per_s_max": max(r.mb_per_s for r in rs),
                "server_cpu_ms_per_msg": statistics.median(1e3 * r.server_cpu_s / r.n for r in rs),
                "client_cpu_ms_per_msg": statistics.median(1e3 * r.client_cpu_s / r.n for r in rs),
                **({"groups_per_get": statistics.median(r.extra["groups_per_get"] for r in rs)}
                   if "groups_per_get" in rs[0].extra else {}),
            }
        )
    echo = {r["size"]: r["mb_per_s"] for r in rows if r["variant"] == "echo"}
    for r in rows:
        r["ratio_vs_echo"] = r["mb_per_s"] / echo[r["size"]] if r["size"] in echo else None
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'size':>5}  {'variant':<27} {'msgs/s':>9} {'MB/s':>8} {'(min-max)':>15} "
        f"{'ratio':>6} {'srv ms/msg':>10} {'cli ms/msg':>10} {'grp/Get':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        spread = f"{r['mb_per_s_min']:.0f}-{r['mb_per_s_max']:.0f}"
        ratio = "" if r["variant"] == "echo" or r["ratio_vs_echo"] is None else f"{r['ratio_vs_echo']:.2f}"
        gpg = f"{r['groups_per_get']:.1f}" if "groups_per_get" in r else ""
        print(
            f"{r['size']:>5}  {r['variant']:<27} {r['msgs_per_s']:>9.0f} {r['mb_per_s']:>8.1f} {spread:>15} "
            f"{ratio:>6} {r['server_cpu_ms_per_msg']:>10.3f} {r['client_cpu_ms_per_msg']:>10.3f} {gpg:>7}"
        )


# -- main ---------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, servers: Servers, workdir: Path) -> dict[str, Any]:
    quick = 1 if args.quick else 0
    sizes = [s for s in SIZES if s in args.sizes]
    counts = {
        (v, s): max(1, int(table[s][quick] * args.scale))
        for v, table in (("echo", ECHO_COUNTS), ("queue", QUEUE_COUNTS))
        for s in sizes
    }
    rounds = args.rounds or (3 if args.quick else 5)
    rng = random.Random(1234)
    templates = {s: make_group(SIZES[s], rng) for s in sizes}
    payloads = {s: templates[s].SerializeToString() for s in sizes}

    # Start every server before this process creates any gRPC channel (fork safety).
    echo_ready = workdir / "echo.ready.json"
    echo = servers.start(
        "echo", [sys.executable, str(ECHO_SERVER), "--host", HOST, "--port", "0", "--ready-file", str(echo_ready)],
        echo_ready,
    )
    queue_variants: dict[str, tuple[str, list[str]]] = {}
    streaming: dict[str, bool] = {}
    for transport in TRANSPORTS[args.transport]:
        name = BATCH_NAME[transport]
        queue_variants[f"{name}(fsync={args.fsync})"] = (args.fsync, sizes)
        if args.fsync != "never" and "1MB" in sizes and not args.no_fsync_never_row:
            queue_variants[f"{name}(fsync=never)"] = ("never", ["1MB"])
    for variant in queue_variants:
        streaming[variant] = variant.startswith(("queue-stream", "queue-batch"))  # (a batch's consumer: Deliver)
    queues: dict[str, Server] = {}
    for i, (variant, (fsync, _)) in enumerate(queue_variants.items()):
        wal_dir = Path(tempfile.mkdtemp(prefix=f"wal{i}-", dir=args.wal_parent or workdir))
        ready = workdir / f"queue{i}.ready.json"
        queues[variant] = servers.start(f"queue{i}", queue_command(wal_dir, ready, fsync, args.queue_set), ready)

    echo_channel = create_channel(f"{HOST}:{echo.port}", [])
    clients: dict[str, QueueClient] = {}
    channels = [echo_channel]
    for variant, server in queues.items():
        ch = create_channel(f"{HOST}:{server.port}", [QUEUE_SERVICE])
        channels.append(ch)
        batch_groups = args.batch_groups if variant.startswith("queue-batch") else 0
        clients[variant] = QueueClient(ch, args.client, streaming[variant], batch_groups)

    run_id = f"{os.getpid():x}{int(time.time()):x}"
    seq = 0

    def queue_fn(variant: str, size: str, n: int) -> Callable[[], Any]:
        nonlocal seq
        seq += 1
        return lambda: run_queue(
            clients[variant], templates[size], n, f"{run_id}-{seq}", args.put_concurrency, args.get_max_groups,
            args.get_wait_ms / 1e3,
        )

    plan: list[tuple[str, str]] = []  # (variant, size) in table order
    for size in sizes:
        plan.append(("echo", size))
        plan += [(v, size) for v, (_, vs) in queue_variants.items() if size in vs]

    # Warm-up: connections, server code paths, the first WAL segment.
    for variant, size in plan:
        warm_n = max(4, counts["echo" if variant == "echo" else "queue", size] // 20)
        if variant == "echo":
            await run_echo(echo_channel, payloads[size], warm_n)
        else:
            await queue_fn(variant, size, warm_n)()

    results: list[Result] = []
    t_start = time.perf_counter()
    for rnd in range(rounds):
        for size in sizes:
            steps = [(v, s) for v, s in plan if s == size]
            if rnd % 2:  # alternate which side goes first, so drift does not favour one
                steps.reverse()
            for variant, _ in steps:
                n = counts["echo" if variant == "echo" else "queue", size]
                if variant == "echo":
                    r = await measure(variant, size, rnd, echo, n, len(payloads[size]),
                                      lambda: run_echo(echo_channel, payloads[size], n))  # noqa: B023
                else:
                    r = await measure(variant, size, rnd, queues[variant], n, len(payloads[size]),
                                      queue_fn(variant, size, n))
                results.append(r)
                if args.verbose:
                    print(
                        f"  round {rnd} {size:>5} {variant:<20} {r.mb_per_s:8.1f} MB/s {r.msgs_per_s:8.0f} msg/s "
                        f"({r.elapsed_s:.2f}s, srv cpu {r.server_cpu_s:.2f}s, cli cpu {r.client_cpu_s:.2f}s) {r.extra}",
                        flush=True,
                    )
    measured_s = time.perf_counter() - t_start

    stats = {}
    for variant, client in clients.items():
        st = await client.stub.Stats(queue_pb2.StatsRequest(), timeout=10)
        stats[variant] = {"acked_groups": st.acked_groups, "depth_groups": st.depth_groups,
                          "leased_groups": st.leased_groups, "wal_bytes": st.wal_bytes}
        if st.depth_groups or st.leased_groups:
            raise RuntimeError(f"{variant}: {st.depth_groups} groups left waiting, {st.leased_groups} leased")
    for client in clients.values():
        await client.put_stream.close()
        await client.deliver.close()
    for ch in channels:
        await ch.close()

    rows = summarize(results, plan)
    wal_parent = Path(args.wal_parent or workdir).resolve()
    return {
        "benchmark": "queue_throughput",
        "quick": bool(args.quick),
        "rounds": rounds,
        "counts": {f"{v}/{s}": n for (v, s), n in counts.items()},
        "client": args.client,
        "payload_bytes": {s: len(payloads[s]) for s in sizes},
        "fsync_policy": args.fsync,
        "fsync_rows": {v: f for v, (f, _) in queue_variants.items()},
        "wal_fs": f"{wal_parent} ({_fs_type(wal_parent)})",
        "transport": args.transport,
        "put_concurrency": args.put_concurrency,
        "batch_groups": args.batch_groups,
        "get_max_groups": args.get_max_groups,
        "get_wait_ms": args.get_wait_ms,
        "queue_set": args.queue_set,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "measured_s": round(measured_s, 1),
        "target_ratio_1mb": TARGET_RATIO,
        "rows": rows,
        "queue_stats": stats,
        "runs": [{**asdict(r), "mb_per_s": r.mb_per_s, "msgs_per_s": r.msgs_per_s} for r in results],
    }


def _batch_groups(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 1024:  # (the queue's MAX_PUT_BATCH)
        raise argparse.ArgumentTypeError(f"{n}: a PutBatch holds 1 to 1024 groups")
    return n


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~30 s: fewer groups per measurement and 3 rounds")
    p.add_argument("--rounds", type=int, default=0, help="rounds per measurement (default 5, --quick 3)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the groups per measurement")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--fsync", default="always", choices=["always", "interval", "never"],
                   help="WAL fsync policy of the main queue rows (default: the queue's default, always)")
    p.add_argument("--no-fsync-never-row", action="store_true", help="skip the extra 1 MB wal.fsync=never row")
    p.add_argument("--client", default="proto", choices=["proto", "raw"],
                   help="proto: generated stubs, groups encoded/decoded as messages (a real client); "
                   "raw: groups sent and received as opaque bytes, like the echo (isolates the service)")
    p.add_argument("--transport", default="all", choices=list(TRANSPORTS),
                   help="unary: Put and Get; stream: PutStream and Deliver (queue.v1 revision 4); batch: PutBatch "
                   "(revision 5) and Deliver, as the rollout and the trainer call them; both: unary and stream; "
                   "all (default)")
    p.add_argument("--batch-groups", type=_batch_groups, default=16,
                   help="groups per PutBatch call (default 16: a ticket of the embedded default)")
    p.add_argument("--put-concurrency", type=int, default=4, help="Puts in flight at once (default 4)")
    p.add_argument("--get-max-groups", type=int, default=8, help="max_groups of each Get (default 8)")
    p.add_argument("--get-wait-ms", type=float, default=50.0, help="long-poll wait of each Get (default 50)")
    p.add_argument("--queue-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra --set for the queue servers (repeatable), e.g. log.level=WARNING")
    p.add_argument("--wal-parent", help="directory to create the temp WAL dirs in (default: the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (server logs, WALs)")
    p.add_argument("--json-only", action="store_true", help="print only the BENCH_JSON line")
    p.add_argument("-v", "--verbose", action="store_true", help="print every measurement")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    workdir = Path(tempfile.mkdtemp(prefix="tauflow-bench-"))
    servers = Servers(workdir)
    t0 = time.perf_counter()
    try:
        report = asyncio.run(bench(args, servers, workdir))
    except KeyboardInterrupt:
        print("interrupted; stopping servers", file=sys.stderr)
        return 130
    except Exception:
        for s in servers.servers:
            print(f"--- {s.name} log tail ({s.log_path}) ---\n{s.log_tail()}", file=sys.stderr)
        raise
    finally:
        servers.stop_all()
        if args.keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    if not args.json_only:
        print(
            f"\ntauflow queue vs plain gRPC bidi echo, loopback {HOST}, {report['cpus']} CPUs, "
            f"{report['rounds']} rounds, medians; MB = 10^6 bytes, one direction"
        )
        print(
            f"queue: max_staleness=-1, {report['put_concurrency']} Puts (batch: PutBatches of "
            f"{report['batch_groups']} groups) in flight, Get max_groups="
            f"{report['get_max_groups']} wait={report['get_wait_ms']:g}ms then Ack, {report['client']} client; "
            f"fsync policy: {args.fsync} (+ never row at 1MB); WAL on {report['wal_fs']}"
        )
        print(f"messages per measurement: {report['counts']}")
        print(f"payload bytes (serialized group): {report['payload_bytes']}\n")
        print_table(report["rows"])
        print()
        for r in report["rows"]:
            target = TARGET_RATIOS.get(r["size"])
            if r["variant"].endswith(f"(fsync={args.fsync})") and target is not None:
                verdict = "MEETS" if r["ratio_vs_echo"] >= target else "MISSES"
                print(f"{r['size']} {r['variant']}/echo = {r['ratio_vs_echo']:.2f}: {verdict} the target of {target}")
        print(f"wall time {report['wall_s']}s (measured {report['measured_s']}s)\n")
    print("BENCH_JSON " + json.dumps(report, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
