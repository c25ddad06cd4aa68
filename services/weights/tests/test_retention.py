"""Publish's hand-off, in process: a copy that blocks answers at the hand-off deadline and holds no other
Publish up."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import tauflow.weights.retention as retention_module
from tauflow.core.config import ConfigError, load_config
from tauflow.weights.config import DeadlinesConfig, WeightsConfig
from tauflow.weights.errors import DataLoss, HandoffDeadline, InvalidRequest, ResourceExhausted
from tauflow.weights.sidecar import Sidecar
from tauflow.weightsync import Manifest, Stager, default_staging_dir
from tauflow.weightsync.manifest import BucketSpec, TensorSpec


class FakeStore:
    store = None
    port = 1


async def test_a_hand_off_that_blocks_answers_at_its_deadline_and_holds_no_other_publish_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unblock = threading.Event()
    buffers: list[torch.Tensor] = []
    real_read = retention_module.read_staged

    def read(uri: str, manifest: Any, out: torch.Tensor, **kw: Any) -> str:
        buffers.append(out)
        if uri.endswith("/blocked"):
            unblock.wait(10)  # a read that blocks (a stuck file system): it never looks at the deadline
        return real_read(uri, manifest, out, **kw)

    monkeypatch.setattr(retention_module, "read_staged", read)
    config = WeightsConfig(deadlines=DeadlinesConfig(handoff_s=0.3), staging_roots=[str(tmp_path)])
    retention = Sidecar(config, FakeStore(), lambda address: None).retention
    stager = Stager(f"file://{tmp_path}/staged")
    manifest = stager.stage({"w": torch.ones(4)}, 1)
    try:
        blocked = asyncio.create_task(retention.publish(manifest, f"file://{tmp_path}/blocked"))
        await asyncio.sleep(0.05)
        good = asyncio.create_task(retention.publish(manifest, stager.uri))  # waits for the publish lock
        # Before the fix both waited until the read returned (for ever, for a FIFO with no writer).
        with pytest.raises(HandoffDeadline, match="deadline"):
            await asyncio.wait_for(blocked, 2)
        assert (await asyncio.wait_for(good, 2)).policy_version == 1
        # The blocked read still writes into its buffer: it is not handed to the next version, and its memory
        # counts against max_retained_bytes until the read ends (repeated hung reads cannot grow the host's).
        assert retention.latest is not None and retention.latest.buffer is buffers[1] is not buffers[0]
        retention.config.max_retained_bytes = 2 * manifest.total_bytes - 1  # (the new version and the hung copy)
        with pytest.raises(ResourceExhausted, match="hand-offs still reading past their deadline"):
            await retention.publish(stager.stage({"w": torch.ones(4)}, 2), stager.uri)
        unblock.set()
        for _ in range(200):
            if not retention._abandoned_bytes:
                break
            await asyncio.sleep(0.01)
        assert (await retention.publish(stager.stage({"w": torch.ones(4)}, 2), stager.uri)).policy_version == 2
    finally:
        unblock.set()


async def test_a_staging_uri_naming_a_fifo_is_an_invalid_argument_at_once(tmp_path: Path) -> None:
    """Opening a FIFO with no writer blocked a thread of the default executor for ever: after a few such
    calls (the pool's size) the sidecar could not publish at all."""
    retention = Sidecar(WeightsConfig(staging_roots=[str(tmp_path)]), FakeStore(), lambda address: None).retention
    manifest = Stager(f"file://{tmp_path}/staged").stage({"w": torch.ones(4)}, 1)
    fifo = tmp_path / "a.fifo"
    os.mkfifo(fifo)
    try:
        with pytest.raises(InvalidRequest, match="staging_uri .* is not a regular file"):
            await asyncio.wait_for(retention.publish(manifest, f"file://{fifo}"), 2)
        assert retention.latest is None
    finally:
        with contextlib.suppress(OSError):  # (a writer that comes and goes releases an open that blocked)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


SECRET = b"agent: tok-" + b"x" * 28 + b"\nother: tok-" + b"y" * 28 + b"\nthird: tok-" + b"z" * 28 + b"\n"


def raw_manifest(n: int, checksum: str, version: int = 1) -> Manifest:
    """What a hostile caller publishes: one uint8 tensor, the first ``n`` bytes (a multiple of 64) of whatever
    file it names."""
    tensor = TensorSpec(name="x", dtype="uint8", shape=(n,), offset_bytes=0, size_bytes=n)
    bucket = BucketSpec(index=0, tensors=(tensor,), offset_bytes=0, size_bytes=n)
    return Manifest(version, (bucket,), n, "sha256", checksum)


async def test_a_staging_file_outside_the_staging_roots_is_refused_and_nothing_is_staged(tmp_path: Path) -> None:
    """Publish read any file the sidecar could (the port has no authentication): its DATA_LOSS answer quoted the
    sha256 of the file's first bytes, a second Publish with it made the file a version, and a member joined at
    an address of the caller's received it."""
    root = tmp_path / "staging"
    root.mkdir()
    secret = tmp_path / "tokens.yaml"
    secret.write_bytes(SECRET)
    retention = Sidecar(WeightsConfig(staging_roots=[str(root)]), FakeStore(), lambda address: None).retention
    leaked = hashlib.sha256(SECRET[:64]).hexdigest()
    (root / "link").symlink_to(secret)
    (root / "dir").symlink_to(tmp_path, target_is_directory=True)
    for uri, why in (
        (f"file://{secret}", "outside the staging roots"),
        (f"file://{tmp_path}/absent", "outside the staging roots"),  # (the same answer: existence is not told)
        (f"file://{root}/../{secret.name}", "no '.' or '..' component"),
        (f"file://{root}/link", "symbolic link"),
        (f"file://{root}/dir/{secret.name}", "symbolic link"),
    ):
        for checksum in ("00", leaked):
            with pytest.raises(InvalidRequest, match=f"staging_uri .*{why}") as refused:
                await retention.publish(raw_manifest(64, checksum, version=10**9), uri)
            assert leaked not in str(refused.value)
    assert retention.latest is None and retention.latest_version is None and not retention._outcomes
    assert retention.retained_bytes() == 0
    # (a link is found when the copy opens the file: its spare buffer went back to the pool, with no byte read)
    assert all(bytes(b.numpy()[:64]) != SECRET[:64] for b in retention._pool._free)


async def test_a_wrong_checksum_is_answered_without_the_staged_bytes_checksum_or_size(tmp_path: Path) -> None:
    retention = Sidecar(WeightsConfig(staging_roots=[str(tmp_path)]), FakeStore(), lambda address: None).retention
    staged = tmp_path / "staged"
    staged.write_bytes(SECRET)
    actual = hashlib.sha256(SECRET[:64]).hexdigest()
    with pytest.raises(DataLoss, match="does not match the manifest's 00") as wrong:
        await retention.publish(raw_manifest(64, "00"), f"file://{staged}")
    assert actual not in str(wrong.value)
    with pytest.raises(InvalidRequest, match="shorter than the 4096 bytes") as short:
        await retention.publish(raw_manifest(4096, "00"), f"file://{staged}")
    assert str(len(SECRET)) not in str(short.value)
    assert retention.latest is None
    assert (await retention.publish(raw_manifest(64, actual), f"file://{staged}")).policy_version == 1


def test_the_default_staging_root_is_where_the_trainer_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller starts the trainer and the sidecar with one environment: TAUFLOW_STAGING_DIR (or
    /dev/shm), where the trainer's Stager() names its file, is the sidecar's default root."""
    monkeypatch.delenv("TAUFLOW_STAGING_DIR", raising=False)
    assert WeightsConfig().staging_roots == [os.path.abspath(default_staging_dir())]
    monkeypatch.setenv("TAUFLOW_STAGING_DIR", str(tmp_path))
    assert WeightsConfig().staging_roots == [str(tmp_path)]
    stager = Stager()
    try:
        assert stager.path.parent == tmp_path
    finally:
        stager.close()
    with pytest.raises(ConfigError, match="not an absolute path"):
        load_config(WeightsConfig, overrides=["staging_roots=[staging]"])
