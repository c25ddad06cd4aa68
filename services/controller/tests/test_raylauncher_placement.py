"""Where the Ray launcher places a role that must share a node: the trainer's rank 0 with the weight sidecar
(the /dev/shm hand-off), and with the sidecar's ipc backend every rollout server too (they read the trainer's
buffer on that machine); and a replica scaled in gives its actor (and so its resources) back."""

from __future__ import annotations

from types import SimpleNamespace

from tauflow.controller.launcher import ManagedService, ServiceSpec
from tauflow.controller.raylauncher import RayLauncher


def _service(role: str, index: int = 0, node: str = "", **settings: object) -> ManagedService:
    svc = ManagedService(ServiceSpec(f"{role}-{index}", dict(settings), role=role, index=index), run_dir=None)  # type: ignore[arg-type]
    svc.proc = SimpleNamespace(node_id=node) if node else None
    return svc


def _node_of(svc: ManagedService, services: dict[str, ManagedService]) -> str:
    return RayLauncher._colocated_node(SimpleNamespace(services=services), svc)  # type: ignore[arg-type]


def test_rollout_servers_share_the_sidecars_node_only_with_the_ipc_backend() -> None:
    for backend, expected in (("gloo", ""), ("ipc", "node-a")):
        services = {"weights": _service("weights", node="node-a", backend=backend)}
        assert _node_of(_service("rollout", 0), services) == expected, backend
        assert _node_of(_service("rollout", 3), services) == expected, backend  # every replica, not just the first
    # the trainer's rank 0 shares it either way, its other ranks go anywhere
    services = {"weights": _service("weights", node="node-a", backend="gloo")}
    assert _node_of(_service("trainer", 0), services) == "node-a"
    assert _node_of(_service("trainer", 1), services) == ""


def test_a_replica_scaled_in_gives_its_actor_back() -> None:
    killed: list[str] = []
    launcher = RayLauncher.__new__(RayLauncher)  # (no cluster: the stop path alone)
    launcher._ray = SimpleNamespace(kill=killed.append)  # type: ignore[attr-defined]
    launcher.stop_grace_s = 1.0
    svc = _service("rollout", 2)
    svc.proc = SimpleNamespace(actor="actor-of-rollout-2", poll=lambda: None, send_signal=lambda sig: None,
                               wait=lambda timeout: 0)  # fmt: skip
    launcher.services = {svc.name: svc}
    assert launcher.stop_service(svc.name) == 0
    assert killed == ["actor-of-rollout-2"] and launcher.services == {}
