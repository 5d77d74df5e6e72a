"""The Hopper family's shared-memory panels: every Q / K / V / dO tile is whole 128-byte swizzle
panels wide (64 elements of a 16-bit dtype), each panel one TMA box with the swizzle the wgmma
descriptors read."""
from __future__ import annotations

__all__ = ["PANEL", "SWIZZLE", "padded_dim"]

#: The smem swizzle span (bytes) of every TMA box and wgmma descriptor: one panel row.
SWIZZLE = 128
PANEL = SWIZZLE // 2  # elements of a 16-bit dtype per panel row


def padded_dim(head_dim: int) -> int:
    """The head dim in whole panels: the width of the Q / K / V / dO tiles in shared memory and the
    N of the wgmmas whose N is the head dim (O += P V; dV, dK, dQ), 128 for d = 96 (its TMA loads
    zero-fill columns 96..127: the tensor maps end at the head dim)."""
    return -(-head_dim // PANEL) * PANEL
