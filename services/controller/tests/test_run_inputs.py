"""What a run names on this machine exists before any role starts: a missing model was a Hugging Face "Repo id
must use alphanumeric chars" error from the trainer once four services had started."""

from __future__ import annotations

from pathlib import Path

import pytest

from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.launcher import LaunchFailed


def test_a_missing_model_or_data_set_is_named_before_any_role_starts(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    config = RunConfig(
        model="/nonexist/model", dataset=str(data), steps=1, out_dir=str(tmp_path / "run"),
        eval={"dataset": str(tmp_path / "heldout.jsonl")},
    )  # fmt: skip
    with pytest.raises(LaunchFailed) as e:
        build_run(config, serve_metrics=False).check_inputs()
    assert "model: /nonexist/model does not exist" in str(e.value)
    assert f"eval.dataset: {tmp_path / 'heldout.jsonl'} does not exist" in str(e.value)
    assert "dataset: " + str(data) not in str(e.value)
    # a Hub id is the roles' to resolve; a folder that is there passes
    (tmp_path / "model").mkdir()
    for model in ("Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path / "model")):
        fine = config.model_copy(update={"model": model, "eval": config.eval.model_copy(update={"dataset": ""})})
        build_run(fine, serve_metrics=False).check_inputs()


def test_a_roles_config_error_names_the_run_configs_section_not_the_file_the_controller_wrote() -> None:
    from tauflow.controller.launcher import _settings_named

    line = "unknown config key 'backend.optim.lrr' (from config file /r/out/settings/trainer.json)"
    assert _settings_named(line, "trainer") == (
        "unknown config key 'backend.optim.lrr' (from services.trainer of the run config, or a run key passed on to it)"
    )
    assert _settings_named("(from config file my.yaml)", "queue") == "(from config file my.yaml)"  # a user's file
