"""The pre-decode walk (tauflow.core.decoding.wire_bounds): a request of many tiny elements is refused on its
wire bytes, naming the field as check_bounds does, and the walk never refuses what a full decode and
check_bounds accept."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tauflow.api.controller.v1 import controller_pb2
from tauflow.api.queue.v1 import queue_pb2
from tauflow.api.reward.v1 import reward_pb2
from tauflow.api.rollout.v1 import rollout_pb2
from tauflow.api.trainer.v1 import trainer_pb2
from tauflow.api.weights.v1 import weights_pb2
from tauflow.core import decoding
from tauflow.core.decoding import OutOfBounds, Undecodable, check_bounds, checked_deserializer, wire_bounds


@pytest.fixture(autouse=True)
def _every_element_descended(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk descends elements of any size here (not only those of 1 KiB or more), so that the small
    messages the properties draw are walked as a large one is."""
    if "floor" not in request.node.name:
        monkeypatch.setattr(decoding, "_DESCENT_FLOOR", 0)


REQUESTS = sorted(
    {
        m.input_type.full_name: m.input_type
        for module in (controller_pb2, queue_pb2, reward_pb2, rollout_pb2, trainer_pb2, weights_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for m in service.methods
    }.items()
)


def test_many_empty_elements_are_refused_before_decoding() -> None:
    raw = b"\x0a\x01r" + b"\x32\x00" * 5_000_000  # request_id, then 5 M empty prompt_parts
    parse = checked_deserializer(rollout_pb2.GenerateRequest, {"prompt_parts": 64})
    start = time.perf_counter()
    got = parse(raw)
    assert time.perf_counter() - start < 0.05  # (the full decode takes ~0.15 s and ~300 MB)
    assert got == OutOfBounds("prompt_parts has more than 64 elements, over the limit of 64")


def test_within_bounds_decodes_as_before() -> None:
    request = rollout_pb2.GenerateRequest(request_id="r")
    request.prompt_parts.add()
    parse = checked_deserializer(rollout_pb2.GenerateRequest, {"prompt_parts": 1})
    assert parse(request.SerializeToString()) == request
    assert isinstance(parse(b"\x0a\x01\xff"), Undecodable)  # (bad UTF-8: the full decode's answer, as before)


def test_without_limits_there_is_no_walk() -> None:
    raw = b"\x32\x00" * 200_000
    assert isinstance(checked_deserializer(rollout_pb2.GenerateRequest)(raw), rollout_pb2.GenerateRequest)


def test_nested_lists_name_the_element() -> None:
    request = reward_pb2.ScoreRequest()
    request.groups.add(group_id="a").samples.add()
    group = request.groups.add(group_id="b")
    for _ in range(4):
        group.samples.add()
    check = wire_bounds(reward_pb2.ScoreRequest.DESCRIPTOR, {"groups.samples": 3})
    assert check(request.SerializeToString()) == "groups[1].samples has more than 3 elements, over the limit of 3"


def test_packed_scalars_are_counted_without_decoding() -> None:
    descriptor = _first_packed_varint_list()
    cls: Any = message_factory.GetMessageClass(descriptor.containing_type)
    msg = cls()
    getattr(msg, descriptor.name).extend([1, 300, 2**20] * 10)
    check = wire_bounds(cls.DESCRIPTOR, max_items=29, max_string=10**9)
    assert check(msg.SerializeToString()) == f"{descriptor.name} has at least 30 elements, over the limit of 29"
    assert wire_bounds(cls.DESCRIPTOR, max_items=30, max_string=10**9)(msg.SerializeToString()) is None


def test_map_keys_are_counted_once_each() -> None:
    field = _first_string_map()
    cls: Any = message_factory.GetMessageClass(field.containing_type)
    one = cls()
    getattr(one, field.name)["k"]
    raw = one.SerializeToString() * 10  # ten entries of one key: one element after decoding
    check = wire_bounds(cls.DESCRIPTOR, max_items=1, max_string=10**9)
    assert check(raw) is None
    two = cls()
    getattr(two, field.name)["j"]
    assert check(raw + two.SerializeToString()) == (f"{field.name} has more than 1 elements, over the limit of 1")


def test_small_elements_are_not_descended_under_the_floor() -> None:
    request = reward_pb2.ScoreRequest()
    request.groups.add(group_id="a")
    for _ in range(4):
        request.groups[0].samples.add()
    check = wire_bounds(reward_pb2.ScoreRequest.DESCRIPTOR, {"groups.samples": 3})
    assert check(request.SerializeToString()) is None  # (left to check_bounds: the group is 13 bytes)
    request.groups[0].group_id = "a" * 2000
    assert check(request.SerializeToString()) == "groups[0].samples has more than 3 elements, over the limit of 3"


def test_the_walk_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoding, "MAX_WALK_TAGS", 1000)
    raw = b"\x0a\x00" * 2000  # request_id 2000 times: no element, but more wire fields than the walk reads
    reason = wire_bounds(rollout_pb2.GenerateRequest.DESCRIPTOR, {"prompt_parts": 64})(raw)
    assert reason is not None and "more than 1000 wire fields" in reason


# -- properties ---------------------------------------------------------------------------------------------

_INTS = {
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=False),
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=False),
    FieldDescriptor.TYPE_STRING: st.text("ab\u00e9\u4e2d", max_size=6),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=6),
}


def _scalar(draw: Any, f: FieldDescriptor) -> Any:
    if f.type == FieldDescriptor.TYPE_ENUM:
        return draw(st.sampled_from([v.number for v in f.enum_type.values]))
    return draw(_INTS[f.type])


def _fill(draw: Any, msg: Message, depth: int) -> None:
    d = msg.DESCRIPTOR
    if d.full_name in ("google.protobuf.Duration", "google.protobuf.Timestamp"):
        msg.seconds = draw(st.integers(0, 10**6))  # type: ignore[attr-defined]
        return
    for f in d.fields:
        if not draw(st.booleans()):
            continue
        value = getattr(msg, f.name)
        if f.is_repeated and f.message_type is not None and f.message_type.GetOptions().map_entry:
            k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            for _ in range(draw(st.integers(0, 5))):
                key = _scalar(draw, k)
                if v.message_type is None:
                    value[key] = _scalar(draw, v)
                elif depth < 3:
                    _fill(draw, value[key], depth + 1)
        elif f.is_repeated:
            for _ in range(draw(st.integers(0, 5))):
                if f.message_type is None:
                    value.append(_scalar(draw, f))
                elif depth < 3:
                    _fill(draw, value.add(), depth + 1)
        elif f.message_type is not None:
            if depth < 3:
                _fill(draw, value, depth + 1)
                if not value.ListFields():
                    value.SetInParent()
        else:
            setattr(msg, f.name, _scalar(draw, f))


@st.composite
def _requests(draw: Any) -> tuple[Any, bytes]:
    _, descriptor = draw(st.sampled_from(REQUESTS))
    cls: Any = message_factory.GetMessageClass(descriptor)
    msg = cls()
    _fill(draw, msg, 0)
    raw = msg.SerializeToString()
    if draw(st.booleans()):  # a second message merged in: lists concatenate, map keys and oneofs replace
        other = cls()
        _fill(draw, other, 0)
        raw += other.SerializeToString()
    return cls, raw


def _mutated(draw: Any, raw: bytes) -> bytes:
    for _ in range(draw(st.integers(1, 4))):
        if not raw:
            break
        i = draw(st.integers(0, len(raw) - 1))
        j = draw(st.integers(i, min(len(raw), i + 8)))
        op = draw(st.sampled_from(["flip", "cut", "repeat", "insert"]))
        if op == "flip":
            raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1 :]
        elif op == "cut":
            raw = raw[:i] + raw[j:]
        elif op == "repeat":
            raw = raw[:j] + raw[i:j] * draw(st.integers(1, 6)) + raw[j:]
        else:
            raw = raw[:i] + draw(st.binary(max_size=4)) + raw[i:]
    return raw


_PATH = re.compile(r"^(.*?) (has|is) ")


def _named(msg: Message, path: str) -> Any:
    """The value at ``a.b[2].c`` in ``msg``."""
    value: Any = msg
    for part in path.split("."):
        name, _, index = part.partition("[")
        value = getattr(value, name)
        if index:
            value = value[int(index[:-1])]
    return value


def _assert_walk_within_check_bounds(cls: Any, raw: bytes, limits: dict[str, int], chars: int, items: int) -> None:
    reason = wire_bounds(cls.DESCRIPTOR, limits, chars, items)(raw)
    if reason is None:
        return
    try:
        msg = cls.FromString(raw)
    except Exception:  # noqa: BLE001 - refused by the full decode as well
        return
    with pytest.raises(ValueError):
        check_bounds(msg, limits, max_string=chars, max_items=items)
    path = _PATH.match(reason)
    assert path is not None, reason
    named = _named(msg, path.group(1))
    key = re.sub(r"\[\d+\]", "", path.group(1))
    bound = limits.get(key + ("[]" if path.group(2) == "is" else ""), chars if path.group(2) == "is" else items)
    assert len(named) > bound, (reason, len(named))
    if at_least := re.search(r" has at least (\d+) elements", reason):  # (a packed list: its elements so far)
        assert bound < int(at_least.group(1)) <= len(named)


_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


@_SETTINGS
@given(_requests(), st.integers(0, 4), st.integers(0, 8))
def test_valid_requests_are_refused_only_when_check_bounds_refuses(
    request_raw: tuple[Any, bytes], items: int, chars: int
) -> None:
    cls, raw = request_raw
    _assert_walk_within_check_bounds(cls, raw, {}, chars, items)
    msg = cls.FromString(raw)
    try:
        check_bounds(msg, max_string=chars, max_items=items)
    except ValueError as e:
        refused = str(e)
    else:
        assert wire_bounds(cls.DESCRIPTOR, {}, chars, items)(raw) is None
        return
    reason = wire_bounds(cls.DESCRIPTOR, {}, chars, items)(raw)
    if reason is not None and refused.startswith(reason.partition(" has ")[0] + " has "):
        assert "over the limit" in reason


@_SETTINGS
@given(st.data(), _requests(), st.integers(0, 4), st.integers(0, 8))
def test_mutated_requests_are_refused_only_when_decoding_or_check_bounds_refuses(
    data: st.DataObject, request_raw: tuple[Any, bytes], items: int, chars: int
) -> None:
    cls, raw = request_raw
    _assert_walk_within_check_bounds(cls, _mutated(data.draw, raw), {}, chars, items)


def test_the_services_limits_are_respected() -> None:
    """With a service's own limits (looser than the generic ones too), a request within them passes."""
    request = queue_pb2.PutRequest(ticket_id="t" * 4096)
    check = wire_bounds(queue_pb2.PutRequest.DESCRIPTOR, {"ticket_id": 4096})
    assert check(request.SerializeToString()) is None


def _first_packed_varint_list() -> FieldDescriptor:
    for _, d in REQUESTS:
        for f in _all_fields(d, set()):
            if f.is_repeated and f.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64):
                return f
    raise AssertionError("no packed varint list in the requests")


def _first_string_map() -> FieldDescriptor:
    for _, d in REQUESTS:
        for f in _all_fields(d, set()):
            mt = f.message_type
            is_map = f.is_repeated and mt is not None and mt.GetOptions().map_entry
            if is_map and mt.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING:
                return f
    raise AssertionError("no map in the requests")


def _all_fields(d: Any, seen: set[str]) -> list[FieldDescriptor]:
    if d.full_name in seen:
        return []
    seen.add(d.full_name)
    out = []
    for f in d.fields:
        out.append(f)
        if f.message_type is not None:
            out.extend(_all_fields(f.message_type, seen))
    return out


@given(
    parts=st.lists(st.dictionaries(st.text(max_size=8), st.text(max_size=40), max_size=4), max_size=5),
    functions=st.lists(st.text(max_size=20), max_size=3),
)
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_field_wire_bytes_is_the_sum_of_a_fields_parts_as_sent(
    parts: list[dict[str, str]], functions: list[str]
) -> None:
    """A message field sent in parts (merged by the decode) is measured by its parts' payloads; other fields,
    before, between and after them, are skipped."""
    raw, expected = b"", 0
    for i, part in enumerate(parts):
        config = reward_pb2.ScoreRequest()
        config.config.update(part)
        piece = config.SerializeToString()
        expected += len(config.config.SerializeToString()) if part else 0
        raw += (
            piece
            + reward_pb2.ScoreRequest(reward_fn=functions[i % len(functions)] if functions else "").SerializeToString()
        )
    raw += b"\x5b\x08\x01\x5c"  # an unknown group (field 11) with a varint inside
    assert decoding.field_wire_bytes(raw, 3) == expected
    merged = reward_pb2.ScoreRequest.FromString(raw)
    assert merged.config.ByteSize() <= expected  # (here: parts of distinct or repeated keys)


def test_field_wire_bytes_leaves_what_is_not_wire_format_to_the_decode() -> None:
    for raw in (b"\x1a\x05ab", b"\x1a", b"\x0f", b"\x5b\x08\x01", b"\x00\x00"):
        assert decoding.field_wire_bytes(raw, 3) is None, raw
