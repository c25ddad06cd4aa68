"""``service_main`` in a real service process (the queue): a service that cannot start — a port in use,
equal ports, a data dir that is no directory, a missing or bad tokens file, TLS files that do not fit, an
absurd message limit — ends with one line naming the problem and exit code 2, never a traceback, and
never a secret; the traceback is there at log.level=DEBUG."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tauflow.core.testing import ServiceProcess, self_signed_certificate

TOKEN = "tok-" + "k" * 28


def _start(tmp_path: Path, *settings: str, timeout_s: float = 60) -> tuple[int, str]:
    """Runs ``python -m tauflow.queue`` with ``settings`` (and free ports unless they say otherwise) until it
    exits; returns its exit code and stderr."""
    defaults = {"server.port": "0", "metrics.port": "0", "wal.dir": str(tmp_path / "wal")}
    for s in settings:
        defaults.pop(s.partition("=")[0], None)
    args = [a for s in [*(f"{k}={v}" for k, v in defaults.items()), *settings] for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tauflow.queue", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=tmp_path,
        env=env,
    )
    return proc.returncode, proc.stderr


def _refused(tmp_path: Path, *settings: str) -> str:
    """The one line a queue that cannot start ends with (asserting exit code 2 and no traceback)."""
    code, stderr = _start(tmp_path, *settings)
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("tauflow-queue: "), stderr
    return last


@pytest.fixture
def running_queue(tmp_path: Path):
    proc = ServiceProcess(
        "queue",
        tmp_path,
        {
            "wal.dir": "wal-first",
            "external.enabled": "true",
            "external.port": 0,
            "external.tokens_file": _tokens(tmp_path),
        },
    )
    yield proc.start()
    proc.stop()


def _tokens(tmp_path: Path, text: str = f"agent: {TOKEN}\n") -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    return path


def test_a_port_in_use_is_refused_naming_the_port(tmp_path: Path, running_queue: ServiceProcess) -> None:
    info = running_queue.info
    port, metrics, external = info["grpc_port"], info["metrics_port"], info["external_port"]
    assert _refused(tmp_path, f"server.port={port}") == (
        f"tauflow-queue: cannot listen on 127.0.0.1:{port} (server.port): the port is in use"
    )
    assert _refused(tmp_path, f"metrics.port={metrics}") == (
        f"tauflow-queue: cannot serve /metrics on 127.0.0.1:{metrics}: Address already in use"
    )
    line = _refused(
        tmp_path, "external.enabled=true", f"external.port={external}", f"external.tokens_file={_tokens(tmp_path)}"
    )
    assert line == f"tauflow-queue: cannot listen on 127.0.0.1:{external} (external.port): the port is in use"
    assert running_queue.proc is not None and running_queue.proc.poll() is None  # the first one serves on


def test_equal_ports_are_refused_by_the_config(tmp_path: Path) -> None:
    line = _refused(
        tmp_path,
        "server.port=50999",
        "external.enabled=true",
        "external.port=50999",
        f"external.tokens_file={_tokens(tmp_path)}",
    )
    assert "server.port and external.port are both 50999 on 127.0.0.1" in line
    line = _refused(tmp_path, "server.port=50998", "metrics.port=50998", "metrics.host=0.0.0.0")
    assert "server.port and metrics.port are both 50998 on 127.0.0.1 and 0.0.0.0" in line


def test_a_data_dir_that_cannot_be_used_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    assert "a-file" in _refused(tmp_path, f"wal.dir={tmp_path / 'a-file'}")
    assert "/proc/no-such" in _refused(tmp_path, "wal.dir=/proc/no-such/wal")  # unwritable, even for root
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "queue.wal").write_bytes(b"this is not a tauflow queue log" * 10)
    assert "damaged" in _refused(tmp_path, f"wal.dir={tmp_path / 'damaged'}")  # build() raised


def test_a_missing_or_bad_tokens_file_is_one_line_without_the_token(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    line = _refused(tmp_path, "external.enabled=true", f"external.tokens_file={missing}")
    assert line == f"tauflow-queue: cannot read the tokens file {missing}: No such file or directory"
    bad = _tokens(tmp_path, f"agent: {TOKEN}\nother: [{TOKEN}x\n")
    for level in ("INFO", "DEBUG"):
        code, stderr = _start(tmp_path, "external.enabled=true", f"external.tokens_file={bad}", f"log.level={level}")
        assert code == 2 and TOKEN not in stderr, stderr
        assert stderr.splitlines()[-1] == (
            f"tauflow-queue: {bad}, line 3, column 1: does not parse as YAML `client_name: token` lines"
        )
        assert ("Traceback" in stderr) == (level == "DEBUG"), stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_tls_files_that_do_not_fit_are_one_line(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    self_signed_certificate(cert, key)
    external = ("external.enabled=true", f"external.tokens_file={_tokens(tmp_path)}")
    line = _refused(tmp_path, *external, f"external.tls_cert_file={key}", f"external.tls_key_file={cert}")
    assert f"the TLS certificate {key} and private key {cert} cannot be used" in line
    code, stderr = _start(
        tmp_path, *external, f"external.tls_cert_file={cert}", f"external.tls_key_file={key}", "external.host=192.0.2.1"
    )  # a good pair: on to binding (TEST-NET-1: not ours)
    assert code == 2, stderr
    assert stderr.splitlines()[-1] == (
        "tauflow-queue: cannot listen on 192.0.2.1:50061 (external.port): Cannot assign requested address"
    )
    assert "PRIVATE KEY" not in stderr and key.read_text().splitlines()[1] not in stderr


@pytest.mark.parametrize("value", ["0", "100", "2147483648", "10000000000000"])
def test_an_absurd_message_limit_is_one_line(tmp_path: Path, value: str) -> None:
    assert "server.max_message_bytes" in _refused(tmp_path, f"server.max_message_bytes={value}")


def test_an_unknown_log_level_is_a_config_error(tmp_path: Path) -> None:
    # (it used to raise inside setup_logging, with a traceback)
    assert "config key 'log.level'" in _refused(tmp_path, "log.level=LOUD")


@pytest.mark.parametrize("where", ["bootstrap", "run"])
def test_a_thread_out_of_memory_ends_the_process_for_a_restart(where: str) -> None:
    # A worker thread whose start failed for want of memory was gone while the work handed to it was never
    # done: its awaiter (the trainer's checkpoint) waited for good, the process alive and never restarted.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import _thread, logging, threading, time
        from tauflow.core.app import exit_when_a_thread_runs_out_of_memory
        exit_when_a_thread_runs_out_of_memory(logging.getLogger("t"))
        def fail():
            raise MemoryError
        if {where!r} == "bootstrap":
            _thread.start_new_thread(fail, ())  # (as a thread whose bootstrap could not allocate)
        else:
            threading.Thread(target=fail).start()
        time.sleep(30)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 70, done.stderr
    assert "ran out of memory" in done.stderr


def test_a_services_worker_threads_are_all_started_before_it_serves() -> None:
    # A worker started mid-run when memory was short failed at its start, and the work handed to it never ran:
    # the trainer waited for its checkpoint for good. Every worker exists from the start now, none is started
    # later.
    import asyncio
    import threading

    from tauflow.core.app import prestart_default_executor

    async def main() -> tuple[set[int], set[int], set[int]]:
        executor = prestart_default_executor(asyncio.get_running_loop())
        before = {t.ident for t in threading.enumerate()}
        workers = {t.ident for t in executor._threads if t.ident is not None}
        used = set(await asyncio.gather(*(asyncio.to_thread(threading.get_ident) for _ in range(50))))
        return {t.ident for t in threading.enumerate()} - before, workers, used  # type: ignore[return-value]

    started_later, workers, used = asyncio.run(main())
    assert started_later == set() and len(workers) == min(32, (os.cpu_count() or 1) + 4)
    assert used <= workers
