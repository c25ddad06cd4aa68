"""The `hf` engine: batched sampling with a transformers causal LM and its KV cache, on CPU or GPU.

One engine thread owns the model and a *running batch*: every sequence being decoded, one row each, with a
left-padded KV cache (``DynamicCache``), a 2-D attention mask and per-row position ids. Each turn of the loop:

1. applies staged weight versions (the safe point: no forward pass is in progress) and, when sequences are in
   flight, recomputes their KV cache with the new weights, so every token sampled after the swap is drawn from
   exactly the new policy;
2. admits waiting sequences (continuous batching): their prompts are prefilled together (a prompt shared by
   the ``n`` samples of a request is prefilled once), they draw their first token, and their cache is merged
   into the running batch (left-padded to a common length);
3. runs one decoding step for all rows: one forward pass of one token per row, then sampling as tensor ops
   (rows that finished are masked, not looped over);
4. hands finished sequences back to their requests, and drops finished rows from the batch when worthwhile;
5. scores one chunk (``max_prefill_tokens`` padded tokens at most) of the oldest ComputeLogprobs job, so that
   however many jobs wait, a decoding step waits for one chunk at most.

(Over 450 lines: the loop, the running batch it owns and the cache surgery on it are one state machine on
one thread; split, each part would need the others' invariants.)
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from tauflow.models.offload import ParameterOffload
from tauflow.models.processor import accepted_inputs, media_token_ids
from tauflow.rollout.engine.base import (
    Completion,
    EngineClosedError,
    EngineState,
    EngineStats,
    FinishReason,
    GenerationEngine,
    InvalidRequestError,
    PromptMedia,
    SamplingParams,
    ScoredSequence,
    Scores,
    TensorSpec,
    check_newer,
    check_temperature,
    settle,
    staged_copies,
)
from tauflow.rollout.engine.sampling import counter_uniforms, row_keys, sample_tokens

if TYPE_CHECKING:  # transformers loads when a model does (from_pretrained), not with this module
    from transformers import PreTrainedModel

__all__ = ["HFEngine"]

_log = logging.getLogger(__name__)

_STOP = int(FinishReason.STOP)
_LENGTH = int(FinishReason.LENGTH)


# -- KV cache plumbing (transformers 5.x keeps cache layers; 4.x kept key/value lists) --------------------------------
# A plain DynamicCache: measured, a preallocated cache written in place was slower on CPU (attention then reads
# non-contiguous keys), and the cache concatenation is a small part of a step.


def _new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def _map_cache(cache: Any, fn: Any, other: Any = None) -> None:
    """Replace, in place, every cached key and value tensor ``t`` by ``fn(t)`` (or ``fn(t, same tensor of other)``).
    Used to drop, reorder, trim and merge rows without copying through the cache's own ``update``."""
    if hasattr(cache, "layers"):
        pairs = zip(cache.layers, other.layers if other is not None else [None] * len(cache.layers), strict=True)
        for layer, o in pairs:
            layer.keys = fn(layer.keys) if o is None else fn(layer.keys, o.keys)
            layer.values = fn(layer.values) if o is None else fn(layer.values, o.values)
    else:  # transformers < 4.56
        for i in range(len(cache.key_cache)):
            for name in ("key_cache", "value_cache"):
                mine = getattr(cache, name)
                mine[i] = fn(mine[i]) if other is None else fn(mine[i], getattr(other, name)[i])


# -- requests and the running batch ---------------------------------------------------------------------------------


class _Request:
    __slots__ = (
        "counted",
        "future",
        "media",
        "params",
        "prompts",
        "remaining",
        "results",
        "seeds",
        "stop_finals",
        "stop_ids",
        "stop_window",
    )

    def __init__(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        stop_ids: list[int],
        media: list[dict[str, torch.Tensor] | None],
    ):
        self.prompts = prompts
        self.media = media  # per prompt: a multimodal prompt's encoder inputs, on the engine's device
        self.params = params
        self.seeds = seeds
        self.stop_ids = stop_ids
        # Tokens decoded to look for a stop string that the newest token may have completed: a byte-level
        # token spells at least one byte (a few more tokens cover a character split across tokens).
        self.stop_window = max((len(s.encode()) for s in params.stop), default=0) + 4
        self.stop_finals = frozenset(s[-1] for s in params.stop) | {"\ufffd"}  # (U+FFFD: a split character)
        self.results: list[list[Completion | None]] = [[None] * params.n for _ in prompts]
        self.remaining = len(prompts) * params.n
        self.counted = True  # still counted in the engine's in-flight requests
        self.future: Future[list[list[Completion]]] = Future()


@dataclass
class _ScoreJob:
    """Sequences to score (prompt, completion), their temperature, and the caller's future; once started, the
    sequences not scored yet (longest first), the log-probs so far and the version they are of."""

    sequences: list[tuple[list[int], list[int]]]
    temperature: float
    future: Future[Scores]
    order: list[int] | None = None  # None: not started
    out: list[list[float]] = field(default_factory=list)
    version: int = 0


class _Row:
    __slots__ = ("prompt_index", "req", "sample_index")

    def __init__(self, req: _Request, prompt_index: int, sample_index: int):
        self.req = req
        self.prompt_index = prompt_index
        self.sample_index = sample_index


@dataclass(slots=True)
class _Staged:
    version: int
    tensors: dict[str, torch.Tensor]
    future: Future[int]


# Per-row tensors of the running batch; all are indexed together when rows are dropped or merged.
_ROW_FIELDS = (
    "last",
    "pos",
    "delta",
    "n_gen",
    "max_new",
    "temp",
    "top_p",
    "top_k",
    "key",
    "stop",
    "done",
    "finish",
    "toks",
    "lps",
    "vers",
)


class _Batch:
    """Sequences being decoded. Invariant: the cache holds every token of a row except ``last`` (sampled, not yet
    fed); ``mask`` has one column per cache position (0 for left padding); ``pos`` is the position of ``last``."""

    rows: list[_Row]
    cache: Any
    mask: torch.Tensor  # [B, L] long
    last: torch.Tensor  # [B] long
    pos: torch.Tensor  # [B] long
    delta: torch.Tensor  # [B] long, a multimodal row's rope offset: its next position is pos + delta (Qwen's 3-D rope)
    n_gen: torch.Tensor  # [B] long, tokens generated so far
    max_new: torch.Tensor  # [B] long
    temp: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] long
    key: torch.Tensor  # [B] long, RNG key of the row
    stop: torch.Tensor  # [B, S] long, -1 padded
    done: torch.Tensor  # [B] bool
    finish: torch.Tensor  # [B] long (FinishReason)
    toks: torch.Tensor  # [B, T] long, T = max max_new + 1 (one scratch column for finished rows)
    lps: torch.Tensor  # [B, T] float32
    vers: torch.Tensor  # [B, T] long
    n_done: int
    truncate: bool
    any_greedy: bool
    any_stop_strings: bool

    def refresh_flags(self) -> None:
        self.truncate = bool(((self.top_k > 0) | (self.top_p < 1)).any())
        self.any_greedy = bool((self.temp <= 0).any())
        self.any_stop_strings = any(r.req.params.stop for r in self.rows)

    @property
    def size(self) -> int:
        return len(self.rows)


def _select(b: _Batch, idx: torch.Tensor, rows: list[_Row]) -> _Batch:
    """The rows ``idx`` of ``b`` (a new batch that takes over b's cache), with left padding that no row needs any
    more trimmed."""
    out = _Batch()
    out.rows = rows
    for name in _ROW_FIELDS:
        setattr(out, name, getattr(b, name).index_select(0, idx))
    mask = b.mask.index_select(0, idx)
    first = int(mask.any(dim=0).to(torch.int8).argmax()) if mask.shape[1] else 0
    _map_cache(b.cache, lambda t: t.index_select(0, idx)[:, :, first:])
    out.mask = mask[:, first:]
    out.cache = b.cache
    out.n_done = int(out.done.sum())
    out.refresh_flags()
    return out


def _merge(a: _Batch, b: _Batch) -> _Batch:
    """Rows of ``a`` then rows of ``b`` (a new batch that takes over a's cache): caches left-padded to a common
    length, outputs right-padded."""
    out = _Batch()
    out.rows = a.rows + b.rows
    la, lb = a.mask.shape[1], b.mask.shape[1]
    length = max(la, lb)
    out.mask = torch.cat([F.pad(a.mask, (length - la, 0)), F.pad(b.mask, (length - lb, 0))])
    _map_cache(
        a.cache, lambda x, y: torch.cat([F.pad(x, (0, 0, length - la, 0)), F.pad(y, (0, 0, length - lb, 0))]), b.cache
    )
    out.cache = a.cache
    width = max(a.toks.shape[1], b.toks.shape[1])
    stops = max(a.stop.shape[1], b.stop.shape[1])
    for name in _ROW_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if name in ("toks", "lps", "vers"):
            x, y = F.pad(x, (0, width - x.shape[1])), F.pad(y, (0, width - y.shape[1]))
        elif name == "stop":
            x, y = F.pad(x, (0, stops - x.shape[1]), value=-1), F.pad(y, (0, stops - y.shape[1]), value=-1)
        setattr(out, name, torch.cat([x, y]))
    out.n_done = a.n_done + b.n_done
    out.truncate = a.truncate or b.truncate
    out.any_greedy = a.any_greedy or b.any_greedy
    out.any_stop_strings = a.any_stop_strings or b.any_stop_strings
    return out


# -- the engine -----------------------------------------------------------------------------------------------------


class HFEngine(GenerationEngine):
    """A generation engine on a transformers causal LM (decoder-only, full attention on every layer).

    Build it with ``HFEngine.from_pretrained(path)`` (the real loading path) or around a model you already hold.
    The engine starts its thread at once and serves ``policy_version`` (the version of the weights it was given).

    Options: ``max_running`` bounds the sequences decoded together (more wait); ``max_prefill_tokens`` bounds the
    prompt tokens prefilled in one turn (at least one prompt is always admitted); ``batch_wait_s`` is how long an
    idle engine waits after the first request for others to join its first batch; ``recompute_kv_on_swap``
    (default True) re-prefills in-flight sequences after a weight swap so that their later tokens are sampled
    from exactly the new weights (False keeps the cache computed with the old weights: faster, and the
    behaviour log-probs are then those of a mixture); ``seed`` seeds the draw of seeds for requests without one;
    ``eos_token_ids`` replaces the ids that end a completion (default: the checkpoint's generation config), and
    ``extra_eos_token_ids`` adds to them (the rollout adds its tokenizer's EOS: an instruct model's end of turn);
    ``release_memory_when_idle`` (colocated mode, docs/gpu.md) hands the GPU memory the engine's caching
    allocator holds but no longer uses (the KV cache of the batch just finished, the staged copy of a swapped-in
    version) back to the driver whenever the engine runs out of work, so that a trainer on the same GPU can
    have it while it steps; ``offload_weights_when_idle`` (colocated mode) also moves the engine's weights to
    host memory then, once it has generated or scored since its last offload (not after a weight update alone:
    requests come next), and back before its next forward. A weight update that arrives meanwhile becomes the
    weights as it is, without copying the old ones back. Weight updates replace every tensor at τ = 0, so the
    engine holds one copy of the weights at most, where a swap otherwise holds two. Either happens once the
    engine has had no work for ``release_after_idle_s`` (so that a gap between two calls costs no round trip
    of the weights).
    """

    backend: ClassVar[str] = "hf"

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        engine_id: str = "hf-0",
        policy_version: int = 0,
        model_name: str = "",
        tokenizer: Any = None,
        max_running: int = 1024,
        max_prefill_tokens: int = 32768,
        batch_wait_s: float = 0.002,
        recompute_kv_on_swap: bool = True,
        eos_token_ids: Sequence[int] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        release_memory_when_idle: bool = False,
        offload_weights_when_idle: bool = False,
        release_after_idle_s: float = 0.05,
    ) -> None:
        super().__init__(engine_id, policy_version)
        config = model.config
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(config, "is_encoder_decoder", False):
            raise ValueError(
                f"the hf engine needs a decoder-only model with full attention on every layer, "
                f"got layer types {sorted(layer_types)}"
            )
        if max_running < 1 or max_prefill_tokens < 1:
            raise ValueError("max_running and max_prefill_tokens must be positive")
        if not (0 <= release_after_idle_s <= 3600):
            raise ValueError(f"release_after_idle_s must be within [0, 3600], not {release_after_idle_s}")
        self._model = model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self._device = next(model.parameters()).device
        self._release_when_idle = release_memory_when_idle and self._device.type == "cuda"
        self.memory_releases = 0  # times the idle engine handed its cached GPU memory back
        self._offload = ParameterOffload([model]) if offload_weights_when_idle else None
        self._release_after_idle_s = release_after_idle_s
        self._served_since_offload = False  # generated or scored since the weights last left the device
        self.model_name = model_name or str(getattr(config, "_name_or_path", "") or type(model).__name__)
        self._tokenizer = tokenizer
        # token ids -> text, for stop strings (the rollout service passes its tokenizer's decode)
        self._detokenize = detokenize or (
            None if tokenizer is None else lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        )
        self._max_running = max_running
        self._max_prefill_tokens = max_prefill_tokens
        self._batch_wait_s = batch_wait_s
        self._recompute_kv = recompute_kv_on_swap
        self._rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        out_emb = model.get_output_embeddings()
        self.vocab_size = int(out_emb.weight.shape[0]) if out_emb is not None else int(text_config.vocab_size)
        self.max_context = getattr(text_config, "max_position_embeddings", None)
        if eos_token_ids is None:
            gen = getattr(model, "generation_config", None)
            eos: Any = getattr(gen, "eos_token_id", None) if gen is not None else None
            if eos is None:
                eos = getattr(config, "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in (*eos_token_ids, *extra_eos_token_ids)))
        pad = getattr(text_config, "pad_token_id", None)
        self._pad = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0

        forward = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward else "past_key_values"
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in forward), None)

        # a multimodal model keeps the rope offset of its last prefill here (Qwen's rope_deltas)
        self._rope_state: torch.nn.Module | None = next((m for m in model.modules() if hasattr(m, "rope_deltas")), None)
        # media placeholders and their markers are never sampled (the trainer scores with the same mask)
        banned = media_token_ids(config) if self._rope_state is not None else []
        self._banned = torch.tensor(banned, dtype=torch.long, device=self._device) if banned else None
        self._banned_set = frozenset(banned)
        self._media_kw = set(forward)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._spec = {n: TensorSpec(p.dtype, tuple(p.shape)) for n, p in self._params.items()}

        self._cv = threading.Condition()
        self._waiting: deque[_Row] = deque()
        self._staged: list[_Staged] = []
        self._scoring: list[_ScoreJob] = []
        self._newest_staged = self._version
        self._cancel_pending = False
        self._closing = False
        self._drain = False
        self._closed = False
        self._in_flight = 0
        self._running = 0
        self._last_error = ""
        self._batch: _Batch | None = None
        self.counters = {
            "tokens": 0,
            "sequences": 0,
            "decode_steps": 0,
            "prefill_tokens": 0,
            "weight_swaps": 0,
            "kv_recomputed_tokens": 0,
            "scored_tokens": 0,
            "weight_offloads": 0,
        }
        self._thread = threading.Thread(target=self._loop, name=f"tauflow-hf-engine-{engine_id}", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = "auto",
        attn_implementation: str | None = None,
        load_tokenizer: bool = False,
        **options: Any,
    ) -> HFEngine:
        """Load a Hugging Face checkpoint directory (``AutoModelForCausalLM.from_pretrained``) and start an engine on
        it (a multimodal folder: the image-text-to-text class its config names). ``load_tokenizer`` also loads its
        tokenizer, to decode ``Completion.text``."""
        import transformers

        from tauflow.models.processor import load_model

        kwargs: dict[str, Any] = {}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        kwargs[dtype_kw] = dtype
        model = load_model(Path(path), **kwargs)
        model = model.to(device)
        tokenizer = None
        if load_tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
        options.setdefault("model_name", str(Path(path)))
        return cls(model, tokenizer=tokenizer, **options)

    # -- public API ---------------------------------------------------------------------------------------------

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, media: Sequence[PromptMedia] | None = None
    ) -> Future[list[list[Completion]]]:
        if not prompts:
            raise InvalidRequestError("at least one prompt is needed")
        if media is not None and len(media) != len(prompts):
            raise InvalidRequestError(f"{len(media)} media entries for {len(prompts)} prompts")
        inputs = [self._media_inputs(i, m) for i, m in enumerate(media or [None] * len(prompts))]
        for i, (prompt, m) in enumerate(zip(prompts, inputs, strict=True)):
            if m is None and self._banned_set.intersection(int(t) for t in prompt):
                # they would stand for media that do not exist: the forward of the whole batch would fail
                raise InvalidRequestError(f"prompt {i} holds the model's media tokens without its media")
        vocab = self.vocab_size
        clean: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids:
                raise InvalidRequestError(f"prompt {i} is empty")
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidRequestError(f"prompt {i} has a token id outside [0, {vocab})")
            if self.max_context is not None and len(ids) + params.max_new_tokens > self.max_context:
                raise InvalidRequestError(
                    f"prompt {i}: {len(ids)} prompt tokens + max_new_tokens {params.max_new_tokens} exceed the "
                    f"model's context of {self.max_context}"
                )
            clean.append(ids)
        if params.stop and self._detokenize is None:
            raise InvalidRequestError("stop strings need the model's tokenizer, and this engine has none")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {vocab}")
        stop_ids = list(dict.fromkeys((() if params.ignore_eos else self.eos_token_ids) + params.stop_token_ids))
        seeds = [params.seed if params.seed is not None else self._rng.getrandbits(64) for _ in clean]
        req = _Request(clean, params, seeds, stop_ids, inputs)
        with self._cv:
            if self._closing:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            self._waiting.extend(_Row(req, i, j) for i in range(len(clean)) for j in range(params.n))
            self._in_flight += 1
            self._cv.notify()
        req.future.add_done_callback(lambda f: self._on_request_done(req, f))
        return req.future

    def _media_inputs(self, i: int, media: PromptMedia) -> dict[str, torch.Tensor] | None:
        if not media:
            return None
        if self._rope_state is None:
            raise InvalidRequestError(f"prompt {i} has media and the model is a text model")
        unknown = sorted(k for k in media if k not in self._media_kw and k != "video_second_per_grid")
        if unknown:
            raise InvalidRequestError(f"prompt {i}: the model takes no {', '.join(unknown)}")

        return dict(media)  # moved to the device when prefilled (not on the caller's thread, not while queued)

    def submit_scoring(self, sequences: Sequence[ScoredSequence], temperature: float = 1.0) -> Future[Scores]:
        if not sequences:
            raise InvalidRequestError("at least one sequence is needed")
        check_temperature(temperature, greedy=False)
        vocab = self.vocab_size
        clean: list[tuple[list[int], list[int]]] = []
        for i, seq in enumerate(sequences):
            prompt, completion = [int(t) for t in seq.prompt_token_ids], [int(t) for t in seq.completion_token_ids]
            if not prompt:
                raise InvalidRequestError(f"sequences[{i}].prompt_token_ids is empty")
            ids = prompt + completion
            if self._banned_set.intersection(ids):
                raise InvalidRequestError(f"sequences[{i}] holds the model's media tokens (media are not scored yet)")
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidRequestError(f"sequences[{i}] has a token id outside [0, {vocab})")
            if self.max_context is not None and len(ids) > self.max_context:
                raise InvalidRequestError(
                    f"sequences[{i}] has {len(ids)} tokens, over the model's context of {self.max_context}"
                )
            clean.append((prompt, completion))
        job = _ScoreJob(clean, float(temperature), Future())
        with self._cv:
            if self._closing:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            self._scoring.append(job)
            self._cv.notify()
        return job.future

    def weight_spec(self) -> Mapping[str, TensorSpec]:
        return dict(self._spec)

    @property
    def newest_version(self) -> int:
        with self._cv:
            return self._newest_staged

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor], rebase: bool = False) -> Future[int]:
        version = int(version)
        with self._cv:
            if self._closing:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            newest = self._newest_staged
        check_newer(version, newest, rebase)
        staged = staged_copies(
            self._spec,
            tensors,
            lambda name, t: t.to(device=self._params[name].device, dtype=self._params[name].dtype, copy=True),
        )
        future: Future[int] = Future()
        with self._cv:
            if self._closing:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            check_newer(version, self._newest_staged, rebase)
            if rebase:  # the trainer resumed from an older checkpoint: what was staged after it is void
                for dropped in self._staged:
                    dropped.future.cancel()
                self._staged.clear()
            self._newest_staged = version
            self._staged.append(_Staged(version, staged, future))
            self._cv.notify()
        return future

    def stats(self) -> EngineStats:
        with self._cv:
            waiting = len(self._waiting)
            staged = [s.version for s in self._staged]
            in_flight = self._in_flight
        update = bool(staged) or self._newest_staged > self._version
        state = EngineState.DRAINING if self._closing else EngineState.SERVING  # closed: accepts nothing new
        return EngineStats(
            engine_id=self.engine_id,
            backend=self.backend,
            model=self.model_name,
            state=state,
            policy_version=self._version,
            in_flight_requests=in_flight,
            running_sequences=self._running,
            waiting_sequences=waiting,
            weight_update_in_progress=update,
            receiving_policy_version=self._newest_staged if update else 0,
            last_error=self._last_error,
            counters=dict(self.counters),
        )

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the engine; with ``drain`` it first finishes every request already submitted (new ones are refused
        from now on)."""
        with self._cv:
            if not self._closing:
                self._closing = True
                self._drain = drain
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------------------------

    def _uncount(self, req: _Request) -> None:
        with self._cv:
            if req.counted:
                req.counted = False
                self._in_flight -= 1

    def _on_request_done(self, req: _Request, future: Future[Any]) -> None:
        self._uncount(req)
        with self._cv:
            if future.cancelled():
                self._cancel_pending = True
                self._cv.notify()

    def _has_work(self) -> bool:
        return bool(
            self._waiting
            or self._staged
            or self._scoring
            or self._batch is not None
            or self._cancel_pending
            or self._closing
        )

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    was_idle = self._batch is None and not self._staged
                    out_of_work = was_idle and not self._has_work()
                if out_of_work:
                    self._rest()
                with self._cv:
                    self._cv.wait_for(self._has_work)
                    if self._closing and not (self._drain and (self._waiting or self._batch is not None)):
                        break
                if was_idle and self._batch_wait_s > 0 and self._waiting:
                    time.sleep(self._batch_wait_s)  # let the other requests of a burst arrive
                with self._cv:
                    # Scoring goes one chunk a turn (so that a long job holds the decoding of the running batch
                    # up for one chunk at most), the oldest job first. A job under way holds staged versions
                    # back until its last chunk: all its log-probs are of one version.
                    job = self._scoring[0] if self._scoring else None
                    if job is None or job.order is None:
                        staged, self._staged = self._staged, []
                    else:
                        staged = []
                    cancel, self._cancel_pending = self._cancel_pending, False
                    if cancel:
                        self._waiting = deque(r for r in self._waiting if not r.req.future.done())
                    admit = self._take_rows_locked()
                try:
                    self._turn(staged, cancel, admit)
                except Exception as exc:  # noqa: BLE001 - keep serving: fail what was in flight, go on with the next
                    _log.exception("hf engine %s: generation failed", self.engine_id)
                    self._last_error = f"{type(exc).__name__}: {exc}"
                    self._fail_in_flight(exc, admit, staged)
                if job is not None:
                    self._score_step(job)  # its failure is its own
        finally:
            self._shutdown()

    def _rest(self) -> None:
        """Out of work, in colocated mode, and still so after ``release_after_idle_s``: the weights go to host
        memory (once the engine has served since they last did), and what the last batch and swap used goes
        back to the driver."""
        offload = self._offload is not None and self._served_since_offload
        if not (offload or self._release_when_idle):
            return
        with self._cv:
            if self._cv.wait_for(self._has_work, timeout=self._release_after_idle_s):
                return  # work came first
        moved = None
        try:
            if self._offload is not None and offload:
                moved = self._offload.to_host()  # (on a GPU it empties the cache too)
                self._served_since_offload = False
            else:
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - e.g. no pinned host memory left: serve on (what left comes back)
            _log.exception("hf engine %s: could not release memory while idle", self.engine_id)
            return
        # Both counts move together, before the log line: a reader that saw the offload counted sees the release.
        self.memory_releases += 1
        if moved is not None:
            self.counters["weight_offloads"] += 1
            if self.counters["weight_offloads"] == 1:
                _log.info("hf engine %s: weights offloaded to host memory while idle (%d bytes)", self.engine_id, moved)

    def _wake(self) -> None:
        """Before a forward: the weights still in host memory come back (outside inference mode, so that a
        later weight update may write into them)."""
        if self._offload is not None:
            self._offload.to_device()
            self._served_since_offload = True

    def _take_rows_locked(self) -> list[_Row]:
        running = 0 if self._batch is None else self._batch.size - self._batch.n_done
        room = self._max_running - running
        rows: list[_Row] = []
        budget = self._max_prefill_tokens
        last: tuple[int, int] | None = None
        while self._waiting and len(rows) < room:
            row = self._waiting[0]
            if row.req.future.done():  # cancelled or failed while waiting
                self._waiting.popleft()
                continue
            key = (id(row.req), row.prompt_index)
            if key != last:
                cost = len(row.req.prompts[row.prompt_index])
                if rows and cost > budget:
                    break
                budget -= cost
                last = key
            rows.append(self._waiting.popleft())
        return rows

    def _turn(self, staged: list[_Staged], cancel: bool, admit: list[_Row]) -> None:
        if staged:
            self._apply_weights(staged)
        if admit or self._batch is not None:
            self._wake()
        with torch.inference_mode():
            if staged and self._batch is not None:
                self._batch = self._compact(self._batch)
                if self._batch is not None and self._recompute_kv:
                    self._recompute_cache(self._batch)
            if cancel and self._batch is not None:
                self._drop_cancelled()
            if admit:
                self._admit(admit)
            if self._batch is not None:
                self._decode_step(self._batch)
        self._running = 0 if self._batch is None else self._batch.size - self._batch.n_done

    # -- scoring --

    def _score_step(self, job: _ScoreJob) -> None:
        """One chunk of the oldest scoring job, after this turn's weight swap and decoding step; with its last
        chunk the job's log-probs are its caller's (they name the version served when its first chunk ran:
        staged versions wait for its last). The future stays pending until then, so a caller that goes away
        (cancels) stops the job at its next chunk; a job that fails fails alone (the engine serves on)."""
        done = True
        if not job.future.cancelled():
            try:
                self._wake()
                with torch.inference_mode():
                    done = self._score_chunk(job)
                if done and job.future.set_running_or_notify_cancel():
                    job.future.set_result(Scores(job.out, job.version))
            except Exception as exc:  # noqa: BLE001 - the caller learns it
                _log.exception("hf engine %s: scoring failed", self.engine_id)
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(exc)
        if done:
            with self._cv:
                if self._scoring and self._scoring[0] is job:
                    self._scoring.pop(0)

    def _score_chunk(self, job: _ScoreJob) -> bool:
        """Scores the job's next chunk: a right-padded forward without a cache over at most
        ``max_prefill_tokens`` padded tokens (the sequences longest first: chunks, and so the numbers, are
        those of scoring the job whole), the log-softmax of logits / temperature gathered at each completion
        token. True once every sequence is scored."""
        if job.order is None:  # its first chunk
            job.order = sorted(range(len(job.sequences)), key=lambda i: -sum(map(len, job.sequences[i])))
            job.out = [[] for _ in job.sequences]
            job.version = self._version
        out, order = job.out, job.order
        if order:
            width = sum(map(len, job.sequences[order[0]]))
            rows = max(1, self._max_prefill_tokens // width)
            chunk, job.order = order[:rows], order[rows:]
            seqs = [job.sequences[i][0] + job.sequences[i][1] for i in chunk]
            ids = torch.tensor([s + [self._pad] * (width - len(s)) for s in seqs], device=self._device)
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=self._device)
            positions = (mask.cumsum(dim=1) - 1).clamp_(min=0)
            logits = self._model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            scaled = logits[:, :-1].float() / job.temperature  # (no [rows, width, V] log-softmax beside it)
            if self._banned is not None:
                scaled = scaled.index_fill(-1, self._banned, float("-inf"))
            picked = scaled.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
            picked = picked.cpu()
            for k, i in enumerate(chunk):
                prompt, completion = job.sequences[i]
                start = len(prompt) - 1  # the target column of the first completion token
                out[i] = picked[k, start : start + len(completion)].tolist()
                self.counters["scored_tokens"] += len(completion)
        return not job.order

    # -- weights --

    def _apply_weights(self, staged: list[_Staged]) -> None:
        with torch.no_grad():
            for s in staged:
                for name, tensor in s.tensors.items():
                    param = self._params[name]
                    if self._offload is None or not self._offload.adopt(param, tensor):
                        param.copy_(tensor)  # (offloaded: the staged copy becomes the weight, nothing copied)
                s.tensors.clear()
        for s in staged:  # (every version copied in is published, whether or not its caller is still there)
            self.counters["weight_swaps"] += 1
            self._publish_version(s.version)
        for s in staged:
            settle(s.future, s.version)

    def _recompute_cache(self, b: _Batch) -> None:
        """Re-prefill every row (prompt + tokens so far, except the pending one) with the current weights."""
        n_gen = b.n_gen.tolist()
        toks = b.toks.tolist()
        seqs = [row.req.prompts[row.prompt_index] + toks[k][: n_gen[k] - 1] for k, row in enumerate(b.rows)]
        media = [row.req.media[row.prompt_index] for row in b.rows]
        b.cache, b.mask, b.pos, b.delta, _ = self._prefill(seqs, media)
        self.counters["kv_recomputed_tokens"] += sum(map(len, seqs))

    # -- batch membership --

    def _compact(self, b: _Batch) -> _Batch | None:
        if b.n_done == 0:
            return b
        if b.n_done == b.size:
            return None
        keep = (~b.done).nonzero()[:, 0]
        return _select(b, keep, [b.rows[i] for i in keep.tolist()])

    def _drop_cancelled(self) -> None:
        b = self._batch
        assert b is not None
        keep = [k for k, row in enumerate(b.rows) if not row.req.future.done()]
        if len(keep) == b.size:
            return
        if not keep:
            self._batch = None
            return
        idx = torch.tensor(keep, device=self._device)
        self._batch = _select(b, idx, [b.rows[k] for k in keep])

    def _prefill(
        self, seqs: list[list[int]], media: Sequence[dict[str, torch.Tensor] | None] | None = None
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded forward over ``seqs``: (cache, mask [B, L], next positions [B], rope offsets [B], last
        logits [B, V]). Text rows go together; a row with media goes alone (the model places its media and
        computes its 3-D positions), and the rows' caches are then stitched together, left-padded."""
        media = media or [None] * len(seqs)
        text = [i for i, m in enumerate(media) if not m]
        pieces: list[tuple[list[int], tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        if text:
            pieces.append((text, self._prefill_text([seqs[i] for i in text])))
        pieces += [([i], self._prefill_media(seqs[i], m)) for i, m in enumerate(media) if m]
        if len(pieces) == 1 and pieces[0][0] == list(range(len(seqs))):
            return pieces[0][1]
        length = max(p[1][1].shape[1] for p in pieces)
        order = torch.tensor([i for rows, _ in pieces for i in rows], device=self._device).argsort()
        cache, first_len = pieces[0][1][0], pieces[0][1][1].shape[1]
        _map_cache(cache, lambda t: F.pad(t, (0, 0, length - first_len, 0)))  # keys and values: [B, H, L, D]
        for _, (other, other_mask, *_) in pieces[1:]:
            n = other_mask.shape[1]
            _map_cache(cache, lambda x, y, n=n: torch.cat([x, F.pad(y, (0, 0, length - n, 0))]), other)
        _map_cache(cache, lambda t: t.index_select(0, order))
        mask = torch.cat([F.pad(p[1][1], (length - p[1][1].shape[1], 0)) for p in pieces]).index_select(0, order)
        pos, delta, logits = (torch.cat([p[1][k] for p in pieces]).index_select(0, order) for k in (2, 3, 4))
        return cache, mask, pos, delta, logits

    def _prefill_text(
        self, seqs: list[list[int]]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        length = max(map(len, seqs))
        ids = torch.tensor([[self._pad] * (length - len(s)) + s for s in seqs], device=self._device)
        mask = torch.tensor([[0] * (length - len(s)) + [1] * len(s) for s in seqs], device=self._device)
        positions = (mask.cumsum(dim=1) - 1).clamp_(min=0)
        cache = _new_cache()
        kwargs: dict[str, Any] = {self._cache_kw: cache}
        if self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        out = self._model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
        self.counters["prefill_tokens"] += int(mask.sum())
        delta = torch.zeros(len(seqs), dtype=torch.long, device=self._device)
        return cache, mask, mask.sum(dim=1), delta, out.logits[:, -1]

    def _prefill_media(
        self, seq: list[int], media: dict[str, torch.Tensor]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.tensor([seq], device=self._device)
        mask = torch.ones_like(ids)
        cache = _new_cache()
        on_device = {k: v.to(self._device) for k, v in media.items()}
        kwargs: dict[str, Any] = {self._cache_kw: cache, **accepted_inputs(self._model, on_device, ids)}
        if self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        out = self._model(input_ids=ids, attention_mask=mask, use_cache=True, **kwargs)
        deltas: Any = getattr(self._rope_state, "rope_deltas", None)
        assert deltas is not None, "a multimodal model keeps its prefill's rope offset"
        delta = torch.as_tensor(deltas).reshape(-1)[:1].to(device=self._device, dtype=torch.long)
        self.counters["prefill_tokens"] += len(seq)
        return cache, mask, mask.sum(dim=1), delta, out.logits[:, -1]

    def _admit(self, rows: list[_Row]) -> None:
        prompts: list[list[int]] = []
        media: list[dict[str, torch.Tensor] | None] = []
        which: list[int] = []
        last: tuple[int, int] | None = None
        for row in rows:
            key = (id(row.req), row.prompt_index)
            if key != last:
                prompts.append(row.req.prompts[row.prompt_index])
                media.append(row.req.media[row.prompt_index])  # a group's media are encoded once, here
                last = key
            which.append(len(prompts) - 1)
        cache, mask, pos, delta, logits = self._prefill(prompts, media)
        dev = self._device
        b = _Batch()
        b.rows = rows
        if len(which) != len(prompts):  # the n samples of a prompt share its prefill
            idx = torch.tensor(which, device=dev)
            _map_cache(cache, lambda t: t.index_select(0, idx))
            mask, pos, logits = mask.index_select(0, idx), pos.index_select(0, idx), logits.index_select(0, idx)
            delta = delta.index_select(0, idx)
        b.cache, b.mask, b.pos, b.delta = cache, mask, pos, delta
        params = [row.req.params for row in rows]
        seeds = [row.req.seeds[row.prompt_index] for row in rows]
        seeds = [s - (1 << 64) if s >= (1 << 63) else s for s in seeds]  # the int64 bit pattern
        b.key = row_keys(torch.tensor(seeds, device=dev), torch.tensor([r.sample_index for r in rows], device=dev))
        b.temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        b.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        b.top_k = torch.tensor([p.top_k for p in params], device=dev)
        b.max_new = torch.tensor([p.max_new_tokens for p in params], device=dev)
        width = max(len(r.req.stop_ids) for r in rows)
        b.stop = torch.tensor(
            [r.req.stop_ids + [-1] * (width - len(r.req.stop_ids)) for r in rows], dtype=torch.long, device=dev
        ).reshape(len(rows), width)
        size, cols = len(rows), int(b.max_new.max()) + 1
        b.n_gen = torch.zeros(size, dtype=torch.long, device=dev)
        b.done = torch.zeros(size, dtype=torch.bool, device=dev)
        b.finish = torch.zeros(size, dtype=torch.long, device=dev)
        b.toks = torch.zeros(size, cols, dtype=torch.long, device=dev)
        b.lps = torch.zeros(size, cols, dtype=torch.float32, device=dev)
        b.vers = torch.zeros(size, cols, dtype=torch.long, device=dev)
        b.last = torch.zeros(size, dtype=torch.long, device=dev)  # replaced by the first sampled token
        b.n_done = 0
        b.refresh_flags()
        self._sample(b, logits)
        running = self._batch
        if running is not None and running.n_done:
            running = self._compact(running)
        new = self._compact(b) if 4 * b.n_done >= b.size else b  # a few finished rows stay, masked
        if new is None:
            self._batch = running
        else:
            self._batch = new if running is None else _merge(running, new)

    # -- the decoding step --

    def _decode_step(self, b: _Batch) -> None:
        column = (~b.done).long()[:, None] if b.n_done else torch.ones_like(b.last)[:, None]
        b.mask = torch.cat([b.mask, column], dim=1)
        out = self._model(
            input_ids=b.last[:, None],
            attention_mask=b.mask,
            position_ids=(b.pos + b.delta)[:, None],
            use_cache=True,
            **{self._cache_kw: b.cache},
        )
        b.pos += 1
        self.counters["decode_steps"] += 1
        self._sample(b, out.logits[:, -1])
        if b.n_done == b.size:
            self._batch = None
        elif b.n_done and (4 * b.n_done >= b.size or self._waiting):
            self._batch = self._compact(b)

    def _sample(self, b: _Batch, logits: torch.Tensor) -> None:
        """Draw the next token of every row, record it, and finish rows that stop."""
        if self._banned is not None:
            logits = logits.index_fill(-1, self._banned, float("-inf"))
        uniforms = counter_uniforms(b.key, b.n_gen)
        tok, lp = sample_tokens(
            logits, b.temp, b.top_p, b.top_k, uniforms, truncate=b.truncate, any_greedy=b.any_greedy
        )
        broken = ~torch.isfinite(lp) & ~b.done
        if bool(broken.any()):
            self._fail_rows(b, broken)
        active = ~b.done
        if b.n_done:
            tok = torch.where(active, tok, self._pad)
        col = b.n_gen[:, None]
        b.toks.scatter_(1, col, tok[:, None])
        b.lps.scatter_(1, col, lp[:, None])
        b.vers.scatter_(1, col, self._version)
        b.n_gen += active
        b.last = tok
        stopped = (tok[:, None] == b.stop).any(dim=1) if b.stop.shape[1] else torch.zeros_like(active)
        if b.any_stop_strings:
            stopped = stopped | self._stop_string_hits(b, active)
        finished = stopped | (b.n_gen >= b.max_new)
        if b.n_done:
            finished &= active
        count = int(finished.sum())
        if count:
            b.finish = torch.where(finished, torch.where(stopped, _STOP, _LENGTH), b.finish)
            b.done |= finished
            self._harvest(b, finished.nonzero()[:, 0])

    def _fail_rows(self, b: _Batch, broken: torch.Tensor) -> None:
        """Rows whose logits were not finite (the model overflowed on them) fail their own requests; the other
        rows of the batch decode on. The failed requests' other rows are dropped next turn."""
        error = FloatingPointError("the model's logits were not finite (nan or inf) for this request")
        self._last_error = f"{type(error).__name__}: {error}"
        _log.error("hf engine %s: %s; failing %d row(s)", self.engine_id, error, int(broken.sum()))
        for r in broken.nonzero()[:, 0].tolist():
            settle(b.rows[r].req.future, error=error)
        b.done |= broken
        b.n_done = int(b.done.sum())
        with self._cv:
            self._cancel_pending = True

    def _stop_string_hits(self, b: _Batch, active: torch.Tensor) -> torch.Tensor:
        """Rows whose newest token completed one of their stop strings. Only the tail is decoded: an earlier
        occurrence would have stopped the row at an earlier step."""
        assert self._detokenize is not None  # submit refuses stop strings without it
        hits = torch.zeros_like(active)
        lengths, running, newest = b.n_gen.tolist(), active.tolist(), b.last.tolist()
        for r, row in enumerate(b.rows):
            strings = row.req.params.stop
            if not strings or not running[r]:
                continue
            # a stop string is completed by a token that spells its last character: most steps end here
            if not row.req.stop_finals.intersection(self._detokenize([newest[r]])):
                continue
            n = lengths[r]
            tail = self._detokenize(b.toks[r, max(0, n - row.req.stop_window) : n].tolist())
            if any(s in tail for s in strings):
                hits[r] = True
        return hits

    def _harvest(self, b: _Batch, idx: torch.Tensor) -> None:
        b.n_done += int(idx.numel())
        lengths = b.n_gen[idx].tolist()
        toks, lps, vers = b.toks[idx].tolist(), b.lps[idx].tolist(), b.vers[idx].tolist()
        reasons = b.finish[idx].tolist()
        for k, r in enumerate(idx.tolist()):
            n = lengths[k]
            self._complete(b.rows[r], Completion(toks[k][:n], lps[k][:n], vers[k][:n], FinishReason(reasons[k])))

    def _complete(self, row: _Row, completion: Completion) -> None:
        req = row.req
        if req.future.done():
            return
        if self._tokenizer is not None:
            completion.text = self._tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        self.counters["tokens"] += len(completion.token_ids)
        self.counters["sequences"] += 1
        req.results[row.prompt_index][row.sample_index] = completion
        req.remaining -= 1
        if req.remaining == 0:
            self._uncount(req)  # before the caller wakes up, so that stats() never shows it in flight after
            settle(req.future, [[c for c in group if c is not None] for group in req.results])  # all are in

    # -- failure and shutdown --

    def _fail_in_flight(self, exc: BaseException, admitted: list[_Row], staged: list[_Staged]) -> None:
        rows = list(admitted) + (self._batch.rows if self._batch is not None else [])
        self._batch = None
        self._running = 0
        for row in rows:
            settle(row.req.future, error=exc)
        for s in staged:
            settle(s.future, error=exc)

    def _shutdown(self) -> None:
        with self._cv:
            self._closing = True
            waiting, self._waiting = list(self._waiting), deque()
            staged, self._staged = self._staged, []
        b, self._batch = self._batch, None
        if b is not None:
            with torch.inference_mode():
                active = (~b.done).nonzero()[:, 0]
                if active.numel():
                    b.finish[active] = int(FinishReason.ABORT)
                    self._harvest(b, active)
        for row in waiting:
            self._complete(row, Completion([], [], [], FinishReason.ABORT))
        for s in staged:
            settle(
                s.future, error=EngineClosedError(f"engine {self.engine_id} closed before loading version {s.version}")
            )
        with self._cv:
            scoring, self._scoring = self._scoring, []
        for job in scoring:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(EngineClosedError(f"engine {self.engine_id} closed before scoring"))
        self._running = 0
        self._closed = True
