"""Register A of a wgmma in flight (``wgmma.mma_async`` with A from registers): by the PTX ISA
(wgmma.wait_group) accessing the registers that hold A's fragments before the ``wait_group`` that
retires the wgmma is undefined, like the accumulator's. The emulator poisons them from the issue to
that wait (which restores them), reports a write to them or a read by an emulated primitive
(stmatrix) as a kernel error naming both lines, and lets a second wgmma in flight read them.

The backward (``templates/wgmma/bwd.cu.j2``) once stored dS^T with stmatrix from the registers of
the register-A ``dK~ += dS^T Q_i`` wgmma before waiting for it; it now stores them first (as FA3
does), and the old order is reported."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fagen import KernelSpec, renderer
from fagen.emulator import EmulatorKernelError, KernelSig, build

import gates

_KERNEL = r"""
// One warpgroup: D (64 x 8) = A (64 x 16, registers) B (16 x 8, shared, K-major, no swizzle).
// mode 0: the wait, then stmatrix of A; 1: stmatrix of A before the wait; 2: a write to A before
// the wait; 3: a second wgmma with the same A in flight; 4: a plain read of A before the wait.
extern "C" __global__ void rega(const unsigned* ain, const __half* b, float* out, unsigned* aout, int mode) {
    unsigned char* smem = fa_smem_1024();
    __half* sb = reinterpret_cast<__half*>(smem);
    __half* c = reinterpret_cast<__half*>(smem + 1024);
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    {   // B[k][n] -> core matrix (n, k % 8), the two K halves 128 bytes apart
        const int n = t / 16, k = t % 16;
        sb[n * 8 + (k % 8) + (k / 8) * 64] = b[k * 8 + n];
    }
    fa_fence_proxy_async();
    fa_sync();
    const unsigned long long db = fa_wgmma_desc(sb, 128, 256, FA_SWIZZLE_NONE);
    unsigned a[4];
    for (int r = 0; r < 4; ++r) a[r] = ain[4 * t + r];
    float d[4], e[4];
    for (int i = 0; i < 4; ++i) d[i] = e[i] = 0.f;
    unsigned early = 0u;
    fa_wgmma_fence();
    fa_wgmma_m64nNk16_rs<__half, 8, 0>(d, a, db, 0);  // LINE:wgmma
    if (mode == 3) fa_wgmma_m64nNk16_rs<__half, 8, 0>(e, a, db, 0);
    fa_wgmma_commit_group();
    if (mode == 1) fa_stmatrix_x4(c + lane * 8 + warp * 512, a);  // LINE:early-stmatrix
    if (mode == 2) a[1] = 0u;  // LINE:early-write
    if (mode == 4) early = a[2];
    fa_wgmma_wait_group<0>();  // LINE:wait
    if (mode == 0) fa_stmatrix_x4(c + lane * 8 + warp * 512, a);
    for (int r = 0; r < 4; ++r) aout[4 * t + r] = mode == 4 ? early : a[r];
    for (int i = 0; i < 4; ++i) { out[8 * t + i] = d[i]; out[8 * t + 4 + i] = e[i]; }
}
"""


def _line(source: str, tag: str) -> int:
    return next(i for i, t in enumerate(source.splitlines(), 1) if t.rstrip().endswith(f"// LINE:{tag}"))


@pytest.fixture(scope="module")
def rega():
    root = renderer.templates_dir()
    source = ((root / "partials/primitives.cuh").read_text() + "\n" + (root / "wgmma/hopper.cuh").read_text()
              + _KERNEL)
    sig = KernelSig("rega", (("const unsigned*", "ain"), ("const __half*", "b"), ("float*", "out"),
                             ("unsigned*", "aout"), ("int", "mode")))
    return source, build(source, [sig])


def _operands():
    rng = np.random.default_rng(3)
    A = rng.integers(-4, 5, (64, 16)).astype(np.float16)
    B = rng.integers(-4, 5, (16, 8)).astype(np.float16)
    ain = np.zeros((128, 4), np.uint32)  # thread t's a[r] = A[16w + g + 8(r & 1)][2q + 8(r >> 1) + {0, 1}]
    bits = A.view(np.uint16).astype(np.uint32)
    for t in range(128):
        w, g, q = t // 32, (t % 32) // 4, t % 4
        for r in range(4):
            row, col = 16 * w + g + 8 * (r & 1), 2 * q + 8 * (r >> 1)
            ain[t, r] = bits[row, col] | bits[row, col + 1] << 16
    D = A.astype(np.float64) @ B.astype(np.float64)
    want = np.zeros((128, 4), np.float32)  # d[i] = D[16w + g + 8((i >> 1) & 1)][2q + (i & 1)]
    for t in range(128):
        w, g, q = t // 32, (t % 32) // 4, t % 4
        for i in range(4):
            want[t, i] = D[16 * w + g + 8 * ((i >> 1) & 1), 2 * q + (i & 1)]
    return ain, B, want


def _launch(mod, mode: int):
    ain, B, want = _operands()
    out = np.zeros((128, 8), np.float32)
    aout = np.zeros((128, 4), np.uint32)
    mod.launch("rega", 1, 128, 8192, [ain, B, out, aout, mode])
    return ain, want, out, aout


def test_register_a_is_the_threads_again_after_the_wait(rega) -> None:
    _, mod = rega
    ain, want, out, aout = _launch(mod, 0)
    np.testing.assert_array_equal(out[:, :4], want)
    np.testing.assert_array_equal(aout, ain)  # restored by the wait, then stored by stmatrix


def test_a_second_wgmma_in_flight_may_read_the_same_a(rega) -> None:
    _, mod = rega
    ain, want, out, aout = _launch(mod, 3)
    np.testing.assert_array_equal(out[:, :4], want)
    np.testing.assert_array_equal(out[:, 4:], want)
    np.testing.assert_array_equal(aout, ain)


def test_a_plain_read_before_the_wait_is_poison(rega) -> None:
    _, mod = rega
    _, _, _, aout = _launch(mod, 4)
    assert (aout == 0x7FFF7FFF).all()  # NaN as fp16 / bf16 pairs (register reads cannot be trapped)


def test_stmatrix_of_a_before_the_wait_names_both_lines(rega) -> None:
    source, mod = rega
    with pytest.raises(EmulatorKernelError,
                       match=rf"fa_stmatrix_x4 at .*:{_line(source, 'early-stmatrix')} reads register\(s\) of the A "
                             rf"fragment of the wgmma issued at .*:{_line(source, 'wgmma')} before fa_wgmma_wait_group"):
        _launch(mod, 1)


def test_a_write_to_a_before_the_wait_names_both_lines(rega) -> None:
    source, mod = rega
    with pytest.raises(EmulatorKernelError,
                       match=rf"register A fragment a\[1\] of the wgmma issued at .*:{_line(source, 'wgmma')} was "
                             rf"written before fa_wgmma_wait_group at .*:{_line(source, 'wait')} retired it"):
        _launch(mod, 2)


# --------------------------------------------------------------------------- the backward
TEMPLATE = "wgmma/bwd.cu.j2"
#: The dS^T stores (stmatrix from the dK~ wgmma's A registers) and the register-A wgmmas after them.
_STORES_START = "                // dS^T -> smem. Stored before"
_ISSUE_START = "                fa_wgmma_fence();\n{% if not DV_EARLY %}"
_ISSUE_END = "                fa_wgmma_commit_group();\n"


def _stores_after_the_dk_wgmma(text: str) -> str:
    """The template as it was: dK~ += dS^T Q_i issued and committed, then dS^T stored from its A
    registers by stmatrix, with no wait in between."""
    s0 = text.index(_STORES_START)
    i0 = text.index(_ISSUE_START, s0)
    i1 = text.index(_ISSUE_END, i0) + len(_ISSUE_END)
    stores, issue = text[s0:i0], text[i0:i1]
    assert "wg_ds_store(sds, sm_kr, sm_m, dsa);" in stores and "fa_wgmma_m64nNk16_rs" in issue
    return text[:s0] + issue + "\n" + stores + text[i1:]


@pytest.mark.parametrize("kw", [dict(num_warps=8), dict(num_warps=4, block_r=64)], ids=["wg2", "wg1-dv-early"])
def test_backward_stores_ds_before_the_register_a_wgmma(kw) -> None:
    """The backward as rendered runs (tests/test_wgmma_bwd.py checks its numerics); in the old
    order the emulator reports stmatrix reading the dK~ wgmma's A registers, naming both lines."""
    import fagen.functional as F

    spec = KernelSpec(direction="bwd", arch="sm_90a", head_dim=64, dtype="float16", causal=True, **kw)
    assert spec.impl == "wgmma"
    text = (renderer.templates_dir() / TEMPLATE).read_text()
    assert text.index(_STORES_START) < text.index("fa_wgmma_m64nNk16_rs<T, PAD_DIM, 1>(dk_acc, dsa[kc]")
    gen = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(1, 70, 1, 64, generator=gen).half() for _ in range(4))
    o, lse = F.attention_forward(q, k, v, causal=True, spec=spec.replace(direction="fwd"))
    F.attention_backward(do, q, k, v, o, lse, causal=True, spec=spec)  # clean

    old = gates.mutated_module(spec, TEMPLATE, _stores_after_the_dk_wgmma(text))
    src = old.rendered.source.splitlines()
    wg_line = next(i for i, t in enumerate(src, 1) if "fa_wgmma_m64nNk16_rs<T, PAD_DIM, 1>(dk_acc, dsa[kc]" in t)
    st_line = next(i for i, t in enumerate(src, 1) if "fa_stmatrix_x4(sds" in t)  # in wg_ds_store
    store_call = next(i for i, t in enumerate(src, 1) if "wg_ds_store(sds, sm_kr, sm_m, dsa);" in t)
    assert store_call > wg_line
    from fagen.runtime import cpu

    real = cpu.cpu_module
    try:
        cpu.cpu_module = lambda s: old if s == spec else real(s)
        with pytest.raises(EmulatorKernelError,
                           match=rf"fa_stmatrix_x4 at .*:{st_line} reads register\(s\) of the A fragment of the "
                                 rf"wgmma issued at .*:{wg_line} before fa_wgmma_wait_group"):
            F.attention_backward(do, q, k, v, o, lse, causal=True, spec=spec)
    finally:
        cpu.cpu_module = real
