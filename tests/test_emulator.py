"""CPU emulator: fibers, barriers, warp collectives, deadlock detection,
sanitizer mode and the build cache, on small CUDA kernels written inline.

Every source starts with templates/partials/primitives.cuh, as rendered
kernels do, and uses only the fa_* layer plus the shim's CUDA built-ins.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fagen.emulator import (
    EmulatorBuildError,
    EmulatorDeadlockError,
    EmulatorKernelError,
    EmulatorLaunchError,
    EmulatorMemoryError,
    KernelSig,
    build,
    clear_memo,
    run_sanitized,
)

REPO = Path(__file__).resolve().parent.parent
PRIMITIVES = (REPO / "templates/partials/primitives.cuh").read_text()
PHILOX = (REPO / "templates/partials/philox.cuh").read_text()

KERNELS = r"""
// Block sum of x (grid-stride), one atomicAdd per block.
extern "C" __global__ void __launch_bounds__(256) block_sum(const float* __restrict__ x, float* out, int n) {
    float v = 0.f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) v += x[i];
    v = fa_warp_sum(v);
    float* red = reinterpret_cast<float*>(fa_smem());
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    fa_sync();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (unsigned w = 0; w < blockDim.x / 32; ++w) s += red[w];
        fa_atomic_add(out, s);
    }
}

// Rounds of producer/consumer through one smem buffer: correct only if fa_sync orders them.
extern "C" __global__ void ring(int* out, int rounds) {
    int* s = reinterpret_cast<int*>(fa_smem());
    const int n = blockDim.x, t = threadIdx.x;
    int v = t;
    for (int r = 0; r < rounds; ++r) {
        s[t] = v * 3 + r;
        fa_sync();
        v = s[(t + 1) % n];
        fa_sync();
    }
    out[blockIdx.x * n + t] = v;
}

// Float atomics from every thread of every block, in an order-sensitive mix of magnitudes.
extern "C" __global__ void atomics(float* f, int* i, unsigned int* u, const float* vals) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(f, vals[g]);
    atomicAdd(i, 1);
    atomicAdd(u, (unsigned int)threadIdx.x);
    fa_atomic_add(f + 1, 1.0f);
}

extern "C" __global__ void convert(const float* x, __half* h, __nv_bfloat16* b, float* hf, float* bf, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    h[i] = fa_from_float<__half>(x[i]);
    b[i] = fa_from_float<__nv_bfloat16>(x[i]);
    hf[i] = fa_to_float(h[i]);
    bf[i] = fa_to_float(b[i]);
}

// Shuffles, votes and multi-dimensional indices: one row of 10 ints per thread.
extern "C" __global__ void collectives(int* out) {
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned full = 0xffffffffu;
    int* o = out + (blockIdx.x * blockDim.x * blockDim.y * blockDim.z + t) * 10;
    o[0] = (int)__shfl_xor_sync(full, (float)t, 5);
    o[1] = __shfl_down_sync(full, (int)t, 3);
    o[2] = __shfl_up_sync(full, (int)t, 2, 16);
    o[3] = __shfl_sync(full, (int)t, 7, 8);
    o[4] = (int)__ballot_sync(full, t % 3 == 0);
    o[5] = __any_sync(full, t == 40);
    o[6] = __all_sync(full, t < 60);
    o[7] = __shfl_xor_sync(full, (int)t, 16, 16);
    __syncwarp();
    o[8] = (int)fa_warp_max((float)(t ^ 7));
    o[9] = (int)(threadIdx.y * 100 + threadIdx.z * 1000 + blockIdx.x * 10000);
}

__device__ float fa_test_table(int i) {
    __shared__ float table[64];  // static __shared__: one copy, blocks run one at a time
    if (threadIdx.x < 64) table[threadIdx.x] = 2.f * threadIdx.x;
    fa_sync();
    return table[i];
}
extern "C" __global__ void static_shared(float* out) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = fa_test_table(63 - threadIdx.x);
}

extern "C" __global__ void spin(float* out, int iters) {
    for (int i = 0; i < iters; ++i) fa_sync();
    out[threadIdx.x] = 1.f;
}

extern "C" __global__ void early_exit(float* out) {
    if (blockIdx.x == 1 && threadIdx.x < 5) fa_sync();  // LINE:early_exit
    out[0] = 0.f;
}

extern "C" __global__ void two_barriers(float* out) {
    if (threadIdx.x & 1) {
        fa_sync();  // LINE:odd
    } else {
        fa_sync();  // LINE:even
    }
    out[0] = 0.f;
}

extern "C" __global__ void half_warp(float* out) {
    float v = threadIdx.x;
    if ((threadIdx.x & 31) < 16) v = fa_warp_sum(v);  // LINE:half_warp
    out[threadIdx.x] = v;
}

extern "C" __global__ void trap_at(int* out, int bad) {
    if (blockIdx.x == 2 && threadIdx.x == bad) __trap();
    out[0] = 1;
}

extern "C" __global__ void philox(const unsigned int* in, unsigned int* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned int* c = in + 6 * i;
    const FaU32x4 r = fa_philox4x32_10(FaU32x4{c[0], c[1], c[2], c[3]}, c[4], c[5]);
    out[4 * i + 0] = r.x;
    out[4 * i + 1] = r.y;
    out[4 * i + 2] = r.z;
    out[4 * i + 3] = r.w;
}
"""
SOURCE = PRIMITIVES + "\n" + PHILOX + "\n" + KERNELS

P = "float*"
SIGS = [
    KernelSig("block_sum", (("const float*", "x"), ("float*", "out"), ("int", "n"))),
    KernelSig("ring", (("int*", "out"), ("int", "rounds"))),
    KernelSig("atomics", (("float*", "f"), ("int*", "i"), ("unsigned int*", "u"), ("const float*", "vals"))),
    KernelSig("convert", (("const float*", "x"), ("__half*", "h"), ("__nv_bfloat16*", "b"), (P, "hf"), (P, "bf"),
                          ("int", "n"))),
    KernelSig("collectives", (("int*", "out"),)),
    KernelSig("static_shared", ((P, "out"),)),
    KernelSig("spin", ((P, "out"), ("int", "iters"))),
    KernelSig("early_exit", ((P, "out"),)),
    KernelSig("two_barriers", ((P, "out"),)),
    KernelSig("half_warp", ((P, "out"),)),
    KernelSig("trap_at", (("int*", "out"), ("int", "bad"))),
    KernelSig("philox", (("const unsigned int*", "in"), ("unsigned int*", "out"), ("int", "n"))),
]


def line_of(tag: str, source: str = SOURCE) -> int:
    """1-based line of the source carrying ``// LINE:<tag>``."""
    for i, text in enumerate(source.splitlines(), 1):
        if text.rstrip().endswith(f"// LINE:{tag}"):
            return i
    raise AssertionError(tag)


@pytest.fixture(scope="module")
def mod():
    return build(SOURCE, SIGS)  # default cache: $FAGEN_CACHE_DIR/emu (conftest points it at a temp dir)


def test_block_sum(mod) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_000).astype(np.float32)
    out = np.zeros(1, np.float32)
    mod.launch("block_sum", (5, 1, 1), (256, 1, 1), 8 * 4, [x.ctypes.data, out.ctypes.data, x.size])
    assert out[0] == _block_sum_model(x, 5, 256)  # the float32 arithmetic in the emulator's order, bit for bit
    assert out[0] == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-5)  # the model is a sum


def test_sync_orders_producer_consumer(mod) -> None:
    n, rounds, blocks = 96, 7, 3
    out = np.zeros(blocks * n, np.int32)
    mod.launch("ring", blocks, n, n * 4, {"out": out, "rounds": rounds})
    expect = np.arange(n)
    for r in range(rounds):
        expect = np.roll(expect * 3 + r, -1)
    np.testing.assert_array_equal(out.reshape(blocks, n), np.broadcast_to(expect, (blocks, n)))


def test_atomics_from_many_blocks(mod) -> None:
    blocks, threads = 40, 128
    vals = np.random.default_rng(1).standard_normal(blocks * threads).astype(np.float32) * 1e3
    f, i, u = np.zeros(2, np.float32), np.zeros(1, np.int32), np.zeros(1, np.uint32)
    mod.launch("atomics", blocks, threads, 0, [f, i, u, vals])
    assert f[1] == blocks * threads
    assert i[0] == blocks * threads
    assert u[0] == blocks * (threads * (threads - 1) // 2)
    # Blocks in order, threads in order: exactly numpy's sequential float32 sum.
    assert f[0] == np.cumsum(vals, dtype=np.float32)[-1]


def _bf16_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even, by bit arithmetic) -> float32."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def test_half_bf16_round_trip(mod) -> None:
    rng = np.random.default_rng(2)
    x = np.concatenate([
        rng.standard_normal(3000).astype(np.float32) * 10.0 ** rng.integers(-6, 5, 3000),
        np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e-8, 6e-5, 3.0e38, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11],
                 dtype=np.float32),
    ]).astype(np.float32)
    n = x.size
    h, b = np.zeros(n, np.float16), np.zeros(n, np.uint16)
    hf, bf = np.zeros(n, np.float32), np.zeros(n, np.float32)
    mod.launch("convert", (n + 127) // 128, 128, 0, [x, h, b, hf, bf, n])
    with np.errstate(over="ignore"):  # 3e38 -> inf, as on the device
        h_ref = x.astype(np.float16)
    np.testing.assert_array_equal(h, h_ref)
    np.testing.assert_array_equal(hf, h_ref.astype(np.float32))
    np.testing.assert_array_equal(bf, _bf16_rne(x))
    np.testing.assert_array_equal(b.astype(np.uint32) << 16, _bf16_rne(x).view(np.uint32))


def _cuda_shfl_model(values: np.ndarray, op: str, arg: int, width: int = 32) -> np.ndarray:
    """CUDA programming guide semantics, per warp of 32 lanes."""
    out = values.copy()
    for t in range(values.size):
        lane, base = t % 32, t - t % 32
        if op == "xor":
            src = lane ^ arg
            src = lane if src >= (lane // width + 1) * width else src
        elif op == "down":
            src = lane + arg if lane % width + arg < width else lane
        elif op == "up":
            src = lane - arg if lane % width >= arg else lane
        else:
            src = (lane // width) * width + arg % width
        out[t] = values[base + src]
    return out


def test_warp_collectives_and_indices(mod) -> None:
    block, blocks = (16, 2, 2), 2  # 64 threads: two warps spanning y and z
    n = 64
    out = np.zeros((blocks, n, 10), np.int32)
    mod.launch("collectives", blocks, block, 0, [out])
    t = np.arange(n)
    for o in out:
        np.testing.assert_array_equal(o[:, 0], _cuda_shfl_model(t, "xor", 5))
        np.testing.assert_array_equal(o[:, 1], _cuda_shfl_model(t, "down", 3))
        np.testing.assert_array_equal(o[:, 2], _cuda_shfl_model(t, "up", 2, 16))
        np.testing.assert_array_equal(o[:, 3], _cuda_shfl_model(t, "idx", 7, 8))
        np.testing.assert_array_equal(o[:, 7], _cuda_shfl_model(t, "xor", 16, 16))
        for w in range(2):
            lanes = slice(32 * w, 32 * w + 32)
            ballot = sum(1 << (x - 32 * w) for x in range(32 * w, 32 * w + 32) if x % 3 == 0)
            assert (o[lanes, 4].view(np.uint32) == ballot).all()
            assert (o[lanes, 5] == int(w == 1)).all()
            assert (o[lanes, 6] == int(w == 0)).all()
            assert (o[lanes, 8] == (t[lanes] ^ 7).max()).all()
    ty, tz = (t // 16) % 2, t // 32
    for bx in range(blocks):
        np.testing.assert_array_equal(out[bx, :, 9], ty * 100 + tz * 1000 + bx * 10000)


def test_static_shared(mod) -> None:
    out = np.zeros(2 * 64, np.float32)
    mod.launch("static_shared", 2, 64, 0, [out])
    np.testing.assert_array_equal(out, np.tile(2.0 * (63 - np.arange(64)), 2))


def _block_sum_model(x: np.ndarray, blocks: int, threads: int) -> np.float32:
    """block_sum's float32 arithmetic in the emulator's fixed order (blocks, then threads, in
    index order): each thread's grid-stride sum, the xor-butterfly warp sum, warp partials summed
    in order by thread 0, one atomic add per block onto 0."""
    one = np.float32
    stride = blocks * threads
    out = one(0)
    for b in range(blocks):
        v = np.zeros(threads, np.float32)
        for t in range(threads):
            for i in range(b * threads + t, x.size, stride):
                v[t] = one(v[t] + x[i])
        w = v.reshape(threads // 32, 32)
        for off in (16, 8, 4, 2, 1):
            w = (w + w[:, np.arange(32) ^ off]).astype(np.float32)
        s = one(0)
        for part in w[:, 0]:
            s = one(s + part)
        out = one(out + s)
    return out


def test_deterministic(mod) -> None:
    """Same launch, same bits: the bits of an independent numpy model of the emulator's fixed order."""
    vals = np.random.default_rng(3).standard_normal(64 * 256).astype(np.float32)
    expect_f = np.cumsum(vals, dtype=np.float32)[-1]  # blocks in order, threads in order
    expect_s = _block_sum_model(vals, 7, 96)
    assert expect_s != expect_f  # another order, other last bits: the comparison below is exact
    for _ in range(2):
        f, i, u = np.zeros(2, np.float32), np.zeros(1, np.int32), np.zeros(1, np.uint32)
        mod.launch("atomics", 64, 256, 0, [f, i, u, vals])
        s = np.zeros(1, np.float32)
        mod.launch("block_sum", 7, 96, 3 * 4, [vals, s, vals.size])
        assert f[0] == expect_f and f[1] == 64 * 256 and i[0] == 64 * 256
        assert s[0] == expect_s, (s[0], expect_s)


def test_deadlock_early_exit(mod) -> None:
    out = np.zeros(1, np.float32)
    with pytest.raises(EmulatorDeadlockError) as info:
        mod.launch("early_exit", (3, 1, 1), (128, 1, 1), 0, [out])
    msg = str(info.value)
    assert "early_exit" in msg and "block (1,0,0)" in msg and "__syncthreads" in msg
    assert f".cu:{line_of('early_exit')}" in msg
    assert "5 of 128" in msg and "threads 5-127" in msg
    assert info.value.kernel == "early_exit" and info.value.block == (1, 0, 0)


def test_divergent_barriers(mod) -> None:
    with pytest.raises(EmulatorDeadlockError, match="divergent __syncthreads") as info:
        mod.launch("two_barriers", 1, 64, 0, [np.zeros(1, np.float32)])
    msg = str(info.value)
    assert f".cu:{line_of('odd')}" in msg and f".cu:{line_of('even')}" in msg


def test_partial_warp_collective(mod) -> None:
    with pytest.raises(EmulatorDeadlockError) as info:
        mod.launch("half_warp", 1, 64, 0, [np.zeros(64, np.float32)])
    msg = str(info.value)
    assert "__shfl_xor_sync" in msg and f".cu:{line_of('half_warp')}" in msg
    assert "warp 0: lanes 0-15" in msg and "lanes 16-31 never arrive" in msg


def test_trap_is_reported(mod) -> None:
    with pytest.raises(EmulatorKernelError, match=r"block \(2,0,0\).*thread \(7,0,0\).*__trap") as info:
        mod.launch("trap_at", 4, 32, 0, [np.zeros(1, np.int32), 7])
    assert info.value.block == (2, 0, 0)
    # The module is still usable afterwards (abandoned fibers are discarded).
    out = np.zeros(1, np.int32)
    mod.launch("trap_at", 4, 32, 0, [out, 99])
    assert out[0] == 1


def test_bad_launches(mod) -> None:
    out = np.zeros(1, np.float32)
    with pytest.raises(EmulatorLaunchError, match="takes 2 arguments"):
        mod.launch("spin", 1, 32, 0, [out])
    with pytest.raises(EmulatorLaunchError, match="invalid block"):
        mod.launch("spin", 1, 2048, 0, [out, 1])
    with pytest.raises(EmulatorLaunchError, match="does not fit"):
        mod.launch("trap_at", 1, 32, 0, [out, 2**40])
    with pytest.raises(EmulatorLaunchError, match="no kernel"):
        mod.launch("nope", 1, 32, 0, [])


def test_many_barriers(mod) -> None:
    out = np.zeros(256, np.float32)
    mod.launch("spin", 1, 256, 0, [out, 2000])  # 512k fiber switches (benchmarks/emulator.py times them)
    assert (out == 1).all()


def _philox_ref(counter: tuple[int, ...], key: tuple[int, int]) -> list[int]:
    """Philox4x32-10 (Salmon et al., SC'11), plain Python."""
    mask = 0xFFFFFFFF
    c, (k0, k1) = list(counter), key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & mask, (p0 >> 32) ^ c[3] ^ k1, p0 & mask]
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c


def test_philox_known_answers(mod) -> None:
    ones = 0xFFFFFFFF
    cases = [((0, 0, 0, 0), (0, 0)), ((ones,) * 4, (ones, ones))]
    rng = np.random.default_rng(4)
    cases += [(tuple(int(v) for v in rng.integers(0, 2**32, 4)), tuple(int(v) for v in rng.integers(0, 2**32, 2)))
              for _ in range(100)]
    inp = np.array([list(c) + list(k) for c, k in cases], np.uint32)
    out = np.zeros((len(cases), 4), np.uint32)
    mod.launch("philox", (len(cases) + 63) // 64, 64, 0, [inp, out, len(cases)])
    assert [hex(v) for v in out[0]] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]
    assert [hex(v) for v in out[1]] == ["0x408f276d", "0x41c83b0e", "0xa20bc7c6", "0x6d5451fd"]
    assert _philox_ref(*cases[0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    for (c, k), got in zip(cases, out):
        assert list(got) == _philox_ref(c, k)


def test_ucontext_fallback(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The portable context switch (used off x86-64) runs the same kernels."""
    m = build(SOURCE, SIGS, extra_flags=["-DFAGEN_EMU_UCONTEXT"], cache_dir=tmp_path_factory.getbasetemp() / "emu-uc")
    n, rounds = 64, 5
    out = np.zeros(2 * n, np.int32)
    m.launch("ring", 2, n, n * 4, [out, rounds])
    expect = np.arange(n)
    for r in range(rounds):
        expect = np.roll(expect * 3 + r, -1)
    np.testing.assert_array_equal(out, np.tile(expect, 2))
    with pytest.raises(EmulatorDeadlockError):
        m.launch("half_warp", 1, 64, 0, [np.zeros(64, np.float32)])


# ------------------------------------------------------------ sanitizer
OOB_SOURCE = PRIMITIVES + r"""
extern "C" __global__ void scale(const float* x, float* y, int n, float a) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];  // LINE:oob
}
extern "C" __global__ void smem_copy(float* y, int n_smem) {
    float* s = reinterpret_cast<float*>(fa_smem());
    if ((int)threadIdx.x < n_smem) s[threadIdx.x] = threadIdx.x;
    fa_sync();
    y[threadIdx.x] = fa_warp_sum(s[threadIdx.x % 16]);
}
"""
OOB_SIGS = [
    KernelSig("scale", (("const float*", "x"), ("float*", "y"), ("int", "n"), ("float", "a"))),
    KernelSig("smem_copy", (("float*", "y"), ("int", "n_smem"))),
]


def test_sanitized_in_bounds_and_out_of_bounds(tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = tmp_path_factory.getbasetemp() / "emu-asan"
    x = np.arange(100, dtype=np.float32)
    y = np.zeros(100, np.float32)
    out = run_sanitized(OOB_SOURCE, OOB_SIGS, "scale", 2, 64, 0, [x, y, 100, 2.0], cache_dir=cache)
    np.testing.assert_array_equal(y, 2 * x)
    np.testing.assert_array_equal(out["y"], 2 * x)
    with pytest.raises(EmulatorMemoryError, match="heap-buffer-overflow") as info:
        run_sanitized(OOB_SOURCE, OOB_SIGS, "scale", 2, 64, 0, [x, y, 101, 2.0], cache_dir=cache)
    assert f".cu:{line_of('oob', OOB_SOURCE)}" in info.value.report
    assert "READ of size 4" in info.value.report
    assert "to the right of argument 'x' (400 bytes)" in str(info.value)  # x[100] is read before y[100] is written
    # Dynamic shared memory is its own exact-size allocation too.
    y32 = np.zeros(32, np.float32)
    run_sanitized(OOB_SOURCE, OOB_SIGS, "smem_copy", 1, 32, 32 * 4, [y32, 32], cache_dir=cache)
    assert y32[0] == sum(range(16)) * 2
    with pytest.raises(EmulatorMemoryError):
        run_sanitized(OOB_SOURCE, OOB_SIGS, "smem_copy", 1, 32, 31 * 4, [y32, 32], cache_dir=cache)


def test_sanitized_module_refuses_in_process_launch(tmp_path_factory: pytest.TempPathFactory) -> None:
    m = build(OOB_SOURCE, OOB_SIGS, sanitize=True, cache_dir=tmp_path_factory.getbasetemp() / "emu-asan")
    with pytest.raises(RuntimeError, match="run_sanitized"):
        m.launch("scale", 1, 32, 0, [0, 0, 0, 1.0])


# ---------------------------------------------------------------- cache
CACHE_SOURCE = PRIMITIVES + r"""
extern "C" __global__ void fill(float* y, float v) { y[threadIdx.x] = v; }
"""
CACHE_SIGS = [KernelSig("fill", (("float*", "y"), ("float", "v")))]


def test_cache_memo_disk_and_corruption(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fagen.emulator.builder as emu_build

    compiles = []
    real = emu_build.compile_unit
    monkeypatch.setattr(emu_build, "compile_unit", lambda *a: (compiles.append(1), real(*a)))
    m1 = build(CACHE_SOURCE, CACHE_SIGS, cache_dir=tmp_path)
    assert build(CACHE_SOURCE, CACHE_SIGS, cache_dir=tmp_path) is m1  # memo
    clear_memo()
    m2 = build(CACHE_SOURCE, CACHE_SIGS, cache_dir=tmp_path)  # disk hit
    assert m2 is not m1 and len(compiles) == 1
    so = m2.path
    assert so.with_suffix(".cu").read_text() == CACHE_SOURCE
    data = so.read_bytes()
    so.unlink()  # (m1 has it mapped: truncating that inode in place would SIGBUS this process)
    so.write_bytes(data[: len(data) // 2])  # a torn write
    clear_memo()
    m3 = build(CACHE_SOURCE, CACHE_SIGS, cache_dir=tmp_path)
    assert len(compiles) == 2 and so.read_bytes() == data
    y = np.zeros(32, np.float32)
    m3.launch("fill", 1, 32, 0, [y, 1.5])
    assert (y == 1.5).all()


def test_without_a_runtime_object_the_header_defines_the_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where g++ cannot compile the prelude on its own, the precompiled header defines the runtime
    itself and the module links nothing more: it builds and runs the same."""
    import fagen.emulator.builder as emu_build

    monkeypatch.setattr(emu_build, "runtime_object", lambda *a: False)  # g++ rejects the prelude as a unit
    m = build(CACHE_SOURCE.replace("void fill(", "void fill5("), [KernelSig("fill5", CACHE_SIGS[0].params)],
              cache_dir=tmp_path)
    (header,) = tmp_path.glob("prelude-*.h")
    assert "-split" not in header.name and not header.read_text().startswith(emu_build.RUNTIME_DECLS_ONLY)
    assert not list(tmp_path.glob("runtime-*.o"))
    y = np.zeros(32, np.float32)
    m.launch("fill5", 1, 32, 0, [y, 2.5])
    assert (y == 2.5).all()


def test_the_prelude_is_precompiled_once_and_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime, shim and CUDA headers every unit starts with are one header with its precompiled
    header in the cache dir, made once per flag set and taken by every later build (g++ -H names the
    .gch it reads); without a usable .gch the unit still builds the same kernels."""
    import subprocess

    import fagen.emulator.builder as emu_build

    other = CACHE_SOURCE.replace("void fill(", "void fill2(").replace("= v;", "= 2 * v;")
    pch_builds, commands = [], []
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: (pch_builds.append(cmd) if "c++-header" in cmd else None,
                                                            commands.append([str(c) for c in cmd]),
                                                            real(cmd, **kw))[-1])
    m1 = build(CACHE_SOURCE, CACHE_SIGS, cache_dir=tmp_path)
    m2 = build(other, [KernelSig("fill2", CACHE_SIGS[0].params)], cache_dir=tmp_path)
    assert len(pch_builds) == 1  # one prelude, one flag set: one precompiled header
    (header,) = tmp_path.glob("prelude-*.h")
    assert header.with_name(header.name + ".gch").stat().st_size > 0
    for m in (m1, m2):
        assert m.path.with_suffix(".cpp").read_text().startswith(f'#include "{header.name}"')
    # ... and one runtime object: the header only declares what it defines, every module links it
    (obj,) = tmp_path.glob("runtime-*.o")
    assert header.read_text().startswith(emu_build.RUNTIME_DECLS_ONLY)
    assert sum(obj.with_suffix(".cpp").name in cmd for cmd in commands) == 1
    for m in (m1, m2):
        (link,) = [cmd for cmd in commands if f"{m.path.stem}.cpp" in cmd]
        assert obj.name in link, link
    defined = real(["nm", "--defined-only", str(obj)], capture_output=True, text=True).stdout
    assert "fagen_emu_map_stacks" in defined and "fagen_emu_state" in defined, defined[:400]
    cpp = m2.path.with_suffix(".cpp")
    flags = emu_build.compile_flags(sanitize=False, debug=False) + ["-I", emu_build.cuda_include_dir()]
    used = real([emu_build.compiler()[0], *flags, "-H", "-fsyntax-only", cpp.name], cwd=tmp_path,
                capture_output=True, text=True)
    assert f"! {header.name}.gch" in used.stderr.replace("./", ""), used.stderr[:500]
    build(CACHE_SOURCE, CACHE_SIGS, sanitize=True, cache_dir=tmp_path)  # another flag set: its own
    assert len(pch_builds) == 2 and len(list(tmp_path.glob("prelude-*.h.gch"))) == 2
    # an unusable .gch (here: garbage) is ignored by g++, which parses the header instead
    for gch in tmp_path.glob("prelude-*.h.gch"):
        gch.write_bytes(b"not a precompiled header")
    third = CACHE_SOURCE.replace("void fill(", "void fill3(").replace("= v;", "= 3 * v;")
    m3 = build(third, [KernelSig("fill3", CACHE_SIGS[0].params)], cache_dir=tmp_path)
    y = np.zeros(32, np.float32)
    for m, name, want in ((m1, "fill", 1.5), (m2, "fill2", 3.0), (m3, "fill3", 4.5)):
        m.launch(name, 1, 32, 0, [y, 1.5])
        assert (y == want).all(), name
    # a prelude that does not precompile: the prelude is pasted into the unit
    monkeypatch.setattr(emu_build, "prelude_header", lambda *a, **k: None)
    fourth = CACHE_SOURCE.replace("void fill(", "void fill4(")
    m4 = build(fourth, [KernelSig("fill4", CACHE_SIGS[0].params)], cache_dir=tmp_path)
    assert "fagen CPU emulator runtime" in m4.path.with_suffix(".cpp").read_text()[:400]
    m4.launch("fill4", 1, 32, 0, [y, 1.5])
    assert (y == 1.5).all()


def test_compile_error_carries_log(tmp_path: Path) -> None:
    src = PRIMITIVES + '\nextern "C" __global__ void broken(float* y) { y[0] = undefined_name; }\n'
    with pytest.raises(EmulatorBuildError) as info:
        build(src, [KernelSig("broken", (("float*", "y"),))], cache_dir=tmp_path)
    assert "undefined_name" in info.value.log
    assert f".cu:{len(src.splitlines())}" in info.value.log


# ---------------------------------------------------------------- a fresh build: temps, modes, shared stacks
@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory: pytest.TempPathFactory):
    """One build into an empty cache dir, under umask 002, with temps of a killed build and a running one
    already there. Yields (module, cache dir, {temp: expected to survive})."""
    import os
    import subprocess
    import sys

    from fagen import cache

    root = tmp_path_factory.mktemp("emu-fresh")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    temps = {cache.temp_path(root / "0123456789abcdef01234567.so", pid=gone.pid): False,  # killed: removed
             cache.temp_path(root / "0123456789abcdef01234567.so"): True}  # this process, alive: kept
    for t in temps:
        t.write_bytes(b"\x7fELF half a module")
    old = os.umask(0o002)
    try:
        module = build(CACHE_SOURCE, CACHE_SIGS, cache_dir=root)
    finally:
        os.umask(old)
    yield module, root, temps


def test_build_removes_stale_temps(fresh_build) -> None:
    _, _, temps = fresh_build
    assert {t.name: t.exists() for t in temps} == {t.name: alive for t, alive in temps.items()}


def test_build_files_follow_the_umask(fresh_build) -> None:
    import stat

    module, root, _ = fresh_build
    modes = {p.name.split(".", 1)[1]: stat.S_IMODE(p.stat().st_mode) for p in root.iterdir()
             if p.name.startswith(module.path.stem)}
    assert modes.pop("so.lock", 0o664) == 0o664  # (filelock may remove it after use)
    assert modes == {"so": 0o775, "so.sha256": 0o664, "cu": 0o664, "cpp": 0o664}


def test_loaded_modules_share_fiber_stacks(fresh_build, tmp_path: Path) -> None:
    """Modules stay loaded for the life of the process; their fiber stacks (2 mappings per thread) must not
    be per module, or a process using a few hundred specs runs out of vm.max_map_count."""
    import shutil

    from fagen.emulator import EmuModule

    module, _, _ = fresh_build
    n, threads = 40, 128

    def maps() -> int:
        return len(Path("/proc/self/maps").read_text().splitlines())

    copies = []
    for i in range(n):  # distinct files: each dlopen is its own module with its own runtime state
        so = tmp_path / f"m{i}.so"
        shutil.copyfile(module.path, so)
        copies.append(so)
    y = np.zeros(threads, np.float32)
    module.launch("fill", 1, threads, 0, [y, 0.5])  # the pool's arena exists before counting
    before = maps()
    for i, so in enumerate(copies):
        m = EmuModule(so, CACHE_SIGS, sanitized=False)
        m.launch("fill", 1, threads, 0, [y, float(i)])
        assert (y == i).all()
    growth = maps() - before
    # Each loaded .so adds its own segments (about 5); stacks of its own would add 2 * 128 more.
    assert growth < n * 16, growth


def test_concurrent_launches_get_their_own_stacks(fresh_build, tmp_path: Path) -> None:
    """Launches running at the same time (other modules, other threads) never share an arena."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from fagen.emulator import EmuModule

    module, _, _ = fresh_build
    mods = [module]
    for i in range(3):
        shutil.copyfile(module.path, tmp_path / f"c{i}.so")
        mods.append(EmuModule(tmp_path / f"c{i}.so", CACHE_SIGS, sanitized=False))

    def work(job: int) -> bool:
        m = mods[job % len(mods)]  # two threads per module, four modules
        ok = True
        for r in range(20):
            threads = 32 * (1 + (job + r) % 8)  # block sizes vary: arenas are regrown
            y = np.zeros(threads, np.float32)
            m.launch("fill", 1, threads, 0, [y, float(job * 100 + r)])
            ok &= bool((y == job * 100 + r).all())
        return ok

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(8)))


def test_plain_builds_take_the_optimisation_level_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAGEN_EMU_OPT sets the plain build's g++ level (default O2); the sanitizer and race-check builds
    take it too, at most O1; the debug build keeps O0 -g; any other value is refused naming the variable."""
    import fagen.emulator.builder as emu_build
    import fagen.settings

    def flags(**kw: bool) -> list[str]:
        fagen.settings.reset()
        return emu_build.compile_flags(sanitize=kw.get("sanitize", False), debug=kw.get("debug", False),
                                       racecheck=kw.get("racecheck", False))

    try:
        monkeypatch.delenv("FAGEN_EMU_OPT", raising=False)
        assert "-O2" in flags()
        assert "-O1" in flags(sanitize=True) and "-O1" in flags(racecheck=True)
        levels = {"-O0", "-Og", "-O1", "-O2", "-O3"}
        for level, instrumented in (("O0", "O0"), ("Og", "Og"), ("O1", "O1"), ("O3", "O1")):
            monkeypatch.setenv("FAGEN_EMU_OPT", level)
            plain = flags()
            assert f"-{level}" in plain and not levels - {f"-{level}"} & set(plain)
            for kind in ("sanitize", "racecheck"):
                built = flags(**{kind: True})
                assert f"-{instrumented}" in built and not levels - {f"-{instrumented}"} & set(built), (level, kind)
            assert "-O0" in flags(debug=True) and not levels - {"-O0"} & set(flags(debug=True))
        monkeypatch.setenv("FAGEN_EMU_OPT", "fast")
        with pytest.raises(ValueError, match="FAGEN_EMU_OPT: expected one of"):
            flags()
    finally:
        monkeypatch.undo()
        fagen.settings.reset()


def test_cuda_headers_without_crt_are_named_before_g_plus_plus_runs(tmp_path: Path) -> None:
    """CUDA 13's wheels ship crt/ (which cuda_fp16.h reaches through vector_types.h) apart from the runtime
    headers: a folder without it is an EmulatorBuildError naming the file and the wheel, not a g++ log."""
    from fagen import settings
    from fagen.emulator import toolchain
    from fagen.emulator.errors import EmulatorBuildError

    for name in ("cuda_fp16.h", "cuda_bf16.h"):
        (tmp_path / name).write_text("// stand-in\n")
    settings.configure(cuda_include=tmp_path)
    toolchain.cuda_include_dir.cache_clear()
    try:
        with pytest.raises(EmulatorBuildError, match=r"lack crt/host_defines\.h.*nvidia-cuda-crt"):
            toolchain.cuda_include_dir()
        (tmp_path / "crt").mkdir()
        (tmp_path / "crt" / "host_defines.h").write_text("// stand-in\n")
        toolchain.cuda_include_dir.cache_clear()
        assert toolchain.cuda_include_dir() == str(tmp_path)
        (tmp_path / "cuda_bf16.h").unlink()
        toolchain.cuda_include_dir.cache_clear()
        with pytest.raises(EmulatorBuildError, match=r"lack cuda_bf16\.h.*FAGEN_CUDA_INCLUDE"):
            toolchain.cuda_include_dir()
    finally:
        settings.reset()
        toolchain.cuda_include_dir.cache_clear()
