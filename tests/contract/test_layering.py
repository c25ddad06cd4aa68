"""The house's layering, checked over the import graph of every tauflow module (docs/architecture.md).

1. **Domain code speaks no wire.** In a service, every module outside ``adapters/`` (and other than
   ``app.py``, which wires the two, and ``__main__.py``) imports nothing *wire-bound*, directly or through
   any other tauflow module: grpc (any ``grpc*`` package), protobuf, the generated contracts
   (``tauflow.api``), and every tauflow module that imports one of those. The rule is a path, so a new
   file is covered the moment it exists; ``import grpc``, ``from grpc import aio``, ``from tauflow.api.x
   import y_pb2`` and imports inside functions or ``if TYPE_CHECKING:`` blocks all count.
2. **One client module per peer.** A service reaches another service's contract (its ``*_pb2_grpc``
   stubs) from exactly one module, ``adapters/<peer>_client.py``; its own stubs only from
   ``adapters/servicer.py`` (and ``app.py``, which registers the servicer, and ``adapters/<role>_client.py``,
   a client of a running instance: the controller's command line reaches a running run through it).
3. **Shared libraries:** ``tauflow.weightsync`` and ``tauflow.media`` are domain code but for their ``wire`` modules; ``tauflow.core``
   (the runtime kit: server, channel, health) and ``tauflow.client`` (a gRPC client) are wire code by
   purpose, and their wire-free modules (config, staleness, files, lifeline, logs, metrics) are usable from
   the domain.
4. **One staleness rule.** Only ``tauflow.core.staleness`` compares a staleness or a τ with ``-1``/``0``
   or computes the pacing window: a service that spells "unbounded" itself fails here.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "src" / "tauflow").is_dir())
WIRE_ROOTS = ("grpc", "grpc_health", "grpc_reflection", "grpc_status", "google.protobuf", "tauflow.api")
WIRING = {"app", "__main__", "cli"}  # the modules that wire a program (cli: the controller's `tauflow`)
LIB_ADAPTERS = {
    "weightsync": {"tauflow.weightsync.wire"},
    "media": {"tauflow.media.wire"},
}  # libraries whose domain/wire split is checked
STALENESS_MODULE = "tauflow.core.staleness"


@dataclass(frozen=True)
class Module:
    name: str  # dotted: tauflow.queue.adapters.servicer
    path: Path


def _sources() -> list[Path]:
    return sorted(
        p
        for base in ("libs", "services")
        for p in (ROOT / base).glob("*/src/tauflow/**/*.py")
        if "/tauflow/api/" not in p.as_posix()  # generated
    )


@functools.cache
def modules() -> dict[str, Module]:
    found = {}
    for path in _sources():
        parts = path.relative_to(ROOT).with_suffix("").parts  # <libs|services>/<dist>/src/tauflow/...
        dotted = list(parts[3:])
        if dotted[-1] == "__init__":
            dotted.pop()
        found[".".join(dotted)] = Module(".".join(dotted), path)
    return found


def _imports_of(module: Module) -> set[str]:
    """Every module ``module`` imports, anywhere in it (functions and TYPE_CHECKING blocks included):
    ``from a.b import c`` is ``a.b.c`` when that is a tauflow module, else ``a.b``."""
    tree = ast.parse(module.path.read_text())
    is_package = module.path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.name.split(".") if is_package else module.name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in modules() or _is_wire_root(full) else base)
    return names


def _is_wire_root(name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in WIRE_ROOTS) or name.endswith("_pb2_grpc")


@functools.cache
def graph() -> dict[str, set[str]]:
    return {name: _imports_of(m) for name, m in modules().items()}


@functools.cache
def wire_chains() -> dict[str, list[str]]:
    """For every wire-bound tauflow module, one import chain that makes it so (ending in a wire root)."""
    chains: dict[str, list[str]] = {}
    for name, imported in graph().items():
        roots = sorted(i for i in imported if _is_wire_root(i))
        if roots:
            chains[name] = [name, roots[0]]
    changed = True
    while changed:  # a fixpoint over the graph: cycles are fine
        changed = False
        for name, imported in graph().items():
            if name in chains:
                continue
            for i in sorted(imported):
                if i in chains:
                    chains[name] = [name, *chains[i]]
                    changed = True
                    break
    return chains


def _service_modules(role: str) -> list[str]:
    return sorted(n for n in modules() if n == f"tauflow.{role}" or n.startswith(f"tauflow.{role}."))


def _is_domain(name: str, role: str) -> bool:
    rest = name.removeprefix(f"tauflow.{role}").lstrip(".")
    return not (rest.split(".")[0] == "adapters" or rest in WIRING)


def domain_breaches(role: str) -> list[str]:
    breaches = []
    for name in _service_modules(role):
        if _is_domain(name, role) and name in wire_chains():
            breaches.append(" -> ".join(wire_chains()[name]))
    return breaches


def test_the_graph_sees_every_form_of_import() -> None:
    """The rule can only hold if the graph reads what Python runs: a module that reaches grpc through a
    function-level ``from`` import, a relative import and a TYPE_CHECKING block is wire-bound."""
    assert _is_wire_root(wire_chains()["tauflow.core.server"][-1])
    assert "tauflow.core.staleness" not in wire_chains() and "tauflow.core.config" not in wire_chains()
    assert "tauflow.core.healthcheck" in wire_chains()  # through channel, and directly


@pytest.mark.parametrize("role", ROLES)
def test_domain_modules_reach_no_wire(role: str) -> None:
    breaches = domain_breaches(role)
    assert not breaches, (
        f"these modules of tauflow.{role} are domain code (not under adapters/) but reach the wire; move the "
        "wire part into adapters/ and give the domain a port (a typing.Protocol) that app.py wires:\n"
        + "\n".join(breaches)
    )


@pytest.mark.parametrize("role", ROLES)
def test_each_peer_is_called_through_one_client_module(role: str) -> None:
    callers: dict[str, set[str]] = {}
    for name in _service_modules(role):
        for imported in graph()[name]:
            if imported.endswith("_pb2_grpc") and imported.startswith("tauflow.api."):
                peer = imported.split(".")[2]
                callers.setdefault(peer, set()).add(name)
    for peer, names in callers.items():
        if peer == role:  # its own contract: the servicer, app.py that registers it, and a client of a running
            # instance of it (the controller's: tauflow scale, set and status reach a running run)
            allowed = {
                f"tauflow.{role}.adapters.servicer",
                f"tauflow.{role}.app",
                f"tauflow.{role}.adapters.{role}_client",
            }
            assert names <= allowed, f"{sorted(names - allowed)} import tauflow.{role}'s own stubs"
        else:
            assert names == {f"tauflow.{role}.adapters.{peer}_client"}, (
                f"tauflow.{role} calls {peer} from {sorted(names)}: one module, adapters/{peer}_client.py"
            )


@pytest.mark.parametrize("lib", sorted(LIB_ADAPTERS))
def test_shared_library_domain_modules_reach_no_wire(lib: str) -> None:
    names = [n for n in modules() if n == f"tauflow.{lib}" or n.startswith(f"tauflow.{lib}.")]
    bound = [" -> ".join(wire_chains()[n]) for n in names if n in wire_chains() and n not in LIB_ADAPTERS[lib]]
    assert bound == []


def test_a_breach_is_caught(tmp_path: Path) -> None:
    """A deliberate breach: a new domain module that imports grpc inside a function, and one that reaches
    it only through the first (relative import), are both caught."""
    fake_root = tmp_path / "services" / "queue" / "src" / "tauflow" / "queue"
    fake_root.mkdir(parents=True)
    (fake_root / "__init__.py").write_text("")
    (fake_root / "sneaky.py").write_text("def f():\n    from grpc import aio\n    return aio\n")
    (fake_root / "innocent.py").write_text("from . import sneaky\n")
    (fake_root / "adapters").mkdir()
    (fake_root / "adapters" / "__init__.py").write_text("")
    (fake_root / "adapters" / "servicer.py").write_text("import grpc\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    for cached in (modules, graph, wire_chains):
        cached.cache_clear()
    try:
        assert sorted(domain_breaches("queue")) == [
            "tauflow.queue.innocent -> tauflow.queue.sneaky -> grpc.aio",
            "tauflow.queue.sneaky -> grpc.aio",
        ]
    finally:
        ROOT = saved
        for cached in (modules, graph, wire_chains):
            cached.cache_clear()


# -- one staleness rule -------------------------------------------------------------------------------


def _names_staleness(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "staleness" in name.lower() or name.lower() in {"tau", "_tau"}


def _is_edge_constant(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return node.operand.value == 1
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def staleness_spellings(path: Path) -> list[str]:
    """Where ``path`` tests a τ or a staleness against -1 or 0 itself (what tauflow.core.staleness says once)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = node.left, node.comparators[0]
            if (_names_staleness(left) and _is_edge_constant(right)) or (
                _names_staleness(right) and _is_edge_constant(left)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_staleness_module_spells_the_rule() -> None:
    own = modules()[STALENESS_MODULE].path
    found = [s for path in _sources() if path != own for s in staleness_spellings(path)]
    assert not found, "use tauflow.core.staleness (is_bounded, too_stale, pacing_limit, UNBOUNDED, check_tau):\n" + (
        "\n".join(found)
    )


def test_a_staleness_spelling_is_caught(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("def f(s):\n    return s.max_staleness >= 0 or tau == -1\n")
    monkey = tmp_path / "x.py"
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert staleness_spellings(monkey) == ["x.py:2: s.max_staleness >= 0", "x.py:2: tau == -1"]
    finally:
        ROOT = saved
