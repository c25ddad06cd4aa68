"""The hf engine on CUDA (marked ``gpu``: skipped without a CUDA device; scripts/gpu-check runs it): float32
log-probs equal a full forward of the same weights, bfloat16 serves with log-probs close to its own full
forward, and a version staged from CPU tensors swaps in on the device mid-generation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tauflow.rollout.engine import FinishReason, SamplingParams
from tauflow.rollout.engine.hf import HFEngine

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 5, 6, 7], [1, 3], [1, 9, 10, 11, 12, 13, 14]]


def _full_logprobs_on(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion], device=device)).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-3), ("bfloat16", 0.1)])
def test_cuda_generation_log_probs_match_a_full_forward(model_dir: Path, dtype: str, tolerance: float) -> None:
    engine = HFEngine.from_pretrained(model_dir, device="cuda", dtype=dtype, seed=3)
    try:
        assert next(engine._model.parameters()).is_cuda
        out = engine.submit(PROMPTS, SamplingParams(max_new_tokens=10, n=4, temperature=0.8, seed=5)).result(60)
        for prompt, group in zip(PROMPTS, out, strict=True):
            assert len(group) == 4
            for c in group:
                assert 1 <= len(c.token_ids) <= 10 and c.versions == [0] * len(c.token_ids)
                expected = _full_logprobs_on(engine._model, prompt, c.token_ids, 0.8)
                assert c.logprobs == pytest.approx(expected, abs=tolerance)
    finally:
        engine.close()


def test_cuda_swap_mid_generation_switches_versions_per_token(model_dir: Path, make_model: Any) -> None:
    engine = HFEngine.from_pretrained(model_dir, device="cuda", dtype="float32", seed=3)
    try:
        new_model = make_model(seed=1)  # on the CPU: the engine copies it to its device at the safe point
        decode, calls, staged = engine._decode_step, [0], []

        def hooked(batch: Any) -> None:
            calls[0] += 1
            if calls[0] == 3:
                staged.append(engine.stage_weights(1, new_model.state_dict()))
            decode(batch)

        engine._decode_step = hooked  # type: ignore[method-assign]
        params = SamplingParams(max_new_tokens=12, n=2, temperature=0.9, ignore_eos=True, seed=7)
        out = engine.submit(PROMPTS, params).result(60)
        assert staged[0].result(10) == 1 and engine.policy_version == 1
        reference = new_model.to("cuda")
        for prompt, group in zip(PROMPTS, out, strict=True):
            for c in group:
                assert c.finish_reason is FinishReason.LENGTH and c.versions == [0] * 4 + [1] * 8
                new = _full_logprobs_on(reference, prompt, c.token_ids, 0.9)
                assert c.logprobs[4:] == pytest.approx(new[4:], abs=1e-3)
        assert all(p.is_cuda for p in engine._model.parameters())
    finally:
        engine.close()


def test_cuda_an_idle_engine_hands_its_cached_memory_back_when_colocated(model_dir: Path) -> None:
    # release_memory_when_idle (colocated mode): what the caching allocator holds unused goes back to the driver
    # each time the engine runs out of work, where a trainer in another process can have it.
    engine = HFEngine.from_pretrained(model_dir, device="cuda", dtype="float32", release_memory_when_idle=True)
    try:
        import time

        # A first request: the engine thread's cuBLAS workspace (32 MiB on Hopper, allocated through the caching
        # allocator and kept by cuBLAS: no release can hand it back) exists before the measure.
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=0)).result(60)
        deadline = time.monotonic() + 10
        while engine.memory_releases == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del scratch  # 64 MiB cached by this process's allocator, unused
        cached = torch.cuda.memory_reserved()
        releases = engine.memory_releases
        engine.submit(PROMPTS, SamplingParams(max_new_tokens=8, n=2, seed=1)).result(60)
        deadline = time.monotonic() + 10
        while engine.memory_releases == releases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.memory_releases > releases
        assert torch.cuda.memory_reserved() <= cached - (64 << 20)
    finally:
        engine.close()


def test_cuda_an_idle_engine_offloads_its_weights_and_serves_the_next_version_exactly(
    model_dir: Path, make_model: Any
) -> None:
    # offload_weights_when_idle (colocated mode): after serving, the idle engine's weights leave the GPU (pinned
    # host copies); a version staged meanwhile becomes the weights without the old ones coming back.
    import time

    engine = HFEngine.from_pretrained(model_dir, device="cuda", dtype="float32", offload_weights_when_idle=True)

    def offloads(count: int) -> None:
        deadline = time.monotonic() + 10
        while engine.counters["weight_offloads"] < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.counters["weight_offloads"] == count
        assert all(p.device.type == "cuda" and p.numel() == 0 for p in engine._model.parameters())
        torch.cuda.synchronize()

    try:
        weight_bytes = sum(p.numel() * p.element_size() for p in engine._model.parameters())
        # A first request: the engine thread's cuBLAS workspace (32 MiB on Hopper, through the caching allocator,
        # kept by cuBLAS) exists before the measure; this model's weights are far smaller.
        engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=0)).result(60)
        offloads(1)
        offloaded = torch.cuda.memory_allocated()
        engine.submit(PROMPTS, SamplingParams(max_new_tokens=8, seed=1)).result(60)  # the weights back, then out
        offloads(2)
        assert torch.cuda.memory_allocated() <= offloaded + weight_bytes // 2  # (weights kept: + weight_bytes)

        v1 = make_model(seed=1)
        assert engine.stage_weights(1, v1.state_dict()).result(30) == 1  # CPU tensors, staged on the GPU
        c = engine.submit(PROMPTS[:1], SamplingParams(max_new_tokens=8, seed=2)).result(60)[0][0]
        assert set(c.versions) == {1}
        expected = _full_logprobs_on(v1.to("cuda"), PROMPTS[0], c.token_ids, 1.0)
        assert c.logprobs == pytest.approx(expected, abs=1e-4)
    finally:
        engine.close()
