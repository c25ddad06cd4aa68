"""The chaos run (#11), shared by tests/e2e/test_chaos.py (short, for CI) and bench/chaos.py (longer, several seeds).

A `tauflow run` of the tiny model of the embedded task (tests/runs.py) with the queue's external port on.
On a seeded schedule, each time the trainer has reached a version, one role is SIGKILLed (and the next fault
waits until the controller has restarted it) or SIGSTOPped for longer than the deadlines its callers use,
then SIGCONTed. Meanwhile an outside producer (``Producer``: tauflow-client, a thread) keeps putting
groups through the external port, retrying while the queue is down, and records every group the queue
acknowledged. After the run, ``account`` checks that accounting is exact from the queue's write-ahead log
and the trainer's last checkpoint: every group the queue accepted is trained once, still in the queue, or
evicted by the queue (stale), and nothing else.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tauflow.client import QueueClient, TauflowError, Trajectory, make_group
from tests.runs import ADDITION, ROOT, run_command

KILLED = ("queue", "reward", "rollout", "weights", "trainer")
CLIENT = "chaos-agent"  # the outside producer's client name: the queue namespaces its ids as chaos-agent/<id>
# Deadlines shortened so that a stop outlasts them within a short run: the rollout's calls (its reward
# Score among them) and the weight sidecar's broadcast phases, whose member is the rollout.
CALL_DEADLINE_S = 3.0
BROADCAST_DEADLINE_S = 4.0
STOP_S = {"reward": 3 * CALL_DEADLINE_S, "rollout": 3 * BROADCAST_DEADLINE_S}


@dataclass
class Fault:
    kind: str  # "kill" (SIGKILL, then the controller restarts it) or "stop" (SIGSTOP, STOP_S, SIGCONT)
    role: str
    after_version: int  # injected once the trainer's version (the queue's) reaches this
    at_version: int = -1  # the version it was injected at
    pid: int = 0
    back_after_s: float = 0.0  # kill: until the restarted process was ready; stop: how long it was stopped
    evidence: dict[str, float] = field(default_factory=dict)  # stop: the metrics that show it


def schedule(seed: int, steps: int, kills_per_role: int = 1, stops: tuple[str, ...] = ("rollout",)) -> list[Fault]:
    """Every role SIGKILLed ``kills_per_role`` times, each round in a seeded order, and each role of ``stops``
    SIGSTOPped once at a seeded place among them; spread over the first 60 % of the run (a step can take
    a tenth of a second once a role is back: the rest leaves room for the last fault to come in time)."""
    rng = random.Random(seed)
    faults = [Fault("kill", role, 0) for _ in range(kills_per_role) for role in rng.sample(KILLED, len(KILLED))]
    for role in stops:
        faults.insert(rng.randrange(len(faults) + 1), Fault("stop", role, 0))
    last = max(len(faults) + 2, int(steps * 0.6))
    gap = (last - 2) / len(faults)
    for i, fault in enumerate(faults):
        fault.after_version = 2 + int(i * gap + rng.random() * gap * 0.5)
    return faults


def settings(out: Path, model: Path, dataset: Path, tokens: Path, steps: int, groups_per_step: int = 4) -> list[str]:
    """The run's --set settings: few steps of the tiny model, short leases, checkpoints and deadlines."""
    return [
        "prepare=[]",
        f"out_dir={out}",
        f"model={model}",
        f"dataset={dataset}",
        "eval.dataset=",
        "target_accuracy=null",
        f"steps={steps}",
        f"groups_per_step={groups_per_step}",
        "group_size=4",
        "max_staleness=1",
        "stall_timeout_s=240",
        "max_restarts=10",
        "restart_window_s=60",
        "services.rollout.groups_per_ticket=2",
        f"services.rollout.channel.default_timeout_s={CALL_DEADLINE_S}",
        "services.trainer.checkpoint_every_steps=3",
        "services.trainer.lease_s=4",
        # A stopped rollout's unused tickets go back after this, so that the outside producer feeds the trainer
        # while the rollout is stopped: a stop that caught it holding every ticket of the staleness window saw no
        # version published, hence no broadcast to miss (the default, 600 s, outlasts the run).
        f"services.queue.reservation_ttl_s={2 * BROADCAST_DEADLINE_S}",
        f"services.weights.deadlines.group_s={BROADCAST_DEADLINE_S}",
        f"services.weights.deadlines.confirm_s={BROADCAST_DEADLINE_S}",
        # Every record stays in the log (no compaction in a run this short anyway): the accounting reads
        # every Put the queue ever acknowledged from it.
        "services.queue.wal.compact_min_bytes=1099511627776",
        "services.queue.external.enabled=true",
        "services.queue.external.port=0",
        f"services.queue.external.tokens_file={tokens}",
    ]


class Producer(threading.Thread):
    """An outside producer on the queue's external port: reserve one group, put it, again, until stopped.
    Its groups are synthetic answers to addition problems (one right, the rest random digits), at the
    ticket's policy version, one every ``pause_s`` at most (alone, it feeds a step every two seconds: the run
    goes on while the rollout is stopped, without racing past the schedule). Calls refused as ``retryable`` (the
    queue restarting or draining) are retried with the same request id / group id; ``acked`` is every group the
    queue acknowledged."""

    def __init__(self, address: str, token: str, seed: int, pause_s: float = 0.5) -> None:
        super().__init__(name="chaos-producer", daemon=True)
        sys.path.insert(0, str(ADDITION))
        import task

        self.task, self.rng, self.pause_s = task, random.Random(seed), pause_s
        self.client = QueueClient(address, token, timeout_s=5)
        self.stopping = threading.Event()
        self.acked: list[str] = []  # namespaced, as the queue and the trainer name them
        self.refused: Counter[str] = Counter()  # by status code, for good
        self.retries = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            n = 0
            while not self.stopping.is_set():
                rid = secrets.token_hex(8)  # the same for every retry: Reserve is idempotent by it
                ticket = self._retry(partial(self.client.reserve, 1, wait_s=1.0, request_id=rid))
                if ticket is None:
                    continue
                gid = f"g{n:05d}"
                n += 1
                group = self._group(gid, ticket.min_policy_version)  # the same for every retry: Put is idempotent by id
                try:
                    self._retry(partial(self.client.put, group, ticket))
                    self.acked.append(f"{CLIENT}/{gid}")
                except TauflowError as e:  # e.g. FAILED_PRECONDITION: a version the trainer rebased away from
                    self.refused[e.code.name] += 1
                    try:
                        self.client.release(ticket)
                    except TauflowError:
                        pass  # it expires by itself
                time.sleep(self.pause_s)
        except _Stopped:
            pass
        except Exception as e:  # noqa: BLE001 - the driver fails the run with it
            self.error = e
        finally:
            self.client.close()

    def _retry(self, call):
        while True:
            try:
                return call()
            except TauflowError as e:
                if not e.retryable:
                    raise
                if self.stopping.is_set():
                    raise _Stopped from None
                self.retries += 1
                time.sleep(0.2)

    def _group(self, gid: str, version: int):
        t = self.task
        a, b = self.rng.randint(10, 99), self.rng.randint(10, 99)
        answer = t.answer_ids(a, b)
        digits = [t.VOCAB[c] for c in "0123456789"]
        samples = []
        for i in range(4):
            tokens = answer if i == 0 else [self.rng.choice(digits) for _ in range(len(answer) - 1)] + [t.VOCAB[t.EOS]]
            trajectory = Trajectory(t.prompt_ids(a, b))
            trajectory.add_model(tokens, [-math.log(len(t.VOCAB))] * len(tokens), [version] * len(tokens))
            samples.append(trajectory.to_sample(str(i), 1.0 if tokens == answer else 0.0))
        return make_group(samples, group_id=gid, prompt_id=t.prompt_text(a, b))

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)


class _Stopped(Exception):
    pass


@dataclass
class Report:
    seed: int
    steps: int
    faults: list[Fault]
    minutes: float = 0.0
    acknowledged: int = 0  # groups the queue accepted (its log's Puts)
    acknowledged_external: int = 0  # of which from the outside producer (as it recorded them)
    trained: int = 0
    left: int = 0  # still in the queue at the end (waiting or leased)
    evicted: dict[str, int] = field(default_factory=dict)  # by the queue, by reason, and never trained
    evicted_after_training: int = 0  # trained, and evicted after their lease expired before its ack (see account)
    refused_external: dict[str, int] = field(default_factory=dict)
    producer_retries: int = 0
    restarts: dict[str, float] = field(default_factory=dict)  # the controller's counter, by role
    unanswered: dict[str, float] = field(default_factory=dict)  # the controller's health-probe counter, by role
    problems: list[str] = field(default_factory=list)  # what the accounting found wrong: none, or a bug

    def as_dict(self) -> dict:
        return asdict(self)


class ChaosRun:
    """One chaos run in ``work`` (its run folder is ``work/run``), from start to the accounting."""

    def __init__(
        self,
        work: Path,
        model: Path,
        dataset: Path,
        steps: int,
        faults: list[Fault],
        seed: int = 0,
        groups_per_step: int = 4,
        timeout_s: float = 900.0,
    ) -> None:
        self.work, self.out, self.steps, self.faults, self.seed = work, work / "run", steps, faults, seed
        self.deadline = time.monotonic() + timeout_s
        token = secrets.token_urlsafe(24)
        tokens = work / "tokens.yaml"
        tokens.write_text(f"{CLIENT}: {token}\n")
        self.token = token
        self.cmd = run_command(ADDITION, settings(self.out, model, dataset, tokens, steps, groups_per_step))
        self.stderr_file = work / "controller.stderr"
        self.proc: subprocess.Popen[bytes] | None = None
        self.probe: QueueClient | None = None

    # -- the run ---------------------------------------------------------------------------

    def execute(self) -> Report:
        started = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        report = Report(self.seed, self.steps, self.faults)
        with open(self.stderr_file, "wb") as err:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        producer = None
        try:
            self._wait("the run's services to start", lambda: (self.out / "rollout.ready.json").exists())
            external = f"127.0.0.1:{self._ready('queue')['external_port']}"
            self.probe_address = external
            self.probe = QueueClient(external, self.token, timeout_s=2)
            producer = Producer(external, self.token, self.seed)
            producer.start()
            for fault in self.faults:
                self._wait(f"version {fault.after_version}", lambda f=fault: self._version() >= f.after_version)
                self._inject(fault)
                if producer.error is not None:
                    raise producer.error
            expected = Counter(f.role for f in self.faults if f.kind == "kill")
            report.restarts = self._wait_restarts(expected)
            report.unanswered = self._controller_metric("tauflow_controller_service_unanswered_total")
            self._wait("the last step", lambda: self._version() >= self.steps or self.proc.poll() is not None)
            producer.stop()
            code = self.proc.wait(max(1.0, self.deadline - time.monotonic()))
            assert code == 0, f"tauflow run exited with {code}:\n{self.controller_log()[-3000:]}"
            if producer.error is not None:
                raise producer.error
        finally:
            if producer is not None:
                producer.stop()
            if self.probe is not None:
                self.probe.close()
            if self.proc.poll() is None:
                self.proc.terminate()
                self.proc.wait(60)
        report.minutes = (time.monotonic() - started) / 60
        report.acknowledged_external = len(producer.acked)
        report.refused_external = dict(producer.refused)
        report.producer_retries = producer.retries
        account(self.out, self.work / "wal-copy", self.steps, set(producer.acked), report)
        return report

    def _inject(self, fault: Fault) -> None:
        fault.at_version = self._version()
        fault.pid = int(self._ready(fault.role)["pid"])
        began = time.monotonic()
        if fault.kind == "kill":
            os.kill(fault.pid, signal.SIGKILL)
            self._wait(f"the restarted {fault.role}", lambda: self._pid(fault.role) not in (None, fault.pid))
        else:
            before: tuple[float, float] = (0.0, 0.0)
            if fault.role == "rollout":  # a member of the sidecar, or no broadcast would wait for it
                self._wait(
                    "the rollout to be an active member of the sidecar",
                    lambda: self._metric("weights", "tauflow_weights_members", "state", "active") >= 1,
                )
                before = (max(0.0, self._failed_broadcasts()), max(0.0, self._joins()))
                began = time.monotonic()
            os.kill(fault.pid, signal.SIGSTOP)
            try:
                time.sleep(STOP_S[fault.role])
                if fault.role == "rollout":  # stopped until a broadcast missed it (a version must come meanwhile)
                    self._wait("a broadcast to miss the stopped rollout", lambda: self._failed_broadcasts() > before[0])
            finally:
                os.kill(fault.pid, signal.SIGCONT)
            fault.back_after_s = round(time.monotonic() - began, 1)
            if fault.role == "rollout":
                self._stop_evidence(fault, *before)
            return
        fault.back_after_s = round(time.monotonic() - began, 1)

    def _failed_broadcasts(self) -> float:
        return self._metric("weights", "tauflow_weights_broadcasts_total", "outcome", "failed")

    def _joins(self) -> float:
        return self._metric("rollout", "tauflow_rollout_sidecar_joins_total", "", "")

    def _metric(self, role: str, name: str, label: str, value: str) -> float:
        """One sample of a role's metric; -1 while its endpoint does not answer (a process just restarted or
        continued may reset the first connections)."""
        try:
            return scrape(self._ready(role)["metrics_port"], name, label).get(value, 0.0)
        except OSError:
            return -1.0

    def _stop_evidence(self, fault: Fault, failed_before: float, joins_before: float) -> None:
        """A stopped rollout misses the sidecar's broadcast deadlines: the sidecar counts the failed broadcasts
        and drops it, and the rollout, running again, joins again (bounded waits)."""

        def shown() -> bool:
            failed, joins = self._failed_broadcasts(), self._joins()
            fault.evidence = {
                "weights_failed_broadcasts": failed - failed_before,
                "rollout_sidecar_rejoins": joins - joins_before,
            }
            return failed > failed_before and joins > joins_before

        self._wait("the stopped rollout in the metrics", shown)

    def _wait_restarts(self, expected: Counter[str]) -> dict[str, float]:
        """The controller's restart counters, once each killed role's reads its kills (bounded wait)."""
        seen: dict[str, float] = {}

        def counted() -> bool:
            seen.clear()
            seen.update(self._controller_metric("tauflow_controller_service_restarts_total"))
            return all(seen.get(role, 0) >= n for role, n in expected.items())

        self._wait("the controller's restart counters", counted)
        return dict(seen)

    def _controller_metric(self, name: str) -> dict[str, float]:
        port = json.loads((self.out / "controller.ready.json").read_text())["metrics_port"]
        return scrape(port, name, "service")

    # -- reading the run -----------------------------------------------------------------

    def _ready(self, role: str) -> dict:
        return json.loads((self.out / f"{role}.ready.json").read_text())

    def _pid(self, role: str) -> int | None:
        try:
            return int(self._ready(role)["pid"])
        except (OSError, ValueError, KeyError):  # not written yet (a restart is under way)
            return None

    def _version(self) -> int:
        """The trainer's version as the queue knows it; -1 while the queue does not answer."""
        assert self.probe is not None
        try:
            return int(self.probe.stats().trainer_version)
        except TauflowError as e:
            if not e.retryable:
                raise
            # A fresh channel: the old one waits out gRPC's reconnect backoff (seconds, growing) before it
            # tries a restarted queue again, and the trainer would be versions further by then.
            self.probe.close()
            self.probe = QueueClient(self.probe_address, self.token, timeout_s=2)
            return -1

    def _wait(self, what: str, done) -> None:
        while not done():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended while waiting for {what}:\n{self.controller_log()[-3000:]}")
            if time.monotonic() > self.deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.controller_log()[-3000:]}")
            time.sleep(0.2)

    def controller_log(self) -> str:
        return self.stderr_file.read_text(errors="replace")


def scrape(port: int, name: str, label: str) -> dict[str, float]:
    """The samples of one metric on a /metrics endpoint, by one label's value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        s.labels.get(label, ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


# -- the accounting ----------------------------------------------------------------------------


def account(out: Path, copy: Path, steps: int, external_acked: set[str], report: Report) -> None:
    """Fills ``report`` from the queue's write-ahead log and the trainer's last checkpoint, and lists in
    ``report.problems`` every way in which accounting is not exact.

    The log holds a PUT record for every group the queue accepted (a Put is answered only once its record
    is written), and an EVICT record naming each group evicted; the state it recovers to holds the groups
    still in the queue. Each log is read from a copy: opening one may cut a torn tail."""
    from tauflow.queue.config import QueueConfig
    from tauflow.queue.records import EVICT, PUT, SNAPSHOT
    from tauflow.queue.state import QueueState
    from tauflow.queue.wal import WriteAheadLog

    problems = report.problems
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(out / "queue-wal", copy / "records")
    shutil.copytree(out / "queue-wal", copy / "state")
    puts: list[str] = []
    evicted: dict[str, set[str]] = {}
    wal = WriteAheadLog(copy / "records" / "queue.wal")
    for kind, meta, _, _ in wal.replay():
        if kind == PUT:
            puts.append(meta["g"])
        elif kind == EVICT:
            evicted.setdefault(meta["why"], set()).update(meta["gs"])
        elif kind == SNAPSHOT:
            problems.append("the log was compacted: the Puts before the snapshot cannot be counted")
    wal.close()
    wal = WriteAheadLog(copy / "state" / "queue.wal")
    left = set(QueueState(QueueConfig(), wal).memory.groups)
    wal.close()

    acknowledged = set(puts)
    if len(puts) != len(acknowledged):
        problems.append(f"{len(puts) - len(acknowledged)} groups were accepted twice")
    if external_acked - acknowledged:
        problems.append(
            f"acknowledged to the outside producer but not in the queue's log: {sorted(external_acked - acknowledged)[:10]}"
        )
    checkpoint = out / "checkpoints" / f"v{steps:08d}" / "trainer_state.json"
    trained_list = json.loads(checkpoint.read_text())["trained_group_ids"] if checkpoint.exists() else []
    if not checkpoint.exists():
        problems.append(f"no checkpoint of the last version: {checkpoint}")
    trained = set(trained_list)
    if len(trained_list) != len(trained):
        problems.append(f"{len(trained_list) - len(trained)} groups trained twice")
    gone = set().union(*evicted.values()) if evicted else set()
    # A trained group that the queue evicted all the same: its step was checkpointed, but its lease expired
    # before the ack (the queue was down longer than the lease, which then expired at its restart), and the
    # queue, taking it back, found it stale. Trained once, so not lost; but the queue counts it as evicted.
    report.evicted_after_training = len(trained & gone)
    for name, a, b in (
        ("trained and still in the queue", trained, left),
        ("evicted and still in the queue", gone, left),
    ):
        if a & b:
            problems.append(f"{len(a & b)} groups {name}: {sorted(a & b)[:10]}")
    if trained - acknowledged:
        problems.append(
            f"{len(trained - acknowledged)} groups trained that the queue never accepted: {sorted(trained - acknowledged)[:10]}"
        )
    lost = acknowledged - trained - left - gone
    if lost:
        problems.append(
            f"{len(lost)} accepted groups neither trained, nor in the queue, nor evicted: {sorted(lost)[:10]}"
        )
    summary = json.loads((out / "summary.json").read_text())
    if summary["status"] != "completed" or summary["staleness_violations"] != 0:
        problems.append(f"summary: status {summary['status']}, {summary['staleness_violations']} staleness violations")
    report.acknowledged, report.trained, report.left = len(acknowledged), len(trained), len(left)
    report.evicted = {why: len(ids - trained) for why, ids in evicted.items()}
