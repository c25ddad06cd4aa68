"""The weight-transfer library never imports grpc (the sidecar's own modules are checked in tests/contract)."""

from __future__ import annotations

from pathlib import Path


def test_weightsync_never_imports_grpc() -> None:
    lib = Path(__file__).resolve().parents[3] / "libs" / "weightsync" / "src" / "tauflow" / "weightsync"
    for path in lib.glob("*.py"):
        text = path.read_text()
        assert "import grpc" not in text and "_pb2_grpc" not in text, path.name
