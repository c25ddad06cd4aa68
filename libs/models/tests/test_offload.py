"""ParameterOffload: a model's parameters go to host memory and come back the same, the Parameter objects and
their ties kept; a replacement adopted while offloaded is served as it is; on a GPU the memory is freed."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tauflow.models.offload import ParameterOffload


def tied_model(device: str = "cpu", vocab_size: int = 32, hidden_size: int = 32) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).to(device).eval()


IDS = torch.tensor([[1, 5, 7, 2, 9, 3]])


def logits(model: Qwen2ForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS.to(model.device)).logits.cpu()


def unique_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # (parameters() skips a tie's twin)


def test_parameters_leave_and_come_back_the_same_objects_and_ties_kept() -> None:
    model = tied_model()
    before = logits(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    total = unique_bytes(model)
    offload = ParameterOffload([model, model])  # (a module listed twice, and a tie: each parameter once)

    moved = offload.to_host()
    assert moved == total
    assert offload.offloaded and offload.offloaded_bytes == moved and offload.offloads == 1
    assert all(p.numel() == 0 for p in model.parameters())
    assert offload.to_host() == 0 and offload.offloads == 1  # nothing left to move

    assert offload.to_device() == moved
    assert not offload.offloaded and offload.offloaded_bytes == 0
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[n] is params[n] for n in params)  # the same Parameter objects
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_optimizer_keeps_stepping_its_parameters_across_offloads(device: str) -> None:
    # each offload takes the values of now (a buffer filled once and reused would bring step 1's back)
    reference, model = tied_model(device), tied_model(device)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    offload = ParameterOffload([model])
    for _ in range(3):
        for m, opt in zip((reference, model), opts, strict=True):
            offload.to_device()
            loss = m(input_ids=IDS.to(device), labels=IDS.to(device)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        offload.to_host()
    offload.to_device()
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


def test_an_adopted_replacement_is_served_and_a_mismatched_one_is_refused() -> None:
    model, newer = tied_model(), tied_model()
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.5)
    offload = ParameterOffload([model])
    embed = model.model.embed_tokens.weight
    assert not offload.adopt(embed, newer.model.embed_tokens.weight.clone())  # on its device: the caller copies

    offload.to_host()
    with pytest.raises(ValueError, match="cannot replace"):
        offload.adopt(embed, torch.zeros(3, 3))
    with torch.inference_mode(), pytest.raises(ValueError, match="inference-mode"):
        offload.adopt(embed, torch.zeros(embed.shape))
    assert embed.numel() == 0  # refused: still offloaded, unchanged
    new_values = dict(newer.named_parameters())
    for name, p in model.named_parameters():
        assert offload.adopt(p, new_values[name].detach().clone())
    assert not offload.offloaded and offload.to_device() == 0  # nothing left to copy back
    torch.testing.assert_close(logits(model), logits(newer), rtol=0, atol=0)

    shapes = {id(p): p.shape for p in model.parameters()}
    offload.to_host()  # a partial replacement: the rest comes back from host memory
    first = next(iter(model.parameters()))
    assert offload.adopt(first, torch.zeros(shapes[id(first)]))
    offload.to_device()
    assert bool((first == 0).all())
    torch.testing.assert_close(model.model.norm.weight, newer.model.norm.weight, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_offload_hands_the_weights_memory_back_to_the_driver() -> None:
    model = tied_model("cuda", vocab_size=65536, hidden_size=512)  # a 128 MiB embedding: well above the blocks
    before = logits(model)
    total = unique_bytes(model)
    offload = ParameterOffload([model])
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    assert offload.to_host() == total
    assert all(p.device.type == "cuda" and p.numel() == 0 for p in model.parameters())
    assert allocated - torch.cuda.memory_allocated() >= total * 0.99
    assert reserved - torch.cuda.memory_reserved() >= total * 0.9  # back with the driver, not cached
    assert all(buf.is_pinned() for buf in offload._host.values())

    offload.to_device()
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)
