"""The generation-engine interface: what every backend (`hf` now, `sglang` later) offers the rollout service.

An engine samples ``n`` completions per prompt from the policy it currently holds and reports, for every
completion token, the behaviour log-probability and the policy version of the weights that sampled it. New
weights are *staged* and swapped in by the engine at a safe point between two decoding steps; requests in
flight are not aborted, they continue with the new weights and their later tokens carry the new version.

No gRPC here: the service layer converts these domain types to and from ``tauflow.api``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch

_log = logging.getLogger(__name__)

__all__ = [
    "MAX_POLICY_VERSION",
    "MIN_TEMPERATURE",
    "Completion",
    "EngineClosedError",
    "EngineState",
    "EngineStats",
    "FinishReason",
    "GenerationEngine",
    "InvalidRequestError",
    "SamplingParams",
    "TensorSpec",
    "WeightUpdateError",
    "check_newer",
    "check_policy_version",
    "check_temperature",
    "check_weight_specs",
    "staged_copies",
]


PromptMedia = Mapping[str, torch.Tensor] | None
"""A prompt's encoder inputs for a multimodal model (pixel values, audio features, grids), or None."""


class InvalidRequestError(ValueError):
    """A generate request the engine cannot serve as asked (the service answers INVALID_ARGUMENT)."""


class WeightUpdateError(ValueError):
    """A staged weight version was rejected (wrong names, shapes, dtypes, version); the old weights keep serving."""


class EngineClosedError(RuntimeError):
    """The engine is closed and accepts no new work (the service answers UNAVAILABLE)."""


class EngineUnavailableError(RuntimeError):
    """What serves the engine (an SGLang server) failed the request or cannot serve now (the service answers
    UNAVAILABLE: the request may be asked again, there or at another replica)."""


class FinishReason(enum.IntEnum):
    """Why a completion ended; the numbers are those of ``tauflow.api.common.v1.FinishReason``."""

    STOP = 1  # a stop token (EOS or one of stop_token_ids) was sampled, or a stop string completed; kept
    LENGTH = 2  # max_new_tokens were generated
    ABORT = 3  # the engine shut down, or the request was cancelled, before the completion ended


class EngineState(enum.IntEnum):
    """Life-cycle state; the numbers are those of ``tauflow.api.rollout.v1.EngineState``."""

    STARTING = 1
    WAITING_FOR_WEIGHTS = 2
    SERVING = 3
    DRAINING = 4
    FAILED = 5


_U64 = 1 << 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Below it, logits / temperature overflow float32 (inf, then NaN log-probs); vLLM too treats less as greedy.
MIN_TEMPERATURE = 1e-5
_MIN_TEMPERATURE_F32 = torch.tensor(MIN_TEMPERATURE, dtype=torch.float32).item()  # 1e-5 as the proto's float


def check_temperature(temperature: float, *, greedy: bool) -> None:
    """Raise InvalidRequestError unless ``temperature`` is finite and at least MIN_TEMPERATURE (or 0, with
    ``greedy``: argmax decoding)."""
    if greedy and temperature == 0:
        return
    if not (math.isfinite(temperature) and temperature >= _MIN_TEMPERATURE_F32):
        allowed = "0 (greedy) or " if greedy else ""
        raise InvalidRequestError(
            f"temperature must be {allowed}a finite number of at least {MIN_TEMPERATURE:g}, got {temperature!r}"
        )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample, per prompt. Mirrors ``tauflow.api.rollout.v1.SamplingParams``.

    - ``temperature`` 0 means greedy (argmax); otherwise logits are divided by it, and it is at least
      MIN_TEMPERATURE.
    - ``top_p`` in (0, 1]: keep the smallest set of most likely tokens whose probability sums to at least top_p.
    - ``top_k`` 0 means no limit.
    - ``stop_token_ids`` end a completion (the stop token is kept); the model's EOS tokens always do, unless
      ``ignore_eos``.
    - ``stop`` strings end a completion when its decoded text (special tokens skipped) first contains one; the
      tokens up to and including the one that completed it are kept, so the text ends with the string (and
      whatever else that last token spells): what the policy sampled is what is trained. They need an engine
      with the model's tokenizer.
    - ``seed``: reproducible draws on one engine and version. Sample ``j`` of *every* prompt of a call draws
      from the stream ``(seed, j)``, so a prompt gets the same completions whether it is sent alone or in a
      batch with others. ``None`` draws a fresh random seed per prompt.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(dict.fromkeys(self.stop)))
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop: {len(self.stop)} strings, at most {MAX_STOP_STRINGS}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
                raise InvalidRequestError(f"stop[{i}]: a stop string must have 1 to {MAX_STOP_CHARS} characters")
            try:
                s.encode()
            except UnicodeEncodeError:
                raise InvalidRequestError(f"stop[{i}]: not valid Unicode text (a lone surrogate)") from None
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (isinstance(self.n, int) and self.n >= 1):
            raise InvalidRequestError(f"n must be a positive integer, got {self.n!r}")
        check_temperature(self.temperature, greedy=True)
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise InvalidRequestError(f"top_k must be a non-negative integer (0: no limit), got {self.top_k!r}")
        if (bad := next((i for i, t in enumerate(self.stop_token_ids) if t < 0), None)) is not None:
            raise InvalidRequestError(
                f"stop_token_ids[{bad}] is {self.stop_token_ids[bad]}: token ids are non-negative"
            )
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < _U64):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class Completion:
    """One sampled completion of one prompt.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the temperature-scaled distribution it was
    drawn from, before top-p/top-k truncation (temperature 1 for greedy decoding), in float32 precision;
    ``versions[i]`` is the policy version of the weights that produced the distribution.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    text: str | None = None

    @property
    def behaviour_version(self) -> int | None:
        """The oldest version of any token (docs/design.md §1); None for an empty (aborted) completion."""
        return min(self.versions) if self.versions else None


@dataclass(frozen=True, slots=True)
class ScoredSequence:
    """A completion to score: the prompt it continues and its tokens."""

    prompt_token_ids: Sequence[int]
    completion_token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class Scores:
    """The log-prob of every completion token of each scored sequence, and the version that scored them."""

    logprobs: list[list[float]]
    policy_version: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Dtype and shape of one named weight the engine accepts."""

    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(slots=True)
class EngineStats:
    """A snapshot of one engine, for the service's ``EngineStatus``."""

    engine_id: str
    backend: str
    model: str
    state: EngineState
    policy_version: int
    in_flight_requests: int
    running_sequences: int
    waiting_sequences: int
    weight_update_in_progress: bool
    receiving_policy_version: int
    last_error: str = ""
    counters: dict[str, float] = field(default_factory=dict)


def check_weight_specs(
    accepted: Mapping[str, TensorSpec], given: Mapping[str, tuple[torch.dtype, Sequence[int]]]
) -> None:
    """Raise WeightUpdateError unless every given (name, dtype, shape) is a weight the engine accepts.

    Shapes must match exactly; a floating-point dtype may differ from the engine's (it is cast on load), any
    other dtype must match. An empty update is rejected.
    """
    if not given:
        raise WeightUpdateError("a weight update must name at least one tensor")
    unknown = [n for n in given if n not in accepted]
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise WeightUpdateError(f"unknown weight name(s): {shown} (not parameters of the model)")
    problems = []
    for name, (dtype, shape) in given.items():
        spec = accepted[name]
        if tuple(shape) != spec.shape:
            problems.append(f"{name}: shape {list(shape)} != {list(spec.shape)}")
        elif dtype != spec.dtype and not (dtype.is_floating_point and spec.dtype.is_floating_point):
            problems.append(f"{name}: dtype {dtype} cannot be loaded into {spec.dtype}")
    if problems:
        more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise WeightUpdateError("weights do not match the model: " + "; ".join(problems[:5]) + more)


def staged_copies(
    accepted: Mapping[str, TensorSpec],
    tensors: Mapping[str, torch.Tensor],
    place: Callable[[str, torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """A weight update checked as every engine checks one (tensors only, ``check_weight_specs``, finite
    values) and each tensor placed where the engine loads it from: ``place(name, tensor)``, a copy the
    caller may not change. Raises WeightUpdateError and stages nothing."""
    bad = [n for n, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise WeightUpdateError(f"weights must be tensors: {bad[:5]}")
    check_weight_specs(accepted, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    staged: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        buf = place(name, t.detach())
        if buf.is_floating_point() and not bool(torch.isfinite(buf).all()):
            raise WeightUpdateError(f"{name}: has non-finite values (nan or inf)")
        staged[name] = buf
    return staged


MAX_POLICY_VERSION = 2**53
"""The largest policy version: the queue's bound (docs/queue.md), exact in a double (metrics) and in any JSON
reader. The wire's uint64 allows more, which the engine's int64 per-token versions cannot hold."""


def check_policy_version(version: int) -> None:
    """Raise WeightUpdateError, naming policy_version, unless ``version`` is in [0, MAX_POLICY_VERSION]: what
    every path that sets a version checks before it stages, receives or confirms anything."""
    if not 0 <= version <= MAX_POLICY_VERSION:
        raise WeightUpdateError(
            f"policy_version {version} is outside [0, {MAX_POLICY_VERSION}] (2**53, the largest version tauflow takes)"
        )


def settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> bool:
    """Resolves a caller's ``future`` (its ``result``, or ``error``) unless the caller left: its call was
    cancelled (a sidecar that died, a deadline), or a re-base dropped it. Race-free against a cancel from
    another thread (the future is set running first). False when there was no one to tell: a future set
    directly after a cancel raised InvalidStateError in the engine's thread, whose catch-all then failed every
    request in flight."""
    if future.done() or not (future.running() or future.set_running_or_notify_cancel()):
        return False
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return True


def check_newer(version: int, newest: int, rebase: bool) -> None:
    """A staged version must be a valid version (``check_policy_version``) newer than the newest served or
    staged, unless it re-bases."""
    check_policy_version(version)
    if version <= newest and not rebase:
        raise WeightUpdateError(f"version {version} is not newer than version {newest} (served or staged)")


class GenerationEngine(ABC):
    """The interface of a generation engine.

    Thread-safety: every public method may be called from any thread. ``submit`` returns a
    ``concurrent.futures.Future``; ``generate`` is the asyncio form of it (cancelling the awaiting task
    cancels the request: its sequences are dropped at the next decoding step).

    Versions: ``policy_version`` is the version the engine samples with now. ``stage_weights`` hands the engine
    a new version; the engine validates it at once (raising ``WeightUpdateError``, old weights untouched) and
    swaps it in at its next safe point, between two decoding steps. The returned future, the listeners added
    with ``add_version_listener``, and ``wait_for_version`` confirm the loaded version.
    """

    backend: ClassVar[str]

    def __init__(self, engine_id: str, policy_version: int) -> None:
        self.engine_id = engine_id
        check_policy_version(int(policy_version))
        self._version = int(policy_version)
        self._version_cv = threading.Condition()
        self._version_listeners: list[Callable[[int], None]] = []

    @classmethod
    @abstractmethod
    def from_pretrained(cls, path: str | os.PathLike[str], **options: Any) -> GenerationEngine:
        """Load a Hugging Face checkpoint folder and start an engine on it (how the service builds its engine);
        ``options`` are the backend's own (the config's ``engine_options``, ``engine_id``, ``seed``)."""

    # -- generation ---------------------------------------------------------------------------------------------

    @abstractmethod
    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, media: Sequence[PromptMedia] | None = None
    ) -> Future[list[list[Completion]]]:
        """Queue ``params.n`` completions of each prompt (token ids). The future's result has one list of ``n``
        completions per prompt, in order. ``media``: for a multimodal model, each prompt's encoder inputs
        (tauflow.models.processor's ``Processed.inputs``; None or ``{}`` for a text prompt), its media
        placeholders already in its token ids. Raises InvalidRequestError (bad prompt or params, media the
        model cannot take) or EngineClosedError at once; the future fails only on an engine error."""

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, media: Sequence[PromptMedia] | None = None
    ) -> list[list[Completion]]:
        """``submit`` for asyncio callers; cancelling the caller cancels the request."""
        return await asyncio.wrap_future(self.submit(prompts, params, media))

    # -- scoring ------------------------------------------------------------------------------------------------

    def submit_scoring(self, sequences: Sequence[ScoredSequence], temperature: float = 1.0) -> Future[Scores]:
        """Queue the scoring of completions: each completion token's log-prob under the weights served when
        the engine gets to it (as behaviour log-probs are computed: log-softmax of logits / temperature), no
        sampling. Raises InvalidRequestError (an empty prompt, a token outside the vocabulary, longer than
        the context, a bad temperature) or EngineClosedError at once. A backend that cannot score raises
        NotImplementedError."""
        raise NotImplementedError(f"the {self.backend} engine does not score sequences")

    async def score(self, sequences: Sequence[ScoredSequence], temperature: float = 1.0) -> Scores:
        """``submit_scoring`` for asyncio callers."""
        return await asyncio.wrap_future(self.submit_scoring(sequences, temperature))

    # -- weights ------------------------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version new tokens are sampled with."""
        return self._version

    @abstractmethod
    def weight_spec(self) -> Mapping[str, TensorSpec]:
        """Every weight name (Hugging Face naming, tied aliases included) the engine accepts, with dtype and shape."""

    @abstractmethod
    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor], rebase: bool = False) -> Future[int]:
        """Stage ``tensors`` (all or some of the weights) as policy ``version``; it must be newer than the version
        served and than any version already staged, unless ``rebase`` (a trainer resumed from an older
        checkpoint: the version goes back, and versions staged after it are dropped). Raises WeightUpdateError for a bad version, name, shape or
        dtype (nothing is staged). The future resolves to ``version`` once it is loaded."""

    @property
    def newest_version(self) -> int:
        """The newest version served or staged: a version staged without ``rebase`` must be above it."""
        return self._version

    def stage_broadcast(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[int]:
        """Stage a version the weight sidecar sent. The sidecar sends only the newest version it holds, so one
        at or below the newest version served *or staged* here is a re-base (the trainer resumed from an older
        checkpoint) or a resend after a membership change: it replaces what was staged after it (dropped),
        rather than being rejected as not newer."""
        return self.stage_weights(version, tensors, rebase=int(version) <= self.newest_version)

    def add_version_listener(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(version)`` after each version is loaded (from the engine's thread; keep it short)."""
        with self._version_cv:
            self._version_listeners.append(callback)

    def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until the engine serves ``version`` or newer; False if ``timeout`` passes first."""
        with self._version_cv:
            return self._version_cv.wait_for(lambda: self._version >= version, timeout)

    async def reach_version(self, version: int, timeout: float | None = None) -> bool:
        """``wait_for_version`` for asyncio callers, without holding a thread while it waits: cancelling the
        caller ends the wait. False if ``timeout`` passes first."""
        loop = asyncio.get_running_loop()
        reached: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not reached.done():
                reached.set_result(None)

        def on_version(loaded: int) -> None:  # (the engine's thread)
            if loaded >= version and not loop.is_closed():
                loop.call_soon_threadsafe(settle)

        with self._version_cv:
            if self._version >= version:
                return True
            self._version_listeners.append(on_version)
        try:
            async with asyncio.timeout(timeout):  # (not wait_for: on 3.11 it can swallow a cancellation)
                await reached
            return True
        except TimeoutError:
            return False
        finally:
            with self._version_cv:
                self._version_listeners.remove(on_version)

    def _publish_version(self, version: int) -> None:
        """For engines: the weights of ``version`` are loaded and serve from the next sampled token on."""
        with self._version_cv:
            self._version = version
            self._version_cv.notify_all()
            listeners = list(self._version_listeners)
        for callback in listeners:
            try:
                callback(version)
            except Exception:  # noqa: BLE001 - a listener's failure must not stop the engine
                _log.exception("version listener failed for version %d", version)

    # -- life cycle ---------------------------------------------------------------------------------------------

    @abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the engine's state and load."""

    @abstractmethod
    def close(self) -> None:
        """Stop the engine. Requests still in flight resolve with ABORT completions (the tokens so far);
        staged versions not yet loaded fail with EngineClosedError. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
