#!/usr/bin/env python
"""What a group costs on its way from the rollout to the queue: the rollout's own client (score, then put)
against a real queue and reward service, with the puts of a ticket coalesced into one PutBatch (queue.v1
revision 5, the default) and, as the baseline in the same run, put one by one on the shared PutStream.

Each round, per path: tickets of 16 of the addition recipe's groups (8 samples of 4 tokens), two tickets
at a time as the producer works them, each scored by the reward service (exact match) and then put, as
``Producer._produce`` does (a ``queue.put`` span per group). Measured: the client's CPU per group (the
rollout's event loop, where it competes with generation for the GIL), the queue's and the reward
service's CPU per group (from /proc), and the wall time per ticket. The paths alternate, round by round.

    python bench/put_path.py                 # 5 rounds of 40 tickets per path
    python bench/put_path.py --rounds 3 --tickets 20

Prints a table of medians and the ratios batch / stream, then ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from tauflow.core.config import ChannelConfig
from tauflow.core.testing import ServiceProcess
from tauflow.rollout.adapters.queue_client import GrpcQueue
from tauflow.rollout.adapters.reward_client import GrpcReward
from tauflow.rollout.dataset import Prompt
from tauflow.rollout.engine.base import Completion, FinishReason
from tauflow.rollout.ports import ProducedGroup
from tauflow.rollout.producer import _group_attributes, tracer

GROUPS_PER_TICKET = 16
TICKETS_AT_ONCE = 2


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Tickets:
    """The recipe's groups, each with a new id (the queue takes each id once)."""

    def __init__(self) -> None:
        self.serial = itertools.count()

    def groups(self) -> list[ProducedGroup]:
        out = []
        for _ in range(GROUPS_PER_TICKET):
            i = next(self.serial)
            completions = [Completion([1, 2, 3, 4], [-0.1] * 4, [0] * 4, FinishReason.STOP) for _ in range(8)]
            prompt = Prompt(f"p{i}", list(range(12)), metadata={"answer": "12"})
            out.append(
                ProducedGroup(f"r0-{i}", prompt, completions, ["12"] * 8, producer_id="r0", created_at=time.time())
            )
        return out


async def measure(
    path: str, queue_proc: ServiceProcess, reward_proc: ServiceProcess, n_tickets: int, tickets: Tickets
) -> dict[str, float]:
    queue = GrpcQueue(queue_proc.address, "r0", ChannelConfig())
    queue.batching = path == "batch"  # (the stream path is what the client falls back to without PutBatch)
    reward = GrpcReward(reward_proc.address, "exact_match", ChannelConfig())
    root = tracer.start_span("bench")

    async def ticket() -> None:
        granted = await queue.reserve(os.urandom(8).hex(), GROUPS_PER_TICKET, 5.0)
        assert granted is not None
        groups = tickets.groups()
        await reward.score(groups)

        async def put(group: ProducedGroup) -> None:
            span = tracer.start_span(
                "queue.put", context=trace.set_span_in_context(root), attributes=_group_attributes(group)
            )
            await queue.put(group, granted.ticket_id)
            span.end()

        await asyncio.gather(*(put(g) for g in groups))

    for _ in range(2):  # warm-up: connections, the stream
        await ticket()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    queue0, reward0 = process_cpu_s(queue_proc.proc.pid), process_cpu_s(reward_proc.proc.pid)
    for _ in range(n_tickets // TICKETS_AT_ONCE):
        await asyncio.gather(*(ticket() for _ in range(TICKETS_AT_ONCE)))
    n_groups = n_tickets // TICKETS_AT_ONCE * TICKETS_AT_ONCE * GROUPS_PER_TICKET
    result = {
        "client_ms_per_group": 1e3 * (time.process_time() - cpu0) / n_groups,
        "queue_ms_per_group": 1e3 * (process_cpu_s(queue_proc.proc.pid) - queue0) / n_groups,
        "reward_ms_per_group": 1e3 * (process_cpu_s(reward_proc.proc.pid) - reward0) / n_groups,
        "wall_ms_per_ticket": 1e3 * (time.perf_counter() - wall0) / (n_groups / GROUPS_PER_TICKET),
    }
    await queue.close()
    await reward.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tickets", type=int, default=40, help="tickets per path and round")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trace.set_tracer_provider(TracerProvider())
    work = Path(tempfile.mkdtemp(prefix="tauflow-bench-put-path-"))
    queue = ServiceProcess("queue", work, {"wal.dir": str(work / "wal"), "max_staleness": -1}).start()
    reward = ServiceProcess("reward", work, {"default_reward_fn": "exact_match"}).start()
    tickets = Tickets()
    runs: dict[str, list[dict[str, float]]] = {"stream": [], "batch": []}
    try:
        for r in range(args.rounds):
            for path in ("stream", "batch") if r % 2 == 0 else ("batch", "stream"):
                runs[path].append(asyncio.run(measure(path, queue, reward, args.tickets, tickets)))
    finally:
        queue.stop()
        reward.stop()
    keys = ("client_ms_per_group", "queue_ms_per_group", "reward_ms_per_group", "wall_ms_per_ticket")
    medians = {path: {k: statistics.median(run[k] for run in rs) for k in keys} for path, rs in runs.items()}
    print(f"\n{args.rounds} rounds of {args.tickets} tickets of {GROUPS_PER_TICKET} groups per path; medians")
    print(f"{'path':<8} {'client ms/group':>16} {'queue ms/group':>15} {'reward ms/group':>16} {'ms/ticket':>10}")
    for path in ("stream", "batch"):
        m = medians[path]
        print(f"{path:<8} {m[keys[0]]:16.3f} {m[keys[1]]:15.3f} {m[keys[2]]:16.3f} {m[keys[3]]:10.1f}")
    ratios = {k: medians["batch"][k] / medians["stream"][k] for k in keys}
    print("batch / stream: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print("BENCH_JSON " + json.dumps({"benchmark": "put_path", "rounds": args.rounds, "tickets": args.tickets,
                                       "medians": medians, "ratios": ratios, "runs": runs}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
