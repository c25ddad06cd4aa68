"""scripts/gpu_check.py, the one prepared GPU run (issue #18): what it runs and what it brings back, checked
on the CPU, since its single run on a GPU has no second try."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_runs_every_file_with_a_gpu_test_and_no_other(gpu_check: ModuleType) -> None:
    # (a file left out loses its figures: the logits-chunk memory test was missing from the list)
    marked = {
        str(path.relative_to(ROOT))
        for top in ("libs", "services", "tests")
        for path in (ROOT / top).rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", path.read_text())
    }
    assert marked, "no test is marked gpu"
    assert set(gpu_check.GPU_TESTS) == marked


def test_a_test_cut_off_at_the_time_limit_counts_as_an_error_not_a_pass(gpu_check: ModuleType, tmp_path: Path) -> None:
    # pytest, interrupted by SIGINT, lists the test it was in without a name or a failure element
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="a.b" name="test_ok" time="1.0" />'
        '<testcase classname="a.b" name="test_bad" time="1.0"><failure message="boom" /></testcase>'
        '<testcase time="0.001" />'
        "</testsuite></testsuites>"
    )
    assert gpu_check.junit_outcomes(junit) == {
        "a.b::test_ok": "passed",
        "a.b::test_bad": "failure: boom",
        "(interrupted)": "error: interrupted at the part's time limit",
    }


def test_a_part_past_its_limit_leaves_no_process_behind_and_a_log_of_bounded_size(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a part's children (ranks, services) outliving it held the GPU through the next part
    pid_file = tmp_path / "child.pid"
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "sys.stdout.write('x' * 3000 + '\\nlast line\\n'); sys.stdout.flush()\n"
        "time.sleep(120)\n"
    )
    monkeypatch.setattr(gpu_check, "LOG_KEEP_BYTES", 1000)
    monkeypatch.setattr(gpu_check, "INTERRUPT_GRACE_S", 1.0)  # (it ignores the SIGINT: the kill must follow)
    log = tmp_path / "part.log"
    started = time.monotonic()
    result = gpu_check.run([sys.executable, "-c", script], log, timeout_s=10)  # (a loaded machine starts it late)
    assert time.monotonic() - started < 60
    assert result["returncode"] == "timed out after 10 s"
    assert result["log_tail"][-1] == "last line"
    assert len(log.read_bytes()) < 1100  # the last 1,000 bytes and a line saying so
    child = int(pid_file.read_text())
    for _ in range(50):  # (killed: gone, or a zombie of the init that adopted it)
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the part's child outlived its part")
