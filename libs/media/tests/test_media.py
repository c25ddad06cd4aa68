"""tauflow.media: each modality decodes to what was encoded, and every kind of bad media is refused with
InvalidMedia naming the part (undecodable, wrong type, too large, inconsistent sizes, a URI outside the
media roots, bytes that differ from their sha256) — never another exception."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tauflow.api.common.v1 import common_pb2
from tauflow.media import (
    InvalidMedia,
    Media,
    MediaLimits,
    Modality,
    Text,
    audio,
    counts,
    decode,
    image,
    parts_from_row,
    resample,
    validate,
    video,
    wire,
)

LIMITS = MediaLimits()


def _picture(h: int = 24, w: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _tone(seconds: float = 0.5, rate: int = 16000, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _clip(frames: int = 6, h: int = 32, w: int = 48) -> np.ndarray:
    return np.stack([np.full((h, w, 3), (20 + 35 * i) % 256, np.uint8) for i in range(frames)])


def test_an_image_decodes_to_its_pixels_exactly() -> None:
    pixels = _picture()
    part = image(pixels)
    assert (part.width, part.height, part.media_type) == (32, 24, "image/png")
    assert np.array_equal(decode(part, LIMITS).image, pixels)  # PNG is lossless


def test_audio_decodes_to_its_samples_within_16_bit_rounding() -> None:
    tone = _tone()
    part = audio(tone, 16000)
    d = decode(part, LIMITS)
    assert d.sample_rate == 16000 and d.audio is not None and d.audio.shape == tone.shape
    assert np.abs(d.audio - tone).max() < 2 / 32767
    assert resample(d.audio, 16000, 8000).size == pytest.approx(4000, abs=64)


@pytest.mark.parametrize("media_type", ["video/mp4", "video/webm"])
def test_a_video_decodes_to_its_frames(media_type: str) -> None:
    clip = _clip()
    part = video(clip, fps=4, media_type=media_type)
    d = decode(part, LIMITS)
    assert d.frames is not None and d.frames.shape == clip.shape and d.fps == 4
    # lossy codecs: flat frames come back within a few levels, in order
    assert np.abs(d.frames.astype(int).mean(axis=(1, 2, 3)) - clip.mean(axis=(1, 2, 3))).max() < 4


def test_parts_round_trip_through_the_contract() -> None:
    parts = [Text("how many? "), image(_picture()), audio(_tone(), 16000), video(_clip(), fps=2)]
    parts[1] = replace(parts[1], grid_thw=(1, 2, 2), num_tokens=1)
    back = wire.from_proto(
        common_pb2.Group.FromString(
            common_pb2.Group(group_id="g", prompt_parts=wire.to_proto(parts)).SerializeToString()
        ).prompt_parts
    )
    assert back == parts
    c = counts(parts)
    assert c.parts == {"text": 1, "image": 1, "audio": 1, "video": 1}
    assert c.bytes["image"] == len(parts[1].data or b"")


def _refused(parts: list, limits: MediaLimits = LIMITS) -> str:
    with pytest.raises(InvalidMedia) as e:
        validate(parts, limits)
    return str(e.value)


def test_undecodable_bytes_are_refused_naming_the_part() -> None:
    bad = Media(Modality.IMAGE, "image/png", data=b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    assert _refused([Text("a"), bad]).startswith("prompt_parts[1].media: the data does not decode as image/png")
    assert "prompt_parts[0].media" in _refused([Media(Modality.AUDIO, "audio/wav", data=b"RIFF" + b"x" * 60)])
    assert "does not decode" in _refused([Media(Modality.VIDEO, "video/mp4", data=b"\0\0\0\x18ftypmp42" * 8)])
    truncated = image(_picture()).data or b""
    assert "does not decode" in _refused([Media(Modality.IMAGE, "image/png", data=truncated[: len(truncated) // 2])])


def test_the_wrong_type_is_refused() -> None:
    png = image(_picture()).data
    assert "does not decode as image/jpeg" in _refused([Media(Modality.IMAGE, "image/jpeg", data=png)])
    assert "is not a image type" in _refused([Media(Modality.IMAGE, "audio/wav", data=png)])
    wav = audio(_tone(), 16000).data
    assert "does not decode as video/mp4" in _refused([Media(Modality.VIDEO, "video/mp4", data=wav)])
    assert "exactly one of data and uri" in _refused([Media(Modality.IMAGE, "image/png")])


def test_media_over_a_bound_is_refused_before_its_pixels_are_decoded() -> None:
    big = image(_picture(64, 64))
    assert "more than 4000" in _refused([big], MediaLimits(max_image_pixels=4000))
    assert "bytes, more than 100" in _refused([big], MediaLimits(max_media_bytes=100))
    # samples are bounded at 48 kHz's worth of max_audio_seconds: 0.1 s is 4800 samples
    assert "more than 4800 samples" in _refused([audio(_tone(0.5), 16000)], MediaLimits(max_audio_seconds=0.1))
    assert "sample rate 16000 Hz is not in 1..8000" in _refused(
        [audio(_tone(0.5), 16000)], MediaLimits(max_audio_rate=8000)
    )
    assert "frames have more than 1000 pixels" in _refused([video(_clip(2), fps=2)], MediaLimits(max_image_pixels=1000))
    clip = video(_clip(8), fps=4)
    assert "more than 5 frames" in _refused([clip], MediaLimits(max_video_frames=5))
    assert "pixels in all" in _refused([clip], MediaLimits(max_video_pixels=32 * 48 * 3))
    assert "3 parts, more than 2" in _refused([Text("a")] * 3, MediaLimits(max_parts=2))
    assert "prompt_parts[0].text is 5 characters" in _refused([Text("hello")], MediaLimits(max_text_chars=4))


def test_sizes_that_differ_from_the_decode_are_refused() -> None:
    assert ".width is 31 but the media decodes to 32" in _refused([replace(image(_picture()), width=31)])
    assert ".num_samples is 7 but" in _refused([replace(audio(_tone(), 16000), num_samples=7)])
    assert ".sample_rate is 8000 but" in _refused([replace(audio(_tone(), 16000), sample_rate=8000)])
    assert ".num_frames is 5 but the media decodes to 6" in _refused([replace(video(_clip(), fps=4), num_frames=5)])
    assert "grid_thw must be empty or 3" in _refused([replace(image(_picture()), grid_thw=(1, 2))])
    assert "sample_rate is set on image" in _refused([replace(image(_picture()), sample_rate=16000)])
    assert "fps must be finite" in _refused([replace(video(_clip(), fps=4), fps=float("nan"))])


def test_uris_are_read_only_under_a_media_root_and_checked_against_sha256(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    data = image(_picture()).data or b""
    (root / "a.png").write_bytes(data)
    (tmp_path / "secret.png").write_bytes(data)
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    limits = MediaLimits(roots=(root,))
    good = Media(Modality.IMAGE, "image/png", uri=f"file://{root}/a.png", sha256=hashlib.sha256(data).hexdigest())
    validate([good], limits)
    assert "no media roots configured" in _refused([good])
    for uri in (f"file://{root}/../secret.png", f"file://{root}/link.png"):
        assert "not under a media root" in _refused([replace(good, uri=uri)], limits)
    assert "must be a file:// URI" in _refused([replace(good, uri="http://example.com/a.png")], limits)
    assert "cannot be read" in _refused([replace(good, uri=f"file://{root}/missing.png")], limits)
    assert "is not a URI" in _refused([replace(good, uri="file://[x/a.png")], limits)
    assert "is not a path" in _refused([replace(good, uri=f"file://{root}/a%00.png")], limits)
    os.mkfifo(root / "pipe.png")  # a reader must not block on it
    assert "does not name a regular file" in _refused([replace(good, uri=f"file://{root}/pipe.png")], limits)
    assert "do not match sha256" in _refused([replace(good, sha256="0" * 64)], limits)
    assert "64 lowercase hex" in _refused([replace(good, sha256="ABC")], limits)


def test_the_data_set_format_reads_paths_uris_and_base64(tmp_path: Path) -> None:
    (tmp_path / "q.png").write_bytes(image(_picture()).data or b"")
    wav = audio(_tone(), 16000).data or b""
    row = json.loads(json.dumps({"prompt_parts": [
        {"type": "image", "path": "q.png"},
        {"type": "audio", "data": base64.b64encode(wav).decode(), "media_type": "audio/wav"},
        {"type": "video", "uri": "file:///mnt/media/q.mp4"},
        {"type": "text", "text": "sum="},
    ]}))  # fmt: skip
    parts = parts_from_row(row["prompt_parts"], tmp_path)
    assert isinstance(parts[0], Media) and (parts[0].width, parts[0].height) == (32, 24)
    assert isinstance(parts[1], Media) and parts[1].data == wav
    assert isinstance(parts[2], Media) and parts[2].media_type == "video/mp4" and parts[2].uri
    assert parts[3] == Text("sum=")
    assert parts_from_row(json.dumps(row["prompt_parts"][3:]), tmp_path) == [Text("sum=")]
    with pytest.raises(InvalidMedia, match=r"prompt_parts\[0\]: a image part needs exactly one of"):
        parts_from_row([{"type": "image"}], tmp_path)
    with pytest.raises(InvalidMedia, match=r"prompt_parts\[0\].type must be"):
        parts_from_row([{"type": "smell", "path": "x"}], tmp_path)
    with pytest.raises(InvalidMedia, match="not base64"):
        parts_from_row([{"type": "audio", "data": "!!", "media_type": "audio/wav"}], tmp_path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([("image", "image/png"), ("image", "image/jpeg"), ("image", "image/gif"), ("audio", "audio/wav"),
                     ("audio", "audio/mpeg"), ("audio", "audio/ogg"), ("video", "video/mp4"), ("video", "video/webm")]),
    st.binary(min_size=1, max_size=2048),
    st.integers(0, 200),
)  # fmt: skip
def test_hostile_bytes_are_refused_or_accepted_never_crash(kind: tuple[str, str], noise: bytes, cut: int) -> None:
    # random bytes, and valid media with a corrupted stretch: only InvalidMedia may come out
    modality, media_type = Modality(kind[0]), kind[1]
    valid = {"image": image(_picture(8, 8)), "audio": audio(_tone(0.05), 8000), "video": video(_clip(2, 16, 16), 2)}
    base = valid[modality].data or b""
    corrupted = base[:cut] + noise[: len(base) // 4] + base[cut + len(noise[: len(base) // 4]) :]
    for data in (noise, corrupted):
        try:
            validate([Media(modality, media_type, data=data)], LIMITS)
        except InvalidMedia as e:
            assert str(e).startswith("prompt_parts[0]")


def test_jpeg_and_gif_images_decode_to_rgb() -> None:
    from PIL import Image

    for fmt, media_type in (("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp")):
        buf = io.BytesIO()
        Image.fromarray(_picture()).save(buf, format=fmt)
        d = decode(Media(Modality.IMAGE, media_type, data=buf.getvalue(), width=32, height=24), LIMITS)
        assert d.image is not None and d.image.shape == (24, 32, 3)


def test_a_parquet_data_set_reads_like_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa  # (a dependency of tauflow-media: read_rows reads Parquet)
    import pyarrow.parquet as pq

    from tauflow.media import load_prompt_rows

    (tmp_path / "q.png").write_bytes(image(_picture()).data or b"")
    rows = [{"id": "a", "answer": "3", "prompt_parts": [{"type": "image", "path": "q.png", "text": None},
                                                          {"type": "text", "path": None, "text": "n="}]}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (row,) = load_prompt_rows(tmp_path / "d.parquet")
    assert row.prompt_id == "a" and row.fields == {"answer": "3"}
    assert isinstance(row.parts[0], Media) and row.parts[0].width == 32 and row.parts[1] == Text("n=")
