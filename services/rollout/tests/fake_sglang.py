"""``FakeSGLangServer``: a FAKE of SGLang's HTTP server, for testing tauflow's side of the sglang engine on a
machine without a GPU (SGLang needs one). It records every call and answers as SGLang's documented API does
(the routes, bodies and answers the engine uses; stdlib only). Its "model" is arithmetic, not a
network: the next token is ``(3 * last + 1 + version) % vocab``, its log-prob ``-(version + 1) / 10``, so a test
can tell which weights produced each token.

What it mimics (and what it does not):
- ``/pause_generation`` ``abort``: running requests answer at once with their tokens so far and finish
  ``abort``; the call returns once they have. ``retract``: running requests stop and go on after
  ``/continue_generation`` with the weights loaded meanwhile. New ``/generate`` calls wait while paused.
- ``/update_weights_from_tensor`` decodes the ``MultiprocessingSerializer`` text (base64 ``ForkingPickler``) and
  records names, shapes and sums; with ``session_required`` (SGLang ≥ 0.5.21) it refuses an update outside
  ``/begin_weight_update`` … ``/end_weight_update``.
- ``weight_versions`` spans in ``meta_info`` only with ``report_spans`` (SGLang ≥ 0.5.19).
- ``/abort_request`` matches a rid exactly (the tokenizer manager's lookup); a second ``/begin_weight_update``
  while a session is open is refused, as SGLang refuses it.
- ``/release_memory_occupation`` (tags ``weights``, ``kv_cache``, ``cuda_graph``; none: all) and
  ``/resume_memory_occupation``:
  as in SGLang, where a failed assertion in the scheduler takes the server down, a release of a busy server
  or of a tag already released, and a resume of a tag not released, *crash* the fake (``crashed`` says why;
  every later call fails). ``/generate`` while anything is released, and ``/update_weights_from_tensor``
  while the weights are, crash it too (a real server would compute with unmapped memory). ``/flush_cache``
  fails on a busy server, as SGLang's does. ``gates`` hold a route's calls until a test sets the event.
- No KV cache, no stop strings, no real sampling, no tensor parallelism.
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

import torch.multiprocessing  # noqa: F401 - ForkingPickler's tensor reductions, to decode what the engine sent


class _Running:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.aborted = False


class FakeSGLangServer:
    """A FAKE SGLang HTTP server on 127.0.0.1 (a thread of the test process); ``calls`` records (route, body)."""

    def __init__(
        self,
        version: str = "0.5.23",
        tp_size: int = 1,
        vocab: int = 16,
        eos: int = 2,
        token_delay_s: float = 0.002,
        report_spans: bool | None = None,
        session_required: bool | None = None,
    ) -> None:
        parts = tuple(int(p) for p in version.split(".")[:3])
        self.version = version
        self.tp_size = tp_size
        self.vocab, self.eos, self.token_delay_s = vocab, eos, token_delay_s
        self.report_spans = parts >= (0, 5, 19) if report_spans is None else report_spans
        self.session_required = parts >= (0, 5, 21) if session_required is None else session_required
        self.weight_version = "default"
        self.calls: list[tuple[str, Any]] = []
        self.loaded: list[dict[str, Any]] = []  # per update: weight_version, names, shapes, sums
        self.fail_next_update = ""
        self.update_gate: threading.Event | None = None  # set: updates wait for it (a test holds one in flight)
        self._cv = threading.Condition()
        self._paused = ""  # "" (serving), "abort", "retract"
        self._in_session = False
        self.released: set[str] = set()  # memory tags released (colocated mode)
        self.crashed = ""  # why the server went down ("" while it serves)
        self.gates: dict[str, threading.Event] = {}  # route -> an event its calls wait for
        # a misbehaving server: (route, status, answer) -> the (status, answer) sent instead
        self.answer_hook: Callable[[str, int, Any], tuple[int, Any]] | None = None
        self.trickle_s = 0.0  # > 0: each answer is sent a byte at a time, this far apart
        self._running: dict[str, _Running] = {}
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cv:
            self._paused = ""
            for r in self._running.values():
                r.aborted = True
            self._cv.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    def routes(self) -> list[str]:
        return [route for route, _ in self.calls]

    # -- the routes ------------------------------------------------------------------------------------------------

    def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, {"error": {"message": "input_ids must be a non-empty list of ints"}}
        sp = body.get("sampling_params") or {}
        unknown = set(sp) - {
            "max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos", "sampling_seed", "stop_token_ids",
            "stop", "no_stop_trim", "skip_special_tokens",
        }  # fmt: skip
        if unknown:
            return 400, {"error": {"message": f"unknown sampling params {sorted(unknown)}"}}
        if self.released:
            return self._crash(f"generate with {sorted(self.released)} released")
        rid = str(body.get("rid") or time.time_ns())
        run = _Running(rid)
        with self._cv:
            self._cv.wait_for(lambda: not self._paused)
            self._running[rid] = run
        tokens: list[int] = []
        versions: list[str] = []
        last, finish = ids[-1], {"type": "length", "length": sp.get("max_new_tokens", 128)}
        # SGLang's ignore_eos turns off every stop token, stop_token_ids included
        stops = set() if sp.get("ignore_eos") else set(sp.get("stop_token_ids") or []) | {self.eos}
        try:
            for _ in range(int(sp.get("max_new_tokens", 128))):
                time.sleep(self.token_delay_s)
                with self._cv:
                    self._cv.wait_for(lambda: self._paused != "retract" or run.aborted)
                    if run.aborted:
                        finish = {"type": "abort", "message": "Aborted"}
                        break
                    version = self.weight_version
                v = int(version) if version.isdigit() else 0
                last = (3 * last + 1 + v) % self.vocab
                tokens.append(last)
                versions.append(version)
                if last in stops:
                    finish = {"type": "stop", "matched": last}
                    break
        finally:
            with self._cv:
                self._running.pop(rid, None)
                self._cv.notify_all()
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
            "weight_version": self.weight_version,
            "output_token_logprobs": [
                [-(int(v) + 1 if v.isdigit() else 1) / 10, t, None] for t, v in zip(tokens, versions, strict=True)
            ],
        }
        if self.report_spans:
            spans: list[dict[str, Any]] = []
            for k, v in enumerate(versions):
                if spans and spans[-1]["version"] == v:
                    spans[-1]["end"] = k + 1
                else:
                    spans.append({"version": v, "start": k, "end": k + 1})
            meta["weight_versions"] = spans
        return 200, {"text": "", "output_ids": tokens, "meta_info": meta}

    def _pause(self, body: dict[str, Any]) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        with self._cv:
            self._paused = mode
            if mode == "abort":
                for r in self._running.values():
                    r.aborted = True
                self._cv.notify_all()
                self._cv.wait_for(lambda: not self._running, timeout=10)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self._cv:
            self._paused = ""
            self._cv.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _update_from_tensor(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.update_gate is not None:
            self.update_gate.wait(30)
        if self.session_required and not self._in_session:
            return 400, {"success": False, "message": "must run between begin_weight_update() and end_weight_update()"}
        if "weights" in self.released:
            return self._crash("update_weights_from_tensor with the weights released")
        if self.fail_next_update:
            message, self.fail_next_update = self.fail_next_update, ""
            return 400, {"success": False, "message": message}
        with self._cv:
            running = bool(self._running) and self._paused != "retract"
        if body.get("flush_cache", True) and running:
            return 400, {"success": False, "message": "Cache flush failed after updating weights"}
        record: dict[str, Any] = {"weight_version": body.get("weight_version"), "paused": self._paused}
        for rank, text in enumerate(body["serialized_named_tensors"]):
            named = pickle.loads(base64.b64decode(text, validate=True))
            record[f"rank{rank}"] = [
                (n, tuple(t.shape), str(t.dtype).removeprefix("torch."), float(t.sum())) for n, t in named
            ]
        self.loaded.append(record)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return 200, {"success": True, "message": "Success"}

    def _crash(self, why: str) -> tuple[int, Any]:
        self.crashed = self.crashed or why
        return 500, {"error": {"message": f"the scheduler hit an exception: {why}"}}

    def _route(self, method: str, route: str, body: Any) -> tuple[int, Any]:
        if self.crashed:
            return 500, {"error": {"message": f"the server is down: {self.crashed}"}}
        gate = self.gates.get(route)
        if gate is not None:
            gate.wait(30)
        if route == "/generate":
            return self._generate(body)
        if route == "/pause_generation":
            return self._pause(body)
        if route == "/continue_generation":
            return self._continue(body)
        if route == "/update_weights_from_tensor":
            return self._update_from_tensor(body)
        if route in ("/release_memory_occupation", "/resume_memory_occupation"):
            tags = set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
            if not tags <= {"weights", "kv_cache", "cuda_graph"}:
                return self._crash(f"unknown memory tags {sorted(tags)}")
            if route == "/resume_memory_occupation":
                if not tags <= self.released:
                    return self._crash(f"resume of {sorted(tags - self.released)}, not released")
                self.released -= tags
                return 200, None
            with self._cv:
                if self._running or self._paused or self._in_session:
                    return self._crash("release_memory_occupation should be called only when server is idle")
                if tags & self.released:
                    return self._crash(f"release of {sorted(tags & self.released)}, already released")
                self.released |= tags
            return 200, None
        if route == "/flush_cache":
            with self._cv:
                busy = bool(self._running)
            return (400, "Cache not flushed. Please check backend logs.") if busy else (200, "Cache flushed.")
        if route == "/begin_weight_update":
            if self._in_session:
                return 400, {"success": False, "message": "a weight-update session is already open"}
            self._in_session = True
            return 200, {"success": True, "message": "begun"}
        if route == "/end_weight_update":
            self._in_session = False
            return 200, {"success": True, "message": "ended"}
        if route == "/update_weight_version":
            self.weight_version = str(body["new_version"])
            return 200, {"success": True, "message": "ok", "new_version": self.weight_version}
        if route == "/abort_request":
            with self._cv:
                for rid, r in self._running.items():
                    if body.get("abort_all") or rid == body.get("rid"):  # the tokenizer manager's exact match
                        r.aborted = True
                self._cv.notify_all()
            return 200, None
        if route == "/get_server_info":
            return 200, {"version": self.version, "tp_size": self.tp_size, "weight_version": self.weight_version}
        if route == "/get_model_info":
            return 200, {"model_path": "fake", "is_generation": True, "weight_version": self.weight_version}
        if route in ("/health", "/health_generate"):
            return 200, None
        return 404, {"detail": "Not Found"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                server.calls.append((self.path, body))
                status, answer = server._route(method, self.path, body)
                if server.answer_hook is not None:
                    status, answer = server.answer_hook(self.path, status, answer)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if server.trickle_s <= 0:
                    self.wfile.write(data)
                    return
                for k in range(len(data)):
                    self.wfile.write(data[k : k + 1])
                    self.wfile.flush()
                    time.sleep(server.trickle_s)

            def do_POST(self) -> None:
                self._answer("POST")

            def do_GET(self) -> None:
                self._answer("GET")

            def log_message(self, *args: Any) -> None:
                pass

        return Handler
