"""A resume says what its config changed: run-config.json records the config a run started or resumed with,
and `tauflow run --resume` with another config lists each changed key in summary.json
(``resumed_config_changes``) and the log (configrecord.py)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.configrecord import CONFIG_FILE, config_changes
from tauflow.controller.run import Run


def _run(out: Path, *, resume: bool = False, **config: Any) -> Run:
    values: dict[str, Any] = {"model": "m", "dataset": "d", "steps": 10, **config}
    run = build_run(RunConfig(out_dir=str(out), resume=resume, **values), serve_metrics=False)
    run.claim_out_dir()  # (as the run's start does: the record is settled once out_dir is the run's)
    run._release_out_dir()
    return run


def test_a_resume_with_another_config_records_each_change_and_one_with_the_same_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    first = _run(out, services={"trainer": {"backend": {"lr": 1e-5}}})
    assert "resumed_config_changes" not in first.summary.extra
    recorded = json.loads((out / CONFIG_FILE).read_text())["config"]
    assert recorded["steps"] == 10 and recorded["services.trainer.backend.lr"] == 1e-5 and "resume" not in recorded

    assert (
        "resumed_config_changes"
        not in _run(out, resume=True, services={"trainer": {"backend": {"lr": 1e-5}}}).summary.extra
    )

    with caplog.at_level(logging.WARNING):
        resumed = _run(out, resume=True, steps=40, dataset="other", services={"trainer": {"backend": {"lr": 2e-5}}})
    assert resumed.summary.extra["resumed_config_changes"] == {
        "dataset": ["d", "other"],
        "services.trainer.backend.lr": [1e-5, 2e-5],
        "steps": [10, 40],
    }
    # said in the log's text (tauflow run logs this before its log's format is set up: an extra would be lost)
    [said] = [r.getMessage() for r in caplog.records if "differs from the one it started with" in r.getMessage()]
    assert "steps 10 -> 40" in said and "dataset 'd' -> 'other'" in said
    # the next resume is compared with the run's start still: a resume that died before its summary hides nothing
    again = _run(out, resume=True, steps=40, dataset="other", services={"trainer": {"backend": {"lr": 2e-5}}})
    assert again.summary.extra["resumed_config_changes"] == resumed.summary.extra["resumed_config_changes"]
    # where the run's files are is not what it trains
    assert (
        "resumed_config_changes"
        not in _run(out, resume=True, services={"trainer": {"backend": {"lr": 1e-5}}}).summary.extra
    )
    relative = _run(Path(os.path.relpath(out)), resume=True, services={"trainer": {"backend": {"lr": 1e-5}}})
    assert "resumed_config_changes" not in relative.summary.extra


def test_a_new_run_sets_the_previous_record_aside_and_reports_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run(out, steps=10)
    fresh = _run(out, steps=99)
    assert "resumed_config_changes" not in fresh.summary.extra
    assert json.loads((out / CONFIG_FILE).read_text())["config"]["steps"] == 99
    assert json.loads((out / (CONFIG_FILE + ".prev")).read_text())["config"]["steps"] == 10


def test_secrets_never_reach_the_record_and_a_damaged_record_reports_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run(out, services={"reward": {"functions": {"genrm": {"config": {"api_key": "sk-live-123"}}}}})
    assert "sk-live-123" not in (out / CONFIG_FILE).read_text()
    # a changed secret is not reported (it is not recorded); other changes are
    resumed = _run(
        out, resume=True, steps=11, services={"reward": {"functions": {"genrm": {"config": {"api_key": "sk-2"}}}}}
    )
    assert resumed.summary.extra["resumed_config_changes"] == {"steps": [10, 11]}

    for damage in (
        b"{not json",
        b'{"format": 1, "config": [1]}',
        b"\xff\xfe",
        b" " * (2 * 1024 * 1024),
        b"[" * 100_000,
    ):
        (out / CONFIG_FILE).write_bytes(damage)
        run = _run(out, resume=True, steps=12)
        assert "resumed_config_changes" not in run.summary.extra
        assert json.loads((out / CONFIG_FILE).read_text())["config"]["steps"] == 12  # recorded anew


def test_config_changes_name_keys_added_and_removed() -> None:
    assert config_changes({"a": 1, "b": 2}, {"a": 1, "c": 3}) == {"b": [2, None], "c": [None, 3]}
    assert config_changes({"a": [1, 2]}, {"a": [1, 2]}) == {}
