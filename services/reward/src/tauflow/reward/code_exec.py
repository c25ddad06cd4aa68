"""The built-in reward ``code``: runs the program in a completion against the sample's tests, in a sandbox.

The program is a fenced code block of the completion (by default the last ```python block, else the last
untagged one); the tests come from the sample's metadata (``tests``, else the group's), in one of two formats:

* assert tests: Python source run after the program in the same process (one case), or a JSON list of such
  sources, each run as its own case (partial credit);
* stdin/stdout tests, the APPS / CodeContests / LiveCodeBench format ``{"inputs": [...], "outputs": [...]}``:
  the program runs once per case with the input on stdin, and its stdout must equal the output once each
  line's trailing whitespace and the trailing blank lines are dropped.

A case passes when the program exits with status 0 within its limits (and, for stdin/stdout, prints the
expected output). An assert case also needs the runner's per-case token on stdout, written only once the
tests ran to their end, so that ``sys.exit(0)``, ``exit()`` or ``os._exit(0)`` before the asserts fail.

The sandbox, and what it does and does not stop
------------------------------------------------
Each case is a fresh ``python -I -S -B`` (isolated mode: no PYTHON* variables, no site-packages, no user
site, no bytecode written; so programs get the standard library only) with an empty environment (PATH, LANG,
MALLOC_ARENA_MAX, and HOME and TMPDIR set to the case's directory), in its own session and process group,
a new temporary directory as its working directory, and stdin from the case's input (an unnamed file in
that directory, so that ``open("/dev/stdin")`` passes Landlock; else /dev/null); its
stdout and stderr are read up to ``max_output_bytes`` each. The case's directory is deleted afterwards; it
lies in its worker process's own ``<TMPDIR>/tauflow-code-<pid>-*``, locked while that process lives, so
that the directory of a worker killed mid-case (past a sample's timeout: no ``finally`` runs) is removed
by the next case of any worker (``_case_parent``). ``wall_time_s`` and ``total_time_s`` must leave 5 s of
the function's ``timeout_s``. A runner (``_RUNNER``) sets the child up before the program runs, in this
order:

1. resource limits: RLIMIT_CPU (``cpu_time_s``: SIGXCPU, SIGKILL a second later), RLIMIT_AS (``memory_mb``:
   allocations past it raise MemoryError), RLIMIT_FSIZE (10 MiB a file), RLIMIT_CORE 0;
2. its own network namespace, with nothing in it but a loopback that is down: as root by
   ``unshare(CLONE_NEWNET)``; as any other user inside a new user namespace (``CLONE_NEWUSER |
   CLONE_NEWNET``) where unprivileged user namespaces are allowed; Docker's and Kubernetes' default seccomp
   profiles refuse them, and there the child shares the service's network, which the audit hook and the
   seccomp filter (no socket) refuse. Inside a user namespace RLIMIT_NPROC is set too (64 tasks, threads
   included), since the kernel (5.14+) then counts the sandbox's tasks alone. It is not set otherwise: root
   is exempt from it, and in the service's own user namespace it would count every process and thread of
   the service's user;
3. ``PR_SET_NO_NEW_PRIVS``, and every capability dropped (the bounding set, then the permitted, effective
   and inheritable sets): a child of a root service cannot ``setns`` back to the host's network, mount,
   load modules, trace other processes or override file permissions; it is still uid 0, though, the owner
   of whatever root owns;
4. ``PR_SET_PDEATHSIG`` SIGKILL: a child dies with its worker (the service kills workers past a sample's
   timeout);
5. Landlock (Linux 5.13+ with the LSM enabled; ``_landlock``): writing, creating, removing, renaming and
   linking only under the case's directory (a rename or link across directories needs ABI 2, Linux 5.19;
   under ABI 1 it is refused everywhere), truncating there only (ABI 3), reading only the case's directory,
   the interpreter's own files (``sys.path``, ``sys.base_prefix``), ``/usr``, ``/lib*``, ``/proc``, the
   online CPUs, the C library's few files of ``/etc`` (ld.so.cache, localtime, passwd, group,
   nsswitch.conf, os-release, mime.types) and ``/dev/null``, ``zero``, ``full``, ``random``, ``urandom``;
   executing nothing. From ABI 4 (6.7) no TCP bind or connect; from ABI 6 (6.12) no signal to a process
   outside the sandbox and no abstract UNIX socket of another domain. Where the kernel has no Landlock the
   service says so once at its start (a warning) and the other layers still apply. ``/dev/shm`` stays
   closed: Landlock grants a directory, not names, and a program that may write there may overwrite or
   remove every file of its uid in it (other cases' semaphores, a colocated trainer's shared memory). So
   no POSIX semaphore, nor any of multiprocessing's locks, queues and pools (``multiprocessing.dummy``'s
   too), which refuse with a PermissionError that says so (``_semaphores_refused``); threads work;
6. a seccomp-BPF filter (Linux 4.14+, x86_64 and aarch64; ``_seccomp_program``): a syscall of another ABI
   (i386, x32, arm32) kills the process; EPERM for ``execve``/``execveat``, ``fork``/``vfork``, ``clone``
   without ``CLONE_THREAD`` or with a new namespace (``clone3``: ENOSYS, so that glibc makes its threads
   with ``clone``), ``kill``/``tgkill``/``rt_sigqueueinfo``/``rt_tgsigqueueinfo`` to another process,
   ``tkill``, ``pidfd_open``/``pidfd_send_signal``/``pidfd_getfd``, ``ptrace``, ``process_vm_readv``/
   ``writev``, ``kcmp``, ``process_madvise``, ``prlimit64``/``setpriority``/``ioprio_set``/``sched_set*`` of
   another process, ``socket`` (all families), ``connect``, ``bind``, ``listen`` and every ``socketpair`` but
   AF_UNIX SOCK_STREAM (asyncio's), ``mount`` and the new mount API, ``umount2``, ``unshare``, ``setns``,
   ``chroot``, ``pivot_root``, ``open_by_handle_at``, ``bpf``, ``perf_event_open``, ``userfaultfd``,
   ``fanotify_init``, ``io_uring_*``, ``keyctl``/``add_key``/``request_key``, module loading, ``kexec``,
   ``reboot``, swap, ``acct``, quotas, ``syslog``, ``personality``, x86's ``iopl``/``ioperm``/
   ``modify_ldt``/``uselib``, setting the clock or the host's names, System V IPC and POSIX message queues,
   ``ioctl`` TIOCSTI/TIOCLINUX/FIOSETOWN/SIOCSPGRP, ``fcntl`` F_SETOWN(_EX), and ``prctl(PR_SET_PDEATHSIG)``.
   Where the kernel has no seccomp filter, or on another arch, the service says so once and the other
   layers still apply. Both kernel layers are set up in the child only (the worker must still start
   children), after ``PR_SET_NO_NEW_PRIVS``, and for good: a layer that the kernel offers (the worker asked
   it: ``kernel_confinement``) but refuses to set up fails the case (exit status 71);
7. a Python audit hook (``sys.addaudithook``) that refuses network use (sockets other than AF_UNIX, connect,
   bind, sendto, sendmsg, name look-ups, syslog); starting or signalling processes (``subprocess``,
   ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``, ``os.fork``, ``os.forkpty``, ``os.kill``,
   ``os.killpg``, ``signal.pthread_kill``; ``_posixsubprocess``, whose ``fork_exec`` raises no audit event,
   is a stub); new interpreters (``_xxsubinterpreters``: a new one has no audit hook); ``ctypes`` and
   CPython's ``_test*`` modules; ``resource.setrlimit``; SQLite and dbm (``_sqlite3``, ``_dbm``, ``_gdbm``,
   which open their files themselves, ``ATTACH DATABASE`` too); ``os.open`` of a directory (so that no
   ``dir_fd`` exists to resolve paths the hook never sees); opening anything under ``/proc`` but the
   child's own ``/proc/<pid>`` (``/proc/self``), another process's above all (``/proc/<worker>/environ``);
   changing files outside the case's directory (opening for writing, removing, renaming, linking,
   chmod, chown, truncate, utime); and loading an extension module (``_imp.create_dynamic``, which
   ``ExtensionFileLoader`` calls: its ``dlopen`` runs the library's constructor, native code no audit
   event sees) from anywhere but the standard library's own directories (``sys.path`` under ``-I -S``, not
   their subdirectories): never a library the program wrote. Paths are checked as the kernel will walk
   them (symbolic links and ``..`` resolved).

   The program cannot switch the hook off from Python: everything the hook reads is bound before the
   program runs to values nothing can change (strings, numbers, tuples, frozensets, built-in functions and
   types, and one helper function without globals or closure, whose ``__code__`` cannot be replaced); it
   reads no global, calls no Python function of the standard library (a program can patch
   ``os.path.realpath`` or ``builtins.isinstance``) nor a method of the program's objects, keeps no mutable
   local and catches no exception. A program that reaches its frame anyway finds nothing to change there (a
   signal handler is handed the frame it interrupts, now and then the hook's; ``f_back`` and ``f_locals``
   raise no audit event). ``tb_frame`` of the hook's frames in a refusal's traceback (told apart by their
   line numbers, from 10**9), ``sys._current_frames`` and ``gc.get_objects`` and its kin are refused
   besides. ``sys._getframe``, and ``tb_frame`` of other frames, stay allowed (logging, doctest, traceback,
   typing and namedtuple need them): they reach only the program's frames and the runner's.

Reading ``/proc/<pid>/environ`` of a worker (a reward function's bearer token) is stopped by the kernel,
not by the hook: a worker is not dumpable (``PR_SET_DUMPABLE`` 0, set by the service and its pool workers),
so no process of its uid without CAP_SYS_PTRACE may read its memory or environment. A child of a root
service lacks the capabilities of its parent, which the kernel requires too; but where the child cannot
get a user namespace and runs under the worker's own uid, nothing else stops it.

What holds is what the kernel enforces: the resource limits, the network namespace where there is one, the
capabilities dropped, Landlock and the seccomp filter where the kernel has them, the SIGKILL of the whole
process group at ``wall_time_s`` (or at the output cap), a throwaway working directory, and a worker that
is not dumpable. The audit hook is defence in depth, not a boundary (PEP 578 says as much): native code
gets past it. ctypes and extension modules the program wrote, the usual ways, are refused, but a
memory-corruption bug in the interpreter or in a C extension, crafted bytecode (``marshal.loads`` makes a
code object of any bytes, and imports need it), or a race that swaps a path (a symbolic link) between the
hook's check and the kernel's walk is enough; and the hook does not see what raises no audit event
(``os.mkfifo``, ``os.mknod``, ``_posixshmem.shm_open``, ``signal.pidfd_send_signal``). With both kernel
layers, native code that gets past the hook still cannot start a process, signal, trace or re-limit
another process, open a socket but a stream pair, write outside its directory, read the host's files
outside the list above, or reach io_uring, bpf, perf, userfaultfd, keys or mounts; it runs as the same
uid, though (uid 0 under a root service, without capabilities), and can read what Landlock leaves
readable (``/proc`` of the service's processes included, but not a non-dumpable worker's environment or
memory). Without Landlock a program past the hook can write wherever the service's user may write and
read whatever it may read; without seccomp it can start processes (which inherit everything above but
the hook), signal the service's other processes, and reach the network where the child has no namespace
of its own. No layer covers the total size of what a case writes (RLIMIT_FSIZE bounds one file) or the
kernel's remaining attack surface; that takes a container, gVisor, nsjail or a remote sandbox. For
untrusted code at scale run the reward service in its own container, as deploy/ does (as the unprivileged
uid 10001, over a root-owned environment), never as root (a program past every layer would still be uid
0), and give that container no secrets, a network policy that lets it reach nothing but its callers, and
a size-bounded tmpfs as TMPDIR.

Asserts run in the program's own process, so a program can defeat them (an ``__eq__`` that always returns
True, a patched builtin, a frame walk that finds the token): stdin/stdout tests, compared outside the
sandbox, are the robust format for RL.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import json
import logging
import marshal
import math
import os
import platform
import re
import secrets
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from tauflow.reward.api import SampleInput, Score
from tauflow.reward.builtins import MAX_KEY_CHARS, _Options, _reference, _validate

MAX_FILE_BYTES = 10 << 20  # RLIMIT_FSIZE: the most a program may write to one file
MAX_TASKS = 64  # RLIMIT_NPROC inside a user namespace: the sandbox's processes and threads
# What a case's directory may hold (RLIMIT_FSIZE bounds one file only: 50 files of 5 MiB filled a run's disk at
# 250 MiB/s); watched by the worker every WATCH_S, with its thread count (root is exempt from RLIMIT_NPROC: one
# case started 7,930 threads), and the case is killed past either.
MAX_CASE_BYTES = 64 << 20
MAX_CASE_ENTRIES = 4096
WATCH_S = 0.05
TIMEOUT_S = 60.0  # CodeExecution.timeout_s: past it the service kills the worker, mid-case
# wall_time_s and total_time_s must leave this much of TIMEOUT_S: a sample's cases end before the worker's
# timeout, and its results come back as a score, not a timeout.
TIMEOUT_MARGIN_S = 5.0
# What the child sees of the environment; HOME and TMPDIR are its own directory (tempfile writes there).
# RLIMIT_AS counts address space reserved, not used: glibc reserves 64 MiB for each thread's malloc arena,
# which under 512 MiB stopped a program at 14 threads (54 with two arenas).
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "2"}
_READ_CHUNK = 1 << 16


class CodeOptions(_Options):
    tests_key: str = Field("tests", min_length=1, max_length=MAX_KEY_CHARS)
    tests_format: Literal["auto", "asserts", "io"] = "auto"
    extract: Literal["last_block", "first_block", "whole"] = "last_block"
    scoring: Literal["all_or_nothing", "fraction"] = "all_or_nothing"
    # With all_or_nothing, the cases after the first failure are not run (fraction runs them all).
    stop_on_first_failure: bool = True
    correct_score: float = 1.0
    incorrect_score: float = 0.0
    cpu_time_s: int = Field(5, ge=1, le=60)  # per case (RLIMIT_CPU counts whole seconds)
    wall_time_s: float = Field(10.0, gt=0)  # per case
    # All the cases of a sample together; the cases it leaves unrun fail. Both at most the function's
    # timeout_s (60 s) less 5 s: past timeout_s the service kills the worker and the sample is a timeout.
    total_time_s: float = Field(50.0, gt=0)
    memory_mb: int = Field(512, ge=16, le=16384)
    max_output_bytes: int = Field(1 << 20, ge=1, le=64 << 20)  # per stream and case; more fails the case
    max_program_chars: int = Field(100_000, ge=1, le=1_000_000)  # a longer program fails, not run
    max_tests_chars: int = Field(1_000_000, ge=1, le=64_000_000)
    max_cases: int = Field(64, ge=1, le=1024)

    @field_validator("wall_time_s", "total_time_s")
    @classmethod
    def _within_the_timeout(cls, v: float) -> float:
        if v > TIMEOUT_S - TIMEOUT_MARGIN_S:
            raise ValueError(
                f"must be at most {TIMEOUT_S - TIMEOUT_MARGIN_S:g} s: the code function's timeout_s is "
                f"{TIMEOUT_S:g} s, past which the service kills its worker mid-case"
            )
        return v


@dataclass(frozen=True)
class Case:
    """One run of the program: ``tests`` (assert source) run after it, or ``stdin`` fed to it and its
    stdout compared with ``expected``."""

    tests: str | None = None
    stdin: str | None = None
    expected: str | None = None


@dataclass(frozen=True)
class CaseResult:
    returncode: int | None  # negative: the signal that ended it
    stdout: bytes
    stderr: bytes
    timed_out: bool  # past wall_time_s, or ended by RLIMIT_CPU (SIGXCPU, or SIGKILL at the hard limit)
    output_exceeded: bool  # stdout or stderr past max_output_bytes (then killed)
    # An assert case: the runner got to the end of the tests (the program did not end the process before
    # them). A stdin/stdout case: always True (its output is what counts).
    finished: bool
    duration_s: float
    # Killed for what the kernel does not bound for it: "tasks" (threads past MAX_TASKS, where RLIMIT_NPROC is
    # not set: a root service) or "disk" (its directory past MAX_CASE_BYTES or MAX_CASE_ENTRIES); else "".
    over_limit: str = ""


class CodeExecution:
    description = (
        "Runs the program in the completion (its last ```python block) against the tests in "
        "Sample.metadata['tests'] (else Group.metadata['tests']): Python asserts (source, or a JSON list run "
        'one case each) or stdin/stdout cases {"inputs": [...], "outputs": [...]}, each case in a '
        "sandboxed subprocess (CPU, memory and wall-time limits, no network, a throwaway directory); "
        "1 when every case passes, else 0 (scoring='fraction': the fraction passed). Standard library only."
    )
    default_config: ClassVar[dict[str, Any]] = CodeOptions().model_dump()
    # The sandbox's limits are the operator's (functions.code.config): a request may lower them, not raise them.
    ceiling_keys = (
        "cpu_time_s",
        "wall_time_s",
        "total_time_s",
        "memory_mb",
        "max_output_bytes",
        "max_program_chars",
        "max_tests_chars",
        "max_cases",
    )
    timeout_s = TIMEOUT_S
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(CodeOptions, config)

    def __call__(self, sample: SampleInput, config: dict[str, Any]) -> Score:
        cases = parse_tests(
            _reference(sample, config["tests_key"]),
            config["tests_format"],
            max_chars=config["max_tests_chars"],
            max_cases=config["max_cases"],
        )
        components = {"code_found": 0.0, "passed": 0.0, "cases": float(len(cases)), "timeouts": 0.0}
        program = extract_program(sample.completion_text, config["extract"])
        if program is None:
            return Score(config["incorrect_score"], components)
        components["code_found"] = 1.0
        passed = timeouts = 0
        if len(program) <= config["max_program_chars"]:
            stop = config["scoring"] == "all_or_nothing" and config["stop_on_first_failure"]
            deadline = time.monotonic() + config["total_time_s"]
            for case in cases:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                result = run_case(
                    program,
                    case,
                    cpu_time_s=config["cpu_time_s"],
                    memory_mb=config["memory_mb"],
                    wall_time_s=min(config["wall_time_s"], left),
                    max_output_bytes=config["max_output_bytes"],
                )
                timeouts += result.timed_out
                if case_passed(case, result):
                    passed += 1
                elif stop:
                    break
        components.update(passed=float(passed), timeouts=float(timeouts))
        low, high = config["incorrect_score"], config["correct_score"]
        if config["scoring"] == "fraction":
            return Score(low + (high - low) * passed / len(cases), components)
        return Score(high if passed == len(cases) else low, components)


# -- the program --------------------------------------------------------------------------------

_PYTHON_TAGS = frozenset({"python", "py", "python3", "py3"})


def extract_program(text: str, mode: str = "last_block") -> str | None:
    """The program in a completion: ``"whole"`` the text itself; else the first or last fenced block
    tagged python (py, python3), or when there is none the first or last untagged block (a block tagged
    with another language, ``text`` or ``bash``, is never the program). ``None`` when there is no block."""
    if mode == "whole":
        return text if text.strip() else None
    tagged: list[str] = []
    untagged: list[str] = []
    tag: str | None = None  # inside a block: its tag ("" when untagged)
    body: list[str] = []
    for line in text.splitlines():
        fence = line.strip()
        if tag is None:
            if fence.startswith("```"):
                tag = fence[3:].strip().split(" ")[0].lower()
                body = []
        elif fence.startswith("```") and not fence.strip("`"):
            if tag in _PYTHON_TAGS:
                tagged.append("\n".join(body) + "\n")
            elif not tag:
                untagged.append("\n".join(body) + "\n")
            tag = None
        else:
            body.append(line)
    blocks = tagged or untagged
    if not blocks:
        return None
    return blocks[0] if mode == "first_block" else blocks[-1]


# -- the tests ----------------------------------------------------------------------------------


def parse_tests(text: str, fmt: str = "auto", *, max_chars: int = 1_000_000, max_cases: int = 64) -> list[Case]:
    """The cases of a sample's tests (see the module's docstring); ``ValueError`` for tests that cannot
    be run as given (malformed, too long, too many cases), which the service reports as the sample's error."""
    if len(text) > max_chars:
        raise ValueError(f"the tests are {len(text)} characters long; max_tests_chars is {max_chars}")
    parsed: Any = None
    if fmt == "io":
        try:
            parsed = json.loads(text)
        except ValueError as e:
            raise ValueError(f"stdin/stdout tests are not valid JSON: {e}") from None
    elif text.lstrip()[:1] in ("{", "["):
        with contextlib.suppress(ValueError):
            parsed = json.loads(text)
    if fmt == "io" or (fmt == "auto" and isinstance(parsed, dict)):
        cases = _io_cases(parsed)
    elif isinstance(parsed, list):
        cases = [Case(tests=_assert_source(t, f"tests[{i}]")) for i, t in enumerate(parsed)]
    elif isinstance(parsed, dict):
        raise ValueError("assert tests must be Python source or a JSON list of Python sources, not an object")
    else:
        cases = [Case(tests=_assert_source(text, "tests"))]
    if not cases:
        raise ValueError("the tests hold no case")
    if len(cases) > max_cases:
        raise ValueError(f"the tests hold {len(cases)} cases; max_cases is {max_cases}")
    return cases


def _io_cases(parsed: Any) -> list[Case]:
    if not isinstance(parsed, dict) or "inputs" not in parsed or "outputs" not in parsed:
        raise ValueError('stdin/stdout tests must be a JSON object {"inputs": [...], "outputs": [...]}')
    if parsed.get("fn_name"):
        raise ValueError("call-based tests (fn_name) are not supported; only stdin/stdout cases are")
    inputs, outputs = parsed["inputs"], parsed["outputs"]
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError("stdin/stdout tests: inputs and outputs must be lists")  # noqa: TRY004 - bad data
    if len(inputs) != len(outputs):
        raise ValueError(f"stdin/stdout tests: {len(inputs)} inputs but {len(outputs)} outputs")
    for name, values in (("inputs", inputs), ("outputs", outputs)):
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise ValueError(f"stdin/stdout tests: {name}[{i}] is a {type(v).__name__}, not a string")  # noqa: TRY004
    return [Case(stdin=i, expected=o) for i, o in zip(inputs, outputs, strict=True)]


def _assert_source(source: Any, where: str) -> str:
    if not isinstance(source, str):
        raise ValueError(f"{where} is a {type(source).__name__}, not Python source")  # noqa: TRY004
    if not source.strip():
        raise ValueError(f"{where} is empty: it would pass any program that runs")
    try:
        compile(source, where, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:  # (ValueError: a NUL character)
        raise ValueError(f"{where} is not valid Python: {e}") from None
    return source


def _normalise_output(text: str) -> str:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def case_passed(case: Case, result: CaseResult) -> bool:
    if result.returncode != 0 or result.timed_out or result.output_exceeded or result.over_limit or not result.finished:
        return False
    if case.expected is None:
        return True
    return _normalise_output(result.stdout.decode(errors="replace")) == _normalise_output(case.expected)


# -- the sandbox ---------------------------------------------------------------------------------

# Run in the child by ``python -I -S -B -c _RUNNER <fd>``, where fd is an unlinked file holding the
# marshalled (program, tests, cpu_s, memory_bytes, file_bytes, max_tasks, parent_pid, token). Run with any
# other ``__name__`` it only defines its functions (the tests read the hook that way).
_RUNNER = r"""
import sys

_FAR = 1000000000  # the hook's code starts at this line: a traceback entry this deep is one of its frames


def _resolve(path, base, fns):
    # The absolute path that ``path`` names, every symbolic link in it resolved as the kernel walks it (a
    # component that does not exist is kept as it is), relative to ``base`` (None: the working directory);
    # None when ``path`` is neither str nor bytes (the events pass an os.PathLike's path, converted once) or
    # holds more than 40 links. Pure: what it calls comes in ``fns``; no global, closure, default or mutable
    # local (a signal handler sees a running frame's locals), so nothing a program can reach changes its
    # answer. It catches nothing: an error refuses the event.
    type_, issubclass_, str_, bytes_, as_str, as_bytes, decode, encoding, lstat, readlink, exists, getcwd = fns
    kind = type_(path)
    if kind is str_:
        pass
    elif kind is bytes_:
        path = decode(path, encoding, "surrogateescape")
    elif issubclass_(kind, str_):  # the characters open() uses, whatever the subclass's methods say
        path = as_str(path)
    elif issubclass_(kind, bytes_):
        path = decode(as_bytes(path), encoding, "surrogateescape")
    else:
        return None
    if not path.startswith("/"):
        path = (getcwd() if base is None else base) + "/" + path
    done, rest, links = "", path, 0
    while rest:
        name, _, rest = rest.partition("/")
        if name == "" or name == ".":
            continue
        if name == "..":
            done = done[: done.rfind("/")]
            continue
        step = done + "/" + name
        if not exists(step, 0, follow_symlinks=False) or lstat(step).st_mode & 0o170000 != 0o120000:
            done = step
            continue
        links += 1
        if links > 40:
            return None
        target = readlink(step)
        if target.startswith("/"):
            done = ""
        rest = target + "/" + rest
    return done or "/"


def _hook_for(root, proc, proc_dev, posix, encoding, native_dirs):
    # ``native_dirs``: a frozenset of the directories whose files (not those of their subdirectories) an
    # extension module may be loaded from: the standard library's.
    # Everything the hook reads is bound here, before the program runs, to what a program cannot change:
    # str, int, tuple and frozenset values, built-in functions and types, and _resolve. The hook reads no
    # global (the runner's globals are a dict that any frame walk reaches), calls no Python function of the
    # standard library (os.path.realpath, os.fsdecode: their modules can be patched) nor a method a program's
    # object could override, keeps no mutable local, and catches no exception (one raised by a signal
    # handler inside it would turn a refusal into a pass): whatever goes wrong refuses the event.
    deny = frozenset((
        "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.kill",
        "os.killpg", "os.startfile", "os.setns", "os.unshare", "subprocess.Popen", "signal.pthread_kill",
        "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
        "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname",
        "syslog.openlog", "syslog.syslog",
        "resource.setrlimit", "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "sys._current_frames", "sys._current_exceptions",
        # A new interpreter has no audit hook: the hook would not see anything it runs.
        "cpython.PyInterpreterState_New",
        # SQLite writes its files itself (ATTACH DATABASE too), past the "open" checks.
        "sqlite3.connect", "sqlite3.connect/handle", "sqlite3.enable_load_extension", "sqlite3.load_extension",
    ))
    # Modules refused by the last part of their name (so that a spec named "x._ctypes" does not pass),
    # besides every "_test*" module (CPython's test helpers read and write raw memory).
    denied_modules = frozenset((
        "_posixsubprocess", "_ctypes", "ctypes", "_sqlite3", "_dbm", "_gdbm", "_xxsubinterpreters",
        "_xxinterpchannels", "_ctypes_test", "_xxtestfuzz",
    ))
    # event, the indices of its path arguments, of its dir_fd arguments
    mutating = (
        ("os.remove", (0,), (1,)), ("os.rmdir", (0,), (1,)), ("os.mkdir", (0,), (2,)),
        ("os.rename", (0, 1), (2, 3)), ("os.link", (0, 1), (2, 3)), ("os.symlink", (1,), (2,)),
        ("os.chmod", (0,), (2,)), ("os.chown", (0,), (3,)), ("os.truncate", (0,), ()),
        ("os.utime", (0,), (3,)), ("os.setxattr", (0,), ()), ("os.removexattr", (0,), ()),
        ("os.chflags", (0,), ()), ("os.lchflags", (0,), ()),
    )
    mutating_events = frozenset(m[0] for m in mutating)
    writing = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    devices = frozenset(("/dev/null", "/dev/stdout", "/dev/stderr"))
    type_, issubclass_, str_, int_, refused = type, issubclass, str, int, PermissionError
    as_str, as_int, resolve = str.__str__, int.__index__, _resolve
    stat, exists, readlink = posix.stat, posix.access, posix.readlink
    fns = (
        type, issubclass, str, bytes, str.__str__, bytes.__bytes__, bytes.decode, encoding, posix.lstat,
        posix.readlink, posix.access, posix.getcwd,
    )
    try:
        raise ValueError
    except ValueError as e:
        traceback_type = type(e.__traceback__)
    prefix, proc_prefix = root + "/", proc + "/"

    def hook(event, args):
        if event in deny or event.startswith("ctypes."):
            raise refused("sandbox: %s is not allowed" % event)
        if event == "open":
            path, mode, flags = args
            if issubclass_(type_(path), int_):  # a descriptor already open
                return
            if type_(path) is str_ and path in devices:
                return
            if type_(flags) is not int_:
                raise refused("sandbox: open with flags that are not an int is not allowed")
            p = resolve(path, None, fns)
            if p is None:
                raise refused("sandbox: open of a path that is neither str nor bytes is not allowed")
            if flags & writing and not (p == root or p.startswith(prefix)):
                raise refused("sandbox: writing outside the working directory (open) is not allowed")
            st = stat(p) if exists(p, 0) else None
            if p == "/proc" or p.startswith("/proc/") or (st is not None and st.st_dev == proc_dev):
                if not (p == proc or p.startswith(proc_prefix)):
                    raise refused("sandbox: reading another process's /proc (open) is not allowed")
            # os.open of a directory would give a dir_fd, for paths that the checks here never see
            if mode is None and st is not None and st.st_mode & 0o170000 == 0o040000:
                raise refused("sandbox: opening a directory (open) is not allowed")
        elif event in mutating_events:
            for name, paths, dir_fds in mutating:
                if name == event:
                    break
            for i in dir_fds:
                if args[i] is not None and args[i] != -1:
                    raise refused("sandbox: dir_fd (%s) is not allowed" % event)
            for i in paths:
                target = args[i]
                if issubclass_(type_(target), int_):  # a descriptor: the file it is open on
                    target = readlink("/proc/self/fd/%d" % as_int(target))
                    if not target.startswith("/"):  # a pipe, a socket
                        raise refused("sandbox: %s of a descriptor that is no file is not allowed" % event)
                p = resolve(target, None, fns)
                if p is None or not (p == root or p.startswith(prefix)):
                    raise refused("sandbox: changing files outside the working directory (%s) is not allowed" % event)
            if event == "os.symlink":  # its target, relative to the link's directory
                link = resolve(args[1], None, fns)
                p = resolve(args[0], link[: link.rfind("/")] or "/", fns)
                if p is None or not (p == root or p.startswith(prefix)):
                    raise refused("sandbox: a link out of the working directory (os.symlink) is not allowed")
        elif event == "socket.__new__":
            if args[1] != 1:  # AF_UNIX (socketpair) only
                raise refused("sandbox: network access (socket.__new__) is not allowed")
        elif event == "import":
            name = args[0]
            if not issubclass_(type_(name), str_):
                raise refused("sandbox: importing a module whose name is no str is not allowed")
            name = as_str(name)
            last = name[name.rfind(".") + 1 :]
            if last in denied_modules or last.startswith("_test"):
                raise refused("sandbox: importing %s is not allowed" % name)
            # An extension module (``_imp.create_dynamic``, raised with its file just before the dlopen()):
            # native code whose constructor runs at once, which no audit event would see. Only the
            # standard library's own load; never a file the program wrote (its directory, /dev/shm, ...).
            if args[1] is not None:
                p = resolve(args[1], None, fns)
                if p is None or p.startswith(prefix) or p[: p.rfind("/")] not in native_dirs:
                    raise refused("sandbox: loading native code (the extension module %s) is not allowed" % name)
        elif event == "object.__setattr__":  # (only __code__, __defaults__ and the like raise it)
            if type_(args[1]) is not str_ or (args[0] is resolve and args[1] == "__code__"):
                raise refused("sandbox: replacing the sandbox's code (object.__setattr__) is not allowed")
        elif event == "object.__getattr__":
            # tb_frame of the hook's own frames (a refusal's traceback holds them): the way to its frame
            tb = args[0]
            if args[1] == "tb_frame" and (type_(tb) is not traceback_type or not 0 <= tb.tb_lineno < 1000000000):
                raise refused("sandbox: the sandbox's frames (tb_frame) are not reachable")

    return hook


def _far(code, by):
    # ``code`` and the code in it with their line numbers ``by`` further down
    consts = tuple(_far(c, by) if type(c) is type(code) else c for c in code.co_consts)
    return code.replace(co_firstlineno=code.co_firstlineno + by, co_consts=consts)


_hook_for = type(_hook_for)(_far(_hook_for.__code__, _FAR), globals(), "_hook_for")
_resolve = type(_resolve)(_far(_resolve.__code__, _FAR), globals(), "_resolve")


# -- kernel confinement (set up in the child before the program runs; see the module's docstring) ------

# Syscalls the program may not make at all: name, x86_64 number, aarch64 number (None: the arch has none).
# Processes (exec, fork; clone and clone3 below), signals and tracing of other processes, namespaces and
# mounts, kernel interfaces that are attack surface more than service (bpf, io_uring, userfaultfd, keys,
# perf), sockets (socketpair below), System V and POSIX message-queue IPC, and the host's clock and name.
_SECCOMP_DENIED = (
    ("execve", 59, 221), ("execveat", 322, 281), ("fork", 57, None), ("vfork", 58, None),
    ("tkill", 200, 130), ("pidfd_open", 434, 434), ("pidfd_send_signal", 424, 424), ("pidfd_getfd", 438, 438),
    ("ptrace", 101, 117), ("process_vm_readv", 310, 270), ("process_vm_writev", 311, 271), ("kcmp", 312, 272),
    ("process_madvise", 440, 440), ("process_mrelease", 448, 448), ("migrate_pages", 256, 238),
    ("move_pages", 279, 239),
    ("socket", 41, 198), ("connect", 42, 203), ("bind", 49, 200), ("listen", 50, 201),
    ("mount", 165, 40), ("umount2", 166, 39), ("unshare", 272, 97), ("setns", 308, 268), ("chroot", 161, 51),
    ("pivot_root", 155, 41), ("open_tree", 428, 428), ("move_mount", 429, 429), ("fsopen", 430, 430),
    ("fsconfig", 431, 431), ("fsmount", 432, 432), ("fspick", 433, 433), ("mount_setattr", 442, 442),
    ("open_by_handle_at", 304, 265), ("name_to_handle_at", 303, 264),
    ("bpf", 321, 280), ("perf_event_open", 298, 241), ("userfaultfd", 323, 282), ("fanotify_init", 300, 262),
    ("io_uring_setup", 425, 425), ("io_uring_enter", 426, 426), ("io_uring_register", 427, 427),
    ("keyctl", 250, 219), ("add_key", 248, 217), ("request_key", 249, 218),
    ("init_module", 175, 105), ("finit_module", 313, 273), ("delete_module", 176, 106),
    ("kexec_load", 246, 104), ("kexec_file_load", 320, 294), ("reboot", 169, 142), ("swapon", 167, 224),
    ("swapoff", 168, 225), ("acct", 163, 89), ("quotactl", 179, 60), ("quotactl_fd", 443, 443),
    ("syslog", 103, 116), ("lookup_dcookie", 212, 18), ("memfd_secret", 447, 447), ("personality", 135, 92),
    ("iopl", 172, None), ("ioperm", 173, None), ("modify_ldt", 154, None), ("uselib", 134, None),
    ("settimeofday", 164, 170), ("clock_settime", 227, 112), ("clock_adjtime", 305, 266),
    ("sethostname", 170, 161), ("setdomainname", 171, 162), ("vhangup", 153, 58),
    ("shmget", 29, 194), ("shmat", 30, 196), ("shmctl", 31, 195), ("shmdt", 67, 197), ("semget", 64, 190),
    ("semop", 65, 193), ("semctl", 66, 191), ("semtimedop", 220, 192), ("msgget", 68, 186), ("msgsnd", 69, 189),
    ("msgrcv", 70, 188), ("msgctl", 71, 187), ("mq_open", 240, 180), ("mq_unlink", 241, 181),
    ("mq_timedsend", 242, 182), ("mq_timedreceive", 243, 183), ("mq_notify", 244, 184),
    ("mq_getsetattr", 245, 185),
)  # fmt: skip
# Syscalls allowed with some arguments only: name, x86_64 number, aarch64 number.
_SECCOMP_CHECKED = (
    ("clone", 56, 220), ("clone3", 435, 435), ("kill", 62, 129), ("tgkill", 234, 131),
    ("rt_sigqueueinfo", 129, 138), ("rt_tgsigqueueinfo", 297, 240), ("prlimit64", 302, 261),
    ("setpriority", 141, 140), ("ioprio_set", 251, 30), ("sched_setaffinity", 203, 122),
    ("sched_setscheduler", 144, 119), ("sched_setparam", 142, 118), ("sched_setattr", 314, 274),
    ("socketpair", 53, 199), ("ioctl", 16, 29), ("fcntl", 72, 25), ("prctl", 157, 167),
)  # fmt: skip
_SECCOMP_ARCHES = {"x86_64": (0xC000003E, 1), "aarch64": (0xC00000B7, 2)}  # AUDIT_ARCH_*, column


def _seccomp_program(arch, pid):
    # The classic BPF program of the child's seccomp filter, as the bytes of its struct sock_filter array:
    # a syscall of another arch (an x86_64 process can make i386 and x32 calls) kills the process; the
    # syscalls of _SECCOMP_DENIED fail with EPERM, clone3 with ENOSYS (glibc then falls back to clone, which
    # is checked: threads only); signals, rlimits, priorities and affinities go to this process (``pid``)
    # alone; everything else is allowed. Arguments are compared by their low 32 bits, which is all the
    # kernel reads of each (an int, a pid, clone's flags, a request or command number).
    import struct

    audit_arch, column = _SECCOMP_ARCHES[arch]
    nrs = {row[0]: row[column] for row in _SECCOMP_DENIED + _SECCOMP_CHECKED}
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050001, 0x00050026
    ld, jeq, jge, and_, ret = 0x20, 0x15, 0x35, 0x54, 0x06
    clone_thread = 0x00010000
    namespaces = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

    def arg(i):
        return 16 + 8 * i  # seccomp_data.args[i]: its low 32 bits (little-endian, as both arches here)

    def only(*conditions):
        # ALLOW when every condition holds, else EPERM; a condition: (argument, mask or None, values)
        code = []
        for c, (i, mask, values) in enumerate(conditions):
            code.append((ld, arg(i)))
            if mask is not None:
                code.append((and_, mask))
            for j, value in enumerate(values):  # a match goes on to the next condition; none to EPERM
                code.append((jeq, value, "held%d" % c, "deny" if j == len(values) - 1 else 0))
            code.append(("label", "held%d" % c))
        return code + [(ret, allow), ("label", "deny"), (ret, eperm)]

    def never(i, values):
        # EPERM when argument i is one of values, else ALLOW
        code = [(ld, arg(i))] + [(jeq, v, "deny", 0) for v in values]
        return code + [(ret, allow), ("label", "deny"), (ret, eperm)]

    mine = (pid,)
    mine_or_0 = (0, pid)
    checked = {
        # threads only: CLONE_THREAD set, no new namespace
        "clone": only((0, clone_thread | namespaces, (clone_thread,))),
        "clone3": [(ret, enosys)],  # its flags are behind a pointer: glibc's threads fall back to clone
        "kill": only((0, None, mine)),
        "tgkill": only((0, None, mine)),
        "rt_sigqueueinfo": only((0, None, mine)),
        "rt_tgsigqueueinfo": only((0, None, mine)),
        "prlimit64": only((0, None, mine_or_0)),  # (another process of the same uid: its limits)
        "setpriority": only((0, None, (0,)), (1, None, mine_or_0)),  # PRIO_PROCESS, this one
        "ioprio_set": only((0, None, (1,)), (1, None, mine_or_0)),  # IOPRIO_WHO_PROCESS, this one
        "sched_setaffinity": only((0, None, mine_or_0)),
        "sched_setscheduler": only((0, None, mine_or_0)),
        "sched_setparam": only((0, None, mine_or_0)),
        "sched_setattr": only((0, None, mine_or_0)),
        "socketpair": only((0, None, (1,)), (1, 0xF, (1,))),  # AF_UNIX, SOCK_STREAM (asyncio's self-pipe)
        # TIOCSTI, TIOCLINUX (input into a terminal), FIOSETOWN, SIOCSPGRP (SIGIO to another process)
        "ioctl": never(1, (0x5412, 0x541C, 0x8901, 0x8902)),
        "fcntl": never(1, (8, 15)),  # F_SETOWN, F_SETOWN_EX: SIGIO/SIGURG to another process
        "prctl": never(0, (1,)),  # PR_SET_PDEATHSIG: the child would outlive its worker
    }
    code = [(ld, 4), (jeq, audit_arch, 1, 0), (ret, kill), (ld, 0)]
    if arch == "x86_64":  # x32 syscalls (nr | 0x40000000) carry AUDIT_ARCH_X86_64 too
        code += [(jge, 0x40000000, 0, 1), (ret, eperm)]
    chunks = [[(ret, eperm)] for name, *_ in _SECCOMP_DENIED if nrs[name] is not None]
    names = [name for name, *_ in _SECCOMP_DENIED if nrs[name] is not None]
    chunks += [checked[name] for name, *_ in _SECCOMP_CHECKED]
    names += [name for name, *_ in _SECCOMP_CHECKED]
    for name, body in zip(names, chunks):
        # each body ends in a return: a syscall that is not this one skips it, its number still loaded
        body = _assemble(body)
        code.append((jeq, nrs[name], 0, len(body)))
        code.extend(body)
    code.append((ret, allow))
    return b"".join(struct.pack("=HBBI", *_resolved(insn)) for insn in code)


def _resolved(insn):
    # (code, k) or (code, k, jt, jf) as (code, jt, jf, k)
    if len(insn) == 2:
        return insn[0], 0, 0, insn[1]
    return insn[0], insn[2], insn[3], insn[1]


def _assemble(code):
    # Resolves the labels of ``code`` (("label", name) entries; forward jumps only) into jump offsets.
    at, out = {}, []
    for insn in code:
        if insn[0] == "label":
            at[insn[1]] = len(out)
        else:
            out.append(insn)
    done = []
    for pc, insn in enumerate(out):
        if len(insn) == 4:
            jt, jf = (at[j] - pc - 1 if isinstance(j, str) else j for j in insn[2:])
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise ValueError("a jump out of reach")
            insn = (insn[0], insn[1], jt, jf)
        done.append(insn)
    return done


def _landlock_rules(abi, root, readable):
    # (path, access) of the Landlock ruleset; handled accesses: the first; a path that does not exist is
    # skipped. Everything under ``root`` (the case's directory) but executing; reading under ``readable``
    # (the standard library, the system's libraries, /proc, ...); reading and writing /dev/null.
    fs = 0x1FFF  # ABI 1: EXECUTE, WRITE_FILE, READ_FILE, READ_DIR, REMOVE_*, MAKE_* (13 rights)
    if abi >= 2:
        fs |= 1 << 13  # REFER: linking or renaming a file into another directory
    if abi >= 3:
        fs |= 1 << 14  # TRUNCATE
    read = 4 | 8  # READ_FILE, READ_DIR
    rules = [(root, fs & ~1)] + [(p, read) for p in readable]
    rules.append(("/dev/null", 2 | 4 | (fs & 1 << 14)))
    rules += [(p, 4) for p in ("/dev/zero", "/dev/urandom", "/dev/random", "/dev/full")]
    return fs, rules


def _landlock(libc, ctypes, abi, root, readable):
    # Restricts this process (and the threads it starts) to _landlock_rules: writes, removals, renames and
    # new files only under root, reads where Python needs them, no execution anywhere; from ABI 4 no TCP
    # bind or connect, from ABI 6 no signal to a process outside the sandbox and no abstract UNIX socket
    # of another domain. Raises OSError when the kernel refuses a step.
    import os
    import stat
    import struct

    long_ = ctypes.c_long
    fs, rules = _landlock_rules(abi, root, readable)
    net = 3 if abi >= 4 else 0  # BIND_TCP, CONNECT_TCP, with no port allowed
    scoped = 3 if abi >= 6 else 0  # LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, LANDLOCK_SCOPE_SIGNAL
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    attr = ctypes.create_string_buffer(struct.pack("=QQQ", fs, net, scoped), 24)
    ruleset = libc.syscall(long_(444), attr, long_(size), long_(0))  # landlock_create_ruleset
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                if path == root:
                    raise
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= 1 | 2 | 4 | 1 << 14  # the rights a file (not a directory) can hold
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
                if libc.syscall(long_(445), long_(ruleset), long_(1), rule, long_(0)) != 0:  # PATH_BENEATH
                    raise OSError(ctypes.get_errno(), "landlock_add_rule " + path)
            finally:
                os.close(fd)
        if libc.syscall(long_(446), long_(ruleset), long_(0)) != 0:  # landlock_restrict_self
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def _seccomp(libc, ctypes, arch):
    # Installs _seccomp_program for this process (and the threads it starts); needs PR_SET_NO_NEW_PRIVS.
    import os

    program = _seccomp_program(arch, os.getpid())

    class Program(ctypes.Structure):  # struct sock_fprog
        _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_char_p))

    fprog = Program(len(program) // 8, program)
    long_ = ctypes.c_long
    if libc.prctl(long_(22), long_(2), ctypes.byref(fprog), long_(0), long_(0)) != 0:  # SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _readable():
    # What the program may read (Landlock): the interpreter's own files, the system's libraries and time
    # zones, a few files of /etc that the C library reads, /proc (the audit hook keeps a program to its
    # own), and which CPUs are online.
    import os

    paths = [p for p in sys.path if p.startswith("/")] + [sys.base_prefix, sys.base_exec_prefix]
    paths += ["/usr", "/lib", "/lib64", "/lib32", "/libx32", "/proc", "/sys/devices/system/cpu"]
    paths += ["/etc/" + name for name in (
        "ld.so.cache", "localtime", "timezone", "passwd", "group", "nsswitch.conf", "os-release", "mime.types",
    )]  # fmt: skip
    return [p for p in paths if os.path.exists(p)]


def _semaphores_refused():
    # Under Landlock /dev/shm is not writable (allowing it would let a program overwrite or remove every file
    # there that its user owns: other cases' semaphores, a colocated trainer's shared memory): no POSIX
    # semaphore can be made, and with it none of multiprocessing's locks, semaphores, conditions, events,
    # queues or pools, multiprocessing.dummy's thread pool included. sem_open's bare EACCES names nothing; a
    # SemLock that says why, and what works instead.
    import _multiprocessing

    base = _multiprocessing.SemLock

    class SemLock(base):
        def __new__(cls, *args, **kwargs):
            try:
                return base.__new__(cls, *args, **kwargs)
            except PermissionError:
                raise PermissionError(
                    13,
                    "sandbox: multiprocessing's locks, semaphores, queues and pools (multiprocessing.dummy.Pool "
                    "too) need POSIX semaphores in /dev/shm, which the sandbox does not allow; use threading, "
                    "queue.Queue or concurrent.futures.ThreadPoolExecutor",
                ) from None

    SemLock.__module__, SemLock.__qualname__ = base.__module__, base.__qualname__
    _multiprocessing.SemLock = SemLock


def _set_up():
    import builtins
    import marshal
    import os
    import posix
    import resource

    with open(int(sys.argv[1]), "rb") as f:
        payload = marshal.loads(f.read())
    program, tests, cpu_s, memory, file_bytes, max_tasks, parent, token, landlock_abi, seccomp_arch = payload
    sys.argv = ["solution.py"]
    sys.dont_write_bytecode = True

    def limit(which, soft, hard):
        ceiling = resource.getrlimit(which)[1]
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(which, (soft, hard))

    limit(resource.RLIMIT_CORE, 0, 0)
    limit(resource.RLIMIT_FSIZE, file_bytes, file_bytes)
    limit(resource.RLIMIT_AS, memory, memory)
    limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)
    limit(resource.RLIMIT_NOFILE, 256, 256)  # (each open file may be one removed, its bytes still on disk)

    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        libc.unshare(0x40000000)  # CLONE_NEWNET
    elif libc.unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET
        maps = (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid)))
        for name, text in maps:
            try:
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
            except OSError:
                pass
        limit(resource.RLIMIT_NPROC, max_tasks, max_tasks)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())  # every set empty
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL (after the changes of credentials, which reset it)
    if os.getppid() != parent:
        os._exit(70)
    root = os.path.realpath(os.getcwd())
    # Before the program runs, and for good: what the kernel enforces whatever the program does, native
    # code included. A layer the kernel offers (the worker checked) but refuses here fails the case.
    try:
        if landlock_abi:
            _landlock(libc, ctypes, landlock_abi, root, _readable())
        if seccomp_arch:
            _seccomp(libc, ctypes, seccomp_arch)
    except OSError as e:
        os.write(2, ("sandbox: the kernel's confinement could not be set up: %s\n" % e).encode())
        os._exit(71)
    del libc, ctypes
    if landlock_abi:
        _semaphores_refused()
    for name in [n for n in sys.modules if n in ("ctypes", "_ctypes") or n.startswith("ctypes.")]:
        del sys.modules[name]  # an import of ctypes is then refused, not served from the cache

    def fork_exec(*args, **kwargs):
        raise PermissionError("sandbox: starting processes is not allowed (_posixsubprocess.fork_exec)")

    stub = type(sys)("_posixsubprocess")
    stub.fork_exec = fork_exec
    sys.modules["_posixsubprocess"] = stub
    builtins.exit = builtins.quit = sys.exit  # (site, which is not imported, adds them)
    try:
        proc_dev = os.stat("/proc").st_dev
    except OSError:
        proc_dev = -1
    proc = "/proc/%d" % os.getpid()
    # extension modules: the standard library's (under -I -S, sys.path is the standard library only; not its
    # subdirectories, such as the base interpreter's site-packages)
    native_dirs = frozenset(os.path.realpath(p) for p in sys.path if p.startswith("/") and os.path.isdir(p))
    sys.addaudithook(_hook_for(root, proc, proc_dev, posix, sys.getfilesystemencoding(), native_dirs))

    main = type(sys)("__main__")
    main.__builtins__ = builtins
    main.__file__ = "solution.py"
    sys.modules["__main__"] = main
    return program, tests, token, main.__dict__


def _run():
    import os

    program, tests, token, namespace = _set_up()
    exec(compile(program, "solution.py", "exec"), namespace)
    if tests is not None:
        exec(compile(tests, "tests.py", "exec"), namespace)
    if token:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, token)
        os._exit(0)


if __name__ == "__main__":
    _run()
"""


@dataclass(frozen=True)
class Confinement:
    """What the kernel offers the sandbox (see the module's docstring): ``landlock_abi`` (0: no Landlock,
    Linux < 5.13 or the LSM not enabled) and ``seccomp_arch`` (``"x86_64"`` or ``"aarch64"``; ``""``: no
    seccomp filter, or an arch the filter is not written for)."""

    landlock_abi: int
    seccomp_arch: str

    def missing(self) -> list[str]:
        """The kernel layers that this kernel leaves out, in words (empty: none)."""
        out = []
        if not self.landlock_abi:
            out.append("Landlock (writes outside the case's directory and reads of the host's files)")
        if not self.seccomp_arch:
            out.append("seccomp (exec, fork, signals to other processes, sockets, namespaces, io_uring, bpf)")
        return out


_SECCOMP_NR = {"x86_64": 317, "aarch64": 277}  # seccomp(2)
_LANDLOCK_CREATE_RULESET = 444  # the same number on both


@functools.cache
def kernel_confinement() -> Confinement:
    """Asks the kernel, once per process, which of the sandbox's kernel layers it has: Landlock's ABI
    (``landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)``) and seccomp filters with
    SECCOMP_RET_ERRNO (``seccomp(SECCOMP_GET_ACTION_AVAIL)``), on x86_64 and aarch64 (64-bit processes)."""
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in _SECCOMP_NR or struct.calcsize("P") != 8:
        return Confinement(0, "")
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    long_ = ctypes.c_long
    abi = libc.syscall(long_(_LANDLOCK_CREATE_RULESET), None, long_(0), long_(1))  # 1: ..._VERSION
    action = ctypes.c_uint32(0x00050000)  # SECCOMP_RET_ERRNO
    filters = libc.syscall(long_(_SECCOMP_NR[machine]), long_(2), long_(0), ctypes.byref(action)) == 0
    return Confinement(max(0, int(abi)), machine if filters else "")


def log_confinement(logger: logging.Logger) -> Confinement:
    """Says once, at the service's start, which kernel layers the sandbox has here: a warning naming those
    this kernel lacks (the other layers still apply), else one info line."""
    confinement = kernel_confinement()
    missing = confinement.missing()
    if missing:
        logger.warning(
            "code sandbox: this kernel lacks %s; the other layers still apply (docs/rewards.md, code)",
            " and ".join(missing),
            extra={"landlock_abi": confinement.landlock_abi, "seccomp_arch": confinement.seccomp_arch},
        )
    else:
        logger.info(
            "code sandbox: kernel confinement",
            extra={"landlock_abi": confinement.landlock_abi, "seccomp_arch": confinement.seccomp_arch},
        )
    return confinement


def run_case(
    program: str,
    case: Case,
    *,
    cpu_time_s: int = 5,
    memory_mb: int = 512,
    wall_time_s: float = 10.0,
    max_output_bytes: int = 1 << 20,
    executable: str | None = None,
) -> CaseResult:
    """Runs ``program`` (then ``case.tests``) once in the sandbox, in a new temporary directory deleted
    afterwards (or, where the process is killed first, by a later case: see ``_case_parent``);
    ``case_passed`` tells whether the result passes."""
    token = secrets.token_hex(16).encode() if case.tests is not None else b""
    confinement = kernel_confinement()
    payload = (
        program,
        case.tests,
        max(1, math.ceil(cpu_time_s)),
        memory_mb << 20,
        MAX_FILE_BYTES,
        MAX_TASKS,
        os.getpid(),
        token,
        confinement.landlock_abi,
        confinement.seccomp_arch,
    )
    workdir = tempfile.mkdtemp(dir=_case_parent())
    start = time.monotonic()
    try:
        # stdin's file lies in the case's directory: ``open("/dev/stdin")`` (or ``/dev/fd/0``) opens it anew
        # through /proc/self/fd/0, and Landlock lets the child read it only beneath a rule of its own
        with tempfile.TemporaryFile() as payload_file, tempfile.TemporaryFile(dir=workdir) as stdin_file:
            payload_file.write(marshal.dumps(payload))
            payload_file.seek(0)
            if case.stdin is not None:
                stdin_file.write(case.stdin.encode())
                stdin_file.seek(0)
            proc = subprocess.Popen(
                [executable or sys.executable, "-I", "-S", "-B", "-c", _RUNNER, str(payload_file.fileno())],
                stdin=stdin_file if case.stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env={**_ENV, "HOME": workdir, "TMPDIR": workdir},
                start_new_session=True,
                pass_fds=(payload_file.fileno(),),
            )
        try:
            stdout, stderr, killed, exceeded, over = _communicate(proc, start + wall_time_s, max_output_bytes, workdir)
        finally:
            _kill_group(proc)
            proc.wait()
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()
            proc.stderr.close()
    finally:
        _remove(workdir)
    code = proc.returncode
    cpu_limit = not exceeded and not over and code in (-signal.SIGXCPU, -signal.SIGKILL)
    finished = True
    if token:  # written by the runner once the tests ran to their end
        finished = stdout.endswith(token)
        stdout = stdout[: -len(token)] if finished else stdout
    return CaseResult(code, stdout, stderr, killed or cpu_limit, exceeded, finished, time.monotonic() - start, over)


def _communicate(
    proc: subprocess.Popen[bytes], deadline: float, cap: int, workdir: str | None = None
) -> tuple[bytes, bytes, bool, bool, str]:
    """Reads the child's stdout and stderr until both close, ``cap`` bytes each; (stdout, stderr, timed out,
    output exceeded, over a limit: ``CaseResult.over_limit``). Past the deadline or the cap the process group
    is killed at once; past MAX_TASKS threads or what ``workdir`` may hold, within WATCH_S."""
    assert proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}

    def output() -> tuple[bytes, bytes]:
        return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()])  # type: ignore[union-attr]

    watched_at = time.monotonic()
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                _kill_group(proc)
                return *output(), True, False, ""
            if now - watched_at >= WATCH_S:
                watched_at = now
                over = _over_limit(proc.pid, workdir)
                if over:
                    _kill_group(proc)
                    return *output(), False, False, over
            for key, _ in selector.select(min(left, WATCH_S)):
                data = os.read(key.fd, _READ_CHUNK)
                if not data:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                buffer += data
                if len(buffer) > cap:
                    _kill_group(proc)
                    del buffer[cap:]
                    return *output(), False, True, ""
    out, err = output()
    while True:  # both streams closed: the program has ended, or closed them and runs on, watched as before
        left = deadline - time.monotonic()
        if left <= 0:
            _kill_group(proc)
            return out, err, True, False, ""
        try:
            proc.wait(min(left, WATCH_S))
            return out, err, False, False, ""
        except subprocess.TimeoutExpired:
            over = _over_limit(proc.pid, workdir)
            if over:
                _kill_group(proc)
                return out, err, False, False, over


def _over_limit(pid: int, workdir: str | None) -> str:
    """ "tasks" when the case's process runs more than MAX_TASKS threads (its only process: fork is refused),
    "disk" when ``workdir`` and the files the process holds open (one removed but open takes its disk still)
    hold more than MAX_CASE_BYTES, or ``workdir`` more than MAX_CASE_ENTRIES, or a folder in it cannot be read
    (a case may take the watch's read permission away: that is no licence); else ""."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Threads:"):
                    if int(line.split()[1]) > MAX_TASKS:
                        return "tasks"
                    break
    except (OSError, ValueError):  # ended, or no /proc
        pass
    if workdir is None:
        return ""
    seen: set[tuple[int, int]] = set()
    used = entries = 0
    unreadable: list[OSError] = []

    def count(st: os.stat_result) -> None:
        nonlocal used
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            used += st.st_blocks * 512  # (the disk taken: a sparse file takes none of its length)

    def walk_error(error: OSError) -> None:
        if not isinstance(error, FileNotFoundError):  # (removed meanwhile: nothing there)
            unreadable.append(error)

    # by directory descriptor: each folder opened from its parent's, not its whole path resolved again
    for _, folders, files, folder_fd in os.fwalk(workdir, onerror=walk_error, follow_symlinks=False):
        entries += len(folders) + len(files)
        if entries > MAX_CASE_ENTRIES or unreadable:
            return "disk"
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                count(os.stat(name, dir_fd=folder_fd, follow_symlinks=False))
        if used > MAX_CASE_BYTES:
            return "disk"
    if unreadable:
        return "disk"
    try:  # what it holds open, removed from the folder or not (its descriptors: RLIMIT_NOFILE)
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                count(os.stat(f"/proc/{pid}/fd/{fd}"))
    except OSError:  # ended, no /proc, or not ours to read
        pass
    return "disk" if used > MAX_CASE_BYTES else ""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove(path: str) -> None:
    """Removes a case's directory (a real directory, never a symbolic link), even where the program took
    away its own permissions in it. Links in it are removed, never followed (chmod would follow them)."""
    try:
        shutil.rmtree(path)
        return
    except OSError:
        pass
    with contextlib.suppress(OSError):
        os.chmod(path, stat.S_IRWXU)
    for parent, dirs, _ in os.walk(path):  # top-down: each directory made readable before it is entered
        for name in dirs:
            sub = os.path.join(parent, name)
            if not os.path.islink(sub):
                with contextlib.suppress(OSError):
                    os.chmod(sub, stat.S_IRWXU)
    shutil.rmtree(path, ignore_errors=True)


# -- the cases' directories ----------------------------------------------------------------------

# <TMPDIR>/tauflow-code-<pid>-<mkdtemp's suffix>: the directory of one process's cases
_OWNED = re.compile(r"tauflow-code-([0-9]+)-[A-Za-z0-9_]+")
_own_lock = threading.Lock()
_own: tuple[int, str, int] | None = None  # this process's (pid, directory, descriptor locking it)


def _case_parent() -> str:
    """This process's directory for its cases' directories, ``<TMPDIR>/tauflow-code-<pid>-XXXXXXXX``, made
    at its first case and locked (``flock``) for as long as the process lives; first removes the directories
    of processes that died without removing theirs.

    A case's ``finally`` removes its directory, but the service kills a worker past a sample's timeout
    (SIGTERM, whose default action skips every ``finally``), and a request can make that happen at will (a
    short ``sample_timeout``). So every case sweeps: a directory whose lock is free and whose pid no longer
    runs belongs to a dead process, whichever worker made it. A live process's lock is held (the kernel
    releases it at its death), so a directory in use is never swept, even by a service in another pid
    namespace that shares TMPDIR; the pid covers the moment between a directory's creation and its lock.
    """
    global _own
    with _own_lock:
        pid = os.getpid()
        if _own is None or _own[0] != pid or not os.path.isdir(_own[1]):
            if _own is not None:  # a fork's copy of its parent's descriptor, or a directory removed
                with contextlib.suppress(OSError):
                    os.close(_own[2])
            path = tempfile.mkdtemp(prefix=f"tauflow-code-{pid}-")
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_EX)
            _own = (pid, path, fd)
        own = _own[1]
    _sweep(os.path.dirname(own), own)
    return own


def _sweep(tmp: str, own: str) -> None:
    """Removes the case directories under ``tmp`` whose process is dead (see ``_case_parent``)."""
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        match = _OWNED.fullmatch(name)
        path = os.path.join(tmp, name)
        if match is not None and path != own and _abandoned(path, int(match[1])):
            _remove(path)


def _abandoned(path: str, pid: int) -> bool:
    """Whether ``path`` (a case directory of process ``pid``) is this user's real directory, unlocked, and
    ``pid`` runs no more. Anything else (a symbolic link, another user's, an error) is left alone."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or pid <= 0:
            return False
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # locked: its process lives
        return False
    finally:
        os.close(fd)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (PermissionError: it runs, as another user)
        return False
    return False  # its lock is free yet the pid runs: not locked yet, or the pid is reused (swept later)


def sweep_abandoned() -> None:
    """Removes the case directories of dead processes now (the service's last act: its workers end by SIGTERM,
    which skips their ``atexit``, and the last run's directories waited for a later service's first case)."""
    own = _own[1] if _own is not None and _own[0] == os.getpid() else ""
    _sweep(tempfile.gettempdir(), own)


@atexit.register
def _remove_own() -> None:
    if _own is not None and _own[0] == os.getpid():
        _remove(_own[1])
