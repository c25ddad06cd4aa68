#!/usr/bin/env python
"""Soak: a real queue process under steady Put/Get/Ack with random faults, for minutes (hours elsewhere).

A producer puts ~16 KB groups, a consumer gets, acks (and now and then nacks, or abandons a lease so it
expires), a third client sends hostile requests (poison groups, 3 MiB request ids, bad durations,
abandoned long polls). On a seeded schedule the queue is SIGKILLed and restarted on the same log, or
SIGSTOPped for a few seconds. Every few seconds the script samples the queue's resident memory, open
file descriptors and log size. At the end it drains the queue and checks that every acknowledged group
was delivered and acked (nothing lost), and that memory, descriptors and the log stayed bounded: the
largest value of the last third of the run is at most ``--growth`` times the largest of the first
third (after a warm-up), with the log kept small by compaction.

    python bench/queue_soak.py --minutes 5 --seed 0

Prints a figures table and one ``SOAK_JSON {...}`` line; exits 1 when a bound or the accounting fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from google.protobuf.duration_pb2 import Duration

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.api.queue.v1 import queue_pb2_grpc
from tauflow.core.protobuf import length_delimited

HOST = "127.0.0.1"


class Queue:
    """The queue process, restartable on the same ports and log."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port = 0
        self.starts = 0

    def start(self) -> None:
        ready = self.workdir / "ready.json"
        ready.unlink(missing_ok=True)
        sets = {
            "server.port": self.port, "metrics.port": self.metrics_port, "max_staleness": -1,
            "wal.dir": str(self.workdir / "wal"), "wal.compact_min_bytes": 4 << 20, "default_lease_s": 3,
            "sweep_interval_s": 0.2, "max_wait_s": 5, "capacity_groups": 2000, "log.level": "WARNING",
        }
        args = [sys.executable, "-m", "tauflow.queue", "--ready-file", str(ready)]
        for key, value in sets.items():
            args += ["--set", f"{key}={value}"]
        self.starts += 1
        log = open(self.workdir / f"queue.{self.starts}.log", "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"queue did not start: {(self.workdir / f'queue.{self.starts}.log').read_text()}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.port, self.metrics_port = info["grpc_port"], info["metrics_port"]

    def sample(self) -> dict[str, float]:
        assert self.proc is not None
        pid = self.proc.pid
        rss_kb = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
        wal = sum(p.stat().st_size for p in (self.workdir / "wal").glob("queue.wal*"))
        return {"rss_mib": rss_kb / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")), "wal_mib": wal / 2**20}

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(30)


def group(gid: str, rng: random.Random) -> common_pb2.Group:
    n = 1000 + rng.randrange(1000)
    samples = [
        common_pb2.Sample(
            sample_id=str(i), prompt_token_ids=list(range(1, 40)), completion_token_ids=[7] * n,
            behaviour_logprobs=[-0.5] * n, reward=common_pb2.Reward(score=float(i % 2)),
        )
        for i in range(2)
    ]
    return common_pb2.Group(group_id=gid, prompt_id=gid, samples=samples)


def _stub(port: int) -> queue_pb2_grpc.QueueServiceStub:
    return queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(f"{HOST}:{port}"))


def _retrying(call, *args, stop: threading.Event, **kwargs):
    """Calls until the queue answers something other than UNAVAILABLE/DEADLINE_EXCEEDED (a restart)."""
    while not stop.is_set():
        try:
            return call(*args, timeout=5, **kwargs)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            time.sleep(0.2)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--growth", type=float, default=1.5, help="allowed last-third / first-third ratio")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="tauflow-soak-"))
    queue = Queue(workdir)
    queue.start()
    stop = threading.Event()
    acknowledged: set[str] = set()
    acked: set[str] = set()
    counts = {"puts": 0, "gets": 0, "acks": 0, "nacks": 0, "abandoned": 0, "hostile": 0, "hostile_unknown": 0,
              "kills": 0, "stops": 0, "duplicate_deliveries": 0}
    lock = threading.Lock()

    def produce() -> None:
        prng = random.Random(args.seed + 1)
        i = 0
        while not stop.is_set():
            gid = f"g{i:07d}"
            stub = _stub(queue.port)
            try:
                resp = _retrying(stub.Put, q.PutRequest(group=group(gid, prng)), stop=stop)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # full: the consumer is behind
                    time.sleep(0.2)
                    continue
                raise
            if resp is not None:
                with lock:
                    acknowledged.add(gid)
                    counts["puts"] += 1
                i += 1

    def consume() -> None:
        crng = random.Random(args.seed + 2)
        while not stop.is_set():
            stub = _stub(queue.port)
            try:
                resp = stub.Get(q.GetRequest(consumer_id="soak", max_groups=8, wait=Duration(seconds=1)), timeout=5)
            except grpc.RpcError:
                time.sleep(0.2)
                continue
            if not resp.groups:
                continue
            ids = [d.group.group_id for d in resp.groups]
            roll = crng.random()
            with lock:
                counts["gets"] += 1
                if roll < 0.05:
                    counts["abandoned"] += 1  # its lease expires and the groups come back
                    continue
            try:
                if roll < 0.10:
                    stub.Nack(q.NackRequest(lease_id=resp.lease.lease_id), timeout=5)
                    with lock:
                        counts["nacks"] += 1
                    continue
                # Retried until the queue answers: an Ack applied just before a kill loses only its answer,
                # and acking an acked lease is OK (Ack is idempotent).
                _retrying(stub.Ack, q.AckRequest(lease_id=resp.lease.lease_id), stop=threading.Event())
            except grpc.RpcError:
                continue  # (expired: FAILED_PRECONDITION, the groups come back)
            with lock:
                counts["acks"] += 1
                counts["duplicate_deliveries"] += len(acked.intersection(ids))
                acked.update(ids)

    def hostile() -> None:
        hrng = random.Random(args.seed + 3)
        poison = group("poison", hrng).SerializeToString() + b"\x1a\x05\x0a\x01\x39\x52\xff"
        while not stop.is_set():
            channel = grpc.insecure_channel(f"{HOST}:{queue.port}")
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            put = channel.unary_unary("/tauflow.api.queue.v1.QueueService/Put")
            calls = [
                (put, b"".join(length_delimited(1, poison)), 5),
                (stub.Reserve, q.ReserveRequest(request_id="r" * (3 << 20), n_groups=1), 5),
                (stub.Get, q.GetRequest(max_groups=1, lease_duration=Duration(seconds=10**11)), 5),
                (stub.Get, q.GetRequest(max_groups=10**6, min_groups=10**6, wait=Duration(seconds=30)),
                 0.3),  # an abandoned long poll
            ]
            try:
                call, request, timeout = hrng.choice(calls)
                call(request, timeout=timeout)
            except grpc.RpcError as e:
                with lock:
                    counts["hostile"] += 1
                    counts["hostile_unknown"] += e.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
            channel.close()
            time.sleep(0.05)

    threads = [threading.Thread(target=f, daemon=True) for f in (produce, consume, hostile)]
    for t in threads:
        t.start()
    samples: list[tuple[float, dict[str, float]]] = []
    started = time.monotonic()
    end = started + args.minutes * 60
    next_fault = started + rng.uniform(20, 40)
    while time.monotonic() < end:
        time.sleep(2.0)
        now = time.monotonic()
        try:
            samples.append((now - started, queue.sample()))
        except (OSError, ValueError):
            pass
        if now >= next_fault:
            if rng.random() < 0.5:
                queue.kill()
                queue.start()
                counts["kills"] += 1
            else:
                assert queue.proc is not None
                queue.proc.send_signal(signal.SIGSTOP)
                time.sleep(rng.uniform(2, 5))  # longer than the clients' deadlines and the lease
                queue.proc.send_signal(signal.SIGCONT)
                counts["stops"] += 1
            next_fault = time.monotonic() + rng.uniform(20, 40)
    stop.set()
    for t in threads:
        t.join(30)
    # Drain: every acknowledged group must come out.
    stub = _stub(queue.port)
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < 8:
        resp = stub.Get(q.GetRequest(consumer_id="drain", max_groups=64, wait=Duration(seconds=1)), timeout=10)
        if resp.groups:
            acked.update(d.group.group_id for d in resp.groups)
            stub.Ack(q.AckRequest(lease_id=resp.lease.lease_id), timeout=10)
            idle_since = time.monotonic()
    stats = stub.Stats(q.StatsRequest(), timeout=10)
    queue.stop()

    lost = sorted(acknowledged - acked)
    duration = samples[-1][0] if samples else 0.0
    warm = [s for t, s in samples if t >= duration * 0.1]
    third = max(len(warm) // 3, 1)
    figures: dict[str, object] = {"minutes": round(duration / 60, 2), "seed": args.seed, **counts,
                                  "acknowledged": len(acknowledged), "lost": len(lost),
                                  "evicted": dict(stats.evicted_groups), "queue_starts": queue.starts}
    ok = not lost and counts["hostile_unknown"] == 0
    for key in ("rss_mib", "fds", "wal_mib"):
        first = max(s[key] for s in warm[:third])
        last = max(s[key] for s in warm[-third:])
        figures[key] = {"first_third_max": round(first, 1), "last_third_max": round(last, 1),
                        "max": round(max(s[key] for s in warm), 1)}
        if last > args.growth * max(first, 1.0):
            ok = False
    print(f"{'figure':<22}value")
    for key, value in figures.items():
        print(f"{key:<22}{value}")
    print(("SOAK OK" if ok else "SOAK FAILED") + (f": lost {lost[:10]}" if lost else ""))
    print("SOAK_JSON " + json.dumps({**figures, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
