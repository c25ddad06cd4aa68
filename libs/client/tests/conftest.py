"""Real servers for the client's tests: the queue with its external port (TLS, two clients' tokens), the
rollout service on a tiny model, the reward service; each its own process (tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tauflow.core.testing import ServiceProcess, self_signed_certificate

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[3]
TOKENS = {"agent-a": "a-token-" + "a" * 24, "agent-b": "b-token-" + "b" * 24}


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost (it is its own CA), and its key."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    self_signed_certificate(cert, key)
    return cert, key


@pytest.fixture
def queue_process(tmp_path: Path, tls_files: tuple[Path, Path]) -> Iterator[Callable[..., ServiceProcess]]:
    """Factory: a queue whose external port speaks TLS and knows TOKENS; ``settings`` add to its config."""
    started: list[ServiceProcess] = []

    def make(settings: dict[str, object] | None = None) -> ServiceProcess:
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text("".join(f"{name}: {token}\n" for name, token in TOKENS.items()))
        cert, key = tls_files
        proc = ServiceProcess(
            "queue",
            tmp_path,
            {
                "wal.dir": f"wal{len(started)}",
                "groups_per_step": 2,
                "max_staleness": 1,
                "external.enabled": "true",
                "external.port": 0,
                "external.tokens_file": tokens,
                "external.tls_cert_file": cert,
                "external.tls_key_file": key,
                **(settings or {}),
            },
        )
        started.append(proc)
        return proc.start()

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture(scope="module")
def rollout_and_reward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """The rollout service on examples/addition's tiny model (Generate only: no dataset, no sidecar, so it
    serves version 0) and the reward service."""
    d = tmp_path_factory.mktemp("services")
    sys.path.insert(0, str(ROOT / "examples" / "addition"))
    import task

    task.build_model(d / "model", hidden=32, layers=1, heads=2)
    task.build_tokenizer(d / "model")
    reward = ServiceProcess("reward", d, {"pool.workers": 1}).start()
    rollout = ServiceProcess("rollout", d, {"model_path": d / "model", "dataset": ""})
    try:
        rollout.start(timeout_s=120)
        yield rollout, reward
    finally:
        rollout.stop()
        reward.stop()
