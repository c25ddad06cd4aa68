"""Each algorithm family learns the embedded task through every service (issue #14): a step-based criterion,
never wall-clock. The warm-started model answers about a third of the held-out problems; each family must
take greedy held-out accuracy past TARGET within STEPS steps (the run stops once an evaluation reaches it,
which keeps CI short). GRPO's own test is test_addition.py; bench/algorithms.py compares the families side
by side at a fixed number of steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.runs import addition_run as run

STEPS = 300  # upper bound: bench/algorithms.py measured each family past TARGET well before this
# measured (75 steps, 2026-12-06): last ten steps' KL / first ten's 0.92 at 30, 0.73 at 60. Held-out accuracy
# climbs slowly and unevenly at the recipe's 3e-4: 45.8 % at 50 and 52.0 % at 100 in examples/distillation's
# table, but two e2e runs (2026-12-07) stayed at 39-43.6 % through 60 and 90 steps, under the 45 % target;
# that table's run reached 62.2 % at 125.
OPD_STEPS = 125
TARGET = 0.45  # +10 points over the warm start (34.6 %), about 5 standard errors of the 500-prompt held-out set

FAMILIES = {
    "rloo": {},
    "reinforce_pp_baseline": {},
    "gspo": {"mini_batches": 2},  # its sequence-level clip binds from the second update on
    # one update a step (its gradient is then GRPO's): with two at the recipe's learning rate CISPO collapsed
    # in both runs here (35 % -> 22-33 %; bench/README.md), keeping the push on tokens PPO's clip stops
    "cispo": {},
    # PPO updates: four per step, one policy version; with the rollout's dynamic sampling (SETTINGS)
    "dapo": {"mini_batches": 2, "epochs": 2},
    "ppo": {},  # GAE with a critic in the trainer (its own optimizer: SETTINGS)
    # on-policy distillation from the distillation recipe's teacher (92 %), run in the trainer: the full
    # per-token reverse KL (the advantage form is tested in the trainer's suite; bench/README.md has both)
    "opd": {"opd_loss": "reverse_kl"},
}
# Settings a family needs beyond its options: PPO's critic learning rate (bench/README.md: 1e-3, about 3x
# the policy's peak, took PPO from 32.8 % to 67.4 % in 150 steps); DAPO's dynamic sampling, which keeps
# groups of equal rewards out of the queue and refills their room.
SETTINGS = {
    "ppo": ["services.trainer.backend.critic_optim.lr=1e-3"],
    "dapo": ["services.rollout.dynamic_sampling.enabled=true"],
}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # steps decide, not the clock: a loaded machine only makes it slower
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_raises_heldout_accuracy_through_every_service(
    name: str, prepared: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The recipe's aggregation, but GSPO's own (per sequence): the override merges into the recipe's options.
    aggregation = "seq-mean-token-mean" if name == "gspo" else "seq-mean-token-sum"
    options = {"aggregation": aggregation, **FAMILIES[name]}
    # Distillation runs a fixed OPD_STEPS rather than stopping at the target: its KL check below compares the
    # first ten steps with the last ten, and a run that hit the target at its first evaluation (step 25) had
    # too few steps between them for the KL to fall by the margin (0.94 of its start, not 0.85).
    summary = run(
        prepared,
        tmp_path / "run",
        f"steps={OPD_STEPS if name == 'opd' else STEPS}",
        "eval.every_steps=25",
        "max_staleness=1",
        # (distillation's run has no target: it runs its steps, and its last evaluation may dip below the best
        # one, which would make the run's exit code "below target"; the criterion is the best, checked below)
        *(["target_accuracy=null"] if name == "opd" else [f"target_accuracy={TARGET}", "stop_at_target=true"]),
        "services.trainer.backend.optim.total_steps=1500",
        f"services.trainer.backend.algorithm={name}",
        "services.trainer.backend.algorithm_options=" + repr(options).replace("'", '"'),
        *SETTINGS.get(name, []),
        *(
            [f"services.trainer.backend.teacher_model_path={request.getfixturevalue('teacher')}"]
            if name == "opd"
            else []
        ),
    )
    first, best = summary["evals"][0], max(e["accuracy"] for e in summary["evals"])
    assert first["policy_version"] == 0 and first["accuracy"] < TARGET - 0.05
    assert best >= TARGET, summary["evals"]
    assert summary["staleness_violations"] == 0
    updates = {s["metrics"].get("updates") for s in summary["steps"]}
    expected = FAMILIES[name].get("mini_batches", 1) * FAMILIES[name].get("epochs", 1)
    assert updates == {float(expected)}, updates  # and still one policy version per step
    assert [s["policy_version"] for s in summary["steps"]] == list(range(1, len(summary["steps"]) + 1))
    if name == "dapo":  # every step full, and full of groups with a signal: the filter worked, the room refilled
        assert {s["groups"] for s in summary["steps"]} == {64}
        assert sum(s["metrics"]["skipped_zero_advantage_groups"] for s in summary["steps"]) == 0
    if name == "opd":  # no reward trained on: the student moved towards the teacher
        kl = [s["metrics"]["kl_teacher"] for s in summary["steps"]]
        assert sum(kl[-10:]) / 10 < 0.85 * sum(kl[:10]) / 10, (kl[:10], kl[-10:])
    if name == "ppo":  # the critic trained beside the policy, one update of each per update
        assert all(s["metrics"]["critic_updates"] == expected for s in summary["steps"])
        # as the policy's returns rise (a third of the samples right at first, more later), its values follow
        gaps = sorted(abs(s["metrics"]["value_mean"] - s["metrics"]["return_mean"]) for s in summary["steps"][-20:])
        assert gaps[len(gaps) // 2] < 0.1, gaps


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_teacher_as_its_own_deployment_scores_the_students_tokens(
    prepared: Path, teacher: Path, tmp_path: Path
) -> None:
    # teacher_model: tauflow run starts a rollout server of its own for the teacher (no data set, no weight
    # sidecar) before the trainer, which asks it for the log-probs of every sampled token (ComputeLogprobs):
    # on-policy distillation's advantage form with the teacher as a deployment, not in the trainer's process.
    summary = run(
        prepared, tmp_path / "run", "steps=10", "eval.every_steps=10", "max_staleness=1",
        "target_accuracy=null", "services.trainer.backend.algorithm=opd", f"teacher_model={teacher}",
    )  # fmt: skip
    assert summary["services"]["teacher"]["contracts"]["tauflow.api.rollout.v1"] >= 3  # checked: it scores
    kl = [s["metrics"]["kl_teacher"] for s in summary["steps"]]
    assert len(kl) == 10 and all(math.isfinite(x) for x in kl)
    assert sum(kl) / len(kl) > 0.3, kl  # the 92 % teacher and the 33 % student disagree, token by token
    assert summary["staleness_violations"] == 0
