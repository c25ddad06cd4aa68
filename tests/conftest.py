"""Fixtures for cross-service tests: real service processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tauflow.core.testing import ServiceProcess


@pytest.fixture
def service_process(tmp_path: Path) -> Iterator[object]:
    """Factory: ``service_process("queue", {"max_staleness": 0})`` returns a started process."""
    started: list[ServiceProcess] = []

    def make(name: str, settings: dict[str, object] | None = None, env: dict[str, str] | None = None) -> ServiceProcess:
        proc = ServiceProcess(name, tmp_path, settings or {}, env)
        started.append(proc)
        return proc.start()

    yield make
    for proc in started:
        proc.stop()
