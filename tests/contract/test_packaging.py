"""House rules of the repository, checked: lockstep versions, one namespace, no cross-service imports."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTS = sorted(p.parent for p in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml")])
ROLES = sorted(p.name for p in (ROOT / "services").iterdir() if p.is_dir())


def _project(dist: Path) -> dict:  # type: ignore[type-arg]
    return tomllib.loads((dist / "pyproject.toml").read_text())["project"]


def test_every_distribution_moves_in_lockstep() -> None:
    versions = {_project(d)["name"]: _project(d)["version"] for d in DISTS}
    assert len(set(versions.values())) == 1, versions
    version = next(iter(versions.values()))
    for dist in DISTS:
        for dep in _project(dist).get("dependencies", []):
            if dep.startswith("tauflow-"):
                assert dep.endswith(f"=={version}"), f"{dist.name}: {dep} is not pinned to {version}"


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: d.name)
def test_distribution_shape(dist: Path) -> None:
    project = _project(dist)
    expected = f"tauflow-{dist.name}"
    assert project["name"] == expected
    assert (dist / "README.md").exists()
    src = dist / "src" / "tauflow"
    if src.exists():
        assert not (src / "__init__.py").exists(), "tauflow is a PEP 420 namespace: no __init__.py"
    if dist.parent.name == "services" and src.exists():
        assert project["scripts"][expected] == f"tauflow.{dist.name}.app:main"
        assert (src / dist.name / "__main__.py").exists()


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("role", ROLES)
def test_services_import_no_other_service(role: str) -> None:
    for path in (ROOT / "services" / role / "src").rglob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "tauflow" and len(parts) > 1 and parts[1] in ROLES:
                assert parts[1] == role, f"{path.relative_to(ROOT)} imports {name}"


DOMAIN = {
    "queue": ["state.py", "wal.py", "convert.py", "config.py", "metrics.py", "wire.py"],
    "reward": ["api.py", "builtins.py", "worker.py", "registry.py", "runner.py", "convert.py", "config.py",
               "metrics.py", "errors.py"],
    "trainer": ["algorithms.py", "backend.py", "batch.py", "convert.py", "loop.py", "ports.py", "config.py"],
    "rollout": ["engine/base.py", "engine/hf.py", "engine/sampling.py", "producer.py", "dataset.py", "convert.py"],
    "weights": ["sidecar.py", "convert.py", "config.py", "metrics.py"],
    "controller": ["config.py", "summary.py", "launcher.py"],
}


@pytest.mark.parametrize(("role", "module"), [(r, m) for r, ms in DOMAIN.items() for m in ms])
def test_domain_modules_never_import_grpc(role: str, module: str) -> None:
    names = _imports(ROOT / "services" / role / "src" / "tauflow" / role / module)
    assert not any(n == "grpc" or n.startswith("grpc.") or n.endswith("_pb2_grpc") for n in names)
