"""Hugging Face ↔ megatron-core weights (tauflow.trainer.megatron.convert): exact round trips, tensor- and
pipeline-parallel shards that merge back, and, where megatron-core is installed, its real GPTModel built on the
CPU from the same config: the converted weights load into it name for name, and its q/k/v split and gated MLP
compute what the Hugging Face layer computes; with TP = 2 and PP = 2 (two gloo ranks, megatron-core's
hard-coded CUDA device pointed at the CPU as the conftest's shim does), each rank's shard in megatron's
parallel model gives the Hugging Face model's logits, and with TP its gradient shards merge to HF's gradients."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tauflow.trainer.megatron.convert import (
    MegatronLayout,
    hf_to_mcore,
    mcore_to_hf,
    merge_shards,
    pipeline_layers,
    shard,
)


def qwen2(layers: int = 4, tied: bool = False) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def llama_tied() -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def full_state(model: Any) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


@pytest.mark.parametrize("fused_norms", [False, True], ids=["local-spec", "te-spec"])
@pytest.mark.parametrize("make", [qwen2, llama_tied], ids=["qwen2-gqa-bias", "llama-tied"])
def test_hf_to_megatron_and_back_is_exact(make: Any, fused_norms: bool) -> None:
    model = make()
    layout = MegatronLayout.from_hf_config(model.config, fused_norms=fused_norms)
    hf = full_state(model)
    mc = hf_to_mcore(hf, layout)
    assert ("output_layer.weight" in mc) is not layout.tied_embeddings
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((layout.num_attention_heads + 2 * layout.num_query_groups) * layout.head_dim, 32)
    back = mcore_to_hf(mc, layout)
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_the_qkv_layout_is_megatrons_groups_of_queries_then_key_then_value() -> None:
    layout = MegatronLayout(
        1, 4, num_attention_heads=4, num_query_groups=2, head_dim=1, ffn_hidden_size=4, vocab_size=8
    )
    hf = {
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[10.0], [11.0], [12.0], [13.0]]),
        "model.layers.0.self_attn.k_proj.weight": torch.tensor([[20.0], [21.0]]),
        "model.layers.0.self_attn.v_proj.weight": torch.tensor([[30.0], [31.0]]),
    }
    packed = hf_to_mcore({**hf, **{n: torch.zeros(1) for n in _other_names(layout)}}, layout)[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]
    assert packed.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]  # group 0: q0 q1 k0 v0; group 1: ...


def _other_names(layout: MegatronLayout) -> list[str]:
    p = "model.layers.0."
    return [
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", p + "self_attn.o_proj.weight",
        p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight",
        p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
    ]  # fmt: skip


def test_unknown_or_missing_weights_are_refused_by_name() -> None:
    model = qwen2(layers=1)
    layout = MegatronLayout.from_hf_config(model.config)
    hf = full_state(model)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_norm.weight"):
        hf_to_mcore({**hf, "model.layers.0.self_attn.q_norm.weight": torch.ones(8)}, layout)
    del hf["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        hf_to_mcore(hf, layout)


def test_pipeline_stages_split_layers_evenly_first_stages_taking_the_remainder() -> None:
    assert [list(pipeline_layers(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(pipeline_layers(4, 4, r)) for r in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError):
        pipeline_layers(2, 3, 0)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_tensor_and_pipeline_shards_merge_back_and_hold_their_part(tp: int, pp: int) -> None:
    model = qwen2(layers=4)
    layout = MegatronLayout.from_hf_config(model.config)
    mc = hf_to_mcore(full_state(model), layout)
    shards = [[shard(mc, layout, tp, t, pp, p) for t in range(tp)] for p in range(pp)]
    first, last = shards[0][0], shards[-1][-1]
    assert "embedding.word_embeddings.weight" in first and ("output_layer.weight" in first) is (pp == 1)
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert sum(1 for n in first if n.endswith("linear_fc2.weight")) == 4 // pp  # renumbered from 0 per stage
    assert first["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] == (4 + 2 * 2) * 8 // tp
    assert first["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 48 // tp, 32)
    assert first["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 32 // tp)
    merged = merge_shards(shards, layout)
    assert merged.keys() == mc.keys()
    for name, t in mc.items():
        assert torch.equal(merged[name], t), name


def test_a_tensor_parallel_size_that_does_not_divide_the_query_groups_is_refused() -> None:
    model = qwen2(layers=1)
    layout = MegatronLayout.from_hf_config(model.config)
    with pytest.raises(ValueError, match="query groups"):
        shard(hf_to_mcore(full_state(model), layout), layout, tp_size=4, tp_rank=0)


# -- against megatron-core's own GPTModel, on the CPU -------------------------------------------------------------


def test_converted_weights_load_into_megatrons_gpt_model_and_compute_what_hf_computes(megatron_world: Any) -> None:
    from tauflow.trainer.megatron.model import gpt_model, transformer_config

    hf_model = qwen2(layers=2)
    layout = MegatronLayout.from_hf_config(hf_model.config)
    mc_model = gpt_model(hf_model.config, transformer_config(hf_model.config, use_cpu_initialization=True))
    converted = hf_to_mcore(full_state(hf_model), layout)
    result = mc_model.load_state_dict(converted, strict=False)
    assert result.unexpected_keys == []
    assert all(k.endswith("_extra_state") for k in result.missing_keys), result.missing_keys
    assert mcore_to_hf(mc_model.state_dict(), layout).keys() == full_state(hf_model).keys()

    torch.manual_seed(2)
    hidden = torch.randn(5, 1, 32)  # megatron's [sequence, batch, hidden]
    hf_layer, mc_layer = hf_model.model.layers[1], mc_model.decoder.layers[1]
    with torch.no_grad():
        q, k, v = mc_layer.self_attention.get_query_key_value_tensors(hidden)
        attn = hf_layer.self_attn
        assert torch.allclose(q, attn.q_proj(hidden).view(5, 1, 4, 8), atol=1e-6)
        assert torch.allclose(k, attn.k_proj(hidden).view(5, 1, 2, 8), atol=1e-6)
        assert torch.allclose(v, attn.v_proj(hidden).view(5, 1, 2, 8), atol=1e-6)
        mlp_out, _ = mc_layer.mlp(hidden)
        assert torch.allclose(mlp_out, hf_layer.mlp(hidden), atol=1e-6)
        assert torch.allclose(mc_layer.input_layernorm(hidden), hf_layer.input_layernorm(hidden), atol=1e-6)
        assert torch.allclose(mc_layer.pre_mlp_layernorm(hidden), hf_layer.post_attention_layernorm(hidden), atol=1e-6)
        ids = torch.tensor([[3, 9, 27]])
        embedded = mc_model.embedding(input_ids=ids, position_ids=torch.arange(3)[None])
        assert torch.equal(embedded[:, 0], hf_model.model.embed_tokens(ids)[0])
        logits, _ = mc_model.output_layer(hidden)
        assert torch.allclose(logits, hf_model.lm_head(hidden), atol=1e-6)


def test_the_rotary_base_is_the_checkpoints_and_scaled_rope_is_refused(megatron_world: Any) -> None:
    from transformers import LlamaConfig, Qwen2Config

    from tauflow.trainer.megatron.model import gpt_model, rope_theta, transformer_config

    config = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, rope_theta=1e6)  # fmt: skip
    assert rope_theta(config) == 1e6
    model = gpt_model(config, transformer_config(config, use_cpu_initialization=True))
    head_dim = 8
    expected = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    assert torch.allclose(model.rotary_pos_emb.inv_freq.float(), expected)
    scaled = LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope scaling 'linear'"):
        rope_theta(scaled)


# -- the shards in megatron-core's tensor- and pipeline-parallel model, two gloo ranks on the CPU ---------------------


def _parallel_rank(rank: int, world: int, port: int, tp: int, pp: int, out: Path) -> None:
    """One rank of a TP x PP world: megatron-core's GPTModel with this rank's shard of the converted weights,
    its forward (and with TP its backward) on the CPU; rank 0 writes the logits and gradients it saw."""
    import contextlib

    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from tauflow.trainer.megatron.model import gpt_model, transformer_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tp, pp)
    # the conftest's shim, in this process: megatron-core's hard-coded CUDA device and RNG fork on the CPU
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    tp_rank, pp_rank = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    hf_model = qwen2(layers=4)  # (seeded: every rank builds the same)
    layout = MegatronLayout.from_hf_config(hf_model.config)
    config = transformer_config(hf_model.config, tensor_parallel=tp, pipeline_parallel=pp, use_cpu_initialization=True)
    model = gpt_model(hf_model.config, config, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)
    mine = shard(hf_to_mcore(full_state(hf_model), layout), layout, tp, tp_rank, pp, pp_rank)
    result = model.load_state_dict(mine, strict=False)
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys), result
    ids = torch.tensor([[3, 9, 27, 5, 11], [7, 1, 60, 2, 33]])
    positions = torch.arange(5).expand_as(ids)
    causal = ~torch.ones(5, 5, dtype=torch.bool).tril()[None, None]  # megatron's mask: True where refused
    if pp == 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(model(ids, positions, causal))
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        gathered: list[Any] = [None] * tp
        dist.all_gather_object(gathered, grads)
        if rank == 0:
            hf_grads = mcore_to_hf(merge_shards([gathered], layout), layout)
            out.write_bytes(pickle.dumps({"logits": logits.detach(), "grads": hf_grads}))
    elif pp_rank == 0:  # the first stage's hidden states go on to the last stage
        dist.send(model(ids, positions, causal).detach().contiguous(), dst=1)
    else:
        hidden = torch.empty(5, 2, 32)
        dist.recv(hidden, src=0)
        model.set_input_tensor(hidden)
        out.write_bytes(pickle.dumps({"logits": model(ids, positions, causal).detach()}))
    dist.destroy_process_group()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_each_ranks_shard_in_megatrons_parallel_model_computes_what_hf_computes(
    spawn_ranks: Callable[..., None], tp: int, pp: int, tmp_path: Path
) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the trainer's megatron extra)")
    out = tmp_path / "seen.pkl"
    spawn_ranks(_parallel_rank, tp * pp, tp, pp, out, timeout_s=180)
    seen = pickle.loads(out.read_bytes())
    hf_model = qwen2(layers=4)
    ids = torch.tensor([[3, 9, 27, 5, 11], [7, 1, 60, 2, 33]])
    expected = hf_model(ids).logits
    assert torch.allclose(seen["logits"], expected, atol=1e-5)
    if "grads" in seen:  # TP: every rank's gradient shard, merged, is the HF model's gradient
        expected.float().pow(2).mean().backward()
        for name, p in hf_model.named_parameters():
            assert torch.allclose(seen["grads"][name], p.grad, atol=1e-6), name
