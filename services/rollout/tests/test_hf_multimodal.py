"""The hf engine on a multimodal model (the tiny Qwen2.5-Omni thinker, issue #15): prompts with an image,
a sound and a video decode beside text prompts in one running batch; each completion's behaviour log-probs
are the model's full forward on the prompt's parts (what the trainer computes, the media tokens masked: they
are never sampled) within 1e-4; a prompt's
media are encoded once for its n samples; a weight swap mid-generation recomputes the cache with them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tauflow import media
from tauflow.models import tiny
from tauflow.models.processor import PartsProcessor, Processed, accepted_inputs, load_model, media_token_ids
from tauflow.rollout.engine import FinishReason, InvalidRequestError, SamplingParams
from tauflow.rollout.engine.hf import HFEngine


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-omni")
    tiny.build(out)
    return out


@pytest.fixture(scope="module")
def prompts(omni: Path) -> list[Processed]:
    proc = PartsProcessor.from_pretrained(omni)
    assert proc is not None
    rng = np.random.default_rng(0)
    t = np.arange(int(0.4 * tiny.SAMPLE_RATE)) / tiny.SAMPLE_RATE
    sound = media.audio((0.3 * np.sin(2 * np.pi * 500 * t)).astype(np.float32), tiny.SAMPLE_RATE)
    clip = media.video(np.stack([np.full((56, 56, 3), 50 * i, np.uint8) for i in range(4)]), fps=2)
    image = media.image(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
    return [
        proc([image, sound, media.Text("3+4=")]),
        proc([media.Text("12+30=")]),  # a text prompt to the multimodal model
        proc([clip, media.Text("?="), image]),
        proc([sound, media.Text("1=")]),
    ]


def _full_logprobs(model: Any, p: Processed, completion: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([p.token_ids + completion])
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), **accepted_inputs(model, p.inputs, ids)
        ).logits
    scaled = logits[0, :-1].float() / temperature
    scaled[:, media_token_ids(model.config)] = float("-inf")  # never sampled: the engine masks them
    lp = torch.log_softmax(scaled, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(p.token_ids) - 1 :].tolist()


def test_behaviour_logprobs_are_the_full_forward_on_the_parts(omni: Path, prompts: list[Processed]) -> None:
    engine = HFEngine.from_pretrained(omni, seed=0)
    reference = load_model(omni).eval()
    try:
        params = SamplingParams(max_new_tokens=6, n=3, temperature=1.0, ignore_eos=True, seed=5)
        out = engine.submit([p.token_ids for p in prompts], params, [p.inputs for p in prompts]).result(60)
        for p, group in zip(prompts, out, strict=True):
            assert len(group) == 3
            for c in group:
                assert len(c.token_ids) == 6 and c.finish_reason is FinishReason.LENGTH
                assert c.logprobs == pytest.approx(_full_logprobs(reference, p, c.token_ids, 1.0), abs=1e-4)
        # each prompt was prefilled once for its three samples
        assert engine.stats().counters["prefill_tokens"] == sum(len(p.token_ids) for p in prompts)
        # the media matter: the same tokens with another image draw other log-probs
        other = dict(prompts[0].inputs, pixel_values=prompts[0].inputs["pixel_values"].flip(0))
        again = engine.submit([prompts[0].token_ids], params, [other]).result(60)[0]
        assert again[0].logprobs != pytest.approx(out[0][0].logprobs, abs=1e-3)
    finally:
        engine.close()


def test_a_weight_swap_mid_generation_recomputes_the_media_rows(omni: Path, prompts: list[Processed]) -> None:
    engine = HFEngine.from_pretrained(omni, seed=0)
    new = load_model(omni).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    decode, calls, futures = engine._decode_step, [0], []

    def hooked(batch: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            futures.append(engine.stage_weights(1, new.state_dict()))
        decode(batch)

    engine._decode_step = hooked
    try:
        params = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, ignore_eos=True, seed=9)
        out = engine.submit([p.token_ids for p in prompts], params, [p.inputs for p in prompts]).result(60)
        assert futures[0].result(10) == 1
        for p, group in zip(prompts, out, strict=True):
            for c in group:
                assert c.versions == [0] * 3 + [1] * 3
                assert c.logprobs[3:] == pytest.approx(_full_logprobs(new, p, c.token_ids, 1.0)[3:], abs=1e-4)
    finally:
        engine.close()


def test_media_a_text_model_cannot_take_are_refused(engine: HFEngine, prompts: list[Processed]) -> None:
    with pytest.raises(InvalidRequestError, match="prompt 0 has media and the model is a text model"):
        engine.submit([[1, 2]], SamplingParams(max_new_tokens=2), [prompts[0].inputs])
    with pytest.raises(InvalidRequestError, match="2 media entries for 1 prompts"):
        engine.submit([[1, 2]], SamplingParams(max_new_tokens=2), [None, None])


def test_qwen2_vl_behaviour_logprobs_are_the_full_forward_too(tmp_path: Path) -> None:
    tiny.build_qwen2_vl(tmp_path)
    proc = PartsProcessor.from_pretrained(tmp_path)
    assert proc is not None
    rng = np.random.default_rng(1)
    clip = media.video(np.stack([np.full((56, 56, 3), 60 * i, np.uint8) for i in range(2)]), fps=1)
    prompts = [proc([media.image(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)), media.Text("1+2=")]),
               proc([clip, media.Text("=")]), proc([media.Text("5+5=")])]  # fmt: skip
    engine, reference = HFEngine.from_pretrained(tmp_path, seed=0), load_model(tmp_path).eval()
    try:
        params = SamplingParams(max_new_tokens=4, n=2, temperature=1.0, ignore_eos=True, seed=2)
        out = engine.submit([p.token_ids for p in prompts], params, [p.inputs for p in prompts]).result(60)
        for p, group in zip(prompts, out, strict=True):
            for c in group:
                assert c.logprobs == pytest.approx(_full_logprobs(reference, p, c.token_ids, 1.0), abs=1e-4)
    finally:
        engine.close()


def test_media_tokens_without_their_media_are_refused(omni: Path) -> None:
    from tauflow.rollout.engine.base import ScoredSequence

    engine = HFEngine.from_pretrained(omni, seed=0)
    try:
        image_token = tiny.vocabulary("0123456789+=? ")["<|IMAGE|>"]
        with pytest.raises(InvalidRequestError, match="prompt 0 holds the model's media tokens without its media"):
            engine.submit([[1, image_token, 5]], SamplingParams(max_new_tokens=2))
        with pytest.raises(InvalidRequestError, match=r"sequences\[0\] holds the model's media tokens"):
            engine.submit_scoring([ScoredSequence([1, 5], [image_token])])
    finally:
        engine.close()
