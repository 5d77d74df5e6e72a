"""NVRTC compiles the Hopper primitives (templates/wgmma/hopper.cuh) for sm_90a, and the SASS
shows the instructions they stand for -- HGMMA (wgmma), UTMALDG / UTMASTG / UTMAREDG (TMA load,
store, reduce-add), SYNCS (mbarrier), STSM (stmatrix), USETMAXREG (setmaxnreg), ELECT -- with
no spills and no local memory. No GPU needed."""
from __future__ import annotations

from pathlib import Path

import pytest

from fagen import nvrtc, sass

REPO = Path(__file__).resolve().parent.parent
PRELUDE = (REPO / "templates/partials/primitives.cuh").read_text() + "\n" + \
    (REPO / "templates/wgmma/hopper.cuh").read_text() + "\n"

pytestmark = pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")


def compile_sm90a(body: str):
    res = nvrtc.compile_cubin(PRELUDE + body, "hopper.cu", ["-arch=sm_90a", "-std=c++17", "-Xptxas=-v"], "sm_90a")
    assert res.ok, res.log
    return res


def no_local_memory(res, mix) -> None:
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in res.log, res.log
    for name, ops in mix.items():
        assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0, (name, ops)


def test_hopper_kernels_show_the_hopper_instructions() -> None:
    res = compile_sm90a((REPO / "tests/hopper_kernels.cu").read_text())
    mix = sass.instruction_mix(res.cubin)
    no_local_memory(res, mix)
    gemm, rest = mix["hopper_gemm"], mix["hopper_rest"]
    for op in ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG", "ELECT", "WARPGROUP"):
        assert gemm.get(op, 0) > 0, (op, gemm)
    for op in ("HGMMA", "UTMALDG", "UTMASTG", "UTMAREDG", "UBLKCP", "UBLKRED", "SYNCS", "STSM"):
        assert rest.get(op, 0) > 0, (op, rest)
    assert rest["UTMAREDG"] == 3 and rest["STSM"] == 4 and gemm["UTMALDG"] == 3


def _every_n_kernels() -> str:
    """One kernel per N: four wgmmas (f16 / bf16, shared / register A, both transposes) chained into d."""
    out = []
    for i, n in enumerate(range(8, 257, 8)):
        ta, tb = i % 2, (i // 2) % 2
        out.append(f"""
extern "C" __global__ void __launch_bounds__(128) every_n{n}(float* out, unsigned long long da, unsigned long long db,
                                                             int flag) {{
    unsigned a[4] = {{1u, 2u, 3u, (unsigned)flag}};
    float d[{n // 2}];
    for (int j = 0; j < {n // 2}; ++j) d[j] = out[j];
    fa_wgmma_fence();
    fa_wgmma_m64nNk16_ss<__half, {n}, {ta}, {tb}>(d, da, db, flag);
    fa_wgmma_m64nNk16_ss<__nv_bfloat16, {n}, {tb}, {ta}>(d, da, db, 1);
    fa_wgmma_m64nNk16_rs<__half, {n}, {tb}>(d, a, db, 1);
    fa_wgmma_m64nNk16_rs<__nv_bfloat16, {n}, {ta}>(d, a, db, 1);
    fa_wgmma_commit_group();
    fa_wgmma_wait_group<0>();
    for (int j = 0; j < {n // 2}; ++j) out[threadIdx.x * {n // 2} + j] = d[j];
}}
""")
    return "".join(out)


def test_every_wgmma_shape_compiles_to_hgmma() -> None:
    """N = 8..256 in steps of 8, both dtypes, both operand sources, both transposes: four HGMMA
    of the right shape per kernel."""
    res = compile_sm90a(_every_n_kernels())
    mix = sass.instruction_mix(res.cubin)
    no_local_memory(res, mix)
    code = sass.kernel_sass(res.cubin)
    for n in range(8, 257, 8):
        hgmma = [i.mnemonic for i in code[f"every_n{n}"] if i.opcode == "HGMMA"]
        assert len(hgmma) == 4 and all(f"64x{n}x16" in m for m in hgmma), (n, hgmma)


def test_sm90a_cubins_pass_the_arch_check() -> None:
    """e_flags name the SM only: an sm_90a cubin is checked as sm_90, and is no sm_80 cubin."""
    from fagen import elf

    cubin = compile_sm90a('extern "C" __global__ void k(float* x) { x[0] = 1.f; }').cubin
    elf.check_cubin(cubin, "sm_90a")
    elf.check_cubin(cubin, "sm_90")
    with pytest.raises(elf.ElfError, match="expected sm_80"):
        elf.check_cubin(cubin, "sm_80a")
