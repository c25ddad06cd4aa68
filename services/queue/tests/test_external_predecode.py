"""Both ports count a group's samples on its wire bytes before they decode it: the external port before it
renames the group, the internal one (Put, PutStream, PutBatch) before it validates it. A group of millions
of empty samples is refused without being decoded (hostile5, item 1c)."""

from __future__ import annotations

import time

import pytest

from tauflow.api.common.v1 import common_pb2
from tauflow.queue.adapters import wire
from tauflow.queue.adapters.convert import MAX_SAMPLES, InvalidGroup
from tauflow.queue.adapters.external import with_client_identity


def test_a_group_of_millions_of_empty_samples_is_refused_before_it_is_decoded() -> None:
    raw = b"\x0a\x01g" + b"\x1a\x00" * 5_000_000  # group_id "g", then 5 M empty samples (field 3)
    assert common_pb2.Group.DESCRIPTOR.fields_by_name["samples"].number == 3
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"^group.samples has more than {MAX_SAMPLES} elements"):
        with_client_identity(raw, "agent-a")
    assert time.perf_counter() - start < 0.05  # (decoding and re-encoding it took ~1 s)


def test_a_group_at_the_bound_is_renamed_as_before() -> None:
    group = common_pb2.Group(group_id="g")
    for i in range(MAX_SAMPLES):
        group.samples.add(sample_id=f"s{i}")
    renamed = common_pb2.Group.FromString(with_client_identity(group.SerializeToString(), "agent-a"))
    assert (renamed.group_id, renamed.producer_id, len(renamed.samples)) == ("agent-a/g", "agent-a", MAX_SAMPLES)


def test_the_internal_port_refuses_a_group_of_millions_of_samples_before_it_is_decoded() -> None:
    raw = b"\x0a\x01g" + b"\x1a\x00" * 5_000_000
    start = time.perf_counter()
    with pytest.raises(InvalidGroup, match=f"^group.samples has more than {MAX_SAMPLES} elements"):
        wire.group_record(raw, 64 << 20)
    assert time.perf_counter() - start < 0.05  # (the full decode: ~1 s and ~1 GB)


def test_a_group_at_the_bound_is_still_validated_in_full() -> None:
    group = common_pb2.Group(group_id="g")
    for i in range(MAX_SAMPLES):
        group.samples.add(sample_id=f"s{i}")
    # (not counted out on the wire: the full checks name what is missing, the samples' tokens here)
    with pytest.raises(InvalidGroup, match="prompt_token_ids|completion_token_ids"):
        wire.group_record(group.SerializeToString(), 64 << 20)
