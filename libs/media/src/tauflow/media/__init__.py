"""tauflow media: a prompt's typed parts (text, image, audio, video) for omni-modal RL (docs/omni.md)."""

from tauflow.media.codec import Decoded, audio, decode, from_file, image, read_bytes, resample, text_of, validate, video
from tauflow.media.dataset import (
    MAX_MESSAGES,
    DataRow,
    PromptRow,
    checked_messages,
    data_rows,
    load_prompt_rows,
    parts_from_row,
    read_rows,
)
from tauflow.media.parts import (
    InvalidMedia,
    Media,
    MediaLimits,
    Modality,
    PartCounts,
    PromptPart,
    Text,
    check_structure,
    counts,
)

__all__ = [
    "MAX_MESSAGES",
    "DataRow",
    "Decoded",
    "InvalidMedia",
    "Media",
    "MediaLimits",
    "Modality",
    "PartCounts",
    "PromptPart",
    "PromptRow",
    "Text",
    "audio",
    "check_structure",
    "checked_messages",
    "counts",
    "data_rows",
    "decode",
    "from_file",
    "image",
    "load_prompt_rows",
    "parts_from_row",
    "read_bytes",
    "read_rows",
    "resample",
    "text_of",
    "validate",
    "video",
]
