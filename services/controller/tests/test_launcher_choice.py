"""Choosing a launcher: the command line and the config, the Ray resources each role asks for, and the
clear errors of a launcher that cannot launch (no Ray, no cluster at the address, an external role that
has no address). The launchers themselves run real services in test_launcher.py (local),
test_external_launcher.py and tests/e2e/test_ray_launcher.py."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from tauflow.controller.adapters.health_client import check_health
from tauflow.controller.app import build_run, create_launcher
from tauflow.controller.cli import build_parser, run_config
from tauflow.controller.config import RayConfig, RunConfig
from tauflow.controller.external import ExternalLauncher
from tauflow.controller.launcher import LaunchFailed, LocalLauncher, ServiceSpec
from tauflow.controller.raylauncher import RayLauncher, role_resources
from tauflow.core.config import ConfigError

BASE = {"model": "m", "dataset": "d", "steps": 1}
ADDRESSES = {r: f"10.0.0.{i}:5005{i}" for i, r in enumerate(("queue", "reward", "weights", "trainer", "rollout"))}


def _args(tmp_path: Path, *argv: str):
    config = tmp_path / "config.yaml"
    config.write_text("model: m\ndataset: d\nsteps: 1\n")
    return build_parser().parse_args(["run", str(config), *argv])


def test_launcher_and_address_on_the_command_line_become_the_config(tmp_path: Path) -> None:
    config = run_config(_args(tmp_path, "--launcher", "ray", "--address", "10.1.2.3:6379"))
    assert config.launcher == "ray" and config.ray.address == "10.1.2.3:6379"
    ray = create_launcher(config.model_copy(update={"out_dir": str(tmp_path)}))
    assert isinstance(ray, RayLauncher) and ray.health is not None  # it probes its roles' health
    assert run_config(_args(tmp_path)).launcher == "local"
    local = create_launcher(RunConfig(**BASE, out_dir=str(tmp_path)))
    assert isinstance(local, LocalLauncher) and local.health is not None


def test_an_address_without_the_ray_launcher_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"--address is a Ray cluster's address, for --launcher ray \(the launcher is local\)"
    ):
        run_config(_args(tmp_path, "--address", "10.1.2.3:6379"))


def test_the_external_launcher_needs_an_address_for_every_role_and_knows_only_roles() -> None:
    with pytest.raises(
        ValidationError, match="launcher external needs every role's address .*set external.weights, external.rollout"
    ):
        RunConfig(**BASE, launcher="external", external={"queue": "q:1", "reward": "r:1", "trainer": "t:1"})
    with pytest.raises(ValidationError, match=r"external: unknown role\(s\) \['sampler'\]"):
        RunConfig(**BASE, external={"sampler": "s:1"})
    with pytest.raises(ValidationError, match=r"ray.num_gpus: unknown role\(s\) \['gpu'\]"):
        RunConfig(**BASE, ray={"num_gpus": {"gpu": 1}})
    config = RunConfig(**BASE, launcher="external", external=ADDRESSES)
    assert isinstance(create_launcher(config), ExternalLauncher)


def test_a_cpu_run_asks_ray_for_no_gpu_and_a_gpu_run_for_one_per_gpu_role(tmp_path: Path) -> None:
    cpu = build_run(RunConfig(**BASE, out_dir=str(tmp_path)))
    for role in ("queue", "reward", "weights", "trainer", "rollout"):
        assert role_resources(role, cpu._settings(role, {}), RayConfig()) == {"num_cpus": 1.0, "num_gpus": 0.0}
    gpu = build_run(
        RunConfig(
            **BASE,
            out_dir=str(tmp_path),
            services={
                "trainer": {"backend": {"device": "cuda"}},
                "rollout": {"engine_options": {"device": "cuda:0"}},
                "weights": {"backend": "nccl"},
            },
        )
    )
    wanted = {"queue": 0.0, "reward": 0.0, "weights": 1.0, "trainer": 1.0, "rollout": 1.0}
    for role, gpus in wanted.items():
        assert role_resources(role, gpu._settings(role, {}), RayConfig())["num_gpus"] == gpus, role
    # Explicit numbers win: e.g. the sidecar and the trainer sharing one GPU, more CPUs for the rollout.
    shared = RayConfig(num_gpus={"weights": 0.25, "trainer": 0.75}, num_cpus={"rollout": 4})
    assert role_resources("weights", gpu._settings("weights", {}), shared)["num_gpus"] == 0.25
    assert role_resources("rollout", gpu._settings("rollout", {}), shared) == {"num_cpus": 4.0, "num_gpus": 1.0}


def test_ray_missing_is_a_launch_failure_that_says_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(LaunchFailed, match=r"needs Ray .*pip install 'tauflow-controller\[ray\]'"):
        RayLauncher(tmp_path, RayConfig()).start(ServiceSpec("queue"))


def test_no_cluster_at_the_address_fails_at_once_naming_it(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(LaunchFailed, match=rf"launcher 'ray': no Ray cluster answers at 127.0.0.1:{port}"):
        RayLauncher(tmp_path, RayConfig(address=f"127.0.0.1:{port}")).start(ServiceSpec("queue"))
    assert time.monotonic() - started < 10  # not Ray's minutes of retries


def test_an_external_role_without_an_address_is_named(tmp_path: Path) -> None:
    with pytest.raises(
        LaunchFailed, match="service 'trainer' failed: launcher 'external' has no address for it: set external.trainer"
    ):
        ExternalLauncher({"queue": "127.0.0.1:1"}, check_health).start(ServiceSpec("trainer"))
