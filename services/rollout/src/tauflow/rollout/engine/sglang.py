"""The ``sglang`` engine (experimental): an SGLang server behind the engine interface, over SGLang's HTTP API.

Written against SGLang's HTTP API (0.5.6 and later; docs/gpu.md says what was verified):
it has been tested only against ``FakeSGLangServer`` (services/rollout/tests), a fake that records the calls,
because SGLang's CUDA wheels cannot reach the GPU machine of this workplace.

- **Generation.** Each sample of each prompt is one ``POST /generate`` with ``input_ids`` and
  ``return_logprob``; SGLang's radix cache shares the prompt's prefill among the ``n`` samples. Its output
  log-probs are those of the temperature-scaled distribution before top-k/top-p truncation, as this
  interface defines them (greedy: temperature 1), so they pass through unchanged.
- **Weight swaps at a safe point.** A staged version is loaded with ``/pause_generation`` →
  ``/update_weights_from_tensor`` (CUDA IPC handles of the staged tensors: the server must share this
  machine and its GPUs) → ``/continue_generation``. ``swap_mode``:

  * ``retract`` (SGLang ≥ 0.5.21, the default there): running requests are retracted to the waiting queue
    and re-prefilled with the new weights; nothing is aborted. Per-token versions come from the answer's
    ``weight_versions`` spans.
  * ``abort`` (older servers): running requests are answered with what they generated so far; this engine
    resubmits each one with its tokens appended to the prompt and fewer new tokens to go, so the caller
    never sees the abort. Every segment ran under one version, so per-token versions are exact.

  Where a segment's versions cannot be told apart (a retract-mode answer without spans, after a swap), its
  tokens carry the older version: a lower bound, so the queue's staleness check stays safe.
- **Versions.** Every update names its ``weight_version`` (the policy version as a string), and the server
  is told the initial one, so answers say which weights produced them.
- **Taking turns in memory** (colocated mode, docs/gpu.md). ``offload_weights_when_idle`` and
  ``release_memory_when_idle``: once no request has been in flight for ``release_after_idle_s``, the engine
  asks ``/release_memory_occupation`` for the KV cache (and the weights); the next request first asks
  ``/resume_memory_occupation`` for them, a weight update for the weights only. SGLang releases only when
  idle (``/flush_cache`` asks first) and needs ``--enable-memory-saver`` (and ``--enable-weights-cpu-backup``
  for the weights to come back as they were: without it they come back only through the next full update);
  a server this engine starts gets both. ``release_cuda_graphs_when_idle`` releases the CUDA graphs' memory
  too (the ``cuda_graph`` tag; the server must run with ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=true``, which a
  server this engine starts gets), back with the next request.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import logging
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from tauflow.core.net import free_port
from tauflow.rollout.engine.base import (
    Completion,
    EngineClosedError,
    EngineState,
    EngineStats,
    EngineUnavailableError,
    FinishReason,
    GenerationEngine,
    InvalidRequestError,
    PromptMedia,
    SamplingParams,
    TensorSpec,
    check_newer,
    settle,
    staged_copies,
)

_log = logging.getLogger(__name__)

SwapMode = Literal["auto", "retract", "abort"]
MIN_VERSION = (0, 5, 6)  # pause_generation that waits for in-flight requests and takes a mode
# pause_generation(mode="retract") with a cache flush that ignores the retracted (waiting) requests, and
# per-token weight_versions spans (0.5.19 and 0.5.20 retract too, but their flush asserts on waiting requests)
RETRACT_SINCE = (0, 5, 21)
UPDATE_SESSION_SINCE = (0, 5, 21)  # weight updates between /begin_weight_update and /end_weight_update
# what /release_memory_occupation and /resume_memory_occupation name (SGLang's GPU_MEMORY_TYPE_*), in the
# order a resume brings them back (slime's: the weights, the CUDA graphs, then the KV cache)
MEMORY_TAGS = ("weights", "cuda_graph", "kv_cache")
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
BUSY = (429, 503)  # a server with no room for now: its /generate is asked again
# The server refused the request itself (its arguments, its length): asking again, there or at another
# replica, gets the same answer, so the caller hears INVALID_ARGUMENT, not UNAVAILABLE (SGLangRefusal).
REFUSED = (400, 413, 422)
GENERATE_RETRIES = 3  # (after 0.5, 1 and 2 s)
CONTROL_TRIES = (
    3  # /continue_generation and /end_weight_update: a server left paused, or its session open, serves nothing
)


class SGLangError(EngineUnavailableError):
    """The SGLang server answered a call with an error (``status``: its HTTP status), or not at all (None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SGLangRefusal(InvalidRequestError):
    """The SGLang server refused a ``/generate`` as asked (HTTP 400, 413 or 422): the service answers
    INVALID_ARGUMENT with the server's reason, and the caller does not ask again."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer`` format for ``/update_weights_from_tensor``: a ``ForkingPickler``
    dump, base64 text. CUDA tensors travel as CUDA IPC handles (no copy through the host); the caller keeps
    them alive until the server has answered."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def weight_spec_of_folder(path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> dict[str, TensorSpec]:
    """Every weight name of a Hugging Face folder's model (tied aliases included), built on the meta device:
    what this engine accepts in a weight update, without loading a weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if dtype is None:
        declared = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
        dtype = getattr(torch, declared) if isinstance(declared, str) else declared
    return {
        name: TensorSpec(dtype if dtype is not None and p.is_floating_point() else p.dtype, tuple(p.shape))
        for name, p in model.named_parameters(remove_duplicate=False)
    }


@dataclass(slots=True)
class _Staged:
    version: int
    tensors: dict[str, torch.Tensor]
    future: Future[int]


@dataclass(slots=True)
class _Sample:
    """One completion being generated, across the segments a swap in abort mode splits it into."""

    prompt: list[int]
    rid: str
    segment_rid: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


class SGLangEngine(GenerationEngine):
    """An SGLang server (launched by ``from_pretrained`` or already running at ``base_url``) as a tauflow
    generation engine. Thread-safe; its HTTP calls run on an event loop thread of its own."""

    backend: ClassVar[str] = "sglang"

    def __init__(
        self,
        base_url: str,
        spec: Mapping[str, TensorSpec],
        *,
        vocab_size: int,
        max_context: int | None = None,
        engine_id: str = "sglang-0",
        policy_version: int = 0,
        model_name: str = "",
        eos_token_ids: Sequence[int] = (),
        extra_eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        swap_mode: SwapMode = "auto",
        ipc_device: str | None = None,
        max_concurrent_requests: int = 512,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 600.0,
        api_key: str | None = None,
        server_process: subprocess.Popen[bytes] | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        release_memory_when_idle: bool = False,
        offload_weights_when_idle: bool = False,
        release_cuda_graphs_when_idle: bool = False,
        release_after_idle_s: float = 0.05,
    ) -> None:

        super().__init__(engine_id, policy_version)
        if max_concurrent_requests < 1 or request_timeout_s <= 0 or control_timeout_s <= 0:
            raise ValueError("max_concurrent_requests and the timeouts must be positive")
        if release_cuda_graphs_when_idle and not (release_memory_when_idle or offload_weights_when_idle):
            raise ValueError(
                "release_cuda_graphs_when_idle goes with release_memory_when_idle or offload_weights_when_idle"
            )
        if not (0 <= release_after_idle_s <= 3600):
            raise ValueError(f"release_after_idle_s must be within [0, 3600], not {release_after_idle_s}")
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name or self.base_url
        self.vocab_size = int(vocab_size)
        self.max_context = max_context
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in (*eos_token_ids, *extra_eos_token_ids)))
        self._extra_eos = tuple(int(t) for t in extra_eos_token_ids)  # the server stops on the checkpoint's own
        self._spec = dict(spec)
        self._seed_base = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self._ipc_device = ipc_device if ipc_device is not None else ("cuda" if torch.cuda.is_available() else None)
        self._server_process = server_process
        self._request_timeout_s = request_timeout_s
        self._control_timeout_s = control_timeout_s
        self._detokenize = detokenize
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._lock = threading.Lock()
        self._staged: list[_Staged] = []
        self._newest_staged = self._version
        self._closing = False
        self._swapping = False
        self._swaps = 0  # weight swaps done, to tell whether one happened while a segment ran
        self._in_flight = 0
        self._running = 0
        self._last_error = ""
        self._broken = ""  # why this engine serves no more (its server lost its weights, stayed paused): FAILED
        self.counters: dict[str, float] = {
            "requests": 0,
            "sequences": 0,
            "segments": 0,
            "resumed_segments": 0,
            "weight_swaps": 0,
            "weight_swap_seconds": 0.0,
            "memory_releases": 0,
            "weight_offloads": 0,
        }
        # colocated mode: what the server is asked to release when idle, and what it holds released now
        wanted = {"weights": offload_weights_when_idle, "cuda_graph": release_cuda_graphs_when_idle,
                  "kv_cache": release_memory_when_idle or offload_weights_when_idle}  # fmt: skip
        self._release_tags: list[str] = [tag for tag in MEMORY_TAGS if wanted[tag]]
        self._release_after_idle_s = release_after_idle_s
        self._released: set[str] = set()
        self._memory = asyncio.Lock()  # one release or resume at a time (bound to the engine's loop on first use)
        self._rest_timer: asyncio.TimerHandle | None = None
        self._rest_task: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tauflow-sglang-{engine_id}", daemon=True)
        self._thread.start()
        self._http = self._call(self._open_client(headers, max_concurrent_requests)).result()
        self._serving = asyncio.Event()  # (bound to a loop on first use: the engine's)
        self._serving.set()
        self._updater: asyncio.Task[None] | None = None
        try:
            info = self._call(self._get("/get_server_info")).result()
            self.server_version = str(info.get("version", "0"))
            self._tp_size = int(info.get("tp_size") or 1)
            if self._tp_size != 1:
                raise SGLangError(
                    f"the SGLang server runs tensor parallel size {self._tp_size}: the sglang engine sends its "
                    "weights as one rank's CUDA IPC handles, so it needs --tp-size 1 for now"
                )
            newer = _version_tuple(self.server_version)
            if newer < MIN_VERSION:
                raise SGLangError(
                    f"SGLang {self.server_version}: the sglang engine needs SGLang >= "
                    f"{'.'.join(map(str, MIN_VERSION))} (a pause that waits for requests in flight, its modes)"
                )
            self._swap_mode: Literal["retract", "abort"] = (
                ("retract" if newer >= RETRACT_SINCE else "abort") if swap_mode == "auto" else swap_mode
            )
            self._update_session = newer >= UPDATE_SESSION_SINCE
            # the server labels its answers with the version it serves from now on (abort nothing)
            self._call(self._set_weight_version(self._version)).result()
        except BaseException:
            self.close()
            raise

    # -- building --------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        base_url: str = "",
        server_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 900.0,
        dtype: str | None = None,
        **options: Any,
    ) -> SGLangEngine:
        """The engine of the model in the Hugging Face folder ``path``: on the SGLang server at ``base_url`` (which
        must serve that folder), or on one started here (``python -m sglang.launch_server``, with
        ``server_args`` after tauflow's own; it stops with the engine). ``options`` are the constructor's."""
        from transformers import AutoConfig, GenerationConfig

        path = str(Path(path))
        config = AutoConfig.from_pretrained(path)
        text = config.get_text_config()
        spec = weight_spec_of_folder(path, getattr(torch, dtype) if dtype and dtype != "auto" else None)
        eos: Any = None
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json
            eos = getattr(config, "eos_token_id", None)
        options.setdefault("eos_token_ids", [] if eos is None else [eos] if isinstance(eos, int) else list(eos))
        options.setdefault("model_name", path)
        options.setdefault("vocab_size", int(text.vocab_size))
        options.setdefault("max_context", getattr(text, "max_position_embeddings", None))
        process = None
        if not base_url:
            port = port or free_port(host)
            version = int(options.get("policy_version", 0))
            command = [sys.executable, "-m", "sglang.launch_server", "--model-path", path, "--host", host]
            command += ["--port", str(port), "--weight-version", str(version)]
            command += ["--dtype", dtype] if dtype else []
            if options.get("offload_weights_when_idle") or options.get("release_memory_when_idle"):
                command += ["--enable-memory-saver"]
            if options.get("offload_weights_when_idle"):
                command += ["--enable-weights-cpu-backup"]  # (the weights come back as they were)
            env = None
            if options.get("release_cuda_graphs_when_idle"):  # (SGLang captures its graphs in a releasable pool)
                env = {**os.environ, "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true"}
            process = subprocess.Popen([*command, *server_args], env=env)
            base_url = f"http://{host}:{port}"
        try:
            if process is not None:
                _wait_until_healthy(base_url, process, startup_timeout_s)
            return cls(base_url, spec, server_process=process, **options)
        except BaseException:  # (an engine that refuses its options leaves no server it started behind)
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
            raise

    # -- the event loop thread -------------------------------------------------------------------------------------

    def _call(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _open_client(self, headers: dict[str, str], connections: int) -> Any:
        import httpx2

        limits = httpx2.Limits(max_connections=connections + 8, max_keepalive_connections=connections + 8)
        timeout = httpx2.Timeout(self._request_timeout_s, connect=10.0)
        return httpx2.AsyncClient(base_url=self.base_url, headers=headers, limits=limits, timeout=timeout)

    def _where(self, route: str, what: str) -> str:
        return f"{self.engine_id} ({self.base_url}) {route}: {what}"

    async def _request(self, method: str, route: str, body: Mapping[str, Any] | None, timeout: float) -> Any:
        """One call, answered 2xx within ``timeout`` as a whole (httpx's timeouts bound each read: a server
        trickling a byte a second held a call, and a swap behind it, for good). 3xx is refused too (a redirect
        to another host: its answer is not this server's)."""
        import httpx2

        try:
            async with asyncio.timeout(timeout):
                r = await self._http.request(method, route, json=body, timeout=timeout)
                answer = _json_or_text(r)
        except TimeoutError:
            raise SGLangError(self._where(route, f"no whole answer within {timeout:g} s")) from None
        except httpx2.HTTPError as e:
            raise SGLangError(self._where(route, f"{type(e).__name__}: {e or 'no answer'}")) from e
        refused = isinstance(answer, dict) and answer.get("success") is False
        if not 200 <= r.status_code < 300 or refused:
            raise SGLangError(self._where(route, f"HTTP {r.status_code}: {_message_of(answer)}"), r.status_code)
        return answer

    async def _post(
        self, route: str, body: Mapping[str, Any], timeout: float | None = None, *, confirm: bool = False
    ) -> Any:
        """``confirm``: the answer must say ``success: true`` (a weight update: an empty or other answer
        published a version the server never loaded)."""
        answer = await self._request("POST", route, body, timeout or self._control_timeout_s)
        if confirm and not (isinstance(answer, dict) and answer.get("success") is True):
            raise SGLangError(self._where(route, f"the server did not confirm it: {_message_of(answer)}"))
        return answer

    async def _get(self, route: str) -> Any:
        return await self._request("GET", route, None, self._control_timeout_s)

    # -- generation ------------------------------------------------------------------------------------------------

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, media: Sequence[PromptMedia] | None = None
    ) -> Future[list[list[Completion]]]:
        if not prompts:
            raise InvalidRequestError("at least one prompt is needed")
        if media is not None and any(media):
            raise InvalidRequestError("the sglang engine takes text prompts only (media: use the hf engine)")
        if params.ignore_eos and params.stop_token_ids:
            raise InvalidRequestError(
                "ignore_eos with stop_token_ids: SGLang's ignore_eos turns off every stop token, so the sglang "
                "engine cannot stop at stop_token_ids while ignoring EOS"
            )
        if params.stop and self._detokenize is None:
            raise InvalidRequestError("stop strings need the model's tokenizer, and this engine has none")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {self.vocab_size}")
        clean: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids:
                raise InvalidRequestError(f"prompt {i} is empty")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise InvalidRequestError(f"prompt {i} has a token id outside [0, {self.vocab_size})")
            if self.max_context is not None and len(ids) + params.max_new_tokens > self.max_context:
                raise InvalidRequestError(
                    f"prompt {i}: {len(ids)} prompt tokens + max_new_tokens {params.max_new_tokens} exceed the "
                    f"model's context of {self.max_context}"
                )
            clean.append(ids)
        with self._lock:
            if self._closing:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            if self._broken:
                raise SGLangError(f"{self.engine_id} ({self.base_url}) serves no more: {self._broken}")
            self._in_flight += 1
            self.counters["requests"] += 1
            self.counters["sequences"] += len(clean) * params.n
        future: Future[list[list[Completion]]] = self._call(self._generate(clean, params))
        future.add_done_callback(self._request_done)
        return future

    def _request_done(self, _: Future[Any]) -> None:
        with self._lock:
            self._in_flight -= 1
            rest = self._in_flight == 0 and bool(self._release_tags) and not self._closing
        if rest:  # (a loop stopped by close() drops the callback)
            self._loop.call_soon_threadsafe(self._schedule_rest, self._release_after_idle_s)

    # -- taking turns in memory (colocated mode) -------------------------------------------------------------------

    def _schedule_rest(self, delay_s: float) -> None:
        """Out of requests: rest once ``delay_s`` has passed (counted from the last request)."""
        if self._rest_timer is not None:
            self._rest_timer.cancel()
        self._rest_timer = self._loop.call_later(delay_s, self._start_rest, delay_s)

    def _start_rest(self, delay_s: float) -> None:
        self._rest_timer = None
        self._rest_task = self._loop.create_task(self._rest(delay_s))

    def _idle(self) -> bool:
        with self._lock:
            return self._in_flight == 0 and not self._staged and not self._swapping and not self._closing

    async def _rest(self, delay_s: float) -> None:
        """Asks the server to release what ``_release_tags`` names, if the engine is still idle. SGLang asserts
        that a server it releases is idle (a failed assertion takes the server down), and a request cancelled
        here may still run there until its abort lands: ``/flush_cache``, which succeeds only on an idle server,
        asks first; a busy one is asked again later (backing off). A failed release turns releasing off."""
        async with self._memory:
            tags = [t for t in self._release_tags if t not in self._released]
            if not tags or not self._idle():
                return
            try:
                await self._post("/flush_cache", {})
            except SGLangError as e:
                if e.status != 400:  # not "busy": a server down, a refused route
                    self._release_tags = []
                    _log.error("%s: /flush_cache failed, releasing memory turned off: %s", self.engine_id, e)
                elif self._idle():  # still idle here: the server is finishing what was cancelled
                    self._schedule_rest(min(max(2 * delay_s, 0.05), 5.0))
                return
            if not self._idle():
                return
            try:
                await asyncio.shield(self._release(tags))
            except SGLangError as e:
                self._release_tags = []  # (what the server did is unknown: ask no more)
                _log.error("%s: releasing memory failed, releasing turned off: %s", self.engine_id, e)

    async def _release(self, tags: list[str]) -> None:
        await self._post("/release_memory_occupation", {"tags": tags})
        self._released.update(tags)  # (shielded: recorded as soon as the server answers)
        self.counters["memory_releases"] += 1
        if "weights" in tags:
            self.counters["weight_offloads"] += 1
            if self.counters["weight_offloads"] == 1:
                _log.info("%s: the server released its weights and KV cache while idle", self.engine_id)

    async def _wake(self, tags: Sequence[str]) -> None:
        """Before the server runs: what it released of ``tags`` comes back (after a release under way, if any).
        Shielded, lock and all: a caller cancelled meanwhile never leaves the record behind the server, nor lets
        a release in before the resume is done. A failed resume is taken as done (asking twice would take SGLang
        down) and turns releasing off."""
        await asyncio.shield(self._resume(tags))

    async def _resume(self, tags: Sequence[str]) -> None:
        async with self._memory:
            back = [t for t in MEMORY_TAGS if t in tags and t in self._released]
            if not back:
                return
            self._released.difference_update(back)
            try:
                await self._post("/resume_memory_occupation", {"tags": back})
            except SGLangError:
                self._release_tags = []
                _log.error("%s: resuming %s failed, releasing turned off", self.engine_id, back)
                raise

    async def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        rid = uuid.uuid4().hex
        # sample j of every prompt draws from the stream (seed, j), as the interface asks; SGLang honours a
        # per-request sampling_seed only when launched with --enable-deterministic-inference
        samples = [
            _Sample(prompt, f"{rid}-{i}-{j}", "", [], [], [])
            for i, prompt in enumerate(prompts)
            for j in range(params.n)
        ]
        seeds = [None if params.seed is None else sample_seed(params.seed, k % params.n) for k in range(len(samples))]
        await self._wake(MEMORY_TAGS)
        tasks = [asyncio.ensure_future(self._sample(s, params, seed)) for s, seed in zip(samples, seeds, strict=True)]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException as e:  # a gone caller, or one sample's failure: its siblings are of no use
            for task in tasks:
                task.cancel()
            # the server keeps decoding what a gone client asked for unless told
            self._loop.create_task(self._abort_quietly([s.segment_rid for s in samples if s.segment_rid]))
            if isinstance(e, SGLangError):
                self._last_error = str(e)
            raise
        return [done[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    async def _abort_quietly(self, rids: list[str]) -> None:
        for rid in rids:
            try:
                await self._post("/abort_request", {"rid": rid}, timeout=10.0)
            except SGLangError as e:
                _log.warning("could not abort %s on %s: %s", rid, self.base_url, e)

    async def _sample(self, sample: _Sample, params: SamplingParams, seed: int | None) -> Completion:
        segment = 0
        while True:
            await self._serving.wait()  # no segment starts while a swap is under way
            if self._closing:  # woken by close() rather than by a finished swap
                return Completion(sample.token_ids, sample.logprobs, sample.versions, FinishReason.ABORT)
            remaining = params.max_new_tokens - len(sample.token_ids)
            swaps, version = self._swaps, self._version
            sample.segment_rid = f"{sample.rid}-{segment}"  # SGLang aborts by exact rid
            body = {
                "input_ids": sample.prompt + sample.token_ids,
                "sampling_params": self._sampling_params(params, remaining, seed),
                "return_logprob": True,
                "rid": sample.segment_rid,
                "stream": False,
            }
            self._running += 1
            try:
                answer = await self._generate_segment(sample, body)
            finally:
                self._running -= 1
            self.counters["segments"] += 1
            if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
                raise SGLangError(self._where("/generate", f"an answer without meta_info: {str(answer)[:200]}"))
            meta = answer["meta_info"]
            tokens, logprobs, reason = self._segment_of(meta, remaining)
            sample.versions += self._versions_of(meta, len(tokens), version, swaps)
            sample.token_ids += tokens
            sample.logprobs += logprobs
            if len(sample.token_ids) >= params.max_new_tokens and reason is FinishReason.ABORT:
                reason = FinishReason.LENGTH
            swapped = self._swaps != swaps or self._swapping
            if reason is not FinishReason.ABORT or self._closing or not swapped:
                text = self._detokenize(sample.token_ids) if self._detokenize and params.stop else None
                return Completion(sample.token_ids, sample.logprobs, sample.versions, reason, text)
            # aborted by a swap in abort mode: go on from where it stopped, with the new weights
            segment += 1
            self.counters["resumed_segments"] += 1

    async def _generate_segment(self, sample: _Sample, body: dict[str, Any]) -> Any:
        """``/generate``, asked again after 0.5, 1 and 2 s while the server answers 429 or 503 (no room for now:
        the first such answer ended the rollout)."""
        for attempt in range(GENERATE_RETRIES + 1):
            try:
                return await self._post("/generate", body, timeout=self._request_timeout_s)
            except SGLangError as e:
                # (a segment resumed after a swap carries the tokens so far: its refusal is no fault of the request)
                if e.status in REFUSED and not sample.token_ids:
                    raise SGLangRefusal(f"the SGLang server refused the request: {e}") from e
                if e.status not in BUSY or attempt == GENERATE_RETRIES:
                    raise
            await asyncio.sleep(0.5 * 2**attempt)
            sample.segment_rid = body["rid"] = f"{sample.segment_rid.split('~')[0]}~{attempt + 1}"
        raise AssertionError("unreachable")

    def _segment_of(self, meta: Mapping[str, Any], remaining: int) -> tuple[list[int], list[float], FinishReason]:
        """A segment's tokens, their log-probs and why it ended, each checked (a token outside the vocabulary,
        more tokens than asked, a log-prob that is not one: refused, naming the server). A length finish may
        come short of the tokens asked: SGLang cuts a request's max_new_tokens 2 short of its context length,
        or of its KV pool, whichever is smaller."""
        entries = meta.get("output_token_logprobs")
        entries = [] if entries is None else entries
        if not isinstance(entries, list) or len(entries) > remaining:
            got = len(entries) if isinstance(entries, list) else type(entries).__name__
            raise SGLangError(self._where("/generate", f"{got} output tokens where at most {remaining} were asked"))
        tokens: list[int] = []
        logprobs: list[float] = []
        for k, entry in enumerate(entries):
            if not isinstance(entry, list | tuple) or len(entry) < 2:
                raise SGLangError(self._where("/generate", f"output_token_logprobs[{k}] is not [log-prob, token id]"))
            lp, token = entry[0], entry[1]
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise SGLangError(
                    self._where("/generate", f"token id {token!r} is not in the vocabulary ({self.vocab_size})")
                )
            if isinstance(lp, bool) or not isinstance(lp, int | float) or not (math.isfinite(lp) and lp <= 0):
                raise SGLangError(self._where("/generate", f"log-prob {lp!r} of token {k} is not a log-probability"))
            tokens.append(token)
            logprobs.append(float(lp))
        finish = meta.get("finish_reason")
        if finish is not None and not isinstance(finish, dict):
            raise SGLangError(self._where("/generate", f"finish_reason {str(finish)[:100]!r} is not an object"))
        reason = _FINISH.get(str((finish or {}).get("type")), FinishReason.ABORT)
        return tokens, logprobs, reason

    def _sampling_params(self, params: SamplingParams, max_new_tokens: int, seed: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            # greedy (top_k 1 too) as temperature 0: SGLang then reports temperature-1 log-probs whatever else
            # is in its batch, as this interface defines greedy log-probs
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "ignore_eos": params.ignore_eos,
            "skip_special_tokens": True,
        }
        if seed is not None:  # honoured by a server started with --enable-deterministic-inference
            out["sampling_seed"] = seed
        stop_ids = list(dict.fromkeys((() if params.ignore_eos else self._extra_eos) + params.stop_token_ids))
        if stop_ids:
            out["stop_token_ids"] = stop_ids
        if params.stop:
            out["stop"] = list(params.stop)
            out["no_stop_trim"] = True  # the text ends with the stop string, as the tokens do
        return out

    def _versions_of(self, meta: Mapping[str, Any], count: int, version: int, swaps: int) -> list[int]:
        """The policy version of each of a segment's ``count`` tokens: ``version`` was served when it was sent,
        ``swaps`` swaps were done by then. The answer must name a version this engine loaded: outside a swap
        that one, else one from it to the newest staged. A server that restarted serves its checkpoint under
        "default" or its start version: its tokens were labelled with this engine's version and reached the
        queue as the policy's (refused now, and the engine stops serving: its restart loads the weights)."""
        swapped = self._swaps != swaps or self._swapping
        # (a re-base, after the trainer resumed from an older checkpoint, loads a version below the one sent)
        lowest = min(version, self._version, self._newest_staged)
        highest = max(version, self._version, self._newest_staged)
        allowed = range(lowest, highest + 1) if swapped else range(version, version + 1)
        label = meta.get("weight_version")
        if _int_or_none(label) not in allowed:
            why = f"the answer names weight version {str(label)[:40]!r}, not {version}"
            if not swapped:
                self._break(f"{self._where('/generate', why)}: the server restarted or lost its weights")
            raise SGLangError(self._where("/generate", why))
        spans = meta.get("weight_versions")
        if spans is not None:
            out: list[int | None] = [None] * count
            for span in spans if isinstance(spans, list) else [spans]:
                v = _int_or_none(span.get("version")) if isinstance(span, dict) else None
                start, end = (span.get("start"), span.get("end")) if isinstance(span, dict) else (None, None)
                ok = v in allowed and isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= count
                if not ok or not isinstance(start, int) or not isinstance(end, int):  # (the last two: for mypy)
                    raise SGLangError(
                        self._where(
                            "/generate",
                            f"weight_versions span {str(span)[:100]} is not one of its tokens' loaded versions",
                        )
                    )
                out[start:end] = [v] * (end - start)
            if any(v is None for v in out):
                raise SGLangError(self._where("/generate", "its weight_versions spans leave tokens without a version"))
            return [int(v) for v in out]  # type: ignore[arg-type]
        if not swapped:
            return [version] * count
        if self._swap_mode == "abort":
            return [int(str(label))] * count  # a segment never straddles a swap in abort mode
        return [lowest] * count  # cannot tell: the oldest it can be, a lower bound

    # -- weights ---------------------------------------------------------------------------------------------------

    def weight_spec(self) -> Mapping[str, TensorSpec]:
        return dict(self._spec)

    @property
    def newest_version(self) -> int:
        with self._lock:
            return self._newest_staged

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor], rebase: bool = False) -> Future[int]:
        version = int(version)
        if self._closing:
            raise EngineClosedError(f"engine {self.engine_id} is closed")
        with self._lock:
            newest = self._newest_staged
        check_newer(version, newest, rebase)  # (before anything is copied)
        staged = staged_copies(
            self._spec,
            tensors,
            lambda name, t: t.to(
                device=self._ipc_device or t.device, dtype=self._spec[name].dtype, copy=True
            ).contiguous(),
        )
        future: Future[int] = Future()
        with self._lock:
            if self._closing:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            check_newer(version, self._newest_staged, rebase)
            if rebase:  # the trainer resumed from an older checkpoint: what was staged after it is void
                for dropped in self._staged:
                    dropped.future.cancel()
                self._staged.clear()
            self._newest_staged = version
            self._staged.append(_Staged(version, staged, future))
        self._loop.call_soon_threadsafe(self._start_updater)
        return future

    def _start_updater(self) -> None:
        if self._updater is None or self._updater.done():
            self._updater = self._loop.create_task(self._load_staged())

    async def _load_staged(self) -> None:
        while True:
            with self._lock:
                if not self._staged or self._closing:
                    return
                staged = self._staged.pop(0)
            if not staged.future.set_running_or_notify_cancel():
                continue  # dropped by a re-base
            started = time.perf_counter()
            try:
                await self._swap(staged.version, staged.tensors)
            except BaseException as e:
                self._last_error = f"weight update to version {staged.version}: {e}"
                _log.error("%s", self._last_error)
                staged.future.set_exception(e if isinstance(e, Exception) else SGLangError(str(e)))
                if not isinstance(e, Exception):
                    raise
                continue
            self.counters["weight_swaps"] += 1
            self.counters["weight_swap_seconds"] += time.perf_counter() - started
            self._publish_version(staged.version)
            staged.future.set_result(staged.version)

    async def _swap(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Pause at a safe point, load ``version`` through CUDA IPC handles, go on."""
        self._serving.clear()
        self._swapping = True
        try:
            await self._wake(["weights"])  # (the KV cache comes back with the next request)
            try:  # (a pause that failed may have paused it all the same: it is continued whatever happens)
                await self._post("/pause_generation", {"mode": self._swap_mode})
                if self._update_session:
                    await self._post("/begin_weight_update", {"selector": "all"})
                    try:
                        await self._load_tensors(version, tensors)
                    finally:  # closed even after a failed load: an open session refuses the next
                        await self._insist("/end_weight_update")
                else:
                    await self._load_tensors(version, tensors)
            finally:
                self._swaps += 1
                await self._insist("/continue_generation")
        finally:
            self._swapping = False
            self._serving.set()
            if self._ipc_device is not None and self._ipc_device.startswith("cuda"):
                torch.cuda.ipc_collect()  # the server has copied them: release what it held open

    async def _set_weight_version(self, version: int) -> None:
        answer = await self._post(
            "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}, confirm=True
        )
        named = answer.get("new_version", str(version))
        if str(named) != str(version):
            raise SGLangError(
                self._where("/update_weight_version", f"the server took version {named!r}, not {version}")
            )

    async def _load_tensors(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        serialized = serialize_named_tensors(list(tensors.items()))
        await self._post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [serialized],  # one TP rank (tp_size 1 is checked at start)
                "load_format": None,
                "flush_cache": True,  # the prefix cache holds the old weights' keys and values
                "abort_all_requests": False,
                "weight_version": str(version),
            },
            confirm=True,
        )

    async def _insist(self, route: str) -> None:
        """A call the server must take (left paused, or with its update session open, it would serve nothing
        while this engine said SERVING): tried again, and the engine broken when it never is."""
        for attempt in range(CONTROL_TRIES):
            try:
                await self._post(route, {})
                return
            except SGLangError as e:
                if attempt == CONTROL_TRIES - 1:
                    self._break(f"{e} (the server may be left unable to serve)")
                    raise
                await asyncio.sleep(0.5 * 2**attempt)

    def _break(self, why: str) -> None:
        """This engine serves no more (its state FAILED, every new request refused with ``why``): the rollout
        ends, and its restart attaches to the server afresh and loads the current weights."""
        if not self._broken:
            self._broken = why
            self._last_error = why
            _log.error("%s: the engine stops serving: %s", self.engine_id, why)

    # -- life cycle ------------------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        with self._lock:
            staged = [s.version for s in self._staged]
            newest, in_flight = self._newest_staged, self._in_flight
        update = bool(staged) or newest > self._version or self._swapping
        return EngineStats(
            engine_id=self.engine_id,
            backend=self.backend,
            model=self.model_name,
            state=EngineState.DRAINING
            if self._closing
            else EngineState.FAILED
            if self._broken
            else EngineState.SERVING,
            policy_version=self._version,
            in_flight_requests=in_flight,
            running_sequences=self._running,
            waiting_sequences=0,
            weight_update_in_progress=update,
            receiving_policy_version=newest if update else 0,
            last_error=self._broken or self._last_error,
            counters=dict(self.counters),
        )

    def close(self, timeout: float = 30.0) -> None:
        """Abort what is in flight (those requests resolve with ABORT completions of the tokens so far), fail
        the staged versions, close the HTTP client, and stop the server if this engine started it."""
        with self._lock:
            if self._closing and not self._thread.is_alive():
                return
            self._closing = True
            staged, self._staged = self._staged, []
        for s in staged:
            settle(s.future, error=EngineClosedError(f"engine {self.engine_id} is closed"))
        if self._thread.is_alive():
            try:
                self._call(self._shutdown(timeout)).result(timeout + 5)
            except Exception as e:  # noqa: BLE001 - closing goes on whatever the server says
                _log.warning("closing %s: %s", self.engine_id, e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if self._server_process is not None and self._server_process.poll() is None:
            self._server_process.terminate()
            try:
                self._server_process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._server_process.kill()

    async def _shutdown(self, timeout: float) -> None:
        if not hasattr(self, "_http"):
            return
        self._serving.set()  # segments waiting for a swap see the engine closing and end
        if self._rest_timer is not None:
            self._rest_timer.cancel()
        started = time.monotonic()
        try:  # (after a release under way, within the time given) a server this engine did not start is left whole
            async with asyncio.timeout(timeout / 2):  # (not wait_for: on 3.11 it can swallow a cancellation)
                await self._memory.acquire()
        except TimeoutError:
            _log.warning("closing %s: a memory release or resume is still under way", self.engine_id)
        else:
            try:
                if self._released and self._server_process is None:
                    await self._post("/resume_memory_occupation", {"tags": sorted(self._released)}, timeout / 2)
                    self._released.clear()
            except SGLangError as e:
                _log.warning("could not resume the memory %s released on %s: %r", self.engine_id, self.base_url, e)
            finally:
                self._memory.release()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if pending and self._in_flight:
            try:
                await self._post("/abort_request", {"rid": "", "abort_all": True}, timeout=10.0)
            except SGLangError as e:
                _log.warning("could not abort the requests of %s: %s", self.engine_id, e)
            await asyncio.wait(pending, timeout=max(1.0, timeout - (time.monotonic() - started)))
        left = [t for t in pending if not t.done()]
        for task in left:  # (their callers' futures resolve, cancelled: no caller waits on a stopped loop)
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=1.0)
        await self._http.aclose()


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index``'s stream under request seed ``seed``: a 63-bit mix, so that (seed, index)
    pairs do not collide as ``seed + index`` would (seed 5 sample 1 against seed 6 sample 0)."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & ((1 << 64) - 1)  # splitmix64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) >> 1


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _json_or_text(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _message_of(answer: Any) -> str:
    if isinstance(answer, dict):
        error = answer.get("error")
        message = error.get("message") if isinstance(error, dict) else answer.get("message", error)
        return str(message)[:500]
    return str(answer)[:500]


def _wait_until_healthy(base_url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    import httpx2

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SGLangError(f"the SGLang server exited with code {process.returncode} while starting")
        try:
            if httpx2.get(f"{base_url}/health_generate", timeout=30.0).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(2.0)
    raise SGLangError(f"the SGLang server at {base_url} was not healthy within {timeout_s:.0f} s")
