"""Instructions the tensor-core kernels issue per unit of work, counted in their own SASS (no GPU).

    python benchmarks/sass_cost.py                         # fagen's default kernels, bwd and fwd
    python benchmarks/sass_cost.py --direction bwd --arch sm_90 --dtype float16
    python benchmarks/sass_cost.py --spec 'direction=bwd,head_dim=128,block_r=64,block_c=128,num_warps=8,knobs=stages:1'
    python benchmarks/sass_cost.py --spec 'direction=fwd,head_dim=128,arch=sm_80,codegen=fwd_q_in_regs:0'
    python benchmarks/sass_cost.py --reference PATH        # + FlashAttention-2 kernels of a binary
    python benchmarks/sass_cost.py --json

For one interior, fully visible tile pair the steady-state tile loop of each kernel's SASS is walked
(``fagen.autotune.sassloops.tile_loop``): the loop whose single trip does the pair's GEMMs (5 in the
backward, 2 in the forward), its nested loops counted times their trip counts (solved from the
tensor-core instructions, 16-byte copies and dQ reductions the pair must issue), predicated
instructions counted, the code a branch skips on full tiles (the mask) and the element-copy fallback
for unaligned tensors not counted. The warp instructions summed over the CTA's warps are divided by
the pair's tensor-core FLOPs / 1e6 (backward 10 Br Bc d, forward 4 Br Bc d; one HMMA.16816 is 4096).
``causal`` rows are the causal kernel's interior tiles, ``diag`` its diagonal (partially masked) ones.
docs/performance.md describes the method and its limits.

``--reference PATH`` (a wheel, a shared library, a cubin or a folder of them, for example one of
FlashAttention-2's binary wheels downloaded by the user; nothing is downloaded here) adds a row for
every FlashAttention-2 backward/forward kernel found in it whose tile is readable from its mangled
name (``Flash_{bwd,fwd}_kernel_traits<d, Br, Bc, warps, ...>``). Embedded cubins are read from the
binary directly when stored uncompressed, or through ``cuobjdump -xelf all`` when it is on PATH.
Needs ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, the ``test`` extra).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from fagen.autotune.sassloops import HMMA_FLOPS, measure, pair_flops, red_width  # noqa: F401 - the figures (re-exported)
from fagen.families.base import k16_padded

#: Columns of the table ("MMA": HMMA.16816 of the mma family, HGMMA of the wgmma family).
COLUMNS = ("kernel", "d", "tile", "warps", "regs", "smem KiB", "spills", "instr/1e6 FLOPs", "FA3", "instr/MMA",
           "LDSM/MMA", "int+ctrl/MMA")
#: FlashAttention-3 on sm_90a, warp instructions per 1e6 FLOPs: static counts of its released binary's
#: SASS, interior tile, fp16 (bf16 the same), every warp of the CTA, (direction, head dim, causal).
FA3 = {("fwd", 64, False): 813, ("fwd", 64, True): 836, ("fwd", 128, False): 420, ("fwd", 128, True): 458,
       ("bwd", 64, False): 551, ("bwd", 64, True): 525, ("bwd", 128, False): 321, ("bwd", 128, True): 389}


@dataclass(frozen=True)
class Row:
    name: str
    direction: str
    head_dim: int
    block_r: int
    block_c: int
    num_warps: int
    registers: int | None
    smem_bytes: int | None
    spill_bytes: int | None
    per_mflop: float
    per_hmma: float
    ldsm_per_hmma: float
    int_ctrl_per_hmma: float
    unsolved_loops: int
    variant: str = "interior"
    fa3: float | None = None  # FlashAttention-3's figure for the row's (direction, d, causal), sm_90a rows

    def cells(self) -> list[str]:
        regs = "-" if self.registers is None else str(self.registers)
        smem = "-" if self.smem_bytes is None else f"{self.smem_bytes / 1024:.0f}"
        spill = "-" if self.spill_bytes is None else str(self.spill_bytes)
        flag = "" if not self.unsolved_loops else f" ({self.unsolved_loops} loop(s) counted once)"
        return [self.name + flag, str(self.head_dim), f"{self.block_r}x{self.block_c}", str(self.num_warps), regs,
                smem, spill, f"{self.per_mflop:.0f}", "-" if self.fa3 is None else f"{self.fa3:.0f}",
                f"{self.per_hmma:.2f}", f"{self.ldsm_per_hmma:.2f}",
                f"{self.int_ctrl_per_hmma:.2f}"]


def measure_specialised(text: str, kernel: str, fs, *, diagonal: bool = False):
    """(consumer TileLoop, producer TileLoop, instructions per 1e6 FLOPs) of a warp-specialised kernel
    (the wgmma family): ``fagen.autotune.sassloops.measure_specialised`` -- the consumer warps' tile
    loop(s) walked with the family's work (the split tile's two warpgroups each with its own), the
    producer warp's loop (the one holding the TMA loads) with its ``producer_work``; every warp of the
    CTA counted. None when a loop is not found."""
    from fagen.autotune.sassloops import measure_specialised as measure_ws
    from fagen.families import get_family

    fam = get_family("wgmma")
    if fam.consumer_loops(fs) is None:  # a direction whose work the family does not state: no row
        print(f"sass_cost: the wgmma family states no tile work for direction={fs.direction}", file=sys.stderr)
        return None
    return measure_ws(text, kernel, fs, fam, diagonal=diagonal)


def row_of(name: str, loop, per_mflop: float, direction: str, head_dim: int, block_r: int, block_c: int,
           num_warps: int, registers: int | None, smem: int | None, spills: int | None, variant: str,
           fa3: float | None = None) -> Row:
    hmma = loop.count("HMMA", "HGMMA") or 1.0
    cls = loop.by_class()
    return Row(name, direction, head_dim, block_r, block_c, num_warps, registers, smem, spills, per_mflop,
               loop.total() / hmma, loop.count("LDSM") / hmma, (cls.get("int", 0) + cls.get("ctrl", 0)) / hmma,
               len(loop.unsolved), variant, fa3)


# ------------------------------------------------------------------------------------------ fagen
def parse_spec(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, _, val = part.partition("=")
        key = key.strip()
        val = val.strip()
        if val in ("True", "true", "False", "false"):
            out[key] = val.lower() == "true"
        elif re.fullmatch(r"-?\d+", val):
            out[key] = int(val)
        elif key in ("knobs", "codegen"):  # knobs=stages:1;other:2, codegen=fwd_q_in_regs:0
            out[key] = {k: int(v) for k, v in (kv.split(":") for kv in val.split(";") if kv)}
        else:
            out[key] = val
    return out


def fagen_rows(specs: Iterable[dict[str, Any]]) -> list[Row]:
    from fagen import sass
    from fagen.compiler import compile as compile_spec
    from fagen.spec import KernelSpec

    rows = []
    for fields in specs:
        spec = KernelSpec(**fields)
        mod = compile_spec(spec)
        text = sass.disassemble(mod.cubin)
        if text is None:
            raise SystemExit("sass_cost: nvdisasm not found (pip install nvidia-cuda-nvdisasm, or the 'test' extra)")
        res = mod.resource("main")
        kname = mod.rendered.kernel("main").name
        t = spec.tile
        dp = k16_padded(spec.head_dim)
        variants = [("interior", False)] + ([("diag", True)] if spec.causal else [])
        fa3 = FA3.get((spec.direction, spec.head_dim, spec.causal)) if spec.impl == "wgmma" and not spec.head_dim_v else None
        for variant, diag in variants:
            if spec.impl == "wgmma":
                spec_got = measure_specialised(text, kname, spec.family_spec, diagonal=diag)
                got = None if spec_got is None else (spec_got[0], spec_got[2])
            else:
                got = measure(text, kname, spec.direction, spec.head_dim, dp, t.block_r, t.block_c, spec.num_warps,
                              diagonal=diag, dq_atomics=not getattr(spec, "deterministic", False),
                              head_dim_v=spec.head_dim_v)
            if got is None:
                continue
            loop, per = got
            label = f"fagen {spec.name}" + (f" [{variant}]" if variant != "interior" else "")
            rows.append(row_of(label, loop, per, spec.direction, spec.head_dim, t.block_r, t.block_c,
                               spec.num_warps, res.registers, spec.smem_bytes,
                               res.spill_store_bytes + res.spill_load_bytes, variant,
                               fa3 if variant == "interior" else None))
    return rows


def default_specs(directions: Iterable[str], dtypes: Iterable[str], dims: Iterable[int], archs: Iterable[str],
                  causal: Iterable[bool]) -> list[dict[str, Any]]:
    """The default kernels of each combination; sm_90a rows only where the Hopper family (wgmma) takes
    the spec (elsewhere sm_90a resolves to the mma family, whose sm_90 rows are already there)."""
    from fagen.spec import KernelSpec

    out = [{"direction": dr, "dtype": dt, "head_dim": d, "arch": a, "causal": c}
           for dr in directions for a in archs for dt in dtypes for d in dims for c in causal]
    return [f for f in out if f["arch"] != "sm_90a" or KernelSpec(**f).impl == "wgmma"]


# ------------------------------------------------------------------------------ reference binaries
_TRAITS = re.compile(r"Flash_(bwd|fwd)_kernel_traits((?:ILi\d+E|Li\d+E)+)")
_INT = re.compile(r"Li(\d+)E")


def cubins_in(path: Path) -> list[bytes]:
    """Every complete cubin (ELF64, EM_CUDA) stored in ``path``: a cubin, a shared library or any binary
    that embeds uncompressed ones, a wheel (zip) of those, or a folder; ``cuobjdump -xelf all`` is used
    for shared libraries when it is on PATH (it also unpacks compressed fat binaries)."""
    from fagen import elf

    if path.is_dir():
        return [c for p in sorted(path.rglob("*")) if p.is_file() for c in cubins_in(p)]
    data = path.read_bytes()
    if zipfile.is_zipfile(path):
        out: list[bytes] = []
        with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory(prefix="sass-cost-") as d:
            for info in z.infolist():
                if info.filename.endswith((".so", ".cubin")) or ".so." in info.filename:
                    z.extract(info, d)
                    out += cubins_in(Path(d) / info.filename)
        return out
    tool = shutil.which("cuobjdump")
    if tool and data[:4] == b"\x7fELF" and not _is_cubin(data):
        with tempfile.TemporaryDirectory(prefix="sass-cost-") as d:
            subprocess.run([tool, "-xelf", "all", str(path.resolve())], cwd=d, capture_output=True, check=False)
            found = [p.read_bytes() for p in sorted(Path(d).glob("*.cubin"))]
        if found:
            return found
    out = []
    start = 0
    while True:
        at = data.find(b"\x7fELF\x02\x01", start)
        if at < 0:
            break
        start = at + 4
        blob = data[at:]
        try:
            h = elf.header(blob)
        except elf.ElfError:
            continue
        if h.machine != elf.EM_CUDA:
            continue
        size = _elf_size(blob)
        if size:
            out.append(bytes(blob[:size]))
            start = at + size
    return out


def _is_cubin(data: bytes) -> bool:
    from fagen import elf

    try:
        return elf.header(data).machine == elf.EM_CUDA
    except elf.ElfError:
        return False


def _elf_size(blob: bytes) -> int:
    """Bytes of the ELF at the start of blob: the end of its last section or header table."""
    import struct

    from fagen import elf

    try:
        h = elf.header(blob)
        end = max(h.shoff + h.shnum * h.shentsize, h.phoff + h.phnum * h.phentsize)
        for i in range(h.shnum):
            _n, typ, _f, _a, off, size, *_ = struct.unpack_from("<IIQQQQIIQQ", blob, h.shoff + i * h.shentsize)
            if typ != elf.SHT_NOBITS:
                end = max(end, off + size)
        elf.sections(blob[:end])
        return end
    except (elf.ElfError, struct.error):
        return 0


def reference_rows(path: Path, name_filter: str) -> list[Row]:
    """Rows for the FlashAttention-2 (mma.sync) kernels in ``path`` whose tile the mangled name gives."""
    from fagen import elf, sass

    rows = []
    pat = re.compile(name_filter)
    for cubin in cubins_in(path):
        try:
            arch = elf.cubin_arch(cubin)
        except elf.ElfError:
            continue
        text = sass.disassemble(cubin)
        if text is None:
            raise SystemExit("sass_cost: nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
        for kname in sass.parse(text):
            m = _TRAITS.search(kname)
            if not m or not pat.search(kname):
                continue
            direction = m.group(1)
            ints = [int(x) for x in _INT.findall(m.group(2))]
            if len(ints) < 4:
                continue
            d, br, bc, warps = ints[:4]
            got = measure(text, kname, direction, d, k16_padded(d), br, bc, warps)
            if got is None:
                continue
            loop, per = got
            short = f"FA2 {direction} d{d} {arch} ({kname[:48]}...)"
            rows.append(row_of(short, loop, per, direction, d, br, bc, warps, None, None, None, "interior"))
    return rows


# ----------------------------------------------------------------------------------------- output
def table(rows: list[Row]) -> str:
    cells = [list(COLUMNS)] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(COLUMNS)))
             for c in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--direction", choices=("bwd", "fwd"), action="append", help="default: both")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), action="append", help="default: both")
    ap.add_argument("--head-dim", type=int, action="append", help="default: 64 and 128")
    ap.add_argument("--arch", choices=("sm_80", "sm_90", "sm_90a"), action="append", help="default: all three")
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    ap.add_argument("--spec", action="append", default=[],
                    help="an extra spec as key=value,... (KernelSpec fields), e.g. "
                         "'direction=bwd,head_dim=128,block_r=64,block_c=128,num_warps=8'")
    ap.add_argument("--only-spec", action="store_true", help="only the --spec rows, not the default kernels")
    ap.add_argument("--reference", type=Path, action="append", default=[],
                    help="a FlashAttention-2 binary (wheel, .so, cubin or folder) to count beside fagen")
    ap.add_argument("--reference-filter", default=r"flash_(bwd|fwd)",
                    help="regex a reference kernel's mangled name must match")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    causal = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    specs = [] if args.only_spec else default_specs(args.direction or ["bwd", "fwd"],
                                                     args.dtype or ["float16", "bfloat16"],
                                                     args.head_dim or [64, 128],
                                                     args.arch or ["sm_80", "sm_90", "sm_90a"],
                                                     causal)
    specs += [parse_spec(s) for s in args.spec]
    rows = fagen_rows(specs)
    for ref in args.reference:
        if not ref.exists():
            ap.error(f"--reference {ref}: no such file or folder")
        found = reference_rows(ref, args.reference_filter)
        if not found:
            print(f"sass_cost: no FlashAttention-2 kernel with a readable tile in {ref} "
                  "(compressed fat binaries need cuobjdump on PATH)", file=sys.stderr)
        rows += found
    if args.json:
        json.dump([r.__dict__ for r in rows], sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    for direction in ("bwd", "fwd"):
        sel = [r for r in rows if r.direction == direction]
        if sel:
            print(f"\n{'backward' if direction == 'bwd' else 'forward'}: warp instructions of one tile pair's "
                  f"steady-state loop trip, summed over the CTA's warps")
            print(table(sel))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
