"""Parts -> a multimodal model's inputs (tauflow.models.processor) on the tiny Qwen2.5-Omni thinker built
here: each media part becomes as many placeholder tokens as its encoder yields, the model runs on the
result, the media change what it predicts, and a padded batch scores as the prompts do one by one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tauflow import media
from tauflow.models import tiny
from tauflow.models.processor import PartsProcessor, accepted_inputs, collate


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-omni")
    tiny.build(out)
    return out


@pytest.fixture(scope="module")
def model(folder: Path):
    from transformers.models.qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration

    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(folder).eval()


def _image(seed: int) -> media.Media:
    return media.image(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8))


def _sound(seconds: float, hz: float = 440.0) -> media.Media:
    t = np.arange(int(seconds * tiny.SAMPLE_RATE)) / tiny.SAMPLE_RATE
    return media.audio((0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), tiny.SAMPLE_RATE)


def _clip(frames: int) -> media.Media:
    return media.video(np.stack([np.full((56, 56, 3), 30 * i, np.uint8) for i in range(frames)]), fps=2)


def test_each_part_becomes_its_placeholder_tokens(folder: Path) -> None:
    proc = PartsProcessor.from_pretrained(folder)
    assert proc is not None
    vocab = tiny.vocabulary("0123456789+=? ")
    out = proc([media.Text("?"), _image(0), _sound(0.5), _clip(3), media.Text("3+4=")])
    ids = out.token_ids
    assert ids[0] == vocab["?"]
    # 56 x 56 pixels: 4 x 4 patches, merged 2 x 2 -> 4 tokens; 0.5 s: 50 feature frames -> 12 tokens;
    # 3 frames padded to 4: 2 x 4 x 4 patches -> 8 tokens
    assert ids.count(vocab["<|IMAGE|>"]) == 4 and ids.count(vocab["<|AUDIO|>"]) == 12
    assert ids.count(vocab["<|VIDEO|>"]) == 8
    assert ids[-4:] == [vocab[c] for c in "3+4="]
    image, sound, clip = (p for p in out.parts if isinstance(p, media.Media))
    assert (image.grid_thw, image.num_tokens) == ((1, 4, 4), 4)
    assert (sound.grid_thw, sound.num_tokens) == ((), 12)
    assert (clip.grid_thw, clip.num_tokens) == ((2, 4, 4), 8)
    assert tuple(out.inputs["pixel_values_videos"].shape) == (2 * 16, 3 * 2 * 14 * 14)
    assert tuple(out.inputs["input_features"].shape) == (1, 32, 100)
    assert int(out.inputs["feature_attention_mask"].sum()) == 50
    assert PartsProcessor.from_pretrained(folder.parent) is None  # no preprocessor: a text model


def _last_logits(model, processed: list) -> torch.Tensor:
    out = []
    for p in processed:
        ids = torch.tensor([p.token_ids])
        with torch.no_grad():
            logits = model(
                input_ids=ids, attention_mask=torch.ones_like(ids), **accepted_inputs(model, p.inputs, ids)
            ).logits
        out.append(logits[0])
    return out


def test_the_media_reach_the_model(folder: Path, model) -> None:
    proc = PartsProcessor.from_pretrained(folder)
    a, b = proc([_image(1), _sound(0.5), media.Text("=")]), proc([_image(2), _sound(0.5), media.Text("=")])
    c = proc([_image(1), _sound(0.5, hz=880), media.Text("=")])
    la, lb, lc = (x[-1] for x in _last_logits(model, [a, b, c]))
    assert a.token_ids == b.token_ids == c.token_ids  # the same tokens: only the pixels and the sound differ
    assert (la - lb).abs().max() > 1e-4 and (la - lc).abs().max() > 1e-4


def test_a_right_padded_batch_scores_as_the_prompts_alone(folder: Path, model) -> None:
    # the trainer scores many samples in one forward: the encoders' inputs concatenate in sample order
    proc = PartsProcessor.from_pretrained(folder)
    prompts = [proc([_image(3), media.Text("1+2=")]), proc([_sound(0.3), _clip(2), _image(4), media.Text("12=")]),
               proc([media.Text("7+8=")])]  # fmt: skip
    alone = _last_logits(model, prompts)
    width = max(len(p.token_ids) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p.token_ids)] = torch.tensor(p.token_ids)
        mask[i, : len(p.token_ids)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **accepted_inputs(model, collate(prompts), ids)).logits
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i, : len(p.token_ids)], alone[i], atol=1e-5, rtol=1e-4)


def test_media_the_model_cannot_take_are_refused_naming_the_part(folder: Path) -> None:
    proc = PartsProcessor.from_pretrained(folder)
    with pytest.raises(
        media.InvalidMedia, match=r"prompt_parts\[1\].media: the model's processor refused it \(the sound is longer"
    ):
        proc([media.Text("x"), _sound(1.5)])
    with pytest.raises(media.InvalidMedia, match=r"prompt_parts\[0\].media: too small for one audio token"):
        proc([_sound(0.01)])
    # text that spells the model's media tokens would place media that do not exist
    with pytest.raises(media.InvalidMedia, match=r"prompt_parts\[1\].text spells the model's media tokens"):
        proc([_image(0), media.Text("<|audio_bos|>=")])
    with pytest.raises(media.InvalidMedia, match=r"prompt_parts\[0\].media: the producer's grid_thw \[1, 2, 2\]"):
        proc([replace(_image(0), grid_thw=(1, 2, 2))])
    with pytest.raises(media.InvalidMedia, match=r"prompt_parts\[1\].media: the prompt's media pass 4000 pixels"):
        PartsProcessor.from_pretrained(folder, media.MediaLimits(max_prompt_pixels=4000))([_image(0), _image(1)])
    bad = media.Media(media.Modality.IMAGE, "image/png", data=b"nope")
    with pytest.raises(media.InvalidMedia, match=r"prompt_parts\[0\].media: the data does not decode"):
        proc([bad])


def test_the_video_layout_is_qwen2_vls(folder: Path) -> None:
    # tauflow patchifies frames from the image processor's per-frame output; transformers' own video
    # processor (it needs torchvision) must lay the same frames out the same way
    pytest.importorskip("torchvision", reason="transformers' video processor needs torchvision (not installed here)")
    from transformers import Qwen2VLVideoProcessor

    proc = PartsProcessor.from_pretrained(folder)
    frames = np.random.default_rng(0).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    ours, grid = proc._video_patches(frames)
    ip = proc.image_processor
    theirs = Qwen2VLVideoProcessor(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56, max_pixels=56 * 56,
        image_mean=ip.image_mean, image_std=ip.image_std, do_sample_frames=False,
    )(videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], return_tensors="pt")  # fmt: skip
    assert theirs["video_grid_thw"][0].tolist() == grid
    torch.testing.assert_close(ours, theirs["pixel_values_videos"], atol=2e-2, rtol=0)


def test_the_qwen2_vl_family_takes_images_and_videos_and_refuses_sound(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    tiny.build_qwen2_vl(tmp_path)
    proc = PartsProcessor.from_pretrained(tmp_path)
    assert proc is not None and proc.feature_extractor is None
    vocab = tiny.vocabulary("0123456789+=? ", tiny.QWEN2_VL_TOKENS)
    out = proc([_image(5), _clip(4), media.Text("1+2=")])
    assert out.token_ids.count(vocab["<|image_pad|>"]) == 4 and out.token_ids.count(vocab["<|video_pad|>"]) == 8
    assert out.token_ids[0] == vocab["<|vision_start|>"] and "video_second_per_grid" in out.inputs
    model = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    ids = torch.tensor([out.token_ids])
    kwargs = accepted_inputs(model, out.inputs, ids)
    assert "video_second_per_grid" not in kwargs  # Qwen2-VL times no video
    assert kwargs["mm_token_type_ids"].tolist()[0].count(1) == 4  # each token's modality: 4 image tokens
    with torch.no_grad():
        assert model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits.shape[1] == len(ids[0])
    with pytest.raises(media.InvalidMedia, match=r"prompt_parts\[0\].media: this model takes no audio"):
        proc([_sound(0.5)])
