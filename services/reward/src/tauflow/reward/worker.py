"""Calls one reward function on one sample (or one group) and turns what it did into an outcome.

This module runs both in the service process (for inline functions) and in the worker processes of
the killable pool, where functions are found again by their reference ``"module:qualname"`` (classes
are instantiated once per process). It never raises for anything a reward function does: a raise, a
result of the wrong type or a non-finite score all become an ``error`` outcome with a message, so that
only a timeout or a dead worker is left for the pool to report.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from tauflow.core.limits import MAX_ABS_REWARD
from tauflow.reward.api import GroupInput, SampleInput, Score

# (ok, score, components, message, detail, duration_s); a plain tuple pickles fast.
Outcome = tuple[bool, float, dict[str, float], str, str, float]

_MESSAGE_CHARS = 500
_DETAIL_CHARS = 4000
MAX_COMPONENTS = 64  # what a function may return: the bounds of a request's reward.components (limits.*)
MAX_COMPONENT_NAME_CHARS = 256
_resolved: dict[str, Any] = {}


def load_object(ref: str) -> Any:
    """``"pkg.module:Attr.sub"`` → the object (what an entry point's value names)."""
    module_name, sep, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    if sep:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    return obj


def resolve(ref: str) -> Any:
    """The callable behind ``ref``, cached per process; a class is instantiated once."""
    fn = _resolved.get(ref)
    if fn is None:
        obj = load_object(ref)
        fn = obj() if isinstance(obj, type) else obj
        _resolved[ref] = fn
    return fn


def register_local(ref: str, fn: Any) -> None:
    """Makes ``ref`` resolve to ``fn`` in this process (for functions registered as objects)."""
    _resolved[ref] = fn


def not_dumpable() -> None:
    """``prctl(PR_SET_DUMPABLE, 0)``: no process of the same uid may read this one's memory or
    ``/proc/<pid>/environ`` (where a reward function's bearer token lives). The ``code`` sandbox's programs
    run as the same uid where no user namespace is allowed (a container's default seccomp profile). Linux
    only; elsewhere a no-op."""
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


def init_worker(
    sys_path: Sequence[str], refs: Sequence[str], service_pid: int | None = None, memory_mb: int = 0
) -> None:
    """Pool initializer: mirror the service's import path, load the functions ahead of the first call,
    and end this worker when the service process is gone (``service_pid``); ``memory_mb`` bounds its
    address space (RLIMIT_AS, the soft limit: the ``code`` sandbox sets its own below the hard one)."""
    not_dumpable()
    if memory_mb > 0:
        limit_address_space(memory_mb << 20)
    # SIGTERM (how the pool stops a task past its timeout) ends the worker at once. Pebble's own handler is
    # Python, which runs only between bytecodes: a task inside C code (an RE2 match, a C extension) lived on
    # until the SIGKILL 3 s later, and the pool's manager thread, waiting for it, held back every result.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if service_pid is not None:
        threading.Thread(target=_exit_when_gone, args=(service_pid,), name="service-watch", daemon=True).start()
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    for ref in refs:
        try:
            resolve(ref)
        except Exception:  # noqa: BLE001, S110 - reported per sample when the function is called
            pass


def limit_address_space(soft: int) -> None:
    """RLIMIT_AS's soft limit at ``soft`` bytes (at most the hard limit): one sample's work (``2^(2^31)``
    evaluated exactly took a worker to 1.6 GB, and the worker kept 1.35 GB of it) fails with MemoryError."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _service_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _exit_when_gone(service_pid: int, every_s: float = 1.0) -> None:
    """A worker's watch on its service. Workers are children of the pool's fork server, not of the service,
    so a service killed with SIGKILL (OOM, kill -9) would leave them running: one stuck in a reward function
    that never returns would spin for ever. Python code yields the GIL, so this thread gets to run."""
    while _service_alive(service_pid):
        time.sleep(every_s)
    os._exit(1)


def ping() -> int:
    return os.getpid()


def _describe(e: BaseException) -> tuple[str, str]:
    text = f"{type(e).__name__}: {e}"
    detail = "".join(traceback.format_exception(e))
    return text[:_MESSAGE_CHARS], detail[-_DETAIL_CHARS:]


def to_score(result: Any) -> tuple[float, dict[str, float]]:
    """A function's result → (score, components); ``TypeError``/``ValueError`` for anything else."""
    components: Any = {}
    if isinstance(result, Score):
        score, components = result.score, result.components
    elif isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"returned a mapping without a 'score' key: {sorted(result)[:8]}")
        score, components = result["score"], result.get("components") or {}
    else:
        score = result
    if not isinstance(score, numbers.Real):
        raise TypeError(f"returned {type(score).__name__} {score!r:.80}; expected a real number, a Score or a mapping")
    score = float(score)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    if abs(score) > MAX_ABS_REWARD:  # (the queue refuses a group beyond it: tauflow.core.limits)
        raise ValueError(f"returned a score {score} beyond ±{MAX_ABS_REWARD:g}")
    if not isinstance(components, Mapping):
        raise TypeError(f"returned components of type {type(components).__name__}; expected a mapping")
    if len(components) > MAX_COMPONENTS:
        raise ValueError(f"returned {len(components)} components; at most {MAX_COMPONENTS} are kept")
    parts: dict[str, float] = {}
    for name, value in components.items():
        if not isinstance(name, str) or not isinstance(value, numbers.Real):
            raise TypeError(f"returned component {name!r:.80}: {value!r:.80}; expected str → real number")
        if not 0 < len(name) <= MAX_COMPONENT_NAME_CHARS:
            raise ValueError(
                f"returned a component name of {len(name)} characters; expected 1 to {MAX_COMPONENT_NAME_CHARS}"
            )
        part = float(value)
        if not math.isfinite(part):
            raise ValueError(f"returned a non-finite component {name!r:.80}: {part}")
        parts[name] = part
    return score, parts


def call_sample(ref: str, sample: SampleInput, config: dict[str, Any]) -> Outcome:
    start = time.perf_counter()
    try:
        score, parts = to_score(resolve(ref)(sample, config))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a reward function may raise anything (even exit)
        message, detail = _describe(e)
        return False, 0.0, {}, message, detail, time.perf_counter() - start
    return True, score, parts, "", "", time.perf_counter() - start


class Stopped(Exception):
    """An inline call is over (its caller's deadline or its budget passed, or it was cancelled): the samples
    left are not scored."""


def call_group(ref: str, group: GroupInput, config: dict[str, Any]) -> list[Outcome]:
    """A group-level function: one call, one outcome per sample (its time split evenly)."""
    n = len(group.samples)
    start = time.perf_counter()
    try:
        results = resolve(ref)(group, config)
        if isinstance(results, (str, bytes, Mapping)) or not isinstance(results, Sequence):
            raise TypeError(f"a group-level function must return a sequence, not {type(results).__name__}")
        if len(results) != n:
            raise ValueError(f"returned {len(results)} results for a group of {n} samples")
        scores = [to_score(r) for r in results]
    except (Exception, SystemExit) as e:  # noqa: BLE001
        message, detail = _describe(e)
        each = (time.perf_counter() - start) / n
        return [(False, 0.0, {}, message, detail, each)] * n
    each = (time.perf_counter() - start) / n
    return [(True, score, parts, "", "", each) for score, parts in scores]
