#!/usr/bin/env python
"""Broadcast bandwidth of the weight sidecar against a plain torch.distributed broadcast.

Both move the same state dict (default ~96 MB: a small transformer in bfloat16, with
its many small norm tensors) from one sender to N receivers (default 2) with gloo on
loopback, in alternating rounds:

* plain    - the benchmark process is rank 0 of a default torch.distributed group
             (init_process_group) with N receiver processes; it broadcasts every tensor
             of the state dict (one collective each, receive buffers preallocated) and
             then runs one tiny barrier so that the time ends when every receiver has
             its bytes. ``plain-flat`` is the same bytes as ONE preallocated buffer.
* sidecar  - a real ``tauflow-weights`` process and N FAKE rollout servers
             (services/weights/tests/fake_rollout.py --discard: the real receiver,
             keeping versions in memory only). The benchmark plays the trainer: it stages
             the state dict in /dev/shm, calls Publish, and the time runs from Publish's
             answer to the moment GetStatus shows every member confirmed the version:
             group set-up excluded (made once), per-bucket gRPC, the broadcast, the
             receivers' unpacking and checksum, and ConfirmVersion included.

* sidecar-ipc - (``--ipc``) the same with the sidecar's ``ipc`` backend, the colocated hand-off: the trainer
             stages into its own shared buffer (``DeviceStager``; CUDA IPC on a GPU, shared memory here),
             Publish passes the URI on, and every fake server copies the buffer and checks its copy
             (``SharedReader``), then confirms. No collective, no copy in the sidecar.

Also measured: the trainer's blocking time per publish (its own write into the
staging area + Publish, i.e. the sidecar's copy and checksum check).

Prints medians and ratios, then ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "services" / "weights" / "tests" / "fake_rollout.py"
MB = 1e6
WARMUP = 2  # rounds not counted: first touch of every buffer (the receivers double-buffer versions)


def model_state_dict(target_mb: float) -> dict[str, torch.Tensor]:
    """A transformer-shaped bfloat16 state dict of about ``target_mb`` MB (norms and biases included)."""
    hidden, inter, vocab = 1024, 2816, 8192
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(vocab, hidden)}
    layer = 0
    while sum(t.numel() * 2 for t in sd.values()) < (target_mb * MB - vocab * hidden * 2):
        p = f"model.layers.{layer}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = w(hidden, hidden)
        for n in ("q_proj", "k_proj", "v_proj"):
            sd[p + f"self_attn.{n}.bias"] = w(hidden)
        sd[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, inter)
        sd[p + "input_layernorm.weight"] = w(hidden)
        sd[p + "post_attention_layernorm.weight"] = w(hidden)
        layer += 1
    sd["model.norm.weight"] = w(hidden)
    sd["lm_head.weight"] = w(vocab, hidden)
    return sd


def _pdeathsig() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# -- plain torch.distributed ----------------------------------------------------------------


def plain_receiver(port: int, rank: int, world: int, mb: float, iterations: int) -> int:
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    sd = model_state_dict(mb)
    bufs = [torch.empty_like(t) for t in sd.values()]
    flat = torch.empty(sum(t.numel() * t.element_size() for t in sd.values()), dtype=torch.uint8)
    for _ in range(iterations):
        mode = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(mode, 0)
        dist.barrier()
        if mode.item() == 0:
            for b in bufs:
                dist.broadcast(b, 0)
        else:
            dist.broadcast(flat, 0)
        dist.barrier()
    dist.destroy_process_group()
    return 0


class Plain:
    def __init__(self, n: int, mb: float, iterations: int, sd: dict[str, torch.Tensor]) -> None:
        import socket

        import torch.distributed as dist

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        self.procs = [
            subprocess.Popen([sys.executable, __file__, "--role", "plain-recv", "--port", str(port), "--rank", str(r),
                              "--world", str(n + 1), "--mb", str(mb), "--iterations", str(iterations)],
                             env=_env(), preexec_fn=_pdeathsig)
            for r in range(1, n + 1)
        ]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=n + 1,
                                timeout=datetime.timedelta(seconds=600))
        self.dist = dist
        self.tensors = list(sd.values())
        self.flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in self.tensors])

    def run(self, flat: bool) -> float:
        dist = self.dist
        dist.broadcast(torch.tensor([1 if flat else 0], dtype=torch.int64), 0)
        dist.barrier()
        started = time.perf_counter()
        if flat:
            dist.broadcast(self.flat, 0)
        else:
            for t in self.tensors:
                dist.broadcast(t, 0)
        dist.barrier()
        return time.perf_counter() - started

    def close(self) -> None:
        self.dist.destroy_process_group()
        for p in self.procs:
            p.wait(60)


# -- the sidecar ----------------------------------------------------------------------------


class Sidecar:
    def __init__(self, n: int, workdir: Path, load_format: str, bucket_mb: float, backend: str = "gloo") -> None:
        sys.path.insert(0, str(ROOT))
        from tauflow.api.weights.v1 import weights_pb2, weights_pb2_grpc
        from tauflow.core.channel import ChannelConfig, create_sync_channel
        from tauflow.weightsync import Stager
        from tauflow.weightsync.ipc import DeviceStager

        self.pb = weights_pb2
        self.workdir = workdir = workdir / backend
        workdir.mkdir(parents=True, exist_ok=True)
        ready = workdir / "weights.ready.json"
        args = [sys.executable, "-m", "tauflow.weights", "--ready-file", str(ready),
                "--set", "server.port=0", "--set", "metrics.port=0", "--set", f"load_format={load_format}",
                "--set", f"backend={backend}", "--set", "log.level=WARNING"]
        self.procs = [subprocess.Popen(args, env=_env(), preexec_fn=_pdeathsig,
                                       stdout=open(workdir / "weights.log", "wb"), stderr=subprocess.STDOUT)]
        self.device_stager = DeviceStager("cpu", bucket_bytes=int(bucket_mb * 1024 * 1024)) if backend == "ipc" else None
        self.info = self._ready(ready, self.procs[0])
        self.address = f"127.0.0.1:{self.info['grpc_port']}"
        self.members = []
        for i in range(n):
            r = workdir / f"fake-{i}.ready.json"
            p = subprocess.Popen([sys.executable, str(FAKE), "--sidecar", self.address, "--member-id", f"fake-{i}",
                                  "--out", str(workdir), "--ready-file", str(r), "--discard"],
                                 env=_env(), preexec_fn=_pdeathsig,
                                 stdout=open(workdir / f"fake-{i}.log", "wb"), stderr=subprocess.STDOUT)
            self.procs.append(p)
            self._ready(r, p)
            self.members.append(f"fake-{i}")
        channel = create_sync_channel(self.address, [weights_pb2.DESCRIPTOR.services_by_name["WeightsService"]],
                                      ChannelConfig(default_timeout_s=120))
        self.stub = weights_pb2_grpc.WeightsServiceStub(channel)
        self.stager = Stager(f"shm://tauflow-bench-{uuid.uuid4().hex[:8]}", bucket_bytes=int(bucket_mb * 1024 * 1024))
        self.version = 0

    @staticmethod
    def _ready(path: Path, proc: subprocess.Popen) -> dict:
        deadline = time.monotonic() + 120
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{path.name}: process did not start (see logs in {path.parent})")
            time.sleep(0.05)
        return json.loads(path.read_text())

    def publish(self, sd: dict[str, torch.Tensor]) -> tuple[float, float, float]:
        """One version: (stage seconds, Publish seconds, seconds from Publish's answer to every confirm)."""
        from tauflow.weightsync.wire import manifest_to_proto

        self.version += 1
        t0 = time.perf_counter()
        if self.device_stager is not None:
            manifest, uri = self.device_stager.stage(sd, self.version)
        else:
            manifest, uri = self.stager.stage(sd, self.version), self.stager.uri
        t1 = time.perf_counter()
        self.stub.Publish(self.pb.PublishRequest(manifest=manifest_to_proto(manifest), staging_uri=uri))
        t2 = time.perf_counter()
        while True:
            s = self.stub.GetStatus(self.pb.GetStatusRequest())
            done = [m for m in s.members if m.HasField("confirmed_policy_version")
                    and m.confirmed_policy_version == self.version]
            if len(done) == len(self.members):
                break
            if s.HasField("last_error") and time.perf_counter() - t2 > 60:
                raise RuntimeError(f"broadcast failed: {s.last_error.message}")
            time.sleep(0.002)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def close(self) -> None:
        self.stager.close()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=96, help="size of the state dict in MB (default 96)")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=64, help="bucket size of the manifest (MiB)")
    ap.add_argument("--load-format", default="tauflow_flat_v1", choices=["tauflow_flat_v1", "per_tensor"])
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--ipc", action="store_true", help="also the sidecar's ipc backend (the colocated hand-off)")
    ap.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--iterations", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.role == "plain-recv":
        return plain_receiver(args.port, args.rank, args.world, args.mb, args.iterations)
    rounds = 3 if args.quick else args.rounds
    sd = model_state_dict(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"state dict: {len(sd)} tensors, {nbytes / MB:.1f} MB bfloat16; {args.receivers} receivers; gloo on "
          f"127.0.0.1; {rounds} rounds (+{WARMUP} warm-up); bucket {args.bucket_mb} MiB; "
          f"load_format={args.load_format or 'per_tensor'}; {os.cpu_count()} CPUs", flush=True)
    fmt = "" if args.load_format == "per_tensor" else args.load_format
    workdir = Path(tempfile.mkdtemp(prefix="tauflow-bench-weights-"))
    plain = Plain(args.receivers, args.mb, 2 * (rounds + WARMUP), sd)
    car = Sidecar(args.receivers, workdir, fmt, args.bucket_mb)
    shared = Sidecar(args.receivers, workdir, fmt, args.bucket_mb, backend="ipc") if args.ipc else None
    runs: dict[str, list[float]] = {"plain": [], "plain-flat": [], "sidecar": [], "stage": [], "publish": []}
    if shared is not None:
        runs.update({"sidecar-ipc": [], "stage-ipc": [], "publish-ipc": []})
    try:
        for r in range(rounds + WARMUP):
            order = ["plain", "sidecar"] if r % 2 == 0 else ["sidecar", "plain"]
            row = {}
            for what in order:
                if what == "plain":
                    row["plain"] = plain.run(flat=False)
                    row["plain-flat"] = plain.run(flat=True)
                else:
                    row["stage"], row["publish"], row["sidecar"] = car.publish(sd)
                    if shared is not None:
                        row["stage-ipc"], row["publish-ipc"], row["sidecar-ipc"] = shared.publish(sd)
            if r < WARMUP:
                print("warm-up: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in row.items()), flush=True)
                continue
            for k, v in row.items():
                runs[k].append(v)
            print(f"round {r}: plain {nbytes / MB / row['plain']:.0f} MB/s, plain-flat "
                  f"{nbytes / MB / row['plain-flat']:.0f} MB/s, sidecar {nbytes / MB / row['sidecar']:.0f} MB/s; "
                  f"hand-off {1000 * (row['stage'] + row['publish']):.0f} ms "
                  f"(stage {1000 * row['stage']:.0f} + Publish {1000 * row['publish']:.0f})", flush=True)
    finally:
        car.close()
        if shared is not None:
            shared.close()
        plain.close()
    shutil.rmtree(workdir, ignore_errors=True)  # kept (with the servers' logs) when a round failed
    med = {k: statistics.median(v) for k, v in runs.items()}
    bw = {k: nbytes / MB / med[k] for k in ("plain", "plain-flat", "sidecar")}
    best = max(bw["plain"], bw["plain-flat"])
    print()
    print(f"{'variant':<12} {'MB/s':>8} {'ms':>8}   (median of {rounds})")
    for k in ("plain", "plain-flat", "sidecar"):
        print(f"{k:<12} {bw[k]:8.0f} {med[k] * 1000:8.1f}")
    print(f"ratio sidecar / plain (per tensor)  = {bw['sidecar'] / bw['plain']:.2f}")
    print(f"ratio sidecar / best plain          = {bw['sidecar'] / best:.2f}   (target >= 0.8)")
    if shared is not None:
        bw["sidecar-ipc"] = nbytes / MB / med["sidecar-ipc"]
        handoff_ipc = [a + b for a, b in zip(runs["stage-ipc"], runs["publish-ipc"], strict=True)]
        print(f"{'sidecar-ipc':<12} {bw['sidecar-ipc']:8.0f} {med['sidecar-ipc'] * 1000:8.1f}")
        print(f"ratio sidecar-ipc / sidecar (gloo)  = {bw['sidecar-ipc'] / bw['sidecar']:.2f}")
        print(f"trainer blocking per publish, ipc: {statistics.median(handoff_ipc) * 1000:.1f} ms median "
              f"(stage into its own buffer {med['stage-ipc'] * 1000:.1f} ms + Publish {med['publish-ipc'] * 1000:.1f} ms)")
    handoff = [a + b for a, b in zip(runs["stage"], runs["publish"], strict=True)]
    print(f"trainer blocking per publish: {statistics.median(handoff) * 1000:.1f} ms median "
          f"(stage into /dev/shm {med['stage'] * 1000:.1f} ms + Publish {med['publish'] * 1000:.1f} ms; "
          f"min {min(handoff) * 1000:.1f}, max {max(handoff) * 1000:.1f})")
    print("BENCH_JSON " + json.dumps({
        "bytes": nbytes, "tensors": len(sd), "receivers": args.receivers, "rounds": rounds,
        "load_format": args.load_format, "bucket_mib": args.bucket_mb,
        "mb_per_s": bw, "ratio_vs_plain": bw["sidecar"] / bw["plain"], "ratio_vs_best_plain": bw["sidecar"] / best,
        "handoff_ms_median": statistics.median(handoff) * 1000, "stage_ms_median": med["stage"] * 1000,
        "publish_ms_median": med["publish"] * 1000, "runs": runs,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
