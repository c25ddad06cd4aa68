"""Publish's hand-off, in process: a copy that blocks answers at the hand-off deadline and holds no other
Publish up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import tauflow.weights.retention as retention_module
from tauflow.weights.config import DeadlinesConfig, WeightsConfig
from tauflow.weights.errors import HandoffDeadline, InvalidRequest, ResourceExhausted
from tauflow.weights.sidecar import Sidecar
from tauflow.weightsync import Stager


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
    config = WeightsConfig(deadlines=DeadlinesConfig(handoff_s=0.3))
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
    retention = Sidecar(WeightsConfig(), FakeStore(), lambda address: None).retention
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
