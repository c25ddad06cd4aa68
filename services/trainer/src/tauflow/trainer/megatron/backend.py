"""The ``megatron`` trainer backend: the policy is megatron-core's GPTModel (``backend.kind: megatron``).

Everything RL (the algorithms, advantages, losses, micro-batches, the optimizer, checkpoints' trainer state)
is the ``torch`` backend's: ``MegatronBackend`` is a ``TorchBackend`` whose policy is a ``MegatronCausalLM``,
megatron-core's GPTModel answering as a Hugging Face causal LM does (``forward(...).logits``, ``config``,
``save_pretrained``). Weights enter from a Hugging Face folder and leave in Hugging Face names: a checkpoint's
weights are a Hugging Face folder (any Hugging Face loader, or a new run of either backend, starts from it;
its optimizer state resumes the megatron backend only: it is keyed by megatron's fused parameters), and the
sidecar publishes Hugging Face names (``convert``). The reference and the teacher, forward only, stay Hugging Face models.

Scope now: tensor- and pipeline-parallel size 1 on one CUDA device (what one GPU verifies;
``tests/test_megatron_backend.py``, marked gpu). megatron-core's forward assumes CUDA (a few buffers made on
``torch.cuda.current_device()``, a CUDA RNG forked around dropout), so the backend refuses other devices; the
CPU tests run the same code under a test shim that points those two at the CPU (the trainer's conftest).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tauflow.trainer.backend import TorchBackend
from tauflow.trainer.megatron.convert import MegatronLayout, hf_to_mcore, mcore_to_hf
from tauflow.trainer.megatron.model import gpt_model, transformer_config


def init_megatron(device: torch.device, tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0) -> None:
    """A one-process world (NCCL on CUDA, gloo on CPU) and megatron's model-parallel state, unless a world
    exists already."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mpu

    if (tensor_parallel, pipeline_parallel) != (1, 1):
        raise ValueError(
            f"tensor_parallel={tensor_parallel}, pipeline_parallel={pipeline_parallel}: the megatron backend runs "
            "TP = PP = 1 for now (docs/gpu.md); the weight conversion already shards (megatron.convert.shard)"
        )
    if not dist.is_initialized():  # one rank: nothing to rendezvous with, so an in-memory store
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

    def __init__(self, hf_config: Any, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.config = hf_config
        self.gpt = gpt
        self.layout = MegatronLayout.from_hf_config(hf_config)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu") -> MegatronCausalLM:
        """The Hugging Face folder's model as a GPTModel, its weights converted, float32, on ``device``."""
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(path)
        config = transformer_config(hf_config, use_cpu_initialization=True)
        model = cls(hf_config, gpt_model(hf_config, config))
        hf_weights = AutoModelForCausalLM.from_pretrained(path).state_dict()
        model.load_hf_state_dict(hf_weights)
        return model.to(device=device, dtype=torch.float32)

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        result = self.gpt.load_state_dict(hf_to_mcore(hf, self.layout), strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"weights do not fit the GPTModel: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
            )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in Hugging Face names (a tied ``lm_head.weight`` listed too); views of the live ones."""
        state = {k: v for k, v in self.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        return mcore_to_hf(state, self.layout)

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
        logits = self.gpt(input_ids, positions, attention_mask=~allowed)
        return SimpleNamespace(logits=logits)

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
        if kwargs.get("group") is not None:
            raise ValueError("the megatron backend runs one rank for now (distributed.world_size: 1)")
        if config.padding_side != "right":
            raise ValueError("the megatron backend needs backend.padding_side: right")
        require_cuda(config.device)
        init_megatron(torch.device(config.device), config.tensor_parallel, config.pipeline_parallel, config.seed)
        super().__init__(config, **kwargs)
        if self.processor is not None:
            raise ValueError("the megatron backend trains text models only (a multimodal folder: backend.kind torch)")

    def _load_policy(self, path: Path) -> Any:
        model = MegatronCausalLM.from_pretrained(path, device=self.device)
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        return model

    def state_dict_for_publish(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        model: MegatronCausalLM = self.model  # type: ignore[assignment]  # _load_policy built it
        state = model.hf_state_dict()
        if dtype is None:
            return {name: t.detach() for name, t in state.items()}
        return {name: t.detach().to(dtype) if t.is_floating_point() else t.detach() for name, t in state.items()}
