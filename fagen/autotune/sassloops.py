"""The main loop of a kernel's SASS, split into its nested loops and the rest.

The cost model needs *dynamic* instruction counts per tile pair. The SASS gives static
counts; the main loop over tiles (the widest span closed by a backward branch) runs once per
tile pair, and the innermost loops nested in it (the k loops of the GEMMs) run some number
of times per tile pair that the model solves for from the FLOPs it knows exactly: math
instructions per pair = outer math + R x inner math. Code in loops between the two levels
is counted once, so the estimate is a lower bound on the instructions issued (an upper bound
on throughput: a ceiling). ``fagen.sass`` disassembles
(``nvdisasm``); without a disassembler everything here returns None.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .. import sass


Mix = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class LoopMix:
    """Opcode counts of a kernel's main loop: ``inner`` inside its innermost nested loops,
    ``outer`` the rest."""

    outer: Mix
    inner: Mix

    def count(self, opcode: str, *, inner: bool) -> int:
        return dict(self.inner if inner else self.outer).get(opcode, 0)

    def total(self, *, inner: bool) -> int:
        return sum(n for _, n in (self.inner if inner else self.outer))

    def merged(self) -> dict[str, int]:
        """The whole main loop's static opcode counts (what ``Family.pair_cost`` receives)."""
        out = dict(self.outer)
        for op, n in self.inner:
            out[op] = out.get(op, 0) + n
        return out


@functools.lru_cache(maxsize=256)
def main_loop_mix(cubin: bytes, kernel: str) -> LoopMix | None:
    """The split mix of ``kernel``'s main loop, or None (no disassembler, no loop); remembered per
    (cubin, kernel) for the process (a LoopMix is immutable)."""
    text = sass.disassemble(cubin)
    if text is None:
        return None
    instrs = sass.parse(text).get(kernel)
    spans = sass.loop_spans(text).get(kernel, [])
    if not instrs or not spans:
        return None
    main = max(spans, key=lambda s: (s[1] - s[0], -s[0]))
    nested = [s for s in spans if s != main and main[0] <= s[0] and s[1] <= main[1]]
    innermost = [s for s in nested if not any(t != s and s[0] <= t[0] and t[1] <= s[1] for t in nested)]
    outer: dict[str, int] = {}
    inner: dict[str, int] = {}
    for ins in instrs:
        if not main[0] <= ins.address <= main[1]:
            continue
        bucket = inner if any(a <= ins.address <= b for a, b in innermost) else outer
        bucket[ins.opcode] = bucket.get(ins.opcode, 0) + 1
    return LoopMix(tuple(sorted(outer.items())), tuple(sorted(inner.items())))


def dynamic_instructions(loop: LoopMix, math_opcode: str, math_per_warp: float) -> float | None:
    """Warp instructions one warp issues per tile pair, given how many math instructions it
    issues (known from the FLOPs): inner loops repeat R times, R = (math - outer math) /
    inner math; when that does not hold (no math inside nested loops, R < 1) the loop is
    scaled as a whole. None when the loop has no math instruction at all."""
    outer_m, inner_m = loop.count(math_opcode, inner=False), loop.count(math_opcode, inner=True)
    if outer_m + inner_m == 0:
        return None
    if inner_m > 0:
        r = (math_per_warp - outer_m) / inner_m
        if r >= 1:
            return loop.total(inner=False) + r * loop.total(inner=True)
    total = loop.total(inner=False) + loop.total(inner=True)
    return total * math_per_warp / (outer_m + inner_m)
