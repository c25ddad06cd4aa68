"""Rollout scaling (scaling.py) and the live τ's bound per step (dial.py), without processes: a fake launcher."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tauflow.controller.dial import TauChange, bound_for_step, violations
from tauflow.controller.launcher import ManagedService, ServiceFailed, ServiceSpec, instance_name
from tauflow.controller.ports import SidecarMember
from tauflow.controller.scaling import RolloutScaler, ScalingRefused, list_services


class FakeLauncher:
    """Starts and stops "processes" at once; ``fail_at`` names an index whose start fails."""

    def __init__(self, tmp_path: Path, starts_services: bool = True, fail_at: int | None = None) -> None:
        self.tmp_path, self.starts_services, self.fail_at = tmp_path, starts_services, fail_at
        self.services: dict[str, ManagedService] = {}
        self.health = None
        self.stopped: list[str] = []

    def start(self, spec: ServiceSpec) -> ManagedService:
        svc = ManagedService(spec, self.tmp_path, info={"grpc_port": 5000 + spec.index, "pid": 100 + spec.index})
        self.services[spec.name] = svc  # registered first, as the local launcher does
        if spec.index == self.fail_at:
            svc.proc = SimpleNamespace(poll=lambda: 1)  # died while starting
            raise ServiceFailed(spec.name, "no room")
        svc.proc, svc.starts = SimpleNamespace(poll=lambda: None), 1
        return svc

    def stop_service(self, name: str) -> int | None:
        self.stopped.append(name)
        del self.services[name]
        return 0


def spec(index: int) -> ServiceSpec:
    return ServiceSpec(instance_name("rollout", index), role="rollout", index=index)


def names(launcher: FakeLauncher) -> list[str]:
    return sorted(launcher.services)


def test_scaling_up_takes_the_lowest_free_indices_and_down_stops_the_highest(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path)
    launcher.start(spec(0))
    scaler = RolloutScaler(1, limit=8)
    assert scaler.set_target(launcher, 3) == 1
    assert scaler.reconcile(launcher, spec) == (["rollout-1", "rollout-2"], [])
    assert names(launcher) == ["rollout", "rollout-1", "rollout-2"]
    assert scaler.reconcile(launcher, spec) == ([], [])  # carried out: nothing more to do
    scaler.set_target(launcher, 1)
    assert scaler.reconcile(launcher, spec) == ([], ["rollout-2", "rollout-1"])
    assert names(launcher) == ["rollout"]
    scaler.set_target(launcher, 2)  # a gap is filled from the lowest free index
    assert scaler.reconcile(launcher, spec) == (["rollout-1"], [])


def test_a_replica_that_cannot_start_falls_the_target_back_to_what_runs(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path, fail_at=2)
    launcher.start(spec(0))
    scaler = RolloutScaler(1, limit=8)
    scaler.set_target(launcher, 4)
    assert scaler.reconcile(launcher, spec) == (["rollout-1"], [])
    assert scaler.target == 2 and "no room" in scaler.last_error
    # given up: no longer supervised, so the launcher's check() does not restart it again and again
    assert names(launcher) == ["rollout", "rollout-1"] and launcher.stopped == ["rollout-2"]


def test_bad_targets_are_refused_before_anything_changes(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path)
    scaler = RolloutScaler(2, limit=8)
    for bad in (0, -1, 9):
        with pytest.raises(ValueError, match="replicas"):
            scaler.set_target(launcher, bad)
    assert scaler.target == 2
    external = FakeLauncher(tmp_path, starts_services=False)
    with pytest.raises(ValueError):  # the argument is judged first, whatever the launcher
        scaler.set_target(external, 0)
    with pytest.raises(ScalingRefused, match="scale the deployment"):
        scaler.set_target(external, 3)
    assert scaler.target == 2


def test_list_services_shows_a_starting_process_without_an_address_and_counts_replicas(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path)
    launcher.start(spec(0))
    starting = ManagedService(spec(1), tmp_path)  # started, its ready file not yet read: no port known
    starting.proc = SimpleNamespace(poll=lambda: None)
    launcher.services[starting.name] = starting
    records = {"rollout": {"build_version": "0.1.0", "contracts": {"tauflow.api.rollout.v1": 1}}}
    views = {v.name: v for v in list_services(launcher, records, [])}  # type: ignore[arg-type]
    assert views["rollout-1"].address == "" and views["rollout-1"].health == "starting"
    assert views["rollout"].address == "127.0.0.1:5000" and views["rollout"].build_version == "0.1.0"
    assert {v.replicas for v in views.values()} == {2} and views["rollout-1"].index == 1


def test_with_launcher_external_the_rollout_replicas_are_the_sidecars_members(tmp_path: Path) -> None:
    from tauflow.controller.external import ExternalService

    launcher = SimpleNamespace(starts_services=False, health=None, services={})
    launcher.services["rollout"] = ExternalService("rollout", "rollout:50052", up=True, starts=1)
    members = [SidecarMember("rollout-a", "10.0.0.5:50052", 3), SidecarMember("rollout-b", "10.0.0.6:50052", 3)]
    views = list_services(launcher, {}, members)  # type: ignore[arg-type]
    rollouts = [v for v in views if v.role == "rollout"]
    assert {v.name for v in rollouts} == {"rollout", "rollout-a", "rollout-b"}
    assert {v.replicas for v in rollouts} == {2}  # the pods behind the Service address, as the sidecar sees them


def test_each_step_is_bound_by_the_tau_in_force_at_its_delivery() -> None:
    # tau 1 until the change to 0 began at version 10 and took effect by 11; 2 from version 20 (at once).
    changes = [TauChange(1, 0, 10, 11, 5.0), TauChange(0, 2, 20, 20, 9.0)]
    assert bound_for_step(5, 1, changes) == 1
    assert bound_for_step(10, 1, changes) == 1  # raced the change: the looser of the two
    assert bound_for_step(11, 1, changes) == 1
    assert bound_for_step(12, 1, changes) == 0
    assert bound_for_step(20, 1, changes) == 2
    assert bound_for_step(25, 1, changes) == 2
    steps = [(5, {1: 64}), (12, {0: 60, 1: 4}), (25, {2: 64})]
    assert violations(steps, 1, changes) == 4  # the 4 groups of staleness 1 at tau 0
    assert violations(steps, -1, []) == 0  # unbounded
