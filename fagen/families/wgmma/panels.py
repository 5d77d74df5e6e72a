"""The Hopper family's shared-memory panels: every Q / K / V / dO tile is whole 128-byte swizzle
panels wide (64 elements of a 16-bit dtype), each panel one TMA box with the swizzle the wgmma
descriptors read; a packed (varlen) tensor is mapped as one batch (:func:`packed_view`)."""
from __future__ import annotations

from typing import Any

__all__ = ["PANEL", "SWIZZLE", "k16_steps", "packed_view", "padded_dim"]

#: The smem swizzle span (bytes) of every TMA box and wgmma descriptor: one panel row.
SWIZZLE = 128
PANEL = SWIZZLE // 2  # elements of a 16-bit dtype per panel row


def padded_dim(head_dim: int) -> int:
    """The head dim in whole panels: the width of the Q / K / V / dO tiles in shared memory and the
    N of the wgmmas whose N is the head dim (O += P V; dV, dK, dQ), 128 for d = 96 (its TMA loads
    zero-fill columns 96..127: the tensor maps end at the head dim)."""
    return -(-head_dim // PANEL) * PANEL


def k16_steps(head_dim: int) -> int:
    """The k16 wgmmas of a k loop over the head dim (S = Q K^T, dP = dO V^T): whole steps of 16 columns,
    the last one half zero fill where the head dim is an odd number of 8-column groups (d = 40, 72, ...;
    the TMA loads zero-fill the panel past the head dim, so those columns add nothing)."""
    return -(-head_dim // 16)


def packed_view(x: Any) -> Any:
    """A packed tensor (varlen: [total, H, d]) as the one batch of the [B, N, H, d] maps ([1, total, H, d]):
    row r of sequence b is row ``cu_seqlens[b] + r`` of batch 0. One map per tensor and call, whatever the
    sequences; a tile past its sequence's end reads the next sequence's rows (the kernels mask them)."""
    return x[None]
