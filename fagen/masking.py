"""The masking rule in Python: the same functions as templates/partials/masking.cuh.

Which elements a query row may attend to (``allowed``), which (Q block, K/V
block) tiles a kernel visits and which of them need no mask math
(``tile_kind``), and the inner-loop bounds of the backward (``kv_block_q_range``)
and forward (``q_block_kv_range``) kernels. Causal is bottom-right aligned:
row ``r`` may attend to key ``c`` iff ``c <= r + Nk - Nq``. A tile is rows
``[row0, row0 + block_r)`` x keys ``[col0, col0 + block_c)``.

``tile_counts`` counts the tiles of one (batch, head) in closed form (O(log N)
integer arithmetic, no per-tile loop), so the autotuner's cost model costs the
same at N = 2**40 as at N = 1024. tests/test_masking.py checks every function
against the C++ rule compiled with g++ and ``tile_counts`` against a per-tile
count.
"""
from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum


class TileKind(IntEnum):
    SKIP = 0  # no element is allowed: never visited
    PARTIAL = 1  # visited, with mask math
    FULL = 2  # visited, every element allowed: no mask math


def allowed(row: int, col: int, seqlen_q: int, seqlen_k: int, *, causal: bool,
            kpm: Sequence[int] | None = None, b: int = 0) -> bool:
    """May query ``row`` attend to key ``col``? ``kpm`` (flattened [B, Nk], nonzero = the key
    takes part) is the key-padding mask, None without key padding."""
    if row < 0 or col < 0 or row >= seqlen_q or col >= seqlen_k:
        return False
    if causal and col > row + seqlen_k - seqlen_q:
        return False
    if kpm is not None and kpm[b * seqlen_k + col] == 0:
        return False
    return True


def tile_kind(row0: int, col0: int, seqlen_q: int, seqlen_k: int, *, block_r: int, block_c: int,
              causal: bool, key_padding: bool) -> TileKind:
    """SKIP if no element of the tile is allowed; FULL if every element is allowed without mask
    math (inside both sequences, causal satisfied, never with key padding); PARTIAL otherwise."""
    if row0 < 0 or col0 < 0 or row0 >= seqlen_q or col0 >= seqlen_k:
        return TileKind.SKIP
    shift = seqlen_k - seqlen_q
    row_last = min(row0 + block_r, seqlen_q) - 1
    if causal and col0 > row_last + shift:
        return TileKind.SKIP
    if key_padding or row0 + block_r > seqlen_q or col0 + block_c > seqlen_k:
        return TileKind.PARTIAL
    if causal and col0 + block_c - 1 > row0 + shift:
        return TileKind.PARTIAL
    return TileKind.FULL


def kv_block_q_range(col0: int, seqlen_q: int, seqlen_k: int, *, block_r: int, causal: bool) -> tuple[int, int]:
    """Backward inner-loop bounds: the Q rows [begin, end) whose tiles with the K/V block at
    ``col0`` are not SKIP; begin is a multiple of block_r; (0, 0) when empty."""
    if col0 < 0 or col0 >= seqlen_k or seqlen_q <= 0:
        return (0, 0)
    first = 0
    if causal:
        first = max(0, col0 - seqlen_k + seqlen_q)
        if first >= seqlen_q:
            return (0, 0)
    return (first // block_r * block_r, seqlen_q)


def q_block_kv_range(row0: int, seqlen_q: int, seqlen_k: int, *, block_r: int, causal: bool) -> tuple[int, int]:
    """Forward inner-loop bounds: the keys [begin, end) whose tiles with the Q block at ``row0``
    are not SKIP; begin is a multiple of the K/V block (0); (0, 0) when empty."""
    if row0 < 0 or row0 >= seqlen_q or seqlen_k <= 0:
        return (0, 0)
    end = seqlen_k
    if causal:
        end = max(0, min(seqlen_k, min(row0 + block_r, seqlen_q) + seqlen_k - seqlen_q))
    return (0, end)


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


def tile_counts(seqlen_q: int, seqlen_k: int, block_r: int, block_c: int, causal: bool,
                key_padding: bool) -> dict[str, int]:
    """Tiles of one (batch, head): ``total`` = Tr x Tc, ``visited`` (not SKIP), ``skipped``,
    ``fully_visible`` (FULL); plus ``rows_visited`` (Q rows inside the sequence summed over the
    visited tiles: what the backward reloads) and ``cols_visited`` (keys, likewise: what the
    forward reloads). Closed form, no per-tile work."""
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
    fr, fc = nq // br, nk // bc  # blocks lying wholly inside the sequences
    shift = nk - nq
    if not causal:
        visited = total
        full = 0 if key_padding else fr * fc
    else:
        # Q block i < Tr-1 visits ceil(x_i / bc) K/V blocks, x_i = (i+1)*br + shift (clamped to
        # [0, nk); x_i < nk for every i < Tr-1); the last Q block visits all Tc of them.
        i_lo = max(0, (-shift) // br)  # the first Q block with x_i > 0
        visited = tc + floor_sum(tr - 1 - i_lo, bc, br, br * (i_lo + 1) + shift + bc - 1)
        full = 0
        if not key_padding and fc > 0 and fr > 0:
            # whole Q block i: K/V blocks j < min(fc, floor(y_i / bc)) are FULL, y_i = i*br + shift + 1
            i_a = max(0, _cdiv(bc - shift - 1, br))  # the first i with at least one FULL tile
            i_b = max(0, _cdiv(fc * bc - shift - 1, br))  # the first i with fc FULL tiles
            lo, hi = i_a, min(i_b, fr)
            if hi > lo:
                full += floor_sum(hi - lo, bc, br, lo * br + shift + 1)
            full += fc * max(0, fr - i_b)
    # Rows (keys) of the sequence in the visited tiles: every visited tile holds block_r rows
    # except the last Q block's, which every K/V block visits (its range always reaches Nq);
    # likewise for keys, where the last K/V block is visited by the Q blocks its range names.
    rows_visited = visited * br - (tr * br - nq) * tc
    q_lo, q_hi = kv_block_q_range((tc - 1) * bc, nq, nk, block_r=br, causal=causal)
    q_blocks_last_col = _cdiv(q_hi - q_lo, br) if q_hi > q_lo else 0
    cols_visited = visited * bc - (tc * bc - nk) * q_blocks_last_col
    return {"total": total, "visited": visited, "skipped": total - visited, "fully_visible": full,
            "rows_visited": rows_visited, "cols_visited": cols_visited}


__all__ = ["TileKind", "allowed", "tile_kind", "kv_block_q_range", "q_block_kv_range", "floor_sum", "tile_counts"]
