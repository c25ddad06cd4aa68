"""The contracts: documented retry classes, stubs that import, and a breaking check that bites."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tauflow.api.retry import is_retryable

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
PROTOS = sorted(PROTO.glob("tauflow/api/*/v1/*.proto"))
RPC = re.compile(r"((?:^[ \t]*//.*\n)+)[ \t]*rpc (\w+)\(", re.MULTILINE)


def _module(proto: Path) -> str:
    rel = proto.relative_to(PROTO).with_suffix("")
    return ".".join(rel.parts) + "_pb2"


def test_every_role_has_a_v1_contract() -> None:
    roles = {p.parts[-3] for p in PROTOS}
    assert {"common", "queue", "rollout", "reward", "trainer", "weights", "controller"} <= roles


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.parts[-3])
def test_every_rpc_documents_its_retry_class_and_it_matches_the_option(proto: Path) -> None:
    text = proto.read_text()
    pb2 = importlib.import_module(_module(proto))
    methods = {m.name: m for s in pb2.DESCRIPTOR.services_by_name.values() for m in s.methods}
    documented = {name: comment for comment, name in RPC.findall(text)}
    assert set(documented) == set(methods), f"undocumented RPCs in {proto.name}"
    for name, comment in documented.items():
        words = " ".join(line.strip().lstrip("/").strip() for line in comment.splitlines())
        klass = re.search(r"Retry class: ([^(.]+)", words)
        assert klass, f"{proto.name} {name}: no 'Retry class:' line"
        assert "Status:" in words, f"{proto.name} {name}: no 'Status:' line"
        says_retryable = not klass.group(1).strip().startswith("not idempotent")
        assert says_retryable == is_retryable(methods[name]), (
            f"{proto.name} {name}: comment says '{klass.group(1).strip()}' but idempotency_level disagrees"
        )


@pytest.mark.parametrize("proto", [p for p in PROTOS if "common" not in p.parts], ids=lambda p: p.parts[-3])
def test_generated_stubs_import_and_serve_every_service(proto: Path) -> None:
    pb2 = importlib.import_module(_module(proto))
    grpc_mod = importlib.import_module(_module(proto) + "_grpc")
    for service in pb2.DESCRIPTOR.services_by_name:
        assert hasattr(grpc_mod, f"{service}Stub")
        assert hasattr(grpc_mod, f"add_{service}Servicer_to_server")


@pytest.mark.skipif(shutil.which("npx") is None, reason="buf runs through npx")
def test_breaking_check_fails_on_a_breaking_change(tmp_path: Path) -> None:
    copy = tmp_path / "proto"
    shutil.copytree(PROTO, copy)
    queue = copy / "tauflow/api/queue/v1/queue.proto"
    text = queue.read_text()
    # Renumber a field of a released message: wire-incompatible.
    broken = text.replace("string consumer_id = 1;", "string consumer_id = 99;", 1)
    assert broken != text
    queue.write_text(broken)
    run = subprocess.run(
        ["npx", "--yes", "@bufbuild/buf", "breaking", "--against", "released/v1.binpb"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "consumer_id" in run.stdout + run.stderr


def test_every_contract_change_is_a_new_revision() -> None:
    """proto/revisions.json records each package's revisions with the fingerprint of its descriptors; the
    current descriptors must match the last one, so a change that adds to a package without a new revision
    (which ServerInfo reports, and peers check) fails here (docs/contracts.md, "Revisions")."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import contract_revisions

    from tauflow.api.revisions import REVISIONS

    record = json.loads((ROOT / "proto" / "revisions.json").read_text())
    packages = contract_revisions.packages()
    assert set(record) == set(packages), "every package needs an entry in proto/revisions.json"
    for package, files in packages.items():
        entries = record[package]
        revisions = [e["revision"] for e in entries]
        assert revisions == list(range(1, len(revisions) + 1)), f"{package}: revisions must count 1, 2, 3, ..."
        now = contract_revisions.fingerprint(files)
        assert now == entries[-1]["fingerprint"], (
            f"{package} changed since revision {revisions[-1]} was recorded: add revision {revisions[-1] + 1} "
            f'with "fingerprint": "{now}" to proto/revisions.json, then run scripts/gen-stubs'
        )
        assert REVISIONS[package] == revisions[-1], "libs/api is stale: run scripts/gen-stubs"
