"""One run per out_dir: a second ``tauflow run`` on a live run's folder moved its checkpoints and queue log
aside, deleted its older checkpoint and overwrote its ready file and summary before it failed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.run import LOCK_FILE, OutDirInUse


def _config(out_dir: Path) -> RunConfig:
    return RunConfig(model="m", dataset="d", steps=10, out_dir=str(out_dir))


async def test_a_second_run_on_a_live_runs_out_dir_is_refused_before_it_touches_anything(tmp_path: Path) -> None:
    out = tmp_path / "run"
    live = build_run(_config(out), serve_metrics=False)
    live.claim_out_dir()
    (out / "checkpoints" / "v00000050").mkdir(parents=True)
    (out / "queue-wal").mkdir()
    (out / "summary.json").write_text('{"status": "running"}')
    (out / "live.json").write_text('{"format": 1}')  # the live run's record of its τ and scale changes
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))

    for resume in (False, True):
        second = build_run(_config(out).model_copy(update={"resume": resume}), serve_metrics=False)
        with pytest.raises(OutDirInUse, match=r"in use by another tauflow run \(controller pid \d+\)"):
            await second.execute()
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
        assert (out / "live.json").read_text() == '{"format": 1}'
    assert (out / "summary.json").read_text() == '{"status": "running"}'

    live._release_out_dir()  # the live run ended: the folder is free again
    second = build_run(_config(out), serve_metrics=False)
    second.claim_out_dir()
    second._release_out_dir()


def test_a_dead_controllers_lock_is_no_lock(tmp_path: Path) -> None:
    # flock: the kernel lets it go with the process (a controller killed -9 leaves run.lock, not the lock)
    out = tmp_path / "run"
    script = textwrap.dedent(f"""
        from tauflow.controller.app import build_run
        from tauflow.controller.config import RunConfig
        build_run(RunConfig(model="m", dataset="d", steps=10, out_dir={str(out)!r}), serve_metrics=False).claim_out_dir()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert (out / LOCK_FILE).exists()
    run = build_run(_config(out), serve_metrics=False)
    run.claim_out_dir()
    run._release_out_dir()


def test_tauflow_run_on_a_live_runs_out_dir_exits_2_saying_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from tauflow.controller import cli

    printed = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=printed, width=400))
    out = tmp_path / "out"
    live = build_run(_config(out), serve_metrics=False)
    live.claim_out_dir()
    config = tmp_path / "run.yaml"
    config.write_text(f"model: m\ndataset: d\nsteps: 1\nout_dir: {out}\n")
    try:
        assert cli.main(["run", str(config)]) == 2
    finally:
        live._release_out_dir()
    assert "is in use by another tauflow run" in printed.getvalue()


def test_a_filesystem_without_flock_runs_unguarded_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # NFS mounted nolock answers ENOLCK: that is no other run, and every run there refused would be worse
    import errno

    from tauflow.controller import run as run_module

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_module.fcntl, "flock", no_locks)
    run = build_run(_config(tmp_path / "run"), serve_metrics=False)
    with caplog.at_level("WARNING"):
        run.claim_out_dir()
    assert "cannot lock out_dir" in caplog.text and run._lock_fd is None
