"""Hugging Face ↔ megatron-core weight names and layouts for Qwen2/Llama-style decoders, with tensor- and
pipeline-parallel shards. Plain tensor code (no megatron import), so checkpoints and the weights the sidecar
publishes (always Hugging Face names on the wire) convert anywhere.

megatron-core's GPTModel packs what Hugging Face keeps apart:

- ``self_attention.linear_qkv``: q, k and v of each query group together, ``[groups, q_per_group + 2, head_dim,
  hidden]`` flattened (that is how ``SelfAttention.get_query_key_value_tensors`` splits it), bias alike;
- ``mlp.linear_fc1``: gate and up projections stacked (``[gate; up]``, the gated unit's order);
- the layer norms sit on the layer (local spec: ``input_layernorm``, ``pre_mlp_layernorm``) or are fused into
  the next linear (Transformer Engine spec: ``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).

Tensor parallelism splits column-parallel weights (embedding and output rows, q/k/v by query group, gate and up
each) along dim 0 and row-parallel ones (``linear_proj``, ``linear_fc2``) along dim 1; norms are replicated.
Pipeline stages hold consecutive layers, renumbered from 0; the first holds the embedding, the last the final
norm and the output layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MegatronLayout",
    "hf_to_mcore",
    "mcore_to_hf",
    "merge_shards",
    "pipeline_layers",
    "shard",
    "split_role",
    "stage_to_global",
]

_MC_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True, slots=True)
class MegatronLayout:
    """What the conversion needs to know of the model (``from_hf_config`` reads it from a Hugging Face config)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    fused_norms: bool = False  # Transformer Engine's spec: each norm lives in the linear after it

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of the "
                f"{self.num_query_groups} query groups"
            )

    @classmethod
    def from_hf_config(cls, config: Any, fused_norms: bool = False) -> MegatronLayout:
        text = config.get_text_config()
        model_type = getattr(text, "model_type", "")
        if model_type not in ("qwen2", "llama", "mistral", "qwen3"):
            raise ValueError(f"the megatron conversion knows Qwen2/Llama-style decoders, not {model_type!r}")
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        if model_type == "qwen3":
            raise ValueError("qwen3's q/k norms are not converted yet")
        return cls(
            num_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size),
            num_attention_heads=heads,
            num_query_groups=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(text.intermediate_size),
            vocab_size=int(text.vocab_size),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(text, "attention_bias", False)),
            fused_norms=fused_norms,
        )

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def norm_names(self) -> tuple[str, str]:
        """megatron's names, within a layer, of the norm before attention and the norm before the MLP."""
        if self.fused_norms:
            return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
        return "input_layernorm.weight", "pre_mlp_layernorm.weight"


# -- whole models ------------------------------------------------------------------------------------------------


def _pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    g, d = layout.num_query_groups, layout.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, layout.q_per_group, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _unpack_qkv(qkv: torch.Tensor, layout: MegatronLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, per = layout.num_query_groups, layout.head_dim, layout.q_per_group
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, per + 2, d, *rest)
    q, k, v = torch.split(grouped, [per, 1, 1], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_mcore(hf: Mapping[str, torch.Tensor], layout: MegatronLayout) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict (``model.*`` and ``lm_head.weight``) as megatron-core GPTModel's (unsharded).
    Raises KeyError naming a missing weight, ValueError naming one it does not know."""
    attn_norm, mlp_norm = layout.norm_names()
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not layout.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    known = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(layout.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = p + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _pack_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], layout
        )
        names = [a + f"{x}_proj.weight" for x in "qkvo"]
        if layout.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _pack_qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], layout
            )
            names += [a + f"{x}_proj.bias" for x in "qkv"]
        out[m + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
        out[m + attn_norm] = hf[p + "input_layernorm.weight"]
        out[m + mlp_norm] = hf[p + "post_attention_layernorm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        known.update(names + [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"])
    unknown = sorted(n for n in hf if n not in known and not n.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise ValueError(f"weights the megatron conversion does not know: {unknown[:5]}")
    return out


def mcore_to_hf(mc: Mapping[str, torch.Tensor], layout: MegatronLayout) -> dict[str, torch.Tensor]:
    """megatron-core GPTModel's (unsharded) state dict in Hugging Face names, the tied ``lm_head.weight`` listed
    too (as the engines' weight specs list it). ``_extra_state`` entries are skipped."""
    attn_norm, mlp_norm = layout.norm_names()
    embed = mc["embedding.word_embeddings.weight"]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(layout.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = p + "self_attn."
        q, k, v = _unpack_qkv(mc[m + "self_attention.linear_qkv.weight"], layout)
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
        if layout.qkv_bias:
            qb, kb, vb = _unpack_qkv(mc[m + "self_attention.linear_qkv.bias"], layout)
            out.update({a + "q_proj.bias": qb, a + "k_proj.bias": kb, a + "v_proj.bias": vb})
        out[a + "o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
        gate, up = torch.chunk(mc[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
        out[p + "mlp.down_proj.weight"] = mc[m + "mlp.linear_fc2.weight"]
        out[p + "input_layernorm.weight"] = mc[m + attn_norm]
        out[p + "post_attention_layernorm.weight"] = mc[m + mlp_norm]
    out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = embed if layout.tied_embeddings else mc["output_layer.weight"]
    return out


# -- tensor- and pipeline-parallel shards -----------------------------------------------------------------------


def pipeline_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The global layer indices pipeline stage ``pp_rank`` holds (an even split; the first stages take one more
    where it does not divide)."""
    if not 0 <= pp_rank < pp_size or pp_size > num_layers:
        raise ValueError(f"pipeline rank {pp_rank} of {pp_size} over {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def stage_to_global(name: str, layout: MegatronLayout, pp_size: int, pp_rank: int) -> str:
    """A weight's name on pipeline stage ``pp_rank`` (its layers numbered from 0) in the whole model."""
    found = _MC_LAYER.fullmatch(name)
    if not found:
        return name
    start = pipeline_layers(layout.num_layers, pp_size, pp_rank).start
    return f"decoder.layers.{int(found.group(1)) + start}.{found.group(2)}"


def split_role(name: str) -> str:
    """How a megatron weight is split across tensor-parallel ranks: rows, qkv, fc1, cols, or replicated."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "qkv"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "rows"
    return "replicated"


def _check_tp(layout: MegatronLayout, tp_size: int) -> None:
    for what, n in (("query groups", layout.num_query_groups), ("vocab_size", layout.vocab_size)):
        if n % tp_size:
            raise ValueError(f"tensor-parallel size {tp_size} does not divide the {n} {what}")
    if layout.ffn_hidden_size % tp_size:
        raise ValueError(f"tensor-parallel size {tp_size} does not divide ffn_hidden_size {layout.ffn_hidden_size}")


def shard(
    mc: Mapping[str, torch.Tensor], layout: MegatronLayout, tp_size: int = 1, tp_rank: int = 0, pp_size: int = 1,
    pp_rank: int = 0,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The part of an unsharded megatron state dict that rank (``tp_rank``, ``pp_rank``) holds, its layers
    renumbered from 0 within the stage."""
    _check_tp(layout, tp_size)
    layers = pipeline_layers(layout.num_layers, pp_size, pp_rank)
    out: dict[str, torch.Tensor] = {}
    for name, t in mc.items():
        found = _MC_LAYER.fullmatch(name)
        if found:
            index = int(found.group(1))
            if index not in layers:
                continue
            name = f"decoder.layers.{index - layers.start}.{found.group(2)}"
        elif not _on_stage(name, pp_size, pp_rank):
            continue
        out[name] = _tp_piece(t, split_role(name), layout, tp_size, tp_rank)
    return out


def _on_stage(name: str, pp_size: int, pp_rank: int) -> bool:
    """Whether a weight outside the layers lives on pipeline stage ``pp_rank``: the embedding on the first, the
    final norm and the output layer on the last."""
    if name.startswith("embedding."):
        return pp_rank == 0
    if name.startswith(("decoder.final_layernorm", "output_layer")):
        return pp_rank == pp_size - 1
    return True


def _tp_piece(t: torch.Tensor, role: str, layout: MegatronLayout, tp_size: int, tp_rank: int) -> torch.Tensor:
    if tp_size == 1 or role == "replicated":
        return t
    if role == "rows":
        return torch.chunk(t, tp_size, dim=0)[tp_rank]
    if role == "cols":
        return torch.chunk(t, tp_size, dim=1)[tp_rank]
    if role == "fc1":
        gate, up = torch.chunk(t, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]])
    grouped = t.reshape(layout.num_query_groups, -1, *t.shape[1:])  # qkv: whole query groups per rank
    return torch.chunk(grouped, tp_size, dim=0)[tp_rank].reshape(-1, *t.shape[1:])


def merge_shards(
    shards: Sequence[Sequence[Mapping[str, torch.Tensor]]], layout: MegatronLayout
) -> dict[str, torch.Tensor]:
    """The unsharded state dict from every rank's shard: ``shards[pp_rank][tp_rank]`` (what ``shard`` gives)."""
    pp_size, tp_size = len(shards), len(shards[0])
    _check_tp(layout, tp_size)
    out: dict[str, torch.Tensor] = {}
    for pp_rank, stage in enumerate(shards):
        if len(stage) != tp_size:
            raise ValueError(f"pipeline stage {pp_rank} has {len(stage)} tensor-parallel shards, not {tp_size}")
        for name in stage[0]:
            pieces = [s[name] for s in stage]
            out[stage_to_global(name, layout, pp_size, pp_rank)] = _tp_merge(pieces, split_role(name), layout)
    return out


def _tp_merge(pieces: Sequence[torch.Tensor], role: str, layout: MegatronLayout) -> torch.Tensor:
    if len(pieces) == 1 or role == "replicated":
        return pieces[0]
    if role == "rows":
        return torch.cat(list(pieces), dim=0)
    if role == "cols":
        return torch.cat(list(pieces), dim=1)
    if role == "fc1":
        halves = [torch.chunk(p, 2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    rest = pieces[0].shape[1:]
    groups = layout.num_query_groups // len(pieces)
    return torch.cat([p.reshape(groups, -1, *rest) for p in pieces], dim=0).reshape(-1, *rest)
