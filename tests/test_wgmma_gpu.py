"""The Hopper primitives on a GPU: the demonstration GEMM of tests/hopper_kernels.cu compiled for
sm_90a and launched through CuPy with tensor maps from the driver's cuTensorMapEncodeTiled
(marked ``gpu``; needs a compute capability 9.0 device). On any machine: the arguments
fagen.runtime.gpu.encode_tensor_map hands the driver, and the 128 bytes CuPy then passes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from fagen import abi, nvrtc, tma
from fagen.runtime import gpu

REPO = Path(__file__).resolve().parent.parent


def test_encode_hands_the_driver_the_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuTensorMapEncodeTiled(map, dtype, rank, address, dims, strides, box, element strides,
    interleave, swizzle, L2 promotion, OOB fill), as the CUDA driver API declares it."""
    seen = {}

    def fake(addr, dtype, rank, address, dims, strides, box, es, interleave, swizzle, l2, oob):
        seen.update(dtype=dtype, rank=rank, address=address, dims=list(dims[:rank]),
                    strides=list(strides[:rank - 1]), box=list(box[:rank]), es=list(es[:rank]),
                    interleave=interleave, swizzle=swizzle, oob=oob, aligned=addr % 64 == 0)
        ctypes.memmove(addr, bytes(range(128)), 128)
        return 0

    monkeypatch.setattr(gpu, "tensor_map_encoder", lambda: fake)
    x = np.zeros((3, 40, 64), np.float16)
    f = tma.tensor_map_for(x, (1, 16, 32), swizzle=64, oob_fill="nan")
    raw = gpu.encode_tensor_map(f)
    assert raw == bytes(range(128))
    assert seen == dict(dtype=6, rank=3, address=x.__array_interface__["data"][0], dims=[64, 40, 3],
                        strides=[128, 40 * 128], box=[32, 16, 1], es=[1, 1, 1], interleave=0, swizzle=2, oob=1,
                        aligned=True)
    arg = gpu.to_cuda_arg(abi.TENSORMAP, f, "tmap")
    assert arg.dtype.itemsize == 128 and arg.tobytes() == bytes(range(128))

    monkeypatch.setattr(gpu, "tensor_map_encoder", lambda: (lambda *a: 1))  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(gpu.LaunchError, match="CUresult 1"):
        gpu.encode_tensor_map(f)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a compute capability 9.0 GPU (sm_90a)")
@pytest.mark.parametrize("k_total", [64, 256])
def test_demonstration_gemm_on_the_gpu(k_total: int) -> None:
    import cupy

    src = (REPO / "templates/partials/primitives.cuh").read_text() + "\n" + \
        (REPO / "templates/wgmma/hopper.cuh").read_text() + "\n" + (REPO / "tests/hopper_kernels.cu").read_text()
    res = nvrtc.compile_cubin(src, "hopper.cu", ["-arch=sm_90a", "-std=c++17"], "sm_90a")
    assert res.ok, res.log
    path = Path(gpu._cubin_path(res.cubin))  # noqa: SLF001 - the runtime's own cubin file
    fn = cupy.RawModule(path=str(path)).get_function("hopper_gemm")
    gen = torch.Generator(device="cuda").manual_seed(k_total)
    a = torch.randn(128, k_total, device="cuda", generator=gen).half()
    b = torch.randn(k_total, 128, device="cuda", generator=gen).half()
    c = torch.full((128, 128), float("nan"), device="cuda")
    ta = gpu.to_cuda_arg(abi.TENSORMAP, tma.tensor_map_for(a, (128, 16), swizzle=32), "tma_a")
    tb = gpu.to_cuda_arg(abi.TENSORMAP, tma.tensor_map_for(b, (16, 64), swizzle=128), "tma_b")
    fn((1, 1, 1), (384, 1, 1), (ta, tb, np.uint64(c.data_ptr()), np.int32(k_total)), shared_mem=4 * 4096 + 64)
    torch.cuda.synchronize()
    torch.testing.assert_close(c, torch.matmul(a.float(), b.float()), rtol=1e-4, atol=1e-3)
