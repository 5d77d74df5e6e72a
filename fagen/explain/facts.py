"""The facts ``fagen explain`` shows: one JSON-able dict per (spec, seqlen_q, seqlen_k).

Every fact comes from the one place that decides it: the tile kinds, the tile
counts and each CTA's inner-loop range from :mod:`fagen.masking`, the shared-memory
buffers from ``spec.smem_layout``, the Algorithm 4 line texts from
:mod:`fagen.algorithm4` and which lines a kernel runs where from the
``// Algorithm 4 line N`` comments of its rendered source, registers / spills /
smem from :func:`fagen.compile`, occupancy and HBM bytes from the autotuner's
cost model. The HTML page (:mod:`fagen.explain.page`) renders from this dict
alone, and ``fagen explain --json`` prints it. docs/explain.md lists the keys.
"""
from __future__ import annotations

import math
import re
from typing import Any

from .. import masking
from .._version import __version__
from ..algorithm4 import ALG4, PAPER
from ..errors import InputError, InputTypeError
from ..plan import plan_of
from ..renderer import render
from ..spec import KernelSpec

#: Tile kind -> the letter used in ``tile_map`` runs (and the CSS class on the page).
KIND_LETTER = {masking.TileKind.SKIP: "s", masking.TileKind.PARTIAL: "p", masking.TileKind.FULL: "f"}
KIND_NAME = {"s": "skipped", "p": "visited, mask math", "f": "visited, fully visible"}
#: Largest Nq x Nk tile grid for which the per-tile map is computed (one tile_kind call per tile).
MAX_MAP_TILES = 1 << 20
#: Paper's loop structure: lines before the inner loop, the inner loop, after it (Algorithm 4).
LOOP_FIRST, LOOP_LAST = 9, 23

ALG4_REF = re.compile(r"Algorithm 4 lines? (\d+)(?:\s*[-\u2013]\s*(\d+))?")
_SMEM_REF = re.compile(r"\bs\.(\w+)")


# --------------------------------------------------------------------------- masking (one source)
def _rule(spec: KernelSpec, window: masking.Window) -> dict[str, Any]:
    """The structural-mask keywords of fagen.masking for ``spec`` (the window only when compiled in)."""
    return {"causal": spec.causal, "window": window if spec.window else masking.NO_WINDOW,
            "top_left": spec.causal_align == "top_left"}


def _kind(spec: KernelSpec, row0: int, col0: int, nq: int, nk: int,
          window: masking.Window = masking.NO_WINDOW) -> masking.TileKind:
    t = spec.tile
    return masking.TileKind(masking.tile_kind(row0, col0, nq, nk, block_r=t.block_r, block_c=t.block_c,
                                              key_padding=spec.key_padding, attn_mask=spec.attn_mask,
                                              **_rule(spec, window)))


def _inner_range(spec: KernelSpec, cta: int, nq: int, nk: int,
                 window: masking.Window = masking.NO_WINDOW) -> tuple[int, int]:
    """Blocks [first, end) the CTA's inner loop walks: Q blocks (bwd) or K/V blocks (fwd)."""
    t = spec.tile
    kw = _rule(spec, window)
    if spec.direction == "bwd":
        b, e = masking.kv_block_q_range(cta * t.block_c, nq, nk, block_r=t.block_r, block_c=t.block_c, **kw)
        size = t.block_r
    else:
        b, e = masking.q_block_kv_range(cta * t.block_r, nq, nk, block_r=t.block_r, block_c=t.block_c, **kw)
        size = t.block_c
    if e <= b:
        return 0, 0
    return b // size, math.ceil(e / size)


def tile_counts(spec: KernelSpec, seqlen_q: int, seqlen_k: int,
                window: masking.Window = masking.NO_WINDOW) -> dict[str, int]:
    """``{"total", "visited", "skipped", "fully_visible"}`` of the whole Nq x Nk matrix (one batch, one head)."""
    t = spec.tile
    kw = _rule(spec, window)
    c = masking.tile_counts(seqlen_q, seqlen_k, t.block_r, t.block_c, kw.pop("causal"), spec.key_padding,
                            attn_mask=spec.attn_mask, **kw)
    return {k: int(c[k]) for k in ("total", "visited", "skipped", "fully_visible")}


def tile_map(spec: KernelSpec, seqlen_q: int, seqlen_k: int,
             window: masking.Window = masking.NO_WINDOW) -> list[list[list[Any]]]:
    """Per Q block, runs ``[letter, first K/V block, end K/V block)`` of equal tile kind."""
    t = spec.tile
    tr, tc = math.ceil(seqlen_q / t.block_r), math.ceil(seqlen_k / t.block_c)
    rows = []
    for i in range(tr):
        runs: list[list[Any]] = []
        for j in range(tc):
            letter = KIND_LETTER[_kind(spec, i * t.block_r, j * t.block_c, seqlen_q, seqlen_k, window)]
            if runs and runs[-1][0] == letter:
                runs[-1][2] = j + 1
            else:
                runs.append([letter, j, j + 1])
        rows.append(runs)
    return rows


# --------------------------------------------------------------------------- source
def _kernel_spans(source: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """Kernel name -> [first line, end line) (1-based) of its definition in the rendered source."""
    lines = source.splitlines()
    starts = []
    for name in names:
        pat = re.compile(rf"\b{re.escape(name)}\s*\(")
        idx = next((n for n, ln in enumerate(lines, 1) if pat.search(ln) and "__global__" in " ".join(lines[max(0, n - 3):n])), None)
        if idx is not None:
            starts.append((idx, name))
    starts.sort()
    spans = {}
    for k, (line, name) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else len(lines) + 1
        spans[name] = (line, end)
    return spans


def source_anchors(source: str) -> list[dict[str, Any]]:
    """Every Algorithm 4 reference in the source: ``{"line": source line, "alg4": [N, ...], "text"}``."""
    out = []
    for n, ln in enumerate(source.splitlines(), 1):
        if "//" not in ln:
            continue
        comment = ln[ln.index("//"):]
        nums: list[int] = []
        for m in ALG4_REF.finditer(comment):
            a = int(m.group(1))
            b = int(m.group(2)) if m.group(2) else a
            nums += [x for x in range(a, b + 1) if x not in nums]
        if nums:
            out.append({"line": n, "alg4": nums, "text": comment.lstrip("/ ").strip()})
    return out


def _buffers_per_line(source: str, anchors: list[dict[str, Any]], span: tuple[int, int], names: set[str]) -> dict[int, list[str]]:
    """Algorithm 4 line -> smem buffers the code after its comment (up to the next one) touches."""
    lines = source.splitlines()
    inside = [a for a in anchors if span[0] <= a["line"] < span[1]]
    out: dict[int, list[str]] = {}
    k = 0
    while k < len(inside):
        group = [inside[k]]  # consecutive comments share the code that follows them
        while k + 1 < len(inside) and inside[k + 1]["line"] == group[-1]["line"] + 1:
            k += 1
            group.append(inside[k])
        stop = inside[k + 1]["line"] if k + 1 < len(inside) else span[1]
        code = "\n".join(lines[group[-1]["line"]:stop - 1])
        touched = []
        for m in _SMEM_REF.finditer(code):
            if m.group(1) in names and m.group(1) not in touched:
                touched.append(m.group(1))
        for a in group:
            for num in a["alg4"]:
                out.setdefault(num, [])
                out[num] += [t for t in touched if t not in out[num]]
        k += 1
    return out


_HELPER_DEF = re.compile(r"^FA_DEVICE\b[^(=;]*?\b(\w+)\s*\(")


def _helper_spans(source: str) -> dict[str, tuple[int, int]]:
    """Device helper name -> [first line, end line) (1-based) of its definition: ``FA_DEVICE ...`` at
    column 0 through the brace that closes its body."""
    lines = source.splitlines()
    out: dict[str, tuple[int, int]] = {}
    for n, ln in enumerate(lines, 1):
        m = _HELPER_DEF.match(ln)
        if not m or ln.rstrip().endswith(";"):
            continue
        depth, opened, end = 0, False, len(lines) + 1
        for k in range(n - 1, len(lines)):
            depth += lines[k].count("{") - lines[k].count("}")
            opened = opened or "{" in lines[k]
            if opened and depth <= 0:
                end = k + 2
                break
        out.setdefault(m.group(1), (n, end))
    return out


def algorithm4(spec: KernelSpec, source: str, main: str, others: list[str]) -> dict[str, Any]:
    """The Algorithm 4 lines the main kernel executes before, in and after its inner loop
    (including the lines of the device helpers it calls, e.g. a tile-pair function)."""
    anchors = source_anchors(source)
    spans = _kernel_spans(source, [main, *others])
    span = spans.get(main, (1, len(source.splitlines()) + 1))
    body = "\n".join(source.splitlines()[span[0] - 1:span[1] - 1])
    ranges = [span] + [hs for name, hs in _helper_spans(source).items()
                       if re.search(rf"\b{re.escape(name)}\s*(<[^>()]*>)?\s*\(", body)]
    in_main = sorted({n for a in anchors if any(lo <= a["line"] < hi for lo, hi in ranges) for n in a["alg4"]})
    elsewhere = sorted({n for a in anchors for n in a["alg4"]} - set(in_main))
    names = {b.name for b in spec.smem_layout.buffers}
    return {
        "texts": {str(n): ALG4[n] for n in sorted(ALG4)},
        "paper": {str(n): PAPER[n] for n in sorted(PAPER)},
        "prologue": [n for n in in_main if n < LOOP_FIRST],
        "loop": [n for n in in_main if LOOP_FIRST <= n <= LOOP_LAST],
        "epilogue": [n for n in in_main if n > LOOP_LAST],
        "other_kernels": elsewhere,
        "buffers": {str(k): v for k, v in sorted(_buffers_per_line(source, anchors, span, names).items())},
        "kernel_lines": {k: list(v) for k, v in spans.items()},
        "anchors": anchors,
    }


# --------------------------------------------------------------------------- tile choice
def tile_choice(spec: KernelSpec) -> dict[str, Any]:
    """The paper's (B_r, B_c), the tile used, and per dimension why it is what it is."""
    plan = plan_of(spec)
    fam = plan.family
    t = spec.tile
    m = spec.sram_bytes

    def footprint(br: int, bc: int) -> int:
        return fam.smem_layout(plan.family_spec.with_tile(br, bc)).total_bytes

    used = footprint(t.block_r, t.block_c)
    reasons: dict[str, str] = {}
    cap_r, cap_c = fam.tile_caps(plan.family_spec)  # the family's default caps for this spec
    for dim, val, paper, top, cap, override in (
        ("block_r", t.block_r, spec.paper_block_r, fam.max_block_r, cap_r, spec.block_r),
        ("block_c", t.block_c, spec.paper_block_c, fam.max_block_c, cap_c, spec.block_c),
    ):
        limit = min(top, cap)
        sym = "B_r" if dim == "block_r" else "B_c"
        q = fam.tile_multiple if dim == "block_r" else getattr(fam, "block_c_multiple", fam.tile_multiple)
        grown = (t.block_r + q, t.block_c) if dim == "block_r" else (t.block_r, t.block_c + q)
        if override is not None:
            reasons[dim] = f"{sym} = {val}: set explicitly (--{dim.replace('_', '-')})"
        elif val == paper:
            reasons[dim] = f"{sym} = {val}: the paper's value"
        elif val == limit and paper > limit:
            what = f"the {spec.impl} template's maximum" if limit == top else f"the {spec.impl} family's cap for this spec"
            reasons[dim] = f"{sym} = {val}: {what} (the paper asks for {paper})"
        elif val + q > paper:
            reasons[dim] = f"{sym} = {val}: the paper's {paper} rounded down to a multiple of {q}"
        else:
            need = footprint(*grown)
            reasons[dim] = (f"{sym} = {val}: {grown[0]} x {grown[1]} would need {need} B of shared memory, "
                            f"more than M = {m} B" if need > m else
                            f"{sym} = {val}: shrunk (the larger dimension first) while the tile did not fit M = {m} B")
    try:
        paper_need: int | None = footprint(spec.paper_block_r, spec.paper_block_c)
    except Exception:  # noqa: BLE001 - a family may lay out only its own tile sizes
        paper_need = None
    return {
        "paper": {"block_r": spec.paper_block_r, "block_c": spec.paper_block_c, "smem_bytes": paper_need,
                  "fits": paper_need is not None and paper_need <= m},
        "used": {"block_r": t.block_r, "block_c": t.block_c, "smem_bytes": used, "fits": used <= m},
        "tile_multiple": fam.tile_multiple, "block_c_multiple": getattr(fam, "block_c_multiple", fam.tile_multiple),
        "max_block_r": fam.max_block_r, "max_block_c": fam.max_block_c,
        "reasons": reasons,
    }


# --------------------------------------------------------------------------- resources
def resources(spec: KernelSpec) -> dict[str, Any]:
    """NVRTC resources per kernel with occupancy; the SASS instruction mix when available."""
    from ..autotune.model import occupancy
    from ..compiler import compile as compile_spec

    try:
        mod = compile_spec(spec)
    except Exception as e:  # noqa: BLE001 - shown on the page, not raised
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "kernels": [], "sass": None}
    kernels = []
    order = {k.name: n for n, k in enumerate(plan_of(spec).kernels)}
    for r in sorted(mod.resources, key=lambda r: order.get(r.kernel, len(order))):
        occ = occupancy(spec.arch, spec.num_warps, r.registers, r.smem_bytes)
        kernels.append({
            "kernel": r.kernel, "registers": r.registers, "spill_bytes": r.spill_bytes,
            "spill_store_bytes": r.spill_store_bytes, "spill_load_bytes": r.spill_load_bytes,
            "stack_frame_bytes": r.stack_frame_bytes, "smem_bytes": r.smem_bytes,
            "static_smem_bytes": r.static_smem_bytes, "dynamic_smem_bytes": r.dynamic_smem_bytes,
            "barriers": r.barriers,
            "occupancy": {"blocks_per_sm": occ.blocks_per_sm, "warps_per_sm": occ.warps_per_sm,
                          "fraction": round(occ.fraction, 4), "limiter": occ.limiter},
        })
    out = {"error": None, "kernels": kernels, "cached": mod.cached, **_sass(mod.cubin)}
    if out["sass"]:  # in the kernels' order
        order = {k["kernel"]: n for n, k in enumerate(kernels)}
        out["sass"] = dict(sorted(out["sass"].items(), key=lambda kv: order.get(kv[0], len(order))))
    return out


def _sass(cubin: bytes) -> dict[str, Any]:
    try:
        from ..sass import instruction_mix  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return {"sass": None, "sass_loop": None, "sass_note": "the SASS reader is not part of this install"}
    try:
        mix = instruction_mix(cubin)
    except Exception as e:  # noqa: BLE001 - e.g. no disassembler installed
        return {"sass": None, "sass_loop": None, "sass_note": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    if mix is None:
        return {"sass": None, "sass_loop": None, "sass_note": "no disassembler installed (pip install nvidia-cuda-nvdisasm)"}
    try:  # the largest loop of each kernel (the main kernel's loop over tiles)
        from ..sass import loop_mix  # type: ignore[import-not-found,unused-ignore]

        loops = {k: v for k, v in (loop_mix(cubin) or {}).items() if v}
    except Exception:  # noqa: BLE001 - optional detail
        loops = {}

    def ordered(m: dict[str, int]) -> dict[str, int]:
        return dict(sorted(m.items(), key=lambda kv: (-kv[1], kv[0])))

    return {"sass": {k: ordered(v) for k, v in mix.items()},
            "sass_loop": {k: ordered(v) for k, v in loops.items()} or None, "sass_note": None}


def hbm(spec: KernelSpec, seqlen_q: int, seqlen_k: int) -> dict[str, Any]:
    """HBM traffic, one batch and one head: the cost model's byte count for the tiles used, and
    the paper's IO bound Theta(Nq Nk d^2 / M) (Theorem 2 forward, Theorem 5 backward; M in elements)
    beside standard attention's Theta(N d + Nq Nk) accesses."""
    from ..autotune import model

    t = spec.tile
    d, m = spec.head_dim, spec.sram_elems
    out: dict[str, Any] = {
        "theorem": "Theorem 5 (backward)" if spec.direction == "bwd" else "Theorem 2 (forward)",
        "flash_accesses": seqlen_q * seqlen_k * d * d / m,
        "standard_accesses": (seqlen_q + seqlen_k) * d + seqlen_q * seqlen_k,
        "sram_elements": m,
    }
    try:
        shape = getattr(model, "Workload", None) or model.Problem  # the model's runtime-shape type
        out["model_bytes"] = float(model.hbm_bytes(spec, shape(1, 1, seqlen_q, seqlen_k), t.block_r, t.block_c))
    except Exception as e:  # noqa: BLE001 - the model is optional context
        out["model_bytes"] = None
        out["model_note"] = f"{type(e).__name__}: {e}"
    return out


# --------------------------------------------------------------------------- everything
def explain(spec: KernelSpec, seqlen_q: int = 1024, seqlen_k: int | None = None, *,
            with_resources: bool = True, window: tuple[int, int] = masking.NO_WINDOW) -> dict[str, Any]:
    """All facts about ``spec`` on an Nq x Nk problem (one batch, one head); ``window`` is the
    runtime (left, right) of a spec compiled with ``window`` (-1 = unbounded)."""
    if not isinstance(spec, KernelSpec):
        raise InputTypeError("spec", "a KernelSpec", type(spec).__name__)
    try:
        window = masking.check_window(window)
    except ValueError as e:
        raise InputError("window", "a pair (left, right) of ints, -1 = unbounded", str(e)) from None
    if window != masking.NO_WINDOW and not spec.window:
        raise InputError("window", "(-1, -1) for a spec compiled without window", window)
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    for arg, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputTypeError(arg, "an int", type(v).__name__)
        if v < 1:
            raise InputError(arg, "at least 1", v)
    t = spec.tile
    tr, tc = math.ceil(seqlen_q / t.block_r), math.ceil(seqlen_k / t.block_c)
    if tr * tc > MAX_MAP_TILES:
        raise InputError("seqlen_q", f"at most {MAX_MAP_TILES} tiles of {t.block_r} x {t.block_c} with seqlen_k={seqlen_k}",
                         f"{tr} x {tc}")
    plan = plan_of(spec)
    infos = plan.kernels
    main = plan.kernel("main")
    rendered = render(spec)
    layout = plan.smem_layout
    spans = layout.breakdown()
    alg = algorithm4(spec, rendered.source, main.name, [k.name for k in infos if k is not main])
    per_buffer: dict[str, list[int]] = {}
    for line, bufs in alg["buffers"].items():
        for b in bufs:
            per_buffer.setdefault(b, []).append(int(line))
    ctas = tc if spec.direction == "bwd" else tr
    facts: dict[str, Any] = {
        "fagen_version": __version__,
        "name": spec.name, "kernel": main.name, "spec": spec.model_dump(mode="json"),
        "direction": spec.direction, "head_dim": spec.head_dim, "dtype": spec.dtype, "causal": spec.causal,
        "key_padding": spec.key_padding, "dropout": spec.dropout, "arch": spec.arch, "impl": spec.impl,
        "num_warps": spec.num_warps, "num_threads": spec.num_threads,
        "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
        "block_r": t.block_r, "block_c": t.block_c,
        "paper_block_r": spec.paper_block_r, "paper_block_c": spec.paper_block_c,
        "sram_bytes": spec.sram_bytes,
        "tile_choice": tile_choice(spec),
        "smem": {
            "capacity_bytes": spec.sram_bytes, "total_bytes": layout.total_bytes,
            "buffers": [{"name": b.name, "ctype": b.ctype, "count": b.count, "itemsize": b.itemsize,
                         "offset": b.offset, "bytes": b.nbytes, "span_bytes": spans[b.name],
                         "alg4": sorted(per_buffer.get(b.name, []))} for b in layout.buffers],
        },
        "grid": {"q_blocks": tr, "kv_blocks": tc, "ctas": ctas,
                 "cta_owns": "kv_block" if spec.direction == "bwd" else "q_block",
                 "inner_loop": "q_blocks" if spec.direction == "bwd" else "kv_blocks"},
        "window": list(window), "causal_align": spec.causal_align,
        "tiles": tile_counts(spec, seqlen_q, seqlen_k, window),
        "tile_map": tile_map(spec, seqlen_q, seqlen_k, window),
        "cta_ranges": [list(_inner_range(spec, c, seqlen_q, seqlen_k, window)) for c in range(ctas)],
        "kernels": [{"kernel": k.name, "role": k.role.name, "block": list(k.block),
                     "grid": list(k.grid(1, 1, seqlen_q, seqlen_k)), "dynamic_smem_bytes": k.smem_bytes}
                    for k in infos],
        "algorithm4": alg,
        "hbm": hbm(spec, seqlen_q, seqlen_k),
        "source": rendered.source,
        "codegen": None if plan.codegen is None or not plan.codegen.knobs else plan.codegen.as_dict(),
    }
    facts["resources"] = resources(spec) if with_resources else {"error": "not requested", "kernels": [], "sass": None}
    return facts
