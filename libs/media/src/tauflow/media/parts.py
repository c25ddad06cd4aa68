"""A prompt's typed parts and the bounds every service applies to them (common.v1 revision 3).

A prompt is a list of parts in order: text, or media (an image, a sound, a video) carried as its encoded
bytes or as a ``file://`` URI under a media root that every service of the run mounts. Sizes given with a
part (pixels, samples, frames) are checked against its decode; the processor's grid and token count are
checked by a consumer that runs the same processor.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Modality(enum.StrEnum):
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"


class InvalidMedia(ValueError):
    """A part that is malformed, over a bound, or does not decode; the message names the part."""


# Media types each modality accepts, with the decoder that reads them: Pillow's format name for images,
# FFmpeg's demuxer for audio and video. The demuxer is named, never probed, so that no hostile file picks a
# demuxer that reads other files or URLs (a playlist, a concat list).
IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF", "image/bmp": "BMP"}
AUDIO_TYPES = {
    "audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/flac": "flac", "audio/mpeg": "mp3",
    "audio/ogg": "ogg",
}  # fmt: skip
VIDEO_TYPES = {"video/mp4": "mp4", "video/webm": "webm", "video/x-matroska": "matroska", "video/quicktime": "mov"}
MEDIA_TYPES = {Modality.IMAGE: IMAGE_TYPES, Modality.AUDIO: AUDIO_TYPES, Modality.VIDEO: VIDEO_TYPES}


@dataclass(frozen=True)
class MediaLimits:
    """The bounds on a prompt's parts (docs/omni.md). The wire bounds are the contract's; the decoded
    bounds keep a small file from expanding into gigabytes (a decompression bomb)."""

    max_parts: int = 64
    max_text_chars: int = 1 << 20
    max_media_bytes: int = 32 << 20
    max_uri_chars: int = 2048
    max_media_type_chars: int = 128
    max_image_pixels: int = 4096 * 4096  # and of each video frame
    max_audio_seconds: float = 600.0  # at 48 kHz: a sound at a higher rate gets as many samples, fewer seconds
    max_audio_rate: int = 192_000
    max_video_frames: int = 768  # Qwen2.5-VL's own ceiling
    max_video_pixels: int = 1 << 27  # summed over the frames: 512 frames of 512 x 512
    max_prompt_pixels: int = 1 << 27  # a model's processor: the pixels of all of a prompt's images and videos
    roots: tuple[Path, ...] = ()  # where file:// URIs may point; none: URIs are refused

    @property
    def max_audio_samples(self) -> int:
        return int(self.max_audio_seconds * 48_000)

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> MediaLimits:
        """From a service's ``media`` config section (tauflow.core.config.MediaConfig, as a mapping)."""
        return cls(**{**config, "roots": tuple(Path(r) for r in config.get("roots", ()))})


@dataclass(frozen=True)
class Media:
    """An image, a sound or a video: ``data`` (the encoded bytes) or ``uri``, exactly one."""

    modality: Modality
    media_type: str
    data: bytes | None = None
    uri: str = ""
    sha256: str = ""
    width: int = 0
    height: int = 0
    sample_rate: int = 0
    num_samples: int = 0
    num_frames: int = 0
    fps: float = 0.0
    grid_thw: tuple[int, ...] = ()
    num_tokens: int = 0

    @property
    def size_bytes(self) -> int:
        return len(self.data) if self.data is not None else 0


@dataclass(frozen=True)
class Text:
    text: str


PromptPart = Text | Media


@dataclass(frozen=True)
class PartCounts:
    """What a prompt's parts weigh, for spans and metrics: parts and carried bytes per modality."""

    parts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)


def counts(parts: list[PromptPart]) -> PartCounts:
    out = PartCounts()
    for p in parts:
        kind = "text" if isinstance(p, Text) else str(p.modality)
        out.parts[kind] = out.parts.get(kind, 0) + 1
        size = len(p.text.encode()) if isinstance(p, Text) else p.size_bytes
        out.bytes[kind] = out.bytes.get(kind, 0) + size
    return out


def check_structure(parts: list[PromptPart], limits: MediaLimits, where: str = "prompt_parts") -> None:
    """The checks that decode nothing: counts, lengths, media types, the source, the sizes' forms."""
    if len(parts) > limits.max_parts:
        raise InvalidMedia(f"{where} has {len(parts)} parts, more than {limits.max_parts}")
    for i, part in enumerate(parts):
        at = f"{where}[{i}]"
        if isinstance(part, Text):
            if len(part.text) > limits.max_text_chars:
                raise InvalidMedia(f"{at}.text is {len(part.text)} characters, more than {limits.max_text_chars}")
            continue
        check_media_structure(part, limits, f"{at}.media")


def check_media_structure(m: Media, limits: MediaLimits, at: str) -> None:
    if m.modality not in MEDIA_TYPES:
        raise InvalidMedia(f"{at}.modality must be image, audio or video")
    if len(m.media_type) > limits.max_media_type_chars:
        raise InvalidMedia(f"{at}.media_type is longer than {limits.max_media_type_chars} characters")
    if m.media_type not in MEDIA_TYPES[m.modality]:
        raise InvalidMedia(
            f"{at}.media_type {m.media_type[:64]!r} is not a {m.modality} type tauflow decodes "
            f"({', '.join(sorted(MEDIA_TYPES[m.modality]))})"
        )
    if (m.data is None) == (not m.uri):
        raise InvalidMedia(f"{at}: exactly one of data and uri must be set")
    if m.data is not None:
        if not m.data:
            raise InvalidMedia(f"{at}.data is empty")
        if len(m.data) > limits.max_media_bytes:
            raise InvalidMedia(f"{at}.data is {len(m.data)} bytes, more than {limits.max_media_bytes}")
    if len(m.uri) > limits.max_uri_chars:
        raise InvalidMedia(f"{at}.uri is longer than {limits.max_uri_chars} characters")
    if m.sha256 and (len(m.sha256) != 64 or any(c not in "0123456789abcdef" for c in m.sha256)):
        raise InvalidMedia(f"{at}.sha256 must be 64 lowercase hex digits")
    if not (m.fps >= 0 and m.fps < float("inf")):  # NaN fails too
        raise InvalidMedia(f"{at}.fps must be finite and >= 0")
    if m.grid_thw and (len(m.grid_thw) != 3 or min(m.grid_thw) < 1):
        raise InvalidMedia(f"{at}.grid_thw must be empty or 3 positive numbers, not {list(m.grid_thw)[:8]}")
    sizes = {
        Modality.IMAGE: ("width", "height"),
        Modality.AUDIO: ("sample_rate", "num_samples"),
        Modality.VIDEO: ("width", "height", "num_frames", "fps"),
    }[m.modality]
    for name in ("width", "height", "sample_rate", "num_samples", "num_frames", "fps"):
        if name not in sizes and getattr(m, name):
            raise InvalidMedia(f"{at}.{name} is set on {m.modality}, which has none")
