"""CPU emulator throughput: fiber switches per second and one heavier launch.

    python benchmarks/emulator.py [--json] [--ucontext]

* ``barrier``: 256 threads doing fa_sync() in a loop -- one fiber switch per
  thread per barrier, the emulator's unit of cost.
* ``shuffle``: 256 threads doing fa_warp_sum() in a loop (5 shuffles each).
* ``sgemm``: a 256x256x256 smem-tiled matmul (256 blocks of 256 threads,
  32 barriers per block), checked against numpy.
* ``fagen_fwd`` / ``fagen_bwd``: one launch of a real rendered kernel
  (d=64, fp16, causal, B=1 H=2 N=256) when fagen's renderer is importable.

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

SOURCE = (REPO / "templates/partials/primitives.cuh").read_text() + r"""
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
"""
SIGS = [
    KernelSig("barrier_loop", (("float*", "out"), ("int", "iters"))),
    KernelSig("shuffle_loop", (("float*", "out"), ("int", "iters"))),
    KernelSig("sgemm", (("const float*", "a"), ("const float*", "b"), ("float*", "c"), ("int", "m"), ("int", "n"),
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
    if not opts.no_fagen:
        _fagen_kernels(results)
    if opts.json:
        print(json.dumps(results))
        return
    for key, value in results.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
