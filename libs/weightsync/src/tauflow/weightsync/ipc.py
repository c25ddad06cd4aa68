"""Weights handed between processes on one machine without a copy: the colocated hand-off (docs/gpu.md).

A trainer and an engine that share a GPU need not send the bytes anywhere: ``DeviceStager.stage`` packs a
state dict into a flat buffer on the trainer's device, in the same canonical layout as the host staging
area (``manifest.plan_buckets``), with a ``sum64x2`` checksum computed on that device, and names the buffer
by an ``ipc://`` URI: a CUDA IPC handle on a GPU, a shared-memory file on a CPU (the same code, so it is
tested on CPUs). ``read_shared`` opens it in the engine's process, verifies the checksum where the bytes are,
and gives each tensor as a view, which the engine copies into its own weights (device to device).

The stager alternates two buffers: the engine reads version N from one while N+1 is written to the other;
version N+2 overwrites N's, and a reader still copying N then sees a checksum mismatch, never a silent mix.

An ``ipc://`` URI is a pickle of torch's own sharing reductions; ``read_shared`` unpickles it with an
allow-list of torch's rebuild functions only, so a forged URI cannot run code.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tauflow.weightsync.checksum import tensor_sum64x2
from tauflow.weightsync.errors import ChecksumMismatch, ManifestError, StagingError
from tauflow.weightsync.manifest import (
    DEFAULT_BUCKET_BYTES,
    BucketSpec,
    Manifest,
    canonical_layout,
    dtype_from_name,
    dtype_name,
    nbytes_of,
    plan_buckets,
)
from tauflow.weightsync.transfer import ReceivedVersion, ReceiveError

SCHEME = "ipc://"
MAX_DIMS = 8  # dimensions of one tensor in a shared version
MAX_TENSORS = 1 << 17  # tensors in one shared version (a large model has thousands)
CHECKSUM = "sum64x2"
MAX_URI_CHARS = 16384  # a CUDA IPC handle pickles to a few hundred bytes


def share(buffer: torch.Tensor) -> str:
    """An ``ipc://`` URI another process on this machine opens as the same memory (``open_shared``). The caller
    keeps ``buffer`` alive while others may open it."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    if buffer.device.type == "cpu":
        # shared memory by file name: a process that is not our child can open it (a file descriptor would
        # need our resource sharer's key)
        mp.set_sharing_strategy("file_system")
        buffer.share_memory_()
    out = io.BytesIO()
    ForkingPickler(out).dump(buffer)
    if buffer.device.type == "cpu":
        # torch counts the references to a shared-memory file in the file, and its pickle takes one that the
        # one process that unpickles it gives back: a URI opened N times would drop N. Giving it back here (and
        # taking one in open_shared) makes every open neutral; the file goes with the last reference.
        buffer.untyped_storage()._shared_decref()
    return SCHEME + base64.b64encode(out.getvalue()).decode("ascii")


_MAX_SHARED_BYTES = 1 << 42  # 4 TiB: more than any buffer a trainer stages
_MANAGER = re.compile(rb"/[^\x00]{0,4000}/torch-shm-dir-[A-Za-z0-9_]{1,64}/manager\.sock")
_SHM_NAME = re.compile(rb"/torch_[0-9]{1,12}_[0-9]{1,12}_[0-9]{1,12}")


def _shm_file_bytes(name: bytes) -> int:
    """The size of the shared-memory file ``name`` (torch opens an existing one at the size it is told, growing
    it: a forged size must not reach it); -1 when there is none."""
    try:
        return os.stat(b"/dev/shm" + name).st_size
    except OSError:
        return -1


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind)


def _sizes(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) <= 8 and all(type(d) is int and 0 <= d < 2**40 for d in value)


def _shared_callables() -> dict[Any, Callable[[tuple[Any, ...]], bool]]:
    """What an ``ipc://`` URI may call, each with the check of its arguments: exactly the calls torch's sharing
    reduction of one uint8 tensor makes (a shared-memory file on a CPU, a CUDA IPC handle on a GPU)."""
    from torch.multiprocessing import reductions

    untyped = torch.storage.UntypedStorage

    def filename(a: tuple[Any, ...]) -> bool:  # (cls, manager socket, shm name, size in bytes)
        return (
            len(a) == 4
            and a[0] is untyped
            and _is(a[1], bytes)
            and _MANAGER.fullmatch(a[1]) is not None
            and _is(a[2], bytes)
            and _SHM_NAME.fullmatch(a[2]) is not None
            and type(a[3]) is int
            and 0 <= a[3] <= _shm_file_bytes(a[2])
        )

    def typed(a: tuple[Any, ...]) -> bool:  # (untyped storage, dtype)
        return len(a) == 2 and _is(a[0], untyped) and a[1] is torch.uint8

    def tensor(a: tuple[Any, ...]) -> bool:  # (cls, typed storage, (offset, size, stride, requires_grad))
        m = a[2] if len(a) == 3 else None
        return (
            a[0] is torch.Tensor
            and _is(a[1], torch.storage.TypedStorage)
            and isinstance(m, tuple)
            and len(m) == 4
            and type(m[0]) is int
            and _sizes(tuple(m[1]))
            and _sizes(tuple(m[2]))
            and m[3] is False
        )

    def cuda_tensor(a: tuple[Any, ...]) -> bool:  # torch's 15 arguments of a CUDA IPC handle
        return (
            len(a) == 15
            and a[0] is torch.Tensor
            and _sizes(tuple(a[1]))
            and _sizes(tuple(a[2]))
            and a[4] in (untyped, torch.storage.TypedStorage)
            and a[5] is torch.uint8
            and a[10] is False
            and all(type(a[i]) is int for i in (3, 6, 8, 9, 12))
            and 0 <= a[8] <= _MAX_SHARED_BYTES
            and all(_is(a[i], bytes) and len(a[i]) <= 1024 for i in (7, 11))
            and (a[13] is None or (_is(a[13], bytes) and len(a[13]) <= 1024))
            and type(a[14]) is bool
        )

    return {
        reductions.rebuild_storage_filename: filename,
        reductions.rebuild_typed_storage: typed,
        reductions.rebuild_tensor: tensor,
        reductions.rebuild_cuda_tensor: cuda_tensor,
        torch.Size: lambda a: len(a) == 1 and _sizes(a[0]),
    }


class _TorchOnly(pickle._Unpickler):  # the Python unpickler: its opcodes can be overridden
    """Unpickles what torch's sharing reduction of a uint8 tensor writes, and nothing else: names are looked up
    in an allow-list (no dotted names), and a call (REDUCE) is made only of an allowed function with arguments
    of the shapes torch writes; every other opcode that builds or calls objects is refused."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # (the Python unpickler's, typed here)
    _GLOBALS: ClassVar[set[tuple[str, str]]] = {
        ("torch.multiprocessing.reductions", n)
        for n in ("rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_cuda_tensor")
    } | {("torch", "Tensor"), ("torch", "Size"), ("torch", "uint8")}
    _GLOBALS |= {("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage")}

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._callables = _shared_callables()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._GLOBALS:
            raise pickle.UnpicklingError(f"an ipc:// URI may only rebuild a torch tensor, not {module}.{name}")
        return super().find_class(module, name)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        check = self._callables.get(func)
        if check is None or not isinstance(args, tuple) or len(args) > 16 or not check(args):
            raise pickle.UnpicklingError(f"an ipc:// URI may not call {getattr(func, '__name__', func)!r} so")
        self.stack[-1] = func(*args)

    def _refuse(self) -> None:
        raise pickle.UnpicklingError("an ipc:// URI may only rebuild a torch tensor")

    dispatch[pickle.REDUCE[0]] = load_reduce
    for _op in (pickle.BUILD, pickle.INST, pickle.OBJ, pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2,
                pickle.EXT4, pickle.PERSID, pickle.BINPERSID, pickle.GLOBAL):  # fmt: skip
        dispatch[_op[0]] = _refuse


def open_shared(uri: str) -> torch.Tensor:
    """The tensor an ``ipc://`` URI names (``share``); StagingError for anything else."""
    if not uri.startswith(SCHEME) or len(uri) > MAX_URI_CHARS:
        raise StagingError(f"not an {SCHEME} URI of at most {MAX_URI_CHARS} characters")
    import torch.multiprocessing

    try:
        raw = base64.b64decode(uri[len(SCHEME) :], validate=True)
        tensor = _TorchOnly(raw).load()
    except Exception as e:  # noqa: BLE001 - whatever a forged URI makes torch raise is the URI's fault
        raise StagingError(f"cannot open the shared buffer: {type(e).__name__}: {e}") from None
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise StagingError("the shared buffer is not a flat uint8 tensor")
    if tensor.device.type == "cpu":
        if not tensor.is_shared():
            raise StagingError("the shared buffer is not in shared memory")
        tensor.untyped_storage()._shared_incref()  # what unpickling gave back (share's comment)
    return tensor


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
            raise ReceiveError("invalid", f"checksum_algorithm must be {CHECKSUM!r}, not {req.checksum_algorithm!r}")
        if not req.manifest_checksum:
            raise ReceiveError("invalid", "manifest_checksum must be set")
        if len(set(req.names)) != n:
            raise ReceiveError("invalid", "names must be distinct")
        for i, shape in enumerate(req.shapes):
            if len(shape) > MAX_DIMS or any(not 0 <= d < 2**40 for d in shape):
                raise ReceiveError(
                    "invalid",
                    f"shapes[{i}] must have at most {MAX_DIMS} dimensions, each in 0..2^40: {list(shape)[:9]}",
                )
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
