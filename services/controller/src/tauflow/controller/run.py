"""A run from start to summary: prepare, launch every role, follow the training, evaluate, stop.

The controller is a client of the services' public contracts only: it reads the trainer's steps
(`ListSteps`), the queue's counters (`Stats`), and measures held-out accuracy by sampling greedily
from the rollout service (`Generate`) and scoring with the reward service (`Score`), exactly as an
outside program would.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tauflow.controller.compat import check_peer
from tauflow.controller.config import ROLES, RunConfig, flatten
from tauflow.controller.launcher import Launcher, LaunchFailed, LocalLauncher, ServiceSpec
from tauflow.controller.metrics import controller_metrics, write_targets
from tauflow.controller.metrics import serve as serve_metrics
from tauflow.controller.summary import EvalRecord, RunSummary, StepRecord
from tauflow.core.channel import create_channel
from tauflow.core.telemetry import configured_exporters

log = logging.getLogger(__name__)


class RunStalled(RuntimeError):
    """The trainer made no step for ``stall_timeout_s`` although every service is up."""


@dataclass
class Progress:
    """What the terminal shows; updated after every poll."""

    version: int = 0
    steps: int = 0
    reward: float = 0.0
    accuracy: float | None = None
    staleness: int = 0
    tokens_per_s: float = 0.0
    queue_depth: int = 0
    message: str = ""


def create_launcher(config: RunConfig, out_dir: Path) -> Launcher:
    """The run's launcher (``launcher``); Ray is imported only for ``ray``."""
    if config.launcher == "external":
        from tauflow.controller.external import ExternalLauncher

        return ExternalLauncher(config.external, start_timeout_s=config.start_timeout_s)
    supervision = {"max_restarts": config.max_restarts, "restart_window_s": config.restart_window_s,
                   "start_timeout_s": config.start_timeout_s}
    if config.launcher == "ray":
        from tauflow.controller.raylauncher import RayLauncher

        return RayLauncher(out_dir, config.ray, **supervision)  # type: ignore[arg-type]
    return LocalLauncher(out_dir, **supervision)  # type: ignore[arg-type]


def _read_jsonl(path: str, limit: int) -> list[dict]:  # type: ignore[type-arg]
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()][:limit]


class Run:
    def __init__(
        self, config: RunConfig, on_progress: Callable[[Progress], None] | None = None, serve_metrics: bool = True
    ) -> None:
        self.c = config
        self.out_dir = Path(config.out_dir or f"runs/{config.name}")
        self.on_progress = on_progress or (lambda p: None)
        self.summary = RunSummary(config.name, config.max_staleness, config.steps, target_accuracy=config.target_accuracy)
        self.progress = Progress()
        self.launcher = create_launcher(config, self.out_dir)
        self._t0, self._wall0 = time.monotonic(), time.time()  # the run's start, on both clocks
        self._stubs: dict[str, object] = {}
        self.serve_metrics = serve_metrics  # False where the process serves /metrics already (tauflow-controller)
        self.metrics_port: int | None = None

    # -- launch --------------------------------------------------------------------------

    def _settings(self, role: str, addresses: dict[str, str]) -> dict[str, object]:
        c, out = self.c, self.out_dir
        base: dict[str, dict[str, object]] = {
            "queue": {"wal.dir": out / "queue-wal", "max_staleness": c.max_staleness,
                      "groups_per_step": c.groups_per_step},
            "reward": {"default_reward_fn": c.reward_fn},
            "weights": {},
            "trainer": {"backend.model_path": c.model, "backend.seed": c.seed,
                        "queue_address": addresses.get("queue", ""), "weights_address": addresses.get("weights", ""),
                        "groups_per_step": c.groups_per_step, "max_staleness": c.max_staleness,
                        "total_steps": c.steps, "checkpoint_dir": out / "checkpoints",
                        "backend.optim.total_steps": c.steps,  # where a cosine schedule ends
                        "backend.temperature": c.temperature},
            "rollout": {"model_path": c.model, "dataset": c.dataset, "group_size": c.group_size, "seed": c.seed,
                        "queue_address": addresses.get("queue", ""), "reward_address": addresses.get("reward", ""),
                        "weights_address": addresses.get("weights", ""), "reward_fn": c.reward_fn,
                        "sampling.temperature": c.temperature},
        }
        extra = {k: v for k, v in flatten(c.services.get(role, {})).items()}
        return {**base[role], **extra}

    def trace_env(self) -> dict[str, str]:
        """With ``traces_file`` set, every service also writes its spans there (OTLP export, when an
        endpoint is set, goes on as well)."""
        if not self.c.traces_file:
            return {}
        path = Path(self.c.traces_file)
        path = (path if path.is_absolute() else self.out_dir / path).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self.c.resume and path.exists() and not getattr(self, "_traces_set_aside", False):
            path.rename(path.with_name(path.name + ".prev"))  # a new run's spans only, as with checkpoints
        self._traces_set_aside = True
        exporters = [e for e in configured_exporters() if e != "file"]
        return {"OTEL_TRACES_EXPORTER": ",".join([*exporters, "file"]), "TAUFLOW_TRACES_FILE": str(path)}

    def prepare_command(self) -> list[str]:
        # "{seed}" in the command is the run's seed: a warm start per seed, as the recipe wants.
        command = [arg.replace("{seed}", str(self.c.seed)) for arg in self.c.prepare]
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
            if self.c.resume or not path.exists():
                continue
            previous = self.out_dir / f"{name}.prev"
            if previous.exists():
                shutil.rmtree(previous)
            path.rename(previous)
            moved.append(name)
        return moved

    def launch(self) -> dict[str, str]:
        # With launcher external the services, their state and their model are their deployment's: nothing
        # to set aside or prepare here.
        if self.launcher.starts_services:
            moved = self.set_aside_previous_run()
            if moved:
                log.warning("a previous run's state was moved aside", extra={"moved": [f"{m}.prev" for m in moved]})
            if self.c.prepare:
                command = self.prepare_command()
                log.info("prepare", extra={"command": " ".join(command)})
                subprocess.run(command, check=True)
        addresses: dict[str, str] = {}
        for role in ROLES:
            self.progress.message = f"starting {role}"
            self.on_progress(self.progress)
            svc = self.launcher.start(ServiceSpec(role, self._settings(role, addresses), env=self.trace_env()))
            addresses[role] = svc.address
            if role == "trainer" and svc.info.get("resumed_from"):  # its first step is the one after this version
                self.summary.extra["resumed_from_version"] = svc.info.get("policy_version")
            asyncio.run(check_peer(role, svc.address, self.summary.services))  # (launch runs in a thread)
            self._write_targets()
        return addresses

    # -- follow --------------------------------------------------------------------------

    def _channel(self, address: str, descriptor) -> grpc.aio.Channel:  # type: ignore[no-untyped-def]
        return create_channel(address, [descriptor])

    async def follow(self, addresses: dict[str, str]) -> RunSummary:
        trainer = trainer_pb2_grpc.TrainerServiceStub(
            self._channel(addresses["trainer"], trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]))
        queue = queue_pb2_grpc.QueueServiceStub(
            self._channel(addresses["queue"], queue_pb2.DESCRIPTOR.services_by_name["QueueService"]))
        rollout = rollout_pb2_grpc.RolloutServiceStub(
            self._channel(addresses["rollout"], rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]))
        reward = reward_pb2_grpc.RewardServiceStub(
            self._channel(addresses["reward"], reward_pb2.DESCRIPTOR.services_by_name["RewardService"]))
        heldout = _read_jsonl(self.c.eval.dataset, self.c.eval.max_prompts) if self.c.eval.dataset else []
        next_eval = 0
        tokens = 0
        last_step_at, last_marker = time.monotonic(), (0, -1)
        eval_failures = 0
        # The next step to list, by step number, not by count: a trainer resumed from a checkpoint (--resume)
        # starts at its version, and its history holds no step before it.
        next_step = 0
        while True:
            restarted = await asyncio.to_thread(self.launcher.check)
            for role in restarted:  # a restart is how a rolling upgrade replaces a role: check the new build
                await check_peer(role, self.launcher.addresses()[role], self.summary.services)
            if restarted:
                self._write_targets()
                self.progress.message = f"restarted {', '.join(restarted)}"
                last_step_at = time.monotonic()  # a restarted role needs time to catch up
            try:
                steps = await trainer.ListSteps(trainer_pb2.ListStepsRequest(from_step=next_step))
                stats = await queue.Stats(queue_pb2.StatsRequest())
            except grpc.aio.AioRpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if time.monotonic() - last_step_at > self.c.stall_timeout_s:
                    raise RunStalled(await self._stall_report(trainer, queue)) from e
                await asyncio.sleep(0.5)  # a service is restarting: the launcher brings it back
                continue
            now = time.monotonic() - self._t0
            # Progress is a new step, or a new version at the queue: a trainer resumed from its
            # checkpoint re-trains steps already listed, and reports each version to the queue.
            marker = (len(self.summary.steps) + len(steps.steps), stats.trainer_version)
            if marker != last_marker:
                last_step_at, last_marker = time.monotonic(), marker
            elif time.monotonic() - last_step_at > self.c.stall_timeout_s:
                raise RunStalled(await self._stall_report(trainer, queue))
            for m in steps.steps:
                next_step = m.step + 1
                self.summary.steps.append(StepRecord(
                    m.step, m.policy_version, now, m.mean_reward, m.max_staleness, m.mean_staleness, m.loss,
                    m.trained_tokens, m.groups, dict(m.metrics),
                    m.committed_at.ToNanoseconds() / 1e9 - self._wall0 if m.HasField("committed_at") else now))
                for staleness, n in m.groups_by_staleness.items():
                    self.summary.staleness_histogram[staleness] = self.summary.staleness_histogram.get(staleness, 0) + n
                tokens += m.trained_tokens
            version = self.summary.steps[-1].policy_version if self.summary.steps else 0
            p = self.progress
            p.version, p.steps, p.queue_depth = version, len(self.summary.steps), stats.depth_groups
            if self.summary.steps:
                last = self.summary.steps[-1]
                p.reward, p.staleness = last.mean_reward, last.max_staleness
                p.tokens_per_s = tokens / max(now, 1e-9)
            done = version >= self.c.steps
            if heldout and (version >= next_eval or done):
                p.message = f"evaluating version {version}"
                self.on_progress(p)
                try:
                    accuracy, engine_version = await self.evaluate(rollout, reward, heldout)
                    eval_failures = 0
                except grpc.aio.AioRpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    eval_failures += 1
                    log.warning("evaluation failed", extra={"code": e.code().name, "attempt": eval_failures})
                    if eval_failures < 3:
                        await asyncio.sleep(0.5)
                        continue  # a service is restarting: evaluate again at the next poll
                    eval_failures, accuracy = 0, None  # give this evaluation up; the run goes on
                if accuracy is None:
                    next_eval = version + self.c.eval.every_steps
                    p.message = f"evaluation of version {version} failed 3 times; skipped"
                else:
                    self.summary.evals.append(EvalRecord(
                        version, time.monotonic() - self._t0, accuracy, len(heldout), engine_version))
                    p.accuracy, p.message = accuracy, ""
                    next_eval = version + self.c.eval.every_steps
                    target = self.c.target_accuracy
                    if self.c.stop_at_target and target is not None and accuracy >= target and not done:
                        self.summary.extra["stopped_at_target_version"] = version
                        break  # the services are stopped (drained) by execute(); the last checkpoint stays
            else:
                p.message = ""
            self.on_progress(p)
            if done:
                await self._until_trainer_finished(trainer)
                break
            await asyncio.sleep(0.5)
        self.summary.wall_s = time.monotonic() - self._t0
        self.summary.tokens_per_s = tokens / max(self.summary.wall_s, 1e-9)
        return self.summary

    async def _stall_report(self, trainer, queue) -> str:  # type: ignore[no-untyped-def]
        """What a stalled run looks like from outside: the trainer's state and the queue's counters."""
        parts = [f"no training step for {self.c.stall_timeout_s:.0f}s"]
        try:
            status = await trainer.GetStatus(trainer_pb2.GetStatusRequest())
            parts.append(f"trainer {trainer_pb2.TrainerState.Name(status.state)} at version {status.policy_version}")
            stats = await queue.Stats(queue_pb2.StatsRequest())
            parts.append(f"queue depth {stats.depth_groups} groups, {stats.reserved_groups} reserved")
        except grpc.aio.AioRpcError as e:
            parts.append(f"status unavailable ({e.code().name})")
        parts.append(f"logs in {self.out_dir / 'logs'}")
        return "; ".join(parts)

    async def _until_trainer_finished(self, trainer, timeout_s: float = 300.0) -> None:  # type: ignore[no-untyped-def]
        """The last step shows up before its checkpoint is written: stop nothing until the trainer says
        FINISHED (its final checkpoint holds every step, and its leases are acked)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                status = await trainer.GetStatus(trainer_pb2.GetStatusRequest())
                if status.state == trainer_pb2.TRAINER_STATE_FINISHED:
                    return
            except grpc.aio.AioRpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the trainer did not finish within {timeout_s:.0f}s of its last step")

    async def evaluate(self, rollout, reward, rows: list[dict]) -> tuple[float, int]:  # type: ignore[no-untyped-def, type-arg]
        """Greedy held-out accuracy through the public APIs (Generate, then Score), and the oldest version the
        engine answered with (it may lag or, with tau > 0, differ from the trainer's)."""
        sampling = rollout_pb2.SamplingParams(n=1, temperature=0.0)

        async def one(row: dict) -> common_pb2.Group:  # type: ignore[type-arg]
            # A deadline of its own: 64 prompts at once on a rollout server that is also generating.
            resp = await rollout.Generate(
                rollout_pb2.GenerateRequest(prompt_text=row["prompt"], sampling=sampling), timeout=120
            )
            return common_pb2.Group(group_id=f"eval-{row['id']}", samples=resp.samples,
                                    metadata={"answer": str(row["answer"])})

        groups = []
        for i in range(0, len(rows), 64):
            groups += await asyncio.gather(*(one(r) for r in rows[i : i + 64]))
        scored = await reward.Score(reward_pb2.ScoreRequest(groups=groups, reward_fn=self.c.eval.reward_fn), timeout=120)
        scores = [s.reward.score for g in scored.groups for s in g.samples]
        engine_version = min((s.behaviour_version for g in groups for s in g.samples), default=0)
        return sum(1.0 for s in scores if s >= 1.0) / max(len(scores), 1), engine_version

    # -- all of it -----------------------------------------------------------------------

    def _write_targets(self) -> None:
        write_targets(self.out_dir, self.c.name, self.launcher.services, self.metrics_port)

    async def execute(self) -> RunSummary:
        controller_metrics().watch(self)
        metrics_server = serve_metrics(self.out_dir) if self.serve_metrics else None
        self.metrics_port = metrics_server.port if metrics_server else None
        try:
            addresses = await asyncio.to_thread(self.launch)
            await self.follow(addresses)
            self.summary.status = "completed"
            target = self.c.target_accuracy
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
            self.launcher.stop(order=["rollout", "trainer", "weights", "reward", "queue"])
            self.summary.write(self.out_dir)
            if metrics_server is not None:
                metrics_server.close()
        return self.summary
