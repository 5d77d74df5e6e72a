"""Dropout keep-mask from counter-based Philox4x32-10, bit-identical to the device code.

This is the numpy twin of ``templates/partials/philox.cuh``.  The keep decision for
element ``(b, h, row, col)`` of a ``[B, H, Nq, Nk]`` attention matrix is a pure
function of ``(seed, offset, b*H + h, row, col, p)``::

    key       = (seed_lo, seed_hi ^ offset_hi)
    counter   = (col >> 2, row, b * H + h, offset_lo)
    r         = Philox4x32-10(counter, key)[col & 3]
    keep     <=> r >= drop_threshold(p),   drop_threshold(p) = floor(p * 2**32)

so it depends neither on tiling nor on ``Nq``/``Nk`` (Salmon et al., SC'11).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .errors import check_dropout_p

__all__ = ["drop_threshold", "philox4x32_10", "keep_mask", "PHILOX_ROUNDS"]

PHILOX_ROUNDS = 10
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_MASK32 = 0xFFFFFFFF
_U64_LIMIT = 1 << 64


def _check_uint(name: str, value: object, limit: int) -> int:
    """Return ``value`` as a Python int, requiring an integer in ``[0, limit)``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer in [0, {limit:#x}), got {value!r}")
    v = int(value)
    if not 0 <= v < limit:
        raise ValueError(f"{name} must be in [0, {limit:#x}), got {v}")
    return v


def drop_threshold(p: float) -> int:
    """Return the uint32 drop threshold ``floor(p * 2**32)`` for dropout probability ``p``.

    An element is kept iff its Philox word ``r`` satisfies ``r >= drop_threshold(p)``,
    so ``P(keep) = 1 - drop_threshold(p) / 2**32``.  This is the single definition
    shared by the reference and the kernel launchers.

    Raises:
        fagen.InputError (a ValueError): if ``p`` is not a real number in ``[0, 1)``.
    """
    p = check_dropout_p(p)
    t = math.floor(p * 4294967296.0)  # exact: p * 2**32 is a scaling by a power of two
    return min(t, _MASK32)


def philox4x32_10(counter: np.ndarray, key0: int, key1: int) -> np.ndarray:
    """Philox4x32-10 block function, vectorised over the leading axes of ``counter``.

    Each of the 10 rounds computes, with ``(hi, lo)`` the halves of a 32x32->64 product::

        hi0, lo0 = M0 * c0;  hi1, lo1 = M1 * c2
        c  = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
        k0 += W0;  k1 += W1          (mod 2**32)

    Args:
        counter: array of shape ``[..., 4]`` with values in ``[0, 2**32)``.
        key0, key1: the two 32-bit key words.

    Returns:
        ``uint32`` array of shape ``[..., 4]``.
    """
    c = np.asarray(counter)
    if c.ndim < 1 or c.shape[-1] != 4:
        raise ValueError(f"counter must have shape [..., 4], got {c.shape}")
    if c.dtype != np.uint32:
        if not np.issubdtype(c.dtype, np.integer):
            raise TypeError(f"counter must be an integer array, got dtype {c.dtype}")
        if c.size and (c.min() < 0 or c.max() > _MASK32):
            raise ValueError("counter values must be in [0, 2**32)")
    k0 = _check_uint("key0", key0, 1 << 32)
    k1 = _check_uint("key1", key1, 1 << 32)

    c64 = c.astype(np.uint64)
    x, y, z, w = c64[..., 0], c64[..., 1], c64[..., 2], c64[..., 3]
    mask = np.uint64(_MASK32)
    shift = np.uint64(32)
    for _ in range(PHILOX_ROUNDS):
        p0 = _M0 * x  # < 2**64: exact in uint64
        p1 = _M1 * z
        hi0, lo0 = p0 >> shift, p0 & mask
        hi1, lo1 = p1 >> shift, p1 & mask
        x, y, z, w = hi1 ^ y ^ np.uint64(k0), lo1, hi0 ^ w ^ np.uint64(k1), lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return np.stack([x, y, z, w], axis=-1).astype(np.uint32)


def keep_mask(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    dropout_p: float,
    *,
    seed: int = 0,
    offset: int = 0,
) -> np.ndarray:
    """Dropout keep-mask ``Z`` of shape ``[batch, nheads, seqlen_q, seqlen_k]`` (True = kept).

    ``Z[b, h, i, j] = Philox4x32-10((j >> 2, i, b*H + h, offset_lo),
    (seed_lo, seed_hi ^ offset_hi))[j & 3] >= drop_threshold(dropout_p)``,
    identical to ``fa_dropout_keep`` in ``templates/partials/philox.cuh``.
    One Philox call serves each group of 4 consecutive columns.

    Raises:
        ValueError: for non-positive sizes, ``dropout_p`` outside ``[0, 1)``, or
            ``seed``/``offset`` outside ``[0, 2**64)``.
    """
    sizes = {"batch": batch, "nheads": nheads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    B, H, Nq, Nk = (int(v) for v in sizes.values())
    if B * H > 1 << 32 or Nq > 1 << 32 or Nk > 1 << 34:
        raise ValueError("batch*nheads, seqlen_q and seqlen_k/4 must fit in 32 bits")
    p = check_dropout_p(dropout_p)
    seed = _check_uint("seed", seed, _U64_LIMIT)
    offset = _check_uint("offset", offset, _U64_LIMIT)
    threshold = drop_threshold(p)
    if threshold == 0:
        return np.ones((B, H, Nq, Nk), dtype=bool)

    key0 = seed & _MASK32
    key1 = (seed >> 32) ^ (offset >> 32)
    ngroups = (Nk + 3) // 4
    counter = np.empty((B * H, Nq, ngroups, 4), dtype=np.uint32)
    counter[..., 0] = np.arange(ngroups, dtype=np.uint32)[None, None, :]
    counter[..., 1] = np.arange(Nq, dtype=np.uint32)[None, :, None]
    counter[..., 2] = np.arange(B * H, dtype=np.uint32)[:, None, None]
    counter[..., 3] = offset & _MASK32
    r = philox4x32_10(counter, key0, key1)  # [BH, Nq, G, 4]; column j = 4*g + (j & 3)
    words = r.reshape(B * H, Nq, ngroups * 4)[..., :Nk]
    return (words >= np.uint32(threshold)).reshape(B, H, Nq, Nk)
