"""A run from start to summary: prepare, launch every role, follow the training, evaluate, stop.

The controller is a client of the services' public contracts only, through its ports (ports.py; app.py
wires the gRPC clients): it reads the trainer's steps and the queue's counters, and measures held-out
accuracy through the rollout and reward services (evaluation.py), exactly as an outside program would.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tauflow.controller.config import ROLES, RunConfig, flatten
from tauflow.controller.evaluation import evaluate, read_heldout
from tauflow.controller.launcher import Launcher, LaunchFailed, ServiceSpec
from tauflow.controller.metrics import controller_metrics, write_targets
from tauflow.controller.metrics import serve as serve_metrics
from tauflow.controller.ports import (
    CheckPeer,
    Connect,
    PeerError,
    Peers,
    PeerUnavailable,
    QueueStats,
    TrainerPort,
    TrainerStep,
)
from tauflow.controller.progress import Progress
from tauflow.controller.summary import EvalRecord, RunSummary, StepRecord
from tauflow.core.telemetry import configured_exporters

log = logging.getLogger(__name__)

POLL_S = 0.5  # between two looks at the trainer and the queue
EVAL_ATTEMPTS = 3  # failed attempts in a row before an evaluation is given up
STOP_ORDER = ["rollout", "trainer", "weights", "reward", "queue"]


class RunStalled(RuntimeError):
    """The trainer made no step for ``stall_timeout_s`` although every service is up."""


@dataclass
class Poll:
    """One look at the run: the trainer's new steps, the queue's counters, and when (since the start)."""

    steps: list[TrainerStep]
    stats: QueueStats
    at_s: float


@dataclass
class Following:
    """What the follow loop carries from one poll to the next."""

    progressed_at: float  # monotonic time of the last progress (or restart)
    # (steps seen, trainer version at the queue) then: progress is a change of either
    marker: tuple[int, int] = (0, -1)
    # The next step to list, by number, not by count: a trainer resumed from a checkpoint (--resume) starts
    # at its version, and its history holds no step before it.
    next_step: int = 0
    next_eval: int = 0  # the version due for evaluation
    eval_failures: int = 0  # failed attempts at the evaluation due, in a row
    tokens: int = 0  # trained in the steps seen


class Evaluated(enum.Enum):
    DONE = enum.auto()  # recorded, or given up: the run goes on
    RETRY = enum.auto()  # a service did not answer: again at the next poll
    STOP = enum.auto()  # reached the target, with stop_at_target


class Run:
    def __init__(
        self,
        config: RunConfig,
        *,
        launcher: Launcher,
        connect: Connect,
        check_peer: CheckPeer,
        on_progress: Callable[[Progress], None] | None = None,
        serve_metrics: bool = True,
    ) -> None:
        self.config = config
        self.out_dir = config.run_dir
        self.launcher = launcher
        self.connect = connect
        self.check_peer = check_peer
        self.on_progress = on_progress or (lambda progress: None)
        self.summary = RunSummary(
            config.name, config.max_staleness, config.steps, target_accuracy=config.target_accuracy
        )
        self.progress = Progress()
        self._t0, self._wall0 = time.monotonic(), time.time()  # the run's start, on both clocks
        self.serve_metrics = serve_metrics  # False where the process serves /metrics already (tauflow-controller)
        self.metrics_port: int | None = None

    # -- launch --------------------------------------------------------------------------

    def _settings(self, role: str, addresses: Mapping[str, str]) -> dict[str, object]:
        config, out = self.config, self.out_dir
        base: dict[str, dict[str, object]] = {
            "queue": {
                "wal.dir": out / "queue-wal",
                "max_staleness": config.max_staleness,
                "groups_per_step": config.groups_per_step,
            },
            "reward": {"default_reward_fn": config.reward_fn},
            "weights": {},
            "trainer": {
                "backend.model_path": config.model,
                "backend.seed": config.seed,
                "queue_address": addresses.get("queue", ""),
                "weights_address": addresses.get("weights", ""),
                "groups_per_step": config.groups_per_step,
                "max_staleness": config.max_staleness,
                "total_steps": config.steps,
                "checkpoint_dir": out / "checkpoints",
                "backend.optim.total_steps": config.steps,  # where a cosine schedule ends
                "backend.temperature": config.temperature,
            },
            "rollout": {
                "model_path": config.model,
                "dataset": config.dataset,
                "group_size": config.group_size,
                "seed": config.seed,
                "queue_address": addresses.get("queue", ""),
                "reward_address": addresses.get("reward", ""),
                "weights_address": addresses.get("weights", ""),
                "reward_fn": config.reward_fn,
                "sampling.temperature": config.temperature,
            },
        }
        return {**base[role], **flatten(config.services.get(role, {}))}

    def trace_env(self) -> dict[str, str]:
        """With ``traces_file`` set, every service also writes its spans there (OTLP export, when an
        endpoint is set, goes on as well). A new run sets the previous run's file aside: call it before the
        first role starts."""
        if not self.config.traces_file:
            return {}
        path = (self.out_dir / self.config.traces_file).resolve()  # an absolute traces_file stays as it is
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self.config.resume and path.exists():
            path.rename(path.with_name(path.name + ".prev"))  # a new run's spans only, as with checkpoints
        exporters = [e for e in configured_exporters() if e != "file"]
        return {"OTEL_TRACES_EXPORTER": ",".join([*exporters, "file"]), "TAUFLOW_TRACES_FILE": str(path)}

    def prepare_command(self) -> list[str]:
        # "{seed}" in the command is the run's seed: a warm start per seed, as the recipe wants.
        command = [arg.replace("{seed}", str(self.config.seed)) for arg in self.config.prepare]
        if command and command[0] in ("python", "python3"):
            command[0] = sys.executable  # the interpreter tauflow runs in, not whatever is on PATH
        return command

    def set_aside_previous_run(self) -> list[str]:
        """A new run in an out_dir that holds a previous one starts afresh; the previous run's state is kept
        one generation back (``checkpoints.prev``, ``queue-wal.prev``) so that a rerun by mistake loses
        nothing. ``resume: true`` continues it instead."""
        moved = []
        for name in ("checkpoints", "queue-wal"):
            path = self.out_dir / name
            if self.config.resume or not path.exists():
                continue
            previous = self.out_dir / f"{name}.prev"
            if previous.exists():
                shutil.rmtree(previous)
            path.rename(previous)
            moved.append(name)
        return moved

    def _prepare(self) -> None:
        moved = self.set_aside_previous_run()
        if moved:
            log.warning("a previous run's state was moved aside", extra={"moved": [f"{m}.prev" for m in moved]})
        if self.config.prepare:
            command = self.prepare_command()
            log.info("prepare", extra={"command": " ".join(command)})
            subprocess.run(command, check=True)

    def launch(self) -> dict[str, str]:
        """Starts every role in order (each learns its peers' addresses) and checks what it is; runs in a
        thread."""
        # With launcher external the services, their state and their model are their deployment's: nothing
        # to set aside or prepare here.
        if self.launcher.starts_services:
            self._prepare()
        env = self.trace_env()
        addresses: dict[str, str] = {}
        for role in ROLES:
            self.progress.message = f"starting {role}"
            self.on_progress(self.progress)
            svc = self.launcher.start(ServiceSpec(role, self._settings(role, addresses), env=dict(env)))
            addresses[role] = svc.address
            if role == "trainer" and svc.info.get("resumed_from"):  # its first step is the one after this version
                self.summary.extra["resumed_from_version"] = svc.info.get("policy_version")
            asyncio.run(self.check_peer(role, svc.address, self.summary.services))
            self._write_targets()
        return addresses

    # -- follow --------------------------------------------------------------------------

    async def follow(self, addresses: Mapping[str, str]) -> RunSummary:
        heldout = read_heldout(self.config.eval)
        following = Following(progressed_at=time.monotonic())
        async with self.connect(addresses) as peers:
            while True:
                await self._check_restarts(following)
                poll = await self._poll(peers, following)
                if poll is None:  # a service is restarting: the launcher brings it back
                    await asyncio.sleep(POLL_S)
                    continue
                await self._check_stall(peers, following, poll)
                self._record_steps(following, poll)
                version = self._show_progress(following, poll)
                done = version >= self.config.steps
                if heldout and (version >= following.next_eval or done):
                    evaluated = await self._evaluate(peers, heldout, version, done, following)
                    if evaluated is Evaluated.RETRY:
                        await asyncio.sleep(POLL_S)
                        continue
                    if evaluated is Evaluated.STOP:
                        break  # the services are stopped (drained) by execute(); the last checkpoint stays
                else:
                    self.progress.message = ""
                self.on_progress(self.progress)
                if done:
                    await self._until_trainer_finished(peers.trainer)
                    break
                await asyncio.sleep(POLL_S)
        self._record_timing(following)
        return self.summary

    async def _check_restarts(self, following: Following) -> None:
        restarted = await asyncio.to_thread(self.launcher.check)
        for role in restarted:  # a restart is how a rolling upgrade replaces a role: check the new build
            await self.check_peer(role, self.launcher.addresses()[role], self.summary.services)
        if restarted:
            self._write_targets()
            self.progress.message = f"restarted {', '.join(restarted)}"
            following.progressed_at = time.monotonic()  # a restarted role needs time to catch up

    def _stalled(self, following: Following) -> bool:
        return time.monotonic() - following.progressed_at > self.config.stall_timeout_s

    async def _poll(self, peers: Peers, following: Following) -> Poll | None:
        """The trainer's new steps and the queue's counters; None while either does not answer (the run
        stalls once that has lasted ``stall_timeout_s``)."""
        try:
            steps = await peers.trainer.list_steps(following.next_step)
            stats = await peers.queue.stats()
        except PeerUnavailable as e:
            if self._stalled(following):
                raise RunStalled(await self._stall_report(peers)) from e
            return None
        return Poll(steps, stats, time.monotonic() - self._t0)

    async def _check_stall(self, peers: Peers, following: Following, poll: Poll) -> None:
        # Progress is a new step, or a new version at the queue: a trainer resumed from its checkpoint
        # re-trains steps already listed, and reports each version to the queue.
        marker = (len(self.summary.steps) + len(poll.steps), poll.stats.trainer_version)
        if marker != following.marker:
            following.progressed_at, following.marker = time.monotonic(), marker
        elif self._stalled(following):
            raise RunStalled(await self._stall_report(peers))

    def _record_steps(self, following: Following, poll: Poll) -> None:
        histogram = self.summary.staleness_histogram
        for step in poll.steps:
            following.next_step = step.step + 1
            committed_s = step.committed_at - self._wall0 if step.committed_at is not None else poll.at_s
            self.summary.steps.append(
                StepRecord(
                    step.step,
                    step.policy_version,
                    poll.at_s,
                    step.mean_reward,
                    step.max_staleness,
                    step.mean_staleness,
                    step.loss,
                    step.trained_tokens,
                    step.groups,
                    dict(step.metrics),
                    committed_s,
                )
            )
            for staleness, groups in step.groups_by_staleness.items():
                histogram[staleness] = histogram.get(staleness, 0) + groups
            following.tokens += step.trained_tokens

    def _show_progress(self, following: Following, poll: Poll) -> int:
        """Updates the progress from what the poll brought; returns the newest policy version."""
        steps, progress = self.summary.steps, self.progress
        version = steps[-1].policy_version if steps else 0
        progress.version, progress.steps, progress.queue_depth = version, len(steps), poll.stats.depth_groups
        if steps:
            progress.reward, progress.staleness = steps[-1].mean_reward, steps[-1].max_staleness
            progress.tokens_per_s = following.tokens / max(poll.at_s, 1e-9)
        return version

    async def _evaluate(
        self, peers: Peers, heldout: list[dict[str, Any]], version: int, done: bool, following: Following
    ) -> Evaluated:
        progress = self.progress
        progress.message = f"evaluating version {version}"
        self.on_progress(progress)
        try:
            accuracy, engine_version = await evaluate(peers.rollout, peers.reward, heldout, self.config.eval.reward_fn)
            following.eval_failures = 0
        except PeerUnavailable as e:
            following.eval_failures += 1
            log.warning("evaluation failed", extra={"code": e.code, "attempt": following.eval_failures})
            if following.eval_failures < EVAL_ATTEMPTS:
                return Evaluated.RETRY
            following.eval_failures = 0  # give this evaluation up; the run goes on
            following.next_eval = version + self.config.eval.every_steps
            progress.message = f"evaluation of version {version} failed {EVAL_ATTEMPTS} times; skipped"
            return Evaluated.DONE
        following.next_eval = version + self.config.eval.every_steps
        self.summary.evals.append(
            EvalRecord(version, time.monotonic() - self._t0, accuracy, len(heldout), engine_version)
        )
        progress.accuracy, progress.message = accuracy, ""
        target = self.config.target_accuracy
        if self.config.stop_at_target and target is not None and accuracy >= target and not done:
            self.summary.extra["stopped_at_target_version"] = version
            return Evaluated.STOP
        return Evaluated.DONE

    def _record_timing(self, following: Following) -> None:
        self.summary.wall_s = time.monotonic() - self._t0
        self.summary.tokens_per_s = following.tokens / max(self.summary.wall_s, 1e-9)

    async def _stall_report(self, peers: Peers) -> str:
        """What a stalled run looks like from outside: the trainer's state and the queue's counters."""
        parts = [f"no training step for {self.config.stall_timeout_s:.0f}s"]
        try:
            status = await peers.trainer.status()
            parts.append(f"trainer {status.state} at version {status.policy_version}")
            stats = await peers.queue.stats()
            parts.append(f"queue depth {stats.depth_groups} groups, {stats.reserved_groups} reserved")
        except PeerError as e:
            parts.append(f"status unavailable ({e.code})")
        parts.append(f"logs in {self.out_dir / 'logs'}")
        return "; ".join(parts)

    async def _until_trainer_finished(self, trainer: TrainerPort, timeout_s: float = 300.0) -> None:
        """The last step shows up before its checkpoint is written: stop nothing until the trainer says
        FINISHED (its final checkpoint holds every step, and its leases are acked)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if (await trainer.status()).finished:
                    return
            except PeerUnavailable:
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the trainer did not finish within {timeout_s:.0f}s of its last step")

    # -- all of it -----------------------------------------------------------------------

    def _write_targets(self) -> None:
        write_targets(self.out_dir, self.config.name, self.launcher.services, self.metrics_port)

    async def execute(self) -> RunSummary:
        controller_metrics().watch(self)
        metrics_server = serve_metrics(self.out_dir) if self.serve_metrics else None
        self.metrics_port = metrics_server.port if metrics_server else None
        try:
            addresses = await asyncio.to_thread(self.launch)
            await self.follow(addresses)
            self.summary.status = "completed"
            target = self.config.target_accuracy
            if target is not None and (self.summary.final_accuracy or 0.0) < target:
                self.summary.status = "below_target"
        except LaunchFailed as e:  # a service that failed (ServiceFailed), or a launcher that cannot launch
            self.summary.status, self.summary.message = "failed", str(e)
            raise
        except RunStalled as e:
            self.summary.status, self.summary.message = "stalled", str(e)
            raise
        except asyncio.CancelledError:
            self.summary.status, self.summary.message = "interrupted", "stopped by the user"
            raise
        finally:
            self.summary.wall_s = time.monotonic() - self._t0
            self.launcher.stop(order=STOP_ORDER)
            self.summary.write(self.out_dir)
            if metrics_server is not None:
                metrics_server.close()
        return self.summary
