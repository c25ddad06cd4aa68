"""The run config's one temperature: both the sampler and the trainer's log-probs get it, and a second,
different one set per service is refused instead of silently skewing every importance ratio."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig


def test_the_run_temperature_reaches_the_sampler_and_the_trainer(tmp_path) -> None:
    run = build_run(RunConfig(model="m", dataset="d", steps=1, temperature=1.2, out_dir=str(tmp_path)))
    assert run._settings("rollout", {})["sampling.temperature"] == 1.2
    assert run._settings("trainer", {})["backend.temperature"] == 1.2


@pytest.mark.parametrize(
    "services",
    [
        {"rollout": {"sampling": {"temperature": 0.7}}},
        {"trainer": {"backend.temperature": 0.7}},  # a dotted key is the same key
    ],
)
def test_a_second_temperature_per_service_is_refused_with_both_values(services) -> None:
    with pytest.raises(ValidationError, match=r"temperature is 0.7 but the run's temperature is 1.2"):
        RunConfig(model="m", dataset="d", steps=1, temperature=1.2, services=services)


def test_the_same_temperature_repeated_per_service_is_accepted() -> None:
    config = RunConfig(
        model="m",
        dataset="d",
        steps=1,
        temperature=1.2,
        services={"rollout": {"sampling": {"temperature": 1.2, "max_new_tokens": 4}}},
    )
    assert config.temperature == 1.2


def test_remax_without_the_rollouts_greedy_completions_is_refused() -> None:
    trainer = {"backend": {"algorithm": "remax"}}
    with pytest.raises(ValidationError, match="greedy_baseline"):
        RunConfig(model="m", dataset="d", steps=1, services={"trainer": trainer})
    with pytest.raises(ValidationError, match="greedy_baseline"):  # the estimator named in the options too
        RunConfig(
            model="m", dataset="d", steps=1, services={"trainer": {"backend.algorithm_options": {"estimator": "remax"}}}
        )
    RunConfig(model="m", dataset="d", steps=1, services={"trainer": trainer, "rollout": {"greedy_baseline": True}})
