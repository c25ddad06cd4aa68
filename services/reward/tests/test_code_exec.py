"""The built-in ``code`` reward: extraction, test formats, scoring, and what its sandbox enforces."""

from __future__ import annotations

import json
import os
import signal
import socket
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tauflow.reward.api import SampleInput, Score
from tauflow.reward.builtins import ConfigInvalid, MissingReference
from tauflow.reward.code_exec import (
    Case,
    CaseResult,
    CodeExecution,
    case_passed,
    extract_program,
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
