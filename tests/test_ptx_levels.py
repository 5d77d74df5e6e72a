"""The two emulator levels side by side, and the PTX level's documentation.

* Where the source level and the PTX level execute the same operations the results are the same
  bits: an mma.sync GEMM fed by cp.async and ldmatrix (the same collectives at both levels) with
  round-to-nearest conversions to half; where NVVM contracts ``a * b + c`` into ``fma.rn`` (one
  rounding) the source level's g++ code rounds twice, and the two differ (docs/emulator.md).
* Every instruction form the shipped kernels emit is supported: the PTX of a sample of the
  standard specs (every family, direction and role) translates without PtxUnsupportedError.
* docs/emulator.md's table of supported forms is the one fagen.emulator.ptx.forms_table() makes.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fagen import KernelSpec, renderer
from fagen.emulator import KernelSig, build
from fagen.emulator.ptx import FORMS, forms_table, translate

ROOT = Path(__file__).resolve().parent.parent

_GEMM = r"""
// C (16 x 8, f32 -> f16) = A (16 x 16) B (16 x 8) for one warp: cp.async into shared memory,
// ldmatrix fragments, one mma.sync; then C rounded to half and r = x * y + z two ways.
extern "C" __global__ void lv(const __half* a, const __half* bt, __half* c, const float* x, float* r1, float* r2) {
    __half* sa = reinterpret_cast<__half*>(fa_smem());
    __half* sb = sa + 256;
    const int lane = threadIdx.x;
    fa_cp_async_16(sa + lane * 8, a + lane * 8, true);          // A: 16 rows of 16 halves
    if (lane < 16) fa_cp_async_16(sb + lane * 8, bt + lane * 8, true);  // B^T: 8 rows of 16
    fa_cp_async_wait_all();
    __syncwarp();
    unsigned af[4], bf[2];
    fa_ldmatrix_x4(af, sa + (lane % 16) * 16 + (lane / 16) * 8);
    fa_ldmatrix_x2(bf, sb + (lane % 8) * 16 + ((lane / 8) % 2) * 8);
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    fa_mma_m16n8k16<__half>(d, af, bf);
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) c[(g + 8 * (i / 2)) * 8 + 2 * t + (i % 2)] = __float2half_rn(d[i]);
    const float u = x[lane], v = x[lane + 32], w = x[lane + 64];
    r1[lane] = __fadd_rn(__fmul_rn(u, v), w);   // two roundings at both levels
    r2[lane] = u * v + w;                       // NVVM: fma.rn (one rounding); g++: two roundings
}
"""
_SIG = KernelSig("lv", (("const __half*", "a"), ("const __half*", "bt"), ("__half*", "c"), ("const float*", "x"),
                        ("float*", "r1"), ("float*", "r2")))


def _source() -> str:
    root = renderer.templates_dir() / "partials"
    return (root / "primitives.cuh").read_text() + (root / "mma.cuh").read_text() + _GEMM


def test_same_operations_same_bits_and_contraction_differs() -> None:
    rng = np.random.default_rng(8)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    bt = rng.standard_normal((8, 16)).astype(np.float16)
    x = rng.standard_normal(96).astype(np.float32)
    outs = {}
    for level, kw in (("source", {}), ("ptx", {"arch": "sm_80"})):
        src = _source()
        mod = build(src, [_SIG], level=level, **kw)
        c = np.zeros((16, 8), np.float16)
        r1, r2 = np.zeros(32, np.float32), np.zeros(32, np.float32)
        mod.launch("lv", 1, 32, 1024, [a, bt, c, x, r1, r2])
        outs[level] = (c, r1, r2)
    want = (a.astype(np.float64) @ bt.astype(np.float64).T).astype(np.float32).astype(np.float16)
    np.testing.assert_array_equal(outs["ptx"][0], want)
    assert outs["ptx"][0].tobytes() == outs["source"][0].tobytes()  # mma + conversions: the same bits
    assert outs["ptx"][1].tobytes() == outs["source"][1].tobytes()  # explicit roundings: the same bits
    u, v, w = (x[i * 32:(i + 1) * 32].astype(np.float64) for i in range(3))
    fused = (u * v + w).astype(np.float32)  # exact product (24 + 24 bits), one rounding of the sum... nearly
    two = ((x[:32] * x[32:64]).astype(np.float32) + x[64:]).astype(np.float32)
    np.testing.assert_array_equal(outs["source"][2], two)  # g++: two roundings
    assert (outs["ptx"][2] != two).any()  # NVVM contracted to fma.rn: the bits differ somewhere
    assert np.abs(outs["ptx"][2].astype(np.float64) - fused).max() <= np.abs(two.astype(np.float64) - fused).max()


# (the default specs of tests/test_ptx_kernels.py are translated there, and built and run)
_SAMPLE = [
    dict(impl="simt", arch="sm_90", dtype="bfloat16", causal=True, key_padding=True, dropout=True),
    dict(impl="mma", arch="sm_80", dtype="float16", causal=True),
    dict(impl="mma", arch="sm_90", dtype="bfloat16", causal=True, key_padding=True, dropout=True),
    dict(impl="wgmma", arch="sm_90a", dtype="bfloat16", head_dim=128),
]


@pytest.mark.parametrize("flags", _SAMPLE, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_every_form_of_the_shipped_kernels_translates(flags: dict) -> None:
    from fagen.compiler import compile as nvrtc_compile

    flags = {"head_dim": 64, **flags}
    for direction in ("fwd", "bwd"):
        spec = KernelSpec(direction=direction, **flags)
        ptx = nvrtc_compile(spec, ptx_target=spec.arch.replace("sm_", "compute_")).cubin.decode()
        tr = translate(ptx)
        assert set(tr.entries) == {k.name for k in renderer.render(spec).kernels}


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").environ.get("FAGEN_TEST_SLOW"), reason="set FAGEN_TEST_SLOW=1")
def test_the_whole_generated_matrix_translates() -> None:
    """Every spec of ``fagen generate --all`` (standard, Hopper and feature matrices)."""
    from fagen.compiler import compile as nvrtc_compile
    from fagen.generate import all_specs

    for spec in all_specs():
        ptx = nvrtc_compile(spec, ptx_target=spec.arch.replace("sm_", "compute_")).cubin.decode()
        assert set(translate(ptx).entries) == {k.name for k in renderer.render(spec).kernels}, spec.name


def _doc_table() -> str:
    text = (ROOT / "docs/emulator.md").read_text()
    m = re.search(r"<!-- ptx-forms:begin -->\n(.*?)\n<!-- ptx-forms:end -->", text, re.DOTALL)
    assert m, "docs/emulator.md lacks the <!-- ptx-forms:begin --> ... <!-- ptx-forms:end --> table"
    return m.group(1)


def test_docs_table_of_supported_forms_is_generated_from_the_code() -> None:
    assert _doc_table() == forms_table(), "regenerate: python -c 'from fagen.emulator.ptx import forms_table; " \
                                          "print(forms_table())'"
    assert len(FORMS) >= 30


_LOCAL = r"""
__device__ int table[4] = {3, -1, 4, 1};
__constant__ float weights[2] = {0.5f, 2.0f};
extern "C" __global__ void loc(const int* idx, float* out) {
    float buf[16];                                   // dynamically indexed: a .local depot
    const int t = threadIdx.x;
    for (int i = 0; i < 16; ++i) buf[i] = float(i * t);
    const int j = idx[t] & 15;
    out[t] = buf[j] * weights[t & 1] + float(table[t & 3]);
}
"""


def test_local_depot_and_module_variables() -> None:
    """A dynamically indexed local array (``.local`` depot, ``cvta.local``) and initialised
    ``.global`` / ``.const`` variables, at the PTX level, against numpy."""
    mod = build(_LOCAL, [KernelSig("loc", (("const int*", "idx"), ("float*", "out")))], level="ptx", arch="sm_80")
    assert ".local" in mod.ptx and ".const" in mod.ptx
    idx = np.random.default_rng(3).integers(0, 1000, 64).astype(np.int32)
    out = np.zeros(64, np.float32)
    mod.launch("loc", 1, 64, 0, [idx, out])
    t = np.arange(64)
    want = (idx & 15) * t * np.array([0.5, 2.0])[t & 1] + np.array([3, -1, 4, 1])[t & 3]
    np.testing.assert_array_equal(out, want.astype(np.float32))
