"""A fuzz harness for any tauflow gRPC service (issue #11): hypothesis strategies built from the protobuf
descriptor of each method's request, byte-level mutations of valid serialized requests, and a check of every
answer, sent as raw bytes (``channel.unary_unary(path)``) so that the server's own decode runs.

Every answer must be OK or a code the method's contract documents (INVALID_ARGUMENT always is: a request that
does not decode in full is refused so), never UNKNOWN or INTERNAL, with a bounded, non-empty message; a refused
call must leave the observed state as it was; after the batch the server still answers its health check.

The budget is ``TAUFLOW_FUZZ_EXAMPLES`` examples per method (CI's default is small and derandomized, so a run
is reproducible; a set budget draws fresh examples)."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

C = grpc.StatusCode
FORBIDDEN = {C.UNKNOWN, C.INTERNAL}  # a bug either way: an escaped exception, or the catch-all that caught one
ALWAYS = {C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED}  # RESOURCE_EXHAUSTED: over gRPC's message size limit
MAX_DETAILS = 16_384  # an error message that echoes a huge field is an unbounded string of its own (4096-character
# fields, the default bound, echoed twice and a sentence fit)


def budget(default: int) -> int:
    return int(os.environ.get("TAUFLOW_FUZZ_EXAMPLES") or default)


# -- strategies over descriptors ---------------------------------------------------------------------

_INT = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted(
        {
            v
            for v in (
                0,
                1,
                2,
                -1,
                lo,
                hi,
                lo + 1,
                hi - 1,
                2**31 - 1,
                2**32 - 1,
                2**53,
                2**53 + 1,
                2**63 - 1,
                -(2**53) - 1,
            )
            if lo <= v <= hi
        }
    )
    return st.one_of(st.sampled_from(edges), st.integers(0, min(hi, 64)), st.integers(lo, hi))


def strings(small: bool = False) -> st.SearchStrategy[str]:
    """Edge-case strings; unless ``small``, also huge ones (inside lists and maps they stay small, so that one
    request stays within a few megabytes)."""
    # (a protobuf string is UTF-8: lone surrogates cannot even be put in a message; bad UTF-8 on the wire is
    # the byte mutations' part)
    any_char, non_ascii = st.characters(codec="utf-8"), st.characters(min_codepoint=0x80, codec="utf-8")
    if small:
        return st.one_of(st.just(""), st.text(any_char, max_size=12), st.text(non_ascii, max_size=8))
    return st.one_of(
        st.just(""),
        st.text(any_char, max_size=12),
        st.text(non_ascii, min_size=1, max_size=12),  # non-ASCII only
        st.sampled_from(
            [
                "\x00",
                "a\x00b",
                "../../etc/passwd",
                "/",
                " ",
                "%s%n",
                "\u202e",
                "🦙" * 3,
                "x:0",
                "127.0.0.1:1",
                "file:///dev/zero",
                "shm://x",
                "gloo",
                "nccl",
                "float32",
                "-1",
            ]
        ),
        st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\x00"]), st.integers(200, 200_000)),
    )


def _scalar(f: FieldDescriptor, small: bool = False) -> st.SearchStrategy[Any]:
    t = f.type
    if t in _INT:
        return integers(*_INT[t])
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return strings(small)
    if t == FieldDescriptor.TYPE_BYTES:
        if small:
            return st.binary(max_size=32)
        return st.one_of(st.binary(max_size=32), st.integers(1000, 200_000).map(lambda n: b"\xff" * n))
    if t == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown numbers decode too
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), integers(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field type {t} of {f.full_name}")


def _time(d: Descriptor) -> st.SearchStrategy[Message]:
    """Durations and Timestamps with in-range, edge and out-of-range seconds and nanos (the wire allows any)."""
    cls = message_factory.GetMessageClass(d)
    secs = st.one_of(
        integers(-(2**63), 2**63 - 1),
        st.sampled_from([315_576_000_000, 315_576_000_001, 253_402_300_800, -62_135_596_801, 86_400 * 365, 3600, 5]),
    )
    nanos = st.one_of(st.sampled_from([0, 1, -1, 999_999_999, 1_000_000_000, -(10**9)]), integers(-(2**31), 2**31 - 1))
    return st.builds(lambda s, n: cls(seconds=s, nanos=n), secs, nanos)


def messages(d: Descriptor, depth: int = 3, small: bool = False) -> st.SearchStrategy[Message]:
    """Messages of type ``d`` with any subset of fields set to generated values (nested up to ``depth``);
    ``small``: no huge strings and no long lists (an element of a list)."""
    if d.full_name in ("google.protobuf.Duration", "google.protobuf.Timestamp"):
        return _time(d)
    cls = message_factory.GetMessageClass(d)
    optional = {}
    for f in d.fields:
        value = _field_value(f, depth, small)
        if value is not None:
            optional[f.name] = value
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: _build(cls, values))


def _element(f: FieldDescriptor, depth: int, small: bool) -> st.SearchStrategy[Any] | None:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(f.message_type, depth - 1, small) if depth > 0 else None
    return _scalar(f, small)


def _field_value(f: FieldDescriptor, depth: int, small: bool = False) -> st.SearchStrategy[Any] | None:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        v = _element(value, depth, True)
        if v is None:
            return None
        if small:
            return st.dictionaries(_scalar(key, True), v, max_size=3)
        return st.one_of(
            st.dictionaries(_scalar(key, True), v, max_size=4),
            st.builds(
                lambda n, x: {(str(i) if key.type == FieldDescriptor.TYPE_STRING else i): x for i in range(n)},
                st.integers(500, 5000),
                v,
            ),
        )
    if not f.is_repeated:
        return _element(f, depth, small)
    element = _element(f, depth, True)
    if element is None:
        return None
    if small:
        return st.lists(element, max_size=3)
    return st.one_of(
        st.lists(element, max_size=4),
        st.builds(lambda x, n: [x] * n, element, st.integers(1000, 20_000)),  # long lists, cheap to draw
    )


def _build(cls: type[Message], values: dict[str, Any]) -> Message:
    msg = cls()
    for name, value in values.items():
        f = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(msg, name) if f.message_type is not None or f.is_repeated else None
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            is_message = f.message_type.fields_by_name["value"].message_type is not None
            for k, v in value.items():
                if is_message:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif f.is_repeated:
            target.extend(value)
        elif f.message_type is not None:
            target.CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


# -- byte-level mutation -------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _mutate(raw: bytes, ops: list[tuple[int, int, int, bytes]], numbers: Sequence[int]) -> bytes:
    data = bytearray(raw)
    for kind, pos, value, blob in ops:
        i = pos % (len(data) + 1)
        if kind == 0 and data:  # flip one bit
            data[i % len(data)] ^= 1 << (value % 8)
        elif kind == 1 and data:  # overwrite one byte
            data[i % len(data)] = value % 256
        elif kind == 2:  # insert bytes
            data[i:i] = blob
        elif kind == 3:  # delete a range
            del data[i : i + 1 + value % 16]
        elif kind == 4:  # truncate
            del data[i:]
        elif kind == 5:  # duplicate a range (a repeated or re-set field)
            data[i:i] = data[i : i + 1 + value % 64]
        elif kind == 6:  # append a known field number with any wire type (incl. groups and invalid ones)
            number = numbers[value % len(numbers)] if numbers else 1 + value % 20
            wire_type = (value >> 8) % 8
            data += _varint(number << 3 | wire_type)
            data += _varint(len(blob)) + blob if wire_type == 2 else blob[:8]
        elif kind == 7:  # a length-delimited field whose length lies
            number = numbers[value % len(numbers)] if numbers else 1
            data += _varint(number << 3 | 2) + _varint(len(blob) + 1 + (value >> 4) % 2**40) + blob
    return bytes(data)


_BLOBS = st.one_of(
    st.binary(max_size=16),
    st.sampled_from(
        [b"\xff\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"\x80" * 11, b"\xff" * 10 + b"\x01", b"\x0b\x0c", b"\x00" * 4]
    ),
)
_OPS = st.lists(
    st.tuples(st.integers(0, 7), st.integers(0, 2**16), st.integers(0, 2**48), _BLOBS), min_size=1, max_size=4
)


def mutations(valid: Sequence[bytes], numbers: Sequence[int] = ()) -> st.SearchStrategy[bytes]:
    """Byte-level mutations of the valid serialized requests ``valid``."""
    return st.builds(lambda raw, ops: _mutate(raw, ops, numbers), st.sampled_from(list(valid)), _OPS)


def requests(d: Descriptor, valid: Sequence[Message]) -> st.SearchStrategy[bytes]:
    """Serialized requests of type ``d``: generated ones, valid ones with generated fields merged in (so that
    one bad field reaches past the checks of the others), and byte mutations of the valid ones."""
    generated = messages(d)
    numbers = [f.number for f in d.fields]
    strategies = [generated.map(lambda m: m.SerializeToString())]
    if valid:
        strategies.append(st.builds(_merged, st.sampled_from(list(valid)), generated))
        strategies.append(mutations([m.SerializeToString() for m in valid], numbers))
    return st.one_of(strategies).map(Payload)


@dataclass(frozen=True)
class Payload:
    """Request bytes whose repr (in hypothesis's report of a failing example) is bounded."""

    raw: bytes

    def __repr__(self) -> str:
        return f"Payload({self.raw[:200]!r}{'...' if len(self.raw) > 200 else ''}, {len(self.raw)} bytes)"


def _merged(base: Message, extra: Message) -> bytes:
    out = type(base)()
    out.CopyFrom(base)
    out.MergeFrom(extra)
    return out.SerializeToString()


# -- the run -----------------------------------------------------------------------------------------


@dataclass
class Method:
    """One RPC to fuzz: the codes its contract documents (besides ``ALWAYS``), valid requests to mutate, and its
    client deadline. ``waits``: the method may wait out a deadline by contract (a long poll)."""

    name: str
    codes: set[grpc.StatusCode] = field(default_factory=set)
    valid: Sequence[Message] = ()
    timeout_s: float = 5.0
    waits: bool = False


@dataclass
class Report:
    examples: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    slowest_s: float = 0.0
    seconds: float = 0.0

    def line(self, method: str) -> str:
        codes = ", ".join(f"{k} {v}" for k, v in self.codes.most_common())
        return f"{method}: {self.examples} examples in {self.seconds:.1f}s, slowest {self.slowest_s:.2f}s ({codes})"


class Fuzzer:
    """Fuzzes the methods of ``service`` on the server at ``address``; ``observe`` returns a cheap, comparable
    observation of the server's state (e.g. its Stats), which a refused call must not change."""

    def __init__(
        self,
        address: str,
        service: ServiceDescriptor,
        observe: Callable[[], Any] | None = None,
        log: Callable[[], str] | None = None,
        token: str = "",
    ) -> None:
        self.address = address
        # the run token, on every call: the fuzzed requests reach the control methods' handlers
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.log = log  # the server's log, whose tail a failure shows
        self.service = service
        self.observe = observe
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        )
        self.reports: dict[str, Report] = {}

    def close(self) -> None:
        self.channel.close()

    def call(self, method: Method, payload: bytes) -> tuple[grpc.StatusCode, str, float]:
        rpc = self.channel.unary_unary(f"/{self.service.full_name}/{method.name}")
        started = time.monotonic()
        try:
            rpc(payload, timeout=method.timeout_s, metadata=self.metadata)
        except grpc.RpcError as e:
            return e.code(), e.details() or "", time.monotonic() - started
        return C.OK, "", time.monotonic() - started

    def check(self, method: Method, payload: bytes, before: Any) -> Any:
        """One call and its checks; returns the observation to compare the next call with."""
        code, details, took = self.call(method, payload)
        report = self.reports.setdefault(method.name, Report())
        report.examples += 1
        report.codes[code.name] += 1
        report.slowest_s = max(report.slowest_s, took)
        what = f"{method.name}({Payload(payload)!r})"
        if code in FORBIDDEN:
            tail = self.log()[-4000:] if self.log else ""
            raise AssertionError(f"{what} answered {code.name}: {details}\nserver log:\n{tail}")
        allowed = ALWAYS | method.codes | ({C.DEADLINE_EXCEEDED} if method.waits else set())
        assert code in allowed, f"{what} answered {code.name} (not in its contract): {details}"
        if code != C.OK:
            assert details.strip(), f"{what} answered {code.name} without a message"
            assert len(details) <= MAX_DETAILS, f"{what}: a {len(details)}-character message: {details[:200]}..."
        if self.observe is None:
            return None
        after = self.observe()
        if code != C.OK and code != C.DEADLINE_EXCEEDED:
            assert after == before, (
                f"{what} was refused ({code.name}: {details}) yet changed state:\n{before}\n->\n{after}"
            )
        return after

    def fuzz(self, method: Method, examples: int) -> Report:
        d = self.service.methods_by_name[method.name].input_type
        state = {"before": self.observe() if self.observe else None}
        started = time.monotonic()

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=not os.environ.get("TAUFLOW_FUZZ_EXAMPLES"),
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        )
        @given(payload=requests(d, method.valid))
        def run(payload: bytes) -> None:
            state["before"] = self.check(method, payload.raw, state["before"])

        run()
        report = self.reports.setdefault(method.name, Report())
        report.seconds = time.monotonic() - started
        self.assert_healthy()
        return report

    def assert_healthy(self, timeout_s: float = 10.0) -> None:
        status = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        assert status.status == health_pb2.HealthCheckResponse.SERVING

    def summary(self) -> str:
        return "\n".join(r.line(m) for m, r in self.reports.items())
