"""CPU emulator throughput: fiber switches per second and one heavier launch.

    python benchmarks/emulator.py [--json] [--ucontext]

* ``barrier``: 256 threads doing fa_sync() in a loop -- one fiber switch per
  thread per barrier, the emulator's unit of cost.
* ``shuffle``: 256 threads doing fa_warp_sum() in a loop (5 shuffles each).
* ``sgemm``: a 256x256x256 smem-tiled matmul (256 blocks of 256 threads,
  32 barriers per block), checked against numpy.
* ``mma`` / ``ldmatrix``: 128 threads (4 warps) issuing ``fa_mma_m16n8k16``
  (fp16) / ``fa_ldmatrix_x4`` in a loop -- the tensor-core warp collectives
  (32 fiber switches plus the whole warp's fragment arithmetic per call);
  rates count warp-level instructions, as a GPU's instruction counts do.
* ``hgemm``: a 256x256x256 fp16 matmul through cp.async + ldmatrix + mma
  (16 blocks of 4 warps, 64x64 tiles), checked against numpy.
* ``fagen_fwd`` / ``fagen_bwd``: one launch of a real rendered kernel
  (d=64, fp16, causal, B=1 H=2 N=256) when fagen's renderer is importable.

* ``racecheck_*``: the same sgemm / hgemm launches from the racecheck build
  (every shared-memory access through the happens-before tracker), and one
  forward + backward of the fagen kernels above per family inside
  ``fagen.runtime.cpu.racecheck()``; ``*_slowdown`` is the time over the plain
  launch's (the racecheck budget is <= 5x).

``--ucontext`` builds with the portable glibc swapcontext switch instead of
the x86-64 assembly one, for comparison.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fagen.emulator import KernelSig, build  # noqa: E402

SOURCE = (REPO / "templates/partials/primitives.cuh").read_text() + (
    REPO / "templates/partials/mma.cuh").read_text() + r"""
extern "C" __global__ void barrier_loop(float* out, int iters) {
    for (int i = 0; i < iters; ++i) fa_sync();
    out[threadIdx.x] = 1.f;
}
extern "C" __global__ void shuffle_loop(float* out, int iters) {
    float v = threadIdx.x;
    for (int i = 0; i < iters; ++i) v = fa_warp_sum(v) * (1.f / 32.f);
    out[threadIdx.x] = v;
}
// C[M,N] = A[M,K] B[K,N], 16x16 tiles, one output per thread.
extern "C" __global__ void sgemm(const float* a, const float* b, float* c, int m, int n, int k) {
    float* as = reinterpret_cast<float*>(fa_smem());
    float* bs = as + 256;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int row = blockIdx.y * 16 + ty, col = blockIdx.x * 16 + tx;
    float acc = 0.f;
    for (int k0 = 0; k0 < k; k0 += 16) {
        as[ty * 16 + tx] = a[row * k + k0 + tx];
        bs[ty * 16 + tx] = b[(k0 + ty) * n + col];
        fa_sync();
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) acc += as[ty * 16 + kk] * bs[kk * 16 + tx];
        fa_sync();
    }
    c[row * n + col] = acc;
}
// Warp-level tensor-core instruction loops (results kept live through out).
extern "C" __global__ void mma_loop(float* out, int iters) {
    unsigned a[4], b[2];
    for (int i = 0; i < 4; ++i) a[i] = 0x3c003c00u;  // fp16 (1, 1)
    for (int i = 0; i < 2; ++i) b[i] = 0x2c002c00u;  // fp16 (1/16, 1/16)
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < iters; ++i) fa_mma_m16n8k16<__half>(d, a, b);
    out[threadIdx.x] = d[0] + d[1] + d[2] + d[3];
}
extern "C" __global__ void ldmatrix_loop(float* out, int iters) {
    unsigned short* s = reinterpret_cast<unsigned short*>(fa_smem());
    for (int i = threadIdx.x; i < 4 * 32 * 8; i += blockDim.x) s[i] = (unsigned short)i;
    fa_sync();
    const unsigned short* row = s + (threadIdx.x >> 5) * 256 + (threadIdx.x & 31) * 8;
    unsigned acc = 0;
    for (int i = 0; i < iters; ++i) {
        unsigned r[4];
        fa_ldmatrix_x4(r, row);
        acc += r[0] ^ r[1] ^ r[2] ^ r[3];
    }
    out[threadIdx.x] = float(acc);
}
// C[M,N] = A[M,K] B[K,N] (fp16 in, fp32 out, row-major), 64x64 tiles per block of
// 4 warps (16 rows each), K in steps of 32 double-buffered through cp.async.
#define HA_LD 40  // 32 + 8 halves
#define HB_LD 72  // 64 + 8 halves
extern "C" __global__ void hgemm(const __half* a, const __half* b, float* c, int m, int n, int k) {
    __half* as = reinterpret_cast<__half*>(fa_smem());  // [2][64][HA_LD]
    __half* bs = as + 2 * 64 * HA_LD;                    // [2][32][HB_LD]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int row0 = blockIdx.y * 64, col0 = blockIdx.x * 64;
    auto load = [&](int st, int k0) {
        for (int ch = tid; ch < 256; ch += 128) {
            const int r = ch >> 2, c8 = (ch & 3) * 8;
            fa_cp_async_16(as + (st * 64 + r) * HA_LD + c8, a + (row0 + r) * k + k0 + c8, true);
        }
        for (int ch = tid; ch < 256; ch += 128) {
            const int r = ch >> 3, c8 = (ch & 7) * 8;
            fa_cp_async_16(bs + (st * 32 + r) * HB_LD + c8, b + (k0 + r) * n + col0 + c8, true);
        }
        fa_cp_async_commit();
    };
    float acc[8][4] = {};
    load(0, 0);
    for (int kt = 0; kt < k / 32; ++kt) {
        const int st = kt & 1;
        if (kt + 1 < k / 32) {
            load(st ^ 1, (kt + 1) * 32);
            fa_cp_async_wait<1>();
        } else {
            fa_cp_async_wait<0>();
        }
        fa_sync();
        const int mi = lane >> 3, ri = lane & 7;
        for (int kk = 0; kk < 32; kk += 16) {
            unsigned af[4];
            fa_ldmatrix_x4(af, as + (st * 64 + warp * 16 + ri + 8 * (mi & 1)) * HA_LD + kk + 8 * (mi >> 1));
            for (int n0 = 0; n0 < 64; n0 += 16) {
                unsigned bf[4];
                fa_ldmatrix_x4_trans(bf, bs + (st * 32 + kk + ri + 8 * (mi & 1)) * HB_LD + n0 + 8 * (mi >> 1));
                const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
                fa_mma_m16n8k16<__half>(acc[n0 / 8], af, b0);
                fa_mma_m16n8k16<__half>(acc[n0 / 8 + 1], af, b1);
            }
        }
        fa_sync();  // everyone is done with stage st before it is refilled
    }
    const int g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 4; ++i)
            c[(row0 + warp * 16 + g + 8 * (i >> 1)) * n + col0 + j * 8 + 2 * t + (i & 1)] = acc[j][i];
}
"""
SIGS = [
    KernelSig("barrier_loop", (("float*", "out"), ("int", "iters"))),
    KernelSig("shuffle_loop", (("float*", "out"), ("int", "iters"))),
    KernelSig("sgemm", (("const float*", "a"), ("const float*", "b"), ("float*", "c"), ("int", "m"), ("int", "n"),
                        ("int", "k"))),
    KernelSig("mma_loop", (("float*", "out"), ("int", "iters"))),
    KernelSig("ldmatrix_loop", (("float*", "out"), ("int", "iters"))),
    KernelSig("hgemm", (("const __half*", "a"), ("const __half*", "b"), ("float*", "c"), ("int", "m"), ("int", "n"),
                        ("int", "k"))),
]


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _fagen_kernels(results: dict) -> None:
    try:
        import torch

        from fagen.functional import attention_backward, attention_forward
    except Exception as exc:  # noqa: BLE001 - fagen's front end is optional here
        results["fagen"] = f"skipped ({type(exc).__name__}: {exc})"
        return
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2, 64, dtype=torch.float16) for _ in range(3))
    o, lse = attention_forward(q, k, v, causal=True)  # builds (or loads) the module
    results["fagen_fwd_s"] = _best(lambda: attention_forward(q, k, v, causal=True))
    do = torch.randn_like(q)
    attention_backward(do, q, k, v, o, lse, causal=True)
    results["fagen_bwd_s"] = _best(lambda: attention_backward(do, q, k, v, o, lse, causal=True))


def _fagen_racecheck(results: dict) -> None:
    """Forward + backward of each family (d=64 fp16 causal, B=1 H=2 N=256): plain, then racecheck."""
    try:
        import torch

        from fagen import KernelSpec
        from fagen.functional import attention_backward, attention_forward
        from fagen.runtime.cpu import racecheck
    except Exception as exc:  # noqa: BLE001 - fagen's front end is optional here
        results["racecheck_fagen"] = f"skipped ({type(exc).__name__}: {exc})"
        return
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 256, 2, 64, dtype=torch.float16) for _ in range(4))
    for impl in ("simt", "mma"):
        sf, sb = (KernelSpec(direction=d, head_dim=64, dtype="float16", causal=True, impl=impl) for d in ("fwd", "bwd"))

        def run(sf=sf, sb=sb):
            o, lse = attention_forward(q, k, v, causal=True, spec=sf)
            attention_backward(do, q, k, v, o, lse, causal=True, spec=sb)

        run()
        plain = _best(run)
        with racecheck():
            run()  # builds (or loads) the racecheck modules
            checked = _best(run)
        results[f"fagen_{impl}_fwd_bwd_s"] = plain
        results[f"racecheck_fagen_{impl}_fwd_bwd_s"] = checked
        results[f"racecheck_fagen_{impl}_slowdown"] = checked / plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--ucontext", action="store_true", help="use the portable swapcontext fiber switch")
    ap.add_argument("--no-fagen", action="store_true", help="skip the real fagen kernels")
    opts = ap.parse_args()
    flags = ["-DFAGEN_EMU_UCONTEXT"] if opts.ucontext else []
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        mod = build(SOURCE, SIGS, extra_flags=flags, cache_dir=tmp)
        results: dict = {"switch": "ucontext" if opts.ucontext else "asm", "build_s": time.perf_counter() - t}

        threads, iters = 256, 20_000 if not opts.ucontext else 2_000
        out = np.zeros(threads, np.float32)
        dt = _best(lambda: mod.launch("barrier_loop", 1, threads, 0, [out, iters]))
        results["barrier_switches_per_s"] = threads * iters / dt

        iters = 2_000 if not opts.ucontext else 200
        dt = _best(lambda: mod.launch("shuffle_loop", 1, threads, 0, [out, iters]))
        results["shuffles_per_s"] = threads * iters * 5 / dt  # lane-shuffles (one fiber switch each)

        m = n = k = 256
        a = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
        b = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
        c = np.zeros((m, n), np.float32)
        results["sgemm_s"] = _best(lambda: mod.launch("sgemm", (n // 16, m // 16, 1), 256, 2 * 256 * 4,
                                                      [a, b, c, m, n, k]))
        results["sgemm_max_err"] = float(np.abs(c - a @ b).max())

        threads, warps = 128, 4
        out = np.zeros(threads, np.float32)
        iters = 2_000 if not opts.ucontext else 200
        dt = _best(lambda: mod.launch("mma_loop", 1, threads, 0, [out, iters]))
        results["mma_per_s"] = warps * iters / dt  # warp-level mma.sync m16n8k16
        results["mma_gflops"] = warps * iters * 2 * 16 * 8 * 16 / dt / 1e9
        dt = _best(lambda: mod.launch("ldmatrix_loop", 1, threads, 4 * 32 * 8 * 2, [out, iters]))
        results["ldmatrix_x4_per_s"] = warps * iters / dt

        ah, bh = a.astype(np.float16), b.astype(np.float16)
        c[:] = 0
        results["hgemm_s"] = _best(lambda: mod.launch("hgemm", (n // 64, m // 64, 1), 128,
                                                      (2 * 64 * 40 + 2 * 32 * 72) * 2, [ah, bh, c, m, n, k]))
        ref = ah.astype(np.float64) @ bh.astype(np.float64)
        results["hgemm_max_err"] = float(np.abs(c - ref).max())
        t = time.perf_counter()
        rmod = build(SOURCE, SIGS, extra_flags=flags, cache_dir=tmp, racecheck=True)
        results["racecheck_build_s"] = time.perf_counter() - t
        dt = _best(lambda: rmod.launch("sgemm", (n // 16, m // 16, 1), 256, 2 * 256 * 4, [a, b, c, m, n, k]))
        results["racecheck_sgemm_s"] = dt
        results["racecheck_sgemm_slowdown"] = dt / results["sgemm_s"]
        dt = _best(lambda: rmod.launch("hgemm", (n // 64, m // 64, 1), 128, (2 * 64 * 40 + 2 * 32 * 72) * 2,
                                       [ah, bh, c, m, n, k]))
        results["racecheck_hgemm_s"] = dt
        results["racecheck_hgemm_slowdown"] = dt / results["hgemm_s"]
    if not opts.no_fagen:
        _fagen_kernels(results)
        _fagen_racecheck(results)
    if opts.json:
        print(json.dumps(results))
        return
    for key, value in results.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
