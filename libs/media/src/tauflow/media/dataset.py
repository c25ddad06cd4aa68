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


def read_rows(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """The rows of a data set: a JSONL or Parquet file; a folder a Hugging Face ``datasets`` object was saved to
    with ``save_to_disk`` (a ``DatasetDict``'s ``split``); or a folder of JSONL and Parquet files, read in name
    order."""
    p = Path(path)
    if p.is_dir():
        return _folder_rows(p, split)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


def _folder_rows(p: Path, split: str) -> list[dict[str, Any]]:
    if (p / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: a folder per split
        splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
        if split not in splits:
            raise ValueError(f"{p}: no split {split!r}; its splits: {', '.join(splits)}")
        return _folder_rows(p / split, split)
    if (p / "state.json").is_file():  # Dataset.save_to_disk: Arrow stream files, listed in state.json
        import pyarrow as pa

        rows: list[dict[str, Any]] = []
        for entry in json.loads((p / "state.json").read_text())["_data_files"]:
            with pa.memory_map(str(p / Path(entry["filename"]).name)) as source:
                rows += pa.ipc.open_stream(source).read_all().to_pylist()
        return rows
    files = sorted(f for f in p.iterdir() if f.suffix in (".jsonl", ".parquet") and f.is_file())
    if not files:
        raise ValueError(f"{p}: a folder with no JSONL or Parquet files, and not a save_to_disk folder")
    return [row for f in files for row in read_rows(f)]


@dataclass(frozen=True)
class DataRow:
    """A training or held-out row as every role reads it: its id, its prompt in exactly one form (token ids,
    text, a chat, or multimodal parts) and the metadata the reward gets (strings)."""

    prompt_id: str
    metadata: dict[str, str]
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    parts: list[PromptPart] | None = None
    token_ids: list[int] | None = None


MAX_MESSAGES = 256  # GenerateRequest.prompt_messages (rollout.v1 revision 5)
ROLES = ("system", "user", "assistant", "tool")


def data_rows(path: str | Path, data: Mapping[str, Any] | None = None) -> list[DataRow]:
    """The rows of a data set, read with the column mapping ``data`` (tauflow.core.config.DataConfig as a
    mapping: ``id_column``, ``prompt_column``, ``messages_column``, ``answer_column``, ``metadata_columns``,
    ``split``, ``chat_template``, ``system_prompt``; docs/data.md). A metadata value that is not a string
    (a list of tests, a dict) is passed to the reward as JSON."""
    d = {**_DATA_DEFAULTS, **(data or {})}
    base = Path(path) if Path(path).is_dir() else Path(path).parent  # where a row's relative media paths start
    out = []
    for i, row in enumerate(read_rows(path, d["split"])):
        where = f"{path}: row {i}"
        metadata = {key: _as_text(row[col]) for key, col in d["metadata_columns"].items() if row.get(col) is not None}
        if row.get(d["answer_column"]) is not None:
            metadata["answer"] = _as_text(row[d["answer_column"]])
        prompt_id = str(row.get(d["id_column"], i))
        if row.get("prompt_parts") is not None:
            parts = parts_from_row(row["prompt_parts"], base, f"{where}: prompt_parts")
            out.append(DataRow(prompt_id, metadata, parts=parts))
        elif row.get("prompt_token_ids") is not None:
            out.append(DataRow(prompt_id, metadata, token_ids=[int(t) for t in row["prompt_token_ids"]]))
        elif row.get(d["messages_column"]) is not None:
            if d["chat_template"] == "never":
                raise ValueError(f"{where}: a chat ('{d['messages_column']}') but chat_template is never")
            messages = checked_messages(row[d["messages_column"]], f"{where}: {d['messages_column']}")
            if d["system_prompt"] and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": d["system_prompt"]})
            out.append(DataRow(prompt_id, metadata, messages=messages))
        elif row.get(d["prompt_column"]) is not None:
            text = str(row[d["prompt_column"]])
            if d["chat_template"] == "always":  # a question, asked as the user's turn of a chat
                system = [{"role": "system", "content": d["system_prompt"]}] if d["system_prompt"] else []
                out.append(DataRow(prompt_id, metadata, messages=[*system, {"role": "user", "content": text}]))
            else:
                out.append(DataRow(prompt_id, metadata, text=text))
        else:
            raise ValueError(
                f"{where} has none of '{d['prompt_column']}', '{d['messages_column']}', 'prompt_token_ids' and "
                "'prompt_parts'"
            )
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


_DATA_DEFAULTS: dict[str, Any] = {
    "id_column": "id",
    "prompt_column": "prompt",
    "messages_column": "messages",
    "answer_column": "answer",
    "metadata_columns": {},
    "split": "train",
    "chat_template": "auto",
    "system_prompt": "",
}


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def checked_messages(value: Any, where: str = "messages") -> list[dict[str, str]]:
    """A chat as a list of ``{"role", "content"}`` with string values and a known role (a JSON string of one
    too); ``ValueError`` naming the message otherwise."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise ValueError(f"{where} must be a non-empty list of messages")
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"{where}: {len(value)} messages, at most {MAX_MESSAGES}")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}[{j}] must be an object with string 'role' and 'content'")  # noqa: TRY004
        if m["role"] not in ROLES:
            raise ValueError(f"{where}[{j}].role must be one of {', '.join(ROLES)}, not {m['role'][:32]!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


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
