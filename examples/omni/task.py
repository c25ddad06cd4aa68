"""The omni task: an image and a sound, and the sum of what each holds.

The image (56 x 56 pixels) shows a shape in some of its four quadrants; the sound (1 s) has a tone in some
of its four quarter-seconds. The answer is the number of shapes plus the number of tones (2 to 8): neither
the image nor the sound alone gives it, and no text does. Shapes vary in kind, colour, size and place
within their quadrant; tones in pitch, loudness and place within their quarter.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

SIDE = 56  # the tiny model's image processor takes exactly this (4 x 4 patches of 14, merged 2 x 2)
RATE = 16000
MAX_NEW_TOKENS = 2  # the digit, then EOS
CHARS = "0123456789="


def draw_image(quadrants: list[int], rng: random.Random):
    """A white picture with a shape in each of ``quadrants`` (0..3: top-left, top-right, bottom-left, ...)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIDE, SIDE), "white")
    draw = ImageDraw.Draw(img)
    half = SIDE // 2
    for q in quadrants:
        size = rng.randint(9, 16)
        x0 = (q % 2) * half + rng.randint(2, half - size - 2)
        y0 = (q // 2) * half + rng.randint(2, half - size - 2)
        colour = tuple(rng.randint(0, 180) for _ in range(3))
        box = (x0, y0, x0 + size, y0 + size)
        [
            draw.ellipse,
            draw.rectangle,
            lambda b, fill: draw.polygon([(b[0], b[3]), ((b[0] + b[2]) // 2, b[1]), (b[2], b[3])], fill=fill),
        ][rng.randint(0, 2)](box, fill=colour)
    return img


def synth_sound(quarters: list[int], rng: random.Random) -> np.ndarray:
    """One second of silence with a tone burst in each of ``quarters`` (0..3)."""
    out = np.zeros(RATE, np.float32)
    quarter = RATE // 4
    for q in quarters:
        length = rng.randint(quarter // 2, quarter - 400)
        start = q * quarter + rng.randint(200, quarter - length - 200)
        t = np.arange(length) / RATE
        envelope = np.minimum(1.0, np.minimum(t, t[::-1]) * 200)  # 5 ms ramps: no clicks
        tone = rng.uniform(0.3, 0.8) * np.sin(2 * np.pi * rng.uniform(300, 2000) * t) * envelope
        out[start : start + length] = tone.astype(np.float32)
    return out


def problems(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (quadrants with a shape, quarters with a tone), each 1 to 4 of 4, uniformly many."""
    rng = random.Random(seed)
    return [(sorted(rng.sample(range(4), rng.randint(1, 4))), sorted(rng.sample(range(4), rng.randint(1, 4))))
            for _ in range(n)]  # fmt: skip


def write_dataset(out: Path, name: str, items: list[tuple[list[int], list[int]]], seed: int,
                  with_media: bool = True) -> Path:  # fmt: skip
    """``<out>/<name>.jsonl`` and its media files (``<out>/media/<name>-<i>.png|.wav``); ``with_media=False``
    writes the text-only control: the same answers, the prompt without its image and sound."""
    from tauflow import media

    rng = random.Random(seed)
    folder = out / "media"
    folder.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.jsonl"
    with open(path, "w") as f:
        for i, (shapes, tones) in enumerate(items):
            image, sound = draw_image(shapes, rng), synth_sound(tones, rng)
            parts: list[dict] = []
            if with_media:
                (folder / f"{name}-{i}.png").write_bytes(media.image(image).data or b"")
                (folder / f"{name}-{i}.wav").write_bytes(media.audio(sound, RATE).data or b"")
                parts = [{"type": "image", "path": f"media/{name}-{i}.png"},
                         {"type": "audio", "path": f"media/{name}-{i}.wav"}]  # fmt: skip
            row = {"id": f"{name}-{i}", "prompt_parts": [*parts, {"type": "text", "text": "="}],
                   "answer": str(len(shapes) + len(tones))}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return path
