"""What the offline checks of deploy/ share: rendering a kustomization with kubectl and validating what it
renders against the Kubernetes schemas (kubernetes-validate), skipping, saying why, where a tool is missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.30.0"


def render(kustomization: Path) -> list[dict[str, Any]]:
    """The resources ``kubectl kustomize`` renders from ``kustomization`` (a folder)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (it renders kustomize offline)")
    done = subprocess.run(
        ["kubectl", "kustomize", str(kustomization)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"kubectl kustomize {kustomization.relative_to(ROOT)}:\n{done.stderr}"
    import yaml

    return [d for d in yaml.safe_load_all(done.stdout) if d]


def validate(docs: list[dict[str, Any]]) -> None:
    """Every resource against Kubernetes' schemas (strict: unknown fields are errors too)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            raise AssertionError(f"{name} is not valid Kubernetes {KUBERNETES_VERSION}: {e}") from None


POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"  # the StatefulSet's number for each pod


def container_environment(docs: list[dict[str, Any]], container: dict[str, Any], pod_index: int) -> dict[str, str]:
    """The environment Kubernetes gives ``container`` of the pod numbered ``pod_index``: its ConfigMaps
    (``envFrom``, in order), then its ``env`` (values, and the pod-index label; no other field is used)."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        env.update(maps[ref["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == POD_INDEX, f"{var['name']}: from {field}"
            env[var["name"]] = str(pod_index)
    return env
