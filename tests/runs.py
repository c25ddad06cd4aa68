"""What the tests that run a whole `tauflow run` share: the tiny model of the embedded task, the command."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ADDITION = ROOT / "examples" / "addition"
OMNI = ROOT / "examples" / "omni"


def tiny_addition(tmp_path: Path, problems: int = 200) -> tuple[Path, Path]:
    """A 17k-parameter model of the embedded task (examples/addition/task.py: 32 wide, one layer, two heads)
    with its tokenizer, and a training set of the task's first ``problems`` problems: (model, dataset)."""
    sys.path.insert(0, str(ADDITION))
    import task

    model, dataset = tmp_path / "model", tmp_path / "train.jsonl"
    task.build_model(model, hidden=32, layers=1, heads=2)
    task.build_tokenizer(model)
    train, _ = task.problems()
    task.write_jsonl(dataset, train[:problems])
    return model, dataset


def run_command(recipe: Path, sets: list[str], *options: str) -> list[str]:
    """`tauflow run RECIPE [options] --set KEY=VALUE ...` with this interpreter."""
    cmd = [sys.executable, "-m", "tauflow.controller.cli", "run", str(recipe), *options]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def addition_command(prepared: Path, out: Path, *settings: str, evaluate: bool = True) -> list[str]:
    """`tauflow run` of the embedded recipe on the model and data sets its prepare step made in ``prepared``
    (the e2e suites' ``prepared`` fixture), into ``out``, with ``settings``."""
    return run_command(
        ADDITION,
        [
            "prepare=[]",
            f"out_dir={out}",
            f"model={prepared / 'model'}",
            f"dataset={prepared / 'train.jsonl'}",
            f"eval.dataset={prepared / 'heldout.jsonl' if evaluate else ''}",
            "target_accuracy=null",
            *settings,
        ],
    )


def addition_run(prepared: Path, out: Path, *settings: str) -> dict[str, Any]:
    """Runs :func:`addition_command` to its end (exit 0 asserted); returns its summary."""
    return finished_run(addition_command(prepared, out, *settings), out)


def omni_run(prepared: Path, out: Path, *settings: str, text_only: bool = False) -> dict[str, Any]:
    """`tauflow run examples/omni` on what its prepare step made in ``prepared``, to its end; returns its
    summary. ``text_only``: the control, on the same prompts without their image and sound."""
    suffix = "-text-only" if text_only else ""
    sets = [
        "prepare=[]",
        f"out_dir={out}",
        f"model={prepared / 'model'}",
        f"dataset={prepared / f'train{suffix}.jsonl'}",
        f"eval.dataset={prepared / f'heldout{suffix}.jsonl'}",
        *settings,
    ]
    return finished_run(run_command(OMNI, sets), out)


def finished_run(cmd: list[str], out: Path) -> dict[str, Any]:
    """Runs a `tauflow run` command to its end (exit 0 asserted); returns its summary."""
    done = subprocess.run(
        cmd,
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert (out / "summary.png").stat().st_size > 10_000
    return summary


class LiveRun:
    """A `tauflow run` started in the background, and what a test asks of it while it trains."""

    def __init__(self, cmd: list[str], out: Path, env: dict[str, str] | None = None, deadline_s: float = 900) -> None:
        self.out, self.env = out, {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=self.env
        )
        self.deadline = time.monotonic() + deadline_s

    def wait_for(self, what: str, done: Callable[[], bool]) -> None:
        while not done():
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended while waiting for {what}: {self.stderr()}")
            assert time.monotonic() < self.deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def stderr(self) -> str:
        return self.proc.stderr.read()[-3000:] if self.proc.stderr else ""

    def status(self) -> dict[str, Any]:
        """`tauflow status --json`, through the client the command uses (the run found by its directory)."""

        from tauflow.controller.adapters.controller_client import ControllerClient, control_address

        async def ask() -> dict[str, Any]:
            client = ControllerClient(control_address(str(self.out)))
            try:
                status = await client.status()
            finally:
                await client.close()
            return {"run": status.run, "services": status.services}

        return asyncio.run(ask())

    def controller_up(self) -> bool:
        try:
            return bool(json.loads((self.out / "controller.ready.json").read_text()).get("control_address"))
        except (OSError, ValueError):
            return False

    def version(self) -> int:
        return int(self.status()["run"]["policy_version"])

    def serving(self, role: str) -> list[str]:
        return sorted(s["name"] for s in self.status()["services"] if s["role"] == role and s["health"] == "serving")

    def tauflow(self, *args: str) -> str:
        """The `tauflow` command against this run (found by its run directory)."""
        done = subprocess.run(
            [sys.executable, "-m", "tauflow.controller.cli", *args, "--run", str(self.out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=self.env,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def pid(self, name: str) -> int:
        return int(json.loads((self.out / f"{name}.ready.json").read_text())["pid"])

    def finish(self) -> dict[str, Any]:
        _, err = self.proc.communicate(timeout=max(60.0, self.deadline - time.monotonic()))
        assert self.proc.returncode == 0, err[-3000:]
        summary: dict[str, Any] = json.loads((self.out / "summary.json").read_text())
        return summary
