"""The ``megatron`` trainer backend: the policy is megatron-core's GPTModel (``backend.kind: megatron``).

Everything RL (the algorithms, advantages, losses, micro-batches, the optimizer, checkpoints' trainer state)
is the ``torch`` backend's: ``MegatronBackend`` is a ``TorchBackend`` whose policy is a ``MegatronCausalLM``,
megatron-core's GPTModel answering as a Hugging Face causal LM does (``forward(...).logits``, ``config``,
``save_pretrained``). Weights enter from a Hugging Face folder and leave in Hugging Face names: a checkpoint's
weights are a Hugging Face folder (any Hugging Face loader, or a new run of either backend, starts from it;
its optimizer state resumes the megatron backend only: it is keyed by megatron's fused parameters), and the
sidecar publishes Hugging Face names (``convert``). The reference and the teacher, forward only, stay Hugging Face models.

Parallelism: tensor and pipeline parallelism, and data parallelism beside them. With ``tensor_parallel`` T and
``pipeline_parallel`` P the trainer role's W ranks are W / (T P) data-parallel replicas of T P ranks each
(megatron's order: the tensor-parallel ranks consecutive, then the replicas, then the stages). The ranks of a
replica take the same share of the batch (they split the model, not the data); every rank loads rank 0's
weights and keeps its shard (``convert.shard``: its stage's layers, its tensor-parallel part of them); the
tensor-parallel ranks compute the log-probs from their slices of the vocabulary's logits (``vocab_parallel``). The stages work on a
window of micro-batches at once, GPipe within it (``pipeline``). After the backward the replicas' gradients are averaged over the
data-parallel group, a tied embedding's two copies (first and last stage) get the sum of their gradients, and
the gradient norm is the whole model's (the shards' norms summed over the tensor-parallel group, the
replicated weights' counted once, summed over the stages). A publish or a checkpoint gathers the shards (one
collective per tensor), merges them (``convert.merge_shards``) and brings every stage's to rank 0: the weights
in Hugging Face names, the AdamW moments as one process of TP = PP = 1 keys them, so a checkpoint resumes at
any size.

megatron-core's forward assumes CUDA (a few buffers made on ``torch.cuda.current_device()``, a CUDA RNG
forked around dropout), so the backend refuses other devices; the CPU tests run the same code under a test
shim that points those two at the CPU (the trainer's conftest).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tauflow.trainer.backend import TorchBackend
from tauflow.trainer.batch import (
    PackedBatch,
    TokenLogProbs,
    logprobs_of_logits,
    output_layer_swapped,
    scaled_logits,
    token_logprobs_of_values,
    token_values,
    values_in_chunks,
)
from tauflow.trainer.megatron.convert import (
    MegatronLayout,
    hf_to_mcore,
    mcore_to_hf,
    merge_shards,
    shard,
    split_role,
    stage_to_global,
)
from tauflow.trainer.megatron.model import gpt_model, transformer_config
from tauflow.trainer.megatron.pipeline import PipelineStage, pipeline_logprobs
from tauflow.trainer.megatron.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_token_values
from tauflow.trainer.optim import clip_and_step
from tauflow.trainer.parallel import RankGroup, balance_by_tokens, keyed_by_index, keyed_by_name, parameter_names

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state tensors: sharded as their parameter is
GRAD_BUCKET_BYTES = 64 * 2**20  # gradients flattened per all-reduce over the data-parallel replicas


def init_megatron(device: torch.device, tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0) -> None:
    """megatron's model-parallel state over the world that exists (the trainer's ranks), or over a one-process
    world it makes (NCCL on CUDA, gloo on CPU) when there is none and one rank is all it needs."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mpu

    if not dist.is_initialized():  # one rank: nothing to rendezvous with, so an in-memory store
        if tensor_parallel * pipeline_parallel != 1:
            raise ValueError(
                f"tensor_parallel={tensor_parallel}, pipeline_parallel={pipeline_parallel} need as many ranks "
                "(distributed.world_size)"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
        mpu.model_parallel_cuda_manual_seed(seed)  # the RNG tracker megatron's dropout forks (0 here, but asked)


def require_cuda(device: str) -> None:
    """megatron-core's forward assumes a CUDA device: refuses any other."""
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"the megatron backend needs a CUDA device (megatron-core's forward assumes one), not {device!r}"
        )


class MegatronCausalLM(torch.nn.Module):
    """megatron-core's GPTModel behind the part of a Hugging Face causal LM's interface the torch backend
    uses. Right padding only: megatron's rotary embedding takes positions 0..T-1 of each row."""

    gpt: Any  # megatron-core's GPTModel

    def __init__(self, hf_config: Any, gpt: Any, stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.gpt = gpt
        self.layout = MegatronLayout.from_hf_config(hf_config)
        self.tensor_parallel = int(gpt.config.tensor_model_parallel_size)
        self.pipeline_parallel = int(gpt.config.pipeline_model_parallel_size)
        self.stage = stage  # with pipeline parallelism: this rank's stage
        self.logits_chunk_tokens = 0  # backend.logits_chunk_tokens (batch_logprobs)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        tensor_parallel: int = 1,
        group: RankGroup | None = None,
        pipeline_parallel: int = 1,
    ) -> MegatronCausalLM:
        """The Hugging Face folder's model as a GPTModel (with pipeline parallelism: this rank's stage of it),
        its weights converted, float32, on ``device``. With ``group`` every rank takes rank 0's weights (it may
        have read them from a checkpoint the others cannot see) before it keeps its shard."""
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(path)
        config = transformer_config(
            hf_config, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, use_cpu_initialization=True
        )
        stage = PipelineStage.of_megatron(torch.device(device)) if pipeline_parallel > 1 else None
        first, last = (stage.first, stage.last) if stage is not None else (True, True)
        model = cls(hf_config, gpt_model(hf_config, config, pre_process=first, post_process=last), stage)
        hf_weights = AutoModelForCausalLM.from_pretrained(path).state_dict()
        if group is not None:
            group.overwrite_with_leaders(hf_weights.values())
        model.load_hf_state_dict(hf_weights)
        return model.to(device=device, dtype=torch.float32)

    @property
    def tensor_parallel_rank(self) -> int:
        if self.tensor_parallel == 1:
            return 0
        from megatron.core import parallel_state

        return int(parallel_state.get_tensor_model_parallel_rank())

    @property
    def pipeline_rank(self) -> int:
        return self.stage.rank if self.stage is not None else 0

    @property
    def holds_tied_copy(self) -> bool:
        """Whether this is the last of several stages of a model whose output layer is its embedding: it keeps
        a copy of the first stage's (megatron's ``output_layer.weight`` here), updated alike."""
        return self.layout.tied_embeddings and self.stage is not None and self.stage.last

    def global_name(self, name: str) -> str:
        """A parameter's (or its state's) name here in the whole model of one process: the layers numbered
        from the first stage's; the tied copy named as the embedding it copies."""
        prefix = "gpt." if name.startswith("gpt.") else ""
        mc = name.removeprefix("gpt.")
        if self.holds_tied_copy and mc == "output_layer.weight":
            return prefix + "embedding.word_embeddings.weight"
        return prefix + stage_to_global(mc, self.layout, self.pipeline_parallel, self.pipeline_rank)

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """The full weights, in Hugging Face names: this rank keeps its shard (its tensor-parallel part of its
        pipeline stage's layers)."""
        mc = hf_to_mcore(hf, self.layout)
        if self.holds_tied_copy:
            mc["output_layer.weight"] = mc["embedding.word_embeddings.weight"]
        if self.tensor_parallel > 1 or self.pipeline_parallel > 1:
            mc = shard(
                mc, self.layout, self.tensor_parallel, self.tensor_parallel_rank, self.pipeline_parallel,
                self.pipeline_rank,
            )  # fmt: skip
        result = self.gpt.load_state_dict(mc, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"weights do not fit the GPTModel: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
            )

    def hf_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The full weights in Hugging Face names (a tied ``lm_head.weight`` listed too): views of the live ones
        with one rank; with several, the shards gathered into new CPU tensors (a collective every rank of the
        group runs; a rank that passes ``keep=False`` takes part and gets {}; with pipeline parallelism only
        global rank 0 keeps them)."""
        state = {k: v for k, v in self.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        if self.stage is None:
            full = self.gather_shards(state, keep=keep)
            return mcore_to_hf(full, self.layout) if keep else {}
        merged = self.gather_shards(state, keep=self.stage.leading)
        whole = self.stage.collect({self.global_name(k): v for k, v in merged.items() if not self.is_tied_copy(k)})
        return mcore_to_hf(whole, self.layout) if whole else {}

    def is_tied_copy(self, name: str) -> bool:
        """Whether ``name`` is the last stage's copy of a tied embedding (:attr:`holds_tied_copy`)."""
        return self.holds_tied_copy and name.removeprefix("gpt.") == "output_layer.weight"

    def gather_shards(self, shards: Mapping[str, torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
        """Every tensor-parallel rank's ``shards`` (megatron names: weights, or state sharded as they are),
        merged into the full tensors on the CPU: one all-gather per sharded tensor, in ``shards``' order (the
        same on every rank), each merged and moved before the next (the device holds one tensor's parts at a
        time). A rank with ``keep=False`` takes part and gets {}. With one rank: ``shards`` as they are."""
        if self.tensor_parallel == 1:
            return dict(shards) if keep else {}
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        out: dict[str, torch.Tensor] = {}
        for name, t in shards.items():
            if split_role(name) == "replicated":  # the same on every rank
                parts = [t.detach()] * self.tensor_parallel
            else:
                parts = [torch.empty_like(t) for _ in range(self.tensor_parallel)]
                dist.all_gather(parts, t.detach().contiguous(), group=group)
            if keep:
                out[name] = merge_shards([[{name: part} for part in parts]], self.layout)[name].cpu()
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        **unused: Any,
    ) -> SimpleNamespace:
        if unused:
            raise ValueError(f"the megatron backend takes text inputs only, not {sorted(unused)}")
        if self.stage is not None:
            raise RuntimeError("a pipeline stage computes log-probs with the others (pipeline.pipeline_logprobs)")
        return SimpleNamespace(logits=self.stage_forward(input_ids, attention_mask, position_ids))

    def stage_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        gather_logits: bool = True,
    ) -> torch.Tensor:
        """The logits, or with pipeline parallelism this stage's output: the hidden states ``[T, B, H]`` for the
        next stage, or on the last the logits. ``hidden``: the previous stage's output (every stage but the
        first). With tensor parallelism the logits are the whole vocabulary's, or with ``gather_logits=False``
        this rank's slice of it."""
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device).expand_as(input_ids)
        if position_ids is not None and attention_mask is not None:
            real = attention_mask.bool()
            if not torch.equal(position_ids[real], positions[real]):
                raise ValueError("the megatron backend needs right padding (backend.padding_side: right)")
        # megatron's mask: True where attention is refused; causal and the padded keys of each row
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        allowed = causal[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        if hidden is not None:
            self.gpt.set_input_tensor(hidden)
        out = self.gpt(input_ids, positions, attention_mask=~allowed)
        if hidden is not None:
            self.gpt.set_input_tensor(None)  # (the autograd graph holds it as long as it is needed)
        if gather_logits and self.tensor_parallel > 1 and (self.stage is None or self.stage.last):
            from megatron.core import tensor_parallel

            # each rank's part of the vocabulary: the losses take the whole
            out = tensor_parallel.gather_from_tensor_model_parallel_region(out)
        return out

    def batch_forward(self, batch: PackedBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`stage_forward` of ``batch``, the logits not gathered."""
        inputs = batch.model_inputs(self)
        return self.stage_forward(
            inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids"), hidden, gather_logits=False
        )

    def batch_logprobs(self, batch: PackedBatch, hidden: torch.Tensor | None = None, **options: Any) -> TokenLogProbs:
        """``completion_logprobs`` of ``batch`` (with pipeline parallelism on the last stage, ``hidden`` the stage
        before's output): from the whole logits (:meth:`logprobs_of_output`), or with ``logits_chunk_tokens`` from
        megatron's output layer run a chunk of positions at a time (``batch.values_in_chunks``; with tensor
        parallelism each chunk's vocabulary-parallel sums), never holding the whole logits."""
        if not self.logits_chunk_tokens or options.get("with_distribution"):
            return self.logprobs_of_output(self.batch_forward(batch, hidden), batch, **options)
        temperature = float(options.get("temperature", 1.0))
        with_entropy, entropy_grad = bool(options.get("with_entropy")), bool(options.get("entropy_grad"))
        layer = self.gpt.output_layer
        layer_forward = layer.forward

        def chunk_values(states: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            logits, _ = layer_forward(states.unsqueeze(0), **layer_options)  # [1, n, V / TP]: this rank's slice
            if self.tensor_parallel == 1:
                scaled = scaled_logits(logits[0], temperature, batch.banned_ids)
                return token_values(
                    scaled, targets, batch.banned_ids, with_entropy=with_entropy, entropy_grad=entropy_grad
                )
            return vocab_parallel_token_values(
                logits[0],
                targets,
                batch.banned_ids,
                vocab_start=self.tensor_parallel_rank * logits.shape[-1],
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
            )

        layer_options: dict[str, Any] = {}

        def per_token_layer(states: torch.Tensor, **options: Any) -> tuple[torch.Tensor, None]:
            layer_options.update(options)  # (the tied embedding's weight, on the last stage of a pipeline)
            by_row = states.transpose(0, 1)[:, :-1]  # megatron's [T, B, H] as [B, T - 1, H]
            values = values_in_chunks(by_row, batch.input_ids[:, 1:], self.logits_chunk_tokens, chunk_values,
                                      with_entropy)  # fmt: skip
            return torch.nn.functional.pad(values, (0, 0, 0, 1)).transpose(0, 1), None  # [T, B, 1 or 2]

        with output_layer_swapped(layer, per_token_layer) as returned:
            out = self.batch_forward(batch, hidden)
        same = len(returned) == 1 and torch.allclose(out, returned[0][0].transpose(0, 1), 0, 0, equal_nan=True)
        if not same:  # (a NaN is the step's to skip, not a sign of changed logits)
            raise ValueError("megatron's GPTModel changes its output layer's logits (or calls it more than once): "
                             "backend.logits_chunk_tokens cannot compute its log-probs in chunks (set it to 0)")  # fmt: skip
        return token_logprobs_of_values(out[:, :-1], entropy_grad)

    def logprobs_of_output(self, logits: torch.Tensor, batch: PackedBatch, **options: Any) -> TokenLogProbs:
        """``logprobs_of_logits`` of this rank's logits (:meth:`batch_forward`): with tensor parallelism from
        its slice of the vocabulary (``vocab_parallel``); the whole distribution, when asked for, from the
        logits gathered."""
        if self.tensor_parallel == 1:
            return logprobs_of_logits(logits, batch, **options)
        lp = vocab_parallel_logprobs(
            logits,
            batch,
            vocab_start=self.tensor_parallel_rank * logits.shape[-1],
            temperature=options.get("temperature", 1.0),
            with_entropy=bool(options.get("with_entropy")),
            entropy_grad=bool(options.get("entropy_grad")),
        )
        if options.get("with_distribution"):  # (the log-probs as every other forward computes them: ratios of 1)
            from megatron.core import tensor_parallel

            whole = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            lp.distribution = logprobs_of_logits(whole, batch, **{**options, "with_entropy": False}).distribution
        return lp

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each layer's activations in backward (megatron's full, uniform recompute)."""
        config = self.gpt.config
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1

    def save_pretrained(self, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """A Hugging Face folder (config.json and model.safetensors), loadable by ``from_pretrained``."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = state_dict if state_dict is not None else self.hf_state_dict()
        if self.layout.tied_embeddings:
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
        self.config.save_pretrained(folder)


class MegatronBackend(TorchBackend):
    """``TorchBackend`` with megatron-core's GPTModel as the policy (see the module's docstring)."""

    def __init__(self, config: Any, **kwargs: Any) -> None:
        group: RankGroup | None = kwargs.get("group")
        tp, pp = config.tensor_parallel, config.pipeline_parallel
        algorithm = config.chosen_algorithm().config
        if pp > 1 and algorithm.distills_full_kl:  # (the stages pass per-token values on, not distributions)
            raise ValueError("distillation by the full KL with pipeline_parallel > 1 is not supported yet")
        world = group.world_size if group is not None else 1
        if world % (tp * pp):
            raise ValueError(
                f"tensor_parallel x pipeline_parallel ({tp} x {pp}) must divide the trainer's world size ({world}): "
                "its ranks are data-parallel replicas of tensor_parallel x pipeline_parallel ranks each"
            )
        if tp * pp > 1 and config.autocast_dtype == "float16":  # (each rank's loss scale would see its own overflows)
            raise ValueError(
                "autocast_dtype float16 with tensor or pipeline parallelism is not supported: use bfloat16"
            )
        if config.padding_side != "right":
            raise ValueError("the megatron backend needs backend.padding_side: right")
        require_cuda(config.device)
        device = torch.device(config.device)
        if group is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", group.config.device_index)  # (as TorchBackend places a rank)
        init_megatron(device, tp, pp, config.seed)
        if group is not None:
            _check_rank_order(group.config.rank, tp, pp, world)
        super().__init__(config, **kwargs)
        if self.processor is not None:
            raise ValueError("the megatron backend trains text models only (a multimodal folder: backend.kind torch)")
        if tp > 1 and not any(getattr(p, "tensor_model_parallel", False) for p in self.model.parameters()):
            # (megatron marks its shards when it initialises them: the gradient norm needs to know which they are)
            raise RuntimeError("megatron-core marked no parameter as tensor-parallel: the gradient norm would be wrong")

    @property
    def megatron(self) -> MegatronCausalLM:
        return self.model  # type: ignore[return-value]  # _load_policy built it

    def _load_policy(self, path: Path) -> Any:
        model = MegatronCausalLM.from_pretrained(
            path, self.device, self.config.tensor_parallel, self.group, self.config.pipeline_parallel
        )
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.logits_chunk_tokens = self.config.logits_chunk_tokens
        model.train()
        return model

    # -- the ranks: data-parallel replicas of tensor x pipeline-parallel ranks each (the same samples, the model
    # -- split)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.config.tensor_parallel * self.config.pipeline_parallel)

    def _shares(self, lengths: Sequence[int]) -> list[list[int]]:
        replicas = balance_by_tokens(lengths, self.data_parallel_size)
        tp, dp = self.config.tensor_parallel, self.data_parallel_size
        return [replicas[_replica_of(rank, tp, dp)] for rank in range(self.world_size)]

    def _totals_to_add(self, totals: dict[str, float]) -> dict[str, float]:
        # a replica's totals once (its tensor- and pipeline-parallel ranks saw the same samples and values)
        model = self.megatron
        counted = model.tensor_parallel_rank == 0 and model.pipeline_rank == 0
        return totals if counted else dict.fromkeys(totals, 0.0)

    def _completion_logprobs(self, model: torch.nn.Module, batch: PackedBatch, **options: Any) -> TokenLogProbs:
        policy = self.megatron
        if model is not policy:  # the reference and a teacher: Hugging Face models
            return super()._completion_logprobs(model, batch, **options)
        if policy.stage is not None:
            return pipeline_logprobs(policy, [batch], policy.stage, **options)[0]
        return policy.batch_logprobs(batch, **options)

    def _window_logprobs(
        self, model: torch.nn.Module, batches: Sequence[PackedBatch], **options: Any
    ) -> list[TokenLogProbs]:
        policy = self.megatron
        if model is policy and policy.stage is not None:
            return pipeline_logprobs(policy, batches, policy.stage, **options)
        return super()._window_logprobs(model, batches, **options)

    def _micro_batches_in_flight(self, model: torch.nn.Module) -> int:
        if model is self.megatron and self.megatron.stage is not None:
            return self.config.pipeline_micro_batches_in_flight or self.config.pipeline_parallel
        return 1

    def _join_ranks(self) -> torch.nn.Module:
        return self.model  # (every rank took rank 0's weights before keeping its shard: _load_policy)

    def _accumulating(self, module: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        if module is self.model:  # (its replicas' gradients are averaged at the update: nothing to hold back)
            return contextlib.nullcontext()
        return super()._accumulating(module, last)  # a critic: data parallel over every rank (FSDP2 or DDP)

    def _clip_and_step(self) -> dict[str, float]:
        model = self.megatron
        if model.layout.tied_embeddings and model.stage is not None:
            self._add_tied_embedding_gradients()
        if self.data_parallel_size > 1:
            self._average_gradients_over_replicas()
        split = model.tensor_parallel > 1 or model.stage is not None
        norm_of = self._model_parallel_grad_norm if split else None
        return clip_and_step(
            self.model,
            self.optimizer,
            self.config.optim.grad_clip,
            self._scaler,
            norm_of,
            scaled=not self._stand_in_zeros,
        )

    def _add_tied_embedding_gradients(self) -> None:
        """The first stage's embedding and the last's copy of it (the output layer) are one weight: each gets
        the sum of both gradients (megatron's embedding group), so both make the same update."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if not parallel_state.is_rank_in_embedding_group():
            return
        weight = self.megatron.gpt.shared_embedding_or_output_weight()
        if weight.grad is None:  # an update with no micro-batch (no advantage): the same on every stage, and
            return  # AdamW leaves a weight without a gradient alone
        dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def _average_gradients_over_replicas(self) -> None:
        """Each gradient averaged over the data-parallel group (the loss was scaled by its size: the average is
        the gradient of the global batch's loss): one all-reduce per bucket of up to ``GRAD_BUCKET_BYTES`` of
        gradients of one dtype, flattened."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        sizes: dict[torch.dtype, int] = {}  # the bytes in each bucket

        def reduce(grads: list[torch.Tensor]) -> None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)  # (a sum: gloo has no average)
            flat.div_(self.data_parallel_size)
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))

        for p in self.model.parameters():  # (the same order on every rank)
            if p.grad is None:
                continue
            bucket = buckets.setdefault(p.grad.dtype, [])
            bucket.append(p.grad)
            sizes[p.grad.dtype] = sizes.get(p.grad.dtype, 0) + p.grad.numel() * p.grad.element_size()
            if sizes[p.grad.dtype] >= GRAD_BUCKET_BYTES:
                reduce(bucket)
                bucket.clear()
                sizes[p.grad.dtype] = 0
        for bucket in buckets.values():
            if bucket:
                reduce(bucket)

    def _model_parallel_grad_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole model's gradient norm: the tensor-parallel shards' squares summed over their group, plus the
        replicated weights' (the norms' scales: the same gradient on every rank) once, summed over the pipeline's
        stages (the last stage's copy of a tied embedding left out: the first counts it)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        tied_copy = self.megatron.gpt.shared_embedding_or_output_weight() if self.megatron.holds_tied_copy else None
        sharded = torch.zeros((), dtype=torch.float32, device=self.device)
        replicated = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:
            assert p.grad is not None
            if p is tied_copy:
                continue
            square = p.grad.detach().float().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += square
            else:
                replicated += square
        if self.megatron.tensor_parallel > 1:
            dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        total = sharded + replicated
        if self.megatron.stage is not None:
            dist.all_reduce(total, group=self.megatron.stage.group)
        return total.sqrt()

    # -- weights and optimizer state out and in: the shards gathered and merged, or cut

    @property
    def _leads(self) -> bool:
        return self.group is None or self.group.leads

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.megatron.hf_state_dict(keep=self._leads)  # (a collective with tensor parallelism)

    def _full_optimizer_state(self) -> dict[str, Any]:
        model = self.megatron
        names = parameter_names(self.model, self.optimizer)
        by_name = keyed_by_name(self.optimizer.state_dict(), names)
        state = {name: dict(values) for name, values in by_name["state"].items()}
        holds = model.stage.leading if model.stage is not None else self._leads  # (what it merges goes on)
        for key in MOMENTS:
            mine = {_mcore(name): values[key] for name, values in state.items() if key in values}
            for name, t in model.gather_shards(mine, keep=holds).items():
                state["gpt." + name][key] = t
        groups = self._pipeline_param_groups(by_name["param_groups"])
        if model.stage is not None:  # every stage's state, in the whole model's names, on the first
            ours = {
                (model.global_name(name), key): value
                for name, values in state.items()
                if not model.is_tied_copy(name)
                for key, value in values.items()
            }
            state = {}
            for (name, key), value in model.stage.collect(ours).items():
                state.setdefault(name, {})[key] = value
        if not self._leads:
            return {}
        return keyed_by_index({"state": state, "param_groups": groups}, [n for g in groups for n in g["params"]])

    def _load_optimizer_state(self, state: Mapping[str, Any]) -> None:
        model = self.megatron
        names = parameter_names(self.model, self.optimizer)
        own_groups = keyed_by_name(self.optimizer.state_dict(), names)["param_groups"]
        full_groups = self._pipeline_param_groups(own_groups)
        loaded = keyed_by_name(state, [n for g in full_groups for n in g["params"]])
        mine: dict[str, Any] = {}
        for name in names:
            values = loaded["state"].get(model.global_name(name))
            if values is None:
                continue
            values = dict(values)
            for key in MOMENTS:
                if key in values:
                    whole = _mcore(model.global_name(name))
                    cut = shard({whole: values[key]}, model.layout, model.tensor_parallel, model.tensor_parallel_rank)
                    values[key] = cut[whole].contiguous().clone()  # (not a view of the full tensor)
            mine[name] = values
        groups = [
            {**theirs, "params": own["params"]} for theirs, own in zip(loaded["param_groups"], own_groups, strict=True)
        ]
        self.optimizer.load_state_dict(keyed_by_index({"state": mine, "param_groups": groups}, names))

    def _pipeline_param_groups(self, param_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """This optimizer's parameter groups (parameters by name) as one process's optimizer holds them: each
        group's parameters of every pipeline stage, stage after stage, in the whole model's names (what a
        checkpoint keys the state by; a collective of the pipeline's stages)."""
        model = self.megatron
        if model.stage is None:
            return [dict(g) for g in param_groups]
        ours = [[model.global_name(n) for n in g["params"] if not model.is_tied_copy(n)] for g in param_groups]
        stages = model.stage.all_gather_object(ours)
        return [{**g, "params": [n for stage in stages for n in stage[i]]} for i, g in enumerate(param_groups)]

    @property
    def _publish_gathers(self) -> bool:
        return self.group is not None  # (a tensor-parallel rank holds shards)

    def _own_state_dict(self) -> dict[str, torch.Tensor]:
        return self.megatron.hf_state_dict()


def _replica_of(rank: int, tp: int, dp: int) -> int:
    """The data-parallel replica of global ``rank`` in megatron's rank order (tensor-parallel ranks consecutive,
    then the replicas, then the pipeline stages)."""
    return (rank // tp) % dp


def _check_rank_order(rank: int, tp: int, pp: int, world: int) -> None:
    """The shares of the batch follow megatron's rank order: refuses a megatron-core that orders otherwise."""
    from megatron.core import parallel_state

    dp = world // (tp * pp)
    expected = (_replica_of(rank, tp, dp), rank // (tp * dp), rank % tp)
    actual = (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    if expected != actual:
        raise RuntimeError(f"megatron-core places rank {rank} at (dp, pp, tp) {actual}, not {expected}")


def _mcore(name: str) -> str:
    """A parameter's name in the GPTModel (``MegatronCausalLM``'s ``gpt.`` dropped): what convert names."""
    return name.removeprefix("gpt.")
