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

from tauflow.weightsync.checksum import ALGORITHMS, MAX_CHECKSUM_CHARS
from tauflow.weightsync.errors import ManifestError

ALIGN_BYTES = 64
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
# The shape of one tensor: at most MAX_DIMS dimensions, each in 0..DIM_LIMIT-1 (no model's weight comes near
# either). Checked before any size is computed from a shape: the product of unbounded dimensions is an integer
# of any size (a manifest of 30000 dimensions of 2^62 took seconds to multiply out, and could not be printed).
MAX_DIMS = 8
DIM_LIMIT = 1 << 40
SHOWN_CHARS = 80  # characters of a name or other string from a request that a message shows
_HEX = re.compile(r"^[0-9a-f]+$")


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """``repr(text)``, cut to ``limit`` characters: for a message that names a string a caller sent."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def _dim_text(d: int) -> str:
    if -(1 << 64) < d < 1 << 64:
        return str(d)
    return f"<a {d.bit_length()}-bit integer>" if isinstance(d, int) else "<out of range>"  # (never printed in full)


def shape_text(shape: Sequence[int]) -> str:
    """``shape`` for a message: its first ``MAX_DIMS`` dimensions, then how many there are."""
    head = ", ".join(_dim_text(d) for d in shape[:MAX_DIMS])
    return f"[{head}]" if len(shape) <= MAX_DIMS else f"[{head}, …] ({len(shape)} dimensions)"


def check_shape(shape: Sequence[int], where: str = "shape") -> None:
    """Raises ``ManifestError`` (naming ``where``) unless ``shape`` has at most ``MAX_DIMS`` dimensions, each in
    0..DIM_LIMIT-1: the bounds of every shape a manifest or a receiver takes, checked before any size."""
    if len(shape) > MAX_DIMS:
        problem = f"it has {len(shape)}"
    else:
        bad = next((j for j, d in enumerate(shape) if not 0 <= d < DIM_LIMIT), None)
        if bad is None:
            return
        problem = f"dimension {bad} is {_dim_text(shape[bad])}"
    raise ManifestError(
        f"{where} must have at most {MAX_DIMS} dimensions, each in 0..2^{DIM_LIMIT.bit_length() - 1}-1 "
        f"({problem}): {shape_text(shape)}"
    )


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
        raise ManifestError(
            f"unknown dtype {shown(name)} (use torch's name without 'torch.', e.g. 'bfloat16')"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    """The bytes of a tensor of ``dtype`` and ``shape``; ManifestError for an unknown dtype or a shape out of
    its bounds (``check_shape``)."""
    check_shape(shape)
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


def check_header(n_buckets: int, checksum_algorithm: str, checksum: str) -> None:
    """The checks of ``validate`` that need no tensor: a manifest's bucket count and checksum fields. Cheap on
    the wire form too, before a manifest of many tensors is converted (tauflow-weights' Publish)."""
    if not n_buckets:
        raise ManifestError("manifest has no buckets")
    if checksum_algorithm not in ALGORITHMS:
        raise ManifestError(
            f"unknown checksum_algorithm {shown(checksum_algorithm)}; supported: {', '.join(ALGORITHMS)}"
        )
    if not checksum or len(checksum) > MAX_CHECKSUM_CHARS or not _HEX.match(checksum):
        raise ManifestError(
            f"checksum must be lower-case hex of at most {MAX_CHECKSUM_CHARS} characters, not {shown(checksum)}"
        )


def validate(m: Manifest) -> None:
    """Raises ``ManifestError`` saying what is wrong: empty, duplicate names, shapes out of their bounds
    (``check_shape``), sizes that do not match dtype and shape, overlapping or non-canonical offsets, wrong
    totals, unknown checksum. A message shows at most ``SHOWN_CHARS`` of a name and ``MAX_DIMS`` dimensions
    of a shape, whatever the manifest holds."""
    check_header(len(m.buckets), m.checksum_algorithm, m.checksum)
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
        for j, t in enumerate(b.tensors):
            where = f"tensor {shown(t.name)} in bucket {i} (tensors[{j}])"
            if not t.name:
                raise ManifestError(f"tensor {j} in bucket {i} has an empty name")
            if t.name in names:
                raise ManifestError(f"duplicate tensor name {shown(t.name)} (bucket {i}, tensors[{j}])")
            names.add(t.name)
            check_shape(t.shape, f"{where}: shape")
            expected = nbytes_of(t.dtype, t.shape)
            if t.size_bytes != expected:
                raise ManifestError(
                    f"{where}: size_bytes {t.size_bytes} does not match dtype {t.dtype} and shape "
                    f"{shape_text(t.shape)} ({expected} bytes)"
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
