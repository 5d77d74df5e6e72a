"""Racecheck of the Hopper primitives (templates/wgmma/hopper.cuh, fagen/emulator/hopper.h).

Hand-written kernels, each with the right synchronisation (clean) and without it (an
``EmulatorRaceError`` naming the asynchronous agent or the threads): a TMA load read without
waiting for its mbarrier phase; mbarrier operations not ordered after the init; a shared-memory
write before a TMA store without ``fence.proxy.async``; a wgmma operand written without the proxy
fence, or overwritten before ``wgmma.wait_group`` retires it; named barriers (``bar.arrive`` /
``bar.sync``) ordering their participants. The primitives' own bookkeeping is not reported: the
demonstration GEMM (tests/hopper_kernels.cu) runs clean, with the same result, in both thread orders.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fagen import tma
from fagen.abi import TENSORMAP
from fagen.emulator import EmulatorRaceError, KernelSig, build

REPO = Path(__file__).resolve().parent.parent
PRIMITIVES = (REPO / "templates/partials/primitives.cuh").read_text()
HOPPER = (REPO / "templates/wgmma/hopper.cuh").read_text()

KERNELS = r"""
// Thread 0 loads a 16 x 64 fp16 box with TMA; every thread reads element t of it.
// mode 0: each waits for the phase; 1: none waits; 2: no barrier between the init and the others'
// mbarrier operations (thread 1 waits on it right away).
extern "C" __global__ void tma_read(const __grid_constant__ FaTensorMap tmap, int box_bytes, unsigned short* out,
                                    int mode) {
    unsigned char* s = fa_smem_1024();
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(s + 4096);
    const int t = threadIdx.x;
    if (t == 0) {
        fa_mbarrier_init(bar, 1);
        fa_fence_barrier_init();
    }
    if (mode != 2) fa_sync();
    if (t == 0) {
        fa_mbarrier_arrive_expect_tx(bar, box_bytes);
        fa_tma_load_2d(s, &tmap, bar, 0, 0);
    }
    if (mode != 1) fa_mbarrier_wait_parity(bar, 0);
    out[t] = reinterpret_cast<const unsigned short*>(s)[t];  // LINE:tma_reader
}

// Thread 0 stores a box from shared memory with TMA. mode 0: fence.proxy.async after writing
// the source; 1: no fence; 2: fence, then the source is overwritten before the bulk wait.
extern "C" __global__ void tma_store(const __grid_constant__ FaTensorMap tmap, const unsigned char* src,
                                     int box_bytes, int mode) {
    unsigned char* s = fa_smem_1024();
    for (int i = 0; i < box_bytes; ++i) s[i] = src[i];  // LINE:store_src
    if (mode != 1) fa_fence_proxy_async();
    fa_tma_store_2d(&tmap, s, 0, 0);  // LINE:tma_store
    fa_bulk_commit_group();
    if (mode == 2) s[0] ^= 1;  // LINE:store_overwrite
    fa_bulk_wait_group_read<0>();
    fa_bulk_wait_group<0>();
}

// One m64n8k16 wgmma of the warpgroup, A and B K-major without swizzle (A 2048 bytes, B 256).
// mode 0: operands written, fence.proxy.async, barrier, then written again after the wait;
// 1: no fence.proxy.async; 2: thread 3 overwrites an A element before the wait; 3: thread 5
// rewrites an A element after the barrier, then a named barrier of the warpgroup, no fence;
// 4: as 3 with thread 5's fence.proxy.async before the named barrier.
extern "C" __global__ void wgmma_ops(float* out, int mode) {
    unsigned char* s = fa_smem_1024();
    const int t = threadIdx.x;
    for (int i = t; i < 1152; i += 128) reinterpret_cast<unsigned short*>(s)[i] = 0;  // LINE:operand_write
    if (mode != 1) fa_fence_proxy_async();
    fa_sync();
    if (mode >= 3) {
        if (t == 5) {
            reinterpret_cast<unsigned short*>(s)[40] = 0;  // LINE:late_write
            if (mode == 4) fa_fence_proxy_async();
        }
        fa_named_barrier_sync(1, 128);
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    const unsigned long long da = fa_wgmma_desc(s, 128, 256, 0);
    const unsigned long long db = fa_wgmma_desc(s + 2048, 128, 256, 0);
    fa_wgmma_fence();
    fa_wgmma_m64nNk16_ss<__half, 8, 0, 0>(d, da, db, 0);  // LINE:wgmma
    fa_wgmma_commit_group();
    if (mode == 2 && t == 3) s[16] = 1;  // LINE:operand_overwrite
    fa_wgmma_wait_group<0>();
    if (mode == 0 || mode == 4) s[2 * t] = 2;  // retired: the operands are free again
    for (int i = 0; i < 4; ++i) out[4 * t + i] = d[i];
}

// Warp 0 writes, arrives on named barrier 1 (64 threads); warp 1 syncs on it and reads.
// mode 1: warp 1 reads without the barrier (warp 0 still arrives).
extern "C" __global__ void named_rw(int* out, int mode) {
    int* s = reinterpret_cast<int*>(fa_smem());
    const int t = threadIdx.x;
    if (t < 32) {
        s[t] = 3 * t;  // LINE:named_write
        fa_named_barrier_arrive(1, 64);
    } else {
        if (mode == 0) fa_named_barrier_sync(1, 64);
        out[t - 32] = s[t - 32];  // LINE:named_read
    }
}
"""
SOURCE = PRIMITIVES + "\n" + HOPPER + "\n" + KERNELS
SIGS = [
    KernelSig("tma_read", ((TENSORMAP, "tmap"), ("int", "box_bytes"), ("unsigned short*", "out"), ("int", "mode"))),
    KernelSig("tma_store", ((TENSORMAP, "tmap"), ("const unsigned char*", "src"), ("int", "box_bytes"),
                            ("int", "mode"))),
    KernelSig("wgmma_ops", (("float*", "out"), ("int", "mode"))),
    KernelSig("named_rw", (("int*", "out"), ("int", "mode"))),
]
SMEM = 8192


def line_of(tag: str) -> int:
    for i, text in enumerate(SOURCE.splitlines(), 1):
        if text.rstrip().endswith(f"// LINE:{tag}"):
            return i
    raise AssertionError(tag)


@pytest.fixture(scope="module")
def mod():
    return build(SOURCE, SIGS, racecheck=True)


def _race(mod, *launch) -> EmulatorRaceError:
    with pytest.raises(EmulatorRaceError) as ei:
        mod.launch(*launch)
    return ei.value


def _box():
    x = (np.arange(16 * 64) % 1000).astype(np.float16).reshape(16, 64)
    return x, tma.tensor_map_for(x, (16, 64), swizzle=128)


def test_tma_load_is_visible_only_through_its_mbarrier_phase(mod) -> None:
    x, fields = _box()
    out = np.zeros(64, np.uint16)
    mod.launch("tma_read", 1, 64, SMEM, [fields, fields.box_bytes, out, 0])
    assert np.array_equal(out[:8], x.view(np.uint16)[0, :8])  # the box lands (no swizzle in row 0)
    e = _race(mod, "tma_read", 1, 64, SMEM, [fields, fields.box_bytes, out, 1])
    msg = str(e)
    assert e.kind == "read-after-write" and e.space == "shared", msg
    assert "write by asynchronous agent 9 (TMA / bulk loads completing on mbarrier smem+0x1000)" in msg, msg
    assert f":{line_of('tma_reader')}" in msg, msg


def test_mbarrier_operations_need_a_barrier_after_the_init(mod) -> None:
    _, fields = _box()
    out = np.zeros(64, np.uint16)
    e = _race(mod, "tma_read", 1, 64, SMEM, [fields, fields.box_bytes, out, 2])
    assert e.offset == 4096 and "write by block (0,0,0) thread (0,0,0)" in str(e), str(e)
    assert "mbarrier" in str(e), str(e)


def test_tma_store_source_needs_fence_proxy_async_and_the_bulk_wait(mod) -> None:
    g = np.zeros((8, 64), np.float16)
    fields = tma.tensor_map_for(g, (8, 64), swizzle=0)
    src = np.arange(fields.box_bytes, dtype=np.uint8)
    mod.launch("tma_store", 1, 1, SMEM, [fields, src, fields.box_bytes, 0])
    assert np.array_equal(g.view(np.uint8).ravel(), src)
    e = _race(mod, "tma_store", 1, 1, SMEM, [fields, src, fields.box_bytes, 1])
    assert e.kind == "read-after-write", str(e)
    assert e.lines == (f"{mod.source_path.name}:{line_of('store_src')}",
                       f"{mod.source_path.name}:{line_of('tma_store')}"), str(e)
    assert "read by asynchronous agent 8 (TMA / bulk stores and reduces)" in str(e), str(e)
    e = _race(mod, "tma_store", 1, 1, SMEM, [fields, src, fields.box_bytes, 2])
    assert e.kind == "write-after-read" and f":{line_of('store_overwrite')}" in str(e), str(e)


def test_wgmma_operands_need_the_proxy_fence_and_stay_untouched_until_the_wait(mod) -> None:
    out = np.ones(512, np.float32)
    mod.launch("wgmma_ops", 1, 128, SMEM, [out, 0])
    assert (out == 0).all()
    e = _race(mod, "wgmma_ops", 1, 128, SMEM, [out, 1])
    assert e.kind == "read-after-write" and "read by asynchronous agent 0 (wgmma of warpgroup 0)" in str(e), str(e)
    assert f":{line_of('operand_write')}" in str(e) and f":{line_of('wgmma')}" in str(e), str(e)
    e = _race(mod, "wgmma_ops", 1, 128, SMEM, [out, 2])
    assert e.kind == "write-after-read" and e.offset == 16, str(e)
    assert "read by asynchronous agent 0 (wgmma of warpgroup 0)" in str(e), str(e)
    assert "write by block (0,0,0) thread (3,0,0)" in str(e) and f":{line_of('operand_overwrite')}" in str(e)
    # another thread's write, ordered by a named barrier but not proxy-fenced by its thread
    mod.launch("wgmma_ops", 1, 128, SMEM, [out, 4])
    e = _race(mod, "wgmma_ops", 1, 128, SMEM, [out, 3])
    assert e.kind == "read-after-write" and e.offset == 80, str(e)
    assert "write by block (0,0,0) thread (5,0,0)" in str(e) and f":{line_of('late_write')}" in str(e), str(e)
    assert "fence.proxy.async" in str(e), str(e)


def test_named_barriers_order_their_participants(mod) -> None:
    out = np.zeros(32, np.int32)
    mod.launch("named_rw", 1, 64, 1024, [out, 0])
    np.testing.assert_array_equal(out, 3 * np.arange(32))
    e = _race(mod, "named_rw", 1, 64, 1024, [out, 1])
    assert e.kind == "read-after-write" and e.lines == (
        f"{mod.source_path.name}:{line_of('named_write')}", f"{mod.source_path.name}:{line_of('named_read')}"), str(e)


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_demonstration_gemm_runs_clean_and_identical_under_racecheck(schedule: str) -> None:
    """tests/hopper_kernels.cu's GEMM (a TMA producer, a 2-stage mbarrier pipeline, two consumer
    warpgroups doing wgmma) has no hazard, in either thread order, and computes the same."""
    import torch

    src = PRIMITIVES + "\n" + HOPPER + "\n" + (REPO / "tests/hopper_kernels.cu").read_text()
    sig = [KernelSig("hopper_gemm", ((TENSORMAP, "tma_a"), (TENSORMAP, "tma_b"), ("float*", "c"),
                                     ("int", "k_total")))]
    flags = ["-DFAGEN_EMU_REVERSE_SCHEDULE"] if schedule == "reverse" else []
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(128, 64, generator=gen).half()
    b = torch.randn(64, 128, generator=gen).half()
    ta = tma.tensor_map_for(a, (128, 16), swizzle=32)
    tb = tma.tensor_map_for(b, (16, 64), swizzle=128)
    out = []
    for racecheck in (False, True):
        c = torch.full((128, 128), float("nan"))
        build(src, sig, extra_flags=flags, racecheck=racecheck).launch("hopper_gemm", 1, 384, 4 * 4096 + 64,
                                                                       [ta, tb, c, 64])
        out.append(c)
    assert torch.equal(out[0], out[1])
