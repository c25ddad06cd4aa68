"""Prompt data sets: JSONL or Parquet rows with a prompt (text, token ids, or typed parts with media), an id
and an answer."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tauflow import media
from tauflow.media.dataset import read_rows

PARTS_FIELD = "prompt_parts"


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    token_ids: list[int]
    metadata: dict[str, str] = field(default_factory=dict)  # e.g. {"answer": "46"} for the reward
    parts: list[media.PromptPart] = field(default_factory=list)
    """A multimodal prompt's parts (tauflow.media); its token ids are the processor's, made when it is drawn."""
    media: dict[str, Any] | None = None
    """Its encoder inputs, with its token ids, once processed (tauflow.media.processor)."""

    @property
    def needs_processing(self) -> bool:
        return bool(self.parts) and not self.token_ids


def load_prompts(
    path: str | Path,
    encode: Callable[[str], list[int]] | None,
    *,
    prompt_field: str = "prompt",
    id_field: str = "id",
    metadata_fields: tuple[str, ...] = ("answer",),
) -> list[Prompt]:
    """Rows become prompts; a row with ``prompt_token_ids`` is taken as is, text goes through ``encode``, and
    ``prompt_parts`` (the multimodal format, docs/omni.md) are read now (their files) and processed when drawn."""
    prompts = []
    for i, row in enumerate(read_rows(path)):
        meta = {k: str(row[k]) for k in metadata_fields if k in row}
        prompt_id = str(row.get(id_field, i))
        if PARTS_FIELD in row:
            parts = media.parts_from_row(row[PARTS_FIELD], Path(path).parent, f"{path}: row {i}: {PARTS_FIELD}")
            prompts.append(Prompt(prompt_id, [], meta, parts))
            continue
        if "prompt_token_ids" in row:
            ids = [int(t) for t in row["prompt_token_ids"]]
        elif prompt_field in row:
            if encode is None:
                raise ValueError(f"{path}: row {i} has text but the model has no tokenizer")
            ids = encode(str(row[prompt_field]))
        else:
            raise ValueError(f"{path}: row {i} has neither '{prompt_field}', 'prompt_token_ids' nor '{PARTS_FIELD}'")
        prompts.append(Prompt(prompt_id, ids, meta))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def epochs(prompts: list[Prompt], seed: int) -> Iterator[Prompt]:
    """Endless shuffled passes over the prompts."""
    rng = random.Random(seed)
    order = list(prompts)
    while True:
        rng.shuffle(order)
        yield from order
