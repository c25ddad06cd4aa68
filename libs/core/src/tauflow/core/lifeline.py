"""A service's lifeline to the process that launched it: once that process is gone, the service stops.

A launcher that starts a service as its child says so in the environment, ``TAUFLOW_PARENT_PID=<its
pid>`` (the controller for the local launcher, the Ray actor that hosts the service for the ray
launcher). Every server (``tauflow.core.server.serve``) then runs :func:`watch_parent`: a thread checks
once a second whether that process is still there and, when it is not, logs one line (``controller
<pid> gone: stopping``) and stops the server exactly as SIGTERM does (drain, then the app's close: the
queue closes its log, in-flight calls finish). Should the drain hang, the process exits on its own
``grace_s + HARD_EXIT_MARGIN_S`` later, which is what the launcher would have done with SIGKILL.
A service started by hand or by Kubernetes has no ``TAUFLOW_PARENT_PID`` and never stops this way.

"Still there" for a parent is ``os.getppid() == pid``: a dead parent's children are re-parented, and
``getppid()`` never returns the old pid again, even if the kernel gives it to a new process. A watched
process that is not our parent (the reward service's pool workers watch the service: they are children
of the pool's fork server) is alive while ``/proc/<pid>`` is not a zombie and has the start time it had
when the watch began (a reused pid has another).

Why not ``PR_SET_PDEATHSIG``: it fires when the parent *thread* that forked exits, not the parent process
(the controller starts and restarts services from worker threads, ``asyncio.to_thread``); it needs a
``preexec_fn`` between fork and exec, unsafe in a threaded parent; it misses a parent that died before the
child called ``prctl``; it is Linux only; and it only signals, so nothing ends a drain that hangs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

PARENT_PID_ENV = "TAUFLOW_PARENT_PID"
CHECK_EVERY_S = 1.0
HARD_EXIT_MARGIN_S = 20.0  # after the drain grace: time for the app's close (the queue's log, a checkpoint)


def parent_pid_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The pid in ``TAUFLOW_PARENT_PID``; None when it is unset or empty. Raises ValueError naming the
    variable for anything but a positive integer."""
    value = (os.environ if environ is None else environ).get(PARENT_PID_ENV, "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 10 or int(value) == 0:
        raise ValueError(f"{PARENT_PID_ENV} must be the pid of the process that started this one, got {value[:40]!r}")
    return int(value)


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); None when there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), None when it is not running (or a zombie). Without
    ``/proc`` (not Linux): "" while the kernel knows the pid."""
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # someone else's process: it exists
        return ""
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return fields[19]  # field 22 of stat: starttime


class Lifeline:
    """Whether the process ``pid`` is still there: our parent (``getppid``), or any process (its start time)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.is_parent = os.getppid() == pid
        self._started = None if self.is_parent else _start_time(pid)

    def alive(self) -> bool:
        if self.is_parent:
            return os.getppid() == self.pid
        return self._started is not None and _start_time(self.pid) == self._started

    def watch(
        self,
        on_gone: Callable[[], None],
        *,
        every_s: float = CHECK_EVERY_S,
        exit_after_s: float | None = None,
        what: str = "controller",
    ) -> threading.Event:
        """Calls ``on_gone`` (from a daemon thread) once the process is gone, after one log line; then, with
        ``exit_after_s``, ends this process that long after unless it has ended by itself. Set the returned
        event to give the watch up (only before the process is gone: a fired watch stays armed)."""
        cancelled = threading.Event()

        def run() -> None:
            while self.alive():
                if cancelled.wait(every_s):
                    return
            log.warning("%s %d gone: stopping", what, self.pid, extra={"parent_pid": self.pid})
            on_gone()
            if exit_after_s is not None:
                time.sleep(exit_after_s)
                log.error("%s %d gone %.0fs ago and this process still runs: exiting", what, self.pid, exit_after_s)
                logging.shutdown()
                os._exit(1)

        threading.Thread(target=run, name=f"lifeline-{self.pid}", daemon=True).start()
        return cancelled


async def watch_parent(stop: asyncio.Event, grace_s: float, environ: Mapping[str, str] | None = None) -> None:
    """A server's background job: sets ``stop`` (the SIGTERM path) when the process named by
    ``TAUFLOW_PARENT_PID`` is gone, and exits the process hard ``grace_s + HARD_EXIT_MARGIN_S`` later if the
    drain has not ended it. Returns at once when no parent is named; raises ValueError for a bad value."""
    pid = parent_pid_from_env(environ)
    if pid is None:
        return
    loop = asyncio.get_running_loop()

    def on_gone() -> None:
        try:
            loop.call_soon_threadsafe(stop.set)
        except RuntimeError:  # the loop has ended: the server stopped already (the hard exit stays armed)
            pass

    cancelled = Lifeline(pid).watch(on_gone, exit_after_s=grace_s + HARD_EXIT_MARGIN_S)
    try:
        await asyncio.Event().wait()  # cancelled with the other background jobs when the server drains
    finally:
        cancelled.set()  # ends a watch that has not fired; one that has stays armed
