"""A run's configuration: one file says what to train, the controller derives every service's settings.

The run-level keys (``max_staleness``, ``groups_per_step``, ``group_size``, ``model``, ...) are the
dial and the recipe; ``services.<role>`` passes any further key to that service's own config
(``--set`` style, e.g. ``services.trainer.backend.optim.lr: 1e-3``), where it is validated by the
service itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from tauflow.core.config import DataConfig, ServiceConfig, StrictModel

ROLES = ("queue", "reward", "weights", "trainer", "rollout")
TEACHER = "teacher"  # the optional role of on-policy distillation's teacher (teacher_model): a rollout server
JUDGE = "judge"  # the optional role of an LLM judge (judge_model) that the reward's genrm asks: a rollout server
SCORERS = (TEACHER, JUDGE)  # rollout servers with frozen weights, no data set and no weight sidecar


class EvalConfig(StrictModel):
    dataset: str = Field("", description="held-out prompts (JSONL with prompt and answer); empty: no eval")
    every_steps: int = Field(50, ge=1)
    max_prompts: int = Field(500, ge=1)
    reward_fn: str = ""
    split: str = Field("test", min_length=1, description="the split of a DatasetDict folder (save_to_disk)")


class RayConfig(StrictModel):
    """``launcher: ray``: the cluster, and what each role's actor reserves on it."""

    address: str = Field(
        "auto",
        description="the Ray cluster: auto (RAY_ADDRESS, else the cluster this machine belongs to), its "
        "GCS host:port, or ray://host:port (Ray Client); local starts a single-node Ray in the controller",
    )
    namespace: str = Field("", description="Ray namespace of the run's actors; empty: an anonymous one")
    num_cpus: dict[str, float] = Field(default_factory=dict, description="role -> CPUs its actor reserves (default 1)")
    num_gpus: dict[str, float] = Field(
        default_factory=dict,
        description="role -> GPUs its actor reserves; default 1 for a role set to run on a GPU "
        "(trainer backend.device cuda..., rollout engine_options.device cuda..., weights backend nccl), else 0",
    )


MAX_ROLLOUT_REPLICAS = 256  # ScaleRollout's bound too (controller.v1)
MAX_WORLD_SIZE = 1024


class TrainerRoleConfig(StrictModel):
    """The trainer role's processes: ``world_size`` ranks of one data-parallel trainer (docs/scaling.md)."""

    world_size: int = Field(
        1, ge=1, le=MAX_WORLD_SIZE, description="ranks (processes) of the trainer, joined by torch.distributed"
    )
    strategy: str = Field(
        "fsdp", pattern="^(fsdp|ddp)$", description="fsdp: FSDP2, sharded (the default); ddp: replicated"
    )


class RolloutRoleConfig(StrictModel):
    """The rollout role's processes: ``replicas`` servers, each reserving and generating on its own."""

    replicas: int = Field(
        1, ge=1, le=MAX_ROLLOUT_REPLICAS, description="rollout servers at the start (tauflow scale changes it)"
    )


class ControlConfig(StrictModel):
    """Where ``tauflow run`` serves ControllerService (tauflow scale, set, status reach it there; its
    address is in <out_dir>/controller.ready.json)."""

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0: a free port")


class RunConfig(StrictModel):
    name: str = "run"
    out_dir: str = Field("", description="where logs, checkpoints and the summary go; default runs/<name>")
    launcher: str = Field(
        "local",
        pattern="^(local|ray|external)$",
        description="local: subprocesses on loopback; ray: actors on a Ray cluster (`ray`); external: services "
        "deployed by someone else, at `external`",
    )
    ray: RayConfig = RayConfig()
    external: dict[str, str] = Field(default_factory=dict, description="role -> host:port, for launcher external")
    prepare: list[str] = Field(
        default_factory=list, description="command run once before the services start; {seed} becomes the run's seed"
    )
    model: str = Field(..., description="Hugging Face folder of the initial policy (version 0)")
    teacher_model: str = Field(
        "",
        description="on-policy distillation with the teacher as its own deployment: a Hugging Face folder that "
        "a rollout server of its own (role teacher) serves; the trainer asks it for the log-probs of the "
        "student's tokens (backend.teacher_address). Empty: no teacher server",
    )
    judge_model: str = Field(
        "",
        description="an LLM judge as its own deployment: a Hugging Face folder that a rollout server of its own "
        "(role judge, weights never trained) serves; the reward's genrm asks it (functions.genrm.config.address "
        "is set to it). Empty: no judge",
    )
    dataset: str = Field(
        ..., description="training prompts: JSONL, Parquet, a folder of them, or a save_to_disk folder (docs/data.md)"
    )
    data: DataConfig = Field(
        DataConfig(), description="the data sets' columns and the chat template's use, for training and eval alike"
    )
    max_staleness: int = Field(
        1, ge=-1, description="tau: 0 on-policy, N bounded, -1 unbounded (tauflow set max-staleness changes it)"
    )
    trainer: TrainerRoleConfig = TrainerRoleConfig()
    rollout: RolloutRoleConfig = RolloutRoleConfig()
    control: ControlConfig = ControlConfig()
    steps: int = Field(..., ge=1, description="optimizer steps (policy versions) to train")
    groups_per_step: int = Field(64, ge=1)
    group_size: int = Field(8, ge=1, description="samples per prompt (G)")
    temperature: float = Field(
        1.0, gt=0, description="the sampling temperature; the trainer computes log-probs at the same one"
    )
    seed: int = 0
    reward_fn: str = "exact_match"
    target_accuracy: float | None = Field(
        None, ge=0, le=1, description="held-out accuracy the run must reach, a fraction (0.8 is 80 %)"
    )
    stop_at_target: bool = Field(False, description="end the run at the first evaluation that reaches target_accuracy")
    eval: EvalConfig = EvalConfig()
    resume: bool = Field(
        False,
        description="continue the run in out_dir from its checkpoint and queue log; otherwise they are "
        "moved to checkpoints.prev and queue-wal.prev and the run starts afresh",
    )
    start_timeout_s: float = Field(
        120.0,
        gt=0,
        description="how long a role may take to serve (model loading included; Ray: placement too); a restarted "
        "process that does not serve by then is killed and restarted again",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="restarts in a row before a dying service fails the run (a restarted process that dies or "
        "hangs before it serves is one more)",
    )
    restart_window_s: float = Field(600.0, gt=0, description="uptime after which a service's restart count resets")
    stall_timeout_s: float = Field(
        600.0, gt=0, description="fail the run when the trainer makes no step for this long (a stall, not a slow step)"
    )
    services: dict[str, dict[str, Any]] = Field(default_factory=dict)
    token_file: str = Field(
        "",
        description="the run token's file (tauflow.core.runtoken: control methods need the token): every role's "
        "auth.token_file and what the controller sends. Empty: <out_dir>/run.token, written (0600) by the first run there; "
        "launcher external: the file (a mounted Secret) the deployed roles read too",
    )
    traces_file: str = Field(
        "",
        description="write every service's spans here as JSON lines (relative: under out_dir); empty: off. "
        "`tauflow trace` reads it",
    )

    @property
    def run_dir(self) -> Path:
        """``out_dir``, or ``runs/<name>`` where it is not set."""
        return Path(self.out_dir or f"runs/{self.name}")

    def model_post_init(self, _: Any) -> None:
        for key, by_role, known in (
            ("services", self.services, (*ROLES, *SCORERS)),
            ("external", self.external, ROLES),
            ("ray.num_cpus", self.ray.num_cpus, (*ROLES, *SCORERS)),
            ("ray.num_gpus", self.ray.num_gpus, (*ROLES, *SCORERS)),
        ):
            unknown = set(by_role) - set(known)
            if unknown:
                raise ValueError(f"{key}: unknown role(s) {sorted(unknown)}; roles are {list(known)}")
        missing = [role for role in ROLES if not self.external.get(role)]
        if self.launcher == "external" and missing:
            keys = ", ".join(f"external.{r}" for r in missing)
            raise ValueError(f"launcher external needs every role's address (host:port): set {keys}")
        # One temperature for both sides: log-probs at another temperature than the sampler's make every
        # importance ratio wrong without any error.
        for role, key in (("rollout", "sampling.temperature"), ("trainer", "backend.temperature")):
            value = flatten(self.services.get(role, {})).get(key)
            if value is not None and float(value) != self.temperature:
                raise ValueError(
                    f"services.{role}.{key} is {value} but the run's temperature is {self.temperature}; "
                    "set `temperature` once, at the top level"
                )
        if self.teacher_model:
            if self.launcher == "external":
                raise ValueError(
                    "teacher_model starts a teacher server, and launcher external starts nothing: deploy the "
                    "teacher (a tauflow-rollout of its own) and set services.trainer.backend.teacher_address"
                )
            if flatten(self.services.get("trainer", {})).get("backend.teacher_model_path"):
                raise ValueError(
                    "set one teacher: teacher_model (its own server) or services.trainer.backend.teacher_model_path "
                    "(in the trainer's process)"
                )
        # REMAX's baseline is the reward of a greedy completion that only the rollout can make: without it
        # every group would train nothing.
        trainer = flatten(self.services.get("trainer", {}))
        remax = (
            trainer.get("backend.algorithm") == "remax" or trainer.get("backend.algorithm_options.estimator") == "remax"
        )
        if remax and not flatten(self.services.get("rollout", {})).get("greedy_baseline"):
            raise ValueError(
                "the trainer's algorithm remax needs the rollout's greedy completions: set "
                "services.rollout.greedy_baseline: true"
            )


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: the dotted keys a service's config takes."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class ControllerConfig(ServiceConfig):
    """``tauflow-controller``: the controller as a service, running the run in ``run``."""

    run: RunConfig
