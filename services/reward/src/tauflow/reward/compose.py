"""The ``compose`` built-in: a weighted sum of other reward functions, optionally behind a gate.

    config = {
        "parts": [{"fn": "math", "weight": 1.0}, {"fn": "format", "weight": 0.2, "config": {"mode": "search"}}],
        "gate": {"fn": "format", "min_score": 1.0, "fail_score": -1.0},  # optional
    }

The score is ``sum(weight_i * score_i)`` (plus ``bias``); with a gate, a sample whose gate function scores
below ``min_score`` gets ``fail_score`` and its parts are not run (the "format first" reward of DeepSeek-R1
style recipes). Each part's config is validated by its own function once per call, through the registry:
the names resolve to the registered functions' references there, never from the request, so a request
cannot make a worker import a module of its choosing. A part that raises gets its function's fallback
score and a component ``error.<label>``; the other parts still count.

Components: ``<label>`` per part (its score), ``<label>.<component>`` for the parts' own components (as
many as fit the 64 a function may return), and ``gate`` when there is one. Group-level functions, and
functions that read token ids or media, cannot be parts: compose runs per sample and receives neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tauflow.reward import worker
from tauflow.reward.api import SampleInput, Score
from tauflow.reward.builtins import MAX_KEY_CHARS, ConfigInvalid, _Options, _validate
from tauflow.reward.errors import InvalidRequest

if TYPE_CHECKING:
    from tauflow.reward.registry import Registry

MAX_PARTS = 8


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class PartSpec(_Strict):
    fn: str = Field(min_length=1, max_length=MAX_KEY_CHARS)
    weight: float = 1.0
    label: str = Field("", max_length=64)  # the component name; default the function's name
    config: dict[str, Any] = Field(default_factory=dict)
    # Filled by the registry's validation (a request's own value is replaced): how a worker finds the function.
    ref: str = Field("", max_length=1024)
    fallback_score: float = 0.0


class GateSpec(_Strict):
    fn: str = Field(min_length=1, max_length=MAX_KEY_CHARS)
    config: dict[str, Any] = Field(default_factory=dict)
    min_score: float = 1.0
    fail_score: float = 0.0
    ref: str = Field("", max_length=1024)
    fallback_score: float = 0.0


class ComposeOptions(_Options):
    parts: list[PartSpec] = Field(default_factory=list, max_length=MAX_PARTS)
    gate: GateSpec | None = None
    bias: float = 0.0

    @model_validator(mode="after")
    def _labels(self) -> ComposeOptions:
        labels = [p.label or p.fn for p in self.parts]
        if len(set(labels)) != len(labels):
            raise ValueError("two parts share a label; give one a 'label'")
        return self


class Compose:
    description = (
        "A weighted sum of other reward functions (parts: [{fn, weight, config, label}]), optionally behind a "
        "gate ({fn, config, min_score, fail_score}: a sample whose gate scores below min_score gets fail_score); "
        "components per part"
    )
    default_config: ClassVar[dict[str, Any]] = ComposeOptions().model_dump()
    timeout_s = 60.0  # the sum of its parts' (a code part's cases, a math part): raise it in functions.compose
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        """Shape only (see ``resolved``, which the registry binds: it also checks each part)."""
        return _validate(ComposeOptions, config)

    def __call__(self, sample: SampleInput, config: dict[str, Any]) -> Score:
        components: dict[str, float] = {}
        gate = config["gate"]
        if gate is not None:
            passed, _ = _run(gate, sample, components, "gate")
            if passed < gate["min_score"]:
                return Score(gate["fail_score"], components)
        total = config["bias"]
        for part in config["parts"]:
            label = part["label"] or part["fn"]
            score, own = _run(part, sample, components, label)
            total += part["weight"] * score
            for name, value in own.items():  # the parts' own components, while they fit
                if len(components) < worker.MAX_COMPONENTS and len(name) + len(label) < worker.MAX_COMPONENT_NAME_CHARS:
                    components[f"{label}.{name}"] = value
        return Score(total, components)


def _run(
    spec: Mapping[str, Any], sample: SampleInput, components: dict[str, float], label: str
) -> tuple[float, dict[str, float]]:
    try:
        score, own = worker.to_score(worker.resolve(spec["ref"])(sample, spec["config"]))
    except Exception:  # noqa: BLE001 - one part's failure costs that part only
        score, own = spec["fallback_score"], {}
        components[f"error.{label}"[: worker.MAX_COMPONENT_NAME_CHARS]] = 1.0
    components[label] = score
    return score, own


def resolved(registry: Registry, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` checked against the registry: every part names a registered per-sample function, its
    config is valid for it, and its reference and fallback come from the registry."""
    shaped = _validate(ComposeOptions, config)
    for where, spec in [*((f"parts.{i}", p) for i, p in enumerate(shaped["parts"])), ("gate", shaped["gate"])]:
        if spec is None:
            continue
        if spec["fn"] not in registry or spec["fn"] == "compose":
            raise ConfigInvalid(f"{where}.fn", f"{spec['fn'][:80]!r} is not a registered reward function to compose")
        fn = registry.get(spec["fn"])
        if fn.group_level or fn.uses_token_ids or fn.uses_prompt_parts:
            raise ConfigInvalid(
                f"{where}.fn", f"{fn.name!r} is group-level or reads token ids or media; compose runs per sample"
            )
        try:
            spec["config"] = fn.resolve_config(spec["config"])
        except InvalidRequest as e:  # its field is "config.<key>"
            raise ConfigInvalid(f"{where}.{e.field}", str(e)[len(e.field) + 2 :]) from None
        spec["ref"], spec["fallback_score"] = fn.ref, fn.fallback_score
    return shaped
