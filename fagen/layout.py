"""Shared-memory layout: the one place a kernel's smem footprint is computed.

A family describes its buffers (name, C type, element count, and optionally
an alignment in bytes); this module places them in order, each at an offset
that is a multiple of its alignment (16 bytes unless the family asks for
more, e.g. 128 for a swizzled tile read by ``ldmatrix``). The template
receives the same offsets as constexprs and ``static_assert``s that its own
``sizeof``-based arithmetic reaches the same offsets and total, so the Python
footprint and the kernel cannot drift.
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
    align: int = ALIGN  # the offset is a multiple of this (bytes, a power of two >= 16)

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

    @property
    def max_align(self) -> int:
        """The largest buffer alignment: the dynamic smem base must be aligned at least this much."""
        return max((b.align for b in self.buffers), default=ALIGN)

    def breakdown(self) -> dict[str, int]:
        """Buffer name -> bytes (alignment padding folded into the buffer before it)."""
        out: dict[str, int] = {}
        for i, b in enumerate(self.buffers):
            end = self.buffers[i + 1].offset if i + 1 < len(self.buffers) else self.total_bytes
            out[b.name] = end - b.offset
        return out


Entry = tuple[str, str, int, int] | tuple[str, str, int, int, int]


def place(entries: list[Entry]) -> SmemLayout:
    """Lay out ``(name, ctype, count, itemsize[, align])`` entries in order; ``align`` (bytes,
    a power of two >= 16) defaults to 16."""
    off = 0
    bufs = []
    for entry in entries:
        name, ctype, count, itemsize = entry[:4]
        align = entry[4] if len(entry) > 4 else ALIGN  # type: ignore[misc]
        if align < ALIGN or align & (align - 1):
            raise ValueError(f"smem buffer {name!r}: align must be a power of two >= {ALIGN}, got {align}")
        off = align_up(off, align)
        bufs.append(Buffer(name, ctype, count, itemsize, off, align))
        off += count * itemsize
    return SmemLayout(tuple(bufs))
