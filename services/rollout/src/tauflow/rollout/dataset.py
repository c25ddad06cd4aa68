"""Prompt data sets: JSONL, Parquet or save_to_disk rows with a prompt (text, a chat, token ids, or typed parts
with media), an id and the reward's metadata."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tauflow import media
from tauflow.rollout.text import ChatTemplateError, TextCodec


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    token_ids: list[int]
    metadata: dict[str, str] = field(default_factory=dict)  # e.g. {"answer": "46"} for the reward
    parts: list[media.PromptPart] = field(default_factory=list)
    """A multimodal prompt's parts (tauflow.media); its token ids are the processor's, made when it is drawn."""
    media: dict[str, Any] | None = None
    """Its encoder inputs, with its token ids, once processed (tauflow.models.processor)."""

    @property
    def needs_processing(self) -> bool:
        return bool(self.parts) and not self.token_ids


def load_prompts(path: str | Path, codec: TextCodec | None, data: Mapping[str, Any] | None = None) -> list[Prompt]:
    """Rows become prompts (tauflow.media.data_rows with the column mapping ``data``, DataConfig as a
    mapping): token ids are taken as they are, text is tokenized, a chat goes through the model's chat
    template, and multimodal parts are read now (their files) and processed when drawn (docs/data.md)."""
    prompts = []
    for row in media.data_rows(path, data):
        where = f"{path}: prompt {row.prompt_id}"
        if row.parts is not None:
            prompts.append(Prompt(row.prompt_id, [], row.metadata, row.parts))
            continue
        if row.token_ids is not None:
            ids = row.token_ids
        elif codec is None:
            raise ValueError(f"{where} has text but the model has no tokenizer")
        elif row.messages is not None:
            try:
                ids = codec.encode_chat(row.messages)
            except ChatTemplateError as e:
                raise ValueError(f"{where} is a chat: {e}") from None
        else:
            assert row.text is not None  # data_rows gives exactly one form
            ids = codec.encode(row.text)
        prompts.append(Prompt(row.prompt_id, ids, row.metadata))
    return prompts


def epochs(prompts: list[Prompt], seed: int) -> Iterator[Prompt]:
    """Endless shuffled passes over the prompts."""
    rng = random.Random(seed)
    order = list(prompts)
    while True:
        rng.shuffle(order)
        yield from order
