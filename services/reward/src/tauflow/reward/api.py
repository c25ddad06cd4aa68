"""What a reward function sees and returns: the public API for custom rewards.

A reward function is a callable ``fn(sample: SampleInput, config: dict) -> result`` (or, for a
group-level function, ``fn(group: GroupInput, config: dict) -> list[result]``) where ``result`` is a
real number, a :class:`Score`, or a mapping ``{"score": x, "components": {...}}``. Everything here is a
plain, picklable dataclass: reward functions never see protobuf and need nothing but this module.
See the package README for how to register one through the ``tauflow.rewards`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

ENTRY_POINT_GROUP = "tauflow.rewards"


@dataclass(frozen=True, slots=True)
class SampleInput:
    """One completion to score, with the reference data of its sample and group."""

    sample_id: str
    completion_text: str
    metadata: Mapping[str, str] = field(default_factory=dict)
    group_metadata: Mapping[str, str] = field(default_factory=dict)
    group_id: str = ""
    prompt_id: str = ""
    finish_reason: str = "unspecified"  # "stop", "length", "abort" or "unspecified"
    # Filled only for functions that declare ``uses_token_ids = True`` (empty otherwise), so that
    # text-only rewards do not pay for copying thousands of token ids per sample.
    completion_token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    # A multimodal prompt's parts (tauflow.media: Text, and Media whose bytes tauflow.media.decode reads),
    # filled only for functions that declare ``uses_prompt_parts = True``: an image's bytes are not copied
    # into every sample for rewards that read only the text.
    prompt_parts: tuple[Any, ...] = ()

    def get(self, key: str, default: str | None = None) -> str | None:
        """``metadata[key]``, else ``group_metadata[key]``, else ``default`` (how references are read)."""
        value = self.metadata.get(key)
        if value is None:
            value = self.group_metadata.get(key, default)
        return value


@dataclass(frozen=True, slots=True)
class GroupInput:
    """A whole group, for group-level functions (pairwise or rank-based judges)."""

    group_id: str
    prompt_id: str
    samples: tuple[SampleInput, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)
    prompt_parts: tuple[Any, ...] = ()  # the prompt's parts (tauflow.media), for a multimodal prompt


@dataclass(frozen=True, slots=True)
class Score:
    """A score with named parts (the parts are for logs only; ``score`` is what training uses)."""

    score: float
    components: Mapping[str, float] = field(default_factory=dict)


F = TypeVar("F", bound=Callable[..., Any])


def reward(
    *,
    description: str | None = None,
    default_config: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
    fallback_score: float | None = None,
    group_level: bool = False,
    uses_token_ids: bool = False,
    uses_prompt_parts: bool = False,
    validate_config: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> Callable[[F], F]:
    """Decorator that attaches a reward function's defaults to it (the same attributes a class has).

    ``None`` leaves the service's default in place (``default_timeout_s``, ``default_fallback_score``).
    """

    def mark(fn: F) -> F:
        attributes: dict[str, Any] = {} if description is None else {"description": description}
        attributes |= {
            "default_config": dict(default_config or {}),
            "timeout_s": timeout_s,
            "fallback_score": fallback_score,
            "group_level": group_level,
            "uses_token_ids": uses_token_ids,
            "uses_prompt_parts": uses_prompt_parts,
        }
        if validate_config is not None:
            attributes["validate_config"] = validate_config
        for name, value in attributes.items():  # (setattr: a type checker knows no attributes of a function)
            setattr(fn, name, value)
        return fn

    return mark
