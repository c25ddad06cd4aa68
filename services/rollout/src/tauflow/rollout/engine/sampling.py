"""Batched token sampling as tensor operations, one row per sequence, each row with its own parameters.

Two pieces, both free of Python loops over rows:

- ``counter_uniforms``: a counter-based random number per row, a hash of (row key, token index). A sequence's
  draws therefore depend only on its seed, its sample index and how many tokens it has, never on which other
  sequences share the batch or when it joined it.
- ``sample_tokens``: temperature, top-k and top-p (nucleus) as masks over the vocabulary, then inverse-CDF
  sampling with those uniforms, in vocabulary order (so a row draws the same token whether or not another row
  of the batch truncates). It returns the behaviour log-prob of the drawn token under the temperature-scaled
  distribution *before* truncation, computed in float32.
"""

from __future__ import annotations

import torch

__all__ = ["counter_uniforms", "row_keys", "sample_tokens"]

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without overflowing int64."""
    return (((x & 0xFFFF) * c) + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xorshift-multiply), on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """A 32-bit key per row from a 64-bit seed (given as int64 bits) and a stream index. Computed once per row."""
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    return _mix32(_mix32(_mix32(lo ^ _GOLDEN) ^ hi) ^ (streams & _M32))


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64, a pure function of (key, counter)."""
    h = _mix32(keys ^ _mul32((counters + 1) & _M32, _GOLDEN))
    return h.to(torch.float64) * (1.0 / 4294967296.0)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    truncate: bool = True,
    any_greedy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. Returns (token ids [B] int64, behaviour log-probs [B] float32).

    logits [B, V] (any float dtype); temperature [B] (0: greedy, i.e. argmax, log-prob at temperature 1);
    top_p [B] in (0, 1]; top_k [B] (0: no limit); uniforms [B] in [0, 1).

    Truncation: top-k keeps the k most likely tokens, top-p the smallest set of most likely tokens whose
    probability sums to at least top_p; both are measured on the full temperature-scaled distribution and a
    token is kept only if both keep it (the most likely token always is). ``truncate=False`` (no row truncates)
    and ``any_greedy=False`` (no row is greedy) skip work; the result is the same.

    A row whose logits are not finite (the model overflowed) still gets a token id in range, and a non-finite
    log-prob that tells the caller so; the other rows are unaffected.
    """
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    logp = torch.log_softmax(logits.to(torch.float32) / scale[:, None], dim=-1)
    probs = logp.exp()
    if truncate:
        vocab = probs.shape[-1]
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the strictly more likely tokens
        rank = torch.arange(vocab, device=probs.device)
        k = torch.where(top_k > 0, top_k, vocab)
        keep = (before < top_p[:, None]) & (rank[None, :] < k[:, None])
        keep[:, 0] = True
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    # target < cdf[:, -1] because uniforms < 1, so the index is in range and lands on a token of positive mass;
    # but a row of non-finite logits has a NaN cdf, for which searchsorted answers V: clamped into range.
    target = uniforms.to(torch.float64)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    if any_greedy:
        tokens = torch.where(greedy, logp.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
