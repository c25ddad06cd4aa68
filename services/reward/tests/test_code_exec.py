"""The built-in ``code`` reward: extraction, test formats, scoring, and what its sandbox enforces."""

from __future__ import annotations

import base64
import dis
import errno
import fcntl
import json
import logging
import multiprocessing
import os
import posix
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest

from tauflow.reward import code_exec
from tauflow.reward.api import SampleInput, Score
from tauflow.reward.builtins import ConfigInvalid, MissingReference
from tauflow.reward.code_exec import (
    _RUNNER,
    Case,
    CaseResult,
    CodeExecution,
    Confinement,
    case_passed,
    extract_program,
    kernel_confinement,
    parse_tests,
    run_case,
)

ADD = "def add(a, b):\n    return a + b\n"
DOUBLE = "print(int(input()) * 2)\n"
IO_TESTS = json.dumps({"inputs": ["1\n", "21\n"], "outputs": ["2\n", "42"]})


def fenced(program: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{program}```\nIt adds the numbers."


def sample(text: str, tests: str | None = None, group_tests: str | None = None) -> SampleInput:
    return SampleInput(
        sample_id="0",
        completion_text=text,
        metadata={} if tests is None else {"tests": tests},
        group_metadata={} if group_tests is None else {"tests": group_tests},
    )


def score(s: SampleInput, **overrides: Any) -> Score:
    fn = CodeExecution()
    return fn(s, fn.validate_config({**fn.default_config, **overrides}))


def run(program: str, stdin: str = "", **limits: Any) -> Any:
    """One stdin/stdout run of ``program`` in the sandbox."""
    return run_case(textwrap.dedent(program), Case(stdin=stdin, expected=""), **limits)


# -- scoring ------------------------------------------------------------------------------------


def test_a_correct_solution_passes_assert_tests() -> None:
    result = score(sample(fenced(ADD), "assert add(1, 2) == 3\nassert add(-1, 1) == 0"))
    assert result == Score(1.0, {"code_found": 1.0, "passed": 1.0, "cases": 1.0, "timeouts": 0.0})


def test_a_correct_solution_passes_stdin_stdout_tests() -> None:
    # A dataclass (which looks itself up in sys.modules['__main__']), a __main__ guard and exit(): all
    # as under `python solution.py`. Trailing spaces and blank lines do not count.
    program = textwrap.dedent(
        """
        from dataclasses import dataclass

        @dataclass
        class Pair:
            a: int

        def main():
            print(Pair(int(input())).a * 2, end="  \\n\\n")

        if __name__ == "__main__":
            main()
            exit()
        """
    )
    result = score(sample(fenced(program), IO_TESTS))
    assert result == Score(1.0, {"code_found": 1.0, "passed": 2.0, "cases": 2.0, "timeouts": 0.0})
    assert score(sample(fenced(DOUBLE), json.dumps({"inputs": ["5"], "outputs": ["10"]}))).score == 1.0


def test_a_wrong_solution_fails() -> None:
    wrong_add = "def add(a, b):\n    return a - b\n"
    assert score(sample(fenced(wrong_add), "assert add(1, 2) == 3")).score == 0.0
    result = score(sample(fenced("print(int(input()) + 2)\n"), IO_TESTS))
    assert result.score == 0.0 and result.components["passed"] == 0.0
    # Extra output, or a crash after the right output, fails too.
    assert score(sample(fenced(DOUBLE + "print('debug')\n"), IO_TESTS)).score == 0.0
    assert score(sample(fenced(DOUBLE + "raise SystemExit(3)\n"), IO_TESTS)).score == 0.0


def test_fraction_scoring_gives_partial_credit_and_all_or_nothing_stops_at_the_first_failure() -> None:
    tests = json.dumps(
        ["assert add(0, 1) == 99", "assert add(1, 1) == 2", "assert add(2, 2) == 4", "assert add(1, 2) == 3"]
    )
    s = sample(fenced(ADD), tests)
    assert score(s, scoring="fraction").components == {"code_found": 1.0, "passed": 3.0, "cases": 4.0, "timeouts": 0.0}
    assert score(s, scoring="fraction").score == 0.75
    assert score(s, scoring="fraction", incorrect_score=-1.0, correct_score=1.0).score == 0.5
    stopped = score(s)
    assert stopped.score == 0.0 and stopped.components["passed"] == 0.0  # the later cases never ran
    went_on = score(s, stop_on_first_failure=False)
    assert went_on.score == 0.0 and went_on.components["passed"] == 3.0
    assert score(sample(fenced("print(2)\n"), IO_TESTS), scoring="fraction").score == 0.5


@pytest.mark.parametrize("escape", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "exit()\n", "quit(0)\n"])
def test_ending_the_process_before_the_asserts_does_not_pass(escape: str) -> None:
    assert score(sample(fenced(ADD + escape), "assert add(1, 2) == 4")).score == 0.0
    assert score(sample(fenced(ADD), "assert add(1, 2) == 3\n" + escape)).score == 0.0


def test_the_tests_are_read_from_the_sample_then_the_group_under_tests_key() -> None:
    assert score(sample(fenced(ADD), group_tests="assert add(1, 2) == 3")).score == 1.0
    assert score(sample(fenced(ADD), "assert add(1, 2) == 4", group_tests="assert add(1, 2) == 3")).score == 0.0
    other = SampleInput(sample_id="0", completion_text=fenced(ADD), metadata={"unit": "assert add(2, 2) == 4"})
    assert score(other, tests_key="unit").score == 1.0
    with pytest.raises(MissingReference, match=r"Sample.metadata\['tests'\].*Group.metadata\['tests'\]"):
        score(sample(fenced(ADD)))


# -- extraction ---------------------------------------------------------------------------------


def test_no_code_block_scores_incorrect_with_code_found_zero() -> None:
    result = score(sample("def add(a, b): return a + b", "assert add(1, 2) == 3"), incorrect_score=-0.5)
    assert result == Score(-0.5, {"code_found": 0.0, "passed": 0.0, "cases": 1.0, "timeouts": 0.0})
    assert score(sample("x = 1", "assert x == 1"), extract="whole").score == 1.0  # no fences needed


def test_extraction_picks_the_python_block() -> None:
    first, last = "x = 1\n", "x = 2\n"
    text = f"```python\n{first}```\nthen\n```py\n{last}```\nOutput:\n```\n2\n```\n```bash\npython a.py\n```"
    assert extract_program(text) == last  # a python block wins over the untagged output block after it
    assert extract_program(text, "first_block") == first
    assert extract_program(text, "whole") == text
    assert extract_program("```\nx = 3\n```\n```text\nhello\n```") == "x = 3\n"  # untagged when no python block
    assert extract_program("```bash\nls\n```") is None
    assert extract_program("```python\nunterminated = 1\n") is None
    assert score(sample(fenced("x = 1\n", tag="Python3"), "assert x == 1")).score == 1.0


def test_a_program_over_max_program_chars_fails_without_running() -> None:
    program = ADD + "# padding\n" * 20
    assert score(sample(fenced(program), "assert add(1, 2) == 3"), max_program_chars=len(program) - 1).score == 0.0
    assert score(sample(fenced(program), "assert add(1, 2) == 3"), max_program_chars=len(program)).score == 1.0


# -- the tests' formats --------------------------------------------------------------------------


def test_test_formats_are_detected_or_forced() -> None:
    assert parse_tests("assert f() == 1") == [Case(tests="assert f() == 1")]
    assert parse_tests('["assert f() == 1", "assert g()"]') == [Case(tests="assert f() == 1"), Case(tests="assert g()")]
    assert parse_tests(IO_TESTS) == [Case(stdin="1\n", expected="2\n"), Case(stdin="21\n", expected="42")]
    assert parse_tests('["assert f()"]', "asserts") == [Case(tests="assert f()")]
    assert parse_tests("[x for x in range(3)]") == [Case(tests="[x for x in range(3)]")]  # Python, not JSON


@pytest.mark.parametrize(
    ("tests", "fmt", "message"),
    [
        ("not json", "io", "not valid JSON"),
        ('{"inputs": ["1"], "outputs": []}', "auto", "1 inputs but 0 outputs"),
        ('{"inputs": [1], "outputs": ["1"]}', "io", r"inputs\[0\] is a int"),
        ('{"inputs": ["1"]}', "auto", "must be a JSON object"),
        ('{"fn_name": "f", "inputs": [[1]], "outputs": [1]}', "io", "fn_name"),
        ('["assert f(", "assert g()"]', "auto", r"tests\[0\] is not valid Python"),
        ("assert f(", "asserts", "not valid Python"),
        ("[]", "auto", "no case"),
        ("  \n", "auto", "tests is empty"),
        ('["assert f()", ""]', "asserts", r"tests\[1\] is empty"),
        ('{"inputs": ["1"], "outputs": ["1"]}', "asserts", "not an object"),
        (json.dumps(["assert True"] * 65), "auto", "65 cases; max_cases is 64"),
        ("assert True" + " " * 1_000_000, "auto", "max_tests_chars"),
    ],
)
def test_malformed_tests_raise_value_error(tests: str, fmt: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        score(sample(fenced(ADD), tests), tests_format=fmt)


def test_stdout_is_compared_line_by_line_without_trailing_whitespace() -> None:
    def passes(stdout: bytes, expected: str, returncode: int = 0) -> bool:
        result = CaseResult(returncode, stdout, b"", False, False, True, 0.0)
        return case_passed(Case(stdin="", expected=expected), result)

    assert passes(b"1 2 \r\n3\r\n\n\n", "1 2\n3")
    assert passes(b"", "\n\n")
    assert not passes(b"1\n\n2\n", "1\n2")  # a blank line inside counts
    assert not passes(b" 1\n", "1")  # so does leading whitespace
    assert not passes(b"1\n", "1", returncode=1)


# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"cpu_time_s": 0}, "cpu_time_s"),
        ({"cpu_time_s": 61}, "cpu_time_s"),
        ({"wall_time_s": 0}, "wall_time_s"),
        ({"wall_time_s": 301}, "wall_time_s"),
        # Both within the function's timeout_s (60 s) less 5 s: past it the worker is killed mid-case.
        ({"wall_time_s": 55.5}, "wall_time_s"),
        ({"total_time_s": 56}, "total_time_s"),
        ({"total_time_s": 3600}, "total_time_s"),
        ({"wall_time_s": 300, "total_time_s": 3600}, "wall_time_s"),
        ({"memory_mb": 8}, "memory_mb"),
        ({"memory_mb": 1 << 20}, "memory_mb"),
        ({"max_cases": 0}, "max_cases"),
        ({"max_output_bytes": 1 << 40}, "max_output_bytes"),
        ({"extract": "middle_block"}, "extract"),
        ({"tests_format": "yaml"}, "tests_format"),
        ({"scoring": "best_of"}, "scoring"),
        ({"tests_key": ""}, "tests_key"),
        ({"correct_score": float("nan")}, "correct_score"),
        ({"network": True}, "network"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigInvalid) as e:
        CodeExecution.validate_config({**CodeExecution.default_config, **overrides})
    assert e.value.key == key


def test_the_default_config_validates_to_itself() -> None:
    assert CodeExecution.validate_config(dict(CodeExecution.default_config)) == CodeExecution.default_config
    assert CodeExecution.timeout_s >= CodeExecution.default_config["total_time_s"] + 5
    limits = {**CodeExecution.default_config, "wall_time_s": 55, "total_time_s": 55}
    assert CodeExecution.validate_config(limits)["total_time_s"] == 55


# -- the sandbox --------------------------------------------------------------------------------


def test_an_infinite_loop_is_ended_by_the_cpu_limit_and_counted_as_a_timeout() -> None:
    start = time.monotonic()
    result = run("while True:\n    pass\n", cpu_time_s=1, wall_time_s=10)
    assert result.returncode == -signal.SIGXCPU and result.timed_out  # RLIMIT_CPU, not the wall clock
    assert time.monotonic() - start < 5
    s = sample(fenced("while True:\n    pass\n"), IO_TESTS)
    assert score(s, cpu_time_s=1).components == {"code_found": 1.0, "passed": 0.0, "cases": 2.0, "timeouts": 1.0}


def test_a_sleeping_program_is_killed_at_the_wall_limit() -> None:
    start = time.monotonic()
    result = run("import time\ntime.sleep(60)\n", wall_time_s=0.5)
    assert result.returncode == -signal.SIGKILL and result.timed_out and not case_passed(Case(stdin=""), result)
    assert time.monotonic() - start < 3


def test_total_time_s_bounds_all_the_cases_of_a_sample() -> None:
    s = sample(fenced("import time\ntime.sleep(60)\n"), json.dumps({"inputs": ["1"] * 5, "outputs": ["1"] * 5}))
    start = time.monotonic()
    result = score(s, scoring="fraction", wall_time_s=1, total_time_s=1.5)
    assert time.monotonic() - start < 3  # not 5 cases x 1 s
    assert result.score == 0.0 and result.components["timeouts"] == 2.0


def test_a_memory_bomb_is_stopped_by_the_memory_limit() -> None:
    bomb = "chunks = []\nfor _ in range(64):\n    chunks.append(bytearray(8 << 20))\nprint('survived')\n"
    result = run(bomb, memory_mb=128)
    assert result.returncode == 1 and b"MemoryError" in result.stderr and b"survived" not in result.stdout
    assert not result.timed_out
    assert run(bomb, memory_mb=1024).stdout == b"survived\n"  # the same program, under a higher limit


def test_the_network_is_unreachable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
        result = run(program)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody came
    assert result.returncode == 1 and b"PermissionError: sandbox: socket" in result.stderr
    assert score(sample(fenced(program), "pass")).score == 0.0


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the child gets its own network namespace")
def test_as_root_the_child_has_its_own_network_namespace_and_no_capabilities() -> None:
    program = """
        print(sorted(line.split(":")[0].strip() for line in open("/proc/self/net/dev").readlines()[2:]))
        print([line.split()[1] for line in open("/proc/self/status") if line.startswith(("CapEff", "CapBnd"))])
        """
    result = run(program)
    assert result.stdout.decode().splitlines() == ["['lo']", "['0000000000000000', '0000000000000000']"]


@pytest.mark.skipif(os.geteuid() == 0, reason="a child of a non-root service has a user namespace where allowed")
def test_as_another_user_rlimit_nproc_is_set_exactly_when_the_child_has_its_own_namespaces() -> None:
    program = """
        import resource
        print(sorted(line.split(":")[0].strip() for line in open("/proc/self/net/dev").readlines()[2:]))
        print(resource.getrlimit(resource.RLIMIT_NPROC)[0])
        """
    interfaces, nproc = run(program).stdout.decode().splitlines()
    if interfaces == "['lo']":  # user namespaces allowed: the kernel counts the sandbox's tasks alone
        assert nproc == "64"
    else:  # the service's user's count: a limit would stop the program's threads at random
        assert nproc != "64"


def test_standard_library_modules_that_start_processes_still_import_and_threads_run() -> None:
    # subprocess imports (its fork_exec is a stub); 32 threads at once fit under the default 512 MiB (glibc
    # would reserve 64 MiB of address space for each thread's malloc arena without MALLOC_ARENA_MAX).
    program = """
        import subprocess, threading, time
        threads = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("ok")
        """
    result = run(program, memory_mb=512)
    assert result.stdout == b"ok\n", result.stderr


def test_a_case_that_starts_threads_past_max_tasks_is_killed_and_fails() -> None:
    # Root is exempt from RLIMIT_NPROC (one case started 7,930 threads of the host's 32,768 pids): the worker
    # watches the count and kills the case past MAX_TASKS; inside a user namespace RLIMIT_NPROC stops it first.
    program = """
        import threading
        threading.stack_size(32768)
        gate, started = threading.Event(), 0
        try:
            for _ in range(2000):
                threading.Thread(target=gate.wait, daemon=True).start()
                started += 1
        except RuntimeError:
            print("refused after", started)
        gate.wait(20)
        """
    result = run(program, wall_time_s=30)
    assert not case_passed(Case(stdin="", expected=""), result)
    if result.over_limit:
        assert result.over_limit == "tasks" and result.returncode == -signal.SIGKILL and not result.timed_out
        assert result.duration_s < 20  # killed on the watch, not at the wall time
    else:  # RLIMIT_NPROC refused the threads past it
        assert result.stdout.startswith(b"refused after "), (result.stdout, result.stderr)
        assert int(result.stdout.split()[-1]) < code_exec.MAX_TASKS


@pytest.mark.parametrize(
    ("program", "why"),
    [
        # RLIMIT_FSIZE bounds one file; 20 files of 5 MiB pass MAX_CASE_BYTES (64 MiB)
        ('for i in range(20):\n    open(f"f{i}", "wb").write(b"x" * (5 << 20))\nimport time; time.sleep(20)', "bytes"),
        ('import os\nfor i in range(5000):\n    open(f"e{i}", "w").close()\nimport time; time.sleep(20)', "entries"),
        ('import os\nfor i in range(5000):\n    os.makedirs(f"d/{i}")\nimport time; time.sleep(20)', "folders"),
    ],
)
def test_a_case_that_fills_its_directory_is_killed_and_fails(program: str, why: str) -> None:
    result = run(program, wall_time_s=30)
    assert result.over_limit == "disk", (why, result.stderr[-500:])
    assert not result.timed_out and result.duration_s < 20 and not case_passed(Case(stdin="", expected=""), result)


_CLOSED_AND_WRITING = """
import os, time
os.close(1)
os.close(2)
for i in range(20):
    open(f"f{i}", "wb").write(b"x" * (5 << 20))
time.sleep(20)
"""
_CLOSED_AND_THREADING = """
import os, threading, time
os.close(1)
os.close(2)
threading.stack_size(32768)
gate = threading.Event()
for _ in range(500):
    threading.Thread(target=gate.wait, daemon=True).start()
time.sleep(20)
"""
_REMOVED_BUT_OPEN = """
import os, time
held = []
for i in range(20):
    f = open(f"f{i}", "wb")
    f.write(b"x" * (5 << 20))
    f.flush()
    os.remove(f"f{i}")
    held.append(f)
time.sleep(20)
"""


@pytest.mark.parametrize(
    ("program", "why"),
    [
        # its output closed, it runs on: still watched (the watch stopped at the streams' end)
        (_CLOSED_AND_WRITING, "disk"),
        (_CLOSED_AND_THREADING, "tasks"),
        (_REMOVED_BUT_OPEN, "disk"),  # files removed but held open: their bytes are still on the disk
    ],
)
def test_a_case_is_watched_to_its_end_and_with_what_it_holds_open(program: str, why: str) -> None:
    result = run(program, wall_time_s=30)
    if why == "tasks" and not result.over_limit:  # (a user namespace's RLIMIT_NPROC refused the threads first)
        assert result.returncode != 0
        return
    assert result.over_limit == why, result.stderr[-500:]
    assert not result.timed_out and result.duration_s < 20


def test_a_case_that_writes_a_sparse_file_is_not_over_its_disk() -> None:
    # (what counts is the disk taken: a 9 MiB file of one written byte takes none of it)
    program = (
        'f = open("sparse", "wb")\nf.seek(9 << 20)\nf.write(b"x")\nf.close()\nimport time; time.sleep(0.3)\nprint("ok")'
    )
    result = run(program)
    assert result.stdout == b"ok\n" and result.over_limit == "", result.stderr


@pytest.mark.parametrize(
    "attempt",
    [
        "import subprocess\nsubprocess.run(['echo', 'escaped'])",
        "import os\nos.system('echo escaped')",
        "import os\nos.execv('/bin/echo', ['echo', 'escaped'])",
        "import os\nos.posix_spawn('/bin/echo', ['echo', 'escaped'], {})",
        "import os\nif os.fork() == 0:\n    print('escaped')",
        "import _posixsubprocess\n_posixsubprocess.fork_exec(['/bin/echo', 'escaped'])",
        "import ctypes\nctypes.CDLL(None).system(b'echo escaped')",
        "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)",
        "import socket\nsocket.getaddrinfo('example.com', 80)",
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))",
        "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (60, 60))",
        "import gc\ngc.get_objects()",
        # A new interpreter has no audit hook of its own.
        "import _xxsubinterpreters as i\ni.run_string(i.create(), 'import os; os.system(\"echo escaped\")')",
        "import _testcapi\n_testcapi.run_in_subinterp('import os; os.system(\"echo escaped\")')",
        "import sys\nsys._current_frames()",
        "import syslog\nsyslog.syslog('escaped')",
    ],
)
def test_processes_signals_and_the_network_are_refused(attempt: str) -> None:
    program = f"try:\n{textwrap.indent(attempt, '    ')}\nexcept PermissionError:\n    print('refused')\n"
    result = run(program)
    assert (result.returncode, result.stdout) == (0, b"refused\n"), result.stderr


def test_the_program_runs_in_a_throwaway_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    program = f"""
        import os, tempfile
        print(os.getcwd())
        with open("marker.txt", "w") as f:
            f.write("written")
        with tempfile.NamedTemporaryFile(dir=None) as t:  # TMPDIR is the working directory
            print(os.path.dirname(t.name) == os.getcwd())
        for attempt in (
            lambda: open({str(tmp_path / "escape.txt")!r}, "w"),
            lambda: open("../escape.txt", "a"),
            lambda: os.remove({str(outside)!r}),
            lambda: os.chmod({str(outside)!r}, 0o777),
            lambda: os.symlink("/", "root"),
            lambda: os.open("/", os.O_RDONLY),
        ):
            try:
                attempt()
                print("allowed")
            except PermissionError:
                print("refused")
        """
    result = run(program)
    cwd, same, *attempts = result.stdout.decode().splitlines()
    assert Path(cwd) != tmp_path and not Path(cwd).exists()  # deleted afterwards
    assert same == "True" and attempts == ["refused"] * 6, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt"] and outside.read_text() == "keep"
    assert not (tmp_path.parent / "escape.txt").exists()


def test_stdin_opens_by_its_paths_and_stdout_and_stderr_by_theirs() -> None:
    # The competitive-programming idiom open("/dev/stdin"): the path opens the file anew through
    # /proc/self/fd/0, which Landlock checks like any other path; stdin's file lay outside every rule.
    program = """
        import os
        for path in ("/dev/stdin", "/dev/fd/0", "/proc/self/fd/0"):
            with open(path) as f:
                print(path, f.read().split())
        print("open(0)", open(0).read().split())  # (each path opened the file anew, at its start)
        print("listdir", os.listdir("."), flush=True)
        with open("/dev/stdout", "w") as f:
            f.write("via /dev/stdout\\n")
        with open("/dev/stderr", "w") as f:
            f.write("via /dev/stderr\\n")
        """
    result = run(program, stdin="1 2\n3\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().splitlines() == [
        "/dev/stdin ['1', '2', '3']",
        "/dev/fd/0 ['1', '2', '3']",
        "/proc/self/fd/0 ['1', '2', '3']",
        "open(0) ['1', '2', '3']",
        "listdir []",  # stdin's file, in the case's directory, has no name there
        "via /dev/stdout",
    ]
    assert result.stderr == b"via /dev/stderr\n"
    # no input at all (an assert case): /dev/stdin is /dev/null
    no_input = run_case('assert open("/dev/stdin").read() == ""\n', Case(tests="", expected=None))
    assert no_input.returncode == 0 and no_input.finished, no_input.stderr


def test_the_environment_does_not_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAUFLOW_TEST_SECRET", "hunter2")
    result = run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('TAUFLOW_TEST_SECRET'))\n")
    assert result.stdout.decode().splitlines() == ["['HOME', 'LANG', 'MALLOC_ARENA_MAX', 'PATH', 'TMPDIR']", "None"]


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_over_max_output_bytes_fails_the_case_at_once(stream: str) -> None:
    program = f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1000)\n"
    start = time.monotonic()
    result = run(program, max_output_bytes=10_000, wall_time_s=20)
    assert result.output_exceeded and not result.timed_out and time.monotonic() - start < 5
    assert len(getattr(result, stream)) == 10_000
    assert not case_passed(Case(stdin="", expected=""), result)


def test_max_output_bytes_is_a_bound_on_each_case() -> None:
    s = sample(fenced("print('x' * 2000)\n"), json.dumps({"inputs": [""], "outputs": ["x" * 2000]}))
    assert score(s, max_output_bytes=2001).score == 1.0
    assert score(s, max_output_bytes=2000).score == 0.0  # the newline is one byte too many


# -- the kernel's layers: Landlock, seccomp ---------------------------------------------------------

CONFINEMENT = kernel_confinement()
needs_landlock = pytest.mark.skipif(not CONFINEMENT.landlock_abi, reason="this kernel has no Landlock")
needs_seccomp = pytest.mark.skipif(not CONFINEMENT.seccomp_arch, reason="no seccomp filter for this kernel/arch")

# Run in a child without the audit hook: what the kernel alone refuses once _landlock and _seccomp are set
# up as the runner sets them up (as native code would meet them: past the hook, every call here is a bare
# syscall). Each attempt prints "<name> allowed" or "<name> refused <errno>".
CONFINED = r"""
import ctypes, errno, fcntl, os, resource, signal, socket, sys, threading
runner_file, root, victim, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
runner = {"__name__": "tauflow_runner"}
exec(open(runner_file).read(), runner)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
os.chdir(root)
if "landlock" in layers:
    runner["_landlock"](libc, ctypes, int(sys.argv[5]), os.path.realpath(root), runner["_readable"]())
if "seccomp" in layers:
    runner["_seccomp"](libc, ctypes, sys.argv[6])

def attempt(name, fn):
    try:
        result = fn()
    except OSError as e:
        print(name, "refused", e.errno, flush=True)
    else:
        if result is not None and result < 0:
            print(name, "refused", ctypes.get_errno(), flush=True)
        else:
            print(name, "allowed", flush=True)
"""


def _confined(tmp_path: Path, attempts: str, layers: str) -> dict[str, str]:
    """Runs CONFINED then ``attempts`` in a child (cwd: ``tmp_path/case``) with the given kernel layers;
    {attempt: "allowed" or "refused <errno>"}. ``victim`` is another process of the same user."""
    case = tmp_path / "case"
    case.mkdir()
    runner_file = tmp_path / "runner.py"
    runner_file.write_text(_RUNNER)
    with subprocess.Popen(["sleep", "30"]) as victim:
        try:
            args = [str(runner_file), str(case), str(victim.pid), layers]
            args += [str(CONFINEMENT.landlock_abi), CONFINEMENT.seccomp_arch]
            script = CONFINED + textwrap.dedent(attempts)
            result = subprocess.run(
                [sys.executable, "-I", "-S", "-c", script, *args], capture_output=True, text=True, timeout=60
            )
        finally:
            victim.kill()
    lines = [line.split(" ", 1) for line in result.stdout.splitlines()]
    return {name: outcome for name, outcome in lines} | ({"rc": str(result.returncode)} if result.stderr else {})


@needs_seccomp
def test_seccomp_refuses_processes_signals_sockets_and_kernel_interfaces_to_native_code(tmp_path: Path) -> None:
    # The hostile program loaded a shared library of its own: its constructor forked, exec'd /bin/sh and
    # found it could signal its worker (kill(worker, 0) == 0), none of which an audit event sees.
    attempts = """
        attempt("fork", lambda: os._exit(0) if os.fork() == 0 else 0)
        attempt("posix_spawn", lambda: os.posix_spawn("/bin/true", ["true"], {}) and 0)
        attempt("kill_other", lambda: os.kill(victim, 0))
        attempt("kill_self", lambda: os.kill(os.getpid(), 0))
        attempt("pidfd_open", lambda: os.pidfd_open(victim) and 0)
        attempt("prlimit_other", lambda: resource.prlimit(victim, resource.RLIMIT_NOFILE) and 0)
        attempt("prlimit_self", lambda: resource.prlimit(0, resource.RLIMIT_NOFILE) and 0)
        attempt("setpriority_other", lambda: os.setpriority(os.PRIO_PROCESS, victim, 19))
        attempt("affinity_other", lambda: os.sched_setaffinity(victim, os.sched_getaffinity(0)))
        attempt("socket_inet", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
        attempt("socket_unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close())
        attempt("socketpair", lambda: [s.close() for s in socket.socketpair()] and None)
        attempt("socketpair_dgram", lambda: socket.socketpair(type=socket.SOCK_DGRAM) and 0)
        attempt("f_setown", lambda: fcntl.fcntl(0, fcntl.F_SETOWN, victim))
        attempt("pdeathsig", lambda: libc.prctl(1, 0, 0, 0, 0))
        attempt("unshare", lambda: libc.unshare(0x10000000))
        attempt("mount", lambda: libc.mount(b"none", b"/nonexistent-tauflow-mount", b"tmpfs", 0, None))
        attempt("ptrace", lambda: libc.ptrace(16, victim, None, None))  # PTRACE_ATTACH
        attempt("io_uring_setup", lambda: libc.syscall(425, 1, None))
        attempt("bpf", lambda: libc.syscall(321 if sys.argv[6] == "x86_64" else 280, 0, None, 0))
        attempt("clone3", lambda: libc.syscall(435, None, 0))
        threads = [threading.Thread(target=lambda: None) for _ in range(4)]
        attempt("threads", lambda: [t.start() for t in threads] and [t.join() for t in threads] and None)
        attempt("exec", lambda: os.execv("/bin/sh", ["sh", "-c", "echo exec allowed"]))
        """
    got = _confined(tmp_path, attempts, "seccomp")
    eperm, enosys = f"refused {errno.EPERM}", f"refused {errno.ENOSYS}"
    assert got == {
        "fork": eperm,
        "posix_spawn": eperm,
        "kill_other": eperm,
        "kill_self": "allowed",
        "pidfd_open": eperm,
        "prlimit_other": eperm,
        "prlimit_self": "allowed",
        "setpriority_other": eperm,
        "affinity_other": eperm,
        "socket_inet": eperm,
        "socket_unix": eperm,
        "socketpair": "allowed",
        "socketpair_dgram": eperm,
        "f_setown": eperm,
        "pdeathsig": eperm,
        "unshare": eperm,
        "mount": eperm,
        "ptrace": eperm,
        "io_uring_setup": eperm,
        "bpf": eperm,
        "clone3": enosys,  # glibc then makes its threads with clone
        "threads": "allowed",
        "exec": eperm,
    }


@needs_landlock
def test_landlock_confines_writes_to_the_case_directory_and_reads_to_what_python_needs(tmp_path: Path) -> None:
    # The constructor of the library wrote a file outside its case directory; the audit hook never sees
    # os.mkfifo or a read, nor anything native code does.
    (tmp_path / "keep.txt").write_text("keep")
    (tmp_path / "secret.txt").write_text("secret")
    attempts = f"""
        outside = {str(tmp_path)!r}
        attempt("write_outside", lambda: open(outside + "/escaped.txt", "w").close())
        attempt("append_outside", lambda: open(outside + "/keep.txt", "a").close())
        attempt("remove_outside", lambda: os.remove(outside + "/keep.txt"))
        attempt("mkfifo_outside", lambda: os.mkfifo(outside + "/fifo"))
        attempt("symlink_outside", lambda: os.symlink("/", outside + "/link"))
        attempt("read_outside", lambda: open(outside + "/secret.txt").read() and None)
        attempt("list_outside", lambda: os.listdir(outside) and None)
        attempt("write_beside", lambda: open(outside + "-beside", "w").close())
        attempt("write_inside", lambda: open("inside.txt", "w").write("x") and None)
        attempt("rename_inside", lambda: os.mkdir("d") or os.rename("inside.txt", "d/moved.txt"))
        attempt("read_inside", lambda: open("d/moved.txt").read() and None)
        attempt("dev_null", lambda: open("/dev/null", "w").write("x") and None)
        attempt("stdlib", lambda: __import__("decimal") and __import__("json") and None)
        attempt("proc_self", lambda: open("/proc/self/status").read() and None)
        attempt("exec", lambda: os.execv("/bin/sh", ["sh", "-c", "echo exec allowed"]))
        """
    got = _confined(tmp_path, attempts, "landlock")
    eacces = f"refused {errno.EACCES}"
    assert got == {
        "write_outside": eacces,
        "append_outside": eacces,
        "remove_outside": eacces,
        "mkfifo_outside": eacces,
        "symlink_outside": eacces,
        "read_outside": eacces,
        "list_outside": eacces,
        "write_beside": eacces,
        "write_inside": "allowed",
        "rename_inside": "allowed",
        "read_inside": "allowed",
        "dev_null": "allowed",
        "stdlib": "allowed",
        "proc_self": "allowed",
        "exec": eacces,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case", "keep.txt", "runner.py", "secret.txt"]
    assert (tmp_path / "keep.txt").read_text() == "keep" and not Path(f"{tmp_path}-beside").exists()


@pytest.mark.skipif(CONFINEMENT.landlock_abi < 6, reason="Landlock's signal scope needs ABI 6 (Linux 6.12)")
def test_landlock_scopes_signals_to_the_sandbox(tmp_path: Path) -> None:
    got = _confined(tmp_path, 'attempt("kill_other", lambda: os.kill(victim, 0))\n', "landlock")
    assert got == {"kill_other": f"refused {errno.EPERM}"}


@needs_landlock
@needs_seccomp
def test_a_case_runs_under_both_kernel_layers_and_what_the_hook_never_saw_is_refused(tmp_path: Path) -> None:
    # os.mkfifo, a read, /dev/shm and pidfd signals raise no audit event: before the kernel layers a
    # program could make FIFOs anywhere its user may write, read the host's files, and signal its worker.
    (tmp_path / "secret.txt").write_text("secret")
    shm = f"/tauflow-escaped-{os.getpid()}"
    program = f"""
        import os, signal, _posixshmem
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        print(status["NoNewPrivs"].strip(), status["Seccomp"].strip())
        for attempt in (
            lambda: os.mkfifo({str(tmp_path / "fifo")!r}),
            lambda: open({str(tmp_path / "secret.txt")!r}).read(),
            lambda: _posixshmem.shm_open({shm!r}, os.O_CREAT | os.O_RDWR, 0o600),
            lambda: signal.pidfd_send_signal(os.pidfd_open(os.getppid()), 0),
        ):
            try:
                attempt()
                print("allowed")
            except PermissionError:
                print("refused")
        """
    try:
        result = run(program)
        assert not Path("/dev/shm" + shm).exists()
    finally:
        Path("/dev/shm" + shm).unlink(missing_ok=True)
    assert result.stdout.decode().splitlines() == ["1 2", "refused", "refused", "refused", "refused"], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]


def test_threads_and_their_locks_and_queues_work_in_the_sandbox() -> None:
    # What docs/rewards.md points to where multiprocessing's locks are refused.
    program = """
        import queue, threading
        from concurrent.futures import ThreadPoolExecutor
        lock, q, total = threading.Lock(), queue.Queue(), [0]
        def add(n):
            with lock:
                total[0] += n
            q.put(n)
        threads = [threading.Thread(target=add, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with ThreadPoolExecutor(4) as pool:
            print(total[0], q.qsize(), sum(pool.map(abs, [-1, -2, -3])))
        """
    result = run(program)
    assert result.stdout == b"28 8 6\n", result.stderr


@needs_landlock
def test_dev_shm_stays_closed_and_multiprocessing_locks_say_why(tmp_path: Path) -> None:
    # /dev/shm is shared with every process of the host's (or the container's) IPC namespace: other cases'
    # semaphores, a colocated trainer's shared-memory staging buffers. Landlock cannot tell a program's own
    # files there from theirs, so the program may neither make, write nor remove any file there; POSIX
    # semaphores (multiprocessing's locks, queues and pools) are unavailable, and say so.
    victims = [Path(f"/dev/shm/sem.tauflow-victim-{os.getpid()}"), Path(f"/dev/shm/torch_tauflow_victim_{os.getpid()}")]
    made = f"/tauflow-made-{os.getpid()}"
    program = f"""
        import multiprocessing, multiprocessing.dummy, os, _posixshmem
        def attempt(name, fn):
            try:
                fn()
                print(name, "allowed")
            except PermissionError as e:
                print(name, "refused", "sandbox:" in str(e))
        attempt("lock", multiprocessing.Lock)
        attempt("dummy_pool", lambda: multiprocessing.dummy.Pool(2).close())
        attempt("shm_open", lambda: os.close(_posixshmem.shm_open({made!r}, os.O_CREAT | os.O_RDWR, 0o600)))
        for victim in {[str(v) for v in victims]!r}:  # shm_open and shm_unlink raise no audit event
            attempt("shm_unlink", lambda: _posixshmem.shm_unlink(victim[len("/dev/shm"):]))
            attempt("shm_write", lambda: os.close(_posixshmem.shm_open(victim[len("/dev/shm"):], os.O_RDWR, 0)))
        """
    try:
        for victim in victims:
            victim.write_bytes(b"staged")
        result = run(program)
        attempts = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in result.stdout.decode().splitlines()}
        assert all(v.read_bytes() == b"staged" for v in victims)
        assert not Path("/dev/shm" + made).exists()
        # and the kernel alone (no audit hook), as native code past it would meet it
        attempts_native = f"""
            victim = {str(victims[0])!r}
            attempt("create", lambda: open("/dev/shm/sem.tauflow-native-" + str(os.getpid()), "w").close())
            attempt("write", lambda: open(victim, "r+b").close())
            attempt("remove", lambda: os.remove(victim))
            attempt("rename", lambda: os.rename(victim, victim + "-moved"))
            """
        native = _confined(tmp_path, attempts_native, "landlock")
        assert all(v.read_bytes() == b"staged" for v in victims)
    finally:
        for victim in victims:
            victim.unlink(missing_ok=True)
        Path("/dev/shm" + made).unlink(missing_ok=True)
    assert result.returncode == 0, result.stderr
    assert attempts == {
        "lock": "refused True",  # the sandbox's own message, not sem_open's bare EACCES
        "dummy_pool": "refused True",
        "shm_open": "refused False",
        "shm_unlink": "refused False",
        "shm_write": "refused False",
    }
    eacces = f"refused {errno.EACCES}"
    assert native == {"create": eacces, "write": eacces, "remove": eacces, "rename": eacces}
    assert not list(Path("/dev/shm").glob("sem.tauflow-native-*"))


def test_a_native_library_the_program_wrote_cannot_be_loaded(tmp_path: Path) -> None:
    # The repro: a shared library written into the case directory (allowed) and loaded with
    # ExtensionFileLoader, whose dlopen() ran its constructor, native code no audit event sees. A copy of
    # a standard-library extension stands in for it here; the standard library's own still load.
    program = """
        import importlib.machinery, importlib.util, os, shutil, sys
        import _json  # the standard library's own extension modules load
        shutil.copy(_json.__file__, "mod.so")
        attempts = (
            lambda: importlib.util.module_from_spec(
                importlib.util.spec_from_loader("_json", importlib.machinery.ExtensionFileLoader("_json", "./mod.so"))
            ),
            lambda: sys.path.insert(0, os.getcwd()) or __import__("mod"),
            lambda: __import__("_imp").create_dynamic(importlib.machinery.ModuleSpec("_json", None, origin="mod.so")),
            lambda: __import__("ctypes"),
        )
        for attempt in attempts:
            try:
                attempt()
                print("allowed")
            except PermissionError:
                print("refused")
        import _decimal, _bisect
        print("stdlib", _decimal.Decimal(1) + 1)
        """
    result = run(program)
    assert result.stdout.decode().splitlines() == ["refused"] * 4 + ["stdlib 2"], result.stderr


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the hostile library")
def test_the_hostile_shared_library_escapes_nothing(tmp_path: Path) -> None:
    # The probe's library itself (its source, as found): a constructor that writes a file outside, forks
    # and execs /bin/sh, and tries to signal its worker.
    marker = tmp_path / "PWNED"
    source = tmp_path / "esc.c"
    source.write_text(
        "#include <fcntl.h>\n#include <unistd.h>\n#include <signal.h>\n#include <stdio.h>\n#include <sys/wait.h>\n"
        "__attribute__((constructor)) static void escape(void) {\n"
        f'  int fd = open("{marker}", O_WRONLY | O_CREAT | O_TRUNC, 0644);\n'
        '  if (fd >= 0) { dprintf(fd, "kill=%d\\n", kill(getppid(), 0)); close(fd); }\n'
        "  pid_t p = fork();\n"
        f'  if (p == 0) {{ execl("/bin/sh", "sh", "-c", "echo exec >> {marker}", (char *)0); _exit(1); }}\n'
        "  if (p > 0) waitpid(p, 0, 0);\n"
        "}\n"
    )
    library = tmp_path / "esc.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=120)
    program = f"""
        import base64, importlib.machinery, importlib.util
        open("esc.so", "wb").write(base64.b64decode({base64.b64encode(library.read_bytes()).decode()!r}))
        loader = importlib.machinery.ExtensionFileLoader("esc", "./esc.so")
        try:
            importlib.util.module_from_spec(importlib.util.spec_from_loader("esc", loader))
        except ImportError as e:
            print("loaded:", e)
        """
    result = run(program, wall_time_s=20)
    assert b"PermissionError: sandbox: loading native code (the extension module esc)" in result.stderr
    assert not marker.exists()


def test_the_seccomp_filter_s_syscall_numbers_are_the_kernel_s() -> None:
    # Checked against the kernel's headers where this machine has them (linux-libc-dev): x86_64's own
    # table, and asm-generic's, which is aarch64's.
    runner = _runner_functions()
    tables = {
        "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
        "aarch64": Path("/usr/include/asm-generic/unistd.h"),
    }
    checked = 0
    for arch, column in (("x86_64", 1), ("aarch64", 2)):
        if not tables[arch].exists():
            continue
        defined = dict(re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", tables[arch].read_text()))
        for row in runner["_SECCOMP_DENIED"] + runner["_SECCOMP_CHECKED"]:
            name, nr = row[0], row[column]
            if nr is None:
                assert name not in defined, (arch, name)
            elif name in defined:  # (headers older than a syscall lack it)
                assert int(defined[name]) == nr, (arch, name, defined[name], nr)
                checked += 1
        program = runner["_seccomp_program"](arch, 1234)
        assert len(program) % 8 == 0 and len(program) // 8 < 4096  # BPF_MAXINSNS
    if not checked:
        pytest.skip("no kernel headers here")


def test_without_the_kernel_layers_a_case_still_runs_and_the_service_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(code_exec, "kernel_confinement", lambda: Confinement(0, ""))
    result = run("print(open('/proc/self/status').read().count('Seccomp:\t0'))")
    assert result.stdout == b"1\n", result.stderr
    with caplog.at_level(logging.INFO):
        code_exec.log_confinement(logging.getLogger("test"))
    assert "lacks Landlock" in caplog.text and "and seccomp" in caplog.text
    monkeypatch.setattr(code_exec, "kernel_confinement", lambda: Confinement(6, "x86_64"))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        code_exec.log_confinement(logging.getLogger("test"))
    assert "kernel confinement" in caplog.text and "lacks" not in caplog.text


# -- the audit hook holds --------------------------------------------------------------------------


def _runner_functions() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "tauflow_runner"}  # (not "__main__": defines, runs nothing)
    exec(_RUNNER, namespace)  # noqa: S102 - the module's own runner
    return namespace


def test_the_hook_reads_no_global_and_holds_only_values_a_program_cannot_change() -> None:
    # What a frame walk reaches of the hook (its locals: the values it closes over; its globals: the
    # runner's) must not change what it decides: no global read, no mutable value, no closure but its own
    # (a function's cells can be rebound), no exception caught, no list or dict built while it runs.
    runner = _runner_functions()
    hook = runner["_hook_for"]("/nonexistent/work", "/proc/1", -1, posix, "utf-8", frozenset({"/nonexistent/lib"}))
    immutable_kinds = (
        str, bytes, int, float, type(None), types.BuiltinFunctionType, types.MethodDescriptorType,
        types.WrapperDescriptorType,
    )  # fmt: skip

    def check(value: Any) -> None:
        if isinstance(value, (tuple, frozenset)):
            for item in value:
                check(item)
        elif isinstance(value, type):
            assert not value.__flags__ & (1 << 9), value  # a built-in type (not a heap type: no attributes set)
        elif isinstance(value, types.FunctionType):
            assert value is runner["_resolve"] and value.__closure__ is None and value.__defaults__ is None
        else:
            assert isinstance(value, immutable_kinds), (type(value), value)

    for cell in hook.__closure__:
        check(cell.cell_contents)
    for fn in (hook, runner["_resolve"]):
        assert fn.__code__.co_firstlineno >= 10**9  # its traceback entries are told apart by their line
        assert fn.__code__.co_exceptiontable == b""
        opnames = {i.opname for i in dis.get_instructions(fn)}
        assert not opnames & {"LOAD_GLOBAL", "LOAD_NAME", "STORE_DEREF", "IMPORT_NAME"}, opnames
        assert not {op for op in opnames if op.startswith("BUILD_")} - {"BUILD_TUPLE", "BUILD_SLICE", "BUILD_STRING"}
    # And it decides as it should, called here directly (it is not installed in this process).
    with pytest.raises(PermissionError, match="outside the working directory"):
        hook("open", ("/nonexistent/elsewhere", "w", os.O_WRONLY | os.O_CREAT))
    hook("open", ("/nonexistent/work/a/../b.txt", "w", os.O_WRONLY | os.O_CREAT))
    with pytest.raises(PermissionError, match="another process's /proc"):
        hook("open", ("/proc/1/../2/environ", "r", os.O_RDONLY))
    with pytest.raises(PermissionError, match="importing x._sqlite3"):
        hook("import", ("x._sqlite3", None, None, None, None))
    hook("import", ("_json", "/nonexistent/lib/_json.so", None, None, None))
    for path in ("/nonexistent/work/_json.so", "/nonexistent/lib/site-packages/_json.so", "/tmp/_json.so", 3):
        with pytest.raises(PermissionError, match=r"loading native code \(the extension module _json\)"):
            hook("import", ("_json", path, None, None, None))


def test_a_traceback_walk_to_the_hook_s_frame_does_not_disable_it(tmp_path: Path) -> None:
    # The attack: a refusal's traceback leads (tb_next) down to the hook's frame, whose locals held its
    # tables, mutable; clearing them let the program change files anywhere.
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    program = f"""
        import os
        outside = {str(outside)!r}
        walked = []
        try:
            os.remove(outside)
        except PermissionError as e:
            tb = e.__traceback__
            while tb is not None:
                try:
                    frame = tb.tb_frame
                except PermissionError:
                    walked.append("refused")
                else:
                    walked.append(frame.f_code.co_name)
                    if frame.f_code.co_filename != "solution.py":
                        state = frame.f_locals
                        if "mutating" in state:
                            state["mutating"].clear()
                        for value in list(state.values()):
                            if isinstance(value, (dict, set, list)):
                                value.clear()
                tb = tb.tb_next
        print(walked)
        for attempt in (
            lambda: os.remove(outside),
            lambda: os.rename(outside, outside + ".moved"),
            lambda: os.link(outside, "here"),
            lambda: os.chmod(outside, 0o777),
        ):
            try:
                attempt()
                print("allowed")
            except PermissionError:
                print("refused")
        """
    result = run(program)
    walked, *attempts = result.stdout.decode().splitlines()
    assert walked == "['<module>', 'refused']" and attempts == ["refused"] * 4, result.stdout + result.stderr
    assert outside.read_text() == "keep" and [p.name for p in tmp_path.iterdir()] == ["outside.txt"]
    assert outside.stat().st_mode & 0o777 != 0o777


def test_the_hook_s_running_frame_holds_nothing_to_change(tmp_path: Path) -> None:
    # A signal handler gets the frame it interrupts: now and then the hook's own, running. Clearing its
    # containers, rebinding closures' cells, replacing its helper's code: none of it lets a change through.
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    program = f"""
        import os, signal, time, types
        outside, inside = {str(outside)!r}, os.getcwd()
        permissive = eval("lambda *args: %r" % inside)
        hits = refused = 0

        def handler(signum, frame):
            global hits, refused
            while frame is not None:
                if frame.f_code.co_filename == "<string>" and frame.f_code.co_name not in ("<module>", "_run"):
                    hits += 1
                    for value in list(frame.f_locals.values()):
                        if isinstance(value, (dict, set, list, bytearray)):
                            value.clear()
                        if isinstance(value, types.FunctionType):
                            for cell in value.__closure__ or ():
                                cell.cell_contents = inside
                            try:
                                value.__code__ = permissive.__code__
                            except PermissionError:
                                refused += 1
                frame = frame.f_back

        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
        deadline, removed = time.monotonic() + 1.0, False
        while hits < 50 and time.monotonic() < deadline and not removed:
            try:
                os.remove(outside)
                removed = True
            except PermissionError:
                pass
        signal.setitimer(signal.ITIMER_REAL, 0)
        print(hits > 0, refused > 0, removed)
        """
    result = run(program)
    assert result.stdout == b"True True False\n", result.stdout + result.stderr
    assert outside.read_text() == "keep"


def test_patching_the_standard_library_does_not_disable_the_hook(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    program = f"""
        import builtins, genericpath, os, posixpath
        cwd = os.getcwd()
        builtins.isinstance = lambda *args: True
        os.path.realpath = posixpath.realpath = lambda path, **kwargs: cwd
        os.fsdecode = lambda path: cwd
        os.path.isdir = genericpath.isdir = posixpath.isdir = lambda path: False
        for attempt in (
            lambda: open({str(tmp_path / "escape.txt")!r}, "w"),
            lambda: os.remove({str(outside)!r}),
            lambda: os.open("/", os.O_RDONLY),
            lambda: open("/proc/%d/cmdline" % os.getppid(), "rb"),
        ):
            try:
                attempt()
                print("allowed")
            except PermissionError:
                print("refused")
        """
    result = run(program)
    assert result.stdout.decode().splitlines() == ["refused"] * 4, result.stdout + result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["outside.txt"]


def test_sqlite_and_dbm_cannot_make_files_outside_the_working_directory(tmp_path: Path) -> None:
    # SQLite opens its files itself, past the hook's "open" checks (ATTACH DATABASE as well): refused whole.
    attached = tmp_path / "attached.db"
    program = f"""
        for attempt in (
            "import sqlite3; sqlite3.connect({str(tmp_path / "made.db")!r}).execute('create table t (x)')",
            "import sqlite3; sqlite3.connect(':memory:').execute(\\"attach '{attached}' as a\\")",
            "import importlib.util, _imp; s = importlib.util.find_spec('_sqlite3'); s.name = 'x._sqlite3'; "
            "_imp.create_dynamic(s)",
            "import dbm; dbm.open({str(tmp_path / "made.dbm")!r}, 'c')",
            "import _gdbm",
            "import _dbm",
        ):
            try:
                exec(attempt)
                print("allowed")
            except PermissionError:
                print("refused")
        """
    result = run(program)
    assert result.stdout.decode().splitlines() == ["refused"] * 6, result.stdout + result.stderr
    assert list(tmp_path.iterdir()) == []


def test_other_processes_proc_files_cannot_be_opened() -> None:
    # Where the child runs as the service's uid without a user namespace of its own, /proc/<worker>/environ
    # (a bearer token) is readable unless the worker is not dumpable; the hook refuses it either way. As
    # root, the kernel refuses environ to the child (no capabilities), not cmdline: the message tells.
    program = """
        import os
        parent = os.getppid()
        for path in (
            "/proc/%d/environ" % parent,
            "/proc/%d/cmdline" % parent,
            "/proc/self/../%d/cmdline" % parent,
            b"/proc/%d/cmdline" % parent,
            "/proc/1/cmdline",
        ):
            try:
                with open(path, "rb") as f:
                    print("read", len(f.read()))
            except PermissionError as e:
                print(e)
        try:
            os.open("/proc/%d/environ" % parent, os.O_RDONLY)
        except PermissionError as e:
            print(e)
        print(all(open(p).read() for p in ("/proc/self/status", "/proc/thread-self/status", "/proc/self/net/dev")))
        """
    result = run(program)
    *refusals, own = result.stdout.decode().splitlines()
    assert refusals == ["sandbox: reading another process's /proc (open) is not allowed"] * 6, result.stdout
    assert own == "True", result.stderr


def test_standard_library_modules_that_walk_frames_or_replace_code_still_work() -> None:
    program = '''
        import asyncio, collections, doctest, traceback, typing

        def double(x):
            """
            >>> double(2)
            4
            """
            return 2 * x

        try:
            1 / 0
        except ZeroDivisionError:
            print(traceback.format_exc().splitlines()[-1])
        print(doctest.testmod().failed, collections.namedtuple("P", "a")(1).a, typing.TypeVar("T"))
        print(asyncio.run(asyncio.sleep(0, "async")))
        '''
    result = run(program)
    expected = ["ZeroDivisionError: division by zero", "0 1 ~T", "async"]
    assert result.stdout.decode().splitlines() == expected, result.stderr


# -- the cases' directories ----------------------------------------------------------------------


def _owned_dirs(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"tauflow-code-{pid}-*"))


def _run_forever() -> None:
    run_case("import time\ntime.sleep(60)\n", Case(stdin="", expected=""), wall_time_s=50)


def test_the_directory_of_a_killed_worker_is_swept_by_the_next_case() -> None:
    # The service ends a worker past a sample's timeout with SIGTERM: no finally runs, the case's
    # directory stays behind. The next case, in any process, removes it.
    worker = multiprocessing.get_context("fork").Process(target=_run_forever)
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while not any(p.is_dir() for d in _owned_dirs(worker.pid or 0) for p in d.iterdir()):
            assert time.monotonic() < deadline, "the worker's case never started"
            time.sleep(0.02)
    finally:
        worker.terminate()
        worker.join()
    left = _owned_dirs(worker.pid or 0)
    assert len(left) == 1 and any(p.is_dir() for p in left[0].iterdir())  # what the kill leaves
    run("print(1)")
    assert not left[0].exists()


def test_each_case_sweeps_the_directories_of_dead_processes_only(tmp_path: Path) -> None:
    tmp = Path(tempfile.gettempdir())
    ended = subprocess.Popen(["true"])
    ended.wait()
    sleeper = subprocess.Popen(["sleep", "30"])
    leftover = tmp / f"tauflow-code-{ended.pid}-leftover"  # its process is gone
    starting = tmp / f"tauflow-code-{sleeper.pid}-starting"  # not locked yet, but its process runs
    locked = tmp / f"tauflow-code-{ended.pid}-locked"  # locked by a live process, whatever its pid says
    link = tmp / f"tauflow-code-{ended.pid}-link"  # a symbolic link is never followed
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (leftover / "tmpcase" / "sub").mkdir(parents=True)
    (leftover / "tmpcase" / "output.txt").write_text("left")
    starting.mkdir()
    locked.mkdir()
    link.symlink_to(victim)
    fd = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        run("print(1)")
        assert not leftover.exists()
        assert starting.is_dir() and locked.is_dir() and link.is_symlink() and (victim / "sub").is_dir()
        sleeper.kill()
        sleeper.wait()
        os.close(fd)
        fd = -1
        run("print(1)")
        assert not starting.exists() and not locked.exists() and link.is_symlink()
    finally:
        if fd >= 0:
            os.close(fd)
        sleeper.kill()
        sleeper.wait()
        link.unlink(missing_ok=True)
        for d in (leftover, starting, locked):
            shutil.rmtree(d, ignore_errors=True)
