"""The recipes of issue #16 through every service, from a fresh prepare, as `tauflow run` runs them:
GSM8K-format math with an instruct model's chat template (a smoke: a tiny model learns nothing of GSM8K),
code against stdin/stdout tests in the reward's sandbox, and a run rewarded by an LLM judge deployed as its
own rollout server (`judge_model`). Criteria are step-based: what held-out accuracy gains within the steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.runs import ROOT, finished_run, run_command

EXAMPLES = ROOT / "examples"


def recipe_run(name: str, out: Path, paths: dict[str, str], *settings: str) -> dict[str, Any]:
    """`tauflow run examples/<name>` with its prepare step writing into ``out``/prepared; ``paths``: the
    config's keys that name prepared files, relative to that folder."""
    prepared = out / "prepared"
    sets = [
        f"out_dir={out}",
        f"prepare=[python, {EXAMPLES / name / 'prepare.py'}, --out, {prepared}]",
        *(f"{key}={prepared / rel}" for key, rel in paths.items()),
        *settings,
    ]
    return finished_run(run_command(EXAMPLES / name, sets), out)


def accuracies(summary: dict[str, Any]) -> list[float]:
    return [e["accuracy"] for e in summary["evals"]]


def test_gsm8k_smoke_runs_chats_and_the_math_reward_through_every_service(tmp_path: Path) -> None:
    summary = recipe_run("gsm8k", tmp_path, {"model": "model"}, "steps=4", "eval.every_steps=2")
    assert summary["status"] == "completed" and len(summary["steps"]) == 4
    versions = [e["policy_version"] for e in summary["evals"]]  # (an evaluation may come a version late)
    assert versions[0] == 0 and versions[-1] == 4 and all(e["prompts"] == 10 for e in summary["evals"])
    # every step took its groups (a tiny model scores 0 on GSM8K, so they carry no advantage: no learning asked,
    # and a group with no advantage trains no token: tokens/s is 0 unless a sample happened to score)
    assert all(s["groups"] == 4 for s in summary["steps"])


def test_code_recipe_learns_through_the_sandbox(tmp_path: Path) -> None:
    paths = {"model": "model", "dataset": "train.jsonl", "eval.dataset": "heldout.jsonl"}
    summary = recipe_run("code", tmp_path, paths, "steps=30", "target_accuracy=null")
    first, last = accuracies(summary)[0], accuracies(summary)[-1]
    # 16 held-out problems (12 trained on): two more whose greedy program passes every test
    assert last >= first + 2 / 16, accuracies(summary)


def test_genrm_recipe_learns_what_its_judge_deployment_rewards(tmp_path: Path) -> None:
    paths = {"model": "policy", "judge_model": "judge", "dataset": "train.jsonl", "eval.dataset": "heldout.jsonl"}
    summary = recipe_run("genrm", tmp_path, paths, "target_accuracy=null")
    assert "judge" in summary["services"], summary["services"].keys()
    rewards = [s["mean_reward"] for s in summary["steps"]]
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.2, rewards  # the judge's scores rise
    assert accuracies(summary)[-1] >= 0.8, accuracies(summary)
