"""Memory counters of the PTX level (fagen/emulator/ptx/counters.h, counters.py; docs/emulator.md,
"Memory counters").

* The counters against an independent model of the documented rules, on random address patterns:
  shared-memory wavefronts of 4-, 8- and 16-byte ``ld.shared`` (one phase of 32 lanes, two of 16,
  four of 8; the max over banks of the distinct 4-byte words, a word read twice a broadcast) with
  random active masks, of ``ldmatrix`` .x1 / .x2 / .x4 and ``stmatrix`` .x4 (one phase per matrix,
  its 8 row addresses of 16 bytes), and global sectors (distinct 32-byte segments of the active lanes);
  a bulk copy (one copy per issuing lane, its bytes).
* Hand-written kernels with known answers: a conflict-free row read (1 wavefront per request), the
  32-way column read of a 32 x 32 float tile (32), the padded tile (1); a coalesced float load (4
  sectors per request) against a stride-32 float load (32).
* The tile loop (the sites inside a backward branch's range with a barrier) and the
  ``fagen.runtime.cpu.ptx(counters=True)`` record on the default SIMT forward.
"""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from fagen.emulator import KernelSig, build
from fagen.emulator.ptx import translate

_SOURCE = r"""
// shared-memory loads of 4 / 8 / 16 bytes at offs[lane] by the lanes in `mask`
extern "C" __global__ void rd4(const unsigned* offs, unsigned mask, float* out) {
    extern __shared__ __align__(16) unsigned char sm[];
    const unsigned lane = threadIdx.x;
    float acc = 0.f;
    if (mask >> lane & 1u) acc = *reinterpret_cast<const float*>(sm + offs[lane]);
    out[lane] = acc;
}
extern "C" __global__ void rd8(const unsigned* offs, unsigned mask, float* out) {
    extern __shared__ __align__(16) unsigned char sm[];
    const unsigned lane = threadIdx.x;
    float acc = 0.f;
    if (mask >> lane & 1u) { const float2 v = *reinterpret_cast<const float2*>(sm + offs[lane]); acc = v.x + v.y; }
    out[lane] = acc;
}
extern "C" __global__ void rd16(const unsigned* offs, unsigned mask, float* out) {
    extern __shared__ __align__(16) unsigned char sm[];
    const unsigned lane = threadIdx.x;
    float acc = 0.f;
    if (mask >> lane & 1u) {
        const float4 v = *reinterpret_cast<const float4*>(sm + offs[lane]);
        acc = v.x + v.y + v.z + v.w;
    }
    out[lane] = acc;
}
// ldmatrix .xN: lane l gives row address offs[l] (lanes 8p..8p+7: matrix p)
extern "C" __global__ void ldm(const unsigned* offs, int num, unsigned* out) {
    extern __shared__ __align__(16) unsigned char sm[];
    const unsigned lane = threadIdx.x;
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(sm + offs[lane]));
    unsigned r0 = 0, r1 = 0, r2 = 0, r3 = 0;
    if (num == 1) asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r0) : "r"(a));
    else if (num == 2) asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(a));
    else asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                      : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
    out[lane] = r0 ^ r1 ^ r2 ^ r3;
}
// global loads of 4 / 8 / 16 bytes at x + idx[lane] floats by the lanes in `mask`
extern "C" __global__ void gl(const float* x, const unsigned* idx, unsigned mask, int width, float* out) {
    const unsigned lane = threadIdx.x;
    float acc = 0.f;
    if (mask >> lane & 1u) {
        const float* p = x + idx[lane];
        if (width == 4) acc = *p;
        else if (width == 8) { const float2 v = *reinterpret_cast<const float2*>(p); acc = v.x + v.y; }
        else { const float4 v = *reinterpret_cast<const float4*>(p); acc = v.x + v.y + v.z + v.w; }
    }
    out[lane] = acc;
}
// a 32 x 32 float tile in shared memory (row stride 32 + pad floats), filled row by row, then
// each lane reads row `lane` (a column access: lane * stride + 3) and row 0 (a row access)
extern "C" __global__ void tile(const float* x, int pad, int stride, float* out) {
    extern __shared__ float t[];
    const int i = threadIdx.x;
    for (int r = 0; r < 32; ++r) t[r * (32 + pad) + i] = x[r * 32 + i];
    __syncthreads();
    const float col = t[i * (32 + pad) + 3];
    const float row = t[5 * (32 + pad) + i];
    const float g = x[i * stride];
    out[i] = col + row + g;
}
// a loop with a block barrier: its shared loads are in the tile loop, the final store is not
extern "C" __global__ void looped(const float* x, int n, float* out) {
    extern __shared__ float s[];
    const int i = threadIdx.x;
    float acc = 0.f;
    for (int it = 0; it < n; ++it) {
        s[i] = x[it * 32 + i];
        __syncthreads();
        acc += s[(i + it) % 32];
        __syncthreads();
    }
    out[i] = acc;
}
"""

_SIGS = [
    KernelSig("rd4", (("const unsigned*", "offs"), ("unsigned", "mask"), ("float*", "out"))),
    KernelSig("rd8", (("const unsigned*", "offs"), ("unsigned", "mask"), ("float*", "out"))),
    KernelSig("rd16", (("const unsigned*", "offs"), ("unsigned", "mask"), ("float*", "out"))),
    KernelSig("ldm", (("const unsigned*", "offs"), ("int", "num"), ("unsigned*", "out"))),
    KernelSig("gl", (("const float*", "x"), ("const unsigned*", "idx"), ("unsigned", "mask"), ("int", "width"),
                     ("float*", "out"))),
    KernelSig("tile", (("const float*", "x"), ("int", "pad"), ("int", "stride"), ("float*", "out"))),
    KernelSig("looped", (("const float*", "x"), ("int", "n"), ("float*", "out"))),
]

_SMEM = 8192


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    return build(_SOURCE, _SIGS, level="ptx", arch="sm_80", counters=True,
                 cache_dir=tmp_path_factory.mktemp("counters"))


def aligned(n: int, dtype, align: int = 256) -> np.ndarray:
    """A zeroed numpy array of n elements whose data starts on an ``align``-byte boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(n * itemsize + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + n * itemsize].view(dtype)


# --------------------------------------------------------------- the independent model
def model_wavefronts(addrs: list[int], active: list[bool], size: int) -> tuple[int, int]:
    """(wavefronts, ideal wavefronts) of one warp-level shared request, from the documented rules."""
    per_phase = {1: 32, 2: 32, 4: 32, 8: 16, 16: 8}[size]
    wav = ideal = 0
    for start in range(0, 32, per_phase):
        words = set()
        for lane in range(start, start + per_phase):
            if active[lane]:
                words.update(range(addrs[lane] // 4, (addrs[lane] + size - 1) // 4 + 1))
        if words:
            wav += max(Counter(w % 32 for w in words).values())
            ideal += -(-len(words) // 32)
    return wav, ideal


def model_ldmatrix(rows: list[int], num: int) -> int:
    wav = 0
    for p in range(num):
        words = {w for lane in range(8 * p, 8 * p + 8) for w in range(rows[lane] // 4, rows[lane] // 4 + 4)}
        wav += max(Counter(w % 32 for w in words).values())
    return wav


def model_sectors(addrs: list[int], active: list[bool], size: int) -> int:
    return len({s for a, on in zip(addrs, active) if on for s in range(a // 32, (a + size - 1) // 32 + 1)})


def _site(counters, kernel: str, opcode_start: str):
    sites = [s for s in counters[kernel].sites if s.site.opcode.startswith(opcode_start)]
    assert len(sites) == 1, [s.site.opcode for s in counters[kernel].sites]
    return sites[0]


def _pattern(rng: random.Random, size: int, limit: int) -> list[int]:
    kind = rng.randrange(4)
    if kind == 0:  # random, a small range: conflicts and broadcasts
        return [rng.randrange(0, 512 // size) * size for _ in range(32)]
    if kind == 1:  # a random stride
        stride = rng.choice([1, 2, 3, 4, 5, 8, 16, 17, 32, 33]) * size
        return [(lane * stride) % limit // size * size for lane in range(32)]
    if kind == 2:  # a permutation of a dense row
        perm = list(range(32))
        rng.shuffle(perm)
        return [p * size for p in perm]
    return [rng.randrange(0, limit // size) * size for _ in range(32)]


@pytest.mark.parametrize("size", [4, 8, 16])
def test_shared_wavefronts_match_the_model(mod, size):
    rng = random.Random(size)
    kernel = {4: "rd4", 8: "rd8", 16: "rd16"}[size]
    out = np.zeros(32, np.float32)
    for trial in range(40):
        addrs = _pattern(rng, size, _SMEM)
        mask = 0xFFFFFFFF if trial % 3 == 0 else rng.getrandbits(32) | 1
        active = [bool(mask >> lane & 1) for lane in range(32)]
        offs = np.array(addrs, np.uint32)
        mod.reset_counters()
        mod.launch(kernel, grid=1, block=32, smem_bytes=_SMEM, args=[offs, mask, out])
        s = _site(mod.counters(), kernel, "ld.shared")
        assert s.site.size == size
        assert (s.shared_requests, s.wavefronts, s.ideal_wavefronts) == (1, *model_wavefronts(addrs, active, size)), \
            (addrs, hex(mask))
        assert s.shared_bytes == size * sum(active)


@pytest.mark.parametrize("num", [1, 2, 4])
def test_ldmatrix_wavefronts_match_the_model(mod, num):
    rng = random.Random(num)
    out = np.zeros(32, np.uint32)
    for _ in range(25):
        rows = _pattern(rng, 16, _SMEM)
        mod.reset_counters()
        mod.launch("ldm", grid=1, block=32, smem_bytes=_SMEM, args=[np.array(rows, np.uint32), num, out])
        s = _site(mod.counters(), "ldm", f"ldmatrix.sync.aligned.m8n8.x{num}")
        assert (s.shared_requests, s.wavefronts, s.ideal_wavefronts) == (1, model_ldmatrix(rows, num), num), rows


_STMATRIX = r"""
extern "C" __global__ void stm(const unsigned* offs, unsigned* out) {
    extern __shared__ __align__(16) unsigned char sm[];
    const unsigned lane = threadIdx.x;
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(sm + offs[lane]));
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(a), "r"(lane), "r"(lane + 1u), "r"(lane + 2u), "r"(lane + 3u) : "memory");
    __syncwarp();
    out[lane] = *reinterpret_cast<const unsigned*>(sm + 4 * lane);
}
"""


def test_stmatrix_wavefronts_match_the_model(mod):
    stm = build(_STMATRIX, [KernelSig("stm", (("const unsigned*", "offs"), ("unsigned*", "out")))], level="ptx",
                arch="sm_90", counters=True, cache_dir=mod.path.parent)
    rng = random.Random(7)
    out = np.zeros(32, np.uint32)
    for _ in range(15):
        perm = list(range(32))
        rng.shuffle(perm)  # distinct rows (a store's rows must not overlap): conflicts by their banks
        stride = rng.choice([16, 32, 64, 80, 128, 144])
        rows = [p * stride for p in perm]
        stm.reset_counters()
        stm.launch("stm", grid=1, block=32, smem_bytes=_SMEM, args=[np.array(rows, np.uint32), out])
        s = _site(stm.counters(), "stm", "stmatrix")
        assert (s.shared_requests, s.wavefronts, s.ideal_wavefronts) == (1, model_ldmatrix(rows, 4), 4), rows


_BULK = r"""
extern "C" __global__ void bulk(const float* x, float* out, int nbytes) {
    extern __shared__ __align__(128) unsigned char sm[];
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(sm));
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(sm + 128));
    if (threadIdx.x == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(nbytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(dst), "l"(x), "r"(nbytes), "r"(bar) : "memory");
    }
    asm volatile("{\n .reg .pred p;\n W:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n @!p bra W;\n}"
                 :: "r"(bar) : "memory");
    out[threadIdx.x] = reinterpret_cast<const float*>(sm + 128)[threadIdx.x];
}
"""


def test_bulk_copies_count_copies_and_bytes(mod):
    m = build(_BULK, [KernelSig("bulk", (("const float*", "x"), ("float*", "out"), ("int", "nbytes")))],
              level="ptx", arch="sm_90", counters=True, cache_dir=mod.path.parent)
    x, out = aligned(128, np.float32), aligned(128, np.float32)
    x[:] = np.arange(128)
    m.launch("bulk", grid=3, block=128, smem_bytes=1024, args=[x, out, 512])
    assert np.array_equal(out, x)
    s = _site(m.counters(), "bulk", "cp.async.bulk")
    assert s.site.kind == "bulk" and (s.bulk_copies, s.bulk_bytes) == (3, 3 * 512)
    assert (s.shared_requests, s.global_requests) == (0, 0)


@pytest.mark.parametrize("width", [4, 8, 16])
def test_global_sectors_match_the_model(mod, width):
    rng = random.Random(width)
    x = aligned(1 << 14, np.float32)
    out = np.zeros(32, np.float32)
    opcode = {4: "ld.global.f32", 8: "ld.global.v2.f32", 16: "ld.global.v4.f32"}[width]
    for trial in range(30):
        idx = [a // 4 for a in _pattern(rng, width, 4 * (1 << 14) - 16)]
        mask = 0xFFFFFFFF if trial % 2 == 0 else rng.getrandbits(32) | 1
        active = [bool(mask >> lane & 1) for lane in range(32)]
        mod.reset_counters()
        mod.launch("gl", grid=1, block=32, smem_bytes=0, args=[x, np.array(idx, np.uint32), mask, width, out])
        s = _site(mod.counters(), "gl", opcode)
        addrs = [x.ctypes.data + 4 * i for i in idx]
        assert (s.global_requests, s.sectors) == (1, model_sectors(addrs, active, width)), (idx, hex(mask))
        assert s.global_bytes == width * sum(active)


def test_known_answers_bank_conflicts_and_coalescing(mod):
    x = aligned(32 * 32 * 32, np.float32)
    out = aligned(32, np.float32)
    for pad, stride, col_wavefronts, sectors in ((0, 1, 32, 4), (1, 32, 1, 32)):
        mod.reset_counters()
        mod.launch("tile", grid=1, block=32, smem_bytes=33 * 32 * 4, args=[x, pad, stride, out])
        kc = mod.counters()["tile"]
        loads = sorted((s for s in kc.sites if s.site.opcode == "ld.shared.f32"), key=lambda s: s.site.line)
        assert len(loads) == 2
        col, row = loads
        # the conflict-free row read: 1 wavefront per 4-byte request; the column read of the
        # 32 x 32 tile: every lane in one bank, 32 wavefronts (31 excess); padded: 1
        assert (row.shared_requests, row.wavefronts, row.excess_wavefronts) == (1, 1, 0)
        assert (col.shared_requests, col.wavefronts, col.excess_wavefronts) == (1, col_wavefronts, col_wavefronts - 1)
        # the fill: 32 row stores, conflict-free either way
        stores = [s for s in kc.sites if s.site.opcode == "st.shared.f32"]
        assert sum(s.shared_requests for s in stores) == 32 and sum(s.wavefronts for s in stores) == 32
        # x[i * stride]: coalesced, 4 sectors of 32 bytes per request; stride 32 floats: 32
        g = max((s for s in kc.sites if s.site.opcode == "ld.global.f32"), key=lambda s: s.site.line)
        assert (g.global_requests, g.sectors, g.ideal_sectors) == (1, sectors, 4)
        st = _site({"tile": kc}, "tile", "st.global")
        assert (st.global_requests, st.sectors, st.global_bytes) == (1, 4, 128)
        assert kc.total.wavefronts_per_request == pytest.approx((32 + 1 + col_wavefronts) / 34)


def test_tile_loop_from_the_branch_structure(mod):
    x = aligned(4 * 32, np.float32)
    out = aligned(32, np.float32)
    mod.reset_counters()
    mod.launch("looped", grid=2, block=32, smem_bytes=128, args=[x, 4, out])
    kc = mod.counters()["looped"]
    in_loop = {s.site.opcode for s in kc.sites if s.site.in_loop}
    assert {"st.shared.f32", "ld.shared.f32"} <= in_loop
    assert all(not s.site.in_loop for s in kc.sites if s.site.opcode.startswith("st.global"))
    # 2 blocks x 4 iterations: one request per block and iteration (and per unrolled copy)
    assert kc.tile_loop.shared_requests == 2 * 2 * 4
    assert kc.other.global_requests == 2 and kc.other.shared_requests == 0


def test_counters_only_when_asked(mod):
    assert "pxc::note" not in translate(mod.ptx).cpp
    assert "pxc::note" in translate(mod.ptx, counters=True).cpp
    plain = build(_SOURCE, _SIGS[:1], level="ptx", arch="sm_80", cache_dir=mod.path.parent)
    with pytest.raises(Exception, match="without memory counters"):
        plain.counters()


def test_runtime_record_counts_the_default_simt_forward():
    import torch

    import fagen.functional as F
    from fagen import KernelSpec
    from fagen.runtime import cpu

    spec = KernelSpec(direction="fwd", head_dim=64, dtype="float16", impl="simt", arch="sm_80")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, 1, 64, generator=g).half() for _ in range(3))
    with cpu.ptx(counters=True) as rec:
        o, _ = F.run_forward(spec, q, k, v)
    with cpu.ptx():
        o_plain, _ = F.run_forward(spec, q, k, v)
    assert torch.equal(o, o_plain)  # the counting build computes the same
    (name,) = rec.counters
    kc = rec.counters[name]
    loop, other = kc.tile_loop, kc.other
    assert loop.shared_requests > 0 and loop.global_requests > 0 and other.global_requests > 0
    assert loop.wavefronts >= loop.ideal_wavefronts >= loop.shared_requests
    assert loop.sectors >= loop.ideal_sectors
    assert kc.as_dict()["tile_loop"]["shared_requests"] == loop.shared_requests
