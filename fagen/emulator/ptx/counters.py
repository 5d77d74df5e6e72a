"""Memory counters of the PTX level, the way Nsight Compute counts them (docs/emulator.md,
"Memory counters").

With ``counters=True`` the translator (translate.py) numbers every memory instruction of the PTX
(a *site*: ``ld`` / ``st`` / ``ldu`` / ``atom`` / ``red`` of the shared, global or generic space,
``ldmatrix``, ``stmatrix``, ``cp.async``; ``translate.counter_site``) and calls ``counters.h``'s ``note()`` before it with the
lane's address(es) and its dynamic execution count of the site; ``counters.h`` groups the lanes of
a warp into warp-level requests and counts shared-memory wavefronts (bank conflicts) and global
32-byte sectors per site. This module enumerates the sites, finds each kernel's tile loop in the
PTX's branch structure, and reads the counts back (:class:`KernelCounters`).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from .parser import Inst

#: Bumped whenever the counting code the translator emits changes (part of a counting build's cache key).
COUNTERS_VERSION = "1"

# counters.h's Kind
SHARED, GLOBAL, GENERIC, MATRIX, CP_ASYNC, BULK = range(6)
KIND_NAMES = {SHARED: "shared", GLOBAL: "global", GENERIC: "generic", MATRIX: "matrix", CP_ASYNC: "cp.async",
              BULK: "bulk"}
_NVALUES = 10  # counters.h's Stat

# The instructions that mark a backward branch's range as the kernel's tile loop.
_LOOP_MARKERS = ("mma.sync", "wgmma.mma_async", "bar.sync", "barrier.sync", "cp.async", "ldmatrix")


@functools.cache
def header_text() -> str:
    return resources.files(__package__).joinpath("counters.h").read_text()


@dataclass(frozen=True)
class Site:
    """One memory instruction of the PTX (static information)."""
    index: int          # module-wide site number (counters.h's table)
    entry: str          # the .entry (kernel) it is in
    line: int           # PTX line
    opcode: str
    kind: str           # "shared", "global", "generic" (resolved per lane at run time), "matrix", "cp.async",
                        # "bulk" (TMA / bulk copies: copies and bytes only)
    size: int           # bytes per lane (ldmatrix / stmatrix: 16 per row address)
    in_loop: bool       # inside the kernel's tile loop (see :func:`tile_loop_ranges`)


def tile_loop_ranges(fn: Any, insts: list[Inst]) -> list[tuple[int, int]]:
    """The PTX line ranges of the kernel's tile loop: every backward ``bra`` (its target label at
    an earlier line) spans a loop [label line, branch line]; loops nested in or overlapping another
    merge into the outermost range; the ranges that contain an ``mma.sync``, a
    ``wgmma.mma_async``, a block barrier (``bar.sync`` / ``barrier.sync``), a ``cp.async`` or an
    ``ldmatrix`` are the tile loop (a kernel whose main loop is fully unrolled has none)."""
    label_line: dict[str, int] = {}
    for st in fn.entry.body:
        if st.kind == "label":
            label_line[fn.labels[st.scope][st.text]] = st.line
    loops = []
    for inst in insts:
        if inst.parts[0] != "bra":
            continue
        fn.cur = inst
        if len(inst.operands) != 1:
            continue  # malformed: the translator reports it
        target = label_line.get(fn.label(inst.operands[0]))
        if target is not None and target < inst.line:
            loops.append((target, inst.line))
    loops.sort()
    merged: list[list[int]] = []
    for lo, hi in loops:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out = []
    for lo, hi in merged:
        if any(lo <= i.line <= hi and i.opcode.startswith(_LOOP_MARKERS) for i in insts):
            out.append((lo, hi))
    return out


# ------------------------------------------------------------------ results
@dataclass
class SiteCounters:
    """The counts of one site over the launches counted."""
    site: Site
    shared_requests: int = 0
    wavefronts: int = 0
    ideal_wavefronts: int = 0
    shared_bytes: int = 0
    global_requests: int = 0
    sectors: int = 0
    ideal_sectors: int = 0
    global_bytes: int = 0
    bulk_copies: int = 0
    bulk_bytes: int = 0

    @property
    def excess_wavefronts(self) -> int:
        return self.wavefronts - self.ideal_wavefronts

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.site.line, "opcode": self.site.opcode, "kind": self.site.kind,
                "bytes_per_lane": self.site.size, "tile_loop": self.site.in_loop,
                "shared_requests": self.shared_requests, "wavefronts": self.wavefronts,
                "ideal_wavefronts": self.ideal_wavefronts, "shared_bytes": self.shared_bytes,
                "global_requests": self.global_requests, "sectors": self.sectors,
                "ideal_sectors": self.ideal_sectors, "global_bytes": self.global_bytes,
                "bulk_copies": self.bulk_copies, "bulk_bytes": self.bulk_bytes}


_FIELDS = ("shared_requests", "wavefronts", "ideal_wavefronts", "shared_bytes", "global_requests", "sectors",
           "ideal_sectors", "global_bytes", "bulk_copies", "bulk_bytes")


@dataclass
class Totals:
    """Sums over a set of sites (a kernel, its tile loop, the rest)."""
    shared_requests: int = 0
    wavefronts: int = 0
    ideal_wavefronts: int = 0
    shared_bytes: int = 0
    global_requests: int = 0
    sectors: int = 0
    ideal_sectors: int = 0
    global_bytes: int = 0
    bulk_copies: int = 0
    bulk_bytes: int = 0

    @property
    def excess_wavefronts(self) -> int:
        return self.wavefronts - self.ideal_wavefronts

    @property
    def wavefronts_per_request(self) -> float:
        return self.wavefronts / self.shared_requests if self.shared_requests else 0.0

    @property
    def sectors_per_request(self) -> float:
        return self.sectors / self.global_requests if self.global_requests else 0.0

    @property
    def ideal_sectors_per_request(self) -> float:
        return self.ideal_sectors / self.global_requests if self.global_requests else 0.0

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f: getattr(self, f) for f in _FIELDS}
        d.update(excess_wavefronts=self.excess_wavefronts,
                 wavefronts_per_request=round(self.wavefronts_per_request, 4),
                 sectors_per_request=round(self.sectors_per_request, 4),
                 ideal_sectors_per_request=round(self.ideal_sectors_per_request, 4))
        return d


def _total(sites: list[SiteCounters]) -> Totals:
    t = Totals()
    for s in sites:
        for f in _FIELDS:
            setattr(t, f, getattr(t, f) + getattr(s, f))
    return t


@dataclass
class KernelCounters:
    """The memory counters of one kernel: ``sites`` by PTX line; ``total``, ``tile_loop`` (the
    sites inside the tile loop) and ``other`` (prologue, epilogue) sums."""
    kernel: str
    sites: list[SiteCounters] = field(default_factory=list)

    @property
    def total(self) -> Totals:
        return _total(self.sites)

    @property
    def tile_loop(self) -> Totals:
        return _total([s for s in self.sites if s.site.in_loop])

    @property
    def other(self) -> Totals:
        return _total([s for s in self.sites if not s.site.in_loop])

    def site(self, line: int) -> SiteCounters:
        """The counters of the site at PTX line ``line``."""
        for s in self.sites:
            if s.site.line == line:
                return s
        raise KeyError(f"kernel {self.kernel}: no memory instruction at PTX line {line}")

    def add(self, other: KernelCounters) -> None:
        mine = {s.site.index: s for s in self.sites}
        for s in other.sites:
            m = mine.get(s.site.index)
            if m is None:
                self.sites.append(SiteCounters(s.site, **{f: getattr(s, f) for f in _FIELDS}))
            else:
                for f in _FIELDS:
                    setattr(m, f, getattr(m, f) + getattr(s, f))

    def as_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "total": self.total.as_dict(), "tile_loop": self.tile_loop.as_dict(),
                "other": self.other.as_dict(), "sites": [s.as_dict() for s in self.sites if
                                                         s.shared_requests or s.global_requests or s.bulk_copies]}


def read(lib: ctypes.CDLL, sites: list[Site]) -> dict[str, KernelCounters]:
    """The counts accumulated in ``lib`` since its last reset, per kernel (closes pending groups)."""
    n = len(sites)
    buf = (ctypes.c_uint64 * (_NVALUES * max(n, 1)))()
    lib.fagen_pxc_read(buf, ctypes.c_uint(n))
    out: dict[str, KernelCounters] = {}
    for s in sites:
        vals = buf[_NVALUES * s.index: _NVALUES * (s.index + 1)]
        kc = out.setdefault(s.entry, KernelCounters(s.entry))
        kc.sites.append(SiteCounters(s, *vals))
    return out
