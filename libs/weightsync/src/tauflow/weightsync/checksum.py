"""Checksums of weight bytes: cheap enough to run on every hand-off and every receive.

The default, ``xxh3-64`` (xxHash), hashes ~15 GB/s on one core; ``crc32`` (zlib, ~2.4 GB/s)
and ``sha256`` are accepted too. A checksum covers the bytes of all buckets in index
order, padding included (the stager writes zero padding), and is hex encoded.

``sum64x2`` is the one a GPU computes where the bytes are (the colocated hand-off, ``ipc``): the bytes,
zero-padded to a multiple of 8, as little-endian 64-bit words w_1..w_n; s1 = Σ w_i and s2 = Σ i·w_i, both
mod 2^64 (so a swap of two words changes s2); hex of s1 then s2. Not cryptographic: it catches torn,
overwritten or mismatched versions, as a checksum here is for.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import xxhash

DEFAULT_ALGORITHM = "xxh3-64"
MAX_CHECKSUM_CHARS = 128  # a hex checksum (sha256's, the longest here, has 64 characters)


class Hasher(Protocol):
    def update(self, data: bytes | memoryview) -> None: ...
    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


_MASK = (1 << 64) - 1
_CHUNK_WORDS = 1 << 20
_steps: np.ndarray | None = None  # 1, 2, ..., _CHUNK_WORDS (8 MiB, made once)


def _word_sums(words: np.ndarray, first: int) -> tuple[int, int]:
    """(Σ w, Σ i·w) mod 2^64 of ``words`` numbered from ``first``: a chunk's Σ (base + j)·w_j is base·Σ w_j plus
    a dot product with 1..n, whose uint64 arithmetic wraps mod 2^64 (10x faster than forming i·w)."""
    global _steps
    if _steps is None:
        _steps = np.arange(1, _CHUNK_WORDS + 1, dtype=np.uint64)
    s1 = s2 = 0
    for start in range(0, len(words), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS]
        total = int(chunk.sum(dtype=np.uint64))
        s1 += total
        s2 += (first + start - 1) * total + int(np.dot(chunk, _steps[: len(chunk)]))
    return s1 & _MASK, s2 & _MASK


class Sum64x2:
    """``sum64x2`` over a stream of bytes (numpy; its uint64 arithmetic wraps mod 2^64)."""

    def __init__(self) -> None:
        self.s1 = self.s2 = 0
        self.words = 0  # words summed so far
        self._pending = b""  # a word's first bytes, until the next update completes it

    def update(self, data: bytes | memoryview) -> None:
        data = self._pending + bytes(data) if self._pending else memoryview(data).cast("B")
        whole = len(data) - len(data) % 8
        self._pending = bytes(data[whole:])
        if whole:
            self._add(np.frombuffer(data[:whole], dtype="<u8"))

    def _add(self, words: np.ndarray) -> None:
        s1, s2 = _word_sums(words, self.words + 1)
        self.s1, self.s2 = (self.s1 + s1) & _MASK, (self.s2 + s2) & _MASK
        self.words += len(words)

    def hexdigest(self) -> str:
        s1, s2 = self.s1, self.s2
        if self._pending:  # the last word, zero-padded
            last = int.from_bytes(self._pending.ljust(8, b"\0"), "little")
            s1, s2 = (s1 + last) & _MASK, (s2 + (self.words + 1) * last) & _MASK
        return f"{s1:016x}{s2:016x}"


def tensor_sum64x2(data: torch.Tensor, chunk_words: int = 1 << 24) -> str:
    """``sum64x2`` of a uint8 tensor's bytes, computed on its own device (a GPU's bytes never leave it):
    int64 arithmetic, whose two's-complement wrap is the mod 2^64 of the definition; on a CPU, numpy's."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("tensor_sum64x2 takes a flat uint8 tensor")
    pad = (-data.numel()) % 8
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    if data.device.type == "cpu":  # (numpy's dot is an order of magnitude faster than torch's int64 ops here)
        s1, s2 = _word_sums(data.contiguous().numpy().view("<u8"), 1)
    else:
        s1, s2 = _device_word_sums(data.view(torch.int64), chunk_words)  # little-endian wherever torch runs
    return f"{s1:016x}{s2:016x}"


def _device_word_sums(words: torch.Tensor, chunk_words: int) -> tuple[int, int]:
    """``_word_sums`` on the words' own device, in torch (one scalar comes back per sum)."""
    s1 = torch.zeros((), dtype=torch.int64, device=words.device)
    s2 = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), chunk_words):
        chunk = words[start : start + chunk_words]
        index = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=words.device)
        s1 += chunk.sum()
        s2 += (chunk * index).sum()
    return int(s1) & _MASK, int(s2) & _MASK


_FACTORIES: dict[str, Callable[[], Hasher]] = {
    "xxh3-64": xxhash.xxh3_64,
    "crc32": _Crc32,
    "sha256": hashlib.sha256,
    "sum64x2": Sum64x2,
}
ALGORITHMS = tuple(_FACTORIES)


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> Hasher:
    """A streaming hasher for ``algorithm``; ``ValueError`` names the ones supported."""
    try:
        return _FACTORIES[algorithm]()
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; supported: {', '.join(ALGORITHMS)}") from None


_ZEROS = bytes(4096)


def update_zeros(hasher: Hasher, n: int) -> None:
    """Feeds ``n`` zero bytes (the padding between tensors) into ``hasher``."""
    while n > 0:
        k = min(n, len(_ZEROS))
        hasher.update(_ZEROS[:k])
        n -= k
