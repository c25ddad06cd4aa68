"""The ``torch`` training backend: the policy model, the reference model, the optimizer, one optimizer
step per batch; its state goes to and comes from the checkpoint store (checkpoint.py).

One `train_step` is one optimizer step and one policy version: the step with index k (the current
version) consumes a batch of groups and turns version k into k + 1. A group is trained at most once: its
id is recorded when a step consumes it, the record is part of every checkpoint, and a group whose id is
already recorded is skipped (a batch made only of such groups commits no step).

With a :class:`~tauflow.trainer.parallel.RankGroup` the backend is one rank of a data-parallel role
(parallel.py): rank 0's backend plans each step and sends every rank its share; the other ranks' backends
run :meth:`TorchBackend.follow`, doing what rank 0 tells them, until it tells them to stop.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from opentelemetry import trace

from tauflow import media
from tauflow.core.limits import MAX_ABS_REWARD
from tauflow.core.staleness import UNBOUNDED, too_stale
from tauflow.models.offload import ParameterOffload
from tauflow.models.processor import ENCODERS, PartsProcessor, freeze_encoders, load_model, media_token_ids
from tauflow.trainer.advantages import Advantage, Scored
from tauflow.trainer.algorithms import Algorithm, get_algorithm
from tauflow.trainer.batch import (
    PADDING_SIDES,
    Group,
    PackedBatch,
    Sample,
    TokenLogProbs,
    completion_logprobs,
    pack,
    split_by_token_budget,
    unpack,
)
from tauflow.trainer.checkpoint import (
    CheckpointInfo,
    read_checkpoint_info,
    read_checkpoint_meta,
    read_trainer_state,
    resolve_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from tauflow.trainer.critic import Critic, critic_source
from tauflow.trainer.losses import LossInputs, Normaliser, add_sums, kl_estimate, sft_loss, summarize, value_loss
from tauflow.trainer.optim import OptimConfig, OptimizerOffload, apply_optim_config, build_optimizer, clip_and_step
from tauflow.trainer.parallel import RankGroup, balance_by_tokens
from tauflow.trainer.ports import TeacherPort

if TYPE_CHECKING:  # transformers is imported where a model is loaded
    from transformers import PreTrainedModel

tracer = trace.get_tracer("tauflow.trainer")

log = logging.getLogger(__name__)

# What the other ranks run without their offloaded weights back (release_memory): the rest wakes them first.
NO_WAKE_COMMANDS = ("keepalive", "stop", "release")


@dataclass(frozen=True)
class TorchBackendConfig:
    model_path: str
    """A local Hugging Face model folder (``from_pretrained``): the initial policy, version 0."""
    teacher_model_path: str | None = None
    """On-policy distillation (estimator opd): the teacher, a local Hugging Face folder with the policy's
    tokenizer, run in this process (frozen) to score the samples' tokens."""
    teacher_address: str | None = None
    """On-policy distillation with the teacher as its own deployment: a rollout server hosting it (host:port),
    asked for the log-probs of the sampled tokens (ComputeLogprobs). One of this and teacher_model_path;
    opd_loss advantage only (the full reverse KL needs the teacher's distributions in this process)."""
    ref_model_path: str | None = None
    """Reference model for the KL penalty; None: ``model_path`` (the initial policy). Loaded only when the
    algorithm has kl_coef > 0."""
    critic_model_path: str | None = None
    """PPO with GAE (estimator gae): the folder the critic starts from, a causal LM (its backbone gets a new
    value head) or a critic a checkpoint saved; None: ``model_path``. Resuming, the checkpoint's critic."""
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The critic's optimizer and schedule (verl's critic lr: 1e-5)."""
    algorithm: str = "grpo"
    algorithm_options: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of the algorithm's config (see algorithms.AlgorithmConfig)."""
    response_tokens: int | None = None
    """The rollout's generation budget (its ``sampling.max_new_tokens``; ``tauflow run`` sets it): Dr. GRPO's
    constant L of seq-mean-token-sum-norm where ``algorithm_options`` sets no ``loss_scale_factor``. None: L is
    the update's longest completion."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_tokens: int = 8192
    """Gradient accumulation: each forward/backward holds at most this many padded tokens."""
    temperature: float = 1.0
    """The sampler's temperature; log-probs are computed from logits / temperature."""
    padding_side: str = "right"
    pad_token_id: int | None = None
    """None: the model config's pad_token_id, else 0 (padded positions are masked either way)."""
    device: str = "cpu"
    autocast_dtype: Literal["bfloat16", "float16"] | None = None
    """Mixed precision: the forward and backward under torch.autocast in this dtype, the weights and the
    optimizer's state float32 (master weights). bfloat16 on GPUs that have it; float16 adds a dynamic loss
    scale (torch.amp.GradScaler). None (fp32) is the default, and what CPUs want."""
    gradient_checkpointing: bool = False
    logits_chunk_tokens: int = 0
    """Compute the output layer's logits this many target positions at a time, never a micro-batch's whole
    ``[tokens, vocabulary]`` (float32 several times over: 0.6 MB a token each for a 150k vocabulary): each
    chunk's log-probs and entropy are kept, its logits computed again in the backward (the output layer's
    matmul once more). The same values and gradients; 0 (the default): the whole logits at once. Distillation
    by the full KL needs them whole (docs/gpu.md, "Memory")."""
    max_sample_tokens: int | None = None
    """The longest sample (prompt and completion) a step takes; a group holding a longer one is skipped and
    counted (``skipped_invalid_groups``): one sample of millions of tokens needs attention memory in its
    square. None (the default): the model's ``max_position_embeddings``, times its ``rope_scaling`` factor
    where it has one (YaRN and linear scaling extend the context); 0: no bound (a RoPE model trained past
    its context on purpose)."""
    compute_entropy: bool = True
    train_encoders: bool = False
    """A multimodal policy: train its vision and audio encoders too; False (the default, as verl's and
    slime's VLM recipes): the language model only, the encoders frozen (their weights still published)."""
    keep_checkpoints: int = 3
    """How many checkpoints save_checkpoint keeps in its directory (0: all)."""
    checkpoint_checksums: bool = True
    """Record each checkpoint file's sha256, checked before a resume loads it (a flipped byte is refused, naming
    the file). Costs reading the checkpoint back once at each save and each resume (about 1 GB/s a core);
    False records only the files' sizes."""
    seed: int = 0
    kind: Literal["torch", "megatron"] = "torch"
    """torch: the Hugging Face model in plain PyTorch (data parallel: FSDP2 or DDP); megatron: megatron-core's
    GPTModel (a Qwen2/Llama-style model; CUDA; the megatron extra; docs/gpu.md)."""
    tensor_parallel: int = 1
    """megatron: tensor-parallel size; with ``pipeline_parallel`` it divides the trainer role's world size (its
    ranks are data-parallel replicas of tensor_parallel x pipeline_parallel ranks each)."""
    pipeline_parallel: int = 1
    """megatron: pipeline stages (consecutive layers each; it divides the layer count), working on a window of
    micro-batches at once (docs/gpu.md)."""
    pipeline_micro_batches_in_flight: int = 0
    """megatron with pipeline_parallel > 1: how many micro-batches a stage runs forward before their backwards
    (GPipe within each window; every stage holds their activations, the last stage their float32 logits too):
    0 means pipeline_parallel, 1 the stages taking turns (the least memory, one stage at work at a time)."""
    offload_optimizer: bool = False
    """Colocated mode (docs/gpu.md): keep the policy optimizer's state in pinned host memory between updates,
    so the engine on the same GPU can use that memory while the trainer waits for its batch (copied back
    before each update). With several ranks each keeps its own part (FSDP2: its shard). On a CPU it saves
    nothing (the host is the device) and behaves the same."""
    offload_model: bool = False
    """Colocated mode (docs/gpu.md): between steps, while the trainer waits for its batch, its models' weights
    (the policy's float32 master weights, the reference's, a teacher's and a critic's in this process) wait in
    host memory, so the engine on the same GPU can use that memory; they come back at the trainer's next
    command (a step, a publish, a checkpoint). With several ranks every rank offloads its own (FSDP2: its
    shard). kind torch. On a CPU it saves nothing (the host is the device) and behaves the same."""

    def __post_init__(self) -> None:
        if self.padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be one of {PADDING_SIDES}, not {self.padding_side!r}")
        if self.kind not in ("torch", "megatron"):
            raise ValueError(f"kind must be torch or megatron, not {self.kind!r}")
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError("tensor_parallel and pipeline_parallel must be at least 1")
        if self.kind == "torch" and (self.tensor_parallel, self.pipeline_parallel) != (1, 1):
            raise ValueError("tensor_parallel and pipeline_parallel need kind: megatron")
        if self.max_sample_tokens is not None and self.max_sample_tokens < 0:
            raise ValueError("max_sample_tokens must be at least 0 (0: no bound; unset: the model's context)")
        if self.pipeline_micro_batches_in_flight < 0:
            raise ValueError("pipeline_micro_batches_in_flight must be at least 0 (0: pipeline_parallel)")
        if self.pipeline_micro_batches_in_flight and self.pipeline_parallel == 1:
            raise ValueError("pipeline_micro_batches_in_flight needs pipeline_parallel > 1 (kind: megatron)")
        if self.logits_chunk_tokens < 0:
            raise ValueError("logits_chunk_tokens must be at least 0 (0: the whole logits at once)")
        if self.offload_model and self.kind != "torch":
            raise ValueError("offload_model needs kind: torch")
        if self.micro_batch_tokens <= 0 or self.temperature <= 0 or self.keep_checkpoints < 0:
            raise ValueError("need micro_batch_tokens > 0, temperature > 0 and keep_checkpoints >= 0")
        if self.response_tokens is not None and self.response_tokens < 1:
            raise ValueError("response_tokens must be at least 1 (or None)")
        # The algorithm and its options, checked when the config loads (not at the first step).
        try:
            algorithm = self.chosen_algorithm()
        except TypeError as e:  # an option AlgorithmConfig does not have
            raise ValueError(f"algorithm_options: {e}") from None
        except KeyError as e:
            raise ValueError(str(e).strip("'\"")) from None
        if self.teacher_model_path and self.teacher_address:
            raise ValueError("set one teacher: teacher_model_path (in this process) or teacher_address (a server)")
        if algorithm.config.estimator == "opd" and not (self.teacher_model_path or self.teacher_address):
            raise ValueError("on-policy distillation (estimator opd) needs teacher_model_path or teacher_address")
        if algorithm.config.distills_full_kl and not self.teacher_model_path:
            raise ValueError(
                "opd_loss reverse_kl needs the teacher's whole distributions in this process: set "
                "teacher_model_path (a teacher_address serves the sampled tokens' log-probs: opd_loss advantage)"
            )

    def chosen_algorithm(self) -> Algorithm:
        """The preset ``algorithm`` with ``algorithm_options`` over it (and ``response_tokens`` as L)."""
        options = dict(self.algorithm_options)
        if self.response_tokens is not None:
            options.setdefault("loss_scale_factor", float(self.response_tokens))
        return get_algorithm(self.algorithm, **options)


@dataclass
class StepResult:
    """What one call of train_step / sft_step did (the fields of trainer.v1.StepMetrics, and more)."""

    step: int
    """Index k of the step: the policy version it started from."""
    policy_version: int
    """The version after the step: k + 1 when committed, k otherwise."""
    committed: bool
    """False when the batch held only already-trained groups: no optimizer step, no new version."""
    groups: int = 0
    """Groups consumed by the step (zero-advantage groups included)."""
    samples: int = 0
    trained_tokens: int = 0
    max_staleness: int = 0
    mean_staleness: float = 0.0
    mean_reward: float = 0.0
    loss: float = 0.0
    duration_s: float = 0.0
    committed_at: float | None = None
    """Wall-clock time (epoch seconds) the step was committed, set by the service loop."""
    metrics: dict[str, float] = field(default_factory=dict)
    """clip_fraction, is_weight_mean, is_truncated_fraction, kl_behaviour, kl_ref, entropy, grad_norm, lr,
    skipped_* counts, ..."""
    trained_group_ids: list[str] = field(default_factory=list)
    skipped_duplicate_group_ids: list[str] = field(default_factory=list)
    skipped_stale_group_ids: list[str] = field(default_factory=list)


@dataclass
class MiniBatch:
    """One optimizer update's samples, their advantages and the normaliser of the whole mini-batch; with a
    critic, each sample's per-token returns and values before the step."""

    samples: list[Sample]
    advantages: list[Advantage]
    norm: Normaliser
    returns: list[list[float]] | None = None
    old_values: list[list[float]] | None = None

    def subset(self, index: Sequence[int]) -> MiniBatch:
        """The samples at ``index`` (a rank's share) with the whole mini-batch's normaliser."""

        def pick(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[i] for i in index]

        return MiniBatch(
            [self.samples[i] for i in index],
            [self.advantages[i] for i in index],
            self.norm,
            pick(self.returns),
            pick(self.old_values),
        )


@dataclass
class StepPlan:
    """What a step trains, decided before any forward: the same on every rank."""

    fresh: list[Group]
    """The groups the step consumes (not trained before, not too stale)."""
    duplicates: list[str]
    stale: list[str]
    invalid_media: list[str] = field(default_factory=list)
    """Groups whose prompt parts this model cannot take (not trained, not recorded; the log says why)."""
    invalid: list[str] = field(default_factory=list)
    """Groups no model could train (a token id outside the vocabulary, a reward out of bounds): likewise."""
    samples: list[Sample] = field(default_factory=list)
    """The samples that run a forward and backward: at least one trained token, not a skipped zero group's."""
    advantages: list[Advantage] = field(default_factory=list)
    returns: list[list[float]] | None = None
    """With a critic: each trained sample's per-token returns (the value loss's targets) ..."""
    old_values: list[list[float]] | None = None
    """... and the critic's values before the step."""
    mini_batches: list[MiniBatch] = field(default_factory=list)
    """The step's samples in ``mini_batches`` parts (in order, sizes differing by one at most)."""
    skipped_zero: int = 0
    rejected: int = 0
    masked_truncated: int = 0
    """Samples dropped by the rejection bounds on their importance weight."""
    kl_reward: float = 0.0
    """Σ of the per-token KL put in the reward, over the trained tokens ..."""
    kl_reward_tokens: int = 0
    """... and how many tokens that is."""
    teacher_gap: float = 0.0
    """Σ of log π_teacher − log π_prox over the trained tokens (on-policy distillation) ..."""
    teacher_tokens: int = 0
    no_baseline: int = 0
    """remax: groups that came without the greedy completion's reward (they train nothing)."""

    @property
    def trained_tokens(self) -> int:
        return sum(s.trained_tokens for s in self.samples)

    @property
    def skipped_groups_metric(self) -> dict[str, float]:
        return {
            **({"skipped_invalid_media_groups": float(len(self.invalid_media))} if self.invalid_media else {}),
            **({"skipped_invalid_groups": float(len(self.invalid))} if self.invalid else {}),
        }


class TorchBackend:
    """Holds the policy (and reference) model and its optimizer; trains on groups; checkpoints.

    ``TorchBackend(config)`` starts from ``config.model_path`` at version 0;
    ``TorchBackend(config, checkpoint=path)`` resumes from a checkpoint written by `save_checkpoint`.
    With ``group`` it is one rank of a data-parallel role: every rank starts from rank 0's weights (rank 0
    alone reads ``checkpoint``; the others ignore theirs and get its state from rank 0), and the model is
    sharded (FSDP2) or wrapped (DDP) before the optimizer is built.
    """

    def __init__(
        self,
        config: TorchBackendConfig,
        *,
        checkpoint: str | Path | None = None,
        group: RankGroup | None = None,
        teacher: TeacherPort | None = None,
        media_limits: media.MediaLimits | None = None,
    ) -> None:
        self.config = config
        self.group = group
        self.algorithm: Algorithm = config.chosen_algorithm()
        self.device = torch.device(config.device)
        if group is not None and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", group.config.device_index)
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.version = 0
        self.trained_group_ids: set[str] = set()
        self.ref_model: torch.nn.Module | None = None
        self.teacher_model: torch.nn.Module | None = None
        self.teacher = teacher
        """A teacher served by another deployment (teacher_address): rank 0 asks it; None: in this process."""
        self.critic: Critic | None = None
        checkpoint_meta: dict[str, Any] | None = None
        if group is not None and not group.leads:
            checkpoint = None  # rank 0 reads it and shares what it holds: no other rank touches the checkpoints
        elif checkpoint is not None:
            checkpoint = resolve_checkpoint(checkpoint)
            checkpoint_meta = read_checkpoint_meta(checkpoint)  # every file whole (size, sha256) before any is loaded
        self._weights_source = checkpoint if checkpoint is not None else Path(config.model_path)
        self.model = self._load_policy(self._weights_source)
        # a multimodal policy's processor (None: a text model), from the model folder: the rollout runs the same
        self.processor = PartsProcessor.from_pretrained(config.model_path, media_limits)
        # the media tokens the rollout never samples: scored with the same mask
        self.banned_ids = media_token_ids(self.model.config) if self.processor is not None else []
        # What forward runs on: the model itself, sharded in place by FSDP2, or DDP's wrapper of it.
        self._forward_model = self._join_ranks() if group is not None else self.model
        self.pad_token_id = (
            config.pad_token_id
            if config.pad_token_id is not None
            else (getattr(self.model.config, "pad_token_id", None) or 0)
        )
        self._model_offload: ParameterOffload | None = None  # built at the first release_memory
        self._build_optimizer()
        # fp16's dynamic loss scale (bfloat16 has float32's range and needs none); it starts afresh on resume
        fp16 = config.autocast_dtype == "float16"
        self._scaler = torch.amp.GradScaler(self.device.type) if fp16 else None
        self._stand_in_zeros = False  # the update under way ran no backward: zeros stand in (set in _train)
        if fp16 and self.algorithm.config.uses_critic:
            raise ValueError("autocast_dtype float16 with a critic is not supported: use bfloat16")
        if self.processor is not None and self.algorithm.config.uses_critic:
            raise ValueError("a critic for a multimodal policy is not supported yet (docs/omni.md)")
        if self.algorithm.config.uses_reference:
            self._ensure_reference()
        if self.algorithm.config.uses_critic:
            self._ensure_critic(checkpoint)
        resuming = checkpoint is not None if group is None else group.agree(checkpoint is not None)
        if resuming:
            self._restore_state(checkpoint, checkpoint_meta)
        # Rank 0 sends one command at a time: a step, a publish and a checkpoint come from different threads.
        self._commands = threading.Lock()
        self._last_command = time.monotonic()

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else self.group.world_size

    # -- how the ranks share the work: data parallelism here (the megatron backend's tensor-parallel ranks
    # -- override these)

    @property
    def data_parallel_size(self) -> int:
        """How many ranks each train their own share of a batch: all of them (FSDP2 or DDP)."""
        return self.world_size

    def _shares(self, lengths: Sequence[int]) -> list[list[int]]:
        """The samples (indices into ``lengths``) each rank takes: a share each, balanced by tokens."""
        return balance_by_tokens(lengths, self.world_size)

    def _totals_to_add(self, totals: dict[str, float]) -> dict[str, float]:
        """What this rank adds to the step's totals over the ranks: its own (its share's)."""
        return totals

    def _join_ranks(self) -> torch.nn.Module:
        """The loaded policy becomes rank 0's on every rank, then is sharded (FSDP2) or wrapped (DDP); what
        forward runs on."""
        assert self.group is not None
        self.group.overwrite_with_leaders(self.model.state_dict().values())  # before it is sharded or wrapped
        return self.group.wrap(self.model)

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights by name on rank 0 (the others get {}): a collective every rank runs."""
        assert self.group is not None
        return self.group.full_state_dict(self.model)

    @property
    def _publish_gathers(self) -> bool:
        """Whether a publish gathers the weights from every rank (FSDP2: each holds a shard), or rank 0 has
        them (:meth:`_own_state_dict`)."""
        return self.group is not None and self.group.strategy == "fsdp"

    def _own_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights by their Hugging Face names as this process holds them."""
        return self.model.state_dict()

    def _full_optimizer_state(self) -> dict[str, Any]:
        """The policy optimizer's state as one process keys it, on rank 0: a collective every rank runs."""
        assert self.group is not None
        return self.group.full_optimizer_state(self.model, self.optimizer)

    def _load_optimizer_state(self, state: Mapping[str, Any]) -> None:
        """A state :meth:`_full_optimizer_state` (or one process) wrote, loaded on every rank."""
        assert self.group is not None
        self.group.load_optimizer_state(self.model, self.optimizer, state)

    def _clip_and_step(self) -> dict[str, float]:
        return clip_and_step(
            self.model, self.optimizer, self.config.optim.grad_clip, self._scaler, scaled=not self._stand_in_zeros
        )

    def release_memory(self) -> int:
        """The trainer's turn is over (colocated mode): with ``offload_model``, the weights of every model this
        process holds go to host memory until its next command brings them back; with several ranks, every
        rank's, and this returns once all have moved theirs (the engine's turn starts then). The bytes moved,
        every rank's together (0 without offload_model). A rank that could not move its weights (no pinned host
        memory left) keeps them and raises (rank 0, once every rank is done: the ranks stay in step). The
        caller keeps it from running beside a step or a checkpoint (the loop's lock)."""
        if not self.config.offload_model:
            return 0
        if self.group is None:
            with self._one_command():
                return self._offload_models()
        with self._command("release"):
            results = self.group.gather(self._offload_models_or_error()) or []
        failed = [f"rank {rank}: {error}" for rank, (_, error) in enumerate(results) if error]
        if failed:
            raise RuntimeError(f"could not offload every rank's weights ({'; '.join(failed)})")
        return sum(moved for moved, _ in results)

    def _offload_models(self) -> int:
        """This rank's models to host memory (release_memory); the bytes moved."""
        modules = [self.model, self.ref_model, self.teacher_model, self.critic.model if self.critic else None]
        present = [m for m in modules if m is not None]
        if self.group is not None and self.group.strategy == "fsdp":
            for model in present:  # (else a root left gathered after a forward would stay, and be offloaded
                self.group.reshard(model)  # in place of its shards)
        offload = self._model_offload
        if offload is None or offload.modules != present:  # (first time, or a model loaded since)
            if offload is not None:
                offload.to_device()  # (a no-op: every command wakes them)
            offload = self._model_offload = ParameterOffload(present)
        return offload.to_host()

    def _offload_models_or_error(self) -> tuple[int, str | None]:
        """:meth:`_offload_models` on a rank of several: a failure is reported, not raised, so that every rank
        still takes part in the gather after it."""
        try:
            return self._offload_models(), None
        except (RuntimeError, OSError) as e:  # e.g. no pinned host memory left: what moved comes back at wake
            return 0, f"{type(e).__name__}: {e}"

    @contextlib.contextmanager
    def _one_command(self) -> Iterator[None]:
        """Rank 0: nothing else runs on the models meanwhile (the commands come one at a time), on this rank's
        device."""
        with self._commands:
            self._use_device()
            yield

    def _use_device(self) -> None:
        """CUDA's current device is a thread's: the commands come from other threads than the one that built
        the backend (the loop's ``asyncio.to_thread``, the other ranks' ``follow`` thread), so each sets it to
        this rank's (megatron-core and some collectives allocate on the current device)."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def _wake(self) -> None:
        """Before the models run or are read: what release_memory moved to host memory comes back."""
        if self._model_offload is not None:
            self._model_offload.to_device()

    # ---------------------------------------------------------------------------------------------
    # Models and optimizer

    def _load_policy(self, path: Path) -> PreTrainedModel:
        model = load_model(path)
        model.to(device=self.device, dtype=torch.float32)
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if not self.config.train_encoders:
            freeze_encoders(model)
        model.train()
        return model

    def _load_frozen(self, path: str) -> torch.nn.Module:
        """A model that only runs forward in this process (the reference, the teacher): frozen, in eval mode,
        sharded like the policy under FSDP2."""
        model = load_model(path)
        model.to(device=self.device, dtype=torch.float32)
        model.eval()
        model.requires_grad_(False)
        return self.group.frozen(model) if self.group is not None else model

    def _ensure_reference(self) -> torch.nn.Module:
        if self.ref_model is None:
            self.ref_model = self._load_frozen(self.config.ref_model_path or self.config.model_path)
        return self.ref_model

    def _ensure_teacher(self) -> torch.nn.Module:
        if self.teacher_model is None:
            if not self.config.teacher_model_path:
                raise ValueError("on-policy distillation (estimator opd) needs backend.teacher_model_path")
            self.teacher_model = self._load_frozen(self.config.teacher_model_path)
        return self.teacher_model

    @property
    def _shared_vocab(self) -> int:
        """The rows of the vocabulary the policy and the teacher share: models of one tokenizer often pad
        their embeddings to different sizes (Qwen2.5-0.5B: 151,936 rows, 7B: 152,064); the full KL compares
        the distributions over the rows both have (the padding rows are never sampled)."""
        teacher = self._ensure_teacher()
        teacher_config: Any = teacher.config  # (a transformers model's, behind torch.nn.Module's typing)
        return min(int(self.model.config.vocab_size), int(teacher_config.vocab_size))

    def _ensure_critic(self, checkpoint: Path | None = None) -> Critic:
        """The critic (PPO with GAE): from ``checkpoint``'s critic when it has one, else from
        critic_model_path or the policy's folder. With several ranks every rank builds it at once (rank 0's
        weights reach the others), as the first command that needs it comes to all of them."""
        if self.critic is None:
            source = critic_source(checkpoint, self.config.critic_model_path, self.config.model_path)
            self.critic = Critic(
                source,
                device=self.device,
                optim=self.config.critic_optim,
                group=self.group,
                gradient_checkpointing=self.config.gradient_checkpointing,
                seed=self.config.seed,
            )
        return self.critic

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=getattr(torch, self.config.autocast_dtype))

    def _build_optimizer(self) -> None:
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), self.config.optim)
        self._offload = OptimizerOffload(self.optimizer) if self.config.offload_optimizer else None

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    def _update(self) -> dict[str, float]:
        """Clip, step the policy's optimizer, clear the gradients (optim.clip_and_step); with offload_optimizer,
        its state is on the GPU for the update only."""
        if self._offload is None:
            return self._clip_and_step()
        self._offload.to_device()
        try:
            return self._clip_and_step()
        finally:
            self._offload.to_host()  # (after a failed update too: the engine's memory is not held hostage)

    def _zero_gradient_without_backward(self) -> bool:
        """An RL update whose every sample is a skipped zero-advantage group ran no backward (on any rank: every
        rank runs one when any has a sample). Its gradient is zero, and the formula's update (verl's, which runs
        the backward) still moves AdamW's momentum and weight decay and counts a step: zeros stand in, so that
        skipping changes no weight. (Before, AdamW left every weight without a gradient alone.) The language
        model's weights only: a multimodal policy's encoders (frozen, or with train_encoders reached only by
        the backward of a batch with media) are left alone. True when the zeros stand in: fp16's loss scale
        neither unscales them nor learns from them."""
        if any(p.grad is not None for p in self.model.parameters()):
            return False
        if self.group is not None and self.group.strategy == "fsdp":
            self.group.reshard(self.model)  # (its root stays gathered after a forward without backward)
        for name, p in self.model.named_parameters():
            if p.requires_grad and not any(part in ENCODERS for part in name.split(".")):
                p.grad = torch.zeros_like(p)
        return True

    def _backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the loss times fp16's loss scale when there is one."""
        (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def _optimizer_step(self) -> dict[str, float]:
        """One update, then the schedule's step (a step of one update: SFT)."""
        lr = self.lr
        out = self._update()
        self.scheduler.step()
        return {**out, "lr": lr}

    # ---------------------------------------------------------------------------------------------
    # Steps

    def train_step(
        self,
        groups: Sequence[Group],
        algorithm: Algorithm | None = None,
        *,
        max_staleness: int = UNBOUNDED,
    ) -> StepResult:
        """One optimizer step on a batch of groups (one policy version).

        Groups already trained (by id, in this run or before the checkpoint it resumed from) are skipped;
        when every group is, nothing is committed. With a bounded ``max_staleness`` (τ), groups too stale
        for this step (tauflow.core.staleness.too_stale) are dropped, not trained and not recorded. The step
        commits (version + 1) whenever it consumed at least one group, even if no token had a gradient
        (all groups zero-advantage): one batch, one version, as the queue's pacing counts it. With several
        ranks, this is rank 0's call: it sends each rank its share of the samples, balanced by tokens.
        """
        started = time.monotonic()
        alg = algorithm or self.algorithm
        step = self.version
        plan = self._plan(groups, alg, max_staleness)
        if not plan.fresh:
            return StepResult(
                step=step,
                policy_version=self.version,
                committed=False,
                duration_s=time.monotonic() - started,
                metrics={
                    "skipped_duplicate_groups": float(len(plan.duplicates)),
                    "skipped_stale_groups": float(len(plan.stale)),
                    **plan.skipped_groups_metric,
                },
                skipped_duplicate_group_ids=plan.duplicates,
                skipped_stale_group_ids=plan.stale,
            )
        with self._command("train", alg):
            mine = plan.mini_batches
            if self.group is not None:
                # Each rank gets its share of every mini-batch, balanced by tokens within the mini-batch.
                per_rank: list[list[MiniBatch]] = [[] for _ in range(self.group.world_size)]
                for mb in plan.mini_batches:
                    for rank, share in enumerate(self._shares([len(s) for s in mb.samples])):
                        per_rank[rank].append(mb.subset(share))
                mine = self.group.scatter(per_rank)
            metrics = self._train(alg, mine)
        self.version += 1
        self.trained_group_ids.update(g.group_id for g in plan.fresh)

        all_samples = [s for g in plan.fresh for s in g.samples]
        staleness = [g.staleness(step) for g in plan.fresh]
        metrics.update(
            {
                "skipped_zero_advantage_groups": float(plan.skipped_zero),
                **({"no_baseline_groups": float(plan.no_baseline)} if alg.config.estimator == "remax" else {}),
                "rejected_samples": float(plan.rejected),
                "masked_truncated_samples": float(plan.masked_truncated),
                **({"kl_reward": plan.kl_reward / plan.kl_reward_tokens} if plan.kl_reward_tokens else {}),
                # the sampled reverse KL to the teacher, per trained token: what distillation drives down
                **({"kl_teacher": -plan.teacher_gap / plan.teacher_tokens} if plan.teacher_tokens else {}),
                "skipped_duplicate_groups": float(len(plan.duplicates)),
                "skipped_stale_groups": float(len(plan.stale)),
                **plan.skipped_groups_metric,
            }
        )
        return StepResult(
            step=step,
            policy_version=self.version,
            committed=True,
            groups=len(plan.fresh),
            samples=len(all_samples),
            trained_tokens=plan.trained_tokens,
            max_staleness=max(staleness),
            mean_staleness=sum(staleness) / len(staleness),
            mean_reward=sum(s.reward for s in all_samples) / len(all_samples),
            loss=metrics.get("loss", 0.0),
            duration_s=time.monotonic() - started,
            metrics=metrics,
            trained_group_ids=[g.group_id for g in plan.fresh],
            skipped_duplicate_group_ids=plan.duplicates,
            skipped_stale_group_ids=plan.stale,
        )

    def _plan(self, groups: Sequence[Group], alg: Algorithm, max_staleness: int) -> StepPlan:
        """Which groups the step consumes, their advantages, the samples that train and the normaliser of
        the whole batch."""
        cfg = alg.config
        step = self.version
        fresh: list[Group] = []
        duplicates: list[str] = []
        seen: set[str] = set()
        for g in groups:
            if g.group_id in self.trained_group_ids or g.group_id in seen:
                duplicates.append(g.group_id)
            else:
                seen.add(g.group_id)
                fresh.append(g)
        stale = [g.group_id for g in fresh if too_stale(step, g.oldest_version, max_staleness)]
        fresh = [g for g in fresh if not too_stale(step, g.oldest_version, max_staleness)]
        unfit = self._unfit(fresh)
        fresh = [g for g in fresh if g.group_id not in unfit]
        invalid = self._attach_media(fresh)
        fresh = [g for g in fresh if g.group_id not in invalid]
        plan = StepPlan(fresh, duplicates, stale, list(invalid), list(unfit))
        if not fresh:
            return plan
        forwarded: dict[int, dict[str, list[float]]] = {}
        if cfg.needs_forward_before_advantages:
            pool = [s for g in fresh for s in g.samples if s.trained_tokens > 0]
            forwarded = {id(s): f for s, f in zip(pool, self._forward_before_advantages(pool, alg), strict=True)}

        def scored(s: Sample, baseline: float | None) -> Scored:
            f = forwarded.get(id(s))
            values = f["values"] if f is not None and cfg.uses_critic else None
            if f is None or (cfg.kl_reward_coef <= 0 and not cfg.teacher_scores_samples):
                return Scored(s.reward, s.mask, values=values, baseline=baseline)
            mask = torch.tensor(s.mask, dtype=torch.bool)
            prox = torch.tensor(f["prox"])
            token_rewards = torch.zeros_like(prox)
            if cfg.kl_reward_coef > 0:
                kl = kl_estimate(prox, torch.tensor(f["ref"]), cfg.kl_reward_estimator, cfg.kl_clamp)
                kl = torch.where(mask, kl, torch.zeros_like(kl))
                plan.kl_reward += float(kl.sum())
                plan.kl_reward_tokens += s.trained_tokens
                token_rewards -= cfg.kl_reward_coef * kl
            if cfg.teacher_scores_samples:
                # the per-token reward of on-policy distillation: −(log π_prox − log π_teacher), the negative
                # of the sampled reverse KL to the teacher
                gap = torch.where(mask, torch.tensor(f["teacher"]) - prox, torch.zeros_like(prox))
                plan.teacher_gap += float(gap.sum())
                plan.teacher_tokens += s.trained_tokens
                token_rewards += gap
            return Scored(s.reward, s.mask, token_rewards.tolist(), values, baseline)

        # A sample with no trained token has no value forwarded (nothing of it trains): zeros stand in.
        advantages = alg.advantages(
            [
                [
                    scored(s, g.baseline_reward)
                    if s.trained_tokens > 0 or not cfg.uses_critic
                    else Scored(s.reward, s.mask, values=[0.0] * len(s.mask))
                    for s in g.samples
                ]
                for g in fresh
            ]
        )
        if cfg.estimator == "remax":
            plan.no_baseline = sum(g.baseline_reward is None for g in fresh)
        if cfg.uses_critic:
            plan.returns, plan.old_values = [], []
        # A zero group's samples have no policy-gradient term, but they count in the mini-batches and their
        # denominators (tokens, sequences, the longest) as in the published formulas and verl: leaving them
        # out scaled every other token's gradient by all tokens / those kept (GPG's α then applied twice).
        # Where their loss is nothing else either (no KL, no entropy, no distillation) they run no forward.
        skip_zero = cfg.skip_zero_advantage_groups and not (
            cfg.distills_full_kl or cfg.kl_coef > 0 or cfg.entropy_coef != 0
        )
        counted: list[tuple[Sample, bool]] = []  # every sample in the denominators; whether it trains
        for gi, (g, adv, zero) in enumerate(zip(fresh, advantages.values, advantages.zero_groups, strict=True)):
            skipped = zero and skip_zero
            plan.skipped_zero += skipped
            for si, (s, a) in enumerate(zip(g.samples, adv, strict=True)):
                if s.trained_tokens == 0:
                    continue
                if cfg.mask_truncated and s.truncated:
                    plan.masked_truncated += 1  # counted in the group's baseline above; trains nothing
                    continue
                if cfg.rejects and _rejected(forwarded[id(s)]["prox"], s, cfg):
                    plan.rejected += 1  # the group's baseline still counted it; it trains nothing
                    continue
                counted.append((s, not skipped))
                if skipped:
                    continue
                plan.samples.append(s)
                plan.advantages.append(a)
                if plan.returns is not None and plan.old_values is not None and advantages.returns is not None:
                    plan.returns.append(advantages.returns[gi][si])
                    plan.old_values.append(forwarded[id(s)]["values"])
        consumed = sum(len(g.samples) for g in fresh)
        parts = max(1, min(cfg.mini_batches, len(counted)))
        bounds = [len(counted) * j // parts for j in range(parts + 1)]
        trained = 0  # plan.samples' index of the part's first trained sample
        for lo, hi in itertools.pairwise(bounds):
            part = [s for s, _ in counted[lo:hi]]
            n = sum(trains for _, trains in counted[lo:hi])
            norm = Normaliser(
                tokens=float(sum(s.trained_tokens for s in part)),
                sequences=float(len(part)),
                # sample-sum: the step's consumed samples, shared out among its mini-batches by their samples
                samples=consumed * len(part) / len(counted) if counted else float(consumed),
                longest=float(max((len(s.completion_ids) for s in part), default=0)),
            )
            plan.mini_batches.append(
                MiniBatch(
                    plan.samples[trained : trained + n],
                    plan.advantages[trained : trained + n],
                    norm,
                    plan.returns[trained : trained + n] if plan.returns is not None else None,
                    plan.old_values[trained : trained + n] if plan.old_values is not None else None,
                )
            )
            trained += n
        return plan

    @functools.cached_property
    def _vocab_rows(self) -> int:
        """The token ids the policy's embedding has rows for (a multimodal model's text vocabulary)."""
        return int(self._text_config("vocab_size"))

    @functools.cached_property
    def _max_positions(self) -> int | None:
        """The longest sample a step takes (``max_sample_tokens``, else the model's context); None: no bound."""
        if self.config.max_sample_tokens is not None:
            return self.config.max_sample_tokens or None
        positions = self._text_config("max_position_embeddings")
        if not positions:
            return None
        scaling = self._text_config("rope_scaling")
        factor = scaling.get("factor") if isinstance(scaling, dict) else None
        return int(positions * factor) if isinstance(factor, (int, float)) and factor > 1 else int(positions)

    def _text_config(self, key: str) -> Any:
        config: Any = self.model.config
        text = getattr(config, "text_config", None)
        return getattr(text, key, None) or getattr(config, key, None)

    def _unfit(self, groups: Sequence[Group]) -> dict[str, str]:
        """Groups no step can train, with why: a sample longer than the model's max_position_embeddings, a
        token id outside [0, vocabulary) (the embedding's lookup raised, and ended the trainer: each restart
        was handed the group again), a reward beyond
        ``MAX_ABS_REWARD`` (its square overflowed, and the step's loss and every other group's update were NaN).
        They are skipped and logged; the step consumes them (their leases are acked)."""
        unfit: dict[str, str] = {}
        rows, positions = self._vocab_rows, self._max_positions
        for g in groups:
            for s in g.samples:
                if positions is not None and len(s) > positions:  # (one sample of millions of tokens: O(n²)
                    # attention memory, one lookup past a learned position table)
                    unfit[g.group_id] = f"sample {s.sample_id!r}: {len(s)} tokens, over max_sample_tokens {positions}"
                    break
                for what, ids in (("prompt", s.prompt_ids), ("completion", s.completion_ids)):
                    if ids and (min(ids) < 0 or max(ids) >= rows):
                        unfit[g.group_id] = f"sample {s.sample_id!r}: a {what} token id outside [0, {rows})"
                        break
                if g.group_id in unfit:
                    break
                if not abs(s.reward) <= MAX_ABS_REWARD:
                    unfit[g.group_id] = f"sample {s.sample_id!r}: reward {s.reward!r} beyond ±{MAX_ABS_REWARD:g}"
                    break
            if (
                g.group_id not in unfit
                and g.baseline_reward is not None
                and not abs(g.baseline_reward) <= MAX_ABS_REWARD
            ):
                unfit[g.group_id] = f"baseline_reward {g.baseline_reward!r} beyond ±{MAX_ABS_REWARD:g}"
        for group_id, why in unfit.items():
            log.warning("group skipped: %s", why, extra={"group_id": group_id[:200]})
        return unfit

    def _attach_media(self, groups: Sequence[Group]) -> dict[str, str]:
        """A multimodal policy: each group's encoder inputs, computed once from its prompt parts and shared by
        its samples, whose prompt tokens must be the processor's tokenization of those parts (so that the
        trainer scores what the rollout generated from). Media tokens anywhere else (a completion, a text
        prompt) would stand for media that do not exist and fail the whole micro-batch's forward. Returns
        the groups it cannot take, with why."""
        invalid: dict[str, str] = {}
        banned = set(self.banned_ids)
        for g in groups:
            if self.processor is None:
                if any(not isinstance(p, media.Text) for p in g.prompt_parts):
                    invalid[g.group_id] = "the prompt has media and the policy is a text model"
                continue
            if any(banned.intersection(s.completion_ids) for s in g.samples):
                invalid[g.group_id] = "a completion holds the model's media tokens"
                continue
            if not g.prompt_parts:  # a text prompt: the prompt's ids as sent
                if any(banned.intersection(s.prompt_ids) for s in g.samples):
                    invalid[g.group_id] = "a text prompt holds the model's media tokens (send media as prompt_parts)"
                    continue
                for s in g.samples:
                    s.media = {}
                continue
            try:
                processed = self.processor(g.prompt_parts, where=f"group {g.group_id}: prompt_parts")
            except media.InvalidMedia as e:
                invalid[g.group_id] = str(e)
                continue
            if any(s.prompt_ids != processed.token_ids for s in g.samples):
                invalid[g.group_id] = "the samples' prompt tokens are not the processor's tokenization of its parts"
                continue
            for s in g.samples:
                s.media = processed.inputs
        for group_id, why in invalid.items():
            log.warning("group skipped: %s", why, extra={"group_id": group_id})
        return invalid

    def _forward_before_advantages(self, pool: list[Sample], alg: Algorithm) -> list[dict[str, list[float]]]:
        """Rank 0: the log-probs the advantages or the rejection need, of every sample of ``pool``, from a
        forward pass without gradients spread over the ranks (balanced by tokens): "prox" (the current
        weights, or the behaviour's with proximal: behaviour), "ref" (with the KL in the reward), "teacher"
        (distillation) and "values" (the critic's, before the step: GAE and the value clip). The
        updates take their proximal log-probs as without it (the training micro-batches' own forward), so
        that the first update's ratio is exactly 1 whatever the batching here."""
        cfg = alg.config
        policy = cfg.proximal == "recompute"
        remote_teacher = cfg.teacher_scores_samples and self.teacher is not None
        models = tuple(
            name
            for name, wanted in (
                ("prox", policy),
                ("ref", cfg.kl_reward_coef > 0),
                ("teacher", cfg.teacher_scores_samples and not remote_teacher),
                ("values", cfg.uses_critic),
            )
            if wanted
        )
        with self._command("forward", models):
            if self.group is None:
                results = self._forward_logprobs(pool, models)
            else:
                shares = self._shares([len(s) for s in pool])
                mine = self.group.scatter([[pool[i] for i in share] for share in shares])
                everyone = self.group.gather(self._forward_logprobs(mine, models)) or []
                results = [{} for _ in pool]
                for share, part in zip(shares, everyone, strict=True):
                    for i, r in zip(share, part, strict=True):
                        results[i] = r
        if not policy:
            for s, r in zip(pool, results, strict=True):
                r["prox"] = [float(x) for x in s.behaviour_logprobs]
        if remote_teacher:
            assert self.teacher is not None
            with tracer.start_as_current_span("teacher_logprobs", attributes={"rl.samples": len(pool)}):
                scored = self.teacher.logprobs(
                    [(s.prompt_ids, s.completion_ids) for s in pool], self.config.temperature
                )
            for s, r, lp in zip(pool, results, scored, strict=True):
                if len(lp) != len(s.completion_ids):
                    raise RuntimeError(f"the teacher scored {len(lp)} of {len(s.completion_ids)} tokens")
                if not all(math.isfinite(x) for x in lp):
                    raise RuntimeError(f"the teacher answered a log-prob that is not finite for sample {s.sample_id!r}")
                r["teacher"] = lp
        return results

    def _forward_logprobs(self, samples: list[Sample], models: Sequence[str]) -> list[dict[str, list[float]]]:
        """This rank's ``samples``: the log-probs of each completion token under each of ``models`` ("prox":
        the policy as it is, "ref": the reference, "teacher"), or the critic's value of its state ("values"),
        without gradients, in micro-batches (as many on every rank: FSDP2's forwards pair up)."""
        index = split_by_token_budget([len(s) for s in samples], self.config.micro_batch_tokens) if samples else []
        count = self.group.most(len(index)) if self.group is not None else len(index)

        Forward = Callable[[list[PackedBatch]], list[torch.Tensor]]

        def critic_values() -> Forward:
            critic = self._ensure_critic()
            return lambda batches: [critic.values(batch) for batch in batches]

        def logprobs_of(model: torch.nn.Module) -> Forward:
            # (every micro-batch in one window: without gradients a pipeline stage keeps no activations)
            return lambda batches: [
                lp.logprobs for lp in self._window_logprobs(model, batches, temperature=self.config.temperature)
            ]

        loaders: dict[str, Callable[[], Forward]] = {
            "prox": lambda: logprobs_of(self._forward_model),
            "ref": lambda: logprobs_of(self._ensure_reference()),
            "teacher": lambda: logprobs_of(self._ensure_teacher()),
            "values": critic_values,
        }
        chosen = [(name, loaders[name]()) for name in models]
        rows_of = [[samples[i] for i in index[k]] if k < len(index) else [] for k in range(count)]
        batches = [
            pack(
                rows or [self._empty_sample()],
                pad_token_id=self.pad_token_id,
                padding_side=self.config.padding_side,
                banned_ids=self.banned_ids,
            ).to(self.device)
            for rows in rows_of
        ]
        out: list[dict[str, list[float]]] = [{} for _ in samples]
        with torch.no_grad(), tracer.start_as_current_span("forward_before_advantages"):
            for key, forward in chosen:
                with self._autocast():
                    per_batch = forward(batches)
                for k, (rows, lp) in enumerate(zip(rows_of, per_batch, strict=True)):
                    if rows:
                        values = unpack(lp.float().cpu(), rows, padding_side=self.config.padding_side)
                        for i, v in zip(index[k], values, strict=True):
                            out[i][key] = v
        return out

    def _micro_batches(self, mini_batch: MiniBatch) -> list[tuple[PackedBatch, bool]]:
        """This rank's share of ``mini_batch`` packed in micro-batches, padded with empty ones (loss 0) to the
        count of the rank with the most, since FSDP2's collectives pair the ranks' forwards up. Each comes
        with whether it is real."""
        samples = mini_batch.samples
        index = split_by_token_budget([len(s) for s in samples], self.config.micro_batch_tokens) if samples else []
        count = self.group.most(len(index)) if self.group is not None else len(index)
        critic = mini_batch.returns is not None
        out = []
        for k in range(count):
            real = k < len(index)
            part = mini_batch.subset(index[k]) if real else MiniBatch([self._empty_sample()], [0.0], mini_batch.norm)
            if critic and not real:
                part.returns = part.old_values = [[0.0]]
            batch = pack(
                part.samples,
                part.advantages,
                pad_token_id=self.pad_token_id,
                padding_side=self.config.padding_side,
                banned_ids=self.banned_ids,
                returns=part.returns,
                old_values=part.old_values,
            )
            out.append((batch.to(self.device), real))
        return out

    def _logprobs_before(
        self, plans: list[list[tuple[PackedBatch, bool]]], model: torch.nn.Module, span: str
    ) -> list[list[torch.Tensor]]:
        """log-probs of every micro-batch of the step under ``model`` as it is before the step's first update
        (the policy: π_prox; the reference), by a forward pass without gradients (every rank runs as many as
        the others), so that no epoch computes them again."""
        with torch.no_grad(), tracer.start_as_current_span(span), self._autocast():
            # (a mini-batch's micro-batches in one window: without gradients a stage keeps no activations)
            return [
                [
                    lp.logprobs
                    for lp in self._window_logprobs(
                        model, [batch for batch, _ in micro], temperature=self.config.temperature
                    )
                ]
                for micro in plans
            ]

    def _train(self, alg: Algorithm, mini_batches: list[MiniBatch]) -> dict[str, float]:
        """This rank's part of a step: ``epochs`` passes over the mini-batches, one optimizer update each,
        over this rank's share in micro-batches with the loss normalised by the whole mini-batch (every
        rank's share); then one step of the learning-rate schedule (it counts steps, as the policy version
        does). When the step makes more than one update, the proximal log-probs come from a forward pass
        before the first; the reference's, when the loss has a KL, too. With a critic, each update also
        makes one update of the critic on the value loss (only the critic's during critic_warmup_steps).
        Returns the step's metrics over every rank."""
        cfg = alg.config
        model = self._forward_model
        critic = self._ensure_critic() if cfg.uses_critic else None
        train_policy = self.version >= cfg.critic_warmup_steps or critic is None
        scale = float(self.data_parallel_size)  # the ranks' gradients are averaged: scaled by N, they add up
        model.train()
        plans = [self._micro_batches(mb) for mb in mini_batches]
        recompute = train_policy and cfg.proximal == "recompute" and cfg.updates > 1
        prox = self._logprobs_before(plans, model, "proximal_logprobs") if recompute else None
        ref = (
            self._logprobs_before(plans, self._ensure_reference(), "reference_logprobs")
            if train_policy and cfg.kl_coef > 0
            else None
        )
        with_entropy = self.config.compute_entropy or cfg.entropy_coef > 0
        teacher = self._ensure_teacher() if train_policy and cfg.distills_full_kl else None
        parts: list[dict[str, float]] = []
        updates: list[dict[str, float]] = []
        critic_updates: list[dict[str, float]] = []
        lr = self.lr
        critic_lr = critic.lr if critic is not None else None
        for epoch in range(cfg.epochs):
            for j, (mb, micro) in enumerate(zip(mini_batches, plans, strict=True)):
                # One span per update: the forward and backward of its micro-batches, then the optimizer's step.
                with tracer.start_as_current_span(
                    "forward_backward",
                    attributes={
                        "rl.samples": len(mb.samples),
                        "rl.trained_tokens": int(mb.norm.tokens),
                        "rl.micro_batches": sum(real for _, real in micro),
                        "rl.update": epoch * len(mini_batches) + j,
                    },
                ):
                    window = self._micro_batches_in_flight(model)
                    lps: list[TokenLogProbs] = []
                    for k, (batch, real) in enumerate(micro):
                        last = k == len(micro) - 1
                        if train_policy:
                            if k % window == 0:  # the forwards of the window's micro-batches, then their backwards
                                with self._autocast():
                                    lps = self._window_logprobs(
                                        model,
                                        [b for b, _ in micro[k : k + window]],
                                        temperature=self.config.temperature,
                                        with_entropy=with_entropy,
                                        entropy_grad=cfg.entropy_coef > 0,
                                        with_distribution=teacher is not None,
                                        distribution_vocab=self._shared_vocab if teacher is not None else None,
                                    )
                            lp = lps[k % window]
                            with self._autocast():
                                teacher_distribution = None
                                if teacher is not None:  # per micro-batch: [B, T, V] for a whole step is too much
                                    with torch.no_grad():
                                        teacher_distribution = self._completion_logprobs(
                                            teacher,
                                            batch,
                                            temperature=self.config.temperature,
                                            with_distribution=True,
                                            distribution_vocab=self._shared_vocab,
                                        ).distribution
                            if prox is not None:
                                prox_logp: torch.Tensor | None = prox[j][k]
                            else:
                                prox_logp = batch.behaviour_logprobs if cfg.proximal == "behaviour" else None
                            out = alg.policy_loss(
                                LossInputs(
                                    logp=lp.logprobs,
                                    behaviour_logp=batch.behaviour_logprobs,
                                    advantages=batch.advantages,
                                    mask=batch.loss_mask,
                                    prox_logp=prox_logp,
                                    ref_logp=ref[j][k] if ref is not None else None,
                                    entropy=lp.entropy,
                                    distribution=lp.distribution,
                                    teacher_distribution=teacher_distribution,
                                ),
                                mb.norm,
                            )
                            with self._accumulating(model, last):
                                self._backward(out.loss * scale if scale != 1.0 else out.loss)
                            if real:
                                parts.append({**out.sums, "micro_batches": 1.0})
                        if critic is not None:
                            assert batch.returns is not None and batch.old_values is not None
                            with self._autocast():
                                values = critic.values(batch)
                            value_out = value_loss(
                                values, batch.old_values, batch.returns, batch.loss_mask, cfg, mb.norm
                            )
                            with self._accumulating(critic.forward_model, last):
                                (value_out.loss * scale if scale != 1.0 else value_out.loss).backward()
                            if real:
                                parts.append(
                                    value_out.sums if train_policy else {**value_out.sums, "micro_batches": 1.0}
                                )
                with tracer.start_as_current_span("optimizer.step"):
                    if train_policy:
                        self._stand_in_zeros = self._zero_gradient_without_backward()
                        try:
                            updates.append(self._update())
                        finally:
                            self._stand_in_zeros = False
                    if critic is not None:
                        critic_updates.append(critic.update())
        with warnings.catch_warnings():
            # a critic warm-up step makes no policy update, yet the policy's schedule counts the step
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.scheduler.step()
        if critic is not None:
            critic.scheduler.step()
        totals = add_sums(parts)
        if self.group is not None and self.data_parallel_size > 1:
            totals = self.group.sum(self._totals_to_add(totals))
        metrics = summarize([totals], updates=max(len(updates), len(critic_updates)))
        metrics["micro_batches"] = totals.get("micro_batches", 0.0)
        metrics["updates"] = float(len(updates))
        metrics["grad_norm"] = sum(u["grad_norm"] for u in updates) / max(len(updates), 1)
        metrics["skipped_nonfinite_grad"] = sum(u["skipped_nonfinite_grad"] for u in updates)
        if updates and "loss_scale" in updates[-1]:  # fp16: the scale after the step's last update
            metrics["loss_scale"] = updates[-1]["loss_scale"]
        metrics["lr"] = lr
        if critic is not None:
            metrics["critic_updates"] = float(len(critic_updates))
            metrics["critic_grad_norm"] = sum(u["critic_grad_norm"] for u in critic_updates) / len(critic_updates)
            metrics["critic_skipped_nonfinite_grad"] = sum(u["critic_skipped_nonfinite_grad"] for u in critic_updates)
            metrics["critic_lr"] = float(critic_lr or 0.0)
        return metrics

    def _completion_logprobs(self, model: torch.nn.Module, batch: PackedBatch, **options: Any) -> TokenLogProbs:
        """``completion_logprobs`` of ``batch`` under ``model`` (the megatron backend's pipeline stages compute
        the policy's together)."""
        return completion_logprobs(model, batch, logits_chunk_tokens=self.config.logits_chunk_tokens, **options)

    def _window_logprobs(
        self, model: torch.nn.Module, batches: Sequence[PackedBatch], **options: Any
    ) -> list[TokenLogProbs]:
        """``_completion_logprobs`` of each of ``batches``, whose backwards (if any) follow in their order (the
        megatron backend's pipeline stages run a window's forwards at once)."""
        return [self._completion_logprobs(model, batch, **options) for batch in batches]

    def _micro_batches_in_flight(self, model: torch.nn.Module) -> int:
        """How many micro-batches' forwards go before their backwards (one: each its forward, then its backward;
        the megatron backend's pipeline stages run more)."""
        return 1

    def _accumulating(self, module: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        if self.group is None:
            return contextlib.nullcontext()
        return self.group.accumulating(module, last)

    def _empty_sample(self) -> Sample:
        """A micro-batch's worth of nothing: one token predicting one, none of it trained (loss 0)."""
        pad = self.pad_token_id
        return Sample([pad], [pad], [0.0], loss_mask=[False])

    def sft_step(self, samples: Sequence[Sample]) -> StepResult:
        """One optimizer step of supervised fine-tuning (token-mean NLL of the masked completion tokens);
        also one policy version. Rewards, advantages and behaviour log-probs are ignored. One process only
        (the warm start of a recipe)."""
        if self.group is not None:
            raise RuntimeError("sft_step runs in one process (world_size 1)")
        started = time.monotonic()
        step = self.version
        self._use_device()
        self._wake()
        train = [s for s in samples if s.trained_tokens > 0]
        norm = Normaliser(float(sum(s.trained_tokens for s in train)), float(len(train)), float(len(samples)))
        parts: list[dict[str, float]] = []
        self.model.train()
        for index in split_by_token_budget([len(s) for s in train], self.config.micro_batch_tokens) if train else []:
            mb = pack(
                [train[i] for i in index],
                pad_token_id=self.pad_token_id,
                padding_side=self.config.padding_side,
                banned_ids=self.banned_ids,
            ).to(self.device)
            with self._autocast():
                lp = self._completion_logprobs(self.model, mb, temperature=1.0)
            out = sft_loss(lp.logprobs, mb.loss_mask, norm)
            self._backward(out.loss)
            parts.append(out.sums)
        metrics = summarize(parts)
        metrics.update(self._optimizer_step())
        self.version += 1
        return StepResult(
            step=step,
            policy_version=self.version,
            committed=True,
            samples=len(samples),
            trained_tokens=int(norm.tokens),
            loss=metrics.get("loss", 0.0),
            duration_s=time.monotonic() - started,
            metrics=metrics,
        )

    # ---------------------------------------------------------------------------------------------
    # The other ranks

    @contextlib.contextmanager
    def _command(self, command: str, payload: Any = None) -> Iterator[None]:
        """Rank 0: one command at a time, sent to the other ranks before its collectives begin."""
        with self._one_command():
            if command not in NO_WAKE_COMMANDS:
                self._wake()
            if self.group is not None:
                self.group.send(command, payload)
            self._last_command = time.monotonic()
            yield

    def follow(self) -> None:
        """A rank other than 0: does what rank 0 sends, until it sends ``stop`` (or its collective fails:
        rank 0 is gone, and this rank fails with it)."""
        assert self.group is not None and not self.group.leads, "follow() is for ranks other than 0"
        self._use_device()  # (this thread's, for every command that follows)
        while True:
            command, payload = self.group.receive()
            if command not in NO_WAKE_COMMANDS:
                self._wake()
            if command == "train":
                self._train(payload, self.group.scatter(None))
                self.version += 1
            elif command == "forward":
                self.group.gather(self._forward_logprobs(self.group.scatter(None), payload))
            elif command == "gather":
                self._full_state_dict()
            elif command == "checkpoint":
                self._gather_for_checkpoint()
            elif command == "release":
                self.group.gather(self._offload_models_or_error())
            elif command == "stop":
                self.group.close()  # at once, in step with rank 0's close (the service may be stopping meanwhile)
                return
            # "keepalive": nothing to do but to wait for the next one

    def keepalive(self) -> None:
        """Rank 0, while it waits for data: tells the other ranks it lives, once ``keepalive_s`` has passed
        since its last command (they would otherwise fail at the collectives' timeout)."""
        if self.group is None or time.monotonic() - self._last_command < self.group.config.keepalive_s:
            return
        with self._command("keepalive"):
            pass

    def close(self) -> None:
        """Rank 0 tells the other ranks to stop; every rank leaves the process group."""
        if self.group is None:
            return
        if self.group.leads:
            with contextlib.suppress(RuntimeError), self._command("stop"):  # a rank already gone
                pass
        self.group.close()

    # ---------------------------------------------------------------------------------------------
    # Weights out

    def state_dict_for_publish(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Parameter and buffer tensors by their Hugging Face names (``model.layers.0.…``, ``lm_head.weight``;
        a tied ``lm_head.weight`` is listed too). Without ``dtype`` the tensors alias the live weights:
        copy them before the next step changes them. With FSDP2 they are gathered from every rank (a
        collective: rank 0 calls this, the others follow) into new CPU tensors."""
        if self._publish_gathers:
            with self._command("gather"):
                state = self._full_state_dict()
        else:
            with self._one_command():  # (not beside a release_memory: a checkpoint's, asked for meanwhile)
                self._wake()
                state = self._own_state_dict()
        if dtype is None:
            return {name: t.detach() for name, t in state.items()}
        return {name: t.detach().to(dtype) if t.is_floating_point() else t.detach() for name, t in state.items()}

    # ---------------------------------------------------------------------------------------------
    # Checkpoints

    def save_checkpoint(self, root: str | Path, *, keep: int | None = None, own: bool = True) -> CheckpointInfo:
        """Write ``root/v{version:08d}/`` (checkpoint.write_checkpoint): the weights in Hugging Face format,
        tokenizer files copied from the source model, and the trainer state (optimizer, schedule, RNG,
        version, trained group ids). The same checkpoint already there is returned as it is. In the trainer's
        own directory (``own``) keeps the newest ``keep`` checkpoints (default config.keep_checkpoints; 0 keeps
        all); an export elsewhere removes nothing. With several
        ranks, the weights and the optimizer state are gathered to rank 0, which writes them as one process
        would: a checkpoint resumes at any world size."""
        with self._command("checkpoint"):
            gathered = self._gather_for_checkpoint()
        critic = self.critic

        def save_weights(folder: Path) -> None:
            self.model.save_pretrained(folder, state_dict=gathered["weights"])  # (None: the model's own state)
            if critic is not None:
                critic.save(folder, gathered["critic_weights"])

        return write_checkpoint(
            root,
            self.version,
            save_weights=save_weights,
            tokenizer_source=self._weights_source,
            trainer_state=lambda: {
                "optimizer": gathered["optimizer"],
                "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(),
                **(
                    {
                        "critic_optimizer": gathered["critic_optimizer"],
                        "critic_scheduler": critic.scheduler.state_dict(),
                    }
                    if critic is not None
                    else {}
                ),
            },
            meta={
                "algorithm": self.algorithm.name,
                "algorithm_config": asdict(self.algorithm.config),
                "trained_group_ids": sorted(self.trained_group_ids),
                "world_size": self.world_size,
            },
            keep=self.config.keep_checkpoints if keep is None else keep,
            own=own,
            checksums=self.config.checkpoint_checksums,
        )

    def _gather_for_checkpoint(self) -> dict[str, Any]:
        """The weights and optimizer states a checkpoint holds: in one process, the optimizers' own (the
        weights None: the models' own); with several ranks, gathered to rank 0 (a collective every rank
        runs; the others get empty ones)."""
        group = self.group
        critic = self.critic
        if group is None:
            out: dict[str, Any] = {"weights": None, "optimizer": self.optimizer.state_dict()}
            if critic is not None:
                out.update(critic_weights=None, critic_optimizer=critic.optimizer.state_dict())
            return out
        # (a sharded state emptied by offload_optimizer is gathered from its device, then offloaded again)
        with self._offload.resident() if self._offload is not None else contextlib.nullcontext():
            out = {"weights": self._full_state_dict(), "optimizer": self._full_optimizer_state()}
        if critic is not None:
            out["critic_weights"] = group.full_state_dict(critic.model)
            out["critic_optimizer"] = group.full_optimizer_state(critic.model, critic.optimizer)
        return out

    def load_checkpoint(self, path: str | Path) -> CheckpointInfo:
        """Restore weights, optimizer, schedule, RNG, version and trained group ids from a checkpoint folder,
        or from the newest checkpoint when ``path`` is a directory of checkpoints. One process only: a
        data-parallel role resumes when it starts (``TorchBackend(config, checkpoint=...)``)."""
        if self.group is not None:
            raise RuntimeError("load_checkpoint runs in one process; a data-parallel role resumes at its start")
        path = resolve_checkpoint(path)
        meta = read_checkpoint_meta(path)  # every file whole (size, sha256) before any is loaded
        if self._model_offload is not None:  # the reference's and a teacher's weights stay: whole again
            self._model_offload.to_device()
            self._model_offload = None  # (it would keep the replaced policy and critic alive)
        self._weights_source = path
        self.model = self._forward_model = self._load_policy(path)
        self._build_optimizer()
        if self.critic is not None or self.algorithm.config.uses_critic:
            self.critic = None
            self._ensure_critic(path)
        self._restore_state(path, meta)
        return read_checkpoint_info(path)

    def _restore_state(self, path: Path | None, meta: dict[str, Any] | None) -> None:
        """The optimizer, schedule, RNG, version and trained ids of checkpoint ``path`` (``meta``: its metadata,
        its files checked); with several ranks, rank 0 reads it (the others pass None) and shares it."""
        if self.group is None:
            assert path is not None
            meta, state = read_trainer_state(path, meta)
        else:
            meta, state = self.group.share(read_trainer_state(path, meta) if path is not None else None)
        if self.group is not None:
            self._load_optimizer_state(state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if self._offload is not None:
            self._offload.to_host()  # (loaded onto the parameters' device: off it until the first update)
        self.scheduler.load_state_dict(state["scheduler"])
        changed = apply_optim_config(self.optimizer, self.scheduler, self.config.optim)
        if self.critic is not None and "critic_optimizer" in state:  # else a new critic: a fresh optimizer
            if self.group is not None:
                self.group.load_optimizer_state(self.critic.model, self.critic.optimizer, state["critic_optimizer"])
            else:
                self.critic.optimizer.load_state_dict(state["critic_optimizer"])
            self.critic.scheduler.load_state_dict(state["critic_scheduler"])
            critic_changed = apply_optim_config(self.critic.optimizer, self.critic.scheduler, self.critic.optim)
            changed |= {f"critic.{key}": values for key, values in critic_changed.items()}
        if changed and path is not None:  # (a resume with new optimizer settings: from now on, said once)
            log.warning(
                "the optimizer settings differ from the checkpoint's: the config's apply", extra={"changed": changed}
            )
        set_rng_state(state["rng"])
        self.version = int(meta["policy_version"])
        self.trained_group_ids = set(meta["trained_group_ids"])
        if path is not None:  # (said once, by the rank that read it: which steps a resume starts after)
            log.info(
                "resumed from a checkpoint",
                extra={"checkpoint": str(path), "version": self.version, "trained_groups": len(self.trained_group_ids)},
            )


def backend_class(config: TorchBackendConfig) -> type[TorchBackend]:
    """The backend ``config.kind`` names (megatron's imported only when named: megatron-core is an extra)."""
    if config.kind == "megatron":
        from tauflow.trainer.megatron.backend import MegatronBackend

        return MegatronBackend
    return TorchBackend


def _rejected(proximal: Sequence[float], sample: Sample, config: Any) -> bool:
    """Whether the rejection bounds drop ``sample``: its geometric-mean importance weight
    exp(mean over trained tokens of log π_prox − log π_beh) lies outside [reject_lower, reject_upper]."""
    logs = [p - b for p, b, m in zip(proximal, sample.behaviour_logprobs, sample.mask, strict=True) if m]
    weight = math.exp(max(-20.0, min(20.0, sum(logs) / len(logs))))
    return (config.reject_lower is not None and weight < config.reject_lower) or (
        config.reject_upper is not None and weight > config.reject_upper
    )
