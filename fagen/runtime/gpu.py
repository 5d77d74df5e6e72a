"""GPU backend: the cubin of :func:`fagen.compile` in a ``cupy.RawModule``.

One module per spec, memoised in process; kernels launch on torch's current
CUDA stream (``cupy.cuda.ExternalStream``); tensors are passed as raw device
pointers (zero-copy); scalars with explicit numpy dtypes; dynamic shared
memory above 48 KiB is opted in per kernel.
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path
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
    """The kernels of one spec; loaded once per CUDA device, on first use there."""

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.compiled = compile_spec(spec)
        self._path = _cubin_path(self.compiled.cubin)
        self._per_device: dict[int, dict[str, Any]] = {}

    def _kernels(self, device: int) -> dict[str, Any]:
        """Kernel handles on ``device`` (call with that device current)."""
        kernels = self._per_device.get(device)
        if kernels is None:
            import cupy

            module = cupy.RawModule(path=str(self._path))
            kernels = {}
            for k in self.compiled.rendered.kernels:
                fn = module.get_function(k.name)
                if k.smem_bytes > _DEFAULT_SMEM_LIMIT:  # opt in above 48 KiB, per kernel and device
                    fn.max_dynamic_shared_size_bytes = k.smem_bytes
                kernels[k.name] = fn
            self._per_device[device] = kernels
        return kernels

    def launch(self, kernel: KernelInfo, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        import cupy
        import torch

        values = pack(kernel, args)
        device = _pointer_device(values)
        packed = tuple(to_cuda_arg(t, v) for t, v in values)
        with cupy.cuda.Device(device), _cupy_stream(torch.cuda.current_stream(device), device):
            fn = self._kernels(device)[kernel.name]
            fn(grid, kernel.block, packed, shared_mem=kernel.smem_bytes)


def _pointer_device(values: list[tuple[str, Any]]) -> int:
    """The CUDA device holding the first non-null pointer argument (the tensors' device)."""
    import cupy

    for ctype, value in values:
        if ctype.endswith("*") and int(value):
            return int(cupy.cuda.runtime.pointerGetAttributes(int(value)).device)
    raise ValueError("kernel launch without a device pointer")


def _cupy_stream(stream: Any, device: int) -> Any:
    """torch's stream as a CuPy stream (a context manager making it current).

    CuPy >= 14 deprecates ``ExternalStream`` for ``Stream.from_external`` (the CUDA
    stream protocol, ``__cuda_stream__``, which recent torch streams implement).
    """
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return cupy.cuda.ExternalStream(stream.cuda_stream, device)
        except TypeError:  # CuPy without the device_id argument
            return cupy.cuda.ExternalStream(stream.cuda_stream)


def _cubin_path(cubin: bytes) -> Path:
    """The cubin as a file in the cache dir (``cupy.RawModule`` loads files), written once."""
    import hashlib

    from ..cache import atomic_write, cache_root

    path = cache_root("cubin") / f"{hashlib.sha256(cubin).hexdigest()}.cubin"
    if not path.exists() or path.read_bytes() != cubin:
        atomic_write(path, cubin)
    return path


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
