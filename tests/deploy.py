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
