"""The wire fast paths agree with the full decode, and fall back to it whenever they cannot be exact."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2
from tauflow.core.protobuf import varint
from tauflow.queue import model
from tauflow.queue.adapters import convert, wire

LIMIT = 1 << 24


def _varint(n: int) -> bytes:
    return varint(n)


samples = st.builds(
    lambda n, prompt, versions, lp, masked, bv, score, sid: dict(
        n=n, prompt=prompt, versions=versions, lp=lp, masked=masked, bv=bv, score=score, sid=sid
    ),
    n=st.integers(1, 40),
    prompt=st.lists(st.integers(-5, 200_000), min_size=0, max_size=5),
    versions=st.one_of(st.none(), st.integers(0, 300)),
    lp=st.one_of(st.none(), st.sampled_from([-0.5, 0.0, 0.5, math.nan, -math.inf])),
    masked=st.booleans(),
    bv=st.integers(0, 300),
    score=st.sampled_from([0.0, 1.0, math.nan]),
    sid=st.sampled_from(["0", "1", "2"]),
)


def _group(specs: list[dict], group_id: str) -> common_pb2.Group:
    g = common_pb2.Group(group_id=group_id)
    for spec in specs:
        s = g.samples.add(sample_id=spec["sid"], prompt_token_ids=spec["prompt"], behaviour_version=spec["bv"])
        s.completion_token_ids.extend(range(spec["n"]))
        if spec["versions"] is not None:
            s.token_versions.extend([spec["versions"] + (i % 3) for i in range(spec["n"])])
        if spec["lp"] is not None:
            s.behaviour_logprobs.extend([spec["lp"]] * spec["n"])
        if spec["masked"]:
            s.loss_mask.extend([i % 2 == 0 for i in range(spec["n"])])
        s.reward.score = spec["score"]
    return g


@settings(max_examples=300, deadline=None)
@given(st.lists(samples, min_size=0, max_size=4), st.sampled_from(["g", ""]))
def test_fast_path_agrees_with_full_decode(specs, group_id) -> None:
    g = _group(specs, group_id)
    raw = g.SerializeToString()
    try:
        expected = convert.group_to_record(g, LIMIT)
    except convert.InvalidGroup as e:
        fast = wire.group_record_fast(raw, LIMIT)  # the fast path reads only the token arrays: it accepts
        if fast is not None:  # a group whose arrays are valid, and check_structure refuses the rest
            with pytest.raises(convert.InvalidGroup):
                convert.check_structure(g)
        with pytest.raises(convert.InvalidGroup) as err:
            wire.group_record(raw, LIMIT)
        assert str(err.value) == str(e)
        return
    got = wire.group_record(raw, LIMIT)
    assert (got.group_id, got.behaviour_version, got.n_tokens) == (
        expected.group_id,
        expected.behaviour_version,
        expected.n_tokens,
    )
    assert got.payload == raw  # stored as received


def test_unpacked_repeated_field_falls_back_to_the_full_decode() -> None:
    sample = common_pb2.Sample(
        sample_id="0", prompt_token_ids=[1], token_versions=[7, 7, 7], behaviour_logprobs=[-1.0] * 3
    ).SerializeToString()
    sample += b"".join(_varint(3 << 3 | 0) + _varint(t) for t in (11, 12, 13))  # unpacked completion ids
    raw = _varint(1 << 3 | 2) + _varint(1) + b"g" + _varint(3 << 3 | 2) + _varint(len(sample)) + sample
    assert list(common_pb2.Group.FromString(raw).samples[0].completion_token_ids) == [11, 12, 13]
    assert wire.group_record_fast(raw, LIMIT) is None
    record = wire.group_record(raw, LIMIT)
    assert (record.n_tokens, record.behaviour_version) == (4, 7)


def test_split_packed_field_falls_back_to_the_full_decode() -> None:
    # A packed field may arrive in two chunks; the view keeps only the last, so it must not be trusted.
    first = common_pb2.Sample(
        sample_id="0", prompt_token_ids=[1], completion_token_ids=[1, 2], behaviour_logprobs=[-1.0] * 4
    ).SerializeToString()
    second = common_pb2.Sample(completion_token_ids=[3, 4]).SerializeToString()
    sample = first + second
    raw = common_pb2.Group(group_id="g").SerializeToString() + _varint(3 << 3 | 2) + _varint(len(sample)) + sample
    assert wire.group_record_fast(raw, LIMIT) is None
    assert wire.group_record(raw, LIMIT).n_tokens == 5


def test_garbage_bytes_are_invalid_argument() -> None:
    with pytest.raises(convert.InvalidGroup, match="does not decode"):
        wire.group_record(b"\xff\xff\xff", LIMIT)


def test_spliced_get_response_decodes_like_a_built_one() -> None:
    groups = [
        _group([dict(n=3, prompt=[1], versions=2, lp=-0.1, masked=True, bv=0, score=1.0, sid="0")], f"g{i}")
        for i in range(3)
    ]
    records = [wire.group_record(g.SerializeToString(), LIMIT) for g in groups]
    for i, r in enumerate(records):
        r.accepted_at = 1700000000.25 + i
    lease = model.Lease("lease-1", [r.group_id for r in records], 1700000100.5, "t", 4)
    result = model.GetResult(lease, [model.Delivery(r, 2, i) for i, r in enumerate(records)], evicted_stale=5)
    decoded = queue_pb2.GetResponse.FromString(wire.encode_get_response(result, trainer_version=4))
    assert decoded.lease.lease_id == "lease-1" and decoded.evicted_stale == 5 and decoded.trainer_version == 4
    assert not decoded.HasField("max_staleness")  # nothing says which tau: a result built without one
    result.max_staleness = -1
    stamped = queue_pb2.GetResponse.FromString(wire.encode_get_response(result, trainer_version=4))
    assert stamped.HasField("max_staleness") and stamped.max_staleness == -1
    assert [d.group for d in decoded.groups] == groups
    assert [d.redeliveries for d in decoded.groups] == [0, 1, 2]
    assert all(d.staleness == 2 and d.behaviour_version == 2 for d in decoded.groups)
    assert decoded.groups[1].accepted_at.ToNanoseconds() == int((1700000001.25) * 1e9)
    # Deliver's answer wraps the same pieces: its batch is that GetResponse
    delivered = queue_pb2.DeliverResponse.FromString(wire.delivery(wire.get_response_parts(result, 4)))
    assert delivered.batch == stamped


def test_get_response_overhead_stays_within_the_budget_get_counts() -> None:
    """Get budgets a batch as RESPONSE_HEAD_BYTES + per group (payload + DELIVERY_OVERHEAD_BYTES); with every
    varint at its longest, the encoded response must stay within that, or a capped batch could still fail
    to send."""
    # length prefixes of 1, 2 and 3 bytes
    payloads = [common_pb2.Group(group_id="g", prompt_id="p" * n).SerializeToString() for n in (5, 300, 70_000)]
    records = [
        model.GroupRecord(f"g{i}", p, 2**64 - 1, 1, accepted_at=253402300798.999) for i, p in enumerate(payloads)
    ]
    lease = model.Lease("f" * 32, [r.group_id for r in records], 253402300798.999, "consumer", 2**64 - 1)
    deliveries = [model.Delivery(r, 2**64 - 1, 2**32 - 1) for r in records]
    result = model.GetResult(lease, deliveries, evicted_stale=2**32 - 1, max_staleness=-1)  # -1: 10 varint bytes
    encoded = wire.encode_get_response(result, trainer_version=2**64 - 1)
    budget = wire.RESPONSE_HEAD_BYTES + sum(len(p) + wire.DELIVERY_OVERHEAD_BYTES for p in payloads)
    assert len(encoded) <= budget
    assert queue_pb2.GetResponse.FromString(encoded).groups[2].staleness == 2**64 - 1
    assert wire.deliverable_group_bytes(1 << 20) == (1 << 20) - wire.RESPONSE_HEAD_BYTES - wire.DELIVERY_OVERHEAD_BYTES


def _sample_bytes(completion_field: bytes, tokens: int = 2) -> bytes:
    head = common_pb2.Sample(
        sample_id="0", prompt_token_ids=[1], behaviour_logprobs=[-1.0] * tokens
    ).SerializeToString()
    return head + _varint(3 << 3 | 2) + _varint(len(completion_field)) + completion_field


def _group_of(sample: bytes) -> bytes:
    return common_pb2.Group(group_id="g").SerializeToString() + _varint(3 << 3 | 2) + _varint(len(sample)) + sample


@pytest.mark.parametrize(
    ("packed", "fast"),
    [
        (_varint(5) + _varint(2**28 - 1), True),  # 4-byte varints: the fast path reads them
        (_varint(5) + _varint(2**28), False),  # a 5-byte varint: the full decode decides
        (_varint(2**64 - 3), False),  # a negative int32 (10 bytes)
    ],
)
def test_fast_path_reads_only_short_varints(packed: bytes, fast: bool) -> None:
    raw = _group_of(_sample_bytes(packed))
    assert (wire.group_record_fast(raw, LIMIT) is not None) is fast
    full = common_pb2.Group.FromString(raw)
    try:
        expected = convert.group_to_record(full, LIMIT).n_tokens
    except convert.InvalidGroup as e:
        with pytest.raises(convert.InvalidGroup, match=re.escape(str(e)[:30])):
            wire.group_record(raw, LIMIT)
        return
    assert wire.group_record(raw, LIMIT).n_tokens == expected


def test_a_packed_field_cut_inside_a_varint_is_refused_as_the_full_decode_refuses_it() -> None:
    raw = _group_of(_sample_bytes(_varint(5) + b"\x80"))  # the last varint never ends
    assert wire.group_record_fast(raw, LIMIT) is None
    with pytest.raises(convert.InvalidGroup, match="does not decode"):
        wire.group_record(raw, LIMIT)


def test_a_string_that_is_not_utf8_is_refused_even_where_the_token_arrays_are_fine() -> None:
    sample = common_pb2.Sample(prompt_token_ids=[1], completion_token_ids=[2]).SerializeToString()
    sample += _varint(1 << 3 | 2) + _varint(2) + b"\xff\xfe"  # sample_id, not UTF-8
    raw = _group_of(sample)
    assert wire.group_record_fast(raw, LIMIT) is None
    with pytest.raises(convert.InvalidGroup, match="does not decode"):
        wire.group_record(raw, LIMIT)


def test_a_logprob_just_above_the_bound_in_float64_is_refused_by_both_paths() -> None:
    import numpy as np

    g = common_pb2.Group(group_id="g")
    g.samples.add(sample_id="0", prompt_token_ids=[1], completion_token_ids=[2], behaviour_logprobs=[1e-3])
    assert float(np.float32(1e-3)) > convert.MAX_LOGPROB  # what the wire carries is float32's 1e-3
    raw = g.SerializeToString()
    assert wire.group_record_fast(raw, LIMIT) is None
    with pytest.raises(convert.InvalidGroup, match="behaviour_logprobs"):
        wire.group_record(raw, LIMIT)
