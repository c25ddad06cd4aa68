"""Omni-modal RL through every service (issue #15): the omni example's tiny Qwen2.5-Omni thinker, warm-started,
learns with GRPO to add the shapes it sees to the tones it hears, and the same run on the same prompts
without their image and sound cannot learn it (no text holds the answer): the media reach the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runs import omni_run

GAIN = 0.25  # held-out accuracy points GRPO must add to the warm start (issue #15)
STEPS = 100  # upper bound: the run stops at the target (here: +25 points by step 20-30)
MAJORITY = 0.275  # the held-out share of the most common answer (5): the best a policy blind to the media can do


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_grpo_learns_from_image_and_sound_and_the_text_alone_cannot(omni_prepared: Path, tmp_path: Path) -> None:
    warm = json.loads((omni_prepared / "prepared.json").read_text())["heldout_accuracy"]
    target = round(warm + GAIN, 3)
    summary = omni_run(
        omni_prepared, tmp_path / "media", f"steps={STEPS}", "eval.every_steps=10", f"target_accuracy={target}",
        "stop_at_target=true",
    )  # fmt: skip
    first, best = summary["evals"][0], max(e["accuracy"] for e in summary["evals"])
    assert first["policy_version"] == 0 and abs(first["accuracy"] - warm) < 0.1  # the services see what prepare saw
    assert best >= target, summary["evals"]
    assert summary["staleness_violations"] == 0
    steps = summary["steps"]
    # the trainer took every group (their media processed, their prompt tokens the processor's) and scored
    # the rollout's tokens as the rollout did: no behaviour KL where a step trained on its own version's data
    assert all("skipped_invalid_media_groups" not in s["metrics"] for s in steps)
    assert min(abs(s["metrics"]["kl_behaviour"]) for s in steps) < 1e-4

    control = omni_run(
        omni_prepared, tmp_path / "text-only", f"steps={max(len(steps), 20)}", "eval.every_steps=10",
        "target_accuracy=null", text_only=True,
    )  # fmt: skip
    accuracies = [e["accuracy"] for e in control["evals"]]
    assert max(accuracies) <= MAJORITY + 0.05, accuracies  # as many steps, and no better than guessing "5"
