"""What the e2e suites share: the embedded recipe's prepared model and data sets, made once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import ADDITION, OMNI, ROOT


def _prepare(script: Path, out: Path, *args: str) -> Path:
    """Runs an example's prepare step into ``out`` (idempotent: a folder made with the same settings is kept)."""
    subprocess.run(
        [sys.executable, str(script), "--out", str(out), *args],
        check=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=1200,
    )
    return out


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The warm-started model and data sets (the recipe's prepare step, seed 0); TAUFLOW_E2E_PREPARED names a
    folder to keep them in between sessions."""
    return _prepare(
        ADDITION / "prepare.py", Path(os.environ.get("TAUFLOW_E2E_PREPARED", tmp_path_factory.mktemp("prepared")))
    )


@pytest.fixture(scope="session")
def teacher(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The distillation recipe's teacher (a 1.8M-parameter addition model fine-tuned to 90 %), prepared beside
    the student that ``prepared`` already holds (examples/distillation/prepare.py reuses it)."""
    kept = os.environ.get("TAUFLOW_E2E_PREPARED")  # kept between sessions, beside the student
    out = Path(kept).parent / "distillation" if kept else tmp_path_factory.mktemp("distillation")
    return (
        _prepare(ROOT / "examples" / "distillation" / "prepare.py", out, "--student", str(prepared))
        / "teacher"
        / "model"
    )


@pytest.fixture(scope="session")
def omni_prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The omni example's tiny thinker, warm-started, and its data sets with their images and sounds."""
    kept = os.environ.get("TAUFLOW_E2E_PREPARED")
    return _prepare(OMNI / "prepare.py", Path(kept).parent / "omni" if kept else tmp_path_factory.mktemp("omni"))
