"""The stored search of a family's codegen knobs (``fagen tune-codegen``; no GPU): the mma family's
(:mod:`fagen.families.mma.codegen`) and the wgmma family's (:mod:`fagen.families.wgmma.codegen`).

For one class (:func:`fagen.families.codegen.class_key`: NVRTC major, arch, dtype, padded head
dims, direction, tile and warps, flags) the search starts from the knobs' starting points (the
family's rules) and walks one knob at a time (coordinate descent): each other
legal value of the knob, the others at the best setting so far, is rendered, NVRTC-compiled and
scored; a cheaper setting becomes the best, and the passes repeat until one changes nothing or
``max_configs`` settings were tried (while no setting tried is clean, a pass varies the one that spills
the fewest bytes). A setting is rejected when a kernel of the module spills or
uses local memory (more stack than the starting point's) or when one of its tile-loop rows (the
interior, and a causal kernel's diagonal) costs more than the starting point's. The score is the
warp instructions of the steady-state tile loop per 1e6 tensor-core FLOPs
(:func:`fagen.autotune.sassloops.measure`, or :func:`~fagen.autotune.sassloops.measure_specialised` for a
warp-specialised kernel: the figure of benchmarks/sass_cost.py), summed over the rows; a failing compile
scores inf. The winners go to the table the family reads (``codegen_table.json`` beside its codegen module).

``evaluate`` is the seam: a callable (KernelSpec, values) -> :class:`Evaluation`; the default,
:func:`nvrtc_evaluate`, compiles with NVRTC and reads the SASS with nvdisasm.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FagenError, InputError
from ..families.base import k16_padded
from ..families.codegen import TABLE_FORMAT, CodegenSet, class_key, clear_tables, forcing, nvrtc_major
from ..spec import KernelSpec

__all__ = ["DEFAULT_MAX_CONFIGS", "ClassResult", "Evaluation", "Trial", "codegen_set", "default_classes",
           "nvrtc_evaluate", "search_class", "write_table"]

#: The families with codegen knobs, in the order ``--all`` searches them.
FAMILIES = ("mma", "wgmma")

#: Settings tried per class at most (the starting point included).
DEFAULT_MAX_CONFIGS = 16


def codegen_set(spec: KernelSpec) -> CodegenSet | None:
    """The codegen knobs of the spec's family (``Family.codegen_set``), None for a family without any."""
    return getattr(spec.family, "codegen_set", None)


@dataclass(frozen=True)
class Evaluation:
    """One compiled setting: its rows' costs (instructions per 1e6 FLOPs; "interior", "diag"), the
    module's spilled bytes and local-memory (stack) bytes, or the error that stopped it."""

    rows: Mapping[str, float] = field(default_factory=dict)
    spill_bytes: int = 0
    local_bytes: int = 0
    error: str | None = None

    @property
    def cost(self) -> float:
        """The score: the rows' sum; inf for a failed compile or a kernel whose loop was not found."""
        if self.error is not None or not self.rows:
            return math.inf
        return float(sum(self.rows.values()))


@dataclass(frozen=True)
class Trial:
    values: Mapping[str, int]
    evaluation: Evaluation
    rejected: str | None  # why the setting cannot win (None: it can)
    seconds: float

    @property
    def cost(self) -> float:
        return self.evaluation.cost


@dataclass(frozen=True)
class ClassResult:
    key: str
    spec: KernelSpec
    start: Mapping[str, int]
    trials: tuple[Trial, ...]
    best: Trial
    seconds: float

    @property
    def start_trial(self) -> Trial:
        return self.trials[0]

    def summary(self) -> list[str]:
        """The lines ``fagen tune-codegen`` prints for the class."""
        rejected = [t for t in self.trials if t.rejected]
        out = [f"class {self.key}: {len(self.trials)} settings tried in {self.seconds:.0f} s, {len(rejected)} rejected"]
        for t in rejected:
            out.append(f"  rejected {_fmt(t.values, self.start)}: {t.rejected}")
        s, b = self.start_trial, self.best
        change = _fmt(b.values, self.start) if b is not s else "the starting point"
        out.append(f"  winner: {change}: {_rows(b)} (starting point {_rows(s)})")
        return out


def _fmt(values: Mapping[str, int], start: Mapping[str, int]) -> str:
    diff = {k: v for k, v in values.items() if start.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in sorted(diff.items())) or "the starting point"


def _rows(t: Trial) -> str:
    if t.cost == math.inf:
        return "inf"
    return " + ".join(f"{k} {v:.0f}" for k, v in t.evaluation.rows.items()) + " instructions per 1e6 FLOPs"


# --------------------------------------------------------------------------- the NVRTC evaluation
def nvrtc_evaluate(spec: KernelSpec, values: Mapping[str, int]) -> Evaluation:
    """Render ``spec`` with the knob setting ``values``, compile it with NVRTC (no cache), and count
    its tile loop's instructions per 1e6 FLOPs in the SASS (interior; a causal kernel's diagonal too)."""
    from .. import nvrtc, sass
    from ..arch import arch_info
    from ..compiler import options_for, parse_ptxas
    from ..errors import CompileError
    from ..renderer import render_with
    from .sassloops import measure, measure_specialised

    with forcing(values):
        rendered = render_with(spec, {})
    try:
        res = nvrtc.compile_cubin(rendered.source, f"{spec.name}.cu", options_for(spec), arch_info(spec.arch).cubin_arch)
    except (CompileError, nvrtc.NvrtcError) as e:
        return Evaluation(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    if not res.ok:
        return Evaluation(error="NVRTC: " + next((ln for ln in res.log.splitlines() if "error" in ln), "compile failed"))
    resources = parse_ptxas(res.log, {k.name: k.smem_bytes for k in rendered.kernels})
    spill = sum(r.spill_bytes for r in resources)
    local = sum(r.stack_frame_bytes for r in resources)
    text = sass.disassemble(res.cubin)
    if text is None:
        raise CodegenSearchError("nvdisasm not found (pip install nvidia-cuda-nvdisasm): the search reads the SASS")
    fs, kname = spec.family_spec, rendered.kernel("main").name
    family = spec.family
    rows: dict[str, float] = {}
    for variant, diag in [("interior", False)] + ([("diag", True)] if spec.causal else []):
        if hasattr(family, "consumer_loops"):  # warp-specialised: consumer and producer loops
            ws = measure_specialised(text, kname, fs, family, diagonal=diag)
            got = None if ws is None else (ws[0], ws[2])
        else:
            got = measure(text, kname, spec.direction, spec.head_dim, k16_padded(spec.head_dim), fs.block_r,
                          fs.block_c, fs.num_warps, diagonal=diag, dq_atomics=not spec.deterministic,
                          head_dim_v=spec.head_dim_v)
        if got is None:
            return Evaluation(spill_bytes=spill, local_bytes=local, error=f"no {variant} tile loop found in the SASS")
        rows[variant] = got[1]
    return Evaluation(rows, spill, local)


class CodegenSearchError(FagenError, RuntimeError):
    """The stored search cannot run (no disassembler, no NVRTC)."""


# --------------------------------------------------------------------------- the search
def _settings_one_knob(cs: CodegenSet, spec: KernelSpec, best: Mapping[str, int]) -> Iterable[dict[str, int]]:
    fs = spec.family_spec
    for k in cs.knobs_for(fs):
        if k.unsearched is not None:
            continue
        for v in k.values:
            if v != best[k.name]:
                cand = {**best, k.name: v}
                if cs.illegal_reason(fs, cand) is None:
                    yield cand


def _checked_set(spec: KernelSpec) -> CodegenSet:
    cs = codegen_set(spec)
    if cs is None:
        raise InputError("impl", f"a spec of a family with codegen knobs ({', '.join(FAMILIES)})", spec.impl)
    return cs


def search_class(spec: KernelSpec, *, evaluate: Callable[[KernelSpec, Mapping[str, int]], Evaluation] = nvrtc_evaluate,
                 max_configs: int = DEFAULT_MAX_CONFIGS, major: int | None = None,
                 log: Callable[[str], None] | None = None) -> ClassResult:
    """Search the knobs of ``spec``'s class (coordinate descent from the starting points, at most
    ``max_configs`` settings); ``evaluate`` compiles and scores one setting."""
    cs = _checked_set(spec)
    if max_configs < 1:
        raise InputError("max_configs", "at least 1", max_configs)
    fs = spec.family_spec
    key = class_key(fs, major)
    t0 = time.perf_counter()
    start = cs.start_values(fs)
    seen: dict[tuple, Trial] = {}
    order: list[Trial] = []

    def run(values: dict[str, int], base: Trial | None) -> Trial:
        t1 = time.perf_counter()
        ev = evaluate(spec, values)
        why = None
        if ev.error is not None:
            why = ev.error
        elif ev.spill_bytes:
            why = f"spills {ev.spill_bytes} bytes"
        elif base is not None and ev.local_bytes > base.evaluation.local_bytes:
            why = f"{ev.local_bytes} bytes of local memory"
        elif base is not None and base.rejected is None:
            worse = [r for r, c in ev.rows.items() if c > base.evaluation.rows.get(r, math.inf) + 1e-9]
            if worse:
                why = f"the {'/'.join(worse)} row costs more than the starting point's"
        trial = Trial(dict(values), ev, why, time.perf_counter() - t1)
        seen[tuple(sorted(values.items()))] = trial
        order.append(trial)
        if log is not None:
            log(f"{key}: {_fmt(values, start)}: {'rejected, ' + why if why else _rows(trial)}")
        return trial

    first = run(dict(start), None)
    best = first
    best_cost = first.cost if first.rejected is None else math.inf  # a spilling start: any clean setting beats it
    # The setting each pass varies: the best clean one; while none is clean, the one that spills the fewest
    # bytes (so that two knobs that each spill less reach a clean setting together).
    walk = best
    changed = True
    while changed and len(order) < max_configs:
        changed = False
        for cand in list(_settings_one_knob(cs, spec, walk.values)):
            if len(order) >= max_configs:
                break
            if tuple(sorted(cand.items())) in seen:
                continue
            trial = run(cand, first)
            if trial.rejected is None and trial.cost < best_cost - 1e-9:
                best, best_cost, walk, changed = trial, trial.cost, trial, True
            elif (best_cost == math.inf and trial.evaluation.error is None
                  and 0 < trial.evaluation.spill_bytes < walk.evaluation.spill_bytes):
                walk, changed = trial, True
    return ClassResult(key, spec, start, tuple(order), best, time.perf_counter() - t0)


# --------------------------------------------------------------------------- the table
def write_table(results: Iterable[ClassResult], path: Path | None = None, *, major: int | None = None) -> Path:
    """Merge the winners of ``results`` into the table at ``path`` (default: the one their family
    reads; results of several families need one call each) and return the path. A class whose winner
    is its starting point is stored too (the search ran; nothing beat the rules)."""
    results = list(results)
    sets = {id(s): s for s in (_checked_set(r.spec) for r in results)}
    if path is None and len(sets) > 1:
        raise InputError("results", "the classes of one family (each family has its own table)",
                         sorted({r.spec.impl for r in results}))
    p = Path(path) if path is not None else next(iter(sets.values())).table if sets else None
    if p is None:
        raise InputError("results", "at least one class", "none")
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        data = {}
    if data.get("format") != TABLE_FORMAT:
        data = {"format": TABLE_FORMAT, "classes": {}}
    for r in results:
        b, s = r.best, r.start_trial
        data["classes"][r.key] = {
            "values": {k: int(v) for k, v in sorted(b.values.items())},
            "cost": {k: round(v, 1) for k, v in b.evaluation.rows.items()},
            "start_cost": {k: round(v, 1) for k, v in s.evaluation.rows.items()},
            "tried": len(r.trials), "spec": r.spec.model_dump(mode="json", exclude_defaults=True),
        }
    data["classes"] = dict(sorted(data["classes"].items()))
    try:
        p.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    except OSError as e:
        raise InputError("table", "a writable file", f"{p} ({e.strerror or e})") from None
    clear_tables()
    return p


#: The wgmma backward's feature classes the search covers beside the plain rows (at d = 64 and 128): the
#: feature rows of docs/performance.md's Hopper tables.
WGMMA_FEATURES: tuple[dict[str, bool], ...] = (
    {"deterministic": True}, {"deterministic": True, "key_padding": True}, {"deterministic": True, "varlen": True},
    {"deterministic": True, "causal": True}, {"bias": True}, {"bias": True, "bias_grad": True},
    {"attn_mask": True}, {"dropout": True}, {"softcap": True}, {"alibi": True}, {"varlen": True},
    {"key_padding": True}, {"window": True})
#: Further wgmma classes, at a head dim of their own: rows whose starting point spilled; the split tile's ALiBi and
#: softcap (alibi_fold, softcap_rcp), and ALiBi at d = 128 with causal (where alibi_fold spills) or deterministic.
WGMMA_EXTRA: tuple[dict, ...] = (
    {"head_dim": 256, "causal": True, "varlen": True, "dropout": True},
    {"head_dim": 256, "causal": True, "varlen": True, "dropout": True, "deterministic": True},
    {"head_dim": 192, "alibi": True}, {"head_dim": 256, "alibi": True}, {"head_dim": 192, "softcap": True},
    {"head_dim": 256, "softcap": True}, {"head_dim": 128, "alibi": True, "causal": True},
    {"head_dim": 128, "alibi": True, "deterministic": True})


def default_classes(impl: str | None = None) -> list[KernelSpec]:
    """The classes ``--all`` searches (``impl``: one family's only). mma: benchmarks/sass_cost.py's default
    rows -- backward and forward, float16 and bfloat16, d = 64 and 128, sm_80 and sm_90, causal or not.
    wgmma (sm_90a, the backward, whose knobs these are): float16 and bfloat16, d = 64, 128, 192 and 256
    causal or not, at d = 64 and 128 each of :data:`WGMMA_FEATURES`, and :data:`WGMMA_EXTRA`."""
    out: list[KernelSpec] = []
    if impl in (None, "mma"):
        out += [KernelSpec(direction=dr, dtype=dt, head_dim=d, arch=a, causal=c, impl="mma")
                for dr in ("bwd", "fwd") for a in ("sm_80", "sm_90") for dt in ("float16", "bfloat16")
                for d in (64, 128) for c in (False, True)]
    if impl in (None, "wgmma"):
        dts = ("float16", "bfloat16")
        out += [KernelSpec(direction="bwd", dtype=dt, head_dim=d, arch="sm_90a", causal=c, impl="wgmma")
                for dt in dts for d in (64, 128, 192, 256) for c in (False, True)]
        out += [KernelSpec(direction="bwd", dtype=dt, head_dim=d, arch="sm_90a", impl="wgmma", **f)
                for dt in dts for d in (64, 128) for f in WGMMA_FEATURES]
        out += [KernelSpec(direction="bwd", dtype=dt, arch="sm_90a", impl="wgmma", **f) for dt in dts for f in WGMMA_EXTRA]
    if impl is not None and impl not in FAMILIES:
        raise InputError("impl", f"a family with codegen knobs ({', '.join(FAMILIES)})", impl)
    return out


def generated_classes(major: int | None) -> frozenset[str]:
    """The classes of the kernels ``generated/`` holds (``fagen.generate.all_specs``): the shipped tables
    leave them at their starting points, so that the emitted source does not depend on the NVRTC major
    (or its absence) of the machine that renders it."""
    from ..generate import all_specs

    return frozenset(class_key(s.family_spec, major) for s in all_specs() if codegen_set(s) is not None)


def current_major() -> int:
    major = nvrtc_major()
    if major is None:
        raise CodegenSearchError("no NVRTC found: the stored search compiles every setting (pip install 'fagen[cuda12]')")
    return major


# --------------------------------------------------------------------------- fagen tune-codegen
def add_arguments(p) -> None:
    g = p.add_argument_group("tune-codegen options")
    g.add_argument("--all", action="store_true",
                   help="every default class of the families with codegen knobs (mma, wgmma; with --impl, that "
                        "family's) instead of the spec's (default: off)")
    g.add_argument("--max-configs", type=int, default=DEFAULT_MAX_CONFIGS, metavar="N",
                   help=f"settings tried per class at most, the starting point included (default: {DEFAULT_MAX_CONFIGS})")
    g.add_argument("--table", type=str, default=None, metavar="PATH",
                   help="the table to merge the winners into (default: the one the class's family reads)")
    g.add_argument("--dry-run", action="store_true", help="search and print, write no table (default: off)")


def run(args, spec: KernelSpec | None) -> int:
    """The body of ``fagen tune-codegen`` (``spec``: the class's spec; None with --all)."""
    import logging

    if args.max_configs < 1:
        raise InputError("--max-configs", "at least 1", args.max_configs)
    table = None if args.table is None else Path(args.table).expanduser()
    if table is not None and not table.resolve().parent.is_dir():
        raise InputError("--table", "a file in an existing directory", f"{table.resolve().parent} does not exist")
    if spec is not None and codegen_set(spec) is None:
        raise InputError("--impl", f"a spec a family with codegen knobs takes ({', '.join(FAMILIES)}; tune-codegen "
                         "searches them)", spec.impl)
    impl = getattr(args, "impl", None)
    if spec is None and impl is not None and impl not in FAMILIES:
        raise InputError("--impl", f"a family with codegen knobs ({', '.join(FAMILIES)})", impl)
    if spec is None and table is not None and impl is None:
        raise InputError("--table", "one family's classes (--all --impl mma or --impl wgmma): each family has its "
                         "own table", "--all of every family")
    specs = default_classes(impl) if spec is None else [spec]
    major = current_major()
    log = logging.getLogger("fagen").info
    generated = generated_classes(major) if table is None else frozenset()
    written: dict[str, int] = {}
    for s in specs:
        r = search_class(s, max_configs=args.max_configs, major=major, log=log)
        print("\n".join(r.summary()), flush=True)
        if args.dry_run:
            continue
        if r.key in generated:
            print("  not stored: a class of generated/ (its kernels are rendered from the starting points, whatever "
                  "NVRTC renders them; --table PATH stores it elsewhere)", flush=True)
            continue
        out = write_table([r], table, major=major)  # class by class: an interrupted --all keeps what it found
        written[str(out)] = written.get(str(out), 0) + 1
    for path, n in written.items():
        print(f"wrote {n} class(es) to {path}")
    return 0
