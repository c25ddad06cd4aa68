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
import pickle
import time
from collections.abc import Mapping
from typing import Any

import torch

from tauflow.weightsync.checksum import tensor_sum64x2
from tauflow.weightsync.errors import ChecksumMismatch, StagingError
from tauflow.weightsync.manifest import (
    DEFAULT_BUCKET_BYTES,
    BucketSpec,
    Manifest,
    dtype_from_name,
    dtype_name,
    plan_buckets,
)

SCHEME = "ipc://"
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
    return SCHEME + base64.b64encode(out.getvalue()).decode("ascii")


class _TorchOnly(pickle.Unpickler):
    """Unpickles what torch's sharing reductions write, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or module.startswith(("torch.multiprocessing.", "torch.storage", "torch._utils")):
            return super().find_class(module, name)
        if (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"an ipc:// URI may only rebuild torch tensors, not {module}.{name}")


def open_shared(uri: str) -> torch.Tensor:
    """The tensor an ``ipc://`` URI names (``share``); StagingError for anything else."""
    if not uri.startswith(SCHEME) or len(uri) > MAX_URI_CHARS:
        raise StagingError(f"not an {SCHEME} URI of at most {MAX_URI_CHARS} characters")
    import torch.multiprocessing

    try:
        raw = base64.b64decode(uri[len(SCHEME) :], validate=True)
        tensor = _TorchOnly(io.BytesIO(raw)).load()
    except (ValueError, pickle.UnpicklingError, EOFError, RuntimeError, OSError, TypeError, AttributeError) as e:
        raise StagingError(f"cannot open the shared buffer: {type(e).__name__}: {e}") from None
    if not isinstance(tensor, torch.Tensor):
        raise StagingError("the shared buffer is not a tensor")
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
