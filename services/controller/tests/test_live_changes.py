"""A run's live changes (tauflow set max-staleness, tauflow scale rollout) survive the controller's death:
live.json records them, and `tauflow run --resume` goes on with them (livechanges.py), unless the resume's
config sets the key itself."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tauflow.controller import livechanges
from tauflow.controller import run as run_module
from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.livechanges import LIVE_FILE
from tauflow.controller.ports import TrainerStatus
from tauflow.controller.run import Run


class Role:
    def __init__(self) -> None:
        self.taus: list[int] = []

    async def status(self) -> TrainerStatus:
        return TrainerStatus("TRAINER_STATE_TRAINING", 3, False)

    async def set_max_staleness(self, tau: int) -> None:
        self.taus.append(tau)


def _run(out: Path, *, resume: bool = False, **config: Any) -> Run:
    values: dict[str, Any] = {"model": "m", "dataset": "d", "steps": 10, "max_staleness": 1, **config}
    run = build_run(RunConfig(out_dir=str(out), resume=resume, **values), serve_metrics=False)
    run.claim_out_dir()  # (as the run's start does: the live record is settled once out_dir is the run's)
    run._release_out_dir()
    run._peers = SimpleNamespace(trainer=Role(), queue=Role())  # type: ignore[assignment]
    return run


def _live(out: Path) -> dict[str, Any]:
    return json.loads((out / LIVE_FILE).read_text())


def test_a_resumed_run_goes_on_with_the_tau_and_replicas_set_live(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _run(out, rollout={"replicas": 2})
    assert not (out / LIVE_FILE).exists()  # nothing changed yet: nothing recorded
    asyncio.run(first.set_max_staleness(4))
    first.scale_rollout(5)
    assert _live(out)["live"] == {"max_staleness": 4, "rollout_replicas": 5}
    assert _live(out)["config"] == {"max_staleness": 1, "rollout_replicas": 2}

    # the controller dies; `tauflow run --resume` with the same config
    resumed = _run(out, resume=True, rollout={"replicas": 2})
    assert resumed.config.max_staleness == resumed.tau == resumed.progress.max_staleness == 4
    assert resumed.scaler.target == resumed.config.rollout.replicas == 5
    assert resumed.summary.max_staleness == 4  # the bound its steps are judged by
    assert resumed.summary.extra["resumed_live_changes"] == {"max_staleness": 4, "rollout_replicas": 5}
    # the queue and the trainer it starts get that τ; launched elsewhere (external), they are given it
    assert resumed._settings("queue", {})["max_staleness"] == 4
    assert resumed._settings("trainer", {})["max_staleness"] == 4
    assert resumed._tau_diverged

    # a change of the resumed run is recorded against the user's config still: a second resume goes on with it
    asyncio.run(resumed.set_max_staleness(0))
    assert _live(out) == {
        "format": 1,
        "config": {"max_staleness": 1, "rollout_replicas": 2},
        "live": {"max_staleness": 0, "rollout_replicas": 5},
    }
    assert _run(out, resume=True, rollout={"replicas": 2}).config.max_staleness == 0


def test_a_stopping_run_refuses_live_changes_and_records_none(tmp_path: Path) -> None:
    # After StopRun a scale was answered OK and written to live.json (a --resume then started two replicas
    # where the config said one), and a τ change went to closed channels: INTERNAL.
    out = tmp_path / "run"
    run = _run(out)
    run.request_stop("done for today")
    with pytest.raises(run_module.RunNotLive, match="stopping"):
        run.scale_rollout(2)
    with pytest.raises(run_module.RunNotLive, match="stopping"):
        asyncio.run(run.set_max_staleness(4))
    assert run.scaler.target == 1 and run.tau == 1
    assert not (out / LIVE_FILE).exists()


def test_a_follow_that_ends_by_cancellation_or_failure_leaves_no_peers_for_live_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(tmp_path / "run")
    run._peers = None
    seen: list[object] = []

    @contextlib.asynccontextmanager
    async def connect(addresses: Any) -> Any:
        yield SimpleNamespace(trainer=Role(), queue=Role())

    for ending in (asyncio.CancelledError, RuntimeError("a poll failed")):

        async def loop(*args: Any, ending: BaseException | type[BaseException] = ending) -> None:
            seen.append(run._peers)
            raise ending

        monkeypatch.setattr(run, "connect", connect)
        monkeypatch.setattr(run, "_follow", loop)
        with pytest.raises((asyncio.CancelledError, RuntimeError)):
            asyncio.run(run.follow({}))
        assert seen[-1] is not None  # live changes could reach the roles while it followed
        assert run._peers is None
        with pytest.raises(run_module.RunNotLive):
            run.scale_rollout(2)


def test_a_value_set_for_the_resume_wins_over_the_live_change(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _run(out)
    asyncio.run(first.set_max_staleness(4))
    first.scale_rollout(3)
    resumed = _run(out, resume=True, max_staleness=8)  # --resume --set max_staleness=8
    assert resumed.config.max_staleness == resumed.tau == 8
    assert resumed.scaler.target == 3  # the key the resume left alone keeps its live value
    assert resumed.resumed_live == {"rollout_replicas": 3}
    # recorded again against the resume's config at once: a second resume with that config runs at 8, not at
    # the first run's live 4 (which it took back before); one with the file's config, at the config's value
    assert _live(out) == {
        "format": 1,
        "config": {"max_staleness": 8, "rollout_replicas": 1},
        "live": {"max_staleness": 8, "rollout_replicas": 3},
    }
    assert _run(out, resume=True, max_staleness=8).tau == 8
    plain = _run(out, resume=True)
    assert plain.tau == 1 and plain.scaler.target == 3  # (its τ differs from the recorded config's: it wins)


def test_a_new_run_forgets_a_previous_runs_live_changes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    asyncio.run(_run(out).set_max_staleness(4))
    fresh = _run(out)  # no --resume: a new run in the same out_dir
    assert fresh.config.max_staleness == 1 and not (out / LIVE_FILE).exists()
    # (set aside one generation back, as the previous run's checkpoints and queue log are)
    assert json.loads((out / (LIVE_FILE + ".prev")).read_text())["live"]["max_staleness"] == 4
    assert _run(out, resume=True).config.max_staleness == 1  # and a resume of it has none to go on with


def _record(form: int, live: dict[str, Any]) -> bytes:
    return json.dumps({"format": form, "config": {"max_staleness": 1, "rollout_replicas": 1}, "live": live}).encode()


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        _record(2, {}),
        _record(1, {"max_staleness": -2}),
        _record(1, {"max_staleness": 2, "rollout_replicas": 257}),
        _record(1, {"max_staleness": True, "rollout_replicas": 1}),
        _record(1, {"max_staleness": 1e400, "rollout_replicas": 1}),
        b"[" * 100_000,
        b" " * (livechanges.MAX_LIVE_FILE_BYTES + 1),
    ],
)
def test_a_damaged_record_is_ignored_with_a_warning(
    tmp_path: Path, damage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / LIVE_FILE).write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="tauflow.controller.livechanges"):
        resumed = _run(out, resume=True)
    assert resumed.config.max_staleness == resumed.tau == 1 and resumed.scaler.target == 1
    assert resumed.resumed_live == {} and "damaged" in caplog.text


def test_a_record_that_cannot_be_written_is_logged_once_and_written_at_a_later_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    run = _run(out)
    real = livechanges.replace_file
    full = True

    def replace_file(path: Any, data: bytes, **kw: Any) -> None:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data, **kw)

    monkeypatch.setattr(livechanges, "replace_file", replace_file)
    with caplog.at_level(logging.ERROR, logger=run_module.__name__):
        asyncio.run(run.set_max_staleness(4))  # the change is in force all the same
        assert run.tau == 4 and not (out / LIVE_FILE).exists()
        run._record_live()  # the follow loop's passes: tried again, not logged again
        run._record_live()
    assert caplog.text.count("could not record a live change") == 1
    assert caplog.records[0].error.startswith("disk full")  # type: ignore[attr-defined]
    full = False
    run._record_live()
    assert _live(out)["live"]["max_staleness"] == 4


def test_a_target_that_fell_back_is_what_is_recorded(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = _run(out)
    run.scale_rollout(6)
    run.scaler.target = 3  # (a replica could not start: scaling.py lowers the target)
    run._record_live()  # the follow loop's pass
    assert _live(out)["live"]["rollout_replicas"] == 3


@pytest.mark.parametrize(
    "argv",
    [
        ["scale", "rollout", "99999999999999999999"],
        ["scale", "rollout", "-1"],
        ["scale", "rollout", "257"],
        ["set", "max-staleness", "99999999999999999999"],
        ["set", "max-staleness", "-2"],
    ],
)
def test_the_cli_refuses_a_value_beyond_the_contracts_bounds_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # (a value beyond the protobuf field's range was a traceback and exit 1)
    from tauflow.controller.cli import build_parser

    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args([*argv, "--run", "127.0.0.1:1"])
    assert ended.value.code == 2
    assert "from " in capsys.readouterr().err
    assert build_parser().parse_args(["set", "max-staleness", "-1", "--run", "x"]).value == -1
    assert build_parser().parse_args(["scale", "rollout", "256", "--run", "x"]).replicas == 256
