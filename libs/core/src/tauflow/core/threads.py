"""Thread pools whose threads are all started when made (no grpc here: domain modules use it)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


def started_executor(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose ``workers`` threads are all started now (a pool starts them on demand: mid-run, a
    start that fails for want of memory leaves the work given to it never run)."""
    executor = ThreadPoolExecutor(workers, thread_name_prefix=name)
    started = threading.Barrier(workers + 1)
    for _ in range(workers):  # (each waits for the others: every submit finds no idle thread and starts one)
        executor.submit(started.wait, 60)
    started.wait(60)
    return executor
