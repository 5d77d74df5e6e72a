"""Shared-memory layout: the one place a kernel's smem footprint is computed.

A family describes its buffers (name, C type, element count); this module
places them at 16-byte aligned offsets. The template receives the same offsets
as constexprs and ``static_assert``s that its own ``sizeof``-based arithmetic
reaches the same total, so the Python footprint and the kernel cannot drift.
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 16


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Buffer:
    name: str  # identifier used in the template (s_<name>)
    ctype: str  # "T" (the spec's dtype) or "float"
    count: int  # elements
    itemsize: int  # bytes per element
    offset: int  # bytes from the start of dynamic smem

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


@dataclass(frozen=True)
class SmemLayout:
    buffers: tuple[Buffer, ...]

    @property
    def total_bytes(self) -> int:
        if not self.buffers:
            return 0
        last = self.buffers[-1]
        return align_up(last.offset + last.nbytes)

    def breakdown(self) -> dict[str, int]:
        """Buffer name -> bytes (alignment padding folded into the buffer before it)."""
        out: dict[str, int] = {}
        for i, b in enumerate(self.buffers):
            end = self.buffers[i + 1].offset if i + 1 < len(self.buffers) else self.total_bytes
            out[b.name] = end - b.offset
        return out


def place(entries: list[tuple[str, str, int, int]]) -> SmemLayout:
    """Lay out ``(name, ctype, count, itemsize)`` entries in order, 16-byte aligned."""
    off = 0
    bufs = []
    for name, ctype, count, itemsize in entries:
        off = align_up(off)
        bufs.append(Buffer(name, ctype, count, itemsize, off))
        off += count * itemsize
    return SmemLayout(tuple(bufs))
