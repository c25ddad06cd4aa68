"""The colocated hand-off (tauflow.weightsync.ipc) on the CPU, where the same code shares memory by file:
another process opens a staged version without a copy and gets it bit for bit, the checksum catches a torn
or overwritten buffer, the two buffers alternate, and a forged URI rebuilds nothing but tensors."""

from __future__ import annotations

import base64
import dataclasses
import json
import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tauflow.weightsync.checksum import _device_word_sums, new_hasher, tensor_sum64x2
from tauflow.weightsync.errors import ChecksumMismatch, StagingError
from tauflow.weightsync.ipc import DeviceStager, SharedReader, open_shared, read_shared, share, shared_request
from tauflow.weightsync.manifest import validate
from tauflow.weightsync.transfer import ReceiveError
from tauflow.weightsync.wire import shared_request_from_proto, shared_request_to_proto


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(17, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(3, generator=g),  # 12 bytes: padding follows
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def reference_sum64x2(data: bytes) -> str:
    data += bytes(-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    mask = (1 << 64) - 1
    return f"{sum(words) & mask:016x}{sum((i + 1) * w for i, w in enumerate(words)) & mask:016x}"


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4099])
def test_sum64x2_is_its_definition_streamed_in_any_pieces_or_on_a_tensor(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    hasher = new_hasher("sum64x2")
    for i in range(0, size, 5):  # pieces that split words
        hasher.update(data[i : i + 5])
    as_tensor = tensor_sum64x2(torch.tensor(list(data), dtype=torch.uint8))
    # the GPU's way (torch int64 ops, in chunks), run here on the CPU
    words = torch.tensor(list(data + bytes(-size % 8)), dtype=torch.uint8).view(torch.int64)
    on_device = "{:016x}{:016x}".format(*_device_word_sums(words, chunk_words=3))
    assert hasher.hexdigest() == as_tensor == on_device == reference_sum64x2(data)


def test_sum64x2_over_several_chunks_is_its_definition() -> None:
    # more than one of the 2^20-word chunks the CPU path sums at a time, streamed in pieces that split them
    words = np.random.default_rng(1).integers(0, 2**63, (1 << 20) + 777, dtype=np.uint64)
    index = np.arange(1, len(words) + 1, dtype=np.uint64)
    data = words.tobytes() + b"\x05"  # and a last, partial word
    last = 5
    mask = (1 << 64) - 1
    s1 = (int(words.sum(dtype=np.uint64)) + last) & mask
    s2 = (int((words * index).sum(dtype=np.uint64)) + (len(words) + 1) * last) & mask
    expected = f"{s1:016x}{s2:016x}"
    hasher = new_hasher("sum64x2")
    for i in range(0, len(data), 3_000_001):
        hasher.update(data[i : i + 3_000_001])
    assert hasher.hexdigest() == tensor_sum64x2(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == expected


def test_swapping_two_words_changes_the_checksum() -> None:
    a, b = (7).to_bytes(8, "little"), (9).to_bytes(8, "little")
    assert reference_sum64x2(a + b) != reference_sum64x2(b + a)


def _open_in_child(uri: str, manifest: bytes, out: str) -> None:
    tensors = read_shared(uri, pickle.loads(manifest))
    torch.save({k: v.clone() for k, v in tensors.items()}, out)


def opened_in_a_child(target: Any, uri: str, manifest: Any, out: Path) -> dict[str, torch.Tensor]:
    """What a spawned process (not our child by fork: nothing inherited) read from ``uri``."""
    child = multiprocessing.get_context("spawn").Process(target=target, args=(uri, pickle.dumps(manifest), str(out)))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    return torch.load(out)


def test_another_process_opens_the_staged_version_bit_for_bit(tmp_path: Path) -> None:
    stager = DeviceStager("cpu")
    weights = state(1)
    manifest, uri = stager.stage(weights, 1)
    validate(manifest)
    seen = opened_in_a_child(_open_in_child, uri, manifest, tmp_path / "seen.pt")
    assert seen.keys() == weights.keys()
    for name, t in weights.items():
        assert seen[name].dtype == t.dtype and torch.equal(seen[name], t), name


def test_views_alias_the_buffer_and_two_buffers_alternate() -> None:
    stager = DeviceStager("cpu")
    m1, uri1 = stager.stage(state(1), 1)
    m2, uri2 = stager.stage(state(2), 2)
    m3, uri3 = stager.stage(state(3), 3)
    assert uri1 == uri3 != uri2  # version 3 overwrote version 1's buffer, never version 2's
    assert torch.equal(read_shared(uri2, m2)["step"], torch.tensor([2]))
    with pytest.raises(ChecksumMismatch, match="version 1"):
        read_shared(uri1, m1)  # overwritten by version 3: refused, not mixed
    assert torch.equal(read_shared(uri3, m3)["step"], torch.tensor([3]))


def test_a_uri_opens_any_number_of_times_and_its_file_goes_with_the_stagers_buffer() -> None:
    # torch counts a shared-memory file's references in the file, and its pickle of a tensor was good for one
    # unpickling: a third open used to find the file gone (the colocated run stalled at its fifth version).
    import gc
    import subprocess
    import sys

    buffer = torch.zeros(1000, dtype=torch.uint8)
    uri = share(buffer)
    opener = f"from tauflow.weightsync.ipc import open_shared; print(open_shared({uri!r}).numel())"
    for _ in range(3):
        opened = subprocess.run([sys.executable, "-c", opener], capture_output=True, text=True, timeout=120)
        assert opened.stdout.strip() == "1000", opened.stderr[-500:]
    for _ in range(3):
        assert open_shared(uri).numel() == 1000  # in this process too

    path = Path("/dev/shm" + _fields_of(uri)["name"])
    assert path.exists()
    del buffer
    gc.collect()
    assert not path.exists()  # nothing left behind in /dev/shm


def test_a_torn_buffer_is_refused() -> None:
    stager = DeviceStager("cpu")
    manifest, uri = stager.stage(state(4), 4)
    open_shared(uri)[3] ^= 0xFF  # one byte changed after staging
    with pytest.raises(ChecksumMismatch):
        read_shared(uri, manifest)
    assert read_shared(uri, manifest, verify=False)  # what verify=False would have let through


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("true",))


@pytest.mark.parametrize(
    "uri",
    [
        "ipc://" + base64.b64encode(pickle.dumps(_Evil())).decode(),
        "ipc://" + base64.b64encode(pickle.dumps({"a": 1})).decode(),
        "ipc://not base64!",
        "shm://elsewhere",
        "ipc://" + "A" * 20000,
    ],
    ids=["code", "not-a-tensor", "not-base64", "other-scheme", "too-long"],
)
def test_a_forged_uri_rebuilds_nothing_but_tensors(uri: str) -> None:
    with pytest.raises(StagingError):
        open_shared(uri)


def _raw_pickle(*ops: bytes) -> str:
    return "ipc://" + base64.b64encode(b"\x80\x04" + b"".join(ops) + b".").decode()


def _name(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


def _uri(fields: dict[str, Any]) -> str:
    return "ipc://" + base64.b64encode(json.dumps(fields).encode()).decode()


def _fields_of(uri: str) -> dict[str, Any]:
    return json.loads(base64.b64decode(uri[len("ipc://") :]))


def test_a_uri_is_plain_data_a_pickle_is_refused_unread(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    for uri in (
        _raw_pickle(_name("torch"), _name("os.system"), b"\x93", _name(f"touch {pwned}"), b"\x85R"),
        "ipc://" + base64.b64encode(pickle.dumps(torch.zeros(4, dtype=torch.uint8))).decode(),
    ):
        with pytest.raises(StagingError, match="base64 of a JSON object"):
            open_shared(uri)
    assert not pwned.exists()


def test_a_forged_uri_is_refused_by_field_and_leaves_the_shared_file_as_it_was() -> None:
    buffer = torch.zeros(1000, dtype=torch.uint8)
    uri = share(buffer)
    real = _fields_of(uri)
    path = Path("/dev/shm" + real["name"])
    on_disk = path.stat().st_size
    forged = {
        "no shared-memory file": {**real, "size": 1001},  # torch would grow the file to a larger size
        "manager and name": {**real, "manager": "/run/docker.sock"},
        "size must be": {**real, "size": 0},
        "kind cpu": {**real, "extra": 1},
        "size must be a int": {**real, "size": "1000"},
        "ref_name and ref_offset": {
            "kind": "cuda", "device": 0, "handle": base64.b64encode(bytes(65)).decode(), "size": 64, "offset": 0,
            "ref_name": real["name"], "ref_offset": 10000, "event": "", "sync": True,
        },
        "handle must be 1 to 1024 bytes": {
            "kind": "cuda", "device": 0, "handle": base64.b64encode(bytes(2000)).decode(), "size": 64, "offset": 0,
            "ref_name": real["name"], "ref_offset": 0, "event": "", "sync": True,
        },
        "event must be 64 bytes": {
            "kind": "cuda", "device": 0, "handle": base64.b64encode(bytes(65)).decode(), "size": 64, "offset": 0,
            "ref_name": real["name"], "ref_offset": 0, "event": base64.b64encode(bytes(8)).decode(), "sync": True,
        },
    }  # fmt: skip
    for field, fields in forged.items():
        for _ in range(3):  # refused before torch's opener runs: no reference count of the file is touched
            with pytest.raises(StagingError, match=field):
                open_shared(_uri(fields))
    assert path.stat().st_size == on_disk
    buffer[7] = 9
    assert int(open_shared(uri)[7]) == 9  # the trainer's buffer, unharmed
    # a CUDA URI of the right shape reaches torch's opener (which needs CUDA here)
    cuda = {**forged["ref_name and ref_offset"], "ref_offset": 5}
    with pytest.raises(StagingError, match="cannot open the shared buffer"):
        open_shared(_uri(cuda))


def test_a_buffer_too_small_for_the_manifest_is_refused() -> None:
    manifest, _ = DeviceStager("cpu").stage(state(5), 5)
    small = torch.zeros(8, dtype=torch.uint8)  # (kept alive: a shared buffer lives as long as its owner's tensor)
    with pytest.raises(StagingError, match="cannot hold"):
        read_shared(share(small), manifest)


def test_the_reader_loads_a_version_from_its_own_checked_copy() -> None:
    stager, reader = DeviceStager("cpu", bucket_bytes=256), SharedReader()
    weights = state(7)
    manifest, uri = stager.stage(weights, 7)
    assert len(manifest.buckets) > 1  # several buckets read as one: their layout is one bucket's
    request = shared_request(manifest, uri, membership_epoch=3, flush_cache=True)
    assert shared_request_from_proto(shared_request_to_proto(request)) == request
    version = reader.read(request)
    assert (version.policy_version, version.membership_epoch, version.flush_cache) == (7, 3, True)
    assert version.loaded_checksum == version.manifest_checksum == manifest.checksum
    assert version.nbytes == sum(t.numel() * t.element_size() for t in weights.values())
    for name, t in weights.items():
        assert version.tensors[name].dtype == t.dtype and torch.equal(version.tensors[name], t), name
    # the engine gets views of the reader's copy: the trainer overwriting its buffer changes nothing there
    open_shared(uri).zero_()
    assert torch.equal(version.tensors["step"], torch.tensor([7]))


def test_the_reader_refuses_an_overwritten_buffer_and_bad_requests_by_field() -> None:
    stager, reader = DeviceStager("cpu"), SharedReader(label="rollout-0")
    m1, uri1 = stager.stage(state(1), 1)
    stager.stage(state(2), 2)
    stager.stage(state(3), 3)  # into version 1's buffer
    with pytest.raises(ChecksumMismatch, match="version 1 read by rollout-0"):
        reader.read(shared_request(m1, uri1))
    good = shared_request(*stager.stage(state(4), 4))
    small = torch.zeros(8, dtype=torch.uint8)
    bad = {
        "names, dtypes and shapes": dataclasses.replace(good, names=good.names[:-1]),
        "checksum_algorithm": dataclasses.replace(good, checksum_algorithm="xxh3-64"),
        "manifest_checksum": dataclasses.replace(good, manifest_checksum=""),
        r"shapes\[0\] must have at most 8 dimensions": dataclasses.replace(good, shapes=[[-17, 8], *good.shapes[1:]]),
        r"shapes\[1\] must have at most 8 dimensions": dataclasses.replace(
            good, shapes=[good.shapes[0], [1] * 80000, *good.shapes[2:]]
        ),
        "names must be distinct": dataclasses.replace(good, names=[good.names[0]] * len(good.names)),
        "dtypes and shapes": dataclasses.replace(good, dtypes=["complex1024", *good.dtypes[1:]]),
        "staging_uri": dataclasses.replace(good, staging_uri="shm://elsewhere"),
        "staging_uri: the shared buffer does not hold": dataclasses.replace(good, staging_uri=share(small)),
    }
    for field, request in bad.items():
        with pytest.raises(ReceiveError, match=field) as refused:
            reader.read(request)
        assert refused.value.kind == "invalid"
    with pytest.raises(ReceiveError, match="more than the 64 this engine takes"):
        reader.read(good, max_bytes=64)
    assert torch.equal(reader.read(good).tensors["step"], torch.tensor([4]))
    assert reader._buffer is not None
    with pytest.raises(ChecksumMismatch):
        reader.read(dataclasses.replace(good, manifest_checksum="0" * 32))
    assert reader._buffer is None  # a refused read keeps no buffer


def _open_on_cuda(uri: str, manifest: bytes, out: str) -> None:
    tensors = read_shared(uri, pickle.loads(manifest))
    assert all(t.is_cuda for t in tensors.values())  # opened where they are: no copy through the host
    torch.save({k: v.cpu() for k, v in tensors.items()}, out)


@pytest.mark.gpu
def test_a_cuda_version_is_opened_by_another_process_through_a_cuda_ipc_handle(tmp_path: Path) -> None:
    stager = DeviceStager("cuda")
    weights = {k: v.cuda() for k, v in state(6).items()}
    manifest, uri = stager.stage(weights, 6)
    seen = opened_in_a_child(_open_on_cuda, uri, manifest, tmp_path / "seen.pt")
    for name, t in weights.items():
        assert torch.equal(seen[name], t.cpu()), name
