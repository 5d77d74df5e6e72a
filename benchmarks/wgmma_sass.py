"""Static SASS of the Hopper family's (``wgmma``, sm_90a) default forward kernels, no GPU needed.

For each default row (fp16 / bf16, head dim 64 / 128, causal or not) NVRTC compiles the kernel
for sm_90a and nvdisasm disassembles it; the tile loop is the smallest loop of the kernel that
holds every HGMMA. Printed per row: registers at launch and after ``setmaxnreg`` (consumer /
producer), spills, smem, the tile loop's HGMMA / LDSM counts and its static instruction count,
and that count per 1e6 forward FLOPs of one consumer warp's tile (16 rows x block_c x 4d),
beside FlashAttention-3's figure for the same head dim (static SASS of its released sm_90a
binary, interior tile). The static count holds both paths of the loop (the interior tile and
the masked boundary tile) and the mbarrier wait loops, so it over-counts the interior path.

    python benchmarks/wgmma_sass.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fagen import KernelSpec, sass  # noqa: E402
from fagen.compiler import compile as compile_spec  # noqa: E402
from fagen.families import get_family  # noqa: E402

#: FlashAttention-3 forward, warp-instructions per 1e6 FLOPs in its steady-state loop (fp16; bf16 the same).
FA3_FWD = {(64, False): 813, (64, True): 836, (128, False): 420, (128, True): 458}


def tile_loop(cubin: bytes, kernel: str) -> dict[str, int] | None:
    """Opcode counts of the smallest loop holding every HGMMA of ``kernel`` (None: no disassembler)."""
    text = sass.disassemble(cubin)
    if text is None:
        return None
    instrs = sass.parse(text)[kernel]
    hg = [i.address for i in instrs if i.opcode == "HGMMA"]
    spans = [s for s in sass.loop_spans(text).get(kernel, []) if hg and s[0] <= min(hg) and max(hg) <= s[1]]
    if not spans:
        return None
    lo, hi = min(spans, key=lambda s: s[1] - s[0])
    return sass.mix_of([i for i in instrs if lo <= i.address <= hi])


def rows() -> list[KernelSpec]:
    return [KernelSpec(direction="fwd", head_dim=d, dtype=dt, causal=c, arch="sm_90a")
            for d in (64, 128) for dt in ("float16", "bfloat16") for c in (False, True)]


def main() -> int:
    if sass.nvdisasm_path() is None:
        print("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
        return 1
    print(f"{'spec':<52} {'regs':>11} {'spill':>5} {'smem':>7} {'HGMMA':>5} {'LDSM':>4} {'loop':>5} "
          f"{'/1e6 FLOP':>9} {'FA3':>5}")
    for spec in rows():
        mod = compile_spec(spec)
        res = mod.resource("main")
        name = mod.rendered.kernel("main").name
        loop = tile_loop(mod.cubin, name) or {}
        consts = {c.name: c.value for c in get_family(spec.impl).template_context(spec.family_spec)["constants"]}
        total = sum(loop.values())
        flops = 4 * 16 * spec.tile.block_c * spec.head_dim
        regs = f"{res.registers}>{consts['CONSUMER_REGS']}/{consts['PRODUCER_REGS']}"
        print(f"{spec.name:<52} {regs:>11} {res.spill_store_bytes:>5} {res.smem_bytes:>7} {loop.get('HGMMA', 0):>5} "
              f"{loop.get('LDSM', 0):>4} {total:>5} {total / flops * 1e6:>9.0f} {FA3_FWD[(spec.head_dim, spec.causal)]:>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
