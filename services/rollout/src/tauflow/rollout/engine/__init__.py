"""Generation engines of the rollout service: the interface (``base``), the sampler (``sampling``) and the backends
(``hf``: transformers, CPU or GPU; ``sglang``: an SGLang server over HTTP, experimental). Backends load lazily: ``engine_class("hf")``."""

from __future__ import annotations

import importlib

from tauflow.rollout.engine.base import (
    Completion,
    EngineClosedError,
    EngineState,
    EngineStats,
    EngineUnavailableError,
    FinishReason,
    GenerationEngine,
    InvalidRequestError,
    SamplingParams,
    ScoredSequence,
    Scores,
    TensorSpec,
    WeightUpdateError,
    check_weight_specs,
)

BACKENDS = {
    "hf": "tauflow.rollout.engine.hf:HFEngine",
    "sglang": "tauflow.rollout.engine.sglang:SGLangEngine",  # experimental: docs/gpu.md
}


def engine_class(backend: str) -> type[GenerationEngine]:
    """The engine class of ``backend`` (imported on first use, so that transformers loads only when needed)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown engine backend {backend!r}; known: {sorted(BACKENDS)}")
    module, name = BACKENDS[backend].split(":")
    cls: type[GenerationEngine] = getattr(importlib.import_module(module), name)
    return cls


__all__ = [
    "BACKENDS",
    "Completion",
    "EngineClosedError",
    "EngineState",
    "EngineStats",
    "EngineUnavailableError",
    "FinishReason",
    "GenerationEngine",
    "InvalidRequestError",
    "SamplingParams",
    "ScoredSequence",
    "Scores",
    "TensorSpec",
    "WeightUpdateError",
    "check_weight_specs",
    "engine_class",
]
