"""GPU backend: the cubin of :func:`fagen.compile` in a ``cupy.RawModule``.

One module per spec, memoised in process; kernels launch on torch's current
CUDA stream (``cupy.Stream.from_external`` / ``ExternalStream``); tensors are
passed as raw device pointers (zero-copy).

Argument packing (what CuPy does with each argument, and why this is exact):
CuPy turns every argument into a host buffer of the argument's own size -- a
numpy scalar by its ``itemsize``, a bare Python ``int`` as 8 bytes, a ``float``
as a float64 -- and hands ``cuLaunchKernel`` one pointer per parameter, so the
driver copies each parameter at the offset and alignment the kernel's own
signature gives it. Correctness therefore needs each value to have exactly its
C type's width and representation: :func:`to_cuda_arg` maps ``int`` ->
``int32``, ``unsigned int`` -> ``uint32``, ``long long`` -> ``int64``,
``unsigned long long`` -> ``uint64``, ``float`` -> ``float32`` and every pointer
-> ``uint64`` (64-bit device addresses), after checking the value fits.

Launch limits checked before CuPy sees them (it casts grid dims to C ``int``
and clamps 0 to 1 silently): grid x in [1, 2**31-1], y and z in [1, 65535],
at most 1024 threads per block; dynamic shared memory is opted in with the
``max_dynamic_shared_size_bytes`` attribute (cuFuncSetAttribute) before the
first launch whenever static + dynamic exceeds the 48 KiB default, and a
kernel needing more than the device's opt-in maximum is refused.
"""
from __future__ import annotations

import functools
import math
import operator
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ..compiler import compile as compile_spec
from ..errors import InputError
from ..renderer import KernelInfo, kernel_infos
from ..spec import KernelSpec
from .args import pack

#: C parameter type -> numpy scalar type for CuPy's argument packing.
_SCALARS: dict[str, type] = {
    "int": np.int32,
    "unsigned int": np.uint32,
    "long long": np.int64,
    "unsigned long long": np.uint64,
    "float": np.float32,
}
_INT_RANGE: dict[str, tuple[int, int]] = {
    "int": (-(2**31), 2**31 - 1),
    "unsigned int": (0, 2**32 - 1),
    "long long": (-(2**63), 2**63 - 1),
    "unsigned long long": (0, 2**64 - 1),
}
_DEFAULT_SMEM_LIMIT = 48 * 1024  # bytes of static + dynamic smem a kernel gets without opting in
GRID_X_MAX = 2**31 - 1
GRID_YZ_MAX = 65535
BLOCK_MAX = (1024, 1024, 64)
THREADS_MAX = 1024
_ATTR_SMEM_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin


class LaunchError(InputError):
    """A kernel argument or launch configuration CUDA cannot take (names which)."""


def to_cuda_arg(ctype: str, value: Any, name: str = "") -> Any:
    """``value`` as the numpy scalar whose bytes are exactly the C parameter ``ctype``."""
    label = name or ctype
    if ctype.endswith("*"):
        ptr = _as_int(value, label, "a device pointer")
        if not 0 <= ptr < 2**64:
            raise LaunchError(label, "a 64-bit device address", hex(ptr))
        return np.uint64(ptr)
    kind = _SCALARS.get(ctype)
    if kind is None:
        raise LaunchError(label, f"a parameter type in {sorted(_SCALARS)} or a pointer", repr(ctype))
    if kind is np.float32:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise LaunchError(label, "a real number (float)", type(value).__name__)
        f = float(value)
        with np.errstate(over="ignore"):
            out = np.float32(f)
        if math.isfinite(f) and not math.isfinite(float(out)):
            raise LaunchError(label, "a value finite in float32 (|x| <= 3.4028235e38)", f)
        return out
    v = _as_int(value, label, f"an integer ({ctype})")
    lo, hi = _INT_RANGE[ctype]
    if not lo <= v <= hi:
        raise LaunchError(label, f"an integer in [{lo}, {hi}] ({ctype})", v)
    return kind(v)


def _as_int(value: Any, label: str, what: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise LaunchError(label, what, repr(value))
    try:
        return operator.index(value)
    except TypeError:
        raise LaunchError(label, what, type(value).__name__) from None


def _converter(ctype: str, name: str):
    """A one-argument :func:`to_cuda_arg` for one parameter that remembers its last few results
    (numpy scalars are immutable, and sizes, strides and pooled pointers repeat call after call).
    Only exact ``int`` (and for ``float`` parameters ``float``) values are remembered; anything
    else takes the full checks every time."""
    exact = (int, float) if ctype == "float" else (int,)
    seen: dict[Any, Any] = {}

    def convert(value: Any) -> Any:
        if type(value) in exact:
            found = seen.get(value)
            if found is None:
                found = to_cuda_arg(ctype, value, name)
                if len(seen) >= 64:
                    seen.clear()
                seen[value] = found
            return found
        return to_cuda_arg(ctype, value, name)
    return convert


_converters: dict[int, tuple[KernelInfo, tuple[tuple[str, Any], ...]]] = {}


def cuda_args(kernel: KernelInfo, args: dict[str, Any]) -> tuple[Any, ...]:
    """The kernel's arguments in parameter order, each as :func:`to_cuda_arg` makes it."""
    entry = _converters.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        entry = (kernel, tuple((n, _converter(t, n)) for t, n in kernel.params))
        if len(_converters) > 4096:
            _converters.clear()
        _converters[id(kernel)] = entry
    try:
        return tuple(convert(args[n]) for n, convert in entry[1])
    except KeyError:
        pack(kernel, args)  # names every missing argument
        raise


def prepare_launch(kernel: KernelInfo, grid: tuple[int, int, int],
                   args: dict[str, Any]) -> tuple[tuple[int, int, int], tuple[int, int, int], tuple[Any, ...]]:
    """(grid, block, arguments) exactly as handed to CuPy: the host-side work of a launch."""
    packed = cuda_args(kernel, args)
    g, block = check_launch(kernel, grid)
    return g, block, packed


def check_launch(kernel: KernelInfo, grid: tuple[int, int, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) as plain int tuples, within CUDA's limits, or :class:`LaunchError`."""
    b = kernel.block
    if type(grid) is tuple and len(grid) == 3 and type(b) is tuple and len(b) == 3:  # the common case, quickly
        x, y, z = grid
        bx, by, bz = b
        if (type(x) is int and type(y) is int and type(z) is int and 1 <= x <= GRID_X_MAX
                and 1 <= y <= GRID_YZ_MAX and 1 <= z <= GRID_YZ_MAX
                and type(bx) is int and type(by) is int and type(bz) is int
                and 1 <= bx <= BLOCK_MAX[0] and 1 <= by <= BLOCK_MAX[1] and 1 <= bz <= BLOCK_MAX[2]
                and bx * by * bz <= THREADS_MAX):
            return grid, b
    if len(grid) != 3:
        raise LaunchError(f"{kernel.name} grid", "3 dimensions", grid)
    g = tuple(_as_int(x, f"{kernel.name} grid", "integers") for x in grid)
    limits = (GRID_X_MAX, GRID_YZ_MAX, GRID_YZ_MAX)
    for axis, (n, hi) in enumerate(zip(g, limits)):
        if not 1 <= n <= hi:
            raise LaunchError(f"{kernel.name} grid.{'xyz'[axis]}", f"1..{hi} blocks", n)
    b = tuple(int(x) for x in kernel.block)
    if len(b) != 3 or any(not 1 <= n <= hi for n, hi in zip(b, BLOCK_MAX)) or b[0] * b[1] * b[2] > THREADS_MAX:
        raise LaunchError(f"{kernel.name} block", f"at most {BLOCK_MAX} and {THREADS_MAX} threads", b)
    return g, b  # type: ignore[return-value]


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
            static = {r.kernel: r.static_smem_bytes for r in self.compiled.resources}
            optin_max = _device_smem_optin(device)
            kernels = {}
            for k in kernel_infos(self.spec):
                total = static.get(k.name, 0) + k.smem_bytes
                if total > optin_max:
                    raise LaunchError(f"{k.name} shared memory", f"at most {optin_max} bytes per block on CUDA device "
                                      f"{device} (spec {self.spec.arch})", total)
                fn = module.get_function(k.name)
                if total > _DEFAULT_SMEM_LIMIT:  # opt in above 48 KiB, per kernel and device, before any launch
                    fn.max_dynamic_shared_size_bytes = k.smem_bytes
                kernels[k.name] = fn
            self._per_device[device] = kernels
        return kernels

    def launch(self, kernel: KernelInfo, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        import cupy
        import torch

        g, block, packed = prepare_launch(kernel, grid, args)
        device = _pointer_device(list(zip((t for t, _ in kernel.params), packed)))
        with cupy.cuda.Device(device), _cupy_stream(torch.cuda.current_stream(device), device):
            fn = self._kernels(device)[kernel.name]
            fn(g, block, packed, shared_mem=kernel.smem_bytes)


def _device_smem_optin(device: int) -> int:
    """The device's opt-in maximum of shared memory per block (bytes)."""
    import cupy

    runtime = cupy.cuda.runtime
    attr = getattr(runtime, "cudaDevAttrMaxSharedMemoryPerBlockOptin", _ATTR_SMEM_OPTIN)
    return int(runtime.deviceGetAttribute(attr, device))


def _pointer_device(values: list[tuple[str, Any]]) -> int:
    """The CUDA device holding the first non-null pointer argument (the tensors' device)."""
    import cupy

    for ctype, value in values:
        if ctype.endswith("*") and int(value):
            return int(cupy.cuda.runtime.pointerGetAttributes(int(value)).device)
    raise LaunchError("kernel arguments", "at least one non-null device pointer (the tensors' device)")


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
    """The cubin as a file (``cupy.RawModule`` loads files): in the cache dir, written once; in a
    private temp file when the cache is read-only (a shared cache that already holds the entry)."""
    import hashlib
    import tempfile

    from ..cache import atomic_write, cache_root
    from ..errors import CacheDirError

    name = f"{hashlib.sha256(cubin).hexdigest()}.cubin"
    try:
        path = cache_root("cubin") / name
        if not path.exists() or path.read_bytes() != cubin:
            atomic_write(path, cubin)
        return path
    except (OSError, CacheDirError):
        fd, tmp = tempfile.mkstemp(prefix="fagen-", suffix=f"-{name}")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        return Path(tmp)


@functools.lru_cache(maxsize=None)
def gpu_module(spec: KernelSpec) -> GpuModule:
    return GpuModule(spec)


def device_arch(device: Any) -> str:
    """The target arch whose cubins run on a torch CUDA device (``fagen.spec.arch_for_capability``)."""
    import torch

    from ..errors import SpecError
    from ..spec import ARCH_SMEM_OPTIN, arch_for_capability

    major, minor = torch.cuda.get_device_capability(device)
    arch = arch_for_capability((major, minor))
    if arch is None:
        raise SpecError(f"GPU compute capability {major}.{minor} runs none of fagen's targets {sorted(ARCH_SMEM_OPTIN)}")
    return arch
