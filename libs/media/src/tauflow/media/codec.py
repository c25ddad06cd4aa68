"""Reading, decoding and checking media; building media parts from arrays and files.

Every consumer decodes in full (the queue to validate a group, the rollout and the trainer to feed the
model's processor) with the same code, so a part the queue accepted decodes the same everywhere.
Decoders: Pillow for images, FFmpeg through PyAV for audio and video (the demuxer named by the media type,
never probed). Decoded sizes are bounded before and while decoding.
"""

from __future__ import annotations

import hashlib
import io
import mimetypes
import os
import stat
import warnings
import wave
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from tauflow.media.parts import (
    AUDIO_TYPES,
    IMAGE_TYPES,
    MEDIA_TYPES,
    VIDEO_TYPES,
    InvalidMedia,
    Media,
    MediaLimits,
    Modality,
    PromptPart,
    Text,
    check_media_structure,
    check_structure,
)


@dataclass(frozen=True)
class Decoded:
    """A decoded part: ``image`` (H, W, 3) uint8 RGB; ``audio`` (N,) float32 mono at ``sample_rate``;
    ``frames`` (T, H, W, 3) uint8 RGB at ``fps``."""

    modality: Modality
    image: np.ndarray | None = None
    audio: np.ndarray | None = None
    sample_rate: int = 0
    frames: np.ndarray | None = None
    fps: float = 0.0


def _quiet_ffmpeg() -> Any:
    import av

    av.logging.set_level(av.logging.PANIC)  # hostile bytes must not fill the logs with FFmpeg's complaints
    return av


def read_bytes(m: Media, limits: MediaLimits, at: str = "media") -> bytes:
    """The part's encoded bytes: ``data``, or the file a ``file://`` URI names under a media root; checked
    against ``sha256`` when it is set."""
    if m.data is not None:
        data = m.data
    else:
        data = _read_uri(m.uri, limits, at)
    if m.sha256 and hashlib.sha256(data).hexdigest() != m.sha256:
        raise InvalidMedia(f"{at}: the bytes do not match sha256")
    return data


def _read_uri(uri: str, limits: MediaLimits, at: str) -> bytes:
    try:
        parsed = urlparse(uri)
    except ValueError as e:  # e.g. an unbalanced IPv6 bracket
        raise InvalidMedia(f"{at}.uri is not a URI") from e
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise InvalidMedia(f"{at}.uri must be a file:// URI (a path on a volume every service mounts)")
    if not limits.roots:
        raise InvalidMedia(f"{at}.uri: this service has no media roots configured, so it reads no URI")
    try:
        path = Path(os.path.realpath(unquote(parsed.path)))  # resolves '..' and links before the root check
    except ValueError as e:  # a NUL byte in the path
        raise InvalidMedia(f"{at}.uri is not a path") from e
    if not any(path.is_relative_to(os.path.realpath(r)) for r in limits.roots):
        raise InvalidMedia(f"{at}.uri is not under a media root of this service")
    try:
        # O_NONBLOCK: a FIFO placed under a root must not hold the reader; only a regular file is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise InvalidMedia(f"{at}.uri cannot be read ({e.strerror})") from e
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InvalidMedia(f"{at}.uri does not name a regular file")
        if info.st_size > limits.max_media_bytes:
            raise InvalidMedia(f"{at}.uri names a file over {limits.max_media_bytes} bytes")
        return f.read(limits.max_media_bytes + 1)


def decode(m: Media, limits: MediaLimits, at: str = "media", *, keep: bool = True) -> Decoded:
    """The full decode of a part, checked against the sizes it gives. ``keep=False`` validates without
    holding the pixels or the samples (a video and a sound are then decoded a frame at a time)."""
    check_media_structure(m, limits, at)
    data = read_bytes(m, limits, at)
    if m.modality is Modality.IMAGE:
        return _decode_image(m, data, limits, at)
    if m.modality is Modality.AUDIO:
        return _decode_audio(m, data, limits, at, keep)
    return _decode_video(m, data, limits, at, keep)


def validate(parts: list[PromptPart], limits: MediaLimits, where: str = "prompt_parts") -> None:
    """Raises InvalidMedia naming the first part that is malformed, over a bound or does not decode."""
    check_structure(parts, limits, where)
    for i, part in enumerate(parts):
        if isinstance(part, Media):
            decode(part, limits, f"{where}[{i}].media", keep=False)


def _check_size(at: str, name: str, given: float, decoded: float) -> None:
    if given and given != decoded:
        raise InvalidMedia(f"{at}.{name} is {given:g} but the media decodes to {decoded:g}")


def _decode_image(m: Media, data: bytes, limits: MediaLimits, at: str) -> Decoded:
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[IMAGE_TYPES[m.media_type]])
            if img.width * img.height > limits.max_image_pixels:  # read from the header, before the pixels
                raise InvalidMedia(
                    f"{at}: the image is {img.width} x {img.height} pixels, more than {limits.max_image_pixels}"
                )
            img.load()
            pixels = np.asarray(img.convert("RGB"))
    except InvalidMedia:
        raise
    except Exception as e:
        raise InvalidMedia(f"{at}: the data does not decode as {m.media_type} ({type(e).__name__})") from e
    _check_size(at, "width", m.width, pixels.shape[1])
    _check_size(at, "height", m.height, pixels.shape[0])
    return Decoded(Modality.IMAGE, image=pixels)


def _decode_audio(m: Media, data: bytes, limits: MediaLimits, at: str, keep: bool) -> Decoded:
    av = _quiet_ffmpeg()
    chunks: list[np.ndarray] = []
    n = 0
    try:
        with av.open(io.BytesIO(data), format=AUDIO_TYPES[m.media_type]) as container:
            if not container.streams.audio:
                raise InvalidMedia(f"{at}: the {m.media_type} data has no audio stream")
            stream = container.streams.audio[0]
            rate = int(stream.sample_rate or 0)
            if not 0 < rate <= limits.max_audio_rate:
                raise InvalidMedia(f"{at}: the audio's sample rate {rate} Hz is not in 1..{limits.max_audio_rate}")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    samples = out.to_ndarray().reshape(-1)
                    n += samples.size
                    if not np.isfinite(samples).all():
                        raise InvalidMedia(f"{at}: the audio has samples that are not finite")
                    if keep:
                        chunks.append(samples)
                if n > limits.max_audio_samples:
                    raise InvalidMedia(
                        f"{at}: the audio has more than {limits.max_audio_samples} samples "
                        f"({limits.max_audio_seconds:g} s at 48 kHz)"
                    )
            for out in resampler.resample(None):
                n += out.samples
                if keep:
                    chunks.append(out.to_ndarray().reshape(-1))
    except InvalidMedia:
        raise
    except Exception as e:  # FFmpeg's errors for bad bytes: all mean "does not decode"
        raise InvalidMedia(f"{at}: the data does not decode as {m.media_type} ({type(e).__name__})") from e
    if n == 0:
        raise InvalidMedia(f"{at}: the audio has no samples")
    _check_size(at, "sample_rate", m.sample_rate, rate)
    _check_size(at, "num_samples", m.num_samples, n)
    audio = np.concatenate(chunks).astype(np.float32, copy=False) if keep else None
    return Decoded(Modality.AUDIO, audio=audio, sample_rate=rate)


def _decode_video(m: Media, data: bytes, limits: MediaLimits, at: str, keep: bool) -> Decoded:
    av = _quiet_ffmpeg()
    frames: list[np.ndarray] = []
    count = pixels = 0
    size: tuple[int, int] | None = None
    try:
        with av.open(io.BytesIO(data), format=VIDEO_TYPES[m.media_type]) as container:
            if not container.streams.video:
                raise InvalidMedia(f"{at}: the {m.media_type} data has no video stream")
            stream = container.streams.video[0]
            declared = (stream.codec_context.width or 0) * (stream.codec_context.height or 0)
            if declared > limits.max_image_pixels:  # from the header: before a frame is allocated
                raise InvalidMedia(f"{at}: the video's frames have more than {limits.max_image_pixels} pixels")
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            for frame in container.decode(stream):
                if size is None:
                    size = (frame.width, frame.height)
                elif size != (frame.width, frame.height):
                    raise InvalidMedia(f"{at}: the video's frames change size")
                count += 1
                if frame.width * frame.height > limits.max_image_pixels:
                    raise InvalidMedia(f"{at}: the video's frames have more than {limits.max_image_pixels} pixels")
                pixels += frame.width * frame.height
                if count > limits.max_video_frames:
                    raise InvalidMedia(f"{at}: the video has more than {limits.max_video_frames} frames")
                if pixels > limits.max_video_pixels:
                    raise InvalidMedia(f"{at}: the video has more than {limits.max_video_pixels} pixels in all")
                if keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except InvalidMedia:
        raise
    except Exception as e:
        raise InvalidMedia(f"{at}: the data does not decode as {m.media_type} ({type(e).__name__})") from e
    if size is None:
        raise InvalidMedia(f"{at}: the video has no frames")
    _check_size(at, "width", m.width, size[0])
    _check_size(at, "height", m.height, size[1])
    _check_size(at, "num_frames", m.num_frames, count)
    fps = m.fps or rate
    if not fps > 0:
        raise InvalidMedia(f"{at}: the video has no frame rate; give fps")
    return Decoded(Modality.VIDEO, frames=np.stack(frames) if keep else None, fps=fps)


def resample(audio: np.ndarray, rate: int, to_rate: int) -> np.ndarray:
    """Mono float32 audio at ``to_rate`` (FFmpeg's resampler), e.g. for a processor that wants 16 kHz."""
    if rate == to_rate:
        return audio
    av = _quiet_ffmpeg()
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(audio, np.float32)[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to_rate)
    out = [o.to_ndarray().reshape(-1) for o in (*resampler.resample(frame), *resampler.resample(None))]
    return np.concatenate(out) if out else np.zeros(0, np.float32)


# -- building parts ---------------------------------------------------------------------------------


def image(pixels: Any, media_type: str = "image/png") -> Media:
    """An image part from an (H, W, 3) uint8 array or a PIL image, encoded losslessly as PNG by default."""
    from PIL import Image

    img = pixels if isinstance(pixels, Image.Image) else Image.fromarray(np.asarray(pixels, np.uint8))
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format=IMAGE_TYPES[media_type])
    return Media(Modality.IMAGE, media_type, data=buf.getvalue(), width=img.width, height=img.height)


def audio(samples: np.ndarray, sample_rate: int) -> Media:
    """An audio part from mono float samples in [-1, 1], encoded as 16-bit PCM WAV."""
    pcm = (np.clip(np.asarray(samples, np.float64), -1.0, 1.0) * 32767).round().astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return Media(Modality.AUDIO, "audio/wav", data=buf.getvalue(), sample_rate=sample_rate, num_samples=pcm.size)


def video(frames: np.ndarray, fps: int, media_type: str = "video/mp4") -> Media:
    """A video part from (T, H, W, 3) uint8 frames (even width and height), encoded with MPEG-4 part 2
    (mp4) or VP9 (webm) at high quality."""
    av = _quiet_ffmpeg()
    frames = np.asarray(frames, np.uint8)
    t, h, w = frames.shape[:3]
    codec = {"video/mp4": "mpeg4", "video/webm": "libvpx-vp9"}[media_type]
    buf = io.BytesIO()
    with av.open(buf, "w", format=VIDEO_TYPES[media_type]) as container:
        stream = container.add_stream(codec, rate=fps, options={"qscale": "2"} if codec == "mpeg4" else {})
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    return Media(Modality.VIDEO, media_type, data=buf.getvalue(), width=w, height=h, num_frames=t, fps=float(fps))


def from_file(path: str | Path, modality: Modality | None = None, media_type: str = "") -> Media:
    """A part from a media file, carried as data; the type from the file's extension unless given. Its sizes
    are filled in from a decode."""
    path = Path(path)
    media_type = media_type or guess_type(path)
    modality = modality or next((mod for mod, types in MEDIA_TYPES.items() if media_type in types), None)
    if modality is None:
        raise InvalidMedia(f"{path}: {media_type or 'an unknown type'} is not an image, audio or video type")
    return with_sizes(Media(modality, media_type, data=path.read_bytes()), MediaLimits())


def guess_type(path: Path) -> str:
    guessed = mimetypes.guess_type(path.name)[0] or ""
    return {"audio/x-wav": "audio/wav", "audio/x-flac": "audio/flac", "video/x-matroska": "video/x-matroska"}.get(
        guessed, guessed
    )


def with_sizes(m: Media, limits: MediaLimits) -> Media:
    """``m`` with the sizes of its decode filled in (width, height, samples, frames, fps)."""
    d = decode(m, limits)
    if d.image is not None:
        return replace(m, width=d.image.shape[1], height=d.image.shape[0])
    if d.audio is not None:
        return replace(m, sample_rate=d.sample_rate, num_samples=d.audio.size)
    assert d.frames is not None
    return replace(m, width=d.frames.shape[2], height=d.frames.shape[1], num_frames=d.frames.shape[0], fps=d.fps)


def text_of(parts: list[PromptPart]) -> str:
    """The prompt's text parts, joined: what a text-only consumer (a reward function's ``prompt``) reads."""
    return "".join(p.text for p in parts if isinstance(p, Text))
