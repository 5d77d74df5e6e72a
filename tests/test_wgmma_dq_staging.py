"""The wgmma backward's dQ_i staging tile and its one reduce-add per step.

The tile is HEAD_DIM / 8 groups of BLOCK_R rows x 8 fp32 columns, so a warp's 8-byte stores of an
accumulator fragment (rows g, g + 8 of 16 per warp, columns 8n + 2 (lane % 4)) fill 256 contiguous
bytes: no bank conflict (the dense BLOCK_R x HEAD_DIM tile it replaces put all 8 rows of a store on
the same banks). dq_accum's tensor map is a 5-D view whose outer strides step rows before column
groups (:func:`fagen.families.wgmma.bwd.dq_staging_view`), so one ``fa_tma_reduce_add_5d`` of the
whole tile, issued by the producer warp's elected lane (coordinates uniform: no loop over lanes),
replaces per-group reduces. Numerics of the backward: tests/test_wgmma_bwd.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fagen import KernelSpec, nvrtc, renderer, tma
from fagen.emulator import KernelSig, build
from fagen.families.wgmma.bwd import DQ_GROUP, bwd_tensor_map_boxes, dq_staging_view

_KERNEL = r"""
// The staging tile `src` (box_bytes) -> smem, then one 5-D reduce-add of it at (0, row, 0, head, batch).
extern "C" __global__ void reduce5(const __grid_constant__ FaTensorMap tmap, const float* src, int box_floats,
                                   int row, int head, int batch) {
    float* s = reinterpret_cast<float*>(fa_smem_1024());
    for (int i = threadIdx.x; i < box_floats; i += blockDim.x) s[i] = src[i];
    fa_fence_proxy_async();
    fa_sync();
    if (threadIdx.x == 0) {
        fa_tma_reduce_add_5d(&tmap, s, 0, row, 0, head, batch);
        fa_bulk_commit_group();
        fa_bulk_wait_group<0>();
    }
}
"""
_SIG = KernelSig("reduce5", (("const FaTensorMap", "tmap"), ("const float*", "src"), ("int", "box_floats"),
                             ("int", "row"), ("int", "head"), ("int", "batch")))


def _source() -> str:
    root = renderer.templates_dir()
    return (root / "partials/primitives.cuh").read_text() + "\n" + (root / "wgmma/hopper.cuh").read_text() + _KERNEL


def _case(block_r: int = 16, rows: int = 20, row0: int = 10):
    """dq_accum [2, rows, 3, 32] of small integers, a staging tile of block_r rows from row0 (past the
    end: clipped) for head 1 of batch 1, and what the reduce-add must leave."""
    rng = np.random.default_rng(5)
    acc = rng.integers(-20, 20, (2, rows, 3, 32)).astype(np.float32)
    groups = 32 // DQ_GROUP
    tile = rng.integers(-20, 20, (groups, block_r, DQ_GROUP)).astype(np.float32)  # the smem image, as staged
    want = acc.copy()
    for c in range(groups):
        for r in range(block_r):
            if row0 + r < rows:
                want[1, row0 + r, 1, DQ_GROUP * c:DQ_GROUP * (c + 1)] += tile[c, r]
    return acc, tile, want


def test_the_view_steps_rows_before_column_groups() -> None:
    x = torch.zeros(2, 20, 3, 32)
    v = dq_staging_view(x)
    assert v.shape == (2, 3, 4, 20, 8) and v.stride() == (20 * 3 * 32, 32, 8, 3 * 32, 1)
    f = tma.tensor_map_for(v, (1, 1, 4, 16, 8))
    assert f.dims == (8, 20, 4, 3, 2) and f.strides == (3 * 32 * 4, 32, 32 * 4, 20 * 3 * 32 * 4)  # not monotonic
    spec = KernelSpec(direction="bwd", arch="sm_90a", head_dim=128, dtype="float16")
    assert bwd_tensor_map_boxes(spec.family_spec)["tma_dqa"] == (1, 1, 128 // DQ_GROUP, spec.tile.block_r, DQ_GROUP)


def test_reduce_add_5d_over_the_view_in_the_emulator() -> None:
    acc, tile, want = _case()
    fields = tma.tensor_map_for(dq_staging_view(torch.from_numpy(acc)).numpy(), (1, 1, 4, 16, 8))
    mod = build(_source(), [_SIG])
    mod.launch("reduce5", 1, 128, 65536, [fields, tile, tile.size, 10, 1, 1])
    np.testing.assert_array_equal(acc, want)


def _warp_store_wavefronts(address) -> int:
    """Shared-memory wavefronts of one warp's 8-byte stores (address(g, t4) in bytes): a 64-bit access
    is served per half-warp; a half takes as many wavefronts as the most distinct 4-byte words on one bank."""
    total = 0
    for half in (range(16), range(16, 32)):
        words: dict[int, set[int]] = {}
        for lane in half:
            a = address(lane // 4, lane % 4)
            for w in (a // 4, a // 4 + 1):
                words.setdefault(w % 32, set()).add(w)
        total += max(len(ws) for ws in words.values())
    return total


@pytest.mark.parametrize("d", [64, 96, 128])
def test_staging_stores_meet_no_bank_conflict(d: int) -> None:
    """The template's staging addresses (float offsets: group (8n) / 8, row g, column 2 t4) against the
    dense tile's: 2 wavefronts per store instead of 8."""
    block_r = 64
    for n in range(8):
        staged = _warp_store_wavefronts(lambda g, t4, n=n: 4 * ((8 * n // DQ_GROUP) * block_r * DQ_GROUP
                                                                + g * DQ_GROUP + 2 * t4))
        dense = _warp_store_wavefronts(lambda g, t4, n=n: 4 * (g * d + 8 * n + 2 * t4))
        assert staged == 2 and dense == 8, (n, staged, dense)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a compute capability 9.0 GPU (sm_90a)")
def test_reduce_add_5d_over_the_view_on_the_gpu() -> None:
    """The driver takes the view's map (outer strides not monotonic) and the TMA adds as the emulator does."""
    import cupy

    from fagen.runtime import gpu

    acc, tile, want = _case()
    acc_d, tile_d = torch.from_numpy(acc).cuda(), torch.from_numpy(tile).cuda()
    res = nvrtc.compile_cubin(_source(), "reduce5.cu", ["-arch=sm_90a", "-std=c++17"], "sm_90a")
    assert res.ok, res.log
    fn = cupy.RawModule(path=str(gpu._cubin_path(res.cubin))).get_function("reduce5")
    fn.max_dynamic_shared_size_bytes = 65536
    tmap = gpu.to_cuda_arg("const __grid_constant__ FaTensorMap",
                           tma.tensor_map_for(dq_staging_view(acc_d), (1, 1, 4, 16, 8)), "tmap")
    fn((1,), (128,), (tmap, np.uint64(tile_d.data_ptr()), np.int32(tile.size), np.int32(10), np.int32(1),
                      np.int32(1)), shared_mem=65536)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(acc_d.cpu().numpy(), want)
