"""What the e2e suites share: the embedded recipe's prepared model and data sets, made once per session.

The prepare steps are single-process CPU work (the omni warm start about 140 s, the distillation teacher about
80 s on 2 cores): the ones the session's tests need start in the background as soon as they can (the omni one
with the session's first prepare, the teacher once its student is made), so that they use the core a learning
run leaves free instead of running one after another while a core waits."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runs import ADDITION, OMNI, ROOT


class Prepare:
    """An example's prepare step into ``out`` (idempotent: a folder made with the same settings is kept), run
    in a subprocess of its own; :meth:`wait` returns ``out`` once it has succeeded."""

    TIMEOUT_S = 1200

    def __init__(self, script: Path, out: Path, *args: str) -> None:
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.log = out.parent / f"{out.name}.prepare.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), "--out", str(out), *args],
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait(self) -> Path:
        code = self.proc.wait(self.TIMEOUT_S)
        assert code == 0, f"{self.proc.args} exited {code}:\n" + self.log.read_text()[-3000:]
        return self.out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _needed(session: pytest.Session, fixture: str) -> bool:
    return any(fixture in getattr(item, "fixturenames", ()) for item in session.items)


@pytest.fixture(scope="session")
def background_prepares() -> Iterator[dict]:
    """The prepares begun in the background, by fixture name (killed at the session's end if still running)."""
    started: dict[str, Prepare] = {}
    yield started
    for prepare in started.values():
        prepare.kill()


def _kept(name: str) -> Path | None:
    """TAUFLOW_E2E_PREPARED names a folder to keep the addition recipe's prepare in between sessions; the
    others are kept beside it."""
    kept = os.environ.get("TAUFLOW_E2E_PREPARED")
    if not kept:
        return None
    return Path(kept) if name == "addition" else Path(kept).parent / name


@pytest.fixture(scope="session")
def prepared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, background_prepares: dict
) -> Path:
    """The warm-started model and data sets (the recipe's prepare step, seed 0); the omni and teacher
    prepares the session needs start beside it."""
    session = request.session
    if _needed(session, "omni_prepared") and "omni_prepared" not in background_prepares:
        background_prepares["omni_prepared"] = Prepare(
            OMNI / "prepare.py", _kept("omni") or tmp_path_factory.mktemp("omni") / "prepared"
        )
    out = Prepare(ADDITION / "prepare.py", _kept("addition") or tmp_path_factory.mktemp("prepared") / "addition")
    out = out.wait()
    if _needed(session, "teacher"):
        _start_teacher(out, tmp_path_factory, background_prepares)
    return out


def _start_teacher(student: Path, tmp_path_factory: pytest.TempPathFactory, background_prepares: dict) -> Prepare:
    if "teacher" not in background_prepares:
        background_prepares["teacher"] = Prepare(
            ROOT / "examples" / "distillation" / "prepare.py",
            _kept("distillation") or tmp_path_factory.mktemp("distillation") / "prepared",
            "--student",
            str(student),
        )
    return background_prepares["teacher"]


@pytest.fixture(scope="session")
def teacher(prepared: Path, tmp_path_factory: pytest.TempPathFactory, background_prepares: dict) -> Path:
    """The distillation recipe's teacher (a 1.8M-parameter addition model fine-tuned to 90 %), prepared beside
    the student that ``prepared`` already holds (examples/distillation/prepare.py reuses it)."""
    return _start_teacher(prepared, tmp_path_factory, background_prepares).wait() / "teacher" / "model"


@pytest.fixture(scope="session")
def omni_prepared(tmp_path_factory: pytest.TempPathFactory, background_prepares: dict) -> Path:
    """The omni example's tiny thinker, warm-started, and its data sets with their images and sounds."""
    if "omni_prepared" not in background_prepares:  # (a session whose tests need no ``prepared``)
        background_prepares["omni_prepared"] = Prepare(
            OMNI / "prepare.py", _kept("omni") or tmp_path_factory.mktemp("omni") / "prepared"
        )
    return background_prepares["omni_prepared"].wait()
