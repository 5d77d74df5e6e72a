"""The candidate space of one spec and its pruning.

A candidate is (family, block_r, block_c, num_warps, knobs). For every
registered kernel family that supports the spec the tile sizes are the
family's tile quantum times powers of two up to its template limit, the
midpoint of the two largest (16, 32, 64, 96, 128 for SIMT), and the paper's
point as made feasible by the spec (``spec.tile`` without overrides); warps
are 2, 4 and 8; knobs take every value the family declares. The spec's own
choice is always a candidate, so "tuned" can be compared with "untuned".

Pruning, cheapest first, every rejection keeping its reason:

1. the family cannot implement the spec, or rejects the (tile, warps, knobs)
   (``Family.config_reason``: template limits, rows per warp, ...);
2. the exact smem footprint (the family's layout) exceeds the arch's opt-in
   per-block capacity or the spec's ``sram_bytes`` (M) -- no compile needed;
3. ``spec.replace(...)`` raises a pydantic ``ValidationError``;
4. NVRTC fails (``CompileError``);
5. ptxas reports spill bytes, or registers outside the launch bounds
   (> 255 per thread, or registers x threads > 65536).

Survivors of 1-3 are compiled in parallel in a thread pool: NVRTC (through
CuPy's Cython binding) releases the GIL, two threads on two cores compile two
modules in ~0.8 s where one after the other takes ~1.3 s.
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import ValidationError

from ..compiler import CompiledModule, compile as compile_spec
from ..errors import CacheDirError, CompileError
from ..families import Family, families, feature_reason
from ..plan import plan_of
from ..spec import ARCH_SMEM_OPTIN, REGS_PER_SM, KernelSpec
from . import sassloops
from .sassloops import LoopMix

_log = logging.getLogger(__name__)

WARPS = (2, 4, 8)
MAX_REGISTERS = 255

Status = Literal["pending", "ok", "rejected"]


@dataclass(frozen=True)
class Candidate:
    """One point of the search space and what is known about it so far."""

    impl: str
    block_r: int
    block_c: int
    num_warps: int
    knobs: tuple[tuple[str, int], ...] = ()  # the family's knobs, sorted by name
    smem_bytes: int | None = None
    spec: KernelSpec | None = field(default=None, compare=False, repr=False)
    status: Status = "pending"
    reason: str | None = None
    registers: int | None = None  # the main kernel's
    spill_bytes: int | None = None  # summed over the module's kernels
    is_paper: bool = False  # the paper's point made feasible (spec.tile without overrides)
    is_default: bool = False  # the spec as given (what runs without tuning)
    occupancy: float | None = None
    predicted_ms: float | None = None
    measured_ms: float | None = None
    bound: str | None = None  # the model's limiting term
    sass_loop: LoopMix | None = field(default=None, compare=False, repr=False)  # the main loop's SASS
    #: the deterministic backward's dq kernel's main loop (None for other specs or without SASS)
    dq_sass_loop: LoopMix | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple:
        """Stable identity, also the deterministic tie-break of every ranking."""
        return (self.impl, self.block_r, self.block_c, self.num_warps, self.knobs)

    @property
    def label(self) -> str:
        return f"{self.block_r}x{self.block_c}" + "".join(f" {k}={v}" for k, v in self.knobs)

    def reject(self, reason: str) -> "Candidate":
        return replace(self, status="rejected", reason=reason)

    def as_dict(self) -> dict[str, object]:
        return {
            "block_r": self.block_r, "block_c": self.block_c, "num_warps": self.num_warps, "impl": self.impl,
            "knobs": dict(self.knobs), "bound": self.bound,
            "smem_bytes": self.smem_bytes, "registers": self.registers, "spill_bytes": self.spill_bytes,
            "occupancy": self.occupancy, "predicted_ms": self.predicted_ms, "measured_ms": self.measured_ms,
            "paper_point": self.is_paper, "default": self.is_default,
            "status": self.status, "reason": self.reason,
        }


def tile_sizes(fam: Family, limit: int | None = None) -> tuple[int, ...]:
    """quantum x 2^k up to the template limit (``limit``: this one), plus the midpoint of the two
    largest."""
    limit = min(fam.max_block_r, fam.max_block_c) if limit is None else limit
    sizes = []
    s = fam.tile_multiple
    while s <= limit:
        sizes.append(s)
        s *= 2
    if len(sizes) >= 2:
        mid = (sizes[-1] + sizes[-2]) // 2 // fam.tile_multiple * fam.tile_multiple
        sizes.append(mid)
    return tuple(sorted(set(sizes)))


def _validation_reason(err: ValidationError) -> str:
    return "; ".join(e["msg"] for e in err.errors())


def _paper_tile(spec: KernelSpec, impl: str) -> tuple[int, int] | None:
    try:
        t = spec.replace(block_r=None, block_c=None, impl=impl).tile
    except ValidationError:
        return None
    return (t.block_r, t.block_c)


def enumerate_candidates(spec: KernelSpec, *, sizes: Sequence[int] | None = None,
                         warps: Sequence[int] = WARPS) -> list[Candidate]:
    """Every candidate point for ``spec`` with steps 1-3 of the pruning applied (no compiling)."""
    default_key = (spec.impl, spec.tile.block_r, spec.tile.block_c, spec.num_warps, spec.knobs)
    out: dict[tuple, Candidate] = {}
    for fam in families():
        impl = fam.name
        paper = _paper_tile(spec, impl)
        rows = tuple(sizes) if sizes is not None else tile_sizes(fam)
        # a family whose streamed block goes further than its owned one (wgmma: 256 keys) gets those too
        cols = tuple(sizes) if sizes is not None else tile_sizes(fam, fam.max_block_c)
        tiles = {(br, bc) for br in rows for bc in cols}
        if paper is not None:
            tiles.add(paper)
        # every speed knob's values; a knob that changes numerics (Knob.numerics) keeps its default
        knob_points = [tuple(sorted((k.name, v) for k, v in zip(fam.knobs, values)  # as the spec lists them
                                    if not (getattr(k, "elided", False) and v == k.default)))
                       for values in itertools.product(*[(k.default,) if getattr(k, "numerics", False) else k.choices
                                                         for k in fam.knobs])]
        points = {(br, bc, w, kn) for br, bc in tiles for w in warps for kn in knob_points}
        if impl == spec.impl:
            points.add(default_key[1:])
        for br, bc, w, kn in sorted(points):
            key = (impl, br, bc, w, kn)
            out[key] = _prune_static(spec, fam, br, bc, w, kn, is_paper=(br, bc) == paper,
                                     is_default=key == default_key)
    return [out[k] for k in sorted(out)]


def _prune_static(spec: KernelSpec, fam: Family, br: int, bc: int, w: int, knobs: tuple[tuple[str, int], ...],
                  *, is_paper: bool, is_default: bool) -> Candidate:
    cand = Candidate(fam.name, br, bc, w, knobs, is_paper=is_paper, is_default=is_default)
    fs = spec.family_spec.with_tile(br, bc, num_warps=w, knobs=tuple(knobs))
    why = fam.unsupported_reason(fs) or feature_reason(fam, fs.features) or fam.combination_reason(fs)
    if why:
        return cand.reject(f"family {fam.name} unsupported: {why}")
    bad = fam.config_reason(fs)
    if bad is not None:
        return cand.reject(bad.message)
    smem = fam.smem_layout(fs).total_bytes
    cand = replace(cand, smem_bytes=smem)
    optin = ARCH_SMEM_OPTIN[spec.arch]
    if smem > optin:
        return cand.reject(f"smem {smem} B > {spec.arch} per-block opt-in {optin}")
    if smem > spec.sram_bytes:
        return cand.reject(f"smem {smem} B > sram_bytes {spec.sram_bytes}")
    try:
        cspec = spec.replace(block_r=br, block_c=bc, num_warps=w, impl=fam.name, knobs=dict(knobs))
    except ValidationError as e:
        return cand.reject(f"invalid spec: {_validation_reason(e)}")
    return replace(cand, spec=cspec)


def main_loop_mix(mod: CompiledModule, role: str = "main") -> LoopMix | None:
    """The main-loop SASS mix of the module's ``role`` kernel: one walked trip of its tile loop where
    the family states the work a tile pair issues (``Family.tile_work``, ``sassloops.tile_loop``),
    else ``sassloops.main_loop_mix``; None without a disassembler or when it fails."""
    try:
        name = mod.rendered.kernel(role).name
        plan = plan_of(mod.spec)
        work = plan.family.tile_work(plan.family_spec, role)
        walked = sassloops.walked_loop_mix(mod.cubin, name, work) if work else None
        return walked if walked is not None else sassloops.main_loop_mix(mod.cubin, name)
    except Exception:  # noqa: BLE001 - SASS is optional evidence for the model
        return None


def check_resources(cand: Candidate, mod: CompiledModule) -> Candidate:
    """Step 5: spills and launch bounds from the ptxas report (and the SASS mix of the main loop,
    and of the dq kernel's for a deterministic backward)."""
    main = mod.resource("main")
    spills = sum(r.spill_bytes for r in mod.resources)
    dq_loop = main_loop_mix(mod, "dq") if mod.spec.direction == "bwd" and mod.spec.deterministic else None
    cand = replace(cand, registers=main.registers, spill_bytes=spills, sass_loop=main_loop_mix(mod),
                   dq_sass_loop=dq_loop)
    threads = 32 * cand.num_warps
    if cand.spec is not None:  # as launched: a warp-specialised family adds its producer warpgroup
        threads = max(k.threads for k in plan_of(cand.spec).kernels)
    if spills:
        worst = max(mod.resources, key=lambda r: r.spill_bytes)
        return cand.reject(f"spills {spills} B ({worst.kernel.rsplit('_', 1)[-1]} kernel)")
    for r in mod.resources:
        if r.registers > MAX_REGISTERS or r.registers * threads > REGS_PER_SM:
            return cand.reject(f"registers {r.registers} x {threads} threads outside the launch bounds "
                               f"(<= {MAX_REGISTERS}, <= {REGS_PER_SM} per block)")
    return replace(cand, status="ok")


def _compile_one(cand: Candidate) -> Candidate:
    if cand.spec is None:  # pragma: no cover - only pending candidates get here
        return cand.reject("no spec")
    try:
        mod = compile_spec(cand.spec)
    except CompileError as e:
        first = next((ln.strip() for ln in e.log.splitlines() if "error" in ln), e.log.strip()[:200])
        return cand.reject(f"compile error: {first}")
    except CacheDirError:  # the setup is wrong, not this candidate
        raise
    except Exception as e:  # noqa: BLE001 - a render/compile failure rejects this candidate only
        return cand.reject(f"compile error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    try:
        return check_resources(cand, mod)
    except LookupError as e:  # no resource report to judge it by: this candidate only
        return cand.reject(str(e))


def compile_candidates(cands: Iterable[Candidate], *, workers: int | None = None,
                       progress: bool | None = None,
                       compile_fn: Callable[[Candidate], Candidate] = _compile_one) -> list[Candidate]:
    """Compile the pending candidates in a thread pool; others pass through. Order is kept."""
    cands = list(cands)
    pending = [i for i, c in enumerate(cands) if c.status == "pending"]
    out = list(cands)
    if not pending:
        return out
    workers = workers or max(1, min(len(pending), os.cpu_count() or 1, 8))
    show = sys.stderr.isatty() if progress is None else progress
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fagen-autotune") as ex:
        futs = {ex.submit(compile_fn, cands[i]): i for i in pending}
        if show:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("compiling candidates"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
                task = bar.add_task("compile", total=len(futs))
                for fut in as_completed(futs):
                    out[futs[fut]] = fut.result()
                    bar.advance(task)
        else:  # no terminal: a plain line per candidate on the "fagen" logger (the CLI shows INFO)
            for done, fut in enumerate(as_completed(futs), 1):
                c = out[futs[fut]] = fut.result()
                _log.info("candidate %d/%d: %s w%d %s: %s", done, len(futs), c.label, c.num_warps, c.impl,
                          c.status if c.status == "ok" else f"rejected ({c.reason})")
    return out


def build_candidates(spec: KernelSpec, *, sizes: Sequence[int] | None = None, warps: Sequence[int] = WARPS,
               workers: int | None = None, progress: bool | None = None) -> list[Candidate]:
    """Enumerate, prune by smem, compile the survivors and prune by the compile report."""
    return compile_candidates(enumerate_candidates(spec, sizes=sizes, warps=warps),
                              workers=workers, progress=progress)
