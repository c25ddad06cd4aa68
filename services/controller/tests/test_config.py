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


def test_a_teacher_model_is_a_rollout_server_of_its_own_started_before_the_trainer(tmp_path) -> None:
    run = build_run(RunConfig(model="m", dataset="d", steps=1, teacher_model="teacher-folder", out_dir=str(tmp_path)))
    assert run.roles == ["queue", "reward", "weights", "teacher", "trainer", "rollout"]
    spec = run._spec("teacher", 0, {"queue": "127.0.0.1:1", "weights": "127.0.0.1:2"})
    assert (spec.name, spec.role, spec.module) == ("teacher", "teacher", "rollout")  # python -m tauflow.rollout
    assert spec.settings["model_path"] == "teacher-folder" and spec.settings["server_id"] == "teacher"
    # it scores only: no data set (no producer loop), no weight sidecar (its weights never change)
    assert not {"dataset", "weights_address", "queue_address"} & set(spec.settings)
    assert run._settings("trainer", {"teacher": "127.0.0.1:7"})["backend.teacher_address"] == "127.0.0.1:7"
    plain = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path)))
    assert "teacher" not in plain.roles and "backend.teacher_address" not in plain._settings("trainer", {})


@pytest.mark.parametrize(
    ("env", "apart"),
    [
        ({"TAUFLOW_TRAINER_BACKEND__DEVICE": "cuda"}, True),
        ({"TAUFLOW_ROLLOUT_ENGINE_OPTIONS__DEVICE": "cuda:0"}, True),
        ({"TAUFLOW_WEIGHTS_BACKEND": "ipc"}, True),
        ({"TAUFLOW_TRAINER_BACKEND": "{device: cuda}"}, True),  # a whole section, as the process reads it
        ({"TAUFLOW_TRAINER_BACKEND__DEVICE": "cpu"}, False),
    ],
)
def test_a_device_set_in_the_environment_the_roles_inherit_orders_the_waves_too(
    tmp_path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], apart: bool
) -> None:
    # the roles read TAUFLOW_<ROLE>_<KEY> from the environment they inherit: the wave rule read the config only
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path)))
    assert run.start_waves()[1:] == ([["trainer"], ["rollout"]] if apart else [["trainer", "rollout"]])
    # the run config's own setting wins (the launcher leaves out a variable the run's settings cover)
    services = {"trainer": {"backend": {"device": "cpu"}}, "rollout": {"engine_options": {"device": "cpu"}}}
    pinned = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path), services=services))
    ipc = "TAUFLOW_WEIGHTS_BACKEND" in env
    assert pinned.start_waves()[1:] == ([["trainer"], ["rollout"]] if ipc else [["trainer", "rollout"]])


@pytest.mark.parametrize(
    ("extra", "waves"),
    [
        ({}, [["queue", "reward", "weights"], ["trainer", "rollout"]]),
        ({"teacher_model": "t"}, [["queue", "reward", "weights", "teacher"], ["trainer", "rollout"]]),
        ({"judge_model": "j"}, [["queue", "judge", "weights"], ["reward", "trainer"], ["rollout"]]),
        # the sidecar's ipc backend: trainer and rollout share a device, and the trainer takes its memory first
        ({"services": {"weights": {"backend": "ipc"}}}, [["queue", "reward", "weights"], ["trainer"], ["rollout"]]),
        # either one on a GPU: they may share it, and the trainer takes its memory first, as one at a time
        (
            {"services": {"trainer": {"backend": {"device": "cuda"}}}},
            [["queue", "reward", "weights"], ["trainer"], ["rollout"]],
        ),
        (
            {"services": {"rollout": {"engine_options": {"device": "cuda:0"}}}},
            [["queue", "reward", "weights"], ["trainer"], ["rollout"]],
        ),
        (
            {"services": {"trainer": {"backend": {"device": "cpu"}}}},
            [["queue", "reward", "weights"], ["trainer", "rollout"]],
        ),
    ],
)
def test_roles_start_in_waves_once_the_peers_they_are_given_serve(
    tmp_path, extra: dict, waves: list[list[str]]
) -> None:
    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path), **extra))
    assert run.start_waves() == waves and sorted(role for wave in waves for role in wave) == sorted(run.roles)
    every = {role: f"127.0.0.1:{port}" for port, role in enumerate(run.roles, 1)}
    started: dict[str, str] = {}
    for wave in waves:  # each role's settings name no address of its own wave or a later one
        for role in wave:
            assert run._settings(role, started) == run._settings(role, every), role
        started |= {role: every[role] for role in wave}


def test_a_teacher_server_is_refused_where_it_cannot_work() -> None:
    with pytest.raises(ValidationError, match="launcher external starts nothing"):
        RunConfig(
            model="m", dataset="d", steps=1, teacher_model="t", launcher="external",
            external={r: "h:1" for r in ("queue", "reward", "weights", "trainer", "rollout")},
        )  # fmt: skip
    with pytest.raises(ValidationError, match="set one teacher"):
        RunConfig(
            model="m", dataset="d", steps=1, teacher_model="t",
            services={"trainer": {"backend": {"teacher_model_path": "t"}}},
        )  # fmt: skip


def test_the_teacher_server_takes_settings_of_its_own(tmp_path) -> None:
    # a real teacher runs on a GPU: services.teacher reaches its process (and its Ray actor asks for one)
    from tauflow.controller.raylauncher import role_resources

    config = RunConfig(
        model="m", dataset="d", steps=1, teacher_model="t", out_dir=str(tmp_path),
        services={"teacher": {"engine_options": {"device": "cuda"}, "max_score_tokens": 65536}},
    )  # fmt: skip
    spec = build_run(config)._spec("teacher", 0, {})
    assert spec.settings["engine_options.device"] == "cuda" and spec.settings["max_score_tokens"] == 65536
    assert role_resources("teacher", spec.settings, config.ray)["num_gpus"] == 1.0


def test_the_rollouts_generation_budget_is_the_trainers_dr_grpo_constant(tmp_path) -> None:
    # Dr. GRPO divides by the generation budget (MAX_TOKENS), verl by its padded response length: the same
    # number, which only the rollout's config holds
    services = {"rollout": {"sampling": {"max_new_tokens": 48}}}
    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path), services=services))
    assert run._settings("trainer", {})["backend.response_tokens"] == 48
    unset = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path)))
    assert "backend.response_tokens" not in unset._settings("trainer", {})
