"""The trainer's domain modules never import gRPC (the service layer will wrap them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tauflow" / "trainer"


@pytest.mark.parametrize("module", ["algorithms.py", "batch.py", "backend.py", "convert.py"])
def test_domain_modules_never_import_grpc(module: str) -> None:
    names: set[str] = set()
    for node in ast.walk(ast.parse((SRC / module).read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    assert not any(n == "grpc" or n.startswith("grpc.") or n.endswith("_pb2_grpc") for n in names), names
