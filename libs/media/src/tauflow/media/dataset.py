"""The data set format of a multimodal prompt: a row's ``prompt_parts``, a list of typed parts.

    {"id": "q1", "answer": "7", "prompt_parts": [
        {"type": "image", "path": "images/q1.png"},
        {"type": "audio", "path": "audio/q1.wav"},
        {"type": "video", "uri": "file:///mnt/media/q1.mp4", "sha256": "..."},
        {"type": "image", "data": "<base64>", "media_type": "image/png"},
        {"type": "text", "text": "How many in all? "}]}

``path`` is read when the row is loaded (relative to the data set's folder) and carried as data;
``uri`` is carried as is and read by each service under its media roots; ``data`` is base64. JSONL and
Parquet rows take the same form (in Parquet, ``prompt_parts`` is a list of structs, or a JSON string).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tauflow.media.codec import from_file, guess_type
from tauflow.media.parts import InvalidMedia, Media, Modality, PromptPart, Text

_SIZE_KEYS = ("width", "height", "sample_rate", "num_samples", "num_frames", "fps")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL or Parquet data set."""
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class PromptRow:
    """A data set row: its id, the prompt's parts and the row's other fields (the answer, metadata)."""

    prompt_id: str
    parts: list[PromptPart]
    fields: dict[str, Any]


def load_prompt_rows(path: str | Path, *, parts_field: str = "prompt_parts", id_field: str = "id") -> list[PromptRow]:
    """Every row of a multimodal data set, its parts read (paths relative to the data set's folder)."""
    rows = []
    for i, row in enumerate(read_rows(path)):
        if parts_field not in row:
            raise InvalidMedia(f"{path}: row {i} has no '{parts_field}'")
        parts = parts_from_row(row[parts_field], Path(path).parent, f"{path}: row {i}: {parts_field}")
        rest = {k: v for k, v in row.items() if k not in (parts_field, id_field)}
        rows.append(PromptRow(str(row.get(id_field, i)), parts, rest))
    return rows


def parts_from_row(value: Any, base: Path, where: str = "prompt_parts") -> list[PromptPart]:
    """The parts a row's ``prompt_parts`` value describes (a list of dicts, or its JSON text)."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise InvalidMedia(f"{where} must be a list of parts")
    return [part_from_spec(spec, base, f"{where}[{i}]") for i, spec in enumerate(value)]


def part_from_spec(spec: Any, base: Path, at: str) -> PromptPart:
    if not isinstance(spec, Mapping):
        raise InvalidMedia(f"{at} must be an object with a 'type'")
    kind = spec.get("type")
    if kind == "text":
        if not isinstance(spec.get("text"), str):
            raise InvalidMedia(f"{at}: a text part needs 'text'")
        return Text(spec["text"])
    try:
        modality = Modality(str(kind))
    except ValueError:
        raise InvalidMedia(f"{at}.type must be text, image, audio or video, not {str(kind)[:32]!r}") from None
    sources = [k for k in ("path", "uri", "data") if spec.get(k) is not None]
    if len(sources) != 1:
        raise InvalidMedia(f"{at}: a {modality} part needs exactly one of path, uri and data")
    sizes = {k: spec[k] for k in _SIZE_KEYS if spec.get(k) is not None}
    if "path" in spec and spec["path"] is not None:
        m = from_file(base / spec["path"], modality, spec.get("media_type") or "")
        return Media(**{**m.__dict__, **sizes})
    media_type = spec.get("media_type") or ""
    if not media_type and spec.get("uri"):
        media_type = guess_type(Path(str(spec["uri"])))
    common: dict[str, Any] = {"sha256": str(spec.get("sha256") or ""), **sizes}
    if spec.get("uri") is not None:
        return Media(modality, media_type, uri=str(spec["uri"]), **common)
    try:
        data = base64.b64decode(str(spec["data"]), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidMedia(f"{at}.data is not base64") from e
    return Media(modality, media_type, data=data, **common)
