"""fa_sync_or (``__syncthreads_or`` / PTX ``bar.red.or.pred``) against its documented semantics:
a block barrier after which every thread holds the OR of all the block's predicates (CUDA
Programming Guide, "Synchronization functions"; PTX ISA, bar.red). Both emulator levels: the CUDA
source on the shim and NVRTC's PTX, translated."""
from __future__ import annotations

import numpy as np
import pytest

from fagen import renderer
from fagen.emulator import KernelSig, build

_KERNEL = r"""
extern "C" __global__ void bor(const int* pred, int* out, int rounds) {
    const int t = threadIdx.x;
    for (int r = 0; r < rounds; ++r) {
        int& dummy = *reinterpret_cast<int*>(fa_smem());  // a value from before the barrier, read after it
        if (t == 0) dummy = r;
        const bool any = fa_sync_or(pred[r * blockDim.x + t] != 0);
        out[r * blockDim.x + t] = (any ? 2 : 0) + (dummy == r ? 1 : 0);
        fa_sync();
    }
}
"""
_SIG = KernelSig("bor", (("const int*", "pred"), ("int*", "out"), ("int", "rounds")))


def _model(pred: np.ndarray) -> np.ndarray:
    """Every thread: the OR over the block of round r's predicates (2), and the pre-barrier write (1)."""
    anyr = pred.any(axis=1, keepdims=True)
    return np.where(anyr, 3, 1).repeat(pred.shape[1], axis=1).astype(np.int32)


@pytest.mark.parametrize("level", ["source", "ptx"])
def test_sync_or_is_the_block_or(level: str) -> None:
    src = (renderer.templates_dir() / "partials" / "primitives.cuh").read_text() + _KERNEL
    mod = build(src, [_SIG], level=level, **({"arch": "sm_80"} if level == "ptx" else {}))
    threads = 96  # three warps; rounds: none true, one thread (in the last warp), all, random
    rng = np.random.default_rng(3)
    pred = np.zeros((5, threads), np.int32)
    pred[1, 95] = 1
    pred[2, :] = 1
    pred[3] = rng.integers(0, 2, threads)
    pred[4, 0] = 7  # any nonzero value is true
    out = np.zeros_like(pred)
    mod.launch("bor", 1, threads, 16, [pred, out, np.int32(pred.shape[0])])
    np.testing.assert_array_equal(out, _model(pred != 0))
