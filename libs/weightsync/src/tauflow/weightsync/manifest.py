"""The manifest of a policy version: names, dtypes, shapes, bucket layout, version, checksum.

Layout rule (``tauflow_flat_v1``): tensors are packed in bucket order; each tensor starts
at the next multiple of ``ALIGN_BYTES`` (64) after the previous one; a bucket's size is
the end of its last tensor rounded up to 64; buckets follow each other without gaps.
Padding bytes are zero. Because the layout follows from the dtypes and shapes alone, a
receiver that gets only SGLang's ``names``/``dtypes``/``shapes`` can place every tensor
in a bucket received as one flat buffer (``canonical_layout``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from tauflow.weightsync.checksum import ALGORITHMS
from tauflow.weightsync.errors import ManifestError

ALIGN_BYTES = 64
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
_HEX = re.compile(r"^[0-9a-f]+$")


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


@lru_cache(maxsize=1)
def _dtypes() -> dict[str, torch.dtype]:
    names: dict[str, torch.dtype] = {}
    for attr in dir(torch):
        value = getattr(torch, attr, None)
        if isinstance(value, torch.dtype):
            names[str(value).removeprefix("torch.")] = value
    return names


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``; only torch's canonical names (``str(dtype)`` less ``torch.``)."""
    try:
        return _dtypes()[name]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r} (use torch's name without 'torch.', e.g. 'bfloat16')") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    n = dtype_from_name(dtype).itemsize
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    size_bytes: int


@dataclass(frozen=True)
class BucketSpec:
    index: int
    tensors: tuple[TensorSpec, ...]
    offset_bytes: int
    size_bytes: int


@dataclass(frozen=True)
class Manifest:
    policy_version: int
    buckets: tuple[BucketSpec, ...]
    total_bytes: int
    checksum_algorithm: str
    checksum: str
    model: str = ""
    created_at: float | None = field(default=None, compare=False)

    def tensors(self) -> Iterable[tuple[BucketSpec, TensorSpec]]:
        for b in self.buckets:
            for t in b.tensors:
                yield b, t


def canonical_layout(dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[list[tuple[int, int]], int]:
    """(offset, size) of each tensor of one bucket under the layout rule, and the bucket's size."""
    out = []
    end = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        size = nbytes_of(dtype, shape)
        offset = align_up(end)
        out.append((offset, size))
        end = offset + size
    return out, align_up(end)


def plan_buckets(
    specs: Iterable[tuple[str, str, Sequence[int]]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[BucketSpec, ...]:
    """Packs ``(name, dtype, shape)`` in order into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ManifestError(f"bucket_bytes must be positive, not {bucket_bytes}")
    buckets: list[BucketSpec] = []
    current: list[TensorSpec] = []
    end = 0
    start = 0

    def close() -> None:
        nonlocal current, end, start
        size = align_up(end)
        buckets.append(BucketSpec(len(buckets), tuple(current), start, size))
        start += size
        current, end = [], 0

    for name, dtype, shape in specs:
        size = nbytes_of(dtype, shape)
        offset = align_up(end)
        if current and offset + size > bucket_bytes:
            close()
            offset = 0
        current.append(TensorSpec(name, dtype, tuple(int(d) for d in shape), offset, size))
        end = offset + size
    if current:
        close()
    return tuple(buckets)


def validate(m: Manifest) -> None:
    """Raises ``ManifestError`` saying what is wrong: empty, duplicate names, sizes that do not
    match dtype and shape, overlapping or non-canonical offsets, wrong totals, unknown checksum."""
    if not m.buckets:
        raise ManifestError("manifest has no buckets")
    if m.checksum_algorithm not in ALGORITHMS:
        raise ManifestError(f"unknown checksum_algorithm {m.checksum_algorithm!r}; supported: {', '.join(ALGORITHMS)}")
    if not m.checksum or not _HEX.match(m.checksum):
        raise ManifestError(f"checksum must be lower-case hex, not {m.checksum!r}")
    names: set[str] = set()
    offset = 0
    for i, b in enumerate(m.buckets):
        if b.index != i:
            raise ManifestError(f"bucket at position {i} has index {b.index}: buckets must be in index order from 0")
        if not b.tensors:
            raise ManifestError(f"bucket {i} has no tensors")
        if b.offset_bytes != offset:
            raise ManifestError(
                f"bucket {i} starts at offset_bytes {b.offset_bytes}, expected {offset} "
                "(buckets follow each other without gaps)"
            )
        end = 0
        for t in b.tensors:
            where = f"tensor {t.name!r} in bucket {i}"
            if not t.name:
                raise ManifestError(f"a tensor in bucket {i} has an empty name")
            if t.name in names:
                raise ManifestError(f"duplicate tensor name {t.name!r}")
            names.add(t.name)
            if any(d < 0 for d in t.shape):
                raise ManifestError(f"{where}: negative dimension in shape {list(t.shape)}")
            expected = nbytes_of(t.dtype, t.shape)
            if t.size_bytes != expected:
                raise ManifestError(
                    f"{where}: size_bytes {t.size_bytes} does not match dtype {t.dtype} and shape "
                    f"{list(t.shape)} ({expected} bytes)"
                )
            if t.offset_bytes < end:
                raise ManifestError(
                    f"{where}: offset_bytes {t.offset_bytes} overlaps the previous tensor (ends at {end})"
                )
            if t.offset_bytes != align_up(end):
                raise ManifestError(
                    f"{where}: offset_bytes {t.offset_bytes} is not the layout's {align_up(end)} "
                    f"(each tensor starts at the next multiple of {ALIGN_BYTES}; see tauflow.weightsync.plan_buckets)"
                )
            end = t.offset_bytes + t.size_bytes
        if b.size_bytes != align_up(end):
            raise ManifestError(
                f"bucket {i}: size_bytes {b.size_bytes}, expected {align_up(end)} (last tensor end, aligned)"
            )
        offset += b.size_bytes
    if m.total_bytes != offset:
        raise ManifestError(f"total_bytes {m.total_bytes} is not the sum of the bucket sizes ({offset})")
