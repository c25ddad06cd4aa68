"""megatron-core's GPTModel for a Qwen2/Llama-style Hugging Face config (the ``megatron`` extra; megatron-core
is imported when these are called). ``megatron.core.parallel_state`` must be initialized first."""

from __future__ import annotations

from typing import Any

import torch

from tauflow.trainer.megatron.convert import MegatronLayout


def transformer_config(
    hf_config: Any,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    bf16: bool = False,
    use_cpu_initialization: bool = False,
) -> Any:
    """The TransformerConfig of the decoder ``hf_config`` describes: RMSNorm, SwiGLU, grouped-query attention,
    q/k/v bias where the checkpoint has it, no dropout (RL fine-tuning), weights in ``params_dtype``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = MegatronLayout.from_hf_config(hf_config)
    if layout.num_layers % pipeline_parallel:  # (megatron's default layout: as many layers on every stage)
        raise ValueError(
            f"pipeline_parallel {pipeline_parallel} does not divide the model's {layout.num_layers} layers"
        )
    text = hf_config.get_text_config()
    return TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(text, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=torch.bfloat16 if bf16 else params_dtype,  # what the stages send each other
        bf16=bf16,
        use_cpu_initialization=use_cpu_initialization,
    )


def rope_theta(hf_config: Any) -> float:
    """The rotary base of a plain (unscaled) rotary embedding: ``rope_parameters`` (transformers 5) or
    ``rope_theta`` (4.x). A scaled one (llama3, yarn, dynamic, ...) is refused: megatron's GPTModel here
    would silently compute a different embedding."""
    text = hf_config.get_text_config()
    params = getattr(text, "rope_parameters", None) or {}
    scaling = params.get("rope_type") or (getattr(text, "rope_scaling", None) or {}).get("rope_type")
    if scaling not in (None, "default"):
        raise ValueError(f"rope scaling {scaling!r} is not supported by the megatron backend yet (plain rope only)")
    return float(params.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0)


def gpt_model(hf_config: Any, config: Any, *, pre_process: bool = True, post_process: bool = True) -> Any:
    """megatron-core's GPTModel (local layer spec: no Transformer Engine needed) with rotary embeddings as the
    Hugging Face model has them (rotate-half, ``rope_theta``), embeddings tied where the checkpoint ties them."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layout = MegatronLayout.from_hf_config(hf_config)
    text = hf_config.get_text_config()
    return GPTModel(
        config=config,
        # RMSNorm named: with apex installed the default spec picks its FusedLayerNorm, which has no RMSNorm
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=layout.vocab_size,
        max_sequence_length=int(getattr(text, "max_position_embeddings", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
