"""A run from start to summary: prepare, launch every role, follow the training, evaluate, stop.

The controller is a client of the services' public contracts only, through its ports (ports.py; app.py
wires the gRPC clients): it reads the trainer's steps and the queue's counters, and measures held-out
accuracy through the rollout and reward services (evaluation.py), exactly as an outside program would.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tauflow.controller.config import JUDGE, MAX_ROLLOUT_REPLICAS, ROLES, SCORERS, TEACHER, RunConfig, flatten
from tauflow.controller.configrecord import settle_config
from tauflow.controller.dial import TauChange
from tauflow.controller.evaluation import evaluate, read_heldout
from tauflow.controller.launcher import (
    Launcher,
    LaunchFailed,
    LocalLauncher,
    Rendezvous,
    Service,
    ServiceSpec,
    describe_os_error,
    instance_name,
    service_env,
)
from tauflow.controller.livechanges import LiveValues, resumed_config, settle_live, write_live
from tauflow.controller.metrics import TARGETS_FILE, controller_metrics, write_targets
from tauflow.controller.metrics import serve as serve_metrics
from tauflow.controller.ports import (
    CheckPeer,
    Connect,
    GreedySampling,
    PeerError,
    Peers,
    PeerUnavailable,
    QueueStats,
    SidecarMember,
    TrainerStep,
)
from tauflow.controller.progress import Progress
from tauflow.controller.scaling import ROLLOUT, RolloutScaler, ServiceView, list_services, replicas_of
from tauflow.controller.secrets import redact_command, redact_text
from tauflow.controller.summary import EvalRecord, RunSummary, StepRecord
from tauflow.controller.watchdog import LoopWatchdog
from tauflow.core.config import environment_over
from tauflow.core.logs import LogLimit
from tauflow.core.runtoken import load_run_token, new_token, write_token_file
from tauflow.core.staleness import check_tau, loosest
from tauflow.core.telemetry import configured_exporters
from tauflow.media import DataRow

log = logging.getLogger(__name__)

POLL_S = 0.5  # between two looks at the trainer and the queue
# The roles whose addresses a role is given at its start (``_settings``): it starts once they serve.
START_NEEDS = {"reward": {JUDGE}, "trainer": {"queue", "weights", TEACHER}, ROLLOUT: {"queue", "reward", "weights"}}
EVAL_ATTEMPTS = 3  # failed attempts in a row before an evaluation is given up
MEMBERS_EVERY_S = 5.0  # launcher external: how often the sidecar's rollout members are read
CHECK_TIMEOUT_S = 5.0  # the check of a restarted process: a hung one must not hold the loop (it restarts the others)
RUN_TOKEN_FILE = "run.token"  # in out_dir, 0600, written by the first run there (tauflow.core.runtoken)
# The stop, in stages: the rollout and the trainer drain first, while the services they call still answer
# (the rollout gives its unused tickets back to the queue, the trainer's last acknowledgements land), then the
# services; every process of a stage at once.
STOP_ORDER = [["rollout", "trainer"], ["teacher", "weights", "reward", "judge", "queue"]]
MAX_TAU = 1_000_000  # SetMaxStaleness's bound (controller.v1)
RENDEZVOUS = Rendezvous("distributed.master_address")  # the trainer's ranks find each other there
WRITE_FAILURE_LOG_EVERY_S = 60.0  # a file that cannot be written (a full disk): one log line per this, at most


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hugging Face Hub model id, org/name
LOCK_FILE = "run.lock"  # in out_dir: held (flock) by the controller of the run that uses it


class OutDirInUse(LaunchFailed):
    """Another controller's run uses this out_dir: a second run there would move its checkpoints and queue
    log aside under it and overwrite its ready file and summary."""


class RunStalled(RuntimeError):
    """The trainer made no step for ``stall_timeout_s`` although every service is up."""


class RunNotLive(RuntimeError):
    """The run is not training (still starting, or ended): a live change cannot be made now."""


class TauChangeUnderWay(RuntimeError):
    """Another change of τ is under way (it runs to its end): this one is refused, to be retried."""


@dataclass
class Poll:
    """One look at the run: the trainer's new steps, the queue's counters, and when (since the start)."""

    steps: list[TrainerStep]
    stats: QueueStats
    at_s: float


@contextlib.asynccontextmanager
async def _running(coroutine: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Runs ``coroutine`` as a task for the block's duration, cancelled at its end."""
    task = asyncio.create_task(coroutine)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


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
    members_at: float = 0.0  # launcher external: when the sidecar's members were last read


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
        # What live changes are recorded against; --resume goes on with the run's live changes (livechanges.py).
        self._configured = LiveValues.of(config)
        self._given = config  # (settle_live records against it once the run holds out_dir)
        config, self.resumed_live = resumed_config(config)
        self._live_recorded = LiveValues.of(config)  # as live.json holds them (or the config, before any change)
        self._live_failed: LiveValues | None = None  # the values whose record failed last (logged once)
        self.config = config
        self.out_dir = config.run_dir
        self.launcher = launcher
        self.connect = connect
        self.check_peer = check_peer
        self.on_progress = on_progress or (lambda progress: None)
        self.summary = RunSummary(
            config.name, config.max_staleness, config.steps, target_accuracy=config.target_accuracy
        )
        if self.resumed_live:
            self.summary.extra["resumed_live_changes"] = dict(self.resumed_live)
        self.progress = Progress(max_staleness=config.max_staleness)
        self._t0, self._wall0 = time.monotonic(), time.time()  # the run's start, on both clocks
        self.serve_metrics = serve_metrics  # False where the process serves /metrics already (tauflow-controller)
        self.metrics_port: int | None = None
        self.control_address = ""  # where ControllerService answers for this run (tauflow run serves one)
        # The run token (tauflow.core.runtoken): every role's control methods need it; this process's channels send it.
        # (absolute: controller.ready.json and the roles' settings name it, read from other directories)
        self.token_file = (Path(config.token_file) if config.token_file else self.out_dir / RUN_TOKEN_FILE).resolve()
        if not config.token_file and not self.token_file.exists():
            # One token per out_dir, kept: services deployed with it (launcher external) work across runs. One
            # that is there but unreadable is an error (load_run_token), never silently replaced under them.
            write_token_file(self.token_file, new_token())
            if config.launcher == "external":
                log.warning(
                    "launcher external without run.token_file: a new run token was written; the deployed "
                    "services need it as their auth.token_file, or their control methods refuse the controller",
                    extra={"token_file": str(self.token_file)},
                )
        self.run_token = load_run_token(self.token_file)
        self._lock_fd: int | None = None  # run.lock, held from claim_out_dir() to the run's end
        self._claimed = False
        self._settled = False
        self.tau = config.max_staleness  # the τ in force: SetMaxStaleness changes it
        self._tau_log = LogLimit(10.0)  # a token holder may change τ thousands of times a minute
        self._watchdog = LoopWatchdog()  # the time the controller itself did not run is no stall of the run
        self.resumed_version = 0  # --resume: the version the trainer resumed at
        self._trainer_released = False  # the run's first evaluation done: the trainer trains (_release_trainer)
        self._resume_pending = False  # a trainer process to resume (the release, or one restarted before it)
        self.scaler = RolloutScaler(config.rollout.replicas, MAX_ROLLOUT_REPLICAS)
        self.members: list[SidecarMember] = []  # launcher external: the rollout servers the sidecar lists
        self._peers: Peers | None = None  # while the run trains: the live changes use its clients
        self._dial = asyncio.Lock()  # one τ change at a time
        self._tau_changes: set[asyncio.Future[tuple[int, int]]] = set()  # under way (each runs to its end)
        # a failed change could not put a role back, or a queue or trainer came back: the follow loop gives
        # both the τ in force
        self._tau_diverged = "max_staleness" in self.resumed_live  # (external roles may hold another τ)
        self._env: dict[str, str] = {}
        self._addresses: dict[str, str] = {}
        self._unchecked: set[str] = set()  # processes (re)started but not yet checked (CheckPeer): each pass asks
        self.run_id = f"{config.name}-{uuid.uuid4().hex[:12]}"
        self.started_wall = self._wall0
        self.following = False  # launched: the run trains (GetRun: RUNNING, not STARTING)
        self.ended_wall: float | None = None
        self.stop_reason = ""  # StopRun's: the summary says why the run stopped
        self.stop_requested = False
        self.summary_written = True  # False once the final summary could not be written
        self.stop_grace_s: float | None = None  # StopRun's grace period (0: immediate); None: the launcher's own
        # prometheus-targets.json behind the services (its write failed: a full disk): written again each pass
        self._targets_due = False
        self._targets_logged_at: float | None = None  # monotonic time of the last failure logged

    # -- launch --------------------------------------------------------------------------

    def _settings(self, role: str, addresses: Mapping[str, str]) -> dict[str, object]:
        config, out = self.config, self.out_dir
        # the rollout's generation budget, where the run sets it: Dr. GRPO's constant L in the trainer's loss
        budget = flatten(config.services.get(ROLLOUT, {})).get("sampling.max_new_tokens")
        base: dict[str, dict[str, object]] = {
            "queue": {
                "wal.dir": out / "queue-wal",
                "max_staleness": config.max_staleness,
                "groups_per_step": config.groups_per_step,
            },
            "reward": {
                "default_reward_fn": config.reward_fn,
                **({"functions.genrm.config.address": addresses[JUDGE]} if addresses.get(JUDGE) else {}),
            },
            JUDGE: {"model_path": config.judge_model, "server_id": JUDGE},
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
                **({"backend.response_tokens": budget} if budget else {}),
                **({"backend.teacher_address": addresses[TEACHER]} if addresses.get(TEACHER) else {}),
                # held until the run's first evaluation is done (``_release_trainer``): a step taken before it
                # made the baseline an evaluation of version 1 or later
                **({"start_paused": True} if self._holds_trainer and not self._trainer_released else {}),
            },
            # A rollout server that only scores: no data set (no producer loop), no weight sidecar (its weights
            # never change), its own server id.
            TEACHER: {
                "model_path": config.teacher_model,
                "server_id": TEACHER,
                "sampling.temperature": config.temperature,
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
                **flatten({"data": config.data.model_dump(exclude_defaults=True)}),  # (the defaults are the service's)
            },
        }
        return {**base[role], "auth.token_file": str(self.token_file), **flatten(config.services.get(role, {}))}

    def _spec(self, role: str, index: int, addresses: Mapping[str, str]) -> ServiceSpec:
        """The process ``index`` of ``role``: a rollout replica (its own server id and seed) or a trainer rank."""
        settings = self._settings(role, addresses)
        if role == ROLLOUT and index:
            settings |= {"server_id": f"rollout-{index}", "seed": self.config.seed + index}
        if role == "trainer" and self.config.trainer.world_size > 1:
            settings |= {
                "distributed.world_size": self.config.trainer.world_size,
                "distributed.rank": index,
                "distributed.strategy": self.config.trainer.strategy,
            }
        name = instance_name(role, index)
        module = "rollout" if role in SCORERS else role
        # Each process's spans name it (service.instance.id), as its Prometheus target does (`instance_name`).
        resource = f"service.instance.id={name},tauflow.role={role},tauflow.replica={index}"
        inherited = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
        env = {**self._env, "OTEL_RESOURCE_ATTRIBUTES": f"{inherited},{resource}" if inherited else resource}
        return ServiceSpec(name, settings, env=env, role=role, index=index, module=module)

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

    def claim_out_dir(self) -> None:
        """Takes ``out_dir/run.lock`` for this process (kept to the end of the run; the kernel lets it go if the
        process dies, and the roles it starts do not inherit it), before anything in out_dir is moved or
        written: a second run on a live run's out_dir moved its checkpoints and queue log aside, deleted its
        older checkpoint and overwrote its ready file and summary, then failed. Raises OutDirInUse. Then the
        live changes are recorded (livechanges.settle_live)."""
        if self._claimed:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.out_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # (EWOULDBLOCK: another process holds it)
            holder = ""
            with contextlib.suppress(OSError):
                holder = os.read(fd, 32).decode("ascii", "replace").strip()
            os.close(fd)
            by = f" (controller pid {holder})" if holder.isdigit() else ""
            raise OutDirInUse(
                f"{self.out_dir} is in use by another tauflow run{by}: stop it (tauflow status {self.out_dir}), "
                "or choose another out_dir"
            ) from None
        except OSError as e:  # a filesystem without flock (NFS mounted nolock, some FUSE mounts): run unguarded
            os.close(fd)
            log.warning("cannot lock out_dir: two runs there are not kept apart", extra={"error": describe_os_error(e)})
        else:
            self._lock_fd = fd
            with contextlib.suppress(OSError):  # (the pid only names the holder in a refusal)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._claimed = True
        if not self._settled:  # (once per run: a run executed again goes on with its own record)
            self._settled = True
            settle_live(self._given, self.config)
            # (the config as given: a live change taken back by the resume is not a change of its config)
            if changes := settle_config(self._given):
                self.summary.extra["resumed_config_changes"] = changes

    def _release_out_dir(self) -> None:
        self._claimed = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

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

    def check_inputs(self) -> None:
        """On this machine (the local launcher), after ``prepare``: the models and data sets named exist. A
        missing model was a Hugging Face "Repo id must use alphanumeric chars" error from the trainer, and a
        missing data set a bare "No such file" from the rollout, once four services had started. A model
        named ``org/name`` may be a Hub id: left to the roles."""
        if not isinstance(self.launcher, LocalLauncher):
            return  # (paths of other machines)
        named = {
            "model": self.config.model,
            "teacher_model": self.config.teacher_model,
            "judge_model": self.config.judge_model,
            "dataset": self.config.dataset,
            "eval.dataset": self.config.eval.dataset,
        }
        missing = [
            f"{key}: {value} does not exist"
            for key, value in named.items()
            if value and not Path(value).exists() and not (key.endswith("model") and _HUB_ID.fullmatch(value))
        ]
        if missing:
            raise LaunchFailed("; ".join(missing) + f" (relative paths are from {Path.cwd()})")

    def _prepare(self) -> None:
        moved = self.set_aside_previous_run()
        if moved:
            log.warning("a previous run's state was moved aside", extra={"moved": [f"{m}.prev" for m in moved]})
        if self.config.prepare:
            command = self.prepare_command()
            shown = " ".join(redact_command(command))  # (a token on its command line is the user's, not the log's)
            log.info("prepare", extra={"command": shown})
            try:
                subprocess.run(command, check=True)
            except subprocess.CalledProcessError as e:  # (its message would quote the whole command)
                raise LaunchFailed(f"the prepare command ({shown}) exited with code {e.returncode}") from None
        self.check_inputs()

    def launch(self) -> dict[str, str]:
        """Starts every role, in waves (``start_waves``: each learns its peers' addresses), and checks what it
        is; runs in a thread."""
        # With launcher external the services, their state and their model are their deployment's: nothing
        # to set aside or prepare here.
        if self.launcher.starts_services:
            self._prepare()
        self._env = self.trace_env()
        addresses = self._addresses
        for wave in self.start_waves():
            self.progress.message = f"starting {', '.join(wave)}"
            self.on_progress(self.progress)
            for role, started in self._start_roles(wave, addresses).items():
                addresses[role] = started[0].address
                if role == "trainer" and started[0].info.get("resumed_from"):  # its first step is the next one
                    self.summary.extra["resumed_from_version"] = started[0].info.get("policy_version")
                    self.resumed_version = int(started[0].info.get("policy_version") or 0)
                for svc in started:
                    asyncio.run(self.check_peer(role, svc.address, self.summary.services, svc.name, _follower(svc)))
            self._write_targets()
        self.summary.rollout_replicas.append((time.monotonic() - self._t0, self._rollout_count()))
        return dict(addresses)

    def start_waves(self) -> list[list[str]]:
        """The roles in the waves they start in: each wave's roles together, once every role whose address
        they are given (``_settings``) serves. Together, the launch takes as long as its slowest role per wave,
        not the sum of all (a model load each for the trainer and the rollout on CPUs). Where the trainer and
        the rollout may share a device (a GPU, or the sidecar's ``ipc`` backend), the rollout starts after the
        trainer: the trainer takes its memory first, as it did one role at a time (an engine that sizes its
        cache by the memory it finds free would otherwise leave the trainer none)."""
        needs = {role: set(peers) for role, peers in START_NEEDS.items()}
        if self._may_share_a_device():
            needs[ROLLOUT] = needs[ROLLOUT] | {"trainer"}
        pending, waves = self.roles, []
        while pending:
            wave = [role for role in pending if not needs.get(role, set()) & set(pending)]
            waves.append(wave)
            pending = [role for role in pending if role not in wave]
        return waves

    def _may_share_a_device(self) -> bool:
        """Whether the trainer and the rollout may share a device: the sidecar's ``ipc`` backend, or either one
        on anything but the CPU (both default to the CPU)."""
        devices = (
            self._role_setting("trainer", "backend.device"),
            self._role_setting(ROLLOUT, "engine_options.device"),
        )
        ipc = self._role_setting("weights", "backend") == "ipc"
        return ipc or any(str(d).lower() != "cpu" for d in devices if d is not None)

    def _role_setting(self, role: str, key: str) -> object:
        """A role's setting as its process will read it (None where nothing sets it): the run config's, else
        the ``TAUFLOW_<ROLE>_*`` environment it inherits (``TAUFLOW_TRAINER_BACKEND__DEVICE=cuda``, or a whole
        section), exactly as the launcher hands them over (``service_env``: the run's settings win) and the
        process reads them (its environment over its settings file)."""
        settings, env = service_env(role, flatten(self.config.services.get(role, {})), os.environ)
        node: object = environment_over(settings, f"TAUFLOW_{role.upper()}_", env)
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    @property
    def roles(self) -> list[str]:
        """The roles, each after the peers whose addresses it is given (the teacher, when the run has one,
        before the trainer that asks it); ``start_waves`` says which start together."""
        roles = list(ROLES)
        if self.config.teacher_model:
            roles.insert(roles.index("trainer"), TEACHER)
        if self.config.judge_model:  # before the reward service that asks it
            roles.insert(roles.index("reward"), JUDGE)
        return roles

    def _start_roles(self, roles: list[str], addresses: Mapping[str, str]) -> dict[str, list[Service]]:
        """Every process of ``roles``, all at once, each serving on return: the rollout replicas side by side
        (each loads its model meanwhile: one after another, the launch took as many loads as there are
        processes), a trainer of several ranks first, as a gang (launcher ray places its rank 0 on the
        sidecar's node before the others take room there). A process that fails to start raises ServiceFailed
        (the launch fails, naming it; the run's stop ends the others)."""
        begun: dict[str, list[Service]] = {}
        names: list[str] = []  # begun, not yet seen serving
        try:
            if "trainer" in roles and self.config.trainer.world_size > 1:
                specs = [self._spec("trainer", rank, addresses) for rank in range(self.config.trainer.world_size)]
                begun["trainer"] = list(self.launcher.start_gang(specs, RENDEZVOUS))
            for role in (r for r in roles if r not in begun):
                count = self.scaler.target if role == ROLLOUT and self.launcher.starts_services else 1
                begun[role] = []
                for index in range(count):
                    begun[role].append(self.launcher.begin_start(self._spec(role, index, addresses)))
                    names.append(begun[role][-1].name)
            waiting = list(names)
            while waiting:
                waiting = [name for name in waiting if not self.launcher.poll_start(name)]
                if waiting:
                    time.sleep(0.05)
        except BaseException:
            # A run stopped meanwhile: a process begun after the stop looked at the services is ended by its
            # poll (nothing else would end it); one that still loads otherwise is the run's stop's to end.
            for name in names:
                with contextlib.suppress(Exception):
                    self.launcher.poll_start(name)
            raise
        return {role: begun[role] for role in roles}

    def _rollout_count(self) -> int:
        """The rollout servers that run (serve, or restart); a new replica counts once it has served."""
        known = [svc for svc in replicas_of(self.launcher.services.values(), ROLLOUT) if svc.info]
        return len(self.members) if self.members and not self.launcher.starts_services else len(known)

    # -- follow --------------------------------------------------------------------------

    async def follow(self, addresses: Mapping[str, str]) -> RunSummary:
        heldout = read_heldout(self.config.eval, self.config.data)
        following = Following(progressed_at=time.monotonic())
        async with self.connect(addresses) as peers, _running(self._watchdog.run()):
            self._peers = peers
            self.following = True
            try:
                await self._follow(peers, following, heldout)
            finally:  # (StopRun cancels the run here, a failure raises: either way its channels close)
                self._peers = None
        self._record_timing(following)
        return self.summary

    async def _follow(self, peers: Peers, following: Following, heldout: Any) -> None:
        """The run's loop: the steps, the evaluations, the restarts and the stall watch, to the last step."""
        while True:
            await self._supervise(peers, following)
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
                if not self._trainer_released:  # (nothing can progress while the trainer is held: no stall)
                    following.progressed_at = time.monotonic()
                if evaluated is Evaluated.RETRY:
                    await asyncio.sleep(POLL_S)
                    continue
                if evaluated is Evaluated.STOP:
                    break  # the services are stopped (drained) by execute(); the last checkpoint stays
            else:
                self.progress.message = ""
            if not self._trainer_released:  # the first evaluation is done (or there is none): train
                self._release_trainer(following)
            if self._resume_pending:
                await self._resume_trainer(peers)
            self.on_progress(self.progress)
            if done:
                self._peers = None  # the run is ending: no live change any more
                await self._until_trainer_finished(peers, following)
                break
            await asyncio.sleep(POLL_S)

    async def _supervise(self, peers: Peers, following: Following) -> None:
        """Restarts what died, carries out the rollout target, checks each new process, and keeps a
        changed τ on a queue or trainer that came back."""
        restarted = await asyncio.to_thread(self.launcher.check)
        started, stopped = await asyncio.to_thread(
            self.scaler.reconcile, self.launcher, lambda index: self._spec(ROLLOUT, index, self._addresses)
        )
        self._unchecked.update([*restarted, *started])
        # a restart is how a rolling upgrade replaces a role: check it (each at once: one that hangs costs
        # the loop one deadline, not one each)
        await asyncio.gather(*(self._check_restarted(name) for name in sorted(self._unchecked)))
        back = {self.launcher.services[name].role for name in restarted}
        if self.tau != self.config.max_staleness and back & {"queue", "trainer"}:
            self._tau_diverged = True  # a queue or trainer that came back gets the live τ (idempotent on both)
        if self._tau_diverged and not self._dial.locked():  # (a change under way may wait on a hung role)
            await self._reapply_tau(peers, {"queue", "trainer"})
        self._record_live()  # (a target that fell back; a record that failed before)
        if started or stopped:
            self.summary.rollout_replicas.append((time.monotonic() - self._t0, self._rollout_count()))
        if not self.launcher.starts_services and time.monotonic() - following.members_at >= MEMBERS_EVERY_S:
            following.members_at = time.monotonic()
            await self._read_members(peers)
        self.progress.rollout_replicas = self._rollout_count()
        if restarted or started or stopped or self._targets_due:
            self._write_targets()
        if restarted or started or stopped:
            self.progress.message = "; ".join(
                f"{what} {', '.join(names)}"
                for what, names in (("restarted", restarted), ("started", started), ("stopped", stopped))
                if names
            )
            following.progressed_at = time.monotonic()  # a restarted role needs time to catch up
        if any(getattr(svc, "restarting", False) for svc in self.launcher.services.values()):
            # a restart under way (bounded by start_timeout_s) is not a stall: a role reloading a large model
            # answers UNAVAILABLE meanwhile
            following.progressed_at = time.monotonic()

    async def _check_restarted(self, name: str) -> None:
        """CheckPeer of a process (re)started: kept in ``_unchecked`` until it answers. A trainer's process
        started paused before the run released the trainer is resumed here."""
        svc = self.launcher.services.get(name)
        if svc is None:  # (stopped for good meanwhile: a replica scaled in)
            self._unchecked.discard(name)
            return
        try:
            await self.check_peer(
                svc.role, svc.address, self.summary.services, name, _follower(svc), timeout_s=CHECK_TIMEOUT_S
            )
            if svc.role == "trainer" and svc.index == 0 and self._trainer_released and self._holds_trainer:
                self._resume_pending = True  # (it may have started paused, before the release)
        except PeerUnavailable as e:  # died again, or hangs: its restarts (or the stall timeout) decide
            log.warning("a restarted service did not say what it is; asked again", extra={"service": name,
                        "code": e.code})  # fmt: skip
            return
        self._unchecked.discard(name)

    @property
    def _holds_trainer(self) -> bool:
        """Whether this run starts its trainer paused until its first evaluation is done (a deployed trainer,
        launcher external, trains without the controller's word)."""
        return bool(self.config.eval.dataset) and self.launcher.starts_services

    def _release_trainer(self, following: Following) -> None:
        """Lets the trainer, started paused (``start_paused``), take its steps once the run's first evaluation
        is done: its later processes start unpaused, and the one that runs is resumed (``_resume_trainer``;
        one started paused before the release is resumed once its restart is checked)."""
        self._trainer_released = True
        if not self._holds_trainer:
            return
        self.launcher.update_settings("trainer", {"start_paused": False})
        following.progressed_at = time.monotonic()  # (the stall timeout counts from the release)
        self._resume_pending = True

    async def _resume_trainer(self, peers: Peers) -> None:
        """Resume, asked at each pass until the trainer has answered it (a call that failed, the trainer
        restarting or slow to answer, must not leave it paused)."""
        try:
            await peers.trainer.resume()
        except PeerUnavailable as e:
            log.debug("the trainer did not answer Resume; asked again", extra={"code": e.code})
            return
        except PeerError as e:  # FAILED_PRECONDITION: failed (its restart comes) or stopping: nothing to resume
            log.warning("the trainer could not be resumed", extra={"code": e.code})
        self._resume_pending = False

    async def _read_members(self, peers: Peers) -> None:
        """Launcher external: the rollout servers the weight sidecar lists (they come and go with their
        deployment); the run logs each change."""
        try:
            members = await peers.weights.members()
        except PeerError:
            return  # the sidecar is restarting: its members are read next time
        before, now = {m.member_id for m in self.members}, {m.member_id for m in members}
        for member_id in sorted(now - before):
            log.info("a rollout server joined", extra={"member": member_id})
        for member_id in sorted(before - now):
            log.info("a rollout server left", extra={"member": member_id})
        self.members = members

    def _stalled(self, following: Following) -> bool:
        """No progress for ``stall_timeout_s`` of the time the controller watched (a pause of its own is not
        the run's stall: the timeout counts again from when it runs again)."""
        watched = time.monotonic() - following.progressed_at - self._watchdog.unwatched_s(following.progressed_at)
        return watched > self.config.stall_timeout_s

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
        for step in poll.steps:
            following.next_step = step.step + 1
            committed_s = step.committed_at - self._wall0 if step.committed_at is not None else poll.at_s
            # The trainer's wall clock, not this process's: a step of either clock (or two hosts' clocks
            # apart) put 295 of 400 steps an hour before the run began. A step was committed after the one
            # before it and before this poll saw it.
            earlier = self.summary.steps[-1].committed_s if self.summary.steps else 0.0
            committed_s = min(max(committed_s, earlier, 0.0), poll.at_s)
            self.summary.add_step(  # (its staleness counted and judged against the τ changes, once)
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
                    dict(step.groups_by_staleness),
                )
            )
            following.tokens += step.trained_tokens

    def _show_progress(self, following: Following, poll: Poll) -> int:
        """Updates the progress from what the poll brought; returns the newest policy version."""
        steps, progress = self.summary.steps, self.progress
        # (a trainer resumed at the last version lists no step: the run is done all the same; before, it
        # waited for a step that never came and ended "stalled")
        version = max(steps[-1].policy_version if steps else 0, self.resumed_version)
        progress.version, progress.steps, progress.queue_depth = version, len(steps), poll.stats.depth_groups
        if steps:
            progress.reward, progress.staleness = steps[-1].mean_reward, steps[-1].max_staleness
            progress.tokens_per_s = following.tokens / max(poll.at_s, 1e-9)
        return version

    def _greedy_sampling(self) -> GreedySampling:
        """How the training's completions end (services.rollout's sampling, nested or dotted), for eval."""
        rollout = flatten(self.config.services.get(ROLLOUT, {}))
        return GreedySampling(
            stop=tuple(rollout.get("sampling.stop", ())),
            stop_token_ids=tuple(rollout.get("sampling.stop_token_ids", ())),
            max_new_tokens=int(rollout.get("sampling.max_new_tokens", 0)),
        )

    async def _evaluate(
        self, peers: Peers, heldout: list[DataRow], version: int, done: bool, following: Following
    ) -> Evaluated:
        progress = self.progress
        progress.message = f"evaluating version {version}"
        self.on_progress(progress)
        try:
            rollouts = await peers.rollouts(self._rollout_addresses())
            accuracy, engine_version = await evaluate(
                rollouts, peers.reward, heldout, self.config.eval.reward_fn, self._greedy_sampling()
            )
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

    def _rollout_addresses(self) -> list[str]:
        """The rollout servers that serve now (an evaluation spreads its prompts over them)."""
        return [svc.address for svc in replicas_of(self.launcher.services.values(), ROLLOUT) if svc.up]

    def _record_timing(self, following: Following) -> None:
        self.summary.wall_s = time.monotonic() - self._t0
        self.summary.tokens_per_s = following.tokens / max(self.summary.wall_s, 1e-9)

    async def _stall_report(self, peers: Peers, what: str = "no training step") -> str:
        """What a stalled run looks like from outside: the trainer's state and the queue's counters."""
        parts = [f"{what} for {self.config.stall_timeout_s:.0f}s"]
        try:
            status = await peers.trainer.status()
            parts.append(f"trainer {status.state} at version {status.policy_version}")
            if status.last_error:  # (a trainer cut off from the queue is still "TRAINING": this says so)
                parts.append(f"trainer: {redact_text(status.last_error)}")
            stats = await peers.queue.stats()
            parts.append(
                f"queue depth {stats.depth_groups} groups, {stats.reserved_groups} reserved, "
                f"{stats.leased_groups} leased"
            )
            held = stats.depth_groups + stats.reserved_groups + stats.leased_groups
            if stats.capacity_groups and held >= stats.capacity_groups:
                # (the trainer acks its leases only at its checkpoints: a capacity below what it holds between
                # two of them deadlocks the run, and "depth 0" pointed away from it)
                parts.append(
                    f"the queue is full (capacity_groups {stats.capacity_groups}): the trainer acks its groups "
                    "only at its checkpoints, so services.queue.capacity_groups must hold groups_per_step x "
                    "checkpoint_every_steps and more"
                )
        except PeerError as e:
            parts.append(f"status unavailable ({e.code})")
        parts.append(f"logs in {self.out_dir / 'logs'}")
        return "; ".join(parts)

    async def _until_trainer_finished(self, peers: Peers, following: Following) -> None:
        """The last step shows up before its checkpoint is written: stop nothing until the trainer says
        FINISHED (its final checkpoint holds every step, and its leases are acked). Meanwhile the roles are
        still supervised (a queue that died here was never restarted, the trainer's acks waiting on it), and a
        trainer that has not finished ``stall_timeout_s`` after its last step is a stall, reported as one (a
        final checkpoint on a full disk ended in a traceback after a fixed 300 s)."""
        following.progressed_at = time.monotonic()
        supervised_at = time.monotonic()
        seen: tuple[str, int] | None = None
        while True:
            try:
                status = await peers.trainer.status()
                if status.finished:
                    return
                if seen is not None and (status.state, status.policy_version) != seen:  # (a restarted trainer
                    following.progressed_at = time.monotonic()  # training its last steps again goes on)
                seen = (status.state, status.policy_version)
            except PeerUnavailable:
                pass
            if self._stalled(following):
                raise RunStalled(await self._stall_report(peers, "the trainer has not finished after its last step"))
            if time.monotonic() - supervised_at >= POLL_S:
                await self._supervise(peers, following)
                supervised_at = time.monotonic()
            await asyncio.sleep(0.2)

    # -- live changes (ControllerService) ------------------------------------------------

    def _refuse_when_stopping(self) -> None:
        # (StopRun was answered: a change now would outlive the run in live.json, and its channels are closing)
        if self.stop_requested:
            raise RunNotLive("the run is stopping: it can change only while it trains")

    def _live_peers(self) -> Peers:
        self._refuse_when_stopping()
        if self._peers is None:
            state = "still starting" if self.summary.status == "running" else f"{self.summary.status}"
            raise RunNotLive(f"the run is {state}: it can change only while it trains")
        return self._peers

    async def set_max_staleness(self, tau: int) -> tuple[int, int]:
        """Sets τ on the queue and the trainer while the run goes on (dial.py); returns (the τ before, the
        trainer's version once the new one is in force). Raises ValueError for a value that is not a τ,
        RunNotLive, or PeerError when a role cannot be reached (the τ in force is then unchanged: a role
        already changed is put back; the call may be retried).

        The change runs to its end whatever becomes of the call that asked for it: cancelled between the two
        roles (a caller's deadline), it left them on different τ, and the controller's record on a third."""
        check_tau(tau, largest=MAX_TAU)
        self._live_peers()
        if self._tau_changes:  # (one at a time: callers that retry against a hung role must not pile up)
            raise TauChangeUnderWay("a change of max_staleness is under way; retry once it has ended")
        change = asyncio.ensure_future(self._change_tau(tau))
        self._tau_changes.add(change)
        change.add_done_callback(_settled_in(self._tau_changes))
        return await asyncio.shield(change)

    async def _change_tau(self, tau: int) -> tuple[int, int]:
        async with self._dial:
            peers = self._live_peers()
            previous = self.tau
            before = (await peers.trainer.status()).policy_version
            if tau == previous:
                # The τ in force by the record: nothing is recorded, but both roles are given it (idempotent
                # there), so that a role a failed change left elsewhere (see _put_back) has it again.
                for peer in (peers.queue, peers.trainer):
                    await peer.set_max_staleness(tau)
                self._tau_diverged = False
                return previous, before
            # The steps the trainer lists from `before` on may race the change: judged once it is known.
            self.summary.tau_change_begins(before)
            changed: list[Any] = []
            try:
                # Lowering: the queue first, so it never delivers under a looser τ than the trainer's;
                # raising: the trainer first. The trainer judges each batch by the τ it was delivered under.
                looser = loosest([tau, previous]) == tau
                for peer in (peers.trainer, peers.queue) if looser else (peers.queue, peers.trainer):
                    # (counted before it answers: one that applied the τ but answered too late is put back too)
                    changed.append(peer)
                    await peer.set_max_staleness(tau)
                after = (await peers.trainer.status()).policy_version
            except BaseException as e:
                self.summary.tau_change_failed()
                # (its caller may be gone, a deadline passed: the log is where the outcome is told)
                why = e.code if isinstance(e, PeerError) else type(e).__name__
                log.warning(
                    "a change of max_staleness failed; the τ in force stays",
                    extra={"tau": tau, "kept": previous, "why": why},
                )
                await self._put_back(changed, previous)
                raise
            change = TauChange(previous, tau, before, after, time.monotonic() - self._t0)
            self.summary.tau_changed(change)
            self.tau = self.progress.max_staleness = tau
            for role in ("queue", "trainer"):  # a restarted process starts with it
                self.launcher.update_settings(role, {"max_staleness": tau})
            self._record_live()  # ... and a resumed run
            if changes := self._tau_log.due():
                log.warning(
                    "max_staleness changed",
                    extra={"previous": previous, "tau": tau, "policy_version": after, "changes": changes},
                )
            return previous, after

    async def _put_back(self, changed: list[Any], tau: int) -> None:
        """A change that failed half-way: the roles it changed get the τ in force back. One that cannot be
        reached either is given it by the follow loop (``_tau_diverged``), or by the next SetMaxStaleness."""
        for peer in reversed(changed):
            try:
                await peer.set_max_staleness(tau)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - unreachable, closed (the run ending)
                self._tau_diverged = True
                log.error("a role kept the τ of a failed change; it gets the one in force again", extra={"tau": tau})

    async def _reapply_tau(self, peers: Peers, roles: set[str]) -> None:
        """A queue or trainer that came back (launcher external: with its deployment's τ), or that a failed
        change left on another τ, gets the live one."""
        async with self._dial:
            self._tau_diverged = False
            for role in sorted(roles & {"queue", "trainer"}):
                try:
                    await (peers.queue if role == "queue" else peers.trainer).set_max_staleness(self.tau)
                except PeerError as e:
                    self._tau_diverged = True  # tried again at the next pass
                    log.warning("could not re-apply max_staleness", extra={"role": role, "code": e.code})

    def scale_rollout(self, replicas: int) -> int:
        """Sets the number of rollout servers (carried out by the follow loop: scaling.py); returns the
        previous target. Raises ScalingRefused (launcher external), ValueError, RunNotLive."""
        if not 1 <= replicas <= self.scaler.limit:
            raise ValueError(f"replicas={replicas} must be between 1 and {self.scaler.limit}")
        self._refuse_when_stopping()
        if self.launcher.starts_services:
            self._live_peers()
        previous = self.scaler.set_target(self.launcher, replicas)
        self._record_live()
        return previous

    def _record_live(self) -> None:
        """Keeps live.json (livechanges.py) at the τ in force and the rollout target, so that a --resume after
        the controller's death goes on with them. A failed write is logged once per value and tried again at
        each pass of the follow loop: the change stays in force meanwhile."""
        live = LiveValues(self.tau, self.scaler.target)
        if live == self._live_recorded:
            return
        try:
            write_live(self.out_dir, self._configured, live)
        except OSError as e:
            if live != self._live_failed:
                self._live_failed = live
                log.error(
                    "could not record a live change; it is in force, but a --resume after a crash would go back "
                    "to the config's value (tried again at each pass)",
                    extra={"out_dir": str(self.out_dir), "error": describe_os_error(e)},
                )
            return
        self._live_recorded, self._live_failed = live, None

    def request_stop(self, reason: str = "", grace_s: float | None = None) -> None:
        """What StopRun asked for, before it cancels the run: why (the summary says so), and how long the
        services may take to stop (0: at once; None: the launcher's grace period)."""
        self.stop_reason, self.stop_grace_s = reason, grace_s
        self.stop_requested = True  # no live change from now on: its channels are about to close

    def services(self) -> list[ServiceView]:
        """Every process of the run (ListServices, tauflow status)."""
        return list_services(self.launcher, self.summary.services, self.members)

    # -- all of it -----------------------------------------------------------------------

    def _write_targets(self) -> None:
        """prometheus-targets.json, for the services now. It is observability, not the run: a failure to write
        it (a full disk) is logged, at most once a minute, the previous file stays whole, and the run goes on
        writing it again at each pass of its loop until it is written."""
        try:
            write_targets(self.out_dir, self.config.name, self.launcher.services, self.metrics_port)
        except OSError as e:
            self._targets_due = True
            now = time.monotonic()
            if self._targets_logged_at is None or now - self._targets_logged_at >= WRITE_FAILURE_LOG_EVERY_S:
                self._targets_logged_at = now
                log.warning(
                    "could not write the Prometheus targets; the previous file stays and the run goes on "
                    "(written again at each pass)",
                    extra={"file": str(self.out_dir / TARGETS_FILE), "error": describe_os_error(e)},
                )
            return
        if self._targets_due:
            log.warning("the Prometheus targets are written again", extra={"file": str(self.out_dir / TARGETS_FILE)})
        self._targets_due, self._targets_logged_at = False, None

    def _write_summary(self) -> None:
        """summary.json and summary.png, each replaced whole (summary.py). A failure (a full disk) must not
        hide how the run ended, nor end a run that completed with a traceback: it is logged (stderr) and the
        previous summary stays as it was."""
        if self._was_complete():
            log.warning(
                "the run had completed already (its trainer resumed at the last version): its summary stays",
                extra={"out_dir": str(self.out_dir), "version": self.resumed_version},
            )
            return
        try:
            self.summary.write_json(self.out_dir)
        except OSError as e:
            self.summary_written = False  # (the CLI says so, and exits 4 where the run itself ended well)
            log.error(
                "could not write the run summary; the previous one (if any) stays",
                extra={"out_dir": str(self.out_dir), "status": self.summary.status, "error": describe_os_error(e)},
            )
            # The steps' metrics are this summary's alone (a --resume writes one of its own steps): kept in
            # logs/ where that folder takes them (out_dir itself made read-only, a quota on it).
            with contextlib.suppress(OSError):
                self.summary.write_json(self.out_dir / "logs")
                log.warning("the run summary was written to logs/ instead", extra={"path": str(self.out_dir / "logs")})
            return
        try:
            self.summary.write(self.out_dir)  # (the JSON again, with its plot: the two stay a pair)
        except OSError as e:
            log.error(
                "could not draw the run summary's plot; summary.json is written",
                extra={"out_dir": str(self.out_dir), "error": describe_os_error(e)},
            )

    def _was_complete(self) -> bool:
        """A resume of a run that had completed (its summary says so) that trained nothing more: the summary of
        the whole run stays, not one of no steps."""
        ended = ("completed", "below_target")
        if self.summary.steps or self.resumed_version < self.config.steps or self.summary.status not in ended:
            return False
        for folder in (self.out_dir, self.out_dir / "logs"):  # (logs/: where one that could not be written went)
            try:
                previous = json.loads((folder / "summary.json").read_text())
            except (OSError, ValueError):
                continue
            if isinstance(previous, dict) and previous.get("status") in ended:
                return True
        return False

    async def execute(self) -> RunSummary:
        self.claim_out_dir()  # (before anything in out_dir is touched; refused, it leaves the other run alone)
        controller_metrics().watch(self)
        metrics_server = (
            serve_metrics(self.out_dir, self.control_address, str(self.token_file)) if self.serve_metrics else None
        )
        self.metrics_port = metrics_server.port if metrics_server else None
        try:
            addresses = await asyncio.to_thread(self.launch)
            await self.follow(addresses)
            self.summary.status = "completed"
            target = self.config.target_accuracy
            if target is not None and (self.summary.final_accuracy or 0.0) < target:
                self.summary.status = "below_target"
        except LaunchFailed as e:  # a service that failed (ServiceFailed), or a launcher that cannot launch
            self.summary.status, self.summary.message = "failed", redact_text(str(e))  # (GetRun shows it)
            raise
        except RunStalled as e:
            self.summary.status, self.summary.message = "stalled", redact_text(str(e))
            raise
        except asyncio.CancelledError:
            why = f": {self.stop_reason}" if self.stop_reason else ""
            self.summary.status, self.summary.message = "interrupted", f"stopped by the user{why}"
            raise
        except Exception as e:  # a peer's answer the run cannot go on from, or a bug: the summary says which
            self.summary.status = "failed"
            self.summary.message = redact_text(f"the controller stopped the run: {type(e).__name__}: {e}")
            raise
        finally:
            self.summary.wall_s = time.monotonic() - self._t0
            # in a thread: the processes' grace period must not hold the loop (ControllerService answers meanwhile)
            stopping = asyncio.ensure_future(
                asyncio.to_thread(self.launcher.stop, order=STOP_ORDER, grace_s=self.stop_grace_s)
            )
            try:
                await asyncio.shield(stopping)
            except asyncio.CancelledError:  # (cancelled again: the stop still finishes)
                await stopping
            self.ended_wall = time.time()
            self._write_summary()
            if metrics_server is not None:
                metrics_server.close()
            self._release_out_dir()
        return self.summary


def _settled_in(pending: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    """A done-callback that forgets a background change and reads its outcome (its caller may be gone)."""

    def settled(future: asyncio.Future[Any]) -> None:
        pending.discard(future)
        if not future.cancelled():
            future.exception()

    return settled


def _follower(svc: Service) -> bool:
    """A trainer rank other than 0: it serves health and ServerInfo only (rank 0 serves TrainerService)."""
    return svc.role == "trainer" and svc.index > 0
