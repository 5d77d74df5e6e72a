"""PTX forms beyond the shipped kernels' (fagen.emulator.ptx): ``elect.sync`` with a lane
destination and a partial member mask, static ``.shared`` variables (placed before the dynamic
window), and the typed refusal of non-inlined ``.func`` / ``call``."""
from __future__ import annotations

import numpy as np
import pytest

from fagen.emulator import KernelSig, build
from fagen.emulator.ptx import PtxUnsupportedError, build_ptx, translate

ELECT_PTX = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry el(.param .u64 po, .param .u32 pm)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [po];
    ld.param.u32 %r7, [pm];
    mov.u32 %r1, %tid.x;
    mov.u32 %r5, 57005;
    setp.eq.s32 %p3, %r7, 0;
    @%p3 bra $FULL;
    setp.ge.u32 %p1, %r1, 16;
    @%p1 bra $OUT;
    elect.sync %r2|%p2, 65535;
    bra.uni $PACK;
$FULL:
    elect.sync %r2|%p2, -1;
$PACK:
    selp.u32 %r3, 256, 0, %p2;
    or.b32 %r5, %r3, %r2;
$OUT:
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r5;
    ret;
}
"""


def test_elect_sync_returns_the_leaders_lane_and_predicate() -> None:
    """(p << 8) | d per lane: the whole warp elects lane 31; lanes 0-15 with mask 0xffff elect
    lane 15 (the emulator elects the highest lane of the mask); lanes 16-31 skip it (0xdead)."""
    mod = build_ptx(ELECT_PTX, [KernelSig("el", (("unsigned*", "out"), ("int", "mode")))])
    out = np.zeros(32, np.uint32)
    mod.launch("el", 1, 32, 0, [out, 0])
    np.testing.assert_array_equal(out, [31 | (256 if lane == 31 else 0) for lane in range(32)])
    mod.launch("el", 1, 32, 0, [out, 1])
    np.testing.assert_array_equal(out, [15 | (256 if lane == 15 else 0) for lane in range(16)] + [0xDEAD] * 16)


STATIC_SRC = r"""
extern "C" __global__ void stat(float* out, unsigned* sizes) {
    __shared__ float tile[64];                 // static: before the dynamic window
    __shared__ unsigned long long flag;
    extern __shared__ float dyn[];             // dynamic
    const int t = threadIdx.x;
    tile[t] = float(t);
    dyn[t] = 2.f * float(t);
    if (t == 0) flag = 7ull;
    __syncthreads();
    out[t] = tile[t ^ 1] + dyn[t ^ 1] + float(flag);
    if (t == 0) {
        unsigned dsize;
        asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dsize));
        sizes[0] = dsize;
        sizes[1] = unsigned(reinterpret_cast<unsigned long long>(dyn) & 1023u);
    }
}
"""


def test_static_shared_variables_sit_before_the_dynamic_window() -> None:
    mod = build(STATIC_SRC, [KernelSig("stat", (("float*", "out"), ("unsigned*", "sizes")))], level="ptx", arch="sm_80")
    tr = translate(mod.ptx)
    assert tr.static_smem == 1024  # 256 + 8 bytes, rounded up to keep the dynamic window 1024-aligned
    out, sizes = np.zeros(64, np.float32), np.zeros(2, np.uint32)
    mod.launch("stat", 1, 64, 256, [out, sizes])
    partner = (np.arange(64) ^ 1).astype(np.float32)
    np.testing.assert_array_equal(out, 3 * partner + 7)
    assert sizes[0] == 256  # %dynamic_smem_size: the launch's dynamic bytes, not the static ones


FUNC_PTX = """.version 8.0
.target sm_80
.address_size 64
.func (.param .b32 r) twice(.param .b32 x)
{
    .reg .b32 %r<3>;
    ld.param.b32 %r1, [x];
    add.s32 %r2, %r1, %r1;
    st.param.b32 [r], %r2;
    ret;
}
.visible .entry k(.param .u64 p)
{
    ret;
}
"""


def test_non_inlined_func_is_a_typed_error_naming_the_line() -> None:
    with pytest.raises(PtxUnsupportedError) as info:
        build_ptx(FUNC_PTX, [KernelSig("k", (("float*", "p"),))])
    assert info.value.opcode == ".func" and info.value.line == 4
    assert "device functions that are not inlined (.func / call)" in str(info.value)
