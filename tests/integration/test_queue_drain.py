"""A queue that drains (SIGTERM: a rolling upgrade, the end of a run) while outside producers call its
external port: every call is answered, or refused with a status the client may retry.

grpcio's asyncio server answers CANCELLED to a call that arrives while it shuts down, before any handler
runs; the chaos run's producer met it at the end of a run and gave up (CANCELLED was not retryable). In a
probe, one drain in three showed it to one of four producers."""

from __future__ import annotations

import secrets
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from tauflow.client import QueueClient, TauflowError

TOKEN = "drain-" + "t" * 26
DRAINS = 4
PRODUCERS = 4


def test_calls_that_meet_a_draining_queue_are_answered_or_retryable(service_process, tmp_path: Path) -> None:
    (tmp_path / "tokens.yaml").write_text(f"agent: {TOKEN}\n")
    seen: Counter[str] = Counter()
    not_retryable: list[str] = []
    for drain in range(DRAINS):
        queue = service_process(
            "queue",
            {
                "max_staleness": 1,  # room for a few tickets: the rest of the Reserves wait (long polls)
                "wal.dir": f"wal-{drain}",
                "external.enabled": "true",
                "external.port": 0,
                "external.tokens_file": str(tmp_path / "tokens.yaml"),
            },
            {"OMP_NUM_THREADS": "1"},
        )
        address = f"127.0.0.1:{queue.info['external_port']}"
        stopping = threading.Event()

        def produce(address: str = address, stopping: threading.Event = stopping) -> None:
            with QueueClient(address, TOKEN, timeout_s=5) as client:
                while not stopping.is_set():
                    try:
                        client.reserve(1, wait_s=1.0, request_id=secrets.token_hex(8))
                        seen["answered"] += 1
                    except TauflowError as e:
                        seen[e.code.name] += 1
                        if not e.retryable:
                            not_retryable.append(str(e))
                        time.sleep(0.02)

        producers = [threading.Thread(target=produce) for _ in range(PRODUCERS)]
        for p in producers:
            p.start()
        time.sleep(1.5)  # each producer waits in a long poll or has just been answered
        queue.proc.send_signal(signal.SIGTERM)
        assert queue.proc.wait(30) == 0, queue.log_text()[-2000:]
        time.sleep(0.3)  # calls that come after the drain meet a closed port
        stopping.set()
        for p in producers:
            p.join(30)
    assert not not_retryable, (not_retryable, seen)
    assert seen["answered"] >= DRAINS * PRODUCERS, seen  # the producers were calling when each drain came
