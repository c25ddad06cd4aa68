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
    """Starts and stops "processes" at once. ``fail_at`` names an index whose start fails at once (no room),
    ``dies_at`` one that dies while starting; a begun start serves at the next poll unless its name is in
    ``loading`` (a model still loading)."""

    def __init__(
        self, tmp_path: Path, starts_services: bool = True, fail_at: int | None = None, dies_at: int | None = None
    ) -> None:
        self.tmp_path, self.starts_services, self.fail_at, self.dies_at = tmp_path, starts_services, fail_at, dies_at
        self.services: dict[str, ManagedService] = {}
        self.health = None
        self.stopped: list[str] = []
        self.loading: set[str] = set()

    def start(self, spec: ServiceSpec) -> ManagedService:
        svc = self.begin_start(spec)
        assert self.poll_start(spec.name)
        return svc

    def begin_start(self, spec: ServiceSpec) -> ManagedService:
        svc = ManagedService(spec, self.tmp_path)
        self.services[spec.name] = svc  # registered first, as the local launcher does
        if spec.index == self.fail_at:
            svc.proc = SimpleNamespace(poll=lambda: 1)
            raise ServiceFailed(spec.name, "no room")
        svc.proc, svc.starts = SimpleNamespace(poll=lambda: None), 1
        return svc

    def poll_start(self, name: str) -> bool:
        svc = self.services[name]
        if svc.index == self.dies_at:
            svc.proc = SimpleNamespace(poll=lambda: 1)
            raise ServiceFailed(name, "exited with code 1 while starting")
        if name in self.loading:
            return False
        svc.info = {"grpc_port": 5000 + svc.index, "pid": 100 + svc.index}
        return True

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
    assert scaler.reconcile(launcher, spec) == ([], [])  # begun, not waited for
    assert names(launcher) == ["rollout", "rollout-1", "rollout-2"]
    assert scaler.reconcile(launcher, spec) == (["rollout-1", "rollout-2"], [])  # serving now
    assert scaler.reconcile(launcher, spec) == ([], [])  # carried out: nothing more to do
    scaler.set_target(launcher, 1)
    assert scaler.reconcile(launcher, spec) == ([], ["rollout-2", "rollout-1"])
    assert names(launcher) == ["rollout"]
    scaler.set_target(launcher, 2)  # a gap is filled from the lowest free index
    scaler.reconcile(launcher, spec)
    assert scaler.reconcile(launcher, spec) == (["rollout-1"], [])


def test_a_replica_still_loading_is_reported_once_it_serves_and_can_be_scaled_away(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path)
    launcher.start(spec(0))
    scaler = RolloutScaler(1, limit=8)
    scaler.set_target(launcher, 3)
    launcher.loading = {"rollout-2"}
    scaler.reconcile(launcher, spec)
    assert scaler.reconcile(launcher, spec) == (["rollout-1"], [])
    assert scaler.reconcile(launcher, spec) == ([], [])  # still loading: nothing to report, nothing new begun
    assert names(launcher) == ["rollout", "rollout-1", "rollout-2"] and scaler.starting == {"rollout-2"}
    scaler.set_target(launcher, 2)  # scaled in before it served: the one still starting goes
    launcher.loading = set()  # (even if it would serve by this pass: stopped, not also reported started)
    assert scaler.reconcile(launcher, spec) == ([], ["rollout-2"])
    assert scaler.starting == set() and names(launcher) == ["rollout", "rollout-1"]


def test_scaling_in_stops_a_replica_still_starting_before_a_serving_one_of_a_higher_index(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path)
    launcher.start(spec(0))
    launcher.start(spec(2))
    scaler = RolloutScaler(2, limit=8)
    scaler.set_target(launcher, 3)
    launcher.loading = {"rollout-1"}
    assert scaler.reconcile(launcher, spec) == ([], []) and scaler.starting == {"rollout-1"}
    scaler.set_target(launcher, 2)
    assert scaler.reconcile(launcher, spec) == ([], ["rollout-1"])
    assert names(launcher) == ["rollout", "rollout-2"]


def test_a_replica_dying_while_starting_lowers_a_target_raised_since_by_one_only(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path, dies_at=2)
    launcher.start(spec(0))
    scaler = RolloutScaler(1, limit=8)
    scaler.set_target(launcher, 3)
    scaler.reconcile(launcher, spec)  # rollout-1 and rollout-2 begun
    scaler.set_target(launcher, 6)  # raised while they load
    started, stopped = scaler.reconcile(launcher, spec)
    assert started == ["rollout-1"] and stopped == ["rollout-2"] and scaler.target == 5
    assert len(launcher.services) == 5  # three more begun towards the target: rollout-2's index again among them
    launcher.dies_at = None  # (this time the process at index 2 comes up)
    assert scaler.reconcile(launcher, spec) == (["rollout-2", "rollout-3", "rollout-4"], [])
    assert scaler.target == 5 and scaler.starting == set()


class LoggingLauncher(FakeLauncher):
    """Records each start begun and each replica seen serving; a replica serves at its second poll."""

    def __init__(self, tmp_path: Path, **kw: int) -> None:
        super().__init__(tmp_path, **kw)
        self.events: list[tuple[str, str]] = []
        self.polls: dict[str, int] = {}

    def begin_start(self, spec: ServiceSpec) -> ManagedService:
        self.events.append(("begun", spec.name))
        return super().begin_start(spec)

    def poll_start(self, name: str) -> bool:
        self.polls[name] = self.polls.get(name, 0) + 1
        serves = self.polls[name] > 1 and super().poll_start(name)
        if serves:
            self.events.append(("serves", name))
        return serves


@pytest.mark.parametrize("dies_at", [None, 1])
def test_a_runs_rollout_replicas_start_at_once_at_launch(tmp_path: Path, dies_at: int | None) -> None:
    from tauflow.controller.app import build_run
    from tauflow.controller.config import RunConfig

    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path)))
    launcher = LoggingLauncher(tmp_path, dies_at=dies_at) if dies_at is not None else LoggingLauncher(tmp_path)
    run.launcher, run.scaler.target = launcher, 3  # type: ignore[assignment]
    if dies_at is not None:  # one that dies while loading fails the launch, naming it
        with pytest.raises(ServiceFailed, match="service 'rollout-1' failed"):
            run._start_roles(["trainer", "rollout"], {})
        return
    started = run._start_roles(["trainer", "rollout"], {})
    assert [svc.name for svc in started["rollout"]] == ["rollout", "rollout-1", "rollout-2"]
    assert [svc.name for svc in started["trainer"]] == ["trainer"]
    # every process of the wave begun before the first serves: they load their models together
    begun = [("begun", name) for name in ("trainer", "rollout", "rollout-1", "rollout-2")]
    assert launcher.events[:4] == begun
    assert sorted(launcher.events[4:]) == sorted(("serves", name) for _, name in begun)


@pytest.mark.parametrize("how", ["no room", "died while starting"])
def test_a_replica_that_cannot_start_falls_the_target_back_to_what_runs(tmp_path: Path, how: str) -> None:
    launcher = FakeLauncher(tmp_path, **({"fail_at": 2} if how == "no room" else {"dies_at": 2}))
    launcher.start(spec(0))
    scaler = RolloutScaler(1, limit=8)
    scaler.set_target(launcher, 4)
    started = scaler.reconcile(launcher, spec)[0] + scaler.reconcile(launcher, spec)[0]
    assert "rollout-1" in started and "rollout-2" not in started
    assert scaler.target == len(launcher.services) and ("no room" if how == "no room" else "while starting") in (
        scaler.last_error
    )
    # given up: no longer supervised, so the launcher's check() does not restart it again and again
    assert "rollout-2" not in launcher.services and launcher.stopped == ["rollout-2"]
    assert scaler.reconcile(launcher, spec)[1] == []  # and the target stays where it fell back


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


class GangLauncher(LoggingLauncher):
    """Records a gang's start too; ``refuse`` names a role whose begin_start raises (the run stopping)."""

    def __init__(self, tmp_path: Path, refuse: str = "") -> None:
        super().__init__(tmp_path)
        self.refuse = refuse

    def begin_start(self, spec: ServiceSpec) -> ManagedService:
        if spec.role == self.refuse:
            raise ServiceFailed(spec.name, "the run is stopping: nothing more starts")
        return super().begin_start(spec)

    def start_gang(self, specs: list[ServiceSpec], rendezvous: object) -> list[ManagedService]:
        self.events.append(("gang", specs[0].name))
        members = [FakeLauncher.begin_start(self, s) for s in specs]
        assert all(FakeLauncher.poll_start(self, s.name) for s in specs)  # (each ready on return)
        return members


def test_a_trainer_gang_starts_before_the_rollout_replicas_of_its_wave(tmp_path: Path) -> None:
    # launcher ray places a gang's rank 0 on the sidecar's node: replicas placed first could take its room
    from tauflow.controller.app import build_run
    from tauflow.controller.config import RunConfig

    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path), trainer={"world_size": 2}))
    launcher = GangLauncher(tmp_path)
    run.launcher, run.scaler.target = launcher, 2  # type: ignore[assignment]
    started = run._start_roles(["trainer", "rollout"], {})
    assert [svc.name for svc in started["trainer"]] == ["trainer", "trainer-1"]
    assert launcher.events[:3] == [("gang", "trainer"), ("begun", "rollout"), ("begun", "rollout-1")]


def test_a_wave_refused_midway_polls_what_it_began_so_a_stopping_run_ends_it(tmp_path: Path) -> None:
    # StopRun while a wave starts: the launcher refuses the next start; a process begun after the stop looked
    # at the services is ended only by its poll (the local launcher kills it there when the run is stopping)
    from tauflow.controller.app import build_run
    from tauflow.controller.config import RunConfig

    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path)))
    launcher = GangLauncher(tmp_path, refuse="weights")
    run.launcher = launcher  # type: ignore[assignment]
    with pytest.raises(ServiceFailed, match="stopping"):
        run._start_roles(["queue", "reward", "weights"], {})
    assert launcher.events[:2] == [("begun", "queue"), ("begun", "reward")]
    assert set(launcher.polls) == {"queue", "reward"}
