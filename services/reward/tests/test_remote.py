"""``remote_rm`` against a real HTTP server on 127.0.0.1 (stdlib ``ThreadingHTTPServer``, a port of its own)
that speaks both protocols and can be told to fail, stall or answer garbage."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tauflow.reward import worker
from tauflow.reward.adapters import remote
from tauflow.reward.adapters.remote import RemoteOptions, RemoteRewardModel, fill, parse_score
from tauflow.reward.api import GroupInput, SampleInput, Score
from tauflow.reward.builtins import ConfigInvalid

TOKEN_ENV = "TAUFLOW_RM_TEST_TOKEN"


# -- the server -----------------------------------------------------------------------------------


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # before answering
    trickle_s: float = 0.0  # between the body's bytes
    length: bool = True  # send Content-Length (else the body ends with the connection)


def text_score(completion: str, metadata: dict[str, str]) -> float:
    """The json endpoint's score: a tenth per character, plus 1 when the answer is in the completion."""
    answer = metadata.get("answer")
    return len(completion) / 10 + (1.0 if answer and answer in completion else 0.0)


def json_reply(body: Any) -> Reply:
    scores = [text_score(c, m) for c, m in zip(body["completions"], body["metadata"], strict=True)]
    components = [{"length": float(len(c))} for c in body["completions"]]
    return Reply(body=json.dumps({"scores": scores, "components": components}).encode())


def chat_reply(content: Any) -> Reply:
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
    return Reply(body=json.dumps(answer).encode())


def default_reply(seen: Seen, attempt: int) -> Reply:
    if seen.path == "/v1/chat/completions":
        user = seen.body["messages"][-1]["content"]
        return chat_reply(f"Looks fine. Score: {len(user) % 11}")
    return json_reply(seen.body)


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up (a timeout) is expected here
            super().handle_error(request, client_address)


class Server:
    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.behave: Callable[[Seen, int], Reply | None] = lambda seen, attempt: None
        self.stop = threading.Event()
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                seen = Seen(self.path, {k.lower(): v for k, v in self.headers.items()}, json.loads(raw))
                with outer.lock:
                    outer.seen.append(seen)
                    attempt = len(outer.seen)
                reply = outer.behave(seen, attempt) or default_reply(seen, attempt)
                if reply.delay_s and outer.stop.wait(reply.delay_s):
                    return
                try:
                    self.send_response(reply.status)
                    self.send_header("content-type", "application/json")
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    if reply.length:
                        self.send_header("content-length", str(len(reply.body)))
                    else:
                        self.send_header("connection", "close")
                        self.close_connection = True
                    self.end_headers()
                    if not reply.trickle_s:
                        self.wfile.write(reply.body)
                        return
                    for i in range(len(reply.body)):
                        self.wfile.write(reply.body[i : i + 1])
                        self.wfile.flush()
                        if outer.stop.wait(reply.trickle_s):
                            return
                except OSError:  # the client gave up (a timeout): nothing to answer
                    self.close_connection = True

        self.httpd = QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def attempts(self) -> int:
        with self.lock:
            return len(self.seen)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@pytest.fixture
def rm() -> Iterator[RemoteRewardModel]:
    fn = RemoteRewardModel()
    yield fn
    fn.close()


def make_group(texts: list[str], answer: str = "42", prompt: str = "What is 6*7?") -> GroupInput:
    group_metadata = {"prompt": prompt, "answer": answer}
    samples = tuple(
        SampleInput(
            sample_id=f"s{i}",
            completion_text=t,
            metadata={"index": str(i)},
            group_metadata=group_metadata,
            group_id="g",
        )
        for i, t in enumerate(texts)
    )
    return GroupInput(group_id="g", prompt_id="p", samples=samples, metadata=group_metadata)


def score(fn: RemoteRewardModel, group: GroupInput, **overrides: Any) -> list[Score]:
    config = RemoteRewardModel.validate_config({**RemoteRewardModel.default_config, **overrides})
    return fn(group, config)


def json_cfg(server: Server, **overrides: Any) -> dict[str, Any]:
    return {"url": f"{server.url}/score", "backoff_s": 0.01, **overrides}


def openai_cfg(server: Server, **overrides: Any) -> dict[str, Any]:
    return {"protocol": "openai", "url": f"{server.url}/v1/chat/completions", "backoff_s": 0.01, **overrides}


def failed(results: list[Score], fallback: float = -1.0, status: float | None = None) -> bool:
    return all(
        r.score == fallback
        and r.components["remote_error"] == 1.0
        and (status is None or r.components["remote_status"] == status)
        for r in results
    )


# -- json protocol --------------------------------------------------------------------------------


def test_json_scores_are_the_servers_and_the_request_is_as_documented(server: Server, rm: RemoteRewardModel) -> None:
    texts = ["the answer is 42", "it is 41", "", "42"]
    results = score(rm, make_group(texts), **json_cfg(server))
    expected = [text_score(t, {"answer": "42"}) for t in texts]
    assert [r.score for r in results] == expected
    assert [r.components for r in results] == [{"length": float(len(t)), "remote_error": 0.0} for t in texts]
    assert server.attempts() == 1
    seen = server.seen[0]
    assert seen.path == "/score"
    assert seen.headers["content-type"] == "application/json"
    assert "authorization" not in seen.headers
    assert seen.body == {
        "group_id": "g",
        "prompt": "What is 6*7?",
        "sample_ids": ["s0", "s1", "s2", "s3"],
        "completions": texts,
        "metadata": [{"prompt": "What is 6*7?", "answer": "42", "index": str(i)} for i in range(4)],
    }


def test_a_group_of_70_with_max_batch_32_takes_3_requests(server: Server, rm: RemoteRewardModel) -> None:
    texts = [f"answer {'x' * i} {42 if i % 3 else 0}" for i in range(70)]
    results = score(rm, make_group(texts), **json_cfg(server, max_batch=32))
    assert server.attempts() == 3
    sizes = sorted(len(s.body["completions"]) for s in server.seen)
    assert sizes == [23, 23, 24]
    assert [r.score for r in results] == [text_score(t, {"answer": "42"}) for t in texts]  # in order
    assert sorted(sid for s in server.seen for sid in s.body["sample_ids"]) == sorted(f"s{i}" for i in range(70))
    server.seen.clear()
    score(rm, make_group(texts[:64]), **json_cfg(server, max_batch=32, max_concurrency=1))
    assert [len(s.body["completions"]) for s in server.seen] == [32, 32]


def test_an_empty_group_sends_nothing(server: Server, rm: RemoteRewardModel) -> None:
    assert score(rm, make_group([]), **json_cfg(server)) == []
    assert score(rm, make_group([]), **openai_cfg(server)) == []
    assert server.attempts() == 0


def test_503_is_retried_until_it_succeeds(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: Reply(503, b"busy") if attempt <= 2 else None
    results = score(rm, make_group(["a", "bb"]), **json_cfg(server, retries=2))
    assert server.attempts() == 3
    assert [r.score for r in results] == [0.1, 0.2]
    assert all(r.components["remote_error"] == 0.0 for r in results)


@pytest.mark.parametrize("status", [429, 502, 504])
def test_429_502_504_are_retried(server: Server, rm: RemoteRewardModel, status: int) -> None:
    server.behave = lambda seen, attempt: Reply(status, headers={"retry-after": "0"}) if attempt == 1 else None
    results = score(rm, make_group(["abc"]), **json_cfg(server))
    assert server.attempts() == 2
    assert results[0].score == pytest.approx(0.3)


def test_retry_after_is_honoured(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: Reply(429, headers={"retry-after": "0.4"}) if attempt == 1 else None
    start = time.monotonic()
    results = score(rm, make_group(["abc"]), **json_cfg(server))
    assert time.monotonic() - start >= 0.4
    assert results[0].components["remote_error"] == 0.0


def test_retries_run_out_into_the_fallback(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: Reply(503)
    results = score(rm, make_group(["a", "b"]), **json_cfg(server, retries=3, fallback_score=-1.0))
    assert server.attempts() == 4
    assert failed(results, -1.0, 503.0)


@pytest.mark.parametrize("status", [400, 401, 404, 422, 500, 307])
def test_other_statuses_are_not_retried(server: Server, rm: RemoteRewardModel, status: int) -> None:
    server.behave = lambda seen, attempt: Reply(status, b'{"error": "no"}', headers={"location": "/elsewhere"})
    results = score(rm, make_group(["a", "b", "c"]), **json_cfg(server, retries=5, fallback_score=-1.0))
    assert server.attempts() == 1  # (a 307 is not followed either)
    assert failed(results, -1.0, float(status))


MALFORMED = {
    "wrong length": b'{"scores": [1.0]}',
    "NaN": b'{"scores": [NaN, 1.0]}',
    "infinity": b'{"scores": [1e999, 1.0]}',
    "a string": b'{"scores": ["1.0", 1.0]}',
    "a bool": b'{"scores": [true, 1.0]}',
    "null": b'{"scores": [null, 1.0]}',
    "no scores": b'{"score": [1.0, 1.0]}',
    "not an object": b"[1.0, 1.0]",
    "not JSON": b"<html>oops</html>",
    "not UTF-8": b'{"scores": [1.0, 1.0], "x": "\xff"}',
    "nested past the recursion limit": b"[" * 200_000,
    "components not a list": b'{"scores": [1.0, 1.0], "components": {"a": 1}}',
    "components of a wrong length": b'{"scores": [1.0, 1.0], "components": [{}]}',
    "a component that is no number": b'{"scores": [1.0, 1.0], "components": [{"a": "x"}, {"a": 1}]}',
    "a component named remote_error": b'{"scores": [1.0, 1.0], "components": [{"remote_error": 0}, {}]}',
    "an empty component name": b'{"scores": [1.0, 1.0], "components": [{"": 0}, {}]}',
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_answer_gives_each_sample_the_fallback(server: Server, rm: RemoteRewardModel, body: bytes) -> None:
    server.behave = lambda seen, attempt: Reply(200, body)
    results = score(rm, make_group(["a", "b"]), **json_cfg(server, fallback_score=-1.0))
    assert server.attempts() == 1
    assert failed(results, -1.0, 200.0)


def test_only_the_samples_of_a_failed_batch_get_the_fallback(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: Reply(200, b'{"scores": []}') if "s4" in seen.body["sample_ids"] else None
    texts = [f"t{'x' * i}" for i in range(9)]
    results = score(rm, make_group(texts), **json_cfg(server, max_batch=3, fallback_score=-1.0))
    assert server.attempts() == 3
    assert failed(results[3:6], -1.0)
    ok = results[:3] + results[6:]
    assert [r.score for r in ok] == [text_score(t, {}) for t in texts[:3] + texts[6:]]
    assert all(r.components["remote_error"] == 0.0 for r in ok)


def test_a_body_over_the_cap_is_refused(server: Server, rm: RemoteRewardModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "MAX_RESPONSE_BYTES", 1024)
    big = json.dumps({"scores": [1.0], "pad": "x" * 2000}).encode()
    for length in (True, False):  # declared up front, or found while reading
        server.behave = lambda seen, attempt, length=length: Reply(200, big, length=length)
        assert failed(score(rm, make_group(["a"]), **json_cfg(server, fallback_score=-1.0)), -1.0, 200.0)
    server.behave = lambda seen, attempt: Reply(200, b'{"scores": [0.5]}', length=False)  # under it: fine
    assert score(rm, make_group(["a"]), **json_cfg(server))[0].score == 0.5


def test_a_compressed_body_is_refused(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: Reply(200, b"\x1f\x8b...", headers={"content-encoding": "gzip"})
    assert failed(score(rm, make_group(["a"]), **json_cfg(server, fallback_score=-1.0)), -1.0, 200.0)
    assert server.seen[0].headers["accept-encoding"] == "identity"


def test_a_server_that_hangs_costs_about_the_request_timeout(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: Reply(delay_s=10.0)
    start = time.monotonic()
    results = score(rm, make_group(["a", "b"]), **json_cfg(server, request_timeout_s=0.5, fallback_score=-1.0))
    elapsed = time.monotonic() - start
    assert 0.45 <= elapsed < 1.5, elapsed
    assert server.attempts() == 1  # a timeout is not retried: the server has the request and is slow
    assert failed(results, -1.0, 0.0)


def test_a_server_that_trickles_its_body_is_cut_off(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: Reply(200, b'{"scores": [1.0]}' + b" " * 100, trickle_s=0.05)
    start = time.monotonic()
    results = score(rm, make_group(["a"]), **json_cfg(server, request_timeout_s=0.5, fallback_score=-1.0))
    assert time.monotonic() - start < 1.5
    assert failed(results, -1.0)


def test_retries_stop_at_the_groups_budget(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: Reply(503, headers={"retry-after": "0.3"})
    start = time.monotonic()
    results = score(rm, make_group(["a"]), **json_cfg(server, retries=10, budget_s=1.0, fallback_score=-1.0))
    assert time.monotonic() - start < 2.0  # (ten retries after 0.3 s each would be 3 s and more)
    assert 2 <= server.attempts() <= 4
    assert failed(results, -1.0, 503.0)


def test_a_refused_connection_is_retried_then_falls_back(rm: RemoteRewardModel) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    results = score(rm, make_group(["a"]), url=f"http://127.0.0.1:{port}/score", fallback_score=-1.0, backoff_s=0.01)
    assert time.monotonic() - start < 2.0
    assert failed(results, -1.0, 0.0)


# -- the token --------------------------------------------------------------------------------------


def test_the_token_is_sent_as_a_bearer(server: Server, rm: RemoteRewardModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "tok-SECRET-123")
    results = score(rm, make_group(["a"]), **json_cfg(server, api_key_env=TOKEN_ENV))
    assert results[0].components["remote_error"] == 0.0
    assert server.seen[0].headers["authorization"] == "Bearer tok-SECRET-123"
    score(rm, make_group(["a"]), **openai_cfg(server, api_key_env=TOKEN_ENV))
    assert server.seen[1].headers["authorization"] == "Bearer tok-SECRET-123"


def test_the_token_appears_in_no_result_message_or_log(
    server: Server, rm: RemoteRewardModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    token = "tok-WRONG-456"
    monkeypatch.setenv(TOKEN_ENV, token)

    def refuse(seen: Seen, attempt: int) -> Reply:  # a server that echoes what it was sent, as some do
        echo = json.dumps({"error": f"bad credentials {seen.headers['authorization']}"}).encode()
        return Reply(401, echo, headers={"www-authenticate": f"Bearer error={seen.headers['authorization']!r}"})

    server.behave = refuse
    config = RemoteRewardModel.validate_config({**RemoteRewardModel.default_config, **json_cfg(server)})
    config |= {"api_key_env": TOKEN_ENV, "fallback_score": -1.0}
    with caplog.at_level(logging.DEBUG):
        results = rm(make_group(["a", "b"]), config)
        outcomes = worker.call_group("tauflow.reward.adapters.remote:RemoteRewardModel", make_group(["a"]), config)
    assert failed(results, -1.0, 401.0)
    assert all(ok for ok, *_ in outcomes)  # a per-sample fallback, not an error of the group
    assert "HTTP 401" in caplog.text
    for text in (repr(results), repr(outcomes), caplog.text):
        assert token not in text
    assert seen_all_with(server, f"Bearer {token}")


def seen_all_with(server: Server, authorization: str) -> bool:
    return all(s.headers.get("authorization") == authorization for s in server.seen)


def test_a_token_variable_must_be_set_and_well_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    base = {**RemoteRewardModel.default_config, "url": "http://127.0.0.1:1/score"}
    with pytest.raises(ConfigInvalid, match=f"{TOKEN_ENV} is not set") as e:
        RemoteRewardModel.validate_config({**base, "api_key_env": TOKEN_ENV})
    assert e.value.key == "api_key_env"
    for name in ("AWS_SECRET_ACCESS_KEY", "TAUFLOW_RM_", "TAUFLOW_RM_lower", "PATH"):
        with pytest.raises(ConfigInvalid, match="TAUFLOW_RM_") as e:
            RemoteRewardModel.validate_config({**base, "api_key_env": name})
        assert e.value.key == "api_key_env"
        assert "aws-secret" not in str(e.value)
    monkeypatch.setenv(TOKEN_ENV, "two words")
    with pytest.raises(ConfigInvalid, match="cannot carry") as e:
        RemoteRewardModel.validate_config({**base, "api_key_env": TOKEN_ENV})
    assert "two words" not in str(e.value)


# -- configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("", "required"),
        ("ftp://example.com/score", "only http, https and grpc"),
        ("file:///etc/passwd", "only http, https and grpc"),
        ("example.com/score", "only http, https and grpc"),
        ("http://user:pw@example.com/score", "credentials"),
        ("http://token@example.com/score", "credentials"),
        ("http://example.com/" + "x" * 2048, "at most 2048"),
        ("http:///score", "no host"),
        ("http://example.com:99999/score", "port"),
        ("http://example.com/score#frag", "fragment"),
        ("http://exa mple.com/score", "printable ASCII"),
        ("http://example.com/\nscore", "printable ASCII"),
        ("http://exämple.com/score", "printable ASCII"),
    ],
)
def test_bad_urls_are_refused_naming_the_key(url: str, problem: str) -> None:
    with pytest.raises(ConfigInvalid, match=problem) as e:
        RemoteRewardModel.validate_config({**RemoteRewardModel.default_config, "url": url})
    assert e.value.key == "url"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("protocol", "grpc"),
        ("retries", 11),
        ("retries", -1),
        ("request_timeout_s", 0),
        ("request_timeout_s", 601),
        ("budget_s", float("nan")),
        ("max_batch", 0),
        ("max_concurrency", 65),
        ("fallback_score", float("inf")),
        ("score_pattern", "(unclosed"),
        ("score_pattern", ""),
        ("template", "no placeholder for the completion: {prompt}"),
        ("max_score", 0.0),
        ("prompt_key", ""),
        ("headers", {"authorization": "Bearer x"}),
    ],
)
def test_bad_options_are_refused_naming_the_key(key: str, value: Any) -> None:
    config = {**RemoteRewardModel.default_config, "url": "https://rm.example/score", key: value}
    with pytest.raises(ConfigInvalid) as e:
        RemoteRewardModel.validate_config(config)
    assert e.value.key == key


def test_the_defaults_are_as_documented() -> None:
    fn = RemoteRewardModel
    assert fn.group_level is True
    assert fn.timeout_s > fn.default_config["budget_s"]
    assert fn.default_config == RemoteOptions().model_dump()
    assert {k: fn.default_config[k] for k in ("protocol", "url", "api_key_env", "max_batch", "retries")} == {
        "protocol": "json",
        "url": "",
        "api_key_env": "",
        "max_batch": 32,
        "retries": 2,
    }
    assert fn.default_config["request_timeout_s"] == 30.0
    config = fn.validate_config({**fn.default_config, "url": "https://rm.internal:8443/v1/score?x=1"})
    assert config == {**fn.default_config, "url": "https://rm.internal:8443/v1/score?x=1"}


def test_importing_the_module_loads_no_http_library() -> None:
    code = "import sys, tauflow.reward.adapters.remote; print(sorted({'httpx2', 'tenacity'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- openai protocol ------------------------------------------------------------------------------


def test_openai_score_7_of_10_is_0_7(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: chat_reply("The answer is right but terse.\nScore: 7")
    results = score(rm, make_group(["42"]), **openai_cfg(server, model="judge-7b", max_tokens=64))
    assert results == [Score(0.7, {"judge_score": 7.0, "remote_error": 0.0})]
    body = server.seen[0].body
    assert server.seen[0].path == "/v1/chat/completions"
    assert body["model"] == "judge-7b"
    assert body["temperature"] == 0
    assert body["max_tokens"] == 64
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][0]["content"] == remote.DEFAULT_SYSTEM_PROMPT
    user = body["messages"][1]["content"]
    assert "[Question]\nWhat is 6*7?\n" in user
    assert "[Reference answer]\n42\n" in user
    assert "[Response]\n42\n" in user
    raw = score(rm, make_group(["42"]), **openai_cfg(server, normalise=False))
    assert raw[0].score == 7.0
    assert "model" not in server.seen[-1].body  # none configured: the server's own


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Score: 7", 0.7),
        ("**Score:** 7.5/10", 0.75),
        ("score = 3\nThe rest: 10/10 steps", 0.3),
        ("Overall I would give it 8.", 0.8),
        ("Score: 12", 1.0),
        ("Score: -3", 0.0),
    ],
)
def test_openai_scores_are_read_and_normalised(
    server: Server, rm: RemoteRewardModel, reply: str, expected: float
) -> None:
    server.behave = lambda seen, attempt: chat_reply(reply)
    assert score(rm, make_group(["x"]), **openai_cfg(server))[0].score == pytest.approx(expected)


@pytest.mark.parametrize(
    "reply",
    [
        chat_reply("I cannot judge this."),
        chat_reply(None),
        Reply(200, b'{"choices": []}'),
        Reply(200, b'{"error": "overloaded"}'),
    ],
)
def test_an_openai_reply_without_a_score_falls_back(server: Server, rm: RemoteRewardModel, reply: Reply) -> None:
    server.behave = lambda seen, attempt: reply
    results = score(rm, make_group(["x", "y"]), **openai_cfg(server, fallback_score=-1.0))
    assert server.attempts() == 2
    assert failed(results, -1.0)


def test_openai_sends_one_request_per_sample_and_keeps_the_order(server: Server, rm: RemoteRewardModel) -> None:
    texts = ["a" * i for i in range(16)]
    results = score(rm, make_group(texts), **openai_cfg(server, template="{completion}", max_concurrency=4))
    assert server.attempts() == 16
    assert [r.score for r in results] == [pytest.approx((i % 11) / 10) for i in range(16)]


def test_openai_custom_pattern_and_range(server: Server, rm: RemoteRewardModel) -> None:
    server.behave = lambda seen, attempt: chat_reply("verdict: RATING=4 of 5; 5 is best")
    cfg = openai_cfg(server, score_pattern=r"RATING=(\d+)", min_score=1.0, max_score=5.0)
    assert score(rm, make_group(["x"]), **cfg)[0].score == pytest.approx(0.75)


def test_the_template_is_filled_without_str_format(server: Server, rm: RemoteRewardModel) -> None:
    hostile = "{0.__class__} {prompt} {reference} {completion} {__import__} }{ \\1 \\g<0>"
    template = "Q: {prompt}\nA: {completion}\nRef: {reference}\nLiteral {braces} and {0} stay."
    score(rm, make_group([hostile], answer="{answer}", prompt="P {x}"), **openai_cfg(server, template=template))
    user = server.seen[0].body["messages"][1]["content"]
    assert user == f"Q: P {{x}}\nA: {hostile}\nRef: {{answer}}\nLiteral {{braces}} and {{0}} stay."


def test_fill_and_parse_score_directly() -> None:
    assert fill("{completion}|{prompt}", {"completion": "{prompt}", "prompt": "p", "reference": ""}) == "{prompt}|p"
    cfg = RemoteRewardModel.validate_config({**RemoteRewardModel.default_config, "url": "http://h/"})
    assert parse_score("Score: 7", cfg) == (pytest.approx(0.7), 7.0)
    assert parse_score("SCORE:10", {**cfg, "normalise": False}) == (10.0, 10.0)
    whole = {**cfg, "score_pattern": r"\d+"}  # no group: the whole match
    assert parse_score("n 3 4", whole) == (pytest.approx(0.3), 3.0)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"protocol": "json", "url": "grpc://rm:50053"}, "url"),  # a gRPC address is protocol tauflow's
        ({"protocol": "tauflow", "url": "http://rm:8000/score"}, "url"),
        ({"protocol": "tauflow", "url": "grpc://rm:50053", "api_key_env": "TAUFLOW_RM_X"}, "api_key_env"),
    ],
)
def test_protocol_tauflow_takes_a_grpc_address_and_no_token(
    overrides: dict[str, Any], key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TAUFLOW_RM_X", "t")
    with pytest.raises(ConfigInvalid) as e:
        RemoteRewardModel.validate_config({**RemoteRewardModel.default_config, **overrides})
    assert e.value.key == key
    fine = RemoteRewardModel.validate_config(
        {**RemoteRewardModel.default_config, "protocol": "tauflow", "url": "grpc://rm:50053"}
    )
    assert fine["url"] == "grpc://rm:50053"
