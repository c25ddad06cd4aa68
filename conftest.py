"""Workspace-wide pytest hooks: tests marked ``gpu`` skip, saying why, where torch sees no CUDA device (CI);
``scripts/gpu-check`` runs them on a GPU."""

from __future__ import annotations

import pytest

NO_GPU = "marked gpu: needs a CUDA device and torch.cuda.is_available() is False here (scripts/gpu-check runs these)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: the queue's and reward's suites need no torch

    if torch.cuda.is_available():
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=NO_GPU))


@pytest.fixture(autouse=True)
def _no_run_token_after_a_test() -> object:
    """A Run makes its token the process's (tauflow.core.runtoken); a later test must not send it."""
    yield
    import sys

    auth = sys.modules.get("tauflow.core.runtoken")  # (not imported where no test used it)
    if auth is not None:
        auth.use_run_token("")
