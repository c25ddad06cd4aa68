"""House rules of the repository, checked: lockstep versions, one namespace, no cross-service imports, every
import declared, and each role installed alone starts (the last is slow: TAUFLOW_SKIP_SOLO_INSTALLS=1 skips it).
The layering inside a service (domain vs adapters) is tests/contract/test_layering.py."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTS = sorted(p.parent for p in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml")])
ROLES = sorted(p.name for p in (ROOT / "services").iterdir() if p.is_dir())


def _project(dist: Path) -> dict:
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


# -- every distribution declares what it imports, and each role starts from a solo install ------------

LIBS = {d.name: d for d in DISTS if d.parent.name == "libs"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalize(re.split(r"[\s\[<>=!~;(]", r, maxsplit=1)[0]) for r in requirements}


def _runtime_imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) of every import of ``path`` that runs: ``if TYPE_CHECKING:`` blocks are
    left out, relative imports too (they stay inside the distribution)."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse, top)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module == "tauflow" and not child.level:
                found.extend((f"tauflow.{a.name}", top) for a in child.names)  # the namespace's packages
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.module, top))
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, top and not nested)

    visit(ast.parse(path.read_text()), True)
    return found


@functools.cache
def _owners() -> dict[str, set[str]]:
    """Installed distributions by the module paths they provide, up to three levels deep: namespace
    packages (google, opentelemetry) are shared by several distributions, each owning a deeper part."""
    owners: dict[str, set[str]] = {}
    for dist in importlib.metadata.distributions():
        name = _normalize(dist.metadata["Name"])
        for f in dist.files or ():
            parts = f.parts
            if not parts or parts[0].endswith((".dist-info", ".data", ".pth")) or parts[0] in ("..", "__pycache__"):
                continue
            modules = [p.removesuffix(".py") for p in parts if p != "__init__.py"]
            modules[-1] = modules[-1].split(".")[0]  # (extension modules: name.cpython-311-x86_64-linux-gnu)
            for depth in range(1, min(len(modules), 3) + 1):
                owners.setdefault(".".join(modules[:depth]), set()).add(name)
    return owners


def _distributions_of(module: str) -> set[str]:
    """The distributions that may provide ``module`` (several only for a bare namespace package); none for
    the standard library."""
    parts = module.split(".")
    if parts[0] in sys.stdlib_module_names or parts[0] == "__future__":
        return set()
    if parts[0] == "tauflow":
        return {f"tauflow-{parts[1]}"}
    owners = _owners()
    for depth in range(min(len(parts), 3), 0, -1):
        if ".".join(parts[:depth]) in owners:
            return owners[".".join(parts[:depth])]
    raise AssertionError(f"no installed distribution provides {module}")


def _declared_closure(name: str) -> set[str]:
    """``name``, its dependencies and, recursively, those of the tauflow distributions among them."""
    by_name = {_project(d)["name"]: d for d in DISTS}
    names = _requirement_names(_project(by_name[name]).get("dependencies", [])) | {name}
    for dep in list(names - {name}):
        if dep in by_name:
            names |= _declared_closure(dep)
    return names


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: d.name)
def test_every_import_is_a_declared_dependency(dist: Path) -> None:
    """What a distribution's code imports comes from what it declares (not from a dependency of a sibling
    or of a third-party package that happens to be installed here): a module-level import from its
    ``dependencies`` or theirs of the tauflow libs it declares (tauflow-core's grpcio, pydantic... are the
    runtime kit, pinned in one place), an import inside a function also from an optional extra (the
    controller's ray)."""
    project = _project(dist)
    declared = _declared_closure(project["name"])
    extras = {e: _requirement_names(r) for e, r in project.get("optional-dependencies", {}).items() if e != "test"}
    lazily_declared = declared.union(*extras.values())
    missing = []
    for path in sorted((dist / "src").rglob("*.py")):
        for module, top in _runtime_imports(path):
            owners = _distributions_of(module)
            if owners and not owners & (declared if top else lazily_declared):
                missing.append(f"{path.relative_to(ROOT)} imports {module} ({' or '.join(sorted(owners))})")
    assert not missing, f"{project['name']} does not declare:\n" + "\n".join(missing)


# Roles that serve alone (no model, no peer): started from their solo install until healthy, then SIGTERM.
# The others (rollout, trainer: a model; controller: a run) import every module and run their entry point.
SERVES_ALONE = {"queue": ["wal.dir=wal"], "reward": [], "weights": []}
SOLO_SKIP = os.environ.get("TAUFLOW_SKIP_SOLO_INSTALLS") == "1"


def _local_closure(name: str) -> list[Path]:
    """The directories of ``name`` and of the tauflow distributions it needs, recursively: what its
    container installs."""
    by_name = {_project(d)["name"]: d for d in DISTS}
    return sorted(by_name[n] for n in _declared_closure(name) if n in by_name)


def _modules(dist: Path) -> list[str]:
    src = dist / "src"
    return sorted(
        ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for p in src.rglob("*.py")
        if p.name != "__main__.py"
    )


def _pip(python: Path) -> list[str]:
    # (no byte-compiling at install: what is checked is what gets installed; compiling every file of torch and
    # transformers took a third of the rollout's install, 75 s -> 51 s on 2 cores)
    return [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]


@pytest.fixture(scope="module")
def torch_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment with only torch (pinned to this environment's build, as scripts/setup installs it,
    never a bare `torch`) and its own dependencies: made once, then copied as hard links into each role's
    environment that needs torch, so that the roles do not unpack the same 700 MB three times."""
    venv = tmp_path_factory.mktemp("torch") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [*_pip(venv / "bin" / "python"), f"torch=={importlib.metadata.version('torch')}"], check=True, timeout=600
    )
    return venv


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """Every tauflow distribution built once into a wheel, from its directory, as pip builds it when a
    container installs the directory: each role's environment then installs those wheels, instead of pip
    building the same libraries again for every role."""
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", "-w", str(out)]
        + [str(d) for d in DISTS],
        check=True,
        timeout=900,
    )
    built = {}
    for d in DISTS:
        name = _project(d)["name"].replace("-", "_")
        (wheel,) = out.glob(f"{name}-*.whl")
        built[d] = wheel
    return built


def _fresh_venv(venv: Path, with_torch: Callable[[], Path] | None) -> None:
    """A new environment at ``venv``: empty, or (``with_torch``) a hard-linked copy of the torch-only one (a
    virtual environment finds its prefix from where its pyvenv.cfg is, so the copy is an environment of its
    own; pip replaces files rather than writing into them, so the original is never changed)."""
    if with_torch is None:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        return

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # another file system: a copy
            shutil.copy2(src, dst)

    shutil.copytree(with_torch(), venv, symlinks=True, copy_function=link)


@pytest.mark.skipif(SOLO_SKIP, reason="TAUFLOW_SKIP_SOLO_INSTALLS=1 (CI runs it: several minutes on 2 cores)")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("role", ROLES)
def test_each_role_starts_from_a_solo_install(
    role: str, tmp_path: Path, request: pytest.FixtureRequest, wheelhouse: dict[Path, Path]
) -> None:
    """``tauflow-<role>`` installed as its container installs it — the distribution and the tauflow libs it
    declares, built from their directories (not editable), into a fresh environment with nothing else — imports
    every module, runs its entry point, and (where it needs no peer) serves until healthy and drains on
    SIGTERM. The one environment of the other tests holds every distribution, so a dependency that only a
    sibling declares goes unseen there (the trainer crashed at start for want of tenacity)."""
    venv = tmp_path / "venv"
    dists = _local_closure(f"tauflow-{role}")
    needs_torch = "torch" in set().union(*(_requirement_names(_project(d).get("dependencies", [])) for d in dists))
    # torch first, as scripts/setup installs it
    _fresh_venv(venv, (lambda: request.getfixturevalue("torch_venv")) if needs_torch else None)
    python, bindir = venv / "bin" / "python", venv / "bin"
    subprocess.run([*_pip(python), *(str(wheelhouse[d]) for d in dists)], check=True, timeout=600)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}

    modules = [m for d in dists for m in _modules(d)]
    imported = subprocess.run(
        [str(python), "-c", f"import importlib\nfor m in {modules!r}: importlib.import_module(m)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert imported.returncode == 0, imported.stderr

    printed = subprocess.run(
        [str(bindir / f"tauflow-{role}"), "--print-config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    # 0, or 2 with "invalid configuration" where a required key has no default (a model path): either way
    # the entry point and its config loaded; a missing module would be a traceback and exit 1.
    assert printed.returncode == 0 or (printed.returncode == 2 and "invalid configuration" in printed.stderr), (
        printed.stderr
    )

    if role in SERVES_ALONE:
        ready = tmp_path / "ready.json"
        settings = ["server.port=0", "metrics.port=0", *SERVES_ALONE[role]]
        proc = subprocess.Popen(
            [str(bindir / f"tauflow-{role}"), "--ready-file", str(ready), *(a for s in settings for a in ("--set", s))],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
        try:
            deadline = time.monotonic() + 120
            while not ready.exists():
                assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
                assert time.monotonic() < deadline, "not ready after 120 s"
                time.sleep(0.1)
            port = json.loads(ready.read_text())["grpc_port"]
            health = subprocess.run(
                [str(python), "-m", "tauflow.core.healthcheck", f"127.0.0.1:{port}"],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            )
            assert health.returncode == 0, health.stdout + health.stderr
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, proc.communicate()[0].decode(errors="replace")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
