"""Generated bad input against a real reward service process (issue #11): no crash, no UNKNOWN, no
INTERNAL, nothing scored on a refusal, and the service keeps serving.

Two generators: hypothesis strategies built from the protobuf descriptors of the requests (every field
of every nested message, with NaN and infinities, lengths around the service's bounds, unknown enum
values, Structs nested past protobuf's limit), biased by the service's own vocabulary (its function
names and config keys, hostile regular expressions) so that requests also get past the first check;
and byte-level mutations of valid serialized requests, sent raw over a real channel.

The CI budget is fixed and derandomized (the whole file runs in about 25 s on 2 cores);
``TAUFLOW_FUZZ_EXAMPLES=<n>`` runs ``n`` examples per test instead (the README records the long run).
"""

from __future__ import annotations

import math
import os
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory, struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tauflow.api.common.v1 import common_pb2
from tauflow.api.reward.v1 import reward_pb2
from tauflow.core.testing import ServiceProcess

LONG_RUN = int(os.environ.get("TAUFLOW_FUZZ_EXAMPLES", "0"))
SETTINGS = settings(
    max_examples=LONG_RUN or 120,
    derandomize=not LONG_RUN,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
# Small bounds, so that values just over them are cheap to generate (the defaults are 256 to 1 Mi).
LIMITS = {
    "limits.max_id_chars": 32,
    "limits.max_text_chars": 2048,
    "limits.max_map_entries": 4,
    "limits.max_tokens_per_sample": 32,
    "limits.max_config_bytes": 1024,
    "max_samples_per_request": 24,
}
DOCUMENTED = {  # what a Score or ListRewardFunctions may answer besides OK (reward.proto)
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
SCORE = "/tauflow.api.reward.v1.RewardService/Score"
LIST = "/tauflow.api.reward.v1.RewardService/ListRewardFunctions"
CALL_TIMEOUT_S = 20.0
HOSTILE_PATTERNS = [
    "(a+)+$",
    "(a|aa)+$",
    r"(\w)\1",
    "(?=a)",
    "((",
    "",
    "x" * 3000,
    r"(x|y|\pL){1000}",
    "a{1001}",
    r"(?:[ab]*a[ab]{999}c|[ab]*b[ab]{999}c)",
    "<think>.*?</think>",
    r"\Z",
    "[",
    "(?P<n>a)(?P=n)",
]

outcomes: Counter[str] = Counter()


# -- the service ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    settings_ = {"pool.workers": 2, "pool.preload": "[]", "load_entry_points": "false", **LIMITS}
    proc = ServiceProcess("reward", tmp_path_factory.mktemp("fuzz"), settings_).start()
    yield proc
    proc.stop()
    if outcomes:
        print("\nfuzz outcomes:", dict(sorted(outcomes.items())))


@pytest.fixture(scope="module")
def channel(service: ServiceProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(service.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def vocabulary(channel: grpc.Channel) -> dict[str, Any]:
    """Names the service knows: its functions and their config keys, read from ListRewardFunctions."""
    raw = channel.unary_unary(LIST)(b"", timeout=10)
    listing = reward_pb2.ListRewardFunctionsResponse.FromString(raw)
    keys = sorted({k for f in listing.reward_functions for k in f.default_config})
    return {"functions": [f.name for f in listing.reward_functions], "keys": keys}


def _scored_total(service: ServiceProcess) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.info['metrics_port']}/metrics", timeout=10).read()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.decode().splitlines()
        if line.startswith("tauflow_reward_scored_samples_total{")
    )


def _serving(channel: grpc.Channel) -> None:
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def _send(channel: grpc.Channel, method: str, raw: bytes) -> tuple[str, bytes | None]:
    """Sends ``raw`` as is (no serializer on either side); (outcome, response bytes when OK)."""
    try:
        return "OK", channel.unary_unary(method)(raw, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        assert e.code() in DOCUMENTED, f"{e.code()}: {e.details()} for {raw[:300]!r}"
        assert e.details(), "a refusal says why"
        return e.code().name, None


def _check_score(service: ServiceProcess, channel: grpc.Channel, raw: bytes) -> None:
    """One Score call: a documented answer; on OK a well-formed response, on a refusal nothing scored."""
    before = _scored_total(service)
    outcome, answer = _send(channel, SCORE, raw)
    outcomes[f"Score {outcome}"] += 1
    scored = _scored_total(service) - before
    if answer is None:
        assert scored == 0, f"a refused call scored {scored} samples"
    else:
        request = reward_pb2.ScoreRequest.FromString(raw)  # what the service accepted, parsed here
        response = reward_pb2.ScoreResponse.FromString(answer)
        assert [g.group_id for g in response.groups] == [g.group_id for g in request.groups]
        for got, sent in zip(response.groups, request.groups, strict=True):
            assert [s.sample_id for s in got.samples] == [s.sample_id for s in sent.samples]
            for s in got.samples:
                assert math.isfinite(s.reward.score), s
                assert all(math.isfinite(v) for v in s.reward.components.values()), s
                assert s.reward.status in (
                    common_pb2.REWARD_STATUS_OK,
                    common_pb2.REWARD_STATUS_ERROR,
                    common_pb2.REWARD_STATUS_TIMEOUT,
                )
        assert scored == sum(len(g.samples) for g in request.groups)
    _serving(channel)


# -- strategies from the descriptors --------------------------------------------------------------

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_LENGTHS = [0, 1, 3, 31, 32, 33, 255, 256, 257, 1023, 1024, 1025, 2047, 2048, 2049, 5000]


def _sized_text() -> st.SearchStrategy[str]:
    """Lengths around every bound the service has, in repeated characters (cheap at any length)."""
    return st.builds(lambda c, n: c * n, st.characters(codec="utf-8"), st.sampled_from(_LENGTHS))


def _ints(field: FieldDescriptor) -> st.SearchStrategy[int]:
    lo, hi = _INT_RANGES[field.type]
    return st.one_of(st.integers(-3, 3).filter(lambda v: lo <= v <= hi), st.integers(lo, hi), st.sampled_from([lo, hi]))


def _json(words: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-(2**60), 2**60),
        words,
        st.sampled_from(HOSTILE_PATTERNS),
        st.sampled_from(["search", "match", "fullmatch", "DOTALL"]),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(words, inner, max_size=4)),
        max_leaves=8,
    )


def _deep_struct(depth: int) -> struct_pb2.Struct:
    """A Struct nested ``depth`` levels: past protobuf's parse limit of 100 messages at about 50."""
    top = s = struct_pb2.Struct()
    for _ in range(depth):
        s = s.fields["k"].struct_value
    s.fields["leaf"].number_value = 1.0
    return top


class Strategies:
    """``message(descriptor)``: a strategy for that message, field by field from its descriptor."""

    def __init__(self, vocabulary: dict[str, Any]) -> None:
        names = vocabulary["functions"] + vocabulary["keys"] + ["answer", "g", "0", "1"]
        self.words = st.one_of(st.sampled_from(names), st.text(max_size=6), _sized_text())
        self.config_keys = st.one_of(st.sampled_from(vocabulary["keys"]), self.words)

    def struct(self) -> st.SearchStrategy[struct_pb2.Struct]:
        def build(values: dict[str, Any]) -> struct_pb2.Struct:
            s = struct_pb2.Struct()
            s.update(values)
            return s

        return st.one_of(
            st.dictionaries(self.config_keys, _json(self.words), max_size=5).map(build),
            st.sampled_from([45, 60, 120]).map(_deep_struct),
        )

    def scalar(self, field: FieldDescriptor) -> st.SearchStrategy[Any]:
        t = field.type
        if t == FieldDescriptor.TYPE_STRING:
            return self.words
        if t == FieldDescriptor.TYPE_BYTES:
            return st.binary(max_size=40)
        if t == FieldDescriptor.TYPE_BOOL:
            return st.booleans()
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return st.floats(allow_nan=True, allow_infinity=True, width=64 if t == FieldDescriptor.TYPE_DOUBLE else 32)
        if t == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown numbers arrive as they are
            return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 99))
        return _ints(field)

    def message(self, descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
        if descriptor.full_name in ("google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"):
            return self.struct()
        cls = _message_class(descriptor)

        @st.composite
        def build(draw: st.DrawFn) -> Any:
            msg = cls()
            for field in descriptor.fields:
                if not draw(st.booleans()):
                    continue
                if field.message_type is not None and field.message_type.GetOptions().map_entry:
                    entry = field.message_type.fields_by_name
                    entries = draw(st.dictionaries(self.scalar(entry["key"]), self.scalar(entry["value"]), max_size=6))
                    getattr(msg, field.name).update(entries)
                elif field.is_repeated:
                    size = draw(
                        st.sampled_from([0, 1, 2, 3, 31, 32, 33])
                        if field.message_type is None
                        else st.integers(0, 4 if depth < 1 else 3)
                    )
                    target = getattr(msg, field.name)
                    if field.message_type is None:
                        target.extend(draw(st.lists(self.scalar(field), min_size=size, max_size=size)))
                    else:
                        for _ in range(size):
                            target.add().CopyFrom(draw(self.message(field.message_type, depth + 1)))
                elif field.message_type is not None:
                    getattr(msg, field.name).CopyFrom(draw(self.message(field.message_type, depth + 1)))
                else:
                    setattr(msg, field.name, draw(self.scalar(field)))
            return msg

        return build()

    def plausible_score_request(self) -> st.SearchStrategy[reward_pb2.ScoreRequest]:
        """Requests that get past the structural checks (unique ids, bounded sizes), so that the scoring
        path and the config checks get hostile values too."""
        texts = st.one_of(
            st.text(max_size=40), st.sampled_from(["a" * 40, "a" * 40 + "b", "<think>x</think><answer>1</answer>"])
        )

        @st.composite
        def build(draw: st.DrawFn) -> reward_pb2.ScoreRequest:
            req = reward_pb2.ScoreRequest(reward_fn=draw(st.sampled_from(["", "exact_match", "format"])))
            for i in range(draw(st.integers(1, 3))):
                g = req.groups.add(group_id=f"g{i}", metadata={"answer": draw(texts)})
                for j in range(draw(st.integers(1, 4))):
                    g.samples.add(sample_id=str(j), completion_text=draw(texts))
            if draw(st.booleans()):
                req.config.CopyFrom(draw(self.struct()))
            if draw(st.booleans()):
                req.sample_timeout.seconds = draw(st.integers(-2, 700))
                req.sample_timeout.nanos = draw(st.one_of(st.integers(-(10**9), 10**9), st.just(0)))
            return req

        return build()


def _message_class(descriptor: Descriptor) -> Any:
    return message_factory.GetMessageClass(descriptor)


# -- byte-level mutations ---------------------------------------------------------------------------


def _seeds() -> list[bytes]:
    def group(gid: str, *texts: str) -> common_pb2.Group:
        return common_pb2.Group(
            group_id=gid,
            metadata={"answer": "4"},
            samples=[
                common_pb2.Sample(
                    sample_id=str(i),
                    completion_text=t,
                    completion_token_ids=[1, 2, 3],
                    behaviour_logprobs=[-0.5, -1.0, -0.1],
                    metadata={"answer": "4"},
                )
                for i, t in enumerate(texts)
            ],
        )

    config = struct_pb2.Struct()
    config.update({"pattern": "(a+)+$", "mode": "search", "flags": ["DOTALL"], "match_score": 1.0})
    requests = [
        reward_pb2.ScoreRequest(groups=[group("a", "4", " 4 ", "5"), group("b", "x")]),
        reward_pb2.ScoreRequest(reward_fn="format", config=config, groups=[group("f", "a" * 40, "<think>")]),
        reward_pb2.ScoreRequest(reward_fn="exact_match", groups=[group("t", "4")], sample_timeout={"seconds": 1}),
    ]
    return [r.SerializeToString() for r in requests]


def _mutate(raw: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    b = bytearray(raw)
    for op, at, value in ops:
        i = at % (len(b) + 1)
        if op == "insert":
            b[i:i] = bytes([value])
        elif op == "truncate":
            del b[i:]
        elif op == "repeat":  # a slice twice: repeated fields, and lengths that no longer fit
            b[i:i] = b[i : i + value % 16]
        elif i < len(b):
            if op == "flip":
                b[i] ^= 1 << (value % 8)
            elif op == "set":
                b[i] = value
            elif op == "delete":
                del b[i]
    return bytes(b)


_ops = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "insert", "delete", "truncate", "repeat"]),
        st.integers(0, 4096),
        st.integers(0, 255),
    ),
    min_size=1,
    max_size=3,
)


# -- the tests ----------------------------------------------------------------------------------------


def test_generated_score_requests_get_a_documented_answer(
    service: ServiceProcess, channel: grpc.Channel, vocabulary: dict[str, Any]
) -> None:
    strategies = Strategies(vocabulary)
    requests = st.one_of(strategies.message(reward_pb2.ScoreRequest.DESCRIPTOR), strategies.plausible_score_request())

    @SETTINGS
    @given(requests)
    def check(request: reward_pb2.ScoreRequest) -> None:
        _check_score(service, channel, request.SerializeToString())

    check()


def test_mutated_score_requests_get_a_documented_answer(service: ServiceProcess, channel: grpc.Channel) -> None:
    @SETTINGS
    @given(st.sampled_from(_seeds()), _ops)
    def check(seed: bytes, ops: list[tuple[str, int, int]]) -> None:
        raw = _mutate(seed, ops)
        try:
            reward_pb2.ScoreRequest.FromString(raw)
        except Exception:  # noqa: BLE001 - bytes protobuf refuses: the service must refuse them too
            outcome, _ = _send(channel, SCORE, raw)
            outcomes[f"Score(undecodable) {outcome}"] += 1
            assert outcome == "INVALID_ARGUMENT"
            _serving(channel)
            return
        _check_score(service, channel, raw)

    check()


def test_list_reward_functions_answers_any_bytes(channel: grpc.Channel) -> None:
    @SETTINGS
    @given(st.one_of(st.binary(max_size=64), st.builds(_mutate, st.just(b"\x0a\x02hi"), _ops)))
    def check(raw: bytes) -> None:
        outcome, answer = _send(channel, LIST, raw)
        outcomes[f"ListRewardFunctions {outcome}"] += 1
        if answer is None:
            assert outcome == "INVALID_ARGUMENT"
        else:
            assert reward_pb2.ListRewardFunctionsResponse.FromString(answer).reward_functions

    check()


def test_the_service_still_serves_and_holds_no_call(service: ServiceProcess, channel: grpc.Channel) -> None:
    _serving(channel)
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.info['metrics_port']}/metrics", timeout=10).read()
    assert "tauflow_reward_inflight_requests 0.0" in text.decode()
    assert service.proc is not None and service.proc.poll() is None
    log = Path(service.workdir / "reward.1.log").read_text(errors="replace")
    # (a reward function's own failure is logged with its traceback, by design: that is not what is looked for)
    for sign in ("unexpected error", "Exception calling application", "Exception deserializing", "Unexpected <"):
        assert sign not in log, log[log.index(sign) - 200 :][:3000]
