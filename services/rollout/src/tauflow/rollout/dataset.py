"""Prompt data sets: JSONL or Parquet rows with a prompt (text or token ids), an id and an answer."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    token_ids: list[int]
    metadata: dict[str, str] = field(default_factory=dict)  # e.g. {"answer": "46"} for the reward


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_prompts(
    path: str | Path,
    encode: Callable[[str], list[int]] | None,
    *,
    prompt_field: str = "prompt",
    id_field: str = "id",
    metadata_fields: tuple[str, ...] = ("answer",),
) -> list[Prompt]:
    """Rows become prompts; a row with ``prompt_token_ids`` is taken as is, text goes through ``encode``."""
    prompts = []
    for i, row in enumerate(read_rows(path)):
        if "prompt_token_ids" in row:
            ids = [int(t) for t in row["prompt_token_ids"]]
        elif prompt_field in row:
            if encode is None:
                raise ValueError(f"{path}: row {i} has text but the model has no tokenizer")
            ids = encode(str(row[prompt_field]))
        else:
            raise ValueError(f"{path}: row {i} has neither '{prompt_field}' nor 'prompt_token_ids'")
        meta = {k: str(row[k]) for k in metadata_fields if k in row}
        prompts.append(Prompt(str(row.get(id_field, i)), ids, meta))
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
