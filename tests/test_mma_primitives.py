"""Tensor-core primitives of templates/partials/mma.cuh on the CPU emulator
(mma.sync m16n8k16, ldmatrix x1/x2/x4[.trans], cp.async with commit/wait
groups), checked against an independent numpy model of the PTX ISA's
documented fragment layouts, plus NVRTC compiles whose SASS shows the
tensor-core instructions.

The model below is written from the PTX ISA text (section 9.7.14.5.8
"Matrix Fragments for mma.m16n8k16 with floating point type" and section
9.7.14.5.15 "Warp-level matrix load instruction: ldmatrix"), element by
element as the ISA states it, not from the C++ code.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fagen.emulator import EmulatorDeadlockError, EmulatorKernelError, KernelSig, build

REPO = Path(__file__).resolve().parent.parent
PRIMITIVES = (REPO / "templates/partials/primitives.cuh").read_text()
MMA = (REPO / "templates/partials/mma.cuh").read_text()

# ----------------------------------------------------------- the layout model
# PTX ISA 9.7.14.5.8, m16n8k16 .f16/.bf16:  groupID = %laneid >> 2,
# threadID_in_group = %laneid % 4. A holds a0..a7 in four .f16x2 registers,
# B holds b0..b3 in two, C/D hold c0..c3 as four .f32 registers; in each
# .f16x2 register the lower-numbered element is the low half.


def _gt(lane: int) -> tuple[int, int]:
    return lane >> 2, lane % 4


def a_element(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of A element a_i held by `lane` (Multiplicand A, .f16/.bf16)."""
    group, tig = _gt(lane)
    row = group if (0 <= i < 2 or 4 <= i < 6) else group + 8
    col = tig * 2 + (i & 1) if i < 4 else tig * 2 + (i & 1) + 8
    return row, col


def b_element(lane: int, i: int) -> tuple[int, int]:
    """(row, col) = (k, n) of B element b_i held by `lane` (Multiplicand B, .f16/.bf16)."""
    group, tig = _gt(lane)
    row = tig * 2 + (i & 1) if i < 2 else tig * 2 + (i & 1) + 8
    return row, group


def c_element(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of accumulator element c_i / d_i held by `lane` (Accumulators C or D, .f32)."""
    group, tig = _gt(lane)
    row = group if i < 2 else group + 8
    return row, tig * 2 + (i & 1)


def ldmatrix_element(lane: int, j: int) -> tuple[int, int]:
    """(row, col) of element j (0 low, 1 high half) of an 8x8 .b16 matrix that `lane`
    receives (ldmatrix fragment layout: each group of four threads holds one row)."""
    return lane >> 2, (lane % 4) * 2 + j


def pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


def a_registers(bits: np.ndarray) -> np.ndarray:
    """16x16 uint16 matrix -> [32 lanes, 4] uint32 registers."""
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        for r in range(4):
            out[lane, r] = pack(bits[a_element(lane, 2 * r)], bits[a_element(lane, 2 * r + 1)])
    return out


def b_registers(bits: np.ndarray) -> np.ndarray:
    """16x8 (k x n) uint16 matrix -> [32, 2] uint32 registers."""
    out = np.zeros((32, 2), np.uint32)
    for lane in range(32):
        for r in range(2):
            out[lane, r] = pack(bits[b_element(lane, 2 * r)], bits[b_element(lane, 2 * r + 1)])
    return out


def c_registers(m: np.ndarray) -> np.ndarray:
    return np.array([[m[c_element(lane, i)] for i in range(4)] for lane in range(32)], np.float32)


def c_matrix(regs: np.ndarray) -> np.ndarray:
    m = np.full((16, 8), np.nan, np.float32)
    for lane in range(32):
        for i in range(4):
            m[c_element(lane, i)] = regs[lane, i]
    return m


# ------------------------------------------------------------ dtype helpers
def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(np.float16).view(np.uint16) if dtype == "f16" else bf16_bits(x)


def from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    return bits.view(np.float16).astype(np.float32) if dtype == "f16" else bf16_value(bits)


def fp32_accumulation_bound(a: np.ndarray, b: np.ndarray, c: np.ndarray | float = 0.0) -> np.ndarray:
    """What fp32 accumulation in any order may lose: 2 (K+1) 2^-24 (|C| + |A||B|)
    (the factor 2 admits truncating adders); products of f16/bf16 are exact in fp32."""
    k = a.shape[1]
    return 2 * (k + 1) * 2.0**-24 * (np.abs(c) + np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))


# ------------------------------------------------------------------ kernels
KERNELS = r"""
// ldmatrix: 32 rows of 8 halves (4 matrices) staged in smem with a padded row
// stride; lane l supplies row rowidx[l] (lanes past 8*num pass nullptr).
#define LDM_STRIDE 24
extern "C" __global__ void ldm(const unsigned short* mat, const int* rowidx, unsigned* out, int variant) {
    unsigned short* s = reinterpret_cast<unsigned short*>(fa_smem());
    const int lane = threadIdx.x;
    for (int k = lane; k < 32 * 8; k += 32) s[(k / 8) * LDM_STRIDE + k % 8] = mat[k];
    fa_sync();
    const int num = variant % 3 == 0 ? 1 : variant % 3 == 1 ? 2 : 4;
    const void* row = lane < 8 * num ? s + rowidx[lane] * LDM_STRIDE : nullptr;
    unsigned r[4] = {0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu};
    switch (variant) {
        case 0: { unsigned x[1]; fa_ldmatrix_x1(x, row); r[0] = x[0]; break; }
        case 1: { unsigned x[2]; fa_ldmatrix_x2(x, row); r[0] = x[0]; r[1] = x[1]; break; }
        case 2: { unsigned x[4]; fa_ldmatrix_x4(x, row); for (int i = 0; i < 4; ++i) r[i] = x[i]; break; }
        case 3: { unsigned x[1]; fa_ldmatrix_x1_trans(x, row); r[0] = x[0]; break; }
        case 4: { unsigned x[2]; fa_ldmatrix_x2_trans(x, row); r[0] = x[0]; r[1] = x[1]; break; }
        default: { unsigned x[4]; fa_ldmatrix_x4_trans(x, row); for (int i = 0; i < 4; ++i) r[i] = x[i]; }
    }
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// mma: every lane of every warp loads its own registers, one mma, stores D.
template <typename E>
__device__ void mma_lanes(const unsigned* a, const unsigned* b, const float* c, float* d) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned ar[4], br[2];
    float acc[4];
    for (int i = 0; i < 4; ++i) ar[i] = a[t * 4 + i];
    for (int i = 0; i < 2; ++i) br[i] = b[t * 2 + i];
    for (int i = 0; i < 4; ++i) acc[i] = c[t * 4 + i];
    fa_mma_m16n8k16<E>(acc, ar, br);
    for (int i = 0; i < 4; ++i) d[t * 4 + i] = acc[i];
}
extern "C" __global__ void mma_f16(const unsigned* a, const unsigned* b, const float* c, float* d) {
    mma_lanes<__half>(a, b, c, d);
}
extern "C" __global__ void mma_bf16(const unsigned* a, const unsigned* b, const float* c, float* d) {
    mma_lanes<__nv_bfloat16>(a, b, c, d);
}

// cp.async group semantics, one thread: snapshots of 4 destination chunks.
extern "C" __global__ void cp_groups(const float* src, float* out) {
    float* s = reinterpret_cast<float*>(fa_smem());
    fa_cp_async_16(s + 0, src + 0, true);    // group 0
    fa_cp_async_commit();
    fa_cp_async_16(s + 4, src + 4, true);    // group 1
    fa_cp_async_16(s + 8, src + 8, false);   // group 1, zero fill
    fa_cp_async_commit();
    fa_cp_async_16(s + 12, src + 12, true);  // not committed yet
    for (int i = 0; i < 16; ++i) out[0 * 16 + i] = s[i];
    fa_cp_async_wait<2>();
    for (int i = 0; i < 16; ++i) out[1 * 16 + i] = s[i];
    fa_cp_async_wait<1>();
    for (int i = 0; i < 16; ++i) out[2 * 16 + i] = s[i];
    fa_cp_async_wait<0>();
    for (int i = 0; i < 16; ++i) out[3 * 16 + i] = s[i];
    fa_cp_async_wait_all();
    for (int i = 0; i < 16; ++i) out[4 * 16 + i] = s[i];
}

// C[64x64] (fp32) = A[64x64] B[64x64] (row-major, E), one block of 4 warps;
// warp w computes rows 16w..16w+15. Two K stages of 32, both loaded by
// cp.async up front (one commit group each; A rows >= m_valid zero-filled).
// mode 0: correct; 1: no cp.async wait; 2: no barrier after the wait.
#define GA_STRIDE 40  // 32 + 8 halves: 80-byte rows
#define GB_STRIDE 72  // 64 + 8 halves: 144-byte rows
template <typename E>
__device__ void gemm64(const E* a, const E* b, float* c, int m_valid, int mode) {
    E* as = reinterpret_cast<E*>(fa_smem());   // [2][64][GA_STRIDE]
    E* bs = as + 2 * 64 * GA_STRIDE;           // [2][32][GB_STRIDE]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    for (int st = 0; st < 2; ++st) {
        for (int ch = tid; ch < 256; ch += 128) {  // A: 64 rows x 4 chunks of 8 halves
            const int r = ch >> 2, c8 = (ch & 3) * 8;
            fa_cp_async_16(as + (st * 64 + r) * GA_STRIDE + c8, a + r * 64 + st * 32 + c8, r < m_valid);
        }
        for (int ch = tid; ch < 256; ch += 128) {  // B: 32 rows x 8 chunks
            const int r = ch >> 3, c8 = (ch & 7) * 8;
            fa_cp_async_16(bs + (st * 32 + r) * GB_STRIDE + c8, b + (st * 32 + r) * 64 + c8, true);
        }
        fa_cp_async_commit();
    }
    float acc[8][4];
    for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
    for (int st = 0; st < 2; ++st) {
        if (mode != 1) {
            if (st == 0) fa_cp_async_wait<1>();
            else fa_cp_async_wait<0>();
        }
        if (mode != 2) fa_sync();
        const E* at = as + st * 64 * GA_STRIDE;
        const E* bt = bs + st * 32 * GB_STRIDE;
        for (int k0 = 0; k0 < 32; k0 += 16) {
            const int mi = lane >> 3, ri = lane & 7;
            unsigned af[4];
            fa_ldmatrix_x4(af, at + (warp * 16 + ri + 8 * (mi & 1)) * GA_STRIDE + k0 + 8 * (mi >> 1));
            for (int n0 = 0; n0 < 64; n0 += 16) {
                unsigned bf[4];
                fa_ldmatrix_x4_trans(bf, bt + (k0 + ri + 8 * (mi & 1)) * GB_STRIDE + n0 + 8 * (mi >> 1));
                const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
                fa_mma_m16n8k16<E>(acc[n0 / 8], af, b0);
                fa_mma_m16n8k16<E>(acc[n0 / 8 + 1], af, b1);
            }
        }
    }
    const int g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 4; ++i) c[(warp * 16 + g + 8 * (i >> 1)) * 64 + j * 8 + 2 * t + (i & 1)] = acc[j][i];
}
extern "C" __global__ void gemm_f16(const __half* a, const __half* b, float* c, int m_valid, int mode) {
    gemm64<__half>(a, b, c, m_valid, mode);
}
extern "C" __global__ void gemm_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, float* c, int m_valid,
                                     int mode) {
    gemm64<__nv_bfloat16>(a, b, c, m_valid, mode);
}

// Lanes disagree on the collective (odd lanes ldmatrix, even lanes mma), or
// half the warp leaves before the mma.
extern "C" __global__ void diverge(float* out, int exit_half) {
    unsigned short* s = reinterpret_cast<unsigned short*>(fa_smem());
    unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    if (exit_half) {
        if (threadIdx.x >= 16) return;
        fa_mma_m16n8k16<__half>(d, a, b);  // LINE:half_mma
    } else if (threadIdx.x & 1) {
        fa_ldmatrix_x4(a, s + (threadIdx.x & 7) * 8);  // LINE:odd_ldm
    } else {
        fa_mma_m16n8k16<__half>(d, a, b);  // LINE:even_mma
    }
    out[threadIdx.x] = d[0] + float(a[0]);
}

// fa_red_add_f32x2: thread t adds (v[2t], v[2t + 1]) to out[2 idx[t]], out[2 idx[t] + 1] (many threads
// share an index); off = 1 makes the address 4-byte aligned only (an error).
extern "C" __global__ void red2(const float* v, const int* idx, float* out, int off) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    fa_red_add_f32x2(out + 2 * idx[t] + off, v[2 * t], v[2 * t + 1]);
}

// fa_mov_b32 / fa_mov_b64 / fa_hold: thread t copies word t (and the 64-bit word t) and its bool / pointer.
extern "C" __global__ void movs(const unsigned* w, const unsigned long long* d, const float* base, unsigned* o32,
                                unsigned long long* o64, int* flags, long long* offs) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    o32[t] = fa_mov_b32(w[t]);
    o64[t] = fa_mov_b64(d[t]);
    flags[t] = fa_hold((w[t] & 1u) != 0u) ? 1 : 0;
    offs[t] = (long long)(fa_hold(base + t) - base);
}
// fa_mad_wide_u32: thread t computes a[t] * b[t] + c[t] (64 bits).
extern "C" __global__ void madw(const unsigned* a, const unsigned* b, const unsigned long long* c, unsigned long long* o) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    o[t] = fa_mad_wide_u32(a[t], b[t], c[t]);
}

// fa_shfl_idx_b32: thread t gets the word of lane src[t] (its own lane's bits taken mod 32) of its warp;
// fa_pin: thread t's own word and pointer, unchanged.
extern "C" __global__ void shfl_idx(const unsigned* w, const unsigned* src, const float* base, unsigned* o, unsigned* pin,
                                    long long* pin_off) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    o[t] = fa_shfl_idx_b32(w[t], src[t]);
    pin[t] = (unsigned)fa_pin((int)w[t]);
    pin_off[t] = (long long)(fa_pin(base + t) - base);
}

extern "C" __global__ void misaligned(const float* src, float* out) {
    float* s = reinterpret_cast<float*>(fa_smem());
    fa_cp_async_16(s + 2, src, true);  // 8-byte aligned destination: invalid
    fa_cp_async_wait_all();
    out[0] = s[2];
}
"""
SOURCE = PRIMITIVES + "\n" + MMA + "\n" + KERNELS
GEMM_SMEM = (2 * 64 * 40 + 2 * 32 * 72) * 2
MMA_SIG = (("const unsigned int*", "a"), ("const unsigned int*", "b"), ("const float*", "c"), ("float*", "d"))
SIGS = [
    KernelSig("ldm", (("const unsigned short*", "mat"), ("const int*", "rowidx"), ("unsigned int*", "out"),
                      ("int", "variant"))),
    KernelSig("mma_f16", MMA_SIG),
    KernelSig("mma_bf16", MMA_SIG),
    KernelSig("cp_groups", (("const float*", "src"), ("float*", "out"))),
    KernelSig("gemm_f16", (("const __half*", "a"), ("const __half*", "b"), ("float*", "c"), ("int", "m_valid"),
                           ("int", "mode"))),
    KernelSig("gemm_bf16", (("const __nv_bfloat16*", "a"), ("const __nv_bfloat16*", "b"), ("float*", "c"),
                            ("int", "m_valid"), ("int", "mode"))),
    KernelSig("misaligned", (("const float*", "src"), ("float*", "out"))),
    KernelSig("red2", (("const float*", "v"), ("const int*", "idx"), ("float*", "out"), ("int", "off"))),
    KernelSig("movs", (("const unsigned*", "w"), ("const unsigned long long*", "d"), ("const float*", "base"),
                       ("unsigned*", "o32"), ("unsigned long long*", "o64"), ("int*", "flags"), ("long long*", "offs"))),
    KernelSig("madw", (("const unsigned*", "a"), ("const unsigned*", "b"), ("const unsigned long long*", "c"),
                       ("unsigned long long*", "o"))),
    KernelSig("shfl_idx", (("const unsigned*", "w"), ("const unsigned*", "src"), ("const float*", "base"),
                           ("unsigned*", "o"), ("unsigned*", "pin"), ("long long*", "pin_off"))),
    KernelSig("diverge", (("float*", "out"), ("int", "exit_half"))),
]


def line_of(tag: str) -> int:
    for i, text in enumerate(SOURCE.splitlines(), 1):
        if text.rstrip().endswith(f"// LINE:{tag}"):
            return i
    raise AssertionError(tag)


@pytest.fixture(scope="module")
def mod():
    return build(SOURCE, SIGS)


# ------------------------------------------------------------------ ldmatrix
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_ldmatrix_matches_layout_model(mod, num: int, trans: bool, dtype: str) -> None:
    rng = np.random.default_rng(num * 2 + trans)
    values = rng.standard_normal((32, 8)).astype(np.float32)
    mat = to_bits(values, dtype)  # 32 smem rows of 8 halves
    rowidx = rng.permutation(32).astype(np.int32)  # lane l supplies smem row rowidx[l]
    out = np.zeros((32, 4), np.uint32)
    variant = {1: 0, 2: 1, 4: 2}[num] + 3 * trans
    mod.launch("ldm", 1, 32, 32 * 24 * 2, [mat, rowidx, out, variant])
    for i in range(num):
        m = mat[rowidx[8 * i: 8 * i + 8]]  # matrix i: rows supplied by lanes 8i..8i+7
        if trans:
            m = m.T
        expect = np.array([pack(m[ldmatrix_element(lane, 0)], m[ldmatrix_element(lane, 1)]) for lane in range(32)])
        np.testing.assert_array_equal(out[:, i], expect, err_msg=f"matrix {i}")
    assert (out[:, num:] == 0xDEADBEEF).all()  # registers past .num untouched


# ----------------------------------------------------------------------- mma
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_mma_matches_numpy(mod, dtype: str) -> None:
    rng = np.random.default_rng(7 if dtype == "f16" else 8)
    warps = 2
    a_bits = [to_bits(rng.standard_normal((16, 16)).astype(np.float32) * 2, dtype) for _ in range(warps)]
    b_bits = [to_bits(rng.standard_normal((16, 8)).astype(np.float32), dtype) for _ in range(warps)]
    cs = [rng.standard_normal((16, 8)).astype(np.float32) * 4 for _ in range(warps)]
    a = np.concatenate([a_registers(x) for x in a_bits])
    b = np.concatenate([b_registers(x) for x in b_bits])
    c = np.concatenate([c_registers(x) for x in cs])
    d = np.zeros((32 * warps, 4), np.float32)
    mod.launch(f"mma_{dtype}", 1, 32 * warps, 0, [a, b, c, d])
    for w in range(warps):
        av, bv = from_bits(a_bits[w], dtype), from_bits(b_bits[w], dtype)
        ref = cs[w].astype(np.float64) + av.astype(np.float64) @ bv.astype(np.float64)
        got = c_matrix(d[32 * w: 32 * (w + 1)])
        assert np.all(np.abs(got - ref) <= fp32_accumulation_bound(av, bv, cs[w]) + 1e-30), f"warp {w}"
        # Each element is a distinct function of its own row/col: a layout slip cannot pass.
        assert not np.allclose(got, np.roll(got, 1, axis=0))


def test_mma_fragment_layout_one_hot(mod) -> None:
    """A = unit matrices picks single elements of B, so every lane's D register must hold
    exactly the B / C element the model places there."""
    one = np.float16(1).view(np.uint16)
    for row, k in [(0, 0), (3, 9), (9, 2), (15, 15)]:
        a_bits = np.zeros((16, 16), np.uint16)
        a_bits[row, k] = one
        b_vals = (np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + 1).astype(np.float16)
        c = np.zeros((16, 8), np.float32)
        d = np.zeros((32, 4), np.float32)
        mod.launch("mma_f16", 1, 32, 0, [a_registers(a_bits), b_registers(b_vals.view(np.uint16)),
                                         c_registers(c), d])
        expect = np.zeros((16, 8), np.float32)
        expect[row] = b_vals[k].astype(np.float32)
        np.testing.assert_array_equal(c_matrix(d), expect)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_mma_decodes_every_bit_pattern(mod, dtype: str) -> None:
    """I(16x16) @ B through the mma for all 65536 16-bit patterns of B, 128 per warp:
    finite values come back exactly; NaN / inf follow IEEE (0 * inf = NaN), as numpy."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    values = from_bits(bits, dtype)
    order = np.argsort(~np.isfinite(values), kind="stable")  # specials fill whole warps at the end
    blocks = bits[order].reshape(-1, 16, 8)  # one 16x8 B per warp
    finite = np.isfinite(from_bits(blocks, dtype))
    assert (finite.all(axis=(1, 2)) | ~finite.any(axis=(1, 2))).all()
    one = to_bits(np.ones(1, np.float32), dtype)[0]
    a_regs = a_registers(np.diag(np.full(16, one, np.uint16)))
    warps = blocks.shape[0]  # 512
    a = np.tile(a_regs, (warps, 1))
    b = np.concatenate([b_registers(blk) for blk in blocks])
    c = np.zeros((32 * warps, 4), np.float32)
    d = np.zeros_like(c)
    mod.launch(f"mma_{dtype}", warps // 32, 1024, 0, [a, b, c, d])
    eye = np.eye(16)
    with np.errstate(invalid="ignore"):
        for w in range(warps):
            products = eye[:, :, None] * from_bits(blocks[w], dtype).astype(np.float64)[None]  # [i, k, n]
            expect = products.sum(axis=1).astype(np.float32)
            np.testing.assert_array_equal(c_matrix(d[32 * w: 32 * (w + 1)]), expect, err_msg=f"warp {w}")


def test_mma_needs_the_full_warp(mod) -> None:
    z4, z2 = np.zeros(64 * 4, np.uint32), np.zeros(64 * 2, np.uint32)
    with pytest.raises(EmulatorKernelError, match="fa_mma_m16n8k16.*all 32 lanes"):
        mod.launch("mma_f16", 1, 48, 0, [z4, z2, np.zeros(64 * 4, np.float32), np.zeros(64 * 4, np.float32)])


def test_exchange_collectives_report_divergence_and_deadlock(mod) -> None:
    out = np.zeros(32, np.float32)
    with pytest.raises(EmulatorDeadlockError, match=(
            rf"divergent warp collective.*lane 1\) called fa_ldmatrix_x4 .*:{line_of('odd_ldm')} while lanes 0 "
            rf"of warp 0 wait at fa_mma_m16n8k16<__half> .*:{line_of('even_mma')}")):
        mod.launch("diverge", 1, 32, 256, [out, 0])
    with pytest.raises(EmulatorDeadlockError, match=(
            rf"warp 0: lanes 0-15 wait at fa_mma_m16n8k16<__half> \(mask 0xffffffff\) at .*:{line_of('half_mma')}, "
            r"lanes 16-31 never arrive")):
        mod.launch("diverge", 1, 32, 256, [out, 1])


# ------------------------------------------------------------------ cp.async
POISON = 0x7FFF7FFF


def test_cp_async_groups_land_at_wait(mod) -> None:
    src = np.arange(1, 17, dtype=np.float32)
    out = np.zeros((5, 16), np.float32)
    mod.launch("cp_groups", 1, 1, 16 * 4, [src, out])
    bits = out.view(np.uint32)
    chunk = [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)]
    assert (bits[0] == POISON).all() and (bits[1] == POISON).all()  # issue; wait_group 2: nothing lands
    np.testing.assert_array_equal(out[2, chunk[0]], src[chunk[0]])  # wait_group 1: group 0
    assert (bits[2, 4:] == POISON).all()
    np.testing.assert_array_equal(out[3, :8], src[:8])  # wait_group 0: group 1 (incl. the zero fill)
    np.testing.assert_array_equal(out[3, chunk[2]], 0)
    assert (bits[3, chunk[3]] == POISON).all()  # an uncommitted copy is not waited for
    np.testing.assert_array_equal(out[4], np.concatenate([src[:8], np.zeros(4), src[12:]]))  # wait_all


def test_cp_async_poison_is_nan_for_every_dtype() -> None:
    half = np.array([0x7FFF], np.uint16)
    assert np.isnan(half.view(np.float16)).all() and np.isnan(bf16_value(half)).all()
    assert np.isnan(np.array([POISON], np.uint32).view(np.float32)).all()


def test_cp_async_misaligned_is_an_error(mod) -> None:
    with pytest.raises(EmulatorKernelError, match="fa_cp_async_16.*not 16-byte aligned"):
        mod.launch("misaligned", 1, 1, 64, [np.zeros(8, np.float32), np.zeros(1, np.float32)])


# ------------------------------------------------------------ vector reduction
def test_red_add_f32x2_is_two_atomic_adds(mod) -> None:
    """PTX ISA "red": red.global.add.v2.f32 adds element i of the vector to the i-th fp32 word at the
    address, each add atomic. Model: every thread's pair added into its two words (np.add.at), with
    small integers so the sum is exact in any order; 8-byte alignment is required."""
    rng = np.random.default_rng(3)
    n, slots = 256, 5
    v = rng.integers(-8, 9, 2 * n).astype(np.float32)
    idx = rng.integers(0, slots, n).astype(np.int32)
    out = rng.integers(-4, 5, 2 * slots).astype(np.float32)
    want = out.astype(np.float64)
    np.add.at(want, 2 * idx, v[0::2])
    np.add.at(want, 2 * idx + 1, v[1::2])
    mod.launch("red2", 2, 128, 0, [v, idx, out, 0])
    np.testing.assert_array_equal(out, want)
    with pytest.raises(EmulatorKernelError, match="fa_red_add_f32x2.*not 8-byte aligned"):
        mod.launch("red2", 1, 32, 0, [v, idx, np.zeros(2 * slots + 2, np.float32), 1])


# ------------------------------------------------------------------ mov / hold
def test_mov_copies_every_bit_and_hold_keeps_bools_and_pointers(mod) -> None:
    """PTX ISA "mov": mov.b32 / mov.b64 copy the source register's bits unchanged (no conversion, so
    NaN payloads, signed zeros and all-ones words survive). Model: the identity on the bit patterns;
    fa_hold of a bool keeps its truth value, of a pointer its address."""
    rng = np.random.default_rng(5)
    n = 256
    w = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    w[:6] = [0, 1, 0xFFFFFFFF, 0x7FC00001, 0x80000000, 0xFF800000]  # NaN payload, -0.0, -inf as float bits
    d = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) * 2 + (w & 1)
    d[:2] = [0xFFFFFFFFFFFFFFFF, 0x7FF8000000000001]
    o32, o64 = np.zeros(n, np.uint32), np.zeros(n, np.uint64)
    flags, offs = np.full(n, -1, np.int32), np.full(n, -1, np.int64)
    mod.launch("movs", 2, 128, 0, [w, d, np.zeros(n, np.float32), o32, o64, flags, offs])
    np.testing.assert_array_equal(o32, w)
    np.testing.assert_array_equal(o64, d)
    np.testing.assert_array_equal(flags, (w & 1).astype(np.int32))
    np.testing.assert_array_equal(offs, np.arange(n))


def test_mad_wide_u32_is_the_full_product_plus_c_mod_2_64(mod) -> None:
    """PTX ISA "mad": mad.wide.u32 d, a, b, c is d = a * b + c with the full 64-bit product of the
    32-bit unsigned a and b, c and d 64-bit, the sum modulo 2^64. Model: Python integers."""
    rng = np.random.default_rng(9)
    n = 256
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    c = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) * 2 + 1
    a[:3], b[:3], c[:3] = [0xFFFFFFFF, 0, 1], [0xFFFFFFFF, 7, 1], [0xFFFFFFFFFFFFFFFF, 5, 0]  # wrap, zero, one
    o = np.zeros(n, np.uint64)
    mod.launch("madw", 2, 128, 0, [a, b, c, o])
    want = [(int(x) * int(y) + int(z)) % 2**64 for x, y, z in zip(a, b, c)]
    assert [int(v) for v in o] == want


def test_shfl_idx_reads_the_source_lane_and_pin_is_the_identity(mod) -> None:
    """PTX ISA "shfl.sync": with c = 0x1f (no segments: mask = 0, maxLane = 31, minLane = 0) the .idx
    mode's source lane is j = b[4:0], always in range, and d is lane j's a. Model: per warp of 32
    threads, out[l] = w[warp base + (src[l] & 31)], with source lane values past 31 (their low five
    bits count) and every bit pattern of the word; fa_pin (a shuffle from the lane itself) returns the
    thread's word and pointer unchanged."""
    rng = np.random.default_rng(13)
    n = 256
    w = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    w[:4] = [0xFFFFFFFF, 0x7FC00001, 0x80000000, 0]
    src = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    src[:8] = [0, 31, 32, 33, 63, 0xFFFFFFFF, 0x80000000, 5]
    o, pin, off = np.zeros(n, np.uint32), np.zeros(n, np.uint32), np.full(n, -1, np.int64)
    mod.launch("shfl_idx", 2, 128, 0, [w, src, np.zeros(n, np.float32), o, pin, off])
    t = np.arange(n)
    np.testing.assert_array_equal(o, w[(t // 32) * 32 + (src & 31)])
    np.testing.assert_array_equal(pin, w)
    np.testing.assert_array_equal(off, t)


# ---------------------------------------------------------------------- GEMM
def _gemm_inputs(dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    a_bits = to_bits(rng.standard_normal((64, 64)).astype(np.float32), dtype)
    b_bits = to_bits(rng.standard_normal((64, 64)).astype(np.float32), dtype)
    return a_bits, b_bits, from_bits(a_bits, dtype), from_bits(b_bits, dtype)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_gemm_through_cp_async_ldmatrix_mma(mod, dtype: str) -> None:
    a_bits, b_bits, a, b = _gemm_inputs(dtype)
    m_valid = 60  # rows 60..63 of A are zero-filled by cp.async (valid = false)
    c = np.zeros((64, 64), np.float32)
    mod.launch(f"gemm_{dtype}", 1, 128, GEMM_SMEM, [a_bits, b_bits, c, m_valid, 0])
    a_used = a.copy()
    a_used[m_valid:] = 0
    ref = a_used.astype(np.float64) @ b.astype(np.float64)
    assert np.all(np.abs(c - ref) <= fp32_accumulation_bound(a_used, b))
    assert (c[m_valid:] == 0).all()


@pytest.fixture(scope="module")
def reverse_mod():
    return build(SOURCE, SIGS, extra_flags=["-DFAGEN_EMU_REVERSE_SCHEDULE"])


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("mode,what", [(1, "no cp.async wait"), (2, "no barrier after the wait")])
def test_gemm_pipeline_bugs_are_caught(request: pytest.FixtureRequest, reverse: bool, mode: int, what: str) -> None:
    """Both thread orders: whichever warp runs first reads the others' chunks as poison."""
    m = request.getfixturevalue("reverse_mod" if reverse else "mod")
    a_bits, b_bits, a, b = _gemm_inputs("f16")
    c = np.zeros((64, 64), np.float32)
    m.launch("gemm_f16", 1, 128, GEMM_SMEM, [a_bits, b_bits, c, 64, 0])  # the correct kernel agrees
    assert np.all(np.abs(c - a.astype(np.float64) @ b) <= fp32_accumulation_bound(a, b))
    m.launch("gemm_f16", 1, 128, GEMM_SMEM, [a_bits, b_bits, c, 64, mode])
    assert np.isnan(c).any(), what


# ----------------------------------------------------------- NVRTC and SASS
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_tensor_core_instructions(arch: str) -> None:
    from fagen import nvrtc, sass

    res = nvrtc.compile_cubin(SOURCE, "mma_primitives.cu", [f"-arch={arch}", "-std=c++17"], arch)
    assert res.ok, res.log
    kernels = sass.kernel_sass(res.cubin)
    if kernels is None:
        pytest.skip("no nvdisasm installed")
    for kernel, hmma in (("gemm_f16", "HMMA.16816.F32"), ("gemm_bf16", "HMMA.16816.F32.BF16")):
        mnemonics = [i.mnemonic for i in kernels[kernel]]
        assert mnemonics.count(hmma) >= 16, (kernel, sorted(set(mnemonics)))
        for m in ("LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS.E.BYPASS.128"):
            assert m in mnemonics, (kernel, m, sorted(set(mnemonics)))
        assert not {"LDL", "STL"} & {i.opcode for i in kernels[kernel]}, kernel
    reds = [i.mnemonic for i in kernels["red2"] if i.opcode in ("RED", "REDG")]
    if arch == "sm_90":  # one vector reduction of two fp32 words
        assert len(reds) == 1 and "F32x2" in reds[0] and "ADD" in reds[0], reds
    else:
        assert len(reds) == 2 and all("F32" in r and "ADD" in r for r in reds), reds
    shfl = [i.mnemonic for i in kernels["shfl_idx"] if i.opcode == "SHFL"]
    assert len(shfl) == 4 and all(m == "SHFL.IDX" for m in shfl), shfl  # one, then fa_pin's 1 + 2
    ldm = {i.mnemonic for i in kernels["ldm"]}
    assert {"LDSM.16.M88", "LDSM.16.M88.2", "LDSM.16.M88.4", "LDSM.16.MT88", "LDSM.16.MT88.2",
            "LDSM.16.MT88.4"} <= ldm, sorted(ldm)


def test_rendered_kernels_include_mma() -> None:
    """Every rendered kernel gets mma.cuh through primitives.cuh's Jinja include (the
    SIMT family's too: the primitives compile for every sm_80+ target, unused)."""
    from fagen import KernelSpec
    from fagen.renderer import render

    text = render(KernelSpec(head_dim=64, impl="simt")).source
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert "FA_DEVICE void fa_cp_async_wait_all()" in text
    assert "{% include" not in text
