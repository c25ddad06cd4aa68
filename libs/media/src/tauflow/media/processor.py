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
from the tokenizer's special tokens. Needs ``transformers`` and ``torch`` (the ``models`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tauflow.media.codec import decode, resample
from tauflow.media.parts import InvalidMedia, Media, MediaLimits, Modality, PromptPart, Text


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
        self.pad_ids = {
            m: tokenizer.convert_tokens_to_ids(getattr(markers, m)[1])
            for m in ("image", "video", "audio")
            if getattr(markers, m) is not None
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
        import torch

        text: list[str] = []
        images: list[np.ndarray] = []
        videos: list[tuple[np.ndarray, float]] = []
        sounds: list[np.ndarray] = []
        for i, part in enumerate(parts):
            if isinstance(part, Text):
                text.append(part.text)
                continue
            d = decode(part, self.limits, f"{where}[{i}].media")
            marks = getattr(self.markers, str(part.modality))
            if marks is None or (part.modality is Modality.AUDIO and self.feature_extractor is None):
                raise InvalidMedia(f"{where}[{i}].media: this model takes no {part.modality}")
            text.append(f"{marks[0]}\0{part.modality}\0{marks[2]}")  # the count comes once processed
            if d.image is not None:
                images.append(d.image)
            elif d.frames is not None:
                videos.append((d.frames, d.fps))
            else:
                assert d.audio is not None
                sounds.append(resample(d.audio, d.sample_rate, int(self.feature_extractor.sampling_rate)))
        inputs: dict[str, Any] = {}
        counts: dict[str, list[int]] = {"image": [], "video": [], "audio": []}
        grids: dict[str, list[tuple[int, ...]]] = {"image": [], "video": []}
        if images:
            out = self.image_processor(images=images, return_tensors="pt")
            inputs["pixel_values"], inputs["image_grid_thw"] = out["pixel_values"], out["image_grid_thw"]
            grids["image"] = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
            counts["image"] = [int(np.prod(g)) // self.merge**2 for g in grids["image"]]
        if videos:
            patches, vgrids, seconds = [], [], []
            for frames, fps in videos:
                p, g = self._video_patches(frames)
                patches.append(p)
                vgrids.append(g)
                seconds.append(self.temporal / fps)
            inputs["pixel_values_videos"] = torch.cat(patches)
            inputs["video_grid_thw"] = torch.tensor(vgrids, dtype=torch.long)
            inputs["video_second_per_grid"] = torch.tensor(seconds, dtype=torch.float)
            grids["video"] = [tuple(g) for g in vgrids]
            counts["video"] = [int(np.prod(g)) // self.merge**2 for g in vgrids]
        if sounds:
            fe = self.feature_extractor
            out = fe(sounds, sampling_rate=fe.sampling_rate, padding="max_length", return_attention_mask=True,
                     return_tensors="pt")  # fmt: skip
            if max(s.size for s in sounds) > fe.n_samples:
                raise InvalidMedia(f"{where}: a sound is longer than the model's {fe.n_samples / fe.sampling_rate:g} s")
            inputs["input_features"], inputs["feature_attention_mask"] = out["input_features"], out["attention_mask"]
            counts["audio"] = [_audio_tokens(int(n)) for n in out["attention_mask"].sum(-1)]
        return self._assemble(text, parts, inputs, counts, grids)

    def _assemble(self, text: list[str], parts: list[PromptPart], inputs: dict[str, Any],
                  counts: dict[str, list[int]], grids: dict[str, list[tuple[int, ...]]]) -> Processed:  # fmt: skip
        seen = {"image": 0, "video": 0, "audio": 0}
        pieces: list[str] = []
        done: list[PromptPart] = []
        for chunk, part in zip(text, parts, strict=True):
            if isinstance(part, Text):
                pieces.append(chunk)
                done.append(part)
                continue
            kind = str(part.modality)
            n = counts[kind][seen[kind]]
            grid = grids[kind][seen[kind]] if kind in grids else ()
            seen[kind] += 1
            pad = getattr(self.markers, kind)[1]
            pieces.append(chunk.replace(f"\0{kind}\0", pad * n))
            done.append(replace(part, num_tokens=n, grid_thw=grid) if isinstance(part, Media) else part)
        ids = self.tokenizer("".join(pieces), add_special_tokens=False)["input_ids"]
        for kind, pad_id in self.pad_ids.items():
            if ids.count(pad_id) != sum(counts[kind]):  # the tokenizer must keep each pad token whole
                raise ValueError(
                    f"the tokenizer split the {kind} placeholders: {ids.count(pad_id)} != {sum(counts[kind])}"
                )
        return Processed(list(ids), inputs, done)

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


_PLACEHOLDER_TYPES = {  # config attribute -> the modality type transformers gives its tokens (0: text)
    "image_token_id": 1, "image_token_index": 1, "video_token_id": 2, "video_token_index": 2,
    "audio_token_id": 3, "audio_token_index": 3,
}  # fmt: skip


def mm_token_types(config: Any, input_ids: Any) -> Any:
    """Each token's modality (0 text, 1 image, 2 video, 3 audio), as transformers' processors return it."""
    import torch

    types = torch.zeros_like(input_ids)
    for name, kind in _PLACEHOLDER_TYPES.items():
        token = getattr(config, name, None)
        if isinstance(token, int):
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


# Config attributes naming a family's media tokens: placeholders and their open/close markers (Qwen2.5-Omni
# says *_token_index for the placeholders, Qwen2-VL *_token_id).
_MEDIA_TOKEN_ATTRS = (
    "image_token_index", "image_token_id", "video_token_index", "video_token_id", "audio_token_index",
    "audio_token_id", "vision_start_token_id", "vision_end_token_id", "audio_start_token_id", "audio_end_token_id",
)  # fmt: skip


def media_token_ids(config: Any) -> list[int]:
    """The token ids a multimodal model must never generate: its media placeholders and their markers. A
    sampled placeholder would stand for media that do not exist (the next forward fails, or places media
    wrong), so the engine masks them before sampling and the trainer scores with the same mask; empty for a
    text model."""
    ids = {getattr(config, name, None) for name in _MEDIA_TOKEN_ATTRS}
    return sorted(int(i) for i in ids if isinstance(i, int) and i >= 0)
