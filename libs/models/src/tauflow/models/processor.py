"""A prompt's parts to a multimodal model's inputs: the prompt's token ids, with each media part as its
placeholder tokens, and the tensors its encoders take — computed the same way in the rollout (to generate)
and in the trainer (to score the same tokens), so that both run the same forward.

tauflow composes the model folder's own processor components (its tokenizer, image processor and audio
feature extractor, loaded with ``from_pretrained``) and places the placeholders itself, by the family's
rule: an image or a video stands for ``grid_t * grid_h * grid_w / merge_size**2`` tokens, a sound for its
audio encoder's output length. Why not the composite processor (``AutoProcessor``): in transformers 5 it
cannot be built without torchvision (its video processor needs it), which a CPU box or a slim image lacks;
``tests`` compare the two where torchvision is installed. Video frames are patchified from the image
processor's per-frame output in pairs along time, as Qwen2-VL's video processor lays them out.

Families: Qwen2.5-Omni's thinker and Qwen3-Omni's (image, audio, video: ``<|IMAGE|>``, ``<|AUDIO|>``,
``<|VIDEO|>`` between their bos/eos markers), Qwen2-VL and Qwen2.5-VL (image, video:
``<|image_pad|>``/``<|video_pad|>`` between ``<|vision_start|>``/``<|vision_end|>``). The family is read
from the tokenizer's special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tauflow.media.codec import Decoded, decode, resample
from tauflow.media.parts import InvalidMedia, MediaLimits, Modality, PromptPart, Text


@dataclass(frozen=True)
class Markers:
    """How a family spells its media in the prompt: [open, pad token, close] per modality."""

    image: tuple[str, str, str]
    video: tuple[str, str, str]
    audio: tuple[str, str, str] | None  # None: the family takes no audio


OMNI = Markers(
    image=("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>"),
    video=("<|vision_bos|>", "<|VIDEO|>", "<|vision_eos|>"),
    audio=("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"),
)
QWEN_VL = Markers(
    image=("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    video=("<|vision_start|>", "<|video_pad|>", "<|vision_end|>"),
    audio=None,
)


@dataclass
class Processed:
    """One prompt, ready for the model: its token ids and its encoders' inputs (tensors, batch-first per
    media item: several prompts concatenate with ``collate``), and its media parts with the processor's
    grid and token count filled in."""

    token_ids: list[int]
    inputs: dict[str, Any] = field(default_factory=dict)
    parts: list[PromptPart] = field(default_factory=list)


def _audio_tokens(feature_frames: int) -> int:
    # the Qwen audio tower: a stride-2 convolution, then a stride-2 pooling
    return ((feature_frames - 1) // 2 + 1 - 2) // 2 + 1


class PartsProcessor:
    """Parts -> ``Processed`` for one model folder."""

    def __init__(self, tokenizer: Any, image_processor: Any, feature_extractor: Any | None, markers: Markers,
                 limits: MediaLimits) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.feature_extractor: Any = feature_extractor
        self.markers = markers
        self.limits = limits
        self.merge = int(image_processor.merge_size)
        self.temporal = int(image_processor.temporal_patch_size)
        # every token of the family's markers: text that spells one is refused
        self.media_ids = {
            int(tokenizer.convert_tokens_to_ids(t))
            for m in (markers.image, markers.video, markers.audio)
            if m is not None
            for t in m
        }

    @classmethod
    def from_pretrained(cls, path: str | Path, limits: MediaLimits | None = None) -> PartsProcessor | None:
        """The processor of a model folder, or None when the folder has no image processor (a text model)."""
        from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

        folder = Path(path)
        if not (folder / "preprocessor_config.json").exists():
            return None
        tokenizer = AutoTokenizer.from_pretrained(folder)
        vocab = tokenizer.get_vocab()
        markers = next((m for m in (OMNI, QWEN_VL) if m.image[1] in vocab), None)
        if markers is None:
            raise ValueError(f"{folder}: a multimodal model of a family tauflow does not know (docs/omni.md)")
        image_processor = AutoImageProcessor.from_pretrained(folder)
        feature_extractor = None
        if markers.audio is not None and markers.audio[1] in vocab:
            feature_extractor = AutoFeatureExtractor.from_pretrained(folder)
        return cls(tokenizer, image_processor, feature_extractor, markers, limits or MediaLimits())

    def __call__(self, parts: list[PromptPart], where: str = "prompt_parts") -> Processed:
        """The prompt's token ids (text parts tokenized one by one, each media part as its markers around its
        placeholders) and its encoder inputs. A part the model cannot take is refused naming it: media that
        do not decode, a modality the model lacks, media too small for one token or over the prompt's budget,
        text that spells the model's media tokens (it would place media that do not exist), a grid or token
        count given by the producer that this processor does not make."""
        import torch

        ids: list[int] = []
        done: list[PromptPart] = []
        tensors: dict[str, list[Any]] = {}
        budget = self.limits.max_prompt_pixels
        for i, part in enumerate(parts):
            at = f"{where}[{i}]"
            if isinstance(part, Text):
                piece = list(self.tokenizer(part.text, add_special_tokens=False)["input_ids"])
                if self.media_ids.intersection(piece):
                    raise InvalidMedia(f"{at}.text spells the model's media tokens; send media as media parts")
                ids += piece
                done.append(part)
                continue
            at = f"{at}.media"
            marks = getattr(self.markers, str(part.modality))
            if marks is None or (part.modality is Modality.AUDIO and self.feature_extractor is None):
                raise InvalidMedia(f"{at}: this model takes no {part.modality}")
            d = decode(part, self.limits, at)
            pixels = d.image.shape[0] * d.image.shape[1] if d.image is not None else 0
            pixels += int(np.prod(d.frames.shape[:3])) if d.frames is not None else 0
            budget -= pixels
            if budget < 0:
                raise InvalidMedia(f"{at}: the prompt's media pass {self.limits.max_prompt_pixels} pixels in all")
            try:
                inputs, grid, n = self._encode(d)
            except (ValueError, RuntimeError) as e:  # the processor's own refusals (e.g. an extreme aspect ratio)
                raise InvalidMedia(f"{at}: the model's processor refused it ({str(e)[:200]})") from e
            if n < 1:
                raise InvalidMedia(f"{at}: too small for one {part.modality} token of this model")
            if (part.grid_thw and tuple(part.grid_thw) != grid) or (part.num_tokens and part.num_tokens != n):
                raise InvalidMedia(
                    f"{at}: the producer's grid_thw {list(part.grid_thw)} / num_tokens {part.num_tokens} are not "
                    f"this model's {list(grid)} / {n}"
                )
            for key, value in inputs.items():
                tensors.setdefault(key, []).append(value)
            open_id, pad_id, close_id = (self.tokenizer.convert_tokens_to_ids(t) for t in marks)
            ids += [open_id, *[pad_id] * n, close_id]
            done.append(replace(part, num_tokens=n, grid_thw=grid))
        return Processed(ids, {k: torch.cat(v) for k, v in tensors.items()}, done)

    def _encode(self, d: Decoded) -> tuple[dict[str, Any], tuple[int, ...], int]:
        """One decoded part's encoder inputs, its patch grid (empty for audio) and its placeholder count."""
        import torch

        if d.image is not None:
            out = self.image_processor(images=[d.image], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
            return inputs, grid, int(np.prod(grid)) // self.merge**2
        if d.frames is not None:
            patches, vgrid = self._video_patches(d.frames)
            inputs = {
                "pixel_values_videos": patches,
                "video_grid_thw": torch.tensor([vgrid], dtype=torch.long),
                "video_second_per_grid": torch.tensor([self.temporal / d.fps], dtype=torch.float),
            }
            return inputs, tuple(vgrid), int(np.prod(vgrid)) // self.merge**2
        assert d.audio is not None
        fe = self.feature_extractor
        sound = resample(d.audio, d.sample_rate, int(fe.sampling_rate))
        if sound.size > fe.n_samples:
            raise ValueError(f"the sound is longer than the model's {fe.n_samples / fe.sampling_rate:g} s")
        out = fe([sound], sampling_rate=fe.sampling_rate, padding="max_length", return_attention_mask=True,
                 return_tensors="pt")  # fmt: skip
        inputs = {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}
        return inputs, (), _audio_tokens(int(out["attention_mask"].sum()))

    def _video_patches(self, frames: np.ndarray) -> tuple[Any, list[int]]:
        """Qwen2-VL's video layout from the image processor's per-frame normalisation: frames resized and
        normalised one by one, padded to a multiple of the temporal patch by repeating the last, then cut
        into (t, h, w) patches of ``temporal x patch x patch``."""

        if len(frames) % self.temporal:
            frames = np.concatenate([frames, np.repeat(frames[-1:], self.temporal - len(frames) % self.temporal, 0)])
        ip = self.image_processor
        # one image per frame through the processor with temporal repeat 1: its patches hold the normalised
        # pixels; a frame's patch rows come out in (h/m, w/m, m, m) order, each row (C, 1, p, p)
        out = ip(images=list(frames), return_tensors="pt", temporal_patch_size=1)
        t, (gh, gw) = len(frames) // self.temporal, [int(x) for x in out["image_grid_thw"][0][1:]]
        p = int(ip.patch_size)
        rows = out["pixel_values"].reshape(len(frames), gh * gw, 3, p, p)
        rows = rows.reshape(t, self.temporal, gh * gw, 3, p, p).permute(0, 2, 3, 1, 4, 5)
        return rows.reshape(t * gh * gw, 3 * self.temporal * p * p), [t, gh, gw]


def collate(items: list[Processed]) -> dict[str, Any]:
    """The encoders' inputs of several prompts (or of one prompt's samples), concatenated in order."""
    import torch

    keys = sorted({k for it in items for k in it.inputs})
    return {k: torch.cat([it.inputs[k] for it in items if k in it.inputs]) for k in keys}


def accepted_inputs(model: Any, inputs: dict[str, Any], input_ids: Any = None) -> dict[str, Any]:
    """``inputs`` under the names ``model.forward`` takes: Qwen2.5-VL calls the video timing
    ``second_per_grid_ts``, Qwen2-VL takes none; a model that asks for ``mm_token_type_ids`` (Qwen2-VL in
    transformers 5: each token's modality, for its 3-D rope) gets them from ``input_ids`` ([B, T])."""
    import inspect

    params = inspect.signature(model.forward).parameters
    out = dict(inputs)
    seconds = out.pop("video_second_per_grid", None)
    if seconds is not None:
        for name in ("video_second_per_grid", "second_per_grid_ts"):
            if name in params:
                out[name] = seconds
    if out and input_ids is not None and "mm_token_type_ids" in params:
        out["mm_token_type_ids"] = mm_token_types(model.config, input_ids)
    return {k: v for k, v in out.items() if k in params or any(p.kind == p.VAR_KEYWORD for p in params.values())}


def mm_token_types(config: Any, input_ids: Any) -> Any:
    """Each token's modality (0 text, 1 image, 2 video, 3 audio), as transformers' processors return it."""
    import torch

    types = torch.zeros_like(input_ids)
    for name, kind in _MEDIA_TOKEN_TYPES.items():
        token = getattr(config, name, None)
        if kind and isinstance(token, int):
            types = torch.where(input_ids == token, kind, types)
    return types


def load_model(path: str | Path, **kwargs: Any) -> Any:
    """The generating model of a local folder (``from_pretrained``): a causal LM, or for a multimodal folder
    (one with a preprocessor) the image-text-to-text class its config names (Qwen2-VL, Qwen2.5-VL, the
    Qwen2.5-Omni thinker)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = (Path(path) / "preprocessor_config.json").exists()
    return (AutoModelForImageTextToText if multimodal else AutoModelForCausalLM).from_pretrained(path, **kwargs)


ENCODERS = ("visual", "vision_tower", "audio_tower")  # Qwen's module names for the media encoders


def freeze_encoders(model: Any) -> int:
    """Stops the media encoders' parameters from training (the language model trains alone); returns how
    many parameters it froze."""
    frozen = 0
    for name, p in model.named_parameters():
        if any(part in ENCODERS for part in name.split(".")):
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


# Config attributes naming a family's media tokens: the placeholders (with the modality type transformers
# gives their tokens: 1 image, 2 video, 3 audio; Qwen2.5-Omni says *_token_index, Qwen2-VL *_token_id) and
# the markers around them (type 0: text).
_MEDIA_TOKEN_TYPES = {
    "image_token_id": 1, "image_token_index": 1, "video_token_id": 2, "video_token_index": 2,
    "audio_token_id": 3, "audio_token_index": 3, "vision_start_token_id": 0, "vision_end_token_id": 0,
    "audio_start_token_id": 0, "audio_end_token_id": 0,
}  # fmt: skip


def media_token_ids(config: Any) -> list[int]:
    """The token ids a multimodal model must never generate: its media placeholders and their markers. A
    sampled placeholder would stand for media that do not exist (the next forward fails, or places media
    wrong), so the engine masks them before sampling and the trainer scores with the same mask; empty for a
    text model."""
    ids = {getattr(config, name, None) for name in _MEDIA_TOKEN_TYPES}
    return sorted(int(i) for i in ids if isinstance(i, int) and i >= 0)
