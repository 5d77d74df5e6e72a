"""Hopper primitives of templates/wgmma/hopper.cuh on the CPU emulator -- wgmma (both operand
sources, every swizzle, both transposes, several N, both dtypes), its descriptors, stmatrix,
mbarrier phases, TMA loads / stores / reduce-adds with out-of-bounds boxes, setmaxnreg and
elect.sync -- each checked lane by lane against tests/hopper_model.py, an independent numpy
model of the PTX ISA's documented layouts; the emulator's reported errors; and NVRTC builds for
sm_90a whose SASS shows the Hopper instructions."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import hopper_model as M
from fagen import tma
from fagen.abi import TENSORMAP
from fagen.emulator import EmulatorDeadlockError, EmulatorKernelError, KernelSig, build

REPO = Path(__file__).resolve().parent.parent
PRIMITIVES = (REPO / "templates/partials/primitives.cuh").read_text()
HOPPER = (REPO / "templates/wgmma/hopper.cuh").read_text()

NS = (8, 24, 64, 128, 256)
DTYPES = ("f16", "bf16")
SWIZZLES = (0, 32, 64, 128)
# (dtype, N, trans_a, trans_b, register A)
CASES = [(dt, n, ta, tb, 0) for dt in DTYPES for n in NS for ta in (0, 1) for tb in (0, 1)] + \
        [(dt, n, 0, tb, 1) for dt in DTYPES for n in NS for tb in (0, 1)]
ETYPE = {"f16": "__half", "bf16": "__nv_bfloat16"}

KERNELS = r"""
// One wgmma of the warpgroup (128 threads) on operands copied into shared memory.
// prm: a_off, a_lbo, a_sbo, a_swizzle, b_off, b_lbo, b_sbo, b_swizzle (bytes).
// mode 0: plain; 1: also store d right after the commit (before the wait);
// 2: write d[0] before the wait; 3: write an A operand byte before the wait;
// 4: no fence; 5: two chained wgmmas into d in one group; 6: base offset 1 in A's descriptor.
template <typename E, int N, int TA, int TB, int RS>
__device__ void wg_case(const unsigned char* image, int image_bytes, const unsigned* aregs, const float* c,
                        const int* prm, int scale_d, float* out, float* early, int mode) {
    unsigned char* s = fa_smem_1024();
    const int t = threadIdx.x;
    for (int i = t; i < image_bytes; i += blockDim.x) s[i] = image[i];
    fa_sync();
    float d[N / 2];
    for (int i = 0; i < N / 2; ++i) d[i] = c[t * (N / 2) + i];
    unsigned a[4];
    for (int i = 0; i < 4; ++i) a[i] = aregs[t * 4 + i];
    const unsigned long long da = fa_wgmma_desc(s + prm[0], prm[1], prm[2], prm[3]) | (mode == 6 ? 1ull << 49 : 0ull);
    const unsigned long long db = fa_wgmma_desc(s + prm[4], prm[5], prm[6], prm[7]);
    if (mode != 4) fa_wgmma_fence();
    for (int rep = 0; rep < (mode == 5 ? 2 : 1); ++rep) {
        if (RS) fa_wgmma_m64nNk16_rs<E, N, TB>(d, a, db, rep ? 1 : scale_d);  // LINE:wgmma_rs
        else fa_wgmma_m64nNk16_ss<E, N, TA, TB>(d, da, db, rep ? 1 : scale_d);  // LINE:wgmma_ss
    }
    fa_wgmma_commit_group();
    if (mode == 1)
        for (int i = 0; i < N / 2; ++i) early[t * (N / 2) + i] = d[i];
    if (mode == 2 && t == 5) d[0] = 1.0f;
    if (mode == 3 && (t == 0 || t == 127)) s[prm[0]] = 0x55;  // before the first thread's wait, either order
    fa_wgmma_wait_group<0>();  // LINE:wgmma_wait
    for (int i = 0; i < N / 2; ++i) out[t * (N / 2) + i] = d[i];
}

extern "C" __global__ void wg(const unsigned char* image, int image_bytes, const unsigned* aregs, const float* c,
                              const int* prm, int scale_d, float* out, float* early, int variant, int mode) {
    switch (variant) {
CASES_HERE
    }
}

extern "C" __global__ void descs(const int* prm, unsigned long long* out, int n) {
    for (int i = 0; i < n; ++i)
        out[i] = fa_wgmma_desc(fa_smem_1024() + prm[4 * i], prm[4 * i + 1], prm[4 * i + 2], prm[4 * i + 3]);
}

// stmatrix: lane l supplies row rowidx[l] (a padded 16-halves stride), registers regs[l][4].
extern "C" __global__ void stm(const unsigned* regs, const int* rowidx, unsigned short* out, int variant) {
    unsigned short* s = reinterpret_cast<unsigned short*>(fa_smem());
    const int lane = threadIdx.x;
    for (int k = lane; k < 32 * 16; k += 32) s[k] = 0xdead;
    fa_sync();
    unsigned r[4];
    for (int i = 0; i < 4; ++i) r[i] = regs[lane * 4 + i];
    void* row = s + rowidx[lane] * 16;
    // variant & 8: the row as its shared address (fa_shared_u32), the form PTX's [%r] operand takes;
    // variant & 16: an address past the window (the emulator names it)
    const unsigned addr = (variant & 16) ? 0xfffffff0u : fa_shared_u32(row);
#define FA_STM(NAME, X) do { if (variant & 24) NAME(addr, X); else NAME(row, X); } while (0)
    switch (variant & 7) {
        case 0: { unsigned x[1] = {r[0]}; FA_STM(fa_stmatrix_x1, x); break; }
        case 1: { unsigned x[2] = {r[0], r[1]}; FA_STM(fa_stmatrix_x2, x); break; }
        case 2: { FA_STM(fa_stmatrix_x4, r); break; }
        case 3: { unsigned x[1] = {r[0]}; FA_STM(fa_stmatrix_x1_trans, x); break; }
        case 4: { unsigned x[2] = {r[0], r[1]}; FA_STM(fa_stmatrix_x2_trans, x); break; }
        default: FA_STM(fa_stmatrix_x4_trans, r);
    }
#undef FA_STM
    fa_sync();
    for (int k = lane; k < 32 * 16; k += 32) out[k] = s[k];
}

// One TMA load of a box (rank 2..4) at coords; out[0..bytes) = smem before the wait (poison),
// out[bytes..2 bytes) after it; tx[0] = tx bytes counted (expect_tx of exactly box bytes completes).
extern "C" __global__ void tma_load(const __grid_constant__ FaTensorMap tmap, const int* coords, int rank,
                                    int box_bytes, unsigned char* out) {
    unsigned char* s = fa_smem_1024();
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(s + 65536);
    fa_mbarrier_init(bar, 1);
    fa_fence_barrier_init();
    fa_mbarrier_arrive_expect_tx(bar, box_bytes);
    if (rank == 2) fa_tma_load_2d(s, &tmap, bar, coords[0], coords[1]);
    else if (rank == 3) fa_tma_load_3d(s, &tmap, bar, coords[0], coords[1], coords[2]);
    else fa_tma_load_4d(s, &tmap, bar, coords[0], coords[1], coords[2], coords[3]);
    for (int i = 0; i < box_bytes; ++i) out[i] = s[i];  // the phase completed at the TMA's complete_tx
    fa_mbarrier_wait_parity(bar, 0);
    for (int i = 0; i < box_bytes; ++i) out[box_bytes + i] = s[i];
}

// The same load with one expected byte more than the box: the phase never completes.
// mode 0: wait (deadlock); 1: read the box without waiting (poison).
extern "C" __global__ void tma_short(const __grid_constant__ FaTensorMap tmap, int box_bytes, unsigned char* out,
                                     int mode) {
    unsigned char* s = fa_smem_1024();
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(s + 65536);
    fa_mbarrier_init(bar, 1);  // LINE:short_init
    fa_mbarrier_arrive_expect_tx(bar, box_bytes + 16);
    fa_tma_load_2d(s, &tmap, bar, 0, 0);
    if (mode == 0) fa_mbarrier_wait_parity(bar, 0);  // LINE:short_wait
    for (int i = 0; i < box_bytes; ++i) out[i] = s[i];
}

// TMA store (kind 0) or reduce-add (1) of the smem box `src` at coords; then the bulk group wait.
// mode 1: overwrite the smem source before the wait.
extern "C" __global__ void tma_out(const __grid_constant__ FaTensorMap tmap, const unsigned char* src, int box_bytes,
                                   const int* coords, int rank, int kind, int mode) {
    unsigned char* s = fa_smem_1024();
    for (int i = 0; i < box_bytes; ++i) s[i] = src[i];
    fa_fence_proxy_async();
    if (rank == 2) {
        if (kind == 0) fa_tma_store_2d(&tmap, s, coords[0], coords[1]);
        else fa_tma_reduce_add_2d(&tmap, s, coords[0], coords[1]);
    } else if (rank == 3) {
        if (kind == 0) fa_tma_store_3d(&tmap, s, coords[0], coords[1], coords[2]);
        else fa_tma_reduce_add_3d(&tmap, s, coords[0], coords[1], coords[2]);
    } else {
        if (kind == 0) fa_tma_store_4d(&tmap, s, coords[0], coords[1], coords[2], coords[3]);
        else fa_tma_reduce_add_4d(&tmap, s, coords[0], coords[1], coords[2], coords[3]);
    }
    fa_bulk_commit_group();
    if (mode == 1) s[0] ^= 1;
    fa_bulk_wait_group_read<0>();  // LINE:bulk_wait
    fa_bulk_wait_group<0>();
}

// mbarrier phases: count 2 arrivals; thread 0 logs try_wait results around them.
// mode 0: normal; 1: a third arrival in phase 0 (too many); 2: arrive on an uninitialised barrier;
// 3: thread 1 never arrives (deadlock).
extern "C" __global__ void mbar(int* log, int mode) {
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(fa_smem_1024());
    unsigned long long* other = bar + 1;
    const int t = threadIdx.x;
    if (t == 0) {
        if (mode == 2) fa_mbarrier_arrive(other);  // LINE:uninit
        fa_mbarrier_init(bar, 2);
        fa_fence_barrier_init();
    }
    fa_sync();
    if (t == 0) {
        log[0] = fa_mbarrier_try_wait_parity(bar, 1);  // the phase before phase 0: complete
        if (mode == 1) {  // two arrivals leave phase 0 waiting for 16 bytes; a third is one too many
            fa_mbarrier_arrive_expect_tx(bar, 16);
            fa_mbarrier_arrive(bar);
            fa_mbarrier_arrive(bar);
        }
        fa_mbarrier_arrive(bar);
        fa_mbarrier_wait_parity(bar, 0);  // LINE:mbar_wait
        log[1] = 1;
        log[2] = fa_mbarrier_try_wait_parity(bar, 0);  // phase 0 is complete
    } else if (t == 1 && mode != 3) {
        log[3] = 7;  // before thread 0 passes its wait
        fa_mbarrier_arrive(bar);
    }
    fa_sync();
}

// setmaxnreg: warpgroup 1 asks dec<40>, warpgroup 0 inc<232>; mode 1: thread 3 asks dec<48>.
extern "C" __global__ void maxnreg(int* out, int mode) {
    const int t = threadIdx.x;
    if (t / 128 == 1) fa_setmaxnreg_dec<40>();
    else if (mode == 1 && t == 3) fa_setmaxnreg_dec<48>();  // LINE:maxnreg_odd
    else fa_setmaxnreg_inc<232>();  // LINE:maxnreg
    out[t] = 1;
}

extern "C" __global__ void elect(int* out) { out[threadIdx.x] = fa_elect_one(); }

// Named barriers: warps 0-1 (64 threads) produce into smem and arrive on barrier 3; warps 2-3
// sync on it and read. mode 1: warp 0 never arrives (deadlock); mode 2: count 48 (invalid).
extern "C" __global__ void named(int* out, int mode) {
    int* s = reinterpret_cast<int*>(fa_smem());
    const int t = threadIdx.x;
    if (t < 64) {
        s[t] = 10 * t;
        if (mode == 1 && t < 32) return;
        fa_named_barrier_arrive(3, mode == 2 ? 48 : 128);
    } else {
        fa_named_barrier_sync(3, 128);  // LINE:named_sync
        out[t - 64] = s[t - 64];
    }
}

// Non-tensor bulk copies: load `bytes` from src into smem (through an mbarrier), add them twice
// into acc (f32 reduce), store them to dst; mode 1: a misaligned size.
extern "C" __global__ void bulk(const float* src, float* acc, float* dst, int bytes, float* early, int mode) {
    unsigned char* s = fa_smem_1024();
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(s + 65536);
    fa_mbarrier_init(bar, 1);
    fa_mbarrier_expect_tx(bar, bytes);  // no arrival yet: the phase stays open after the copy's complete_tx
    fa_bulk_load(s + 256, src, bytes - (mode == 1 ? 8 : 0), bar);  // LINE:bulk_load
    for (int i = 0; i < bytes / 4; ++i) early[i] = reinterpret_cast<float*>(s + 256)[i];
    fa_mbarrier_arrive(bar);
    fa_mbarrier_wait_parity(bar, 0);
    fa_bulk_reduce_add_f32(acc, reinterpret_cast<float*>(s + 256), bytes);
    fa_bulk_reduce_add_f32(acc, reinterpret_cast<float*>(s + 256), bytes);
    fa_bulk_store(dst, s + 256, bytes);
    fa_bulk_commit_group();
    fa_bulk_wait_group<0>();
}
"""


def _cases_cpp() -> str:
    lines = []
    for i, (dt, n, ta, tb, rs) in enumerate(CASES):
        lines.append(f"        case {i}: wg_case<{ETYPE[dt]}, {n}, {ta}, {tb}, {rs}>(image, image_bytes, aregs, c, prm, "
                     "scale_d, out, early, mode); break;")
    return "\n".join(lines)


SOURCE = PRIMITIVES + "\n" + HOPPER + "\n" + KERNELS.replace("CASES_HERE", _cases_cpp())
TM = TENSORMAP  # the ABI's tensor-map parameter kind
SIGS = [
    KernelSig("wg", (("const unsigned char*", "image"), ("int", "image_bytes"), ("const unsigned*", "aregs"),
                     ("const float*", "c"), ("const int*", "prm"), ("int", "scale_d"), ("float*", "out"),
                     ("float*", "early"), ("int", "variant"), ("int", "mode"))),
    KernelSig("descs", (("const int*", "prm"), ("unsigned long long*", "out"), ("int", "n"))),
    KernelSig("stm", (("const unsigned*", "regs"), ("const int*", "rowidx"), ("unsigned short*", "out"),
                      ("int", "variant"))),
    KernelSig("tma_load", ((TM, "tmap"), ("const int*", "coords"), ("int", "rank"), ("int", "box_bytes"),
                           ("unsigned char*", "out"))),
    KernelSig("tma_short", ((TM, "tmap"), ("int", "box_bytes"), ("unsigned char*", "out"), ("int", "mode"))),
    KernelSig("tma_out", ((TM, "tmap"), ("const unsigned char*", "src"), ("int", "box_bytes"),
                          ("const int*", "coords"), ("int", "rank"), ("int", "kind"), ("int", "mode"))),
    KernelSig("mbar", (("int*", "log"), ("int", "mode"))),
    KernelSig("maxnreg", (("int*", "out"), ("int", "mode"))),
    KernelSig("elect", (("int*", "out"),)),
    KernelSig("named", (("int*", "out"), ("int", "mode"))),
    KernelSig("bulk", (("const float*", "src"), ("float*", "acc"), ("float*", "dst"), ("int", "bytes"),
                       ("float*", "early"), ("int", "mode"))),
]
SMEM = 65536 + 1024


def line_of(tag: str) -> int:
    for i, text in enumerate(SOURCE.splitlines(), 1):
        if text.rstrip().endswith(f"// LINE:{tag}"):
            return i
    raise AssertionError(tag)


@pytest.fixture(scope="module")
def mod():
    return build(SOURCE, SIGS)


# ------------------------------------------------------------------ values
def bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(np.float16).view(np.uint16) if dtype == "f16" else bf16_bits(x)


def distinct_values(n: int, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """n distinct values, each exactly representable in ``dtype`` (fp16: integers; bf16: 8-bit
    significands times powers of two)."""
    if dtype == "f16":
        pool = np.arange(-2048, 2048, dtype=np.float32)
    else:
        sig = 1 + np.arange(128, dtype=np.float32) / 128
        pool = np.concatenate([s * sig * np.float32(2.0) ** e for e in range(-10, 11) for s in (1, -1)])
    return rng.permutation(pool)[:n]


# ------------------------------------------------------------ wgmma driver
def place(image: np.ndarray, bits: np.ndarray, mn_major: bool, swizzle: int, base: int, kofs: int,
          mutation: str | None = None) -> tuple[int, int, int]:
    """Writes operand ``bits`` [rows, 16] into ``image`` through the model; returns the
    descriptor's (start, lbo, sbo)."""
    rows = bits.shape[0]
    lbo, sbo, _ = M.canonical_params(rows, mn_major, swizzle)
    start = base + 2 * kofs
    addrs = M.operand_addresses(rows, mn_major, swizzle, start, lbo, sbo, mutation)
    assert len(np.unique(addrs)) == addrs.size  # every element its own address
    for (r, k), a in np.ndenumerate(addrs):
        image[a:a + 2] = np.frombuffer(bits[r, k].tobytes(), np.uint8)
    return start, lbo, sbo


def k_offset(mn_major: bool, swizzle: int) -> int:
    """K elements into a wider K-major swizzled tile where the operand starts (the descriptor's
    start address advanced by 32 bytes per k16 step, the swizzle acting on absolute addresses)."""
    return swizzle // 2 - 16 if (not mn_major and swizzle) else 0


def run_wgmma(mod, dtype: str, n: int, ta: int, tb: int, rs: int, sw_a: int, sw_b: int, a_vals: np.ndarray,
              b_vals: np.ndarray, c: np.ndarray | None = None, scale_d: int = 1, mode: int = 0,
              mutation: str | None = None):
    """Runs one wgmma; returns (D as [64, n] through the model's D layout, raw registers, early)."""
    a_bits, b_bits = to_bits(a_vals, dtype), to_bits(b_vals, dtype)  # A [64, 16], B [16, n]
    image = np.zeros(2 * 65536, np.uint8)
    ka, kb = k_offset(bool(ta), sw_a), k_offset(bool(tb), sw_b)
    a_start, a_lbo, a_sbo = place(image, a_bits, bool(ta), sw_a, 0, ka, mutation)
    b_base = 32768
    b_start, b_lbo, b_sbo = place(image, np.ascontiguousarray(b_bits.T), bool(tb), sw_b, b_base, kb, mutation)
    aregs = np.zeros((128, 4), np.uint32)
    for tid, r in itertools.product(range(128), range(4)):
        lo = a_bits[M.a_register_position(tid, r, 0, mutation)]
        hi = a_bits[M.a_register_position(tid, r, 1, mutation)]
        aregs[tid, r] = int(lo) | int(hi) << 16
    tid, i = np.meshgrid(np.arange(128), np.arange(n // 2), indexing="ij")
    rows, cols = M.d_position(tid, i, mutation)
    c = np.zeros((64, n), np.float32) if c is None else c
    creg = c[rows, cols].astype(np.float32)
    prm = np.array([a_start, a_lbo, a_sbo, sw_a, b_start, b_lbo, b_sbo, sw_b], np.int32)
    out = np.zeros((128, n // 2), np.float32)
    early = np.zeros((128, n // 2), np.float32)
    variant = CASES.index((dtype, n, ta, tb, rs))
    mod.launch("wg", 1, 128, SMEM, [image, 65536, aregs, creg, prm, scale_d, out, early, variant, mode])
    d = np.full((64, n), np.nan, np.float32)
    d[rows, cols] = out
    return d, out, early


def config_swizzles(index: int) -> tuple[int, int]:
    return SWIZZLES[index % 4], SWIZZLES[(index // 4 + index + 1) % 4]


WG_CASES = [pytest.param(*case, id=f"{case[0]}-n{case[1]}-ta{case[2]}-tb{case[3]}-{'rs' if case[4] else 'ss'}")
            for case in CASES]


@pytest.mark.parametrize("dtype,n,ta,tb,rs", WG_CASES)
def test_wgmma_selects_every_element(mod, dtype: str, n: int, ta: int, tb: int, rs: int) -> None:
    """A picks B's rows (A[m, k] = 1 where k = m mod 16) and then B picks A's columns: every D
    register of every thread must hold exactly the one distinct element the model puts there."""
    rng = np.random.default_rng(n * 8 + ta * 4 + tb * 2 + rs)
    sw_a, sw_b = config_swizzles(CASES.index((dtype, n, ta, tb, rs)))
    sel_a = (np.arange(16)[None, :] == np.arange(64)[:, None] % 16).astype(np.float32)
    b = distinct_values(16 * n, dtype, rng).reshape(16, n)
    d, _, _ = run_wgmma(mod, dtype, n, ta, tb, rs, sw_a, sw_b, sel_a, b, scale_d=0)
    np.testing.assert_array_equal(d, b[np.arange(64) % 16], err_msg=f"B through swizzle {sw_b}")
    a = distinct_values(64 * 16, dtype, rng).reshape(64, 16)
    sel_b = (np.arange(16)[:, None] == np.arange(n)[None, :] % 16).astype(np.float32)
    d, _, _ = run_wgmma(mod, dtype, n, ta, tb, rs, sw_a, sw_b, a, sel_b, scale_d=0)
    np.testing.assert_array_equal(d, a[:, np.arange(n) % 16], err_msg=f"A through swizzle {sw_a}")


@pytest.mark.parametrize("sw_a,sw_b", list(itertools.product(SWIZZLES, SWIZZLES)))
@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 1)])
def test_wgmma_every_swizzle_pair_exact(mod, sw_a: int, sw_b: int, ta: int, tb: int) -> None:
    """Integer operands (exact in fp32): D = C + A B element for element, with scale-d = 1."""
    rng = np.random.default_rng(sw_a + 3 * sw_b + ta)
    a = rng.integers(-4, 5, (64, 16)).astype(np.float32)
    b = rng.integers(-4, 5, (16, 64)).astype(np.float32)
    c = rng.integers(-100, 100, (64, 64)).astype(np.float32)
    d, _, _ = run_wgmma(mod, "f16", 64, ta, tb, 0, sw_a, sw_b, a, b, c, scale_d=1)
    np.testing.assert_array_equal(d, c + a.astype(np.float64) @ b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_d", [0, 1])
def test_wgmma_scale_d_and_random_values(mod, dtype: str, scale_d: int) -> None:
    """Random operands against float64 within fp32 accumulation error; scale-d 0 ignores C."""
    rng = np.random.default_rng(scale_d + 2 * (dtype == "bf16"))
    a = rng.standard_normal((64, 16)).astype(np.float32)
    b = rng.standard_normal((16, 128)).astype(np.float32)
    a = (a.astype(np.float16) if dtype == "f16" else (bf16_bits(a).astype(np.uint32) << 16).view(np.float32))
    b = (b.astype(np.float16) if dtype == "f16" else (bf16_bits(b).astype(np.uint32) << 16).view(np.float32))
    a, b = a.astype(np.float32), b.astype(np.float32)
    c = rng.standard_normal((64, 128)).astype(np.float32) * 4
    d, _, _ = run_wgmma(mod, dtype, 128, 0, 1, 0, 128, 128, a, b, c, scale_d=scale_d)
    ref = (c.astype(np.float64) if scale_d else 0) + a.astype(np.float64) @ b.astype(np.float64)
    bound = 2 * 17 * 2.0**-24 * ((np.abs(c) if scale_d else 0) + np.abs(a.astype(np.float64)) @ np.abs(b))
    assert np.all(np.abs(d - ref) <= bound + 1e-30)


@pytest.mark.parametrize("mutation", ["d_regs", "a_regs", "swizzle_xor", "lbo_sbo"])
def test_a_wrong_model_fails(mod, mutation: str) -> None:
    """Mutation check: the correct model reproduces the emulator; a model with swapped D or A
    registers, the swizzle XOR one bit off, or LBO and SBO swapped does not."""
    rng = np.random.default_rng(1)
    a = rng.integers(-4, 5, (64, 16)).astype(np.float32)
    b = rng.integers(-4, 5, (16, 128)).astype(np.float32)
    rs = 1 if mutation == "a_regs" else 0
    sw = 0 if mutation == "lbo_sbo" else 64
    ref = a.astype(np.float64) @ b
    ta = 0 if rs else 1
    d, _, _ = run_wgmma(mod, "f16", 128, ta, 1, rs, sw, sw, a, b, scale_d=0)
    np.testing.assert_array_equal(d, ref)
    d_bad, _, _ = run_wgmma(mod, "f16", 128, ta, 1, rs, sw, sw, a, b, scale_d=0, mutation=mutation)
    assert not np.array_equal(d_bad, ref), mutation


def test_descriptor_bits_follow_the_isa(mod) -> None:
    rows = [(0, 16, 1024, 0), (32, 0x3FF0, 1024, 128), (2048, 128, 256, 32), (4096 + 64, 256, 512, 64),
            (65520, 0x3FFF0, 0x3FFF0, 128)]
    prm = np.array(rows, np.int32).reshape(-1)
    out = np.zeros(len(rows), np.uint64)
    mod.launch("descs", 1, 1, SMEM, [prm, out, len(rows)])
    assert [int(x) for x in out] == [M.encode_desc(*r) for r in rows]


def test_wgmma_results_are_poison_until_the_wait(mod) -> None:
    a = np.ones((64, 16), np.float32)
    b = np.ones((16, 64), np.float32)
    d, out, early = run_wgmma(mod, "f16", 64, 0, 0, 0, 128, 128, a, b, scale_d=0, mode=1)
    assert (early.view(np.uint32) == 0x7FFF7FFF).all()
    np.testing.assert_array_equal(d, np.full((64, 64), 16.0))


def test_wgmma_chains_into_the_same_registers(mod) -> None:
    """Two wgmmas into one accumulator in one group (the ISA orders them): D = C + 2 A B."""
    rng = np.random.default_rng(5)
    a = rng.integers(-3, 4, (64, 16)).astype(np.float32)
    b = rng.integers(-3, 4, (16, 24)).astype(np.float32)
    c = rng.integers(-9, 9, (64, 24)).astype(np.float32)
    for rs in (0, 1):
        d, _, _ = run_wgmma(mod, "bf16", 24, 0, 1, rs, 32, 64, a, b, c, scale_d=1, mode=5)
        np.testing.assert_array_equal(d, c + 2 * (a.astype(np.float64) @ b))


def test_wgmma_misuse_is_reported(mod) -> None:
    a = np.ones((64, 16), np.float32)
    b = np.ones((16, 64), np.float32)
    wait = line_of("wgmma_wait")
    with pytest.raises(EmulatorKernelError, match=rf"accumulator register d\[0\] of the wgmma issued at .*:"
                       rf"{line_of('wgmma_ss')} was written before fa_wgmma_wait_group at .*:{wait}"):
        run_wgmma(mod, "f16", 64, 0, 0, 0, 0, 0, a, b, mode=2)
    with pytest.raises(EmulatorKernelError, match=rf"shared memory at offset 0x0, an operand of the wgmma issued at "
                       rf".*:{line_of('wgmma_ss')}, was written before fa_wgmma_wait_group"):
        run_wgmma(mod, "f16", 64, 0, 0, 0, 0, 0, a, b, mode=3)
    with pytest.raises(EmulatorKernelError, match=r"without fa_wgmma_fence\(\)"):
        run_wgmma(mod, "f16", 64, 0, 0, 0, 0, 0, a, b, mode=4)
    with pytest.raises(EmulatorKernelError, match=r"has base offset 1; the emulator supports 0 only"):
        run_wgmma(mod, "f16", 64, 0, 0, 0, 128, 128, a, b, mode=6)


def test_wgmma_needs_the_whole_warpgroup(mod) -> None:
    z = np.zeros(1 << 17, np.uint8)
    with pytest.raises(EmulatorKernelError, match="needs all 128 threads of warpgroup 0"):
        mod.launch("wg", 1, 96, SMEM, [z, 0, np.zeros((128, 4), np.uint32), np.zeros(128 * 32, np.float32),
                                       np.zeros(8, np.int32), 0, np.zeros(128 * 32, np.float32),
                                       np.zeros(128 * 32, np.float32), CASES.index(("f16", 64, 0, 0, 0)), 0])


# ---------------------------------------------------------------- stmatrix
@pytest.mark.parametrize("by_address", [False, True], ids=["pointer", "shared-address"])
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("num", [1, 2, 4])
def test_stmatrix_matches_layout_model(mod, num: int, trans: bool, by_address: bool) -> None:
    rng = np.random.default_rng(num + 8 * trans)
    regs = rng.integers(0, 2**32, (32, 4), dtype=np.uint64).astype(np.uint32)
    rowidx = rng.permutation(32).astype(np.int32)
    out = np.zeros(32 * 16, np.uint16)
    mod.launch("stm", 1, 32, 32 * 16 * 2, [regs, rowidx, out, {1: 0, 2: 1, 4: 2}[num] + 3 * trans + 8 * by_address])
    smem = out.reshape(32, 16)
    expect = np.full((32, 16), 0xDEAD, np.uint16)
    for i in range(num):
        mat = np.zeros((8, 8), np.uint16)
        for lane, j in itertools.product(range(32), range(2)):
            mat[M.stmatrix_position(lane, j)] = (int(regs[lane, i]) >> (16 * j)) & 0xFFFF
        if trans:
            mat = mat.T
        for r in range(8):
            expect[rowidx[8 * i + r], :8] = mat[r]  # row r of matrix i goes to lane 8i + r's address
    np.testing.assert_array_equal(smem, expect)


def test_stmatrix_at_a_shared_address_past_the_window_is_named(mod) -> None:
    regs, rowidx, out = np.zeros((32, 4), np.uint32), np.arange(32, dtype=np.int32), np.zeros(32 * 16, np.uint16)
    with pytest.raises(EmulatorKernelError, match="fa_stmatrix_x4 at .*shared address 4294967280 is not in the "
                                                  "dynamic shared memory window"):
        mod.launch("stm", 1, 32, 32 * 16 * 2, [regs, rowidx, out, 2 + 16])


# --------------------------------------------------------------------- TMA
TMA_CASES = [
    # (shape (torch order), box, coords, swizzle, element strides, dtype)
    ((40, 64), (16, 64), (32, 0), 128, None, np.float16),  # rows past the end: zero
    ((40, 72), (8, 64), (-3, 30), 128, None, np.float16),  # negative start and past the end
    ((33, 32), (16, 32), (20, -8), 64, None, np.float16),
    ((17, 16), (16, 16), (5, 3), 32, None, np.float16),
    ((9, 12), (8, 8), (2, 6), 0, None, np.float32),
    ((5, 6, 32), (2, 4, 32), (4, 3, 0), 64, None, np.float16),
    ((3, 4, 5, 16), (2, 2, 4, 16), (1, 2, -1, 0), 32, None, np.float16),
    ((20, 32), (8, 32), (1, 0), 64, (2, 1), np.float16),  # every other row
]


def _fields(arr: np.ndarray, box, swizzle, es) -> tma.TensorMapFields:
    return tma.tensor_map_for(arr, box, swizzle=swizzle, element_strides=es)


@pytest.mark.parametrize("shape,box,coords,swizzle,es,dtype", TMA_CASES)
def test_tma_load_box_placement_and_oob_fill(mod, shape, box, coords, swizzle, es, dtype) -> None:
    rng = np.random.default_rng(len(shape) * 100 + swizzle)
    x = (rng.permutation(np.prod(shape)) + 1).astype(dtype).reshape(shape)  # distinct, non-zero
    fields = _fields(x, box, swizzle, es)
    nbytes = fields.box_bytes
    out = np.zeros(2 * nbytes, np.uint8)
    tma_coords = np.array(list(reversed(coords)) + [0] * (4 - len(coords)), np.int32)  # innermost first
    mod.launch("tma_load", 1, 1, SMEM, [fields, tma_coords, len(shape), nbytes, out])
    expect_box = M.tma_box(x, coords, box, es)
    placed = M.smem_image_of_box(expect_box, 0, swizzle)
    expect = np.zeros(nbytes, np.uint8)
    for a, raw in placed.items():
        expect[a:a + len(raw)] = np.frombuffer(raw, np.uint8)
    np.testing.assert_array_equal(out[nbytes:], expect)
    np.testing.assert_array_equal(out[:nbytes], expect)  # the phase completed at issue (tx and arrival done)
    if swizzle:  # mutation check: a swizzle XOR one address bit off places the box elsewhere
        wrong = np.zeros(nbytes, np.uint8)
        for a, raw in M.smem_image_of_box(expect_box, 0, swizzle, "swizzle_xor").items():
            wrong[a:a + len(raw)] = np.frombuffer(raw, np.uint8)
        assert not np.array_equal(out[nbytes:], wrong)
    assert (expect_box == 0).any() or not any(c < 0 or c + b > s for c, b, s in zip(coords, box, shape))


def test_tma_data_is_poison_until_the_phase_completes(mod) -> None:
    x = np.arange(64 * 64, dtype=np.float16).reshape(64, 64)
    fields = tma.tensor_map_for(x, (16, 64), swizzle=128)
    out = np.zeros(fields.box_bytes, np.uint8)
    mod.launch("tma_short", 1, 1, SMEM, [fields, fields.box_bytes, out, 1])
    assert (out.view(np.uint16) == 0x7FFF).all()
    with pytest.raises(EmulatorDeadlockError, match=(
            rf"threads 0 wait at fa_mbarrier_try_wait_parity\(parity 0\) at .*:{line_of('short_wait')} on mbarrier "
            rf"smem\+0x10000 \(initialised at .*:{line_of('short_init')}\), whose phase 0 never completes: 0 of 1 "
            r"arrival\(s\) pending, tx-count 16")):
        mod.launch("tma_short", 1, 1, SMEM, [fields, fields.box_bytes, out, 0])


@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("shape,box,coords,swizzle,dtype", [
    ((10, 64), (8, 64), (5, 0), 128, np.float16),
    ((6, 20), (4, 16), (3, 8), 64, np.float32),
    ((3, 5, 32), (2, 4, 32), (2, 3, 0), 64, np.float16),
    ((2, 3, 5, 8), (2, 2, 4, 8), (1, 2, 3, 0), 0, np.float32),
])
def test_tma_store_and_reduce_add_skip_out_of_bounds(mod, kind, shape, box, coords, swizzle, dtype) -> None:
    rng = np.random.default_rng(kind + swizzle)
    g = rng.integers(-50, 50, shape).astype(dtype)
    before = g.copy()
    src_box = rng.integers(-50, 50, box).astype(dtype)
    fields = tma.tensor_map_for(g, box, swizzle=swizzle)
    image = np.zeros(fields.box_bytes, np.uint8)
    for a, raw in M.smem_image_of_box(src_box, 0, swizzle).items():
        image[a:a + len(raw)] = np.frombuffer(raw, np.uint8)
    tma_coords = np.array(list(reversed(coords)) + [0] * (4 - len(coords)), np.int32)
    mod.launch("tma_out", 1, 1, SMEM, [fields, image, fields.box_bytes, tma_coords, len(shape), kind, 0])
    expect = before.copy()
    for idx in np.ndindex(*box):
        dst = tuple(c + j for c, j in zip(coords, idx))
        if all(d < s for d, s in zip(dst, shape)):
            expect[dst] = src_box[idx] if kind == 0 else before[dst] + src_box[idx]
    np.testing.assert_array_equal(g, expect)


def test_tma_store_source_overwritten_before_the_wait_is_reported(mod) -> None:
    g = np.zeros((8, 64), np.float16)
    fields = tma.tensor_map_for(g, (8, 64), swizzle=128)
    src = np.ones(fields.box_bytes, np.uint8)
    with pytest.raises(EmulatorKernelError, match=rf"was written before fa_bulk_wait_group at .*:{line_of('bulk_wait')}"):
        mod.launch("tma_out", 1, 1, SMEM, [fields, src, fields.box_bytes, np.zeros(4, np.int32), 2, 0, 1])


def test_tma_store_with_a_negative_start_is_refused(mod) -> None:
    g = np.zeros((8, 64), np.float16)
    fields = tma.tensor_map_for(g, (8, 64), swizzle=128)
    src = np.zeros(fields.box_bytes, np.uint8)
    with pytest.raises(EmulatorKernelError, match="must not start below 0"):
        mod.launch("tma_out", 1, 1, SMEM, [fields, src, fields.box_bytes, np.array([0, -1, 0, 0], np.int32), 2, 0, 0])


def test_non_tensor_bulk_copies(mod) -> None:
    src = np.arange(1, 65, dtype=np.float32)
    acc = np.full(64, 0.5, np.float32)
    dst = np.zeros(64, np.float32)
    early = np.zeros(64, np.float32)
    mod.launch("bulk", 1, 1, SMEM, [src, acc, dst, 256, early, 0])
    assert (early.view(np.uint32) == 0x7FFF7FFF).all()  # poison until the phase completes
    np.testing.assert_array_equal(dst, src)
    np.testing.assert_array_equal(acc, 0.5 + 2 * src)
    with pytest.raises(EmulatorKernelError, match=rf"fa_bulk_load at .*:{line_of('bulk_load')}: 248 bytes .*multiples of 16"):
        mod.launch("bulk", 1, 1, SMEM, [src, acc, dst, 256, early, 1])


def test_named_barriers(mod) -> None:
    out = np.zeros(64, np.int32)
    mod.launch("named", 1, 128, 1024, [out, 0])
    np.testing.assert_array_equal(out, 10 * np.arange(64))
    with pytest.raises(EmulatorDeadlockError, match=(
            rf"named barrier 3: 96 of 128 thread\(s\) arrived \(first at .*\), threads 64-127 wait there")):
        mod.launch("named", 1, 128, 1024, [out, 1])
    with pytest.raises(EmulatorKernelError, match="thread count 48 is not a positive multiple of 32"):
        mod.launch("named", 1, 128, 1024, [out, 2])


# ---------------------------------------------------------------- mbarrier
def test_mbarrier_phases_and_parity(mod) -> None:
    log = np.zeros(4, np.int32)
    mod.launch("mbar", 1, 64, SMEM, [log, 0])
    assert list(log) == [1, 1, 1, 7]


@pytest.mark.parametrize("runtime_object", [True, False], ids=["runtime-object", "pasted"])
def test_the_hopper_runtime_is_compiled_once_into_the_runtime_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     runtime_object: bool) -> None:
    """hopper.h's out-of-line half (wgmma issue and retirement, mbarriers, TMA, named barriers) is defined
    in the runtime object, once per flag set, and only declared in a unit; where g++ cannot make the
    object the unit's header defines it itself. Either way the primitives run the same."""
    import shutil
    import subprocess

    import fagen.emulator.builder as emu_build

    if not runtime_object:
        monkeypatch.setattr(emu_build, "runtime_object", lambda *a: False)
    m = build(SOURCE, SIGS, cache_dir=tmp_path)
    log = np.zeros(4, np.int32)
    m.launch("mbar", 1, 64, SMEM, [log, 0])
    assert list(log) == [1, 1, 1, 7]
    with pytest.raises(EmulatorKernelError, match=r"gets more arrivals than its count 2 in phase 0"):
        m.launch("mbar", 1, 64, SMEM, [log, 1])
    objects = list(tmp_path.glob("runtime-*.o"))
    (header,) = tmp_path.glob("prelude-*.h")
    assert header.read_text().startswith(emu_build.RUNTIME_DECLS_ONLY) == runtime_object
    assert len(objects) == (1 if runtime_object else 0)
    if runtime_object and shutil.which("nm"):
        defined = subprocess.run(["nm", "-C", "--defined-only", str(objects[0])], capture_output=True, text=True,
                                 check=True).stdout
        for fn in ("fagen_emu::hopper::wgmma_wait(", "fagen_emu::hopper::mbar_arrive(", "fagen_emu::hopper::tma(",
                   "fagen_emu::hopper::named_barrier(", "void fagen_emu::hopper::stmatrix_complete<4, true>("):
            assert fn in defined, fn


def test_mbarrier_misuse_is_reported(mod) -> None:
    log = np.zeros(4, np.int32)
    with pytest.raises(EmulatorKernelError, match=r"gets more arrivals than its count 2 in phase 0"):
        mod.launch("mbar", 1, 64, SMEM, [log, 1])
    with pytest.raises(EmulatorKernelError, match=rf"fa_mbarrier_arrive at .*:{line_of('uninit')}: mbarrier "
                       r"smem\+0x8 was not initialised"):
        mod.launch("mbar", 1, 64, SMEM, [log, 2])
    with pytest.raises(EmulatorDeadlockError, match=(
            rf"threads 0 wait at fa_mbarrier_try_wait_parity\(parity 0\) at .*:{line_of('mbar_wait')} on mbarrier "
            r"smem\+0x0 .*phase 0 never completes: 1 of 2 arrival\(s\) pending")):
        mod.launch("mbar", 1, 64, SMEM, [log, 3])


# ------------------------------------------------------ setmaxnreg, elect
def test_setmaxnreg_is_a_uniform_warpgroup_collective(mod) -> None:
    out = np.zeros(256, np.int32)
    mod.launch("maxnreg", 1, 256, 0, [out, 0])
    assert (out == 1).all()
    with pytest.raises(EmulatorDeadlockError, match=(
            rf"divergent warpgroup collective .*: thread \(3,0,0\) called fa_setmaxnreg_dec<48> at .*:"
            rf"{line_of('maxnreg_odd')} while 3 thread\(s\) of warpgroup 0 wait at fa_setmaxnreg_inc<232>")):
        mod.launch("maxnreg", 1, 256, 0, [out, 1])


def test_elect_one_elects_exactly_one_lane_per_warp(mod) -> None:
    out = np.zeros(96, np.int32)
    mod.launch("elect", 1, 96, 0, [out])
    assert list(out.reshape(3, 32).sum(axis=1)) == [1, 1, 1]
    assert list(np.flatnonzero(out) % 32) == [31, 31, 31]  # not lane 0: kernels must not assume it


# -------------------------------------------------------- demonstration GEMM
GEMM_SOURCE = PRIMITIVES + "\n" + HOPPER + "\n" + (REPO / "tests/hopper_kernels.cu").read_text()
GEMM_SIGS = [KernelSig("hopper_gemm", ((TM, "tma_a"), (TM, "tma_b"), ("float*", "c"), ("int", "k_total"))),
             KernelSig("hopper_rest", ((TM, "tmap"), ("float*", "out"), ("int", "flag")))]


@pytest.mark.parametrize("k_total,schedule", [(64, "forward"), (16, "forward"), (64, "reverse")])
def test_demonstration_gemm_equals_torch_matmul(k_total: int, schedule: str) -> None:
    """128 x 128 x K fp16 GEMM: a TMA producer warp, a 2-stage mbarrier pipeline (K = 64: each
    stage used twice, so the parities flip) and two consumer warpgroups doing wgmma; in either
    thread order (reverse: the producer runs first)."""
    import torch

    flags = ["-DFAGEN_EMU_REVERSE_SCHEDULE"] if schedule == "reverse" else []
    gm = build(GEMM_SOURCE, GEMM_SIGS, extra_flags=flags)
    gen = torch.Generator().manual_seed(k_total)
    a = torch.randn(128, k_total, generator=gen).half()
    b = torch.randn(k_total, 128, generator=gen).half()
    c = torch.full((128, 128), float("nan"))
    ta = tma.tensor_map_for(a, (128, 16), swizzle=32)
    tb = tma.tensor_map_for(b, (16, 64), swizzle=128)
    gm.launch("hopper_gemm", 1, 384, 4 * 4096 + 64, [ta, tb, c, k_total])
    torch.testing.assert_close(c, torch.matmul(a.float(), b.float()), rtol=1e-5, atol=1e-5)


def test_header_survives_a_jinja_include() -> None:
    """The family's templates pull hopper.cuh in with a Jinja include: it must come out verbatim."""
    import jinja2

    from fagen.renderer import templates_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), keep_trailing_newline=True)
    assert env.from_string('{% include "wgmma/hopper.cuh" %}').render() == HOPPER
