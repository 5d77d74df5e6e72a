"""GPU backend: the cubin of :func:`fagen.compile` in a ``cupy.RawModule``.

One module per spec, memoised in process; kernels launch on torch's current
CUDA stream (``cupy.cuda.ExternalStream``); tensors are passed as raw device
pointers (zero-copy); scalars with explicit numpy dtypes; dynamic shared
memory above 48 KiB is opted in per kernel.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..compiler import compile as compile_spec
from ..renderer import KernelInfo
from ..spec import KernelSpec
from . import pack

#: C parameter type -> numpy scalar type for CuPy's argument packing.
_SCALARS: dict[str, type] = {
    "int": np.int32,
    "unsigned int": np.uint32,
    "long long": np.int64,
    "unsigned long long": np.uint64,
    "float": np.float32,
}
_DEFAULT_SMEM_LIMIT = 48 * 1024


def to_cuda_arg(ctype: str, value: Any) -> Any:
    if ctype.endswith("*"):
        return np.uint64(int(value))  # device pointer, passed by value
    return _SCALARS[ctype](value)


class GpuModule:
    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.compiled = compile_spec(spec)
        self._module = _load_cubin(self.compiled.cubin)
        self._kernels: dict[str, Any] = {}
        for k in self.compiled.rendered.kernels:
            fn = self._module.get_function(k.name)
            if k.smem_bytes > _DEFAULT_SMEM_LIMIT:
                fn.max_dynamic_shared_size_bytes = k.smem_bytes
            self._kernels[k.name] = fn

    def launch(self, kernel: KernelInfo, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        import cupy
        import torch

        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        packed = tuple(to_cuda_arg(t, v) for t, v in pack(kernel, args))
        with stream:
            self._kernels[kernel.name](grid, kernel.block, packed, shared_mem=kernel.smem_bytes)


def _load_cubin(cubin: bytes) -> Any:
    """A RawModule over an in-memory cubin (CuPy loads files; write it to the cache dir once)."""
    import hashlib

    import cupy

    from ..cache import atomic_write, cache_root

    path = cache_root("cubin") / f"{hashlib.sha256(cubin).hexdigest()}.cubin"
    if not path.exists() or path.read_bytes() != cubin:
        atomic_write(path, cubin)
    return cupy.RawModule(path=str(path))


@functools.lru_cache(maxsize=None)
def gpu_module(spec: KernelSpec) -> GpuModule:
    return GpuModule(spec)


def device_arch(device: Any) -> str:
    """sm_XY of a torch CUDA device, validated against the archs fagen targets."""
    import torch

    from ..errors import SpecError
    from ..spec import ARCH_SMEM_OPTIN

    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    if arch not in ARCH_SMEM_OPTIN:
        raise SpecError(f"GPU compute capability {major}.{minor} ({arch}) is not a fagen target; supported: {sorted(ARCH_SMEM_OPTIN)}")
    return arch
