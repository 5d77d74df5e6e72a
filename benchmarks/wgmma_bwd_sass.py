"""Static SASS of the Hopper family's (``wgmma``, sm_90a) backward main kernels, no GPU needed.

For each row (fp16 / bf16, head dim 64 / 96 / 128, causal or not, one or two consumer warpgroups)
NVRTC compiles the kernel for sm_90a and nvdisasm disassembles it; ``fagen.autotune.sassloops.
tile_loop`` walks one trip of its tile loop on the path of an interior tile pair (``[diag]``: a
partially masked one, causal rows), with the HGMMA count the family's ``tile_work`` states.
Printed per row: registers at launch and after ``setmaxnreg`` (consumer / producer), spill bytes,
smem, the loop's HGMMA / LDSM, its instructions per warp and their sum over the consumer warps
per 1e6 backward FLOPs of the tile pair (10 Br Bc d), beside FlashAttention-3's figure (static
SASS of its released sm_90a binary, interior tile; two consumer warpgroups; none at d = 96).

    python benchmarks/wgmma_bwd_sass.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fagen import KernelSpec, sass  # noqa: E402
from fagen.autotune.sassloops import tile_loop  # noqa: E402
from fagen.compiler import compile as compile_spec  # noqa: E402
from fagen.families import get_family  # noqa: E402

#: FlashAttention-3 backward, warp-instructions per 1e6 FLOPs in its steady-state loop (fp16; bf16 the same).
FA3_BWD = {(64, False): 551, (64, True): 525, (128, False): 321, (128, True): 389}


def rows() -> list[KernelSpec]:
    return [KernelSpec(direction="bwd", head_dim=d, dtype=dt, causal=c, num_warps=w, arch="sm_90a")
            for w in (8, 4) for d in (64, 96, 128) for dt in ("float16", "bfloat16") for c in (False, True)]


def main() -> int:
    if sass.nvdisasm_path() is None:
        print("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
        return 1
    print(f"{'spec':<60} {'regs':>11} {'spill':>5} {'smem':>7} {'HGMMA':>5} {'LDSM':>4} {'loop':>5} "
          f"{'/1e6 FLOP':>9} {'FA3':>5}")
    for spec in rows():
        fam = get_family(spec.impl)
        mod = compile_spec(spec)
        res = mod.resource("main")
        name = mod.rendered.kernel("main").name
        text = sass.disassemble(mod.cubin)
        consts = {c.name: c.value for c in fam.template_context(spec.family_spec)["constants"]}
        regs = f"{res.registers}>{consts['CONSUMER_REGS']}/{consts['PRODUCER_REGS']}"
        work = fam.tile_work(spec.family_spec, "main")
        t = spec.tile
        flops = 10 * t.block_r * t.block_c * spec.head_dim
        for diag in (False, True) if spec.causal else (False,):
            loop = tile_loop(text, name, work, diagonal=diag)
            if loop is None:
                continue
            label = spec.name + (" [diag]" if diag else "")
            per = loop.total() * spec.num_warps / (flops / 1e6)
            print(f"{label:<60} {regs:>11} {res.spill_store_bytes + res.spill_load_bytes:>5} {res.smem_bytes:>7} "
                  f"{loop.count('HGMMA'):>5.0f} {loop.count('LDSM'):>4.0f} {loop.total():>5.0f} {per:>9.0f} "
                  f"{FA3_BWD.get((spec.head_dim, spec.causal), '-'):>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
