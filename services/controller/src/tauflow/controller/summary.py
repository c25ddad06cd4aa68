"""The run summary: a JSON file and a PNG of reward and held-out accuracy against steps and time,
with the histogram of delivered staleness."""

from __future__ import annotations

import io
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tauflow.controller.dial import StalenessLedger, TauChange
from tauflow.controller.launcher import replace_file

# The τ changes a summary keeps (the last ones; ``max_staleness_changes_total`` counts them all): a client
# that toggles τ must not grow the summary, its plot's title or the controller's memory without bound. The
# violations are counted over every change (dial.py), kept or not.
MAX_TAU_CHANGES_KEPT = 100


@dataclass
class StepRecord:
    step: int
    policy_version: int
    time_s: float  # since the run started
    mean_reward: float
    max_staleness: int
    mean_staleness: float
    loss: float
    trained_tokens: int
    groups: int
    metrics: dict[str, float] = field(default_factory=dict)
    committed_s: float = 0.0  # when the trainer committed it, since the run started (time_s: when seen; clamped
    # between the step before it and time_s, against a step of either process's wall clock)
    groups_by_staleness: dict[int, int] = field(default_factory=dict)  # its trained groups by staleness


@dataclass
class EvalRecord:
    policy_version: int
    time_s: float
    accuracy: float
    prompts: int
    engine_version: int = 0  # the oldest version the rollout engine answered with


def json_text(value: Any, indent: int = 2) -> str:
    """``value`` as standard JSON: a float that is not finite (a step's NaN loss, an infinite mean reward)
    becomes null. Python writes NaN and Infinity, which JSON has not: JavaScript's JSON.parse, Go's and
    Rust's decoders refuse the whole file."""
    return json.dumps(_finite(value), indent=indent, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


@dataclass
class RunSummary:
    name: str
    max_staleness: int
    steps_planned: int
    steps: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    staleness_histogram: dict[int, int] = field(default_factory=dict)  # staleness -> groups
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    status: str = "running"
    message: str = ""
    target_accuracy: float | None = None
    # role -> what the compatibility check learnt of it: build_version, contracts (package -> revision),
    # checks (at start, then once per restart)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # tauflow set max-staleness, in order: the last MAX_TAU_CHANGES_KEPT of them; how many there were in all
    max_staleness_changes: list[TauChange] = field(default_factory=list)
    max_staleness_changes_total: int = 0
    # (seconds since the start, rollout replicas): the start's count, then each change carried out
    rollout_replicas: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ledger = StalenessLedger(self.max_staleness)  # (not a field: the summary's JSON holds its count)

    @property
    def final_accuracy(self) -> float | None:
        return self.evals[-1].accuracy if self.evals else None

    @property
    def staleness_violations(self) -> int:
        """Groups trained with a staleness above the τ in force at their delivery (dial.py), counted from the
        steps as the trainer listed them, each once as it came; the invariant says 0."""
        return self._ledger.violations

    @property
    def ledger(self) -> StalenessLedger:
        return self._ledger

    def add_step(self, record: StepRecord) -> None:
        """A step the trainer listed (after the ones before it): kept, its staleness counted and judged."""
        self.steps.append(record)
        for staleness, groups in record.groups_by_staleness.items():
            self.staleness_histogram[staleness] = self.staleness_histogram.get(staleness, 0) + groups
        self._ledger.step(record.step, record.groups_by_staleness)

    def tau_change_begins(self, from_version: int) -> None:
        """A change of τ is under way from the trainer's ``from_version``: the steps from there wait for it."""
        self._ledger.begin(from_version)

    def tau_changed(self, change: TauChange) -> None:
        self._ledger.changed(change)
        self.max_staleness_changes.append(change)
        self.max_staleness_changes_total += 1
        if len(self.max_staleness_changes) > MAX_TAU_CHANGES_KEPT:
            del self.max_staleness_changes[0]

    def tau_change_failed(self) -> None:
        """The change under way did not happen (for this run's accounting: a role could not be reached)."""
        self._ledger.abandoned()

    def time_to_accuracy(self, threshold: float) -> float | None:
        return next((e.time_s for e in self.evals if e.accuracy >= threshold), None)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["final_accuracy"] = self.final_accuracy
        data["staleness_violations"] = self.staleness_violations
        data["time_to_accuracy_s"] = {str(t): self.time_to_accuracy(t) for t in (0.6, 0.7, 0.8)}
        data["staleness_histogram"] = {str(k): v for k, v in sorted(self.staleness_histogram.items())}
        return data

    def write(self, out_dir: Path) -> tuple[Path, Path]:
        """``summary.json``, then ``summary.png``, each replaced whole and durably (a temporary file in
        ``out_dir``, fsynced, renamed over it): a full disk never leaves an empty or half summary. Raises
        OSError when one cannot be written; that file is then as it was (the previous run's, or none), and
        the PNG is not attempted after a JSON that failed (the two stay a pair)."""
        json_path = self.write_json(out_dir)
        png_path = out_dir / "summary.png"
        plot(self, png_path)
        return json_path, png_path

    def write_json(self, out_dir: Path) -> Path:
        """``summary.json`` alone, replaced whole and durably (raises OSError, the file as it was)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / "summary.json"
        replace_file(json_path, json_text(self.to_json()).encode(), durable=True)
        return json_path


def plot(summary: RunSummary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # (its INFO lines were the service log's last)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = [s.step for s in summary.steps]
    times = [s.time_s for s in summary.steps]
    rewards = [s.mean_reward for s in summary.steps]
    for ax, xs, label in ((axes[0], steps, "optimizer step"), (axes[1], times, "wall time (s)")):
        ax.plot(xs, rewards, color="tab:blue", alpha=0.35, label="batch reward")
        if summary.evals:
            ex: list[float] = (
                [e.policy_version for e in summary.evals] if xs is steps else [e.time_s for e in summary.evals]
            )
            ax.plot(ex, [e.accuracy for e in summary.evals], "o-", color="tab:green", label="held-out accuracy")
        if summary.target_accuracy is not None:
            ax.axhline(summary.target_accuracy, color="tab:red", linestyle="--", linewidth=1, label="target")
        ax.set_xlabel(label)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    kept = summary.max_staleness_changes
    taus = "→".join(str(t) for t in [summary.max_staleness, *(c.tau for c in kept[-5:])])
    if summary.max_staleness_changes_total > min(len(kept), 5):  # the first τ, then the last five changes
        left_out = summary.max_staleness_changes_total - min(len(kept), 5)
        taus = taus.replace("→", f"→({left_out} changes)→", 1)
    axes[0].set_title(f"{summary.name}: reward and accuracy by step (tau={taus})")
    axes[1].set_title("by wall time")
    hist = sorted(summary.staleness_histogram.items())
    axes[2].bar([str(k) for k, _ in hist], [v for _, v in hist], color="tab:purple")
    axes[2].set_title("delivered staleness (groups)")
    axes[2].set_xlabel("staleness (steps)")
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=90, format="png")
    finally:
        plt.close(fig)
    replace_file(path, image.getvalue(), durable=True)  # (never half a PNG)
