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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


# ---------------------------------------------------------------------------------------------
# The steady-state tile loop, walked: what one interior tile pair issues (benchmarks/sass_cost.py)
# ---------------------------------------------------------------------------------------------
#: Opcodes whose presence marks a region as doing a tile pair's work (memory, shared memory, tensor
#: cores, barriers, shuffles): a forward branch over a region with none of them but with floating-point
#: arithmetic is the mask of a tile that is not fully visible (it zeroes P and dS), skipped on an
#: interior tile; one over integer arithmetic only (an address a valid row computes) is executed.
WORK_PREFIXES = ("LD", "ST", "RED", "ATOM", "HMMA", "BAR", "SHFL", "MEMBAR", "DEPBAR", "CCTL", "SYNCS",
                 "UTMA", "WGMMA", "HGMMA")
#: Opcode classes of the report (instr / HMMA, LDSM / HMMA, int+ctrl / HMMA).
INT_OPCODES = frozenset({"IMAD", "IADD3", "IADD", "VIADD", "LEA", "SHF", "LOP3", "ISETP", "SEL", "MOV", "PRMT", "IABS",
                         "IMNMX", "VIMNMX", "POPC", "FLO", "BMSK", "BREV", "SGXT", "P2R", "R2P", "PLOP3", "S2R", "CS2R",
                         "S2UR", "LDC", "ULDC", "IMUL", "I2F", "F2I", "I2I", "VOTE", "VOTEU", "LOP", "SHL", "SHR",
                         "BFE", "BFI", "IDP", "IMMA", "CS2UR", "R2UR", "UMOV"})
CTRL_OPCODES = frozenset({"BRA", "JMP", "BSSY", "BSYNC", "WARPSYNC", "EXIT", "RET", "CALL", "NOP", "YIELD", "BREAK",
                          "BPT", "KILL", "JMX", "BRX", "ELECT", "ACQBULK", "ENDCOLLECTIVE"})
_TARGET_LABEL = re.compile(r"`\(([.\w$]+)\)")


def opcode_class(opcode: str) -> str:
    """``tensor`` (HMMA/GMMA), ``ldsm``, ``mem`` (global/shared/local memory, barriers), ``int`` (integer,
    predicate and uniform-datapath arithmetic), ``ctrl`` (branches, convergence) or ``fp``."""
    if opcode in ("HMMA", "HGMMA", "WGMMA", "IMMA"):
        return "tensor"
    if opcode == "LDSM":
        return "ldsm"
    if opcode in CTRL_OPCODES:
        return "ctrl"
    if opcode.startswith(("LD", "ST", "RED", "ATOM", "BAR", "DEPBAR", "MEMBAR", "CCTL", "SYNCS", "UTMA")) and \
            opcode not in ("LDC",):
        return "mem"
    if opcode in INT_OPCODES or (opcode.startswith("U") and opcode != "UTMA"):
        return "int"
    return "fp"


@dataclass(frozen=True)
class Loop:
    head: int  # address of the first instruction
    end: int  # address of the backward branch that closes it
    trips: float  # per trip of the enclosing loop (solved, see TileLoop)


@dataclass(frozen=True)
class TileLoop:
    """One steady-state trip of a kernel's tile loop, walked on the path an interior tile pair takes.

    ``mix``: opcode -> warp instructions one (average) warp issues; ``loops``: the nested loops with
    the trip counts solved from the work they must do; ``unsolved``: nested loops whose trip count
    could not be solved (counted once)."""

    kernel: str
    head: int
    end: int
    mix: tuple[tuple[str, float], ...]
    loops: tuple[Loop, ...]
    unsolved: tuple[Loop, ...]

    def total(self) -> float:
        return sum(n for _, n in self.mix)

    def count(self, *opcodes: str) -> float:
        d = dict(self.mix)
        return sum(d.get(o, 0.0) for o in opcodes)

    def by_class(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for op, n in self.mix:
            c = opcode_class(op)
            out[c] = out.get(c, 0.0) + n
        return out


WORK_OPCODE_CLASSES = ("tensor", "ldsm", "mem")


class _Walker:
    """One trip of a loop walked on the steady-state path (see tile_loop), with memoised paths."""

    def __init__(self, instrs: list[sass.Instruction], labels: dict[str, int], spans: list[tuple[int, int]],
                 diagonal: bool) -> None:
        self.instrs = instrs
        self.index = {ins.address: i for i, ins in enumerate(instrs)}
        self.labels = labels
        self.diagonal = diagonal
        self.spans = spans
        self.trips: dict[tuple[int, int], float] = {}
        self.memo: dict[tuple[int, int, int], tuple[dict[str, float], tuple[tuple[int, int], ...]]] = {}

    def set_trips(self, loop: tuple[int, int], trips: float) -> None:
        self.trips[loop] = trips
        self.memo.clear()

    def target(self, ins: sass.Instruction) -> int | None:
        m = _TARGET_LABEL.search(ins.operands)
        return self.labels.get(m.group(1)) if m else None

    def region(self, lo: int, hi: int) -> list[sass.Instruction]:
        """Instructions at addresses [lo, hi)."""
        return [ins for ins in self.instrs if lo <= ins.address < hi]

    @staticmethod
    def has(instrs: list[sass.Instruction], *prefixes: str) -> bool:
        """Does any instruction's opcode start with one of prefixes (constant loads, LDC, excepted)?"""
        return any(ins.opcode.startswith(prefixes) and ins.opcode not in ("LDC", "ULDC") for ins in instrs)

    def nested_at(self, pc: int, lo: int, hi: int) -> tuple[int, int] | None:
        """The widest loop starting at pc strictly inside [lo, hi]."""
        cands = [s for s in self.spans if s[0] == pc and lo <= s[0] and s[1] < hi and s != (lo, hi)]
        return max(cands, key=lambda s: s[1]) if cands else None

    @staticmethod
    def _unconditional(ins: sass.Instruction) -> bool:
        return not ins.predicate and not ins.operands.split("`")[0].strip()

    def walk(self, lo: int, hi: int, counts: dict[str, float], weight: float,
             visit: list[tuple[int, int]] | None = None) -> None:
        """Add weight x one path through the loop [lo, hi] (hi: its closing backward branch) to counts."""
        c, v = self.path(lo, lo, hi)
        for op, n in c.items():
            counts[op] = counts.get(op, 0.0) + weight * n
        if visit is not None:
            visit.extend(v)

    def path(self, start: int, lo: int, hi: int) -> tuple[dict[str, float], tuple[tuple[int, int], ...]]:
        """Counts of the path from start to the end of a trip of loop [lo, hi], and the nested loops
        it enters (each at its trips)."""
        key = (start, lo, hi)
        if key in self.memo:
            return self.memo[key]
        counts: dict[str, float] = {}
        visit: list[tuple[int, int]] = []

        def add(c: Mapping[str, float], w: float) -> None:
            for op, n in c.items():
                counts[op] = counts.get(op, 0.0) + w * n

        i = self.index[start]
        while i < len(self.instrs) and self.instrs[i].address <= hi:
            ins = self.instrs[i]
            pc = ins.address
            if pc != lo:
                inner = self.nested_at(pc, lo, hi)
                if inner is not None:
                    c, v = self.path(inner[0], inner[0], inner[1])
                    add(c, self.trips.get(inner, 1.0))
                    visit.append(inner)
                    visit.extend(v)
                    i = self.index[inner[1]] + 1
                    continue
            counts[ins.opcode] = counts.get(ins.opcode, 0.0) + 1
            if ins.opcode in ("BRA", "JMP"):
                t = self.target(ins)
                if t is not None:
                    if t <= pc or t > hi:  # back to a loop head or out of the loop
                        if self._unconditional(ins):
                            break  # the trip ends here
                    elif self._unconditional(ins):
                        i = self.index[t]
                        continue
                    elif self.take(pc, t, lo, hi):
                        c, v = self.path(t, lo, hi)
                        add(c, 1.0)
                        visit.extend(v)
                        break
            elif ins.opcode in ("EXIT", "RET") and not ins.predicate:
                break
            i += 1
        out = (counts, tuple(visit))
        self.memo[key] = out
        return out

    @staticmethod
    def _work(c: Mapping[str, float]) -> float:
        return sum(n for op, n in c.items() if opcode_class(op) in WORK_OPCODE_CLASSES or op.startswith("SHFL"))

    def rare_flag(self, pc: int) -> bool | None:
        """For a branch at pc guarded by a huge-score flag -- a predicate last written by a block
        reduction (``B2R.RESULT`` of ``bar.red.or``: fa_sync_or) or a warp vote (``VOTE.ANY``:
        fa_warp_any), the kernels' only uses of either: a step or tile with a row of huge scores
        (templates/partials/common.cuh) -- whether the branch is taken on an ordinary tile pair
        (the flag false): taken iff guarded by the negated flag. None for any other branch."""
        ins = self.instrs[self.index[pc]]
        m = re.fullmatch(r"@(!?)(P\d)", ins.predicate)
        if m is None:
            return None
        neg, reg = m.group(1) == "!", m.group(2)
        word = re.compile(rf"(?<![\w.]){reg}(?!\w)")
        for k in range(self.index[pc] - 1, -1, -1):
            prev = self.instrs[k]
            if not word.search(prev.operands):
                continue
            first = prev.operands.split(",")
            if prev.mnemonic.startswith("B2R.RESULT") and first[-1].strip(" ;") == reg:
                return neg
            if prev.opcode == "VOTE" and ".ANY" in prev.mnemonic and first[0].strip() == reg:
                return neg
            return None
        return None

    def take(self, pc: int, t: int, lo: int, hi: int) -> bool:
        """Is the conditional forward branch at pc to t (inside the loop) taken on the steady path?"""
        rare = self.rare_flag(pc)
        if rare is not None:
            return rare  # the huge-score path is skipped on an ordinary tile pair, like the mask
        body = self.region(pc + 1, t)
        if not body:
            return True
        nxt = self.instrs[self.index[pc] + 1].address
        then_c, _ = self.path(nxt, lo, hi)
        else_c, _ = self.path(t, lo, hi)
        last = body[-1]
        if last.opcode in ("BRA", "JMP") and self._unconditional(last):
            # if/else: the fall-through never reaches t. The side with the 16-byte cp.async (not the
            # element-copy fallback); else the side with more work (memory, tensor cores); with the same
            # work, the shorter (hoisted guards, no mask) on an interior tile, the longer on a diagonal one.
            a, b = then_c.get("LDGSTS", 0.0), else_c.get("LDGSTS", 0.0)
            if a != b:
                return b > a
            wa, wb = self._work(then_c), self._work(else_c)
            if wa != wb:
                return wb > wa
            na, nb = sum(then_c.values()), sum(else_c.values())
            if na == nb:
                return False
            return (nb < na) != self.diagonal
        if self.has(body, *WORK_PREFIXES) or not any(opcode_class(ins.opcode) == "fp" for ins in body):
            return False  # work, or integer set-up (an address a valid row computes)
        return not self.diagonal  # floating-point guard arithmetic: the mask of a partial tile


def tile_loop(text: str, kernel: str, work: Mapping[str, float], *, diagonal: bool = False,
              anchor: tuple[str, ...] = ("HMMA", "HGMMA"), smallest: bool = False) -> TileLoop | None:
    """Walk ``kernel``'s tile loop in ``nvdisasm`` text ``text``: the loop holding the most tensor-core
    instructions (the smallest such whose walked trip issues the ``work`` of the anchor opcodes: where ptxas
    rolled the GEMMs into a loop of their own, the loop enclosing it), one trip on the path of an interior, fully visible tile pair
    (``diagonal``: a partially masked one) with 16-byte-aligned tensors.

    ``work``: warp instructions one (average) warp must issue per tile pair for some opcodes (e.g.
    ``{"HMMA": ..., "LDGSTS": ..., "REDG": ...}``), from which the trip count of every nested loop is
    solved, innermost first: a loop whose body holds an opcode of ``work`` that no other unsolved loop
    of the same nest level holds gets trips = (work - what the rest of the path issues) / its body's
    count (the opcode the fewest loops issue first). Conditional forward branches: over a region with
    work (memory, tensor cores, barriers, shuffles) or with integer set-up only, fall through; over
    floating-point guard arithmetic only (the mask), taken on an interior tile and walked with
    ``diagonal``. Of an if/else (the fall-through ends in an unconditional branch) the side whose path
    issues more 16-byte cp.async (the element-copy fallback for unaligned tensors is not counted), else
    more work, else the shorter on an interior tile (hoisted guards, no mask) and the longer with
    ``diagonal``; an unconditional backward branch ends the trip. ``anchor``: the opcodes that pick the
    loop (a warp-specialised kernel's producer loop is the one holding its TMA loads, ``("UTMALDG",)``);
    ``smallest``: the smallest loop holding one of them instead of the one holding the most (a spin
    wait's out-of-line retry that branches back into an earlier loop closes a span around the loads
    outside the loop too). None when the kernel has no loop with an anchor opcode."""
    instrs = sass.parse(text).get(kernel)
    spans = sorted(set(sass.loop_spans(text).get(kernel, [])))
    if not instrs or not spans:
        return None
    labels = sass.labels(text).get(kernel, {})
    # A span around an unconditional EXIT is no loop: a spin wait's out-of-line retry, placed after
    # the kernel's end, branching back into the code before it.
    exits = [ins.address for ins in instrs if ins.opcode == "EXIT" and not ins.predicate]
    spans = [s for s in spans if not any(s[0] <= a < s[1] for a in exits)] or spans

    def hmma_in(s: tuple[int, int]) -> int:
        return sum(1 for ins in instrs if s[0] <= ins.address <= s[1] and ins.opcode in anchor)

    if smallest:
        held = [s for s in spans if hmma_in(s)]
        best = min(held, key=lambda s: (s[1] - s[0], s[0])) if held else spans[0]
        return _walk_tile_loop(instrs, labels, spans, diagonal, kernel, work, best) if hmma_in(best) else None
    most = max(hmma_in(s) for s in spans)
    if most == 0:
        return None
    # the smallest loop holding the most tensor-core instructions, unless ptxas rolled them into a loop of
    # their own inside the tile loop: then one trip of that inner loop issues a part of the pair's work, and
    # the tile loop is the smallest enclosing one whose trip (the inner loop at its solved trips) issues it all
    tied = sorted((s for s in spans if hmma_in(s) == most), key=lambda s: (s[1] - s[0], s[0]))
    want = sum(work.get(op, 0.0) for op in anchor)
    first = None
    for best in tied:
        loop = _walk_tile_loop(instrs, labels, spans, diagonal, kernel, work, best)
        first = first or loop
        if not want or loop.count(*anchor) >= want * (1 - 1e-3):
            return loop
    return first


def _walk_tile_loop(instrs: list, labels: Mapping, spans: list[tuple[int, int]], diagonal: bool, kernel: str,
                    work: Mapping[str, float], best: tuple[int, int]) -> TileLoop:
    """One trip of loop ``best`` on an interior tile pair's path, its nested loops' trips solved from ``work``
    (:func:`tile_loop`)."""
    w = _Walker(instrs, labels, spans, diagonal)
    nested = [s for s in spans if s != best and best[0] <= s[0] and s[1] <= best[1]]
    unsolved = set(nested)

    def issues(s: tuple[int, int], op: str) -> bool:
        return any(ins.opcode == op for ins in instrs if s[0] <= ins.address <= s[1])

    for _ in range(len(nested) + 1):  # a loop (or a group of like loops) solved per round, at least
        progress = False
        # the opcode that the fewest unsolved loops issue first (dQ reductions before HMMAs)
        for op, want in sorted(work.items(), key=lambda kv: sum(issues(s, kv[0]) for s in unsolved)):
            # the path's counts with the current trips; which unsolved loops issue op on it
            base: dict[str, float] = {}
            visited: list[tuple[int, int]] = []
            w.walk(best[0], best[1], base, 1.0, visited)
            cands = [s for s in unsolved if s in visited and issues(s, op)]
            if not cands:
                continue
            # innermost candidate first: a loop with no unsolved candidate inside it
            inner = [s for s in cands if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in cands)]
            if len(inner) != 1 and len({_path_count(w, s, op) for s in inner}) != 1:
                continue
            group = inner if len(inner) > 1 else inner[:1]
            per = sum(_path_count(w, s, op) * _outer_weight(w, s, best) for s in group)
            rest = base.get(op, 0.0) - per
            trips = (want - rest) / per if per else 0.0
            if trips >= 1 - 1e-9:
                for s in group:
                    w.set_trips(s, round(trips, 6))
                    unsolved.discard(s)
                progress = True
                break  # re-rank the opcodes against the loops left
        if not progress:
            break
    counts: dict[str, float] = {}
    w.walk(best[0], best[1], counts, 1.0)
    loops = tuple(Loop(s[0], s[1], w.trips.get(s, 1.0)) for s in nested if s not in unsolved)
    left = tuple(Loop(s[0], s[1], 1.0) for s in nested if s in unsolved and _reached(w, s, best))
    return TileLoop(kernel, best[0], best[1], tuple(sorted(counts.items())), loops, left)


def _path_count(w: _Walker, s: tuple[int, int], op: str) -> float:
    """op issued by one trip of loop s's body (its own nested loops at their current trips)."""
    c: dict[str, float] = {}
    w.walk(s[0], s[1], c, 1.0)
    return c.get(op, 0.0)


def _outer_weight(w: _Walker, s: tuple[int, int], best: tuple[int, int]) -> float:
    """Product of the trips of the loops enclosing s inside best."""
    out = 1.0
    for o, t in w.trips.items():
        if o != s and o != best and o[0] <= s[0] and s[1] <= o[1]:
            out *= t
    return out


def _reached(w: _Walker, s: tuple[int, int], best: tuple[int, int]) -> bool:
    visited: list[tuple[int, int]] = []
    w.walk(best[0], best[1], {}, 1.0, visited)
    return s in visited


def walked_loop_mix(cubin: bytes, kernel: str, work: Mapping[str, float]) -> LoopMix | None:
    """The opcode counts one walked trip of ``kernel``'s tile loop issues (``tile_loop``, its nested
    loops at their solved trips) as a LoopMix with no inner part, which ``dynamic_instructions``
    takes whole; None without a disassembler, a tile loop or when a nested loop's trips stay
    unsolved (the caller falls back to ``main_loop_mix``)."""
    text = sass.disassemble(cubin)
    if text is None:
        return None
    loop = tile_loop(text, kernel, work)
    if loop is None or loop.unsolved:
        return None
    return LoopMix(tuple(sorted((op, round(n)) for op, n in loop.mix if round(n))), ())


# --------------------------------------------------------------------- instructions per 1e6 FLOPs
#: FLOPs of one HMMA.16816 (m16 n8 k16).
HMMA_FLOPS = 2 * 16 * 8 * 16


def pair_flops(direction: str, head_dim: int, block_r: int, block_c: int, head_dim_v: int | None = None) -> float:
    """Tensor-core FLOPs of one tile pair: 5 GEMMs backward, 2 forward, each 2 Br Bc d; with a v head
    dim dv of its own, those whose K or N is v's (P V; dP = dO V^T, dV) take dv: 2 Br Bc (d + dv)
    forward, 2 Br Bc (3 d + 2 dv) backward."""
    dv = head_dim_v or head_dim
    return 2 * block_r * block_c * ((3 * head_dim + 2 * dv) if direction == "bwd" else (head_dim + dv))


def red_width(mnemonic: str) -> int:
    """fp32 values one global reduction instruction adds (``REDG.E.ADD.F32x4...``: 4)."""
    m = re.search(r"F32X(\d)|\.V(\d)\.|\.(64|128)\b", mnemonic.upper())
    if not m:
        return 1
    if m.group(1) or m.group(2):
        return int(m.group(1) or m.group(2))
    return int(m.group(3)) // 32


def measure(text: str, kernel: str, direction: str, head_dim: int, padded_dim: int, block_r: int, block_c: int,
            num_warps: int, *, diagonal: bool = False, dq_atomics: bool = True, head_dim_v: int | None = None):
    """(TileLoop, instructions per 1e6 FLOPs) of ``kernel`` in nvdisasm ``text``, or None. ``head_dim_v``:
    v's head dim where it differs (its GEMMs and copies counted at its padded width)."""
    w = num_warps
    padded_v = -(-head_dim_v // 16) * 16 if head_dim_v else padded_dim
    flops = pair_flops(direction, padded_dim, block_r, block_c, padded_v)
    work: dict[str, float] = {"HMMA": flops / HMMA_FLOPS / w}
    if direction == "bwd":
        work["LDGSTS"] = block_r * (padded_dim + padded_v) / 8 / 32 / w  # Q_i and dO_i in 16-byte copies
        if dq_atomics:
            reds = [i for i in sass.parse(text).get(kernel, []) if i.opcode in ("RED", "REDG", "ATOM", "ATOMG")]
            width = max((red_width(i.mnemonic) for i in reds), default=1)
            op = reds[0].opcode if reds else "REDG"
            work[op] = block_r * head_dim / width / 32 / w  # dQ_i += dS K_j, one add per element
    else:
        work["LDGSTS"] = block_c * (padded_dim + padded_v) / 8 / 32 / w  # K_j and V_j
    loop = tile_loop(text, kernel, work, diagonal=diagonal)
    if loop is None:
        return None
    return loop, loop.total() * w / (pair_flops(direction, head_dim, block_r, block_c, head_dim_v) / 1e6)


def measure_specialised(text: str, kernel: str, fs: Any, family: Any, *, diagonal: bool = False):
    """(consumer TileLoop, producer TileLoop, instructions per 1e6 FLOPs) of a warp-specialised kernel
    (the wgmma family) in nvdisasm ``text``, or None when a loop is not found: each consumer loop of
    ``family.consumer_loops(fs)`` walked with its work (HGMMA per warp and tile pair; one HGMMA m64nNk16 is
    2 x 64 x N x 16 FLOPs of its warpgroup) and counted over the warps that run it, the producer warp's
    loop (the smallest loop holding its TMA loads) with ``family.producer_work(fs)`` over
    ``family.producer_warps(fs)`` (the elected warp; its warpgroup's other warps exit at once), over the
    tile pair's FLOPs. The consumer TileLoop returned is the first loop's."""
    loops = family.consumer_loops(fs)
    if not loops:
        return None
    walked = [tile_loop(text, kernel, work, diagonal=diagonal, anchor=anchor) for work, anchor, _ in loops]
    producer = tile_loop(text, kernel, family.producer_work(fs) or {}, anchor=("UTMALDG",), smallest=True)
    if producer is None or any(w is None for w in walked) or len({id(w) for w in walked}) < len(walked):
        return None
    total = sum(w.total() * warps for w, (_, _, warps) in zip(walked, loops))
    total += producer.total() * family.producer_warps(fs)
    return walked[0], producer, total / (pair_flops(fs.direction, fs.head_dim, fs.block_r, fs.block_c, fs.dv) / 1e6)
