"""Weights handed between processes on one machine without a copy: the colocated hand-off (docs/gpu.md).

A trainer and an engine that share a GPU need not send the bytes anywhere: ``DeviceStager.stage`` packs a
state dict into a flat buffer on the trainer's device, in the same canonical layout as the host staging
area (``manifest.plan_buckets``), with a ``sum64x2`` checksum computed on that device, and names the buffer
by an ``ipc://`` URI: a CUDA IPC handle on a GPU, a shared-memory file on a CPU (the same code, so it is
tested on CPUs). ``read_shared`` opens it in the engine's process, verifies the checksum where the bytes are,
and gives each tensor as a view, which the engine copies into its own weights (device to device).

The stager alternates two buffers: the engine reads version N from one while N+1 is written to the other;
version N+2 overwrites N's, and a reader still copying N then sees a checksum mismatch, never a silent mix.

An ``ipc://`` URI is plain data (JSON: the shared-memory file, or the CUDA IPC handles, as torch's own sharing
names them), never a pickle: a forged one can only name memory, and its fields are checked before torch's own
opener runs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tauflow.weightsync.checksum import tensor_sum64x2
from tauflow.weightsync.errors import ChecksumMismatch, ManifestError, StagingError
from tauflow.weightsync.manifest import (
    DEFAULT_BUCKET_BYTES,
    BucketSpec,
    Manifest,
    canonical_layout,
    check_shape,
    dtype_from_name,
    dtype_name,
    nbytes_of,
    plan_buckets,
    shown,
)
from tauflow.weightsync.transfer import ReceivedVersion, ReceiveError

SCHEME = "ipc://"
MAX_TENSORS = 1 << 17  # tensors in one shared version (a large model has thousands)
CHECKSUM = "sum64x2"
MAX_URI_CHARS = 16384  # a URI's JSON names a CUDA IPC handle in a few hundred bytes


_MAX_SHARED_BYTES = 1 << 42  # 4 TiB: more than any buffer a trainer stages
_SHM_HEADER_BYTES = 64  # torch's shared-memory file: its reference count, then the data
_CUDA_REF_COUNTERS = 10000  # the counters in one of torch's CUDA IPC reference-counter files
_MANAGER = re.compile(r"/[^\x00]{0,4000}/torch-shm-dir-[A-Za-z0-9_]{1,64}/manager\.sock")
_SHM_NAME = re.compile(r"/torch_[0-9]{1,12}_[0-9]{1,12}_[0-9]{1,12}")
_CPU_FIELDS: dict[str, type] = {"kind": str, "manager": str, "name": str, "size": int}
_CUDA_FIELDS: dict[str, type] = {
    "kind": str,
    "device": int,
    "handle": str,
    "size": int,
    "offset": int,
    "ref_name": str,
    "ref_offset": int,
    "event": str,
    "sync": bool,
}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def share(buffer: torch.Tensor) -> str:
    """An ``ipc://`` URI another process on this machine opens as the same memory (``open_shared``): the base64
    of a JSON object naming a flat uint8 buffer the way torch's own sharing does (``kind`` cpu: the shared-memory
    file and its manager's socket; ``kind`` cuda: the CUDA IPC handles). Plain data, no pickle: a forged URI can
    only name memory. The caller keeps ``buffer`` alive while others may open it."""
    from torch.multiprocessing.reductions import StorageWeakRef, shared_cache

    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.storage_offset() != 0:
        raise StagingError("share takes a flat uint8 tensor that starts its storage")
    storage = buffer.untyped_storage()
    fields: dict[str, Any]
    if buffer.device.type == "cpu":
        import torch.multiprocessing as mp

        # shared memory by file name: a process that is not our child can open it (a file descriptor would
        # need our resource sharer's key); torch counts the file's references in the file
        mp.set_sharing_strategy("file_system")
        buffer.share_memory_()
        manager, name, size = storage._share_filename_cpu_()
        shared_cache[name] = StorageWeakRef(storage)  # (an open in this process finds it, as torch's does)
        fields = {"kind": "cpu", "manager": manager.decode(), "name": name.decode(), "size": int(size)}
    else:
        device, handle, size, offset, ref_name, ref_offset, event, sync = storage._share_cuda_()
        shared_cache[handle] = StorageWeakRef(storage)
        fields = {
            "kind": "cuda",
            "device": int(device),
            "handle": _b64(handle),
            "size": int(size),
            "offset": int(offset),
            "ref_name": ref_name.decode(),
            "ref_offset": int(ref_offset),
            "event": _b64(event) if event else "",
            "sync": bool(sync),
        }
    return SCHEME + _b64(json.dumps(fields).encode())


def _shm_file_bytes(name: str) -> int:
    """The size of the shared-memory file ``name``; -1 when there is none."""
    try:
        return os.stat("/dev/shm" + name).st_size
    except OSError:
        return -1


def _fields(uri: str) -> dict[str, Any]:
    """The JSON object of an ``ipc://`` URI, checked field by field (StagingError names the first wrong one)."""
    if not uri.startswith(SCHEME) or len(uri) > MAX_URI_CHARS:
        raise StagingError(f"not an {SCHEME} URI of at most {MAX_URI_CHARS} characters")
    try:
        fields = json.loads(base64.b64decode(uri[len(SCHEME) :], validate=True))
    except (ValueError, UnicodeDecodeError):
        raise StagingError(f"an {SCHEME} URI is the base64 of a JSON object (share)") from None
    schema = _CPU_FIELDS if isinstance(fields, dict) and fields.get("kind") == "cpu" else _CUDA_FIELDS
    if not isinstance(fields, dict) or fields.get("kind") not in ("cpu", "cuda") or set(fields) != set(schema):
        raise StagingError(f"an {SCHEME} URI names kind cpu ({sorted(_CPU_FIELDS)}) or cuda ({sorted(_CUDA_FIELDS)})")
    for key, kind in schema.items():
        value = fields[key]
        if type(value) is not kind or (isinstance(value, str) and len(value) > 4096):
            raise StagingError(f"{key} must be a {kind.__name__}")
    if not 0 < fields["size"] <= _MAX_SHARED_BYTES:
        raise StagingError(f"size must be in 1..{_MAX_SHARED_BYTES}")
    return fields


def _decode(value: str, what: str, length: int | None = None) -> bytes:
    """``value``'s base64, of ``length`` bytes when given."""
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raise StagingError(f"{what} must be base64") from None
    if length is not None and len(raw) != length:
        raise StagingError(f"{what} must be {length} bytes")
    return raw


def open_shared(uri: str) -> torch.Tensor:
    """The flat uint8 tensor an ``ipc://`` URI names (``share``), mapped, not copied; StagingError for anything
    else. Only torch's own openers run, with arguments checked first: a size beyond the shared file (torch would
    grow it), a reference counter outside its file, and any other field out of its range are refused."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_storage_filename

    f = _fields(uri)
    size = f["size"]
    if f["kind"] == "cpu":
        if _MANAGER.fullmatch(f["manager"]) is None or _SHM_NAME.fullmatch(f["name"]) is None:
            raise StagingError("manager and name must be a torch shared-memory manager's socket and file")
        if size + _SHM_HEADER_BYTES > _shm_file_bytes(f["name"]):
            raise StagingError(f"no shared-memory file {f['name']} holding {size} bytes")
        try:
            storage = rebuild_storage_filename(
                torch.storage.UntypedStorage, f["manager"].encode(), f["name"].encode(), size
            )
        except Exception as e:  # noqa: BLE001 - whatever torch raises opening it, the URI named it
            raise StagingError(f"cannot open the shared buffer: {type(e).__name__}: {e}") from None
        # torch's opener gives back the reference its pickle would have taken (share takes none): take it
        # again, so that every open is neutral and the file goes with the owner's last reference
        storage._shared_incref()
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
    if not 0 <= f["device"] < 1024 or not 0 <= f["offset"] <= _MAX_SHARED_BYTES:
        raise StagingError("device and offset must be in range")
    if _SHM_NAME.fullmatch(f["ref_name"]) is None or not 0 <= f["ref_offset"] < _CUDA_REF_COUNTERS:
        raise StagingError(f"ref_name and ref_offset must name one of torch's {_CUDA_REF_COUNTERS} CUDA IPC counters")
    # torch's handle: a kind byte, then a cudaIpcMemHandle_t (64 bytes), or an expandable segment's handles
    handle = _decode(f["handle"], "handle")
    if not 1 <= len(handle) <= 1024:
        raise StagingError("handle must be 1 to 1024 bytes")
    event = _decode(f["event"], "event", 64) if f["event"] else None  # a cudaIpcEventHandle_t
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size([size]), (1,), 0, torch.storage.TypedStorage, torch.uint8, f["device"], handle,
            size, f["offset"], False, f["ref_name"].encode(), f["ref_offset"], event, f["sync"],
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001
        raise StagingError(f"cannot open the shared buffer: {type(e).__name__}: {e}") from None


class DeviceStager:
    """Trainer side of the colocated hand-off: state dicts staged in device memory, named by ``ipc://`` URIs."""

    def __init__(
        self, device: torch.device | str, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, model: str = ""
    ) -> None:
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.model = model
        self._layout: tuple[tuple[tuple[str, str, tuple[int, ...]], ...], tuple[BucketSpec, ...]] | None = None
        self._buffers: list[tuple[torch.Tensor, str]] = []  # two, alternating; each with its URI
        self._turn = 0

    def _buckets(self, state_dict: Mapping[str, torch.Tensor]) -> tuple[BucketSpec, ...]:
        key = tuple((name, dtype_name(t.dtype), tuple(t.shape)) for name, t in state_dict.items())
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, plan_buckets(key, self.bucket_bytes))
            self._buffers, self._turn = [], 0  # another layout: new buffers (zeroed, so the padding is zero)
        return self._layout[1]

    def stage(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> tuple[Manifest, str]:
        """Copies ``state_dict`` into the next buffer; its manifest (checksum ``sum64x2``) and ``ipc://`` URI."""
        buckets = self._buckets(state_dict)
        total = buckets[-1].offset_bytes + buckets[-1].size_bytes
        which, self._turn = self._turn % 2, self._turn + 1  # never the buffer of the version staged last
        if which == len(self._buffers):
            buffer = torch.zeros(total, dtype=torch.uint8, device=self.device)
            self._buffers.append((buffer, share(buffer)))
        buffer, uri = self._buffers[which]
        with torch.no_grad():
            for b in buckets:
                for spec in b.tensors:
                    start = b.offset_bytes + spec.offset_bytes
                    target = buffer[start : start + spec.size_bytes].view(dtype_from_name(spec.dtype))
                    target.view(spec.shape).copy_(state_dict[spec.name].detach())
        manifest = Manifest(
            policy_version=policy_version,
            buckets=buckets,
            total_bytes=total,
            checksum_algorithm=CHECKSUM,
            checksum=tensor_sum64x2(buffer[:total]),
            model=self.model,
            created_at=time.time(),
        )
        return manifest, uri


def read_shared(uri: str, manifest: Manifest, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Engine side: each tensor of ``manifest`` as a view of the shared buffer ``uri`` names, after checking
    the buffer's checksum on its own device (ChecksumMismatch: torn, overwritten or not this version). The
    views alias the trainer's memory: copy them before the trainer stages the version after next."""
    buffer = open_shared(uri)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < manifest.total_bytes:
        raise StagingError(f"the shared buffer cannot hold the {manifest.total_bytes} bytes of the manifest")
    if verify:
        if manifest.checksum_algorithm != CHECKSUM:
            raise StagingError(f"a shared buffer is checked with {CHECKSUM}, not {manifest.checksum_algorithm}")
        digest = tensor_sum64x2(buffer[: manifest.total_bytes])
        if digest != manifest.checksum:
            raise ChecksumMismatch(
                f"shared buffer of version {manifest.policy_version}", CHECKSUM, manifest.checksum, digest
            )
    out: dict[str, torch.Tensor] = {}
    for b, spec in manifest.tensors():
        start = b.offset_bytes + spec.offset_bytes
        out[spec.name] = buffer[start : start + spec.size_bytes].view(dtype_from_name(spec.dtype)).view(spec.shape)
    return out


# -- the rollout side: RolloutService.UpdateWeightsFromTensor ---------------------------------------


@dataclass(frozen=True)
class SharedRequest:
    """One version to load from a shared buffer (UpdateWeightsFromTensorRequest, as plain data). The tensors
    lie back to back in the canonical layout: a manifest's buckets follow each other without gaps and each
    is 64-byte aligned, so all of them together have the layout of one bucket of every tensor."""

    names: Sequence[str]
    dtypes: Sequence[str]
    shapes: Sequence[Sequence[int]]
    staging_uri: str
    policy_version: int
    manifest_checksum: str
    membership_epoch: int = 0
    checksum_algorithm: str = CHECKSUM
    flush_cache: bool = False
    traceparent: str = ""  # W3C context of the trainer's `weights.publish` of the version
    tracestate: str = ""


def shared_request(
    manifest: Manifest,
    staging_uri: str,
    *,
    membership_epoch: int = 0,
    flush_cache: bool = False,
    traceparent: str = "",
    tracestate: str = "",
) -> SharedRequest:
    """The request that has a member load ``manifest``'s version from ``staging_uri`` (the sidecar's side)."""
    specs = [spec for _, spec in manifest.tensors()]
    return SharedRequest(
        names=[t.name for t in specs],
        dtypes=[t.dtype for t in specs],
        shapes=[list(t.shape) for t in specs],
        staging_uri=staging_uri,
        policy_version=manifest.policy_version,
        manifest_checksum=manifest.checksum,
        membership_epoch=membership_epoch,
        checksum_algorithm=manifest.checksum_algorithm,
        flush_cache=flush_cache,
        traceparent=traceparent,
        tracestate=tracestate,
    )


class SharedReader:
    """Engine side of the colocated hand-off: copies a shared version into a buffer of its own (device to
    device), then checks that copy, so what the engine loads is exactly what was checked even if the trainer
    overwrites its buffer meanwhile (a torn copy fails the check). The buffer is reused by the next version:
    the engine copies the tensors it is given before it asks for another (calls are serialized by the
    caller)."""

    def __init__(self, *, label: str = "reader") -> None:
        self.label = label
        self._buffer: torch.Tensor | None = None

    def read(self, req: SharedRequest, *, max_bytes: int = _MAX_SHARED_BYTES) -> ReceivedVersion:
        """The version ``req`` names, checked; ReceiveError('invalid') for a request that cannot be read (or
        names more than ``max_bytes``: the caller's bound, e.g. what its model's weights can take),
        ChecksumMismatch when the bytes are not the manifest's. A refused read keeps no buffer."""
        try:
            return self._read(req, max_bytes)
        except BaseException:
            self._buffer = None  # (a refused request leaves no allocation of its choosing behind)
            raise

    def _read(self, req: SharedRequest, max_bytes: int) -> ReceivedVersion:
        started = time.monotonic()
        n = len(req.names)
        if not 0 < n <= MAX_TENSORS or len(req.dtypes) != n or len(req.shapes) != n:
            raise ReceiveError(
                "invalid",
                f"names, dtypes and shapes must be non-empty, of one length and at most {MAX_TENSORS} long, not "
                f"{n}, {len(req.dtypes)}, {len(req.shapes)}",
            )
        if (req.checksum_algorithm or CHECKSUM) != CHECKSUM:
            raise ReceiveError(
                "invalid", f"checksum_algorithm must be {CHECKSUM!r}, not {shown(req.checksum_algorithm)}"
            )
        if not req.manifest_checksum:
            raise ReceiveError("invalid", "manifest_checksum must be set")
        if len(set(req.names)) != n:
            raise ReceiveError("invalid", "names must be distinct")
        try:
            for i, shape in enumerate(req.shapes):
                check_shape(shape, f"shapes[{i}]")  # (a manifest's bounds, before any size is computed)
        except ManifestError as e:
            raise ReceiveError("invalid", str(e)) from None
        try:
            layout, total = canonical_layout(req.dtypes, req.shapes)
        except (ManifestError, ValueError, OverflowError) as e:
            raise ReceiveError("invalid", f"dtypes and shapes: {e}") from None
        if total > max_bytes:
            raise ReceiveError(
                "invalid", f"dtypes and shapes: {total} bytes, more than the {max_bytes} this engine takes"
            )
        try:
            source = open_shared(req.staging_uri)
        except StagingError as e:
            raise ReceiveError("invalid", f"staging_uri: {e}") from None
        if source.dtype != torch.uint8 or source.dim() != 1 or source.numel() < total:
            raise ReceiveError("invalid", f"staging_uri: the shared buffer does not hold the {total} bytes named")
        buffer = self._buffer
        if buffer is None or buffer.numel() != total or buffer.device != source.device:
            self._buffer = buffer = torch.empty(total, dtype=torch.uint8, device=source.device)
        buffer.copy_(source[:total])
        del source  # (a CUDA IPC mapping is closed with its last tensor)
        loaded = tensor_sum64x2(buffer)
        if loaded != req.manifest_checksum:
            raise ChecksumMismatch(
                f"version {req.policy_version} read by {self.label}", CHECKSUM, req.manifest_checksum, loaded
            )
        tensors = {
            name: buffer[offset : offset + size].view(dtype_from_name(dtype)).view(tuple(shape))
            for name, dtype, shape, (offset, size) in zip(req.names, req.dtypes, req.shapes, layout, strict=True)
        }
        return ReceivedVersion(
            policy_version=req.policy_version,
            membership_epoch=req.membership_epoch,
            tensors=tensors,
            manifest_checksum=req.manifest_checksum,
            loaded_checksum=loaded,
            checksum_algorithm=CHECKSUM,
            load_duration_s=time.monotonic() - started,
            nbytes=sum(nbytes_of(d, s) for d, s in zip(req.dtypes, req.shapes, strict=True)),
            flush_cache=req.flush_cache,
        )
