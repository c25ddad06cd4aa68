"""The transfer library across processes: a sender here, two receiver processes, gloo on loopback."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tauflow.weightsync import (
    LOAD_FORMAT_FLAT,
    LOAD_FORMAT_PER_TENSOR,
    GroupSpec,
    Phase,
    PhaseError,
    Stager,
    StoreHost,
    WeightGroup,
    bucket_requests,
    read_staged,
    send_bucket,
)

WORKER = Path(__file__).with_name("receiver_worker.py")
LABELS = ("r1", "r2")


class Cluster:
    """The sender side of the test, and the two receiver processes it drives through the store."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.host = StoreHost("127.0.0.1", 0, timeout_s=60)
        self.store = self.host.store
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs = {
            label: subprocess.Popen(
                [sys.executable, str(WORKER), "--port", str(self.host.port), "--label", label, "--out", str(tmp)],
                # the child's log stays open for the child's whole life
                env=env,
                stdout=open(tmp / f"{label}.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )
            for label in LABELS
        }
        self.step = 0
        self.epoch = 0
        self.store.wait([f"ready/{label}" for label in LABELS])

    def post(self, cmd: dict) -> int:
        i = self.step
        self.store.set(f"ctl/{i}", json.dumps(cmd))
        self.step += 1
        return i

    def outcome(self, i: int, timeout_s: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        out = {}
        for label in LABELS:
            key = f"done/{i}/{label}"
            while not self.store.check([key]):
                assert self.procs[label].poll() is None, (self.tmp / f"{label}.log").read_text()
                assert time.monotonic() < deadline, f"{label} did not finish command {i}"
                time.sleep(0.01)
            out[label] = self.store.get(key).decode()
        return out

    def group(self, ranks: dict[str, int], timeout_s: float = 30.0, idle: tuple[str, ...] = ()) -> WeightGroup:
        self.epoch += 1
        spec = GroupSpec(
            "127.0.0.1", self.host.port, f"test-e{self.epoch}", len(ranks) + 1, 0, "gloo", self.epoch, timeout_s
        )
        cmd = {k: v for k, v in dataclasses.asdict(spec).items() if k != "rank"}
        i = self.post({"op": "init", "group": cmd, "ranks": ranks, "idle": list(idle)})
        try:
            return WeightGroup(self.store, spec, {r: label for label, r in ranks.items()})
        finally:
            out = self.outcome(i)
            assert all(v in ("ok", "idle") for v in out.values()) or idle, out

    def close(self) -> None:
        self.post({"op": "exit"})
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("weightsync"))
    yield c
    c.close()


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(64, generator=g).half(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=g),
        "model.layers.0.mlp.bias": torch.randn(7, generator=g, dtype=torch.float64),
        "model.rotary.inv_freq": torch.arange(5, dtype=torch.int64) * seed,
        "model.mask": torch.rand(3, 5, generator=g) > 0.5,
        "model.scale": torch.tensor(float(seed)),
        "model.empty": torch.empty(0, 3),
        "lm_head.weight": torch.randn(300, 64, generator=g),
    }
    sd["model.layers.0.self_attn.q_proj.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    return sd


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def send_version(
    cluster: Cluster,
    group: WeightGroup,
    labels: list[str],
    sd: dict[str, torch.Tensor],
    version: int,
    bucket_bytes: int,
    load_format: str,
    tag: str,
) -> str:
    stager = Stager(f"file://{cluster.tmp}/staging-{tag}", bucket_bytes=bucket_bytes)
    manifest = stager.stage(sd, version)
    buf = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    assert read_staged(stager.uri, manifest, buf, roots=[cluster.tmp]) == manifest.checksum
    reqs = bucket_requests(
        manifest, group_name=group.name, membership_epoch=group.spec.membership_epoch, load_format=load_format
    )
    i = cluster.post({"op": "recv", "labels": labels, "tag": tag, "buckets": [dataclasses.asdict(r) for r in reqs]})
    for b in manifest.buckets:
        send_bucket(
            group,
            b,
            buf[b.offset_bytes : b.offset_bytes + b.size_bytes],
            policy_version=version,
            load_format=load_format,
        )
    out = cluster.outcome(i)
    assert all(out[label] == "ok" for label in labels), out
    return manifest.checksum


def check_received(cluster: Cluster, label: str, tag: str, sd: dict[str, torch.Tensor], checksum: str) -> None:
    got = torch.load(cluster.tmp / f"{label}-{tag}.pt")
    assert got["loaded_checksum"] == checksum
    assert list(got["tensors"]) == list(sd)
    for name, t in sd.items():
        assert bitwise_equal(got["tensors"][name], t), name


def test_versions_reach_both_receivers_bitwise(cluster: Cluster) -> None:
    group = cluster.group({"r1": 1, "r2": 2})
    try:
        cases = [
            (1, 1024, LOAD_FORMAT_FLAT),
            (2, 40_000, LOAD_FORMAT_PER_TENSOR),
            (3, 1 << 26, LOAD_FORMAT_FLAT),
            (4, 1, LOAD_FORMAT_PER_TENSOR),
        ]
        for version, bucket_bytes, fmt in cases:
            sd = state_dict(version)
            tag = f"v{version}"
            checksum = send_version(cluster, group, list(LABELS), sd, version, bucket_bytes, fmt, tag)
            for label in LABELS:
                check_received(cluster, label, tag, sd, checksum)
    finally:
        group.destroy()
        cluster.outcome(cluster.post({"op": "destroy", "group_name": group.name}))


def test_one_sender_holds_independent_groups(cluster: Cluster) -> None:
    """Two groups of one sender process, one per engine, each with its own version."""
    groups: dict[str, WeightGroup] = {}
    cluster.epoch += 1
    specs = {
        label: GroupSpec(
            "127.0.0.1", cluster.host.port, f"solo-{label}-e{cluster.epoch}", 2, 0, "gloo", cluster.epoch, 30.0
        )
        for label in LABELS
    }
    for label, spec in specs.items():
        cmd = {k: v for k, v in dataclasses.asdict(spec).items() if k != "rank"}
        i = cluster.post({"op": "init", "group": cmd, "ranks": {label: 1}})
        groups[label] = WeightGroup(cluster.store, spec, {1: label})
        assert cluster.outcome(i)[label] == "ok"
    try:
        for n, label in enumerate(LABELS):
            sd = state_dict(10 + n)
            tag = f"solo-{label}"
            checksum = send_version(cluster, groups[label], [label], sd, 10 + n, 20_000, LOAD_FORMAT_FLAT, tag)
            check_received(cluster, label, tag, sd, checksum)
            assert not (cluster.tmp / f"{LABELS[1 - n]}-{tag}.pt").exists()
    finally:
        for label, g in groups.items():
            g.destroy()
            cluster.outcome(
                cluster.post({"op": "destroy", "group_name": g.name, "idle": [x for x in LABELS if x != label]})
            )


def test_receiver_that_never_posts_is_a_transfer_error_naming_it(cluster: Cluster) -> None:
    deadline = 2.0
    group = cluster.group({"r1": 1, "r2": 2}, timeout_s=deadline)
    try:
        sd = state_dict(5)
        stager = Stager(f"file://{cluster.tmp}/staging-stall", bucket_bytes=1 << 20)
        manifest = stager.stage(sd, 5)
        buf = torch.empty(manifest.total_bytes, dtype=torch.uint8)
        read_staged(stager.uri, manifest, buf, roots=[cluster.tmp])
        reqs = bucket_requests(manifest, group_name=group.name, membership_epoch=group.spec.membership_epoch)
        i = cluster.post(
            {
                "op": "recv",
                "labels": ["r1"],
                "tag": "stall",
                "idle": ["r2"],
                "buckets": [dataclasses.asdict(r) for r in reqs],
            }
        )
        b = manifest.buckets[0]
        started = time.monotonic()
        with pytest.raises(PhaseError) as err:
            send_bucket(group, b, buf[: b.size_bytes], policy_version=5)
        took = time.monotonic() - started
        assert err.value.phase is Phase.TRANSFER and err.value.timed_out
        assert "rank 2 (r2)" in err.value.peer and "r1" not in err.value.peer
        msg = str(err.value)
        assert msg.startswith("transfer with peer rank 2 (r2) missed its deadline of 2s (version 5")
        assert deadline * 0.8 < took < deadline + 3.0, took
        cluster.outcome(i)  # r1 got its bucket or failed by its own deadline; either way it is done
    finally:
        group.destroy()
        cluster.outcome(cluster.post({"op": "destroy", "group_name": group.name}))


def test_rank_that_never_joins_is_a_group_init_error_naming_it(cluster: Cluster) -> None:
    deadline = 2.0
    cluster.epoch += 1
    spec = GroupSpec("127.0.0.1", cluster.host.port, f"test-e{cluster.epoch}", 3, 0, "gloo", cluster.epoch, deadline)
    cmd = {k: v for k, v in dataclasses.asdict(spec).items() if k != "rank"}
    i = cluster.post({"op": "init", "group": cmd, "ranks": {"r1": 1, "r2": 2}, "idle": ["r2"]})
    started = time.monotonic()
    with pytest.raises(PhaseError) as err:
        WeightGroup(cluster.store, spec, {1: "r1", 2: "r2"})
    took = time.monotonic() - started
    assert err.value.phase is Phase.GROUP_INIT
    assert str(err.value).startswith("group_init with peer rank 2 (r2)"), str(err.value)
    assert took < deadline + 3.0, took
    out = cluster.outcome(i)
    assert "group_init with peer rank 0 (sender)" in out["r1"], out


def test_threads_do_not_leak_between_tests() -> None:
    assert threading.active_count() < 20
