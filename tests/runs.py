"""What the tests that run a whole `tauflow run` share: the tiny model of the embedded task, the command."""

from __future__ import annotations

import sys
from pathlib import Path

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
