"""What the tests that run a whole `tauflow run` share: the tiny model of the embedded task, the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ADDITION = ROOT / "examples" / "addition"


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
    done = subprocess.run(
        addition_command(prepared, out, *settings),
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
