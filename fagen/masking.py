"""The masking rule in Python: the same functions as templates/partials/masking.cuh.

Which elements a query row may attend to (``allowed``), which (Q block, K/V
block) tiles a kernel visits and which of them need no mask math
(``tile_kind``), and the inner-loop bounds of the backward (``kv_block_q_range``)
and forward (``q_block_kv_range``) kernels. With ``shift = Nk - Nq``
(bottom-right, flash-attn; ``top_left=True``: 0, torch SDPA's ``is_causal``),
row ``i`` may attend to key ``j`` iff both are inside their sequences and

* causal: ``j <= i + shift``;
* window ``(l, r)`` (negative = unbounded): ``j >= i + shift - l`` and ``j <= i + shift + r``
  (causal with a window is the window ``(l, min(r, 0))``: flash-attn's causal means right = 0);
* data masks (key padding ``kpm[b * Nk + j]``, an attention mask): per element.

So a row's keys are one band ``[i + shift - L, i + shift + R]``: tiles wholly outside
it are SKIP and never visited (the loop bounds are tight). A tile is rows
``[row0, row0 + block_r)`` x keys ``[col0, col0 + block_c)``.

``tile_counts`` counts the tiles of one (batch, head) in closed form (O(log N)
integer arithmetic, no per-tile loop), so the autotuner's cost model costs the
same at N = 2**40 as at N = 1024. tests/test_masking.py checks every function
against the C++ rule compiled with g++ and ``tile_counts`` against a per-tile
count.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

from .errors import InputError, InputTypeError

Window = tuple[int, int]
NO_WINDOW: Window = (-1, -1)
CAUSAL_ALIGNS = ("bottom_right", "top_left")


class TileKind(IntEnum):
    SKIP = 0  # no element is allowed: never visited
    PARTIAL = 1  # visited, with mask math
    FULL = 2  # visited, every element allowed: no mask math


def check_window(window: Any, argument: str = "window_size") -> Window:
    """``(left, right)``: two ints >= -1 (-1 = unbounded on that side), as a tuple.

    The one validator of a window (the functional API, the reference and the explain page
    call it): not a pair of ints is :class:`~fagen.errors.InputTypeError`, a pair of the
    wrong length or a side below -1 :class:`~fagen.errors.InputError`, naming ``argument``."""
    if not isinstance(window, (list, tuple)):
        raise InputTypeError(argument, "a tuple of two ints (left, right), -1 = unbounded", repr(window))
    if len(window) != 2:
        raise InputError(argument, "a pair (left, right) of ints, -1 = unbounded", repr(window))
    if not all(_is_int(w) for w in window):
        raise InputTypeError(argument, "a tuple of two ints (left, right), -1 = unbounded", repr(window))
    left, right = (int(w) for w in window)
    if left < -1 or right < -1:
        raise InputError(argument, "two ints >= -1 (-1 = unbounded)", (left, right))
    return left, right


def check_causal_align(causal_align: Any, argument: str = "causal_align") -> str:
    """``"bottom_right"`` (flash-attn: the diagonal ends at the last key) or ``"top_left"``
    (torch SDPA's ``is_causal``); anything else is an :class:`~fagen.errors.InputError`."""
    if not isinstance(causal_align, str) or causal_align not in CAUSAL_ALIGNS:
        raise InputError(argument, f"one of {CAUSAL_ALIGNS}", repr(causal_align))
    return causal_align


def _is_int(x: Any) -> bool:
    """An integer that is not a bool (numpy and torch integers included, by their ``__index__``)."""
    if isinstance(x, bool):  # numpy's bool_ is not Integral either
        return False
    if isinstance(x, numbers.Integral):
        return True
    return type(x).__name__ == "SymInt"  # torch.SymInt (torch is not imported here)


def band(seqlen_q: int, seqlen_k: int, *, causal: bool, window: Sequence[int] = NO_WINDOW,
         top_left: bool = False) -> tuple[int, int | None, int | None]:
    """``(shift, lo, hi)``: row i may attend keys j with ``lo <= j - i - shift <= hi`` (None =
    unbounded), inside both sequences."""
    left, right = check_window(window)
    shift = 0 if top_left else seqlen_k - seqlen_q
    lo = -left if left >= 0 else None
    hi = right if right >= 0 else None
    if causal and (hi is None or hi > 0):
        hi = 0
    return shift, lo, hi


def allowed(row: int, col: int, seqlen_q: int, seqlen_k: int, *, causal: bool,
            kpm: Sequence[int] | None = None, b: int = 0, window: Sequence[int] = NO_WINDOW,
            top_left: bool = False) -> bool:
    """May query ``row`` attend to key ``col``? ``kpm`` (flattened [B, Nk], nonzero = the key
    takes part) is the key-padding mask, None without key padding."""
    if row < 0 or col < 0 or row >= seqlen_q or col >= seqlen_k:
        return False
    shift, lo, hi = band(seqlen_q, seqlen_k, causal=causal, window=window, top_left=top_left)
    o = col - row - shift
    if (lo is not None and o < lo) or (hi is not None and o > hi):
        return False
    if kpm is not None and kpm[b * seqlen_k + col] == 0:
        return False
    return True


def tile_kind(row0: int, col0: int, seqlen_q: int, seqlen_k: int, *, block_r: int, block_c: int,
              causal: bool, key_padding: bool, window: Sequence[int] = NO_WINDOW, top_left: bool = False,
              attn_mask: bool = False) -> TileKind:
    """SKIP if no element of the tile is allowed; FULL if every element is allowed without mask
    math (inside both sequences and the band, never with a data mask: key padding or an
    attention mask); PARTIAL otherwise."""
    if row0 < 0 or col0 < 0 or row0 >= seqlen_q or col0 >= seqlen_k:
        return TileKind.SKIP
    shift, lo, hi = band(seqlen_q, seqlen_k, causal=causal, window=window, top_left=top_left)
    row_end, col_end = min(row0 + block_r, seqlen_q), min(col0 + block_c, seqlen_k)
    o_min, o_max = col0 - (row_end - 1) - shift, (col_end - 1) - row0 - shift
    if (hi is not None and o_min > hi) or (lo is not None and o_max < lo):
        return TileKind.SKIP
    if key_padding or attn_mask or row0 + block_r > seqlen_q or col0 + block_c > seqlen_k:
        return TileKind.PARTIAL
    if (hi is not None and o_max > hi) or (lo is not None and o_min < lo):
        return TileKind.PARTIAL
    return TileKind.FULL


def kv_block_q_range(col0: int, seqlen_q: int, seqlen_k: int, *, block_r: int, block_c: int, causal: bool,
                     window: Sequence[int] = NO_WINDOW, top_left: bool = False) -> tuple[int, int]:
    """Backward inner-loop bounds: the Q rows [begin, end) whose tiles with the K/V block at
    ``col0`` are not SKIP (exactly those); begin is a multiple of block_r; (0, 0) when empty."""
    if col0 < 0 or col0 >= seqlen_k or seqlen_q <= 0:
        return (0, 0)
    shift, lo, hi = band(seqlen_q, seqlen_k, causal=causal, window=window, top_left=top_left)
    col_last = min(col0 + block_c, seqlen_k) - 1
    first, last = 0, seqlen_q - 1
    if hi is not None:
        first = max(first, col0 - shift - hi)
    if lo is not None:
        last = min(last, col_last - shift - lo)
    if first > last:
        return (0, 0)
    return (first // block_r * block_r, last + 1)


def q_block_kv_range(row0: int, seqlen_q: int, seqlen_k: int, *, block_r: int, block_c: int, causal: bool,
                     window: Sequence[int] = NO_WINDOW, top_left: bool = False) -> tuple[int, int]:
    """Forward inner-loop bounds: the keys [begin, end) whose tiles with the Q block at ``row0``
    are not SKIP (exactly those); begin is a multiple of block_c; (0, 0) when empty."""
    if row0 < 0 or row0 >= seqlen_q or seqlen_k <= 0:
        return (0, 0)
    shift, lo, hi = band(seqlen_q, seqlen_k, causal=causal, window=window, top_left=top_left)
    row_last = min(row0 + block_r, seqlen_q) - 1
    first, last = 0, seqlen_k - 1
    if lo is not None:
        first = max(first, row0 + shift + lo)
    if hi is not None:
        last = min(last, row_last + shift + hi)
    if first > last:
        return (0, 0)
    return (first // block_c * block_c, last + 1)


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum_{i=0}^{n-1} floor((a*i + b) / m) for n >= 0, m >= 1, a >= 0, b >= 0, in O(log m)
    steps (the Euclidean-like reduction of the AtCoder Library's floor_sum)."""
    if n <= 0:
        return 0
    if m < 1 or a < 0 or b < 0:
        raise ValueError(f"floor_sum needs m >= 1, a >= 0, b >= 0, got m={m}, a={a}, b={b}")
    ans = 0
    while True:
        if a >= m:
            ans += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            ans += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return ans
        n, b = divmod(y_max, m)
        m, a = a, m


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)


def _sum_count_below(i_lo: int, i_hi: int, a: int, c: int | None, m: int, f: int) -> int:
    """sum over i in [i_lo, i_hi) of #{j in [0, f): j <= floor((a*i + c) / m)}, i.e. of
    min(max(floor((a*i + c) / m) + 1, 0), f); a >= 1. ``c`` None: +infinity (every j counts)."""
    if i_hi <= i_lo or f <= 0:
        return 0
    if c is None:
        return f * (i_hi - i_lo)
    i_z = max(i_lo, min(i_hi, _cdiv(-c, a)))  # first i with a*i + c >= 0
    i_f = max(i_z, min(i_hi, _cdiv((f - 1) * m - c, a)))  # first i with floor(.) + 1 >= f
    n = i_f - i_z
    return f * (i_hi - i_f) + (floor_sum(n, m, a, a * i_z + c) + n if n > 0 else 0)


def _blocks_in_band(i_lo: int, i_hi: int, br: int, bc: int, f: int, c_hi: int | None, c_lo: int | None) -> int:
    """sum over Q blocks i in [i_lo, i_hi) of #{j in [0, f): ceil((br*i + c_lo) / bc) <= j <=
    floor((br*i + c_hi) / bc)} (None: unbounded) as a difference of two prefix counts; exact
    when c_hi >= c_lo - 1, so that the interval is empty or proper for every i."""
    upper = _sum_count_below(i_lo, i_hi, br, c_hi, bc, f)
    # j < ceil(x / bc)  <=>  j <= floor((x - 1) / bc)
    lower = 0 if c_lo is None else _sum_count_below(i_lo, i_hi, br, c_lo - 1, bc, f)
    return upper - lower


def tile_counts(seqlen_q: int, seqlen_k: int, block_r: int, block_c: int, causal: bool,
                key_padding: bool, *, window: Sequence[int] = NO_WINDOW, top_left: bool = False,
                attn_mask: bool = False) -> dict[str, int]:
    """Tiles of one (batch, head): ``total`` = Tr x Tc, ``visited`` (not SKIP), ``skipped``,
    ``fully_visible`` (FULL); plus ``rows_visited`` (Q rows inside the sequence summed over the
    visited tiles: what the backward reloads) and ``cols_visited`` (keys, likewise: what the
    forward reloads). Closed form (floor sums, O(log N)), no per-tile work."""
    for name, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    for name, v in (("block_r", block_r), ("block_c", block_c)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    nq, nk, br, bc = seqlen_q, seqlen_k, block_r, block_c
    tr, tc = _cdiv(nq, br), _cdiv(nk, bc)
    total = tr * tc
    if total == 0:
        return {"total": 0, "visited": 0, "skipped": 0, "fully_visible": 0, "rows_visited": 0, "cols_visited": 0}
    shift, lo, hi = band(nq, nk, causal=causal, window=window, top_left=top_left)
    kw = dict(causal=causal, window=window, top_left=top_left)

    # Visited: a whole Q block i (i < Tr - 1, rows i*br .. i*br + br - 1) sees the keys
    # [i*br + shift + lo, i*br + br - 1 + shift + hi]; K/V block j is visited iff it meets them,
    # for the Q blocks whose band meets [0, Nk) at all. The last Q block is counted directly.
    i_a, i_b = 0, tr - 1
    if hi is not None:  # i*br + br - 1 + shift + hi >= 0
        i_a = max(i_a, _cdiv(-(br - 1 + shift + hi), br))
    if lo is not None:  # i*br + shift + lo <= nk - 1
        i_b = min(i_b, (nk - 1 - shift - lo) // br + 1)
    visited = 0
    if i_b > i_a:
        visited = _blocks_in_band(i_a, i_b, br, bc, tc, None if hi is None else br - 1 + shift + hi,
                                  None if lo is None else shift + lo - bc + 1)
    c0, c1 = q_block_kv_range((tr - 1) * br, nq, nk, block_r=br, block_c=bc, **kw)
    last_q_visits = _cdiv(c1 - c0, bc) if c1 > c0 else 0
    visited += last_q_visits

    # FULL: whole Q blocks i < Nq // br and whole K/V blocks j < Nk // bc with every offset
    # j*bc - (i*br + br - 1) - shift >= lo and j*bc + bc - 1 - i*br - shift <= hi.
    full = 0
    fr, fc = nq // br, nk // bc
    if not (key_padding or attn_mask) and fr > 0 and fc > 0:
        c_hi = None if hi is None else shift + hi - bc + 1
        c_lo = None if lo is None else br - 1 + shift + lo
        if c_hi is None or c_lo is None or c_hi - c_lo >= 0:  # else the band is narrower than a tile
            full = _blocks_in_band(0, fr, br, bc, fc, c_hi, c_lo)

    # Rows (keys) of the sequence in the visited tiles: every visited tile holds block_r rows
    # except the last Q block's; likewise keys, the last K/V block being visited by the
    # contiguous run of Q blocks its range names.
    rows_visited = visited * br - (tr * br - nq) * last_q_visits
    q_lo, q_hi = kv_block_q_range((tc - 1) * bc, nq, nk, block_r=br, block_c=bc, **kw)
    q_blocks_last_col = _cdiv(q_hi - q_lo, br) if q_hi > q_lo else 0
    cols_visited = visited * bc - (tc * bc - nk) * q_blocks_last_col
    return {"total": total, "visited": visited, "skipped": total - visited, "fully_visible": full,
            "rows_visited": rows_visited, "cols_visited": cols_visited}


__all__ = ["TileKind", "Window", "NO_WINDOW", "CAUSAL_ALIGNS", "check_window", "check_causal_align", "band",
           "allowed", "tile_kind", "kv_block_q_range",
           "q_block_kv_range", "floor_sum", "tile_counts"]
