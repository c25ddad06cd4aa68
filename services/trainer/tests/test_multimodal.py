"""A multimodal policy in the trainer (issue #15): a group's prompt parts become the encoders' inputs once,
shared by its samples; the trainer's log-probs of a batch of such samples equal the model's own forward on
each sample alone; the encoders stay frozen unless train_encoders; a group the model cannot take (its
prompt tokens are not the processor's, or a text policy gets media) is skipped, named in the log."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tauflow import media
from tauflow.models import tiny
from tauflow.models.processor import PartsProcessor, accepted_inputs, media_token_ids
from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.batch import Group, Sample, completion_logprobs, pack, unpack
from tauflow.trainer.optim import OptimConfig


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-omni")
    tiny.build(out)
    return out


def _parts(seed: int) -> list[media.PromptPart]:
    rng = np.random.default_rng(seed)
    t = np.arange(int(0.3 * tiny.SAMPLE_RATE)) / tiny.SAMPLE_RATE
    sound = media.audio((0.3 * np.sin(2 * np.pi * (300 + 100 * seed) * t)).astype(np.float32), tiny.SAMPLE_RATE)
    return [media.image(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)), sound, media.Text("3+4=")]


def _group(proc: PartsProcessor, seed: int, n: int = 3) -> Group:
    parts = _parts(seed)
    prompt = proc(parts).token_ids
    rng = np.random.default_rng(seed)
    samples = [
        Sample(prompt, [int(x) for x in rng.integers(10, 24, 3)], [-1.0] * 3, reward=float(i % 2), sample_id=str(i))
        for i in range(n)
    ]
    return Group(f"g{seed}", samples, prompt_parts=parts)


def test_the_trainers_logprobs_are_the_models_own_on_each_sample(omni: Path) -> None:
    backend = TorchBackend(TorchBackendConfig(model_path=str(omni)))
    assert backend.processor is not None
    groups = [_group(backend.processor, 1), _group(backend.processor, 2, n=2)]
    assert backend._attach_media(groups) == {}
    samples = [s for g in groups for s in g.samples]
    assert samples[0].media is samples[1].media  # computed once per group
    model = backend.model.eval()
    with torch.no_grad():
        batched = unpack(completion_logprobs(model, pack(samples, banned_ids=backend.banned_ids)).logprobs, samples)
        for s, got in zip(samples, batched, strict=True):
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = model(
                input_ids=ids, attention_mask=torch.ones_like(ids), **accepted_inputs(model, s.media, ids)
            ).logits
            scaled = logits[0, :-1].float()
            scaled[:, media_token_ids(model.config)] = float("-inf")  # as the engine, which never samples them
            lp = torch.log_softmax(scaled, -1).gather(-1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(got), lp[len(s.prompt_ids) - 1 :], atol=1e-5, rtol=0)


def _encoders(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "visual" in n or "audio_tower" in n}


@pytest.mark.parametrize("train_encoders", [False, True])
def test_a_step_trains_the_language_model_and_the_encoders_only_when_asked(omni: Path, train_encoders: bool) -> None:
    backend = TorchBackend(
        TorchBackendConfig(
            model_path=str(omni), optim=OptimConfig(lr=1e-2, warmup_steps=0), train_encoders=train_encoders
        )
    )
    before, lm = _encoders(backend.model), backend.model.get_input_embeddings().weight.detach().clone()
    result = backend.train_step([_group(backend.processor, 3, n=4), _group(backend.processor, 4, n=4)])
    assert result.committed and result.trained_tokens == 24
    after = _encoders(backend.model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert bool(changed) is train_encoders, changed
    assert not torch.equal(lm, backend.model.get_input_embeddings().weight)


def test_groups_the_model_cannot_take_are_skipped_not_trained(omni: Path, tiny_model_dir: Path) -> None:
    backend = TorchBackend(TorchBackendConfig(model_path=str(omni)))
    good, forged, text = _group(backend.processor, 5), _group(backend.processor, 6), _group(backend.processor, 7)
    for s in forged.samples:
        s.prompt_ids = s.prompt_ids[1:]  # not what the processor makes of the parts
    text.prompt_parts = []
    for s in text.samples:
        s.prompt_ids = s.prompt_ids[-4:]  # a text prompt to the multimodal model: trained as sent
    broken = _group(backend.processor, 9)
    broken.prompt_parts = [media.Media(media.Modality.IMAGE, "image/png", data=b"not a png"), media.Text("=")]
    # media tokens where no media are (a completion, a text prompt) would fail the whole micro-batch's forward
    image_token = backend.banned_ids[0]
    sneaky_completion = _group(backend.processor, 10)
    sneaky_completion.samples[1].completion_ids[0] = image_token
    sneaky_prompt = _group(backend.processor, 11)
    sneaky_prompt.prompt_parts = []
    for s in sneaky_prompt.samples:
        s.prompt_ids = [image_token, *s.prompt_ids[-4:]]
    result = backend.train_step([good, forged, text, broken, sneaky_completion, sneaky_prompt])
    assert result.groups == 2 and result.metrics["skipped_invalid_media_groups"] == 4
    assert {"g6", "g9", "g10", "g11"}.isdisjoint(backend.trained_group_ids)
    assert {"g5", "g7"} <= backend.trained_group_ids
    # a text policy cannot see the media: it does not train on the prompt's placeholders alone
    text_backend = TorchBackend(TorchBackendConfig(model_path=str(tiny_model_dir)))
    assert text_backend.processor is None
    g = Group(
        "m", [Sample([1, 2], [3, 4], [-1.0, -1.0], reward=float(i % 2)) for i in range(2)], prompt_parts=_parts(8)
    )
    assert text_backend._attach_media([g]) == {"m": "the prompt has media and the policy is a text model"}
