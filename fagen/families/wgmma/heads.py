"""The head dims the Hopper family takes: every multiple of 8 in 8..256, each computed in whole
128-byte swizzle panels (:func:`~fagen.families.wgmma.panels.padded_dim`: 64, 128, 192, 256) where
that is cheaper than the ``mma`` family's kernel of the real head dim, declined by name otherwise."""
from __future__ import annotations

from fagen.families.base import FamilySpec

__all__ = ["padded_reason"]


def padded_reason(fs: FamilySpec) -> str | None:
    """Why the family declines the spec's head dims (``head_dim``, then ``head_dim_v``), or None."""
    for name, d in (("head_dim", fs.head_dim), ("head_dim_v", fs.dv)):
        if d % 8 or not 8 <= d <= 256:
            return f"{name}={d}: the wgmma templates take a multiple of 8 in 8..256"
    return None
