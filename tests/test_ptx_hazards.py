"""PTX-level hazards (fagen.emulator.ptx): what only the translated PTX shows.

A hand-written register-A wgmma kernel, compiled by NVRTC for compute_90a and run at the PTX level:
* MODE 0 (the corrected order): the wait, then stmatrix of the A fragment -> runs clean, D = A B;
* MODE 1 (the defect templates/wgmma/bwd.cu.j2 once had): stmatrix of the A registers after the
  commit, before ``wgmma.wait_group`` -> PtxHazardError naming the kernel, the PTX line of the
  stmatrix, the CTA and the warp;
* MODE 2: the accumulator stored to global memory before the wait -> PtxHazardError;
* MODE 3: the A fragment rewritten after ``wgmma.fence`` and before the wgmma -> PtxHazardError
  (a wgmma issued without a fence after its registers were accessed);
* MODE 4: warp 0 waits at one ``wgmma.wait_group`` and the other warps at another: the
  ``.sync.aligned`` instruction is not executed together by the warpgroup -> a divergence error
  naming both PTX lines;
* MODE 5: B written to shared memory with plain stores and no ``fence.proxy.async`` before the
  barrier and the wgmma that reads it through its descriptor (the async proxy) -> PtxHazardError
  at the wgmma naming the store's PTX line.
Plus: a divergent ``bar.sync`` (two PTX lines) is a divergence error naming the PTX lines, and an
unknown instruction is a PtxUnsupportedError naming the opcode and line.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from fagen import renderer
from fagen.emulator import EmulatorDeadlockError, EmulatorError, KernelSig
from fagen.emulator.ptx import (
    PtxHazardError,
    PtxUnsupportedError,
    build_ptx,
    ptx_of_source,
)

_KERNEL = r"""
// D (64 x 8, f32) = A (64 x 16, f16, registers) x B (16 x 8, f16, shared, K-major, no swizzle)
extern "C" __global__ void hz(const unsigned* ain, const __half* b, float* out, unsigned* aout, float* early) {
    unsigned char* smem = fa_smem_1024();
    __half* sb = reinterpret_cast<__half*>(smem);
    __half* sa = reinterpret_cast<__half*>(smem + 1024);
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    {
        const int n = t / 16, k = t % 16;  // B[k][n] at core matrix (n, k % 8), K halves 128 bytes apart
        sb[n * 8 + (k % 8) + (k / 8) * 64] = b[k * 8 + n];
    }
#if MODE != 5
    fa_fence_proxy_async();                                   // B's generic writes -> the async proxy
#endif
    fa_sync();
    const unsigned long long db = fa_wgmma_desc(sb, 128, 256, FA_SWIZZLE_NONE);
    unsigned a[4];
    for (int r = 0; r < 4; ++r) a[r] = ain[4 * t + r];
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    // CUTLASS's warpgroup_fence_operand: the registers are defined before the fence (without it
    // NVVM sinks the zeroing past wgmma.fence, which the PTX level reports)
    asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+r"(a[0]), "+r"(a[1]), "+r"(a[2]), "+r"(a[3]));
    fa_wgmma_fence();
#if MODE == 3
    for (int r = 0; r < 4; ++r) a[r] = ain[4 * t + r] ^ 0u;   // reloaded after the fence
    asm volatile("" : "+r"(a[0]), "+r"(a[1]), "+r"(a[2]), "+r"(a[3]));
#endif
    fa_wgmma_m64nNk16_rs<__half, 8, 0>(d, a, db, 0);
    fa_wgmma_commit_group();
#if MODE == 1
    fa_stmatrix_x4(sa + lane * 8 + warp * 512, a);            // A still in flight: the hazard
#endif
#if MODE == 2
    for (int i = 0; i < 4; ++i) early[4 * t + i] = d[i];      // accumulator still in flight
#endif
#if MODE == 4
    if (warp == 0) fa_wgmma_wait_group<0>(); else fa_wgmma_wait_group<1>();   // not .aligned
#else
    fa_wgmma_wait_group<0>();
#endif
#if MODE != 1
    fa_stmatrix_x4(sa + lane * 8 + warp * 512, a);            // the corrected order: after the wait
#endif
    fa_sync();
    const unsigned* sau = reinterpret_cast<const unsigned*>(sa);
    for (int r = 0; r < 4; ++r) aout[4 * t + r] = sau[4 * t + r];
    for (int i = 0; i < 4; ++i) out[4 * t + i] = d[i];
}
"""

SIG = KernelSig("hz", (("const unsigned*", "ain"), ("const __half*", "b"), ("float*", "out"),
                       ("unsigned*", "aout"), ("float*", "early")))


def _source() -> str:
    root = renderer.templates_dir()
    return (root / "partials/primitives.cuh").read_text() + "\n" + (root / "wgmma/hopper.cuh").read_text() + _KERNEL


_mods: dict[int, object] = {}


def _module(mode: int):
    if mode not in _mods:
        ptx = ptx_of_source(_source(), "sm_90a", [f"-DMODE={mode}"], name=f"hz{mode}.cu")
        _mods[mode] = (ptx, build_ptx(ptx, [SIG]))
    return _mods[mode]


def _operands():
    rng = np.random.default_rng(5)
    A = rng.integers(-4, 5, (64, 16)).astype(np.float16)
    B = rng.integers(-4, 5, (16, 8)).astype(np.float16)
    bits = A.view(np.uint16).astype(np.uint32)
    ain = np.zeros((128, 4), np.uint32)  # mma.m16n8k16's A fragment, stacked per warp
    for t in range(128):
        w, g, q = t // 32, (t % 32) // 4, t % 4
        for r in range(4):
            row, col = 16 * w + g + 8 * (r & 1), 2 * q + 8 * (r >> 1)
            ain[t, r] = bits[row, col] | bits[row, col + 1] << 16
    D = A.astype(np.float64) @ B.astype(np.float64)
    want = np.zeros((128, 4), np.float32)
    for t in range(128):
        w, g, q = t // 32, (t % 32) // 4, t % 4
        for i in range(4):
            want[t, i] = D[16 * w + g + 8 * ((i >> 1) & 1), 2 * q + (i & 1)]
    return ain, B, want


def _launch(mode: int):
    ptx, mod = _module(mode)
    ain, B, want = _operands()
    out = np.zeros((128, 4), np.float32)
    aout = np.zeros((128, 4), np.uint32)
    early = np.zeros((128, 4), np.float32)
    mod.launch("hz", 1, 128, 8192, [ain, B, out, aout, early])
    return ptx, want, out


def _ptx_line(ptx: str, needle: str) -> int:
    return next(i for i, t in enumerate(ptx.splitlines(), 1) if needle in t)


def test_corrected_order_runs_clean_and_computes_d() -> None:
    _, want, out = _launch(0)
    np.testing.assert_array_equal(out, want)


def test_stmatrix_of_the_in_flight_a_fragment_is_a_hazard() -> None:
    ptx, mod = _module(1)
    line = _ptx_line(ptx, "stmatrix.sync.aligned")
    with pytest.raises(PtxHazardError) as info:
        _launch(1)
    e = info.value
    assert e.kernel == "hz" and e.block == (0, 0, 0) and e.ptx_line == line
    msg = str(e)
    assert f".ptx:{line}, warp 0," in msg and "in the A fragment of the wgmma.mma_async at PTX line" in msg
    assert "stmatrix.sync.aligned" in msg and "before the wgmma.wait_group" in msg


def test_accumulator_read_before_the_wait_is_a_hazard() -> None:
    ptx, _ = _module(2)
    with pytest.raises(PtxHazardError, match=r"is an accumulator of the wgmma.mma_async at PTX line \d+, still in "
                                             r"flight") as info:
        _launch(2)
    assert "st.global" in ptx.splitlines()[info.value.ptx_line - 1]


def test_wgmma_without_fence_after_its_registers_were_written_is_a_hazard() -> None:
    with pytest.raises(PtxHazardError, match="issued without wgmma.fence after its A fragment registers were accessed"):
        _launch(3)


def test_wait_group_not_executed_together_by_the_warpgroup_names_both_ptx_lines() -> None:
    ptx, _ = _module(4)
    lines = [i for i, t in enumerate(ptx.splitlines(), 1) if "wgmma.wait_group.sync.aligned" in t]
    assert len(lines) == 2
    with pytest.raises(EmulatorDeadlockError, match=r"divergent warpgroup collective") as info:
        _launch(4)
    assert all(f".ptx:{n}" in str(info.value) for n in lines)


def test_wgmma_operand_written_without_fence_proxy_async_is_a_hazard() -> None:
    ptx, _ = _module(5)
    lines = ptx.splitlines()
    with pytest.raises(PtxHazardError) as info:
        _launch(5)
    e = info.value
    assert "wgmma.mma_async" in lines[e.ptx_line - 1]
    m = re.search(r"written through the generic proxy by thread (\d+) at PTX line (\d+) with no fence.proxy.async "
                  r"by that thread since", str(e))
    assert m and lines[int(m.group(2)) - 1].strip().startswith("st.shared"), str(e)
    assert "fence.proxy.async" not in ptx and "fence.proxy.async" in _module(0)[0]


def test_hazard_error_is_an_emulator_error() -> None:
    assert issubclass(PtxHazardError, EmulatorError) and issubclass(PtxUnsupportedError, EmulatorError)


_DIVERGENT = r"""
extern "C" __global__ void div(float* out) {
    if (threadIdx.x < 32) { out[threadIdx.x] = 1.f; __syncthreads(); }
    else { out[threadIdx.x] = 2.f; __syncthreads(); }
}
"""


def test_divergent_bar_sync_names_the_ptx_lines() -> None:
    ptx = ptx_of_source(_DIVERGENT, "sm_80", name="div.cu")
    lines = [i for i, t in enumerate(ptx.splitlines(), 1) if "bar.sync" in t]
    if len(lines) < 2:
        pytest.skip("NVVM merged the two barriers")
    mod = build_ptx(ptx, [KernelSig("div", (("float*", "out"),))])
    with pytest.raises(EmulatorDeadlockError, match=r"divergent __syncthreads.*\.ptx:\d+ while .* at .*\.ptx:\d+"):
        mod.launch("div", 1, 64, 0, [np.zeros(64, np.float32)])


def test_unknown_instruction_is_a_typed_error_naming_opcode_and_line() -> None:
    ptx = "\n".join([
        ".version 8.0", ".target sm_80", ".address_size 64", "",
        ".visible .entry k(.param .u64 p)", "{", "\t.reg .b32 %r<3>;",
        "\tmov.u32 %r1, 1;", "\tfrobnicate.b32 %r2, %r1;", "\tret;", "}"])
    with pytest.raises(PtxUnsupportedError) as info:
        build_ptx(ptx, [KernelSig("k", (("float*", "p"),))])
    assert info.value.opcode == "frobnicate.b32" and info.value.line == 9 and info.value.kernel == "k"
    assert "PTX line 9" in str(info.value)
    # a known opcode with an unknown modifier is refused too
    with pytest.raises(PtxUnsupportedError, match=r"unsupported PTX add\.sat\.u32 at PTX line 9"):
        build_ptx(ptx.replace("frobnicate.b32 %r2, %r1", "add.sat.u32 %r2, %r1, %r1"), [KernelSig("k", (("float*", "p"),))])


_SPLIT_MMA = """
.version 8.0
.target sm_80
.address_size 64
.visible .entry split(.param .u64 po)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .f32 %f<12>;
    .reg .b64 %rd<4>;
    mov.u32 %r1, %tid.x;
    mov.u32 %r2, 0;
    mov.f32 %f1, 0f00000000;
    setp.lt.u32 %p1, %r1, 16;
    @%p1 bra $LOW;
    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f2, %f3, %f4, %f5}, {%r2, %r2, %r2, %r2}, {%r2, %r2}, {%f1, %f1, %f1, %f1};
    bra.uni $DONE;
$LOW:
    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f2, %f3, %f4, %f5}, {%r2, %r2, %r2, %r2}, {%r2, %r2}, {%f1, %f1, %f1, %f1};
$DONE:
    ld.param.u64 %rd1, [po];
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.f32 [%rd3], %f2;
    ret;
}
"""


def test_aligned_mma_split_across_two_ptx_lines_is_a_divergence() -> None:
    """mma.sync.aligned needs every lane at the same instruction: half a warp at each of two
    mma.sync lines is reported with both lines (the operation alone would agree)."""
    mod = build_ptx(_SPLIT_MMA, [KernelSig("split", (("float*", "o"),))])
    first, second = (i for i, t in enumerate(_SPLIT_MMA.splitlines(), 1) if "mma.sync" in t)
    with pytest.raises(EmulatorDeadlockError, match=rf"mma.sync.aligned is .aligned, but lane 0 executes it at "
                                                    rf".*\.ptx:{second} and lane 16 at .*\.ptx:{first}"):
        mod.launch("split", 1, 32, 0, [np.zeros(32, np.float32)])
