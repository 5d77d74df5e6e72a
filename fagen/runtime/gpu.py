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
-> ``uint64`` (64-bit device addresses), after checking the value fits. A tensor map
(``CUtensorMap``, 128 bytes) is a one-element numpy array (:func:`tensor_map_arg`), the one
by-value form of more than 16 bytes that every allowed CuPy packs.

Launch limits checked before CuPy sees them (it casts grid dims to C ``int``
and clamps 0 to 1 silently): grid x in [1, 2**31-1], y and z in [1, 65535],
at most 1024 threads per block; dynamic shared memory is opted in with the
``max_dynamic_shared_size_bytes`` attribute (cuFuncSetAttribute) before the
first launch whenever static + dynamic exceeds the 48 KiB default, and a
kernel needing more than the device's opt-in maximum is refused.

CUDA versions, decided once at first use (:func:`ensure_toolchain`): the driver's CUDA
version, CuPy's and torch's CUDA runtime and the installed NVRTC wheel sets
(``fagen.nvrtc.toolkits``) give the NVRTC to compile with -- the newest whose major
the driver can load (NVRTC 13 cubins use an ELF ABI a CUDA 12 driver cannot read) --
or one line naming the ``pip install`` that fixes the setup (:class:`CudaSetupError`).
A device newer than every arch the chosen NVRTC knows gets PTX for the newest compute
capability it does know, JIT-compiled by the driver, with a one-line warning; a device
below sm_80 is refused (:func:`device_arch`).
"""
from __future__ import annotations

import functools
import math
import operator
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..abi import is_tensormap
from ..compiler import compile as compile_spec
from ..errors import FagenError, InputError
from ..plan import KernelInfo, plan_of
from ..spec import KernelSpec
from .args import LaunchArgs, pack

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


class CudaSetupError(FagenError, RuntimeError):
    """The CUDA driver, CuPy, torch and NVRTC on this machine do not fit together; the message
    is one line naming the install that fixes it."""


Version = tuple[int, int]


@dataclass(frozen=True)
class CudaVersions:
    """What decides the NVRTC: (major, minor) of each CUDA part (None where absent or unknown)."""

    driver: Version  # the CUDA version the driver supports (cuDriverGetVersion)
    nvrtc: tuple[Version, ...]  # the installed NVRTC wheel sets, newest first
    cupy: Version | None  # CuPy's CUDA runtime
    torch: Version | None  # torch.version.cuda
    cupy_wheels: tuple[str, ...] = ()  # the cupy-cuda* distributions installed (more than one breaks CuPy)


def _v(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


def decide_nvrtc(v: CudaVersions, pinned: int | None = None) -> int:
    """The CUDA major of the NVRTC to compile with, or :class:`CudaSetupError`.

    * CuPy and torch must not be built for a newer CUDA major than the driver supports (their
      own first CUDA call would fail with cudaErrorInsufficientDriver);
    * the NVRTC is the newest installed one whose major the driver supports (cubins of NVRTC N
      load on drivers of CUDA N.x; NVRTC 13's ELF ABI is unreadable to a CUDA 12 driver),
      ``pinned`` (the ``FAGEN_NVRTC`` folder's) when given and loadable.
    """
    drv = v.driver
    extra = f"pip install 'fagen[cuda{drv[0]}]'"
    if len(v.cupy_wheels) > 1:
        keep = f"cupy-cuda{drv[0]}x"
        drop = [w for w in v.cupy_wheels if w != keep] if keep in v.cupy_wheels else list(v.cupy_wheels)
        fix = f"pip uninstall -y {' '.join(drop)}" + ("" if keep in v.cupy_wheels else f" && {extra}")
        raise CudaSetupError(f"{len(v.cupy_wheels)} CuPy wheels are installed ({', '.join(v.cupy_wheels)}), which "
                             f"breaks import cupy; keep the one for the CUDA {_v(drv)} driver: {fix}")
    if v.cupy is None:
        raise CudaSetupError(f"CuPy is not installed (the CUDA {_v(drv)} driver wants CuPy for CUDA {drv[0]}): {extra}")
    if v.cupy[0] > drv[0]:
        raise CudaSetupError(f"CuPy is built for CUDA {_v(v.cupy)} but the driver supports CUDA {_v(drv)}: "
                             f"pip uninstall -y cupy-cuda{v.cupy[0]}x && {extra}")
    if v.torch is not None and v.torch[0] > drv[0]:
        raise CudaSetupError(f"torch is built for CUDA {_v(v.torch)} but the driver supports CUDA {_v(drv)}: "
                             f"install a torch build for CUDA {drv[0]}, then {extra}")
    usable = [n for n in v.nvrtc if n[0] <= drv[0]]
    if pinned is not None:
        if not any(n[0] == pinned for n in v.nvrtc):
            raise CudaSetupError(f"FAGEN_NVRTC holds no NVRTC for CUDA {pinned}")
        if pinned > drv[0]:
            raise CudaSetupError(f"FAGEN_NVRTC names NVRTC {pinned}, whose cubins a CUDA {_v(drv)} driver cannot "
                                 f"load: point it at a CUDA {drv[0]} set or unset it, and {extra}")
        return pinned
    if not usable:
        have = ", ".join(_v(n) for n in v.nvrtc) or "none"
        raise CudaSetupError(f"no NVRTC the CUDA {_v(drv)} driver can load is installed (found: {have}): {extra}")
    return max(usable)[0]


@functools.lru_cache(maxsize=1)
def _libcuda():
    """The CUDA driver library, loaded once (``OSError`` where there is none)."""
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def driver_version() -> Version | None:
    """The CUDA version the driver supports, from libcuda itself (None without a driver)."""
    import ctypes

    try:
        lib = _libcuda()
    except OSError:
        return None
    out = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(out)) != 0 or out.value <= 0:
        return None
    return out.value // 1000, (out.value % 1000) // 10


def _cupy_version() -> Version | None:
    try:
        import cupy

        n = int(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:  # noqa: BLE001 - not installed, or two CuPy wheels that break each other's import
        return None
    return n // 1000, (n % 1000) // 10


def _torch_version() -> Version | None:
    import torch

    cu = torch.version.cuda
    if not cu:
        return None
    major, minor, *_ = (int(x) for x in cu.split("."))
    return major, minor


def _cupy_wheels() -> tuple[str, ...]:
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    return tuple(sorted(n for n in names if re.fullmatch(r"cupy-cuda\d+x?", n)))


def installed_versions(driver: Version) -> CudaVersions:
    """The :class:`CudaVersions` of this process (NVRTC minors from the wheels' versions; without
    any wheel set, the version of the NVRTC cuda-pathfinder finds, e.g. a system CUDA install)."""
    from .. import nvrtc

    found = []
    for tk in nvrtc.toolkits():
        minor = int(tk.release.split(".")[1]) if tk.release else 0
        found.append((tk.major, minor))
    if not found:
        try:
            found.append(nvrtc.version())
        except Exception:  # noqa: BLE001 - no NVRTC at all: decide_nvrtc names the install
            pass
    return CudaVersions(driver, tuple(found), _cupy_version(), _torch_version(), _cupy_wheels())


_decided: list[int | None] = []


def reset_process_state() -> None:
    """Forget this process's NVRTC decision (:func:`ensure_toolchain`) and which PTX warnings were
    given: the next launch decides and warns again (after a driver or wheel change in a long-lived
    process, and in tests that stand in a fake driver)."""
    _decided.clear()
    _warned.clear()


def ensure_toolchain() -> int | None:
    """Decide the NVRTC once per process on a machine with a CUDA driver (see
    :func:`decide_nvrtc`) and select it; None without a driver (nothing to decide)."""
    if _decided:
        return _decided[0]
    from .. import compiler, nvrtc

    driver = driver_version()
    if driver is None:
        _decided.append(None)
        return None
    pinned_tk = nvrtc.chosen_toolkit() if nvrtc.get_pinned_folder() is not None else None
    major = decide_nvrtc(installed_versions(driver), pinned_tk.major if pinned_tk is not None else None)
    current = nvrtc.chosen_toolkit()
    wheel_set = any(tk.major == major for tk in nvrtc.toolkits())
    if wheel_set and (current is None or current.major != major):
        nvrtc.select(major)
        compiler.clear_memo()
    _decided.append(major)
    return major


def ptx_target_for(arch: str, supported: "frozenset[str] | set[str]",
                   capability: Version | None = None) -> str | None:
    """None when the NVRTC emits a cubin that runs (``arch`` is supported and, when the device's
    ``capability`` is given, of its major); else the ``compute_XY`` of the newest arch the NVRTC
    knows at or below both, whose PTX the driver JIT-compiles. :class:`CudaSetupError` if none."""
    from ..arch import arch_info, newest_at_or_below

    cap = arch_info(arch).capability
    runs = capability is None or (capability[0] == cap[0] and capability[1] >= cap[1])
    if arch in supported and runs:
        return None
    limit = min(cap, tuple(capability)) if capability is not None else cap
    best = newest_at_or_below(limit, set(supported))
    if best is None:
        raise CudaSetupError(f"the installed NVRTC knows no arch at or below {arch}: pip install 'fagen[cuda13]'")
    return arch_info(best).compute


def check_ptx_driver(driver: Version | None, nvrtc_version: Version) -> None:
    """PTX of NVRTC X.Y is JIT-compiled only by a driver for CUDA X.Y or newer (its PTX ISA
    version); :class:`CudaSetupError` naming the fix otherwise (None: no driver to ask)."""
    if driver is not None and tuple(driver) < tuple(nvrtc_version):
        raise CudaSetupError(f"PTX from NVRTC {_v(nvrtc_version)} needs a driver for CUDA {_v(nvrtc_version)} or "
                             f"newer, this one supports CUDA {_v(driver)}: update the driver, or pip install "
                             f"'nvidia-cuda-nvrtc-cu{driver[0]}=={driver[0]}.{driver[1]}.*'")


_warned: set[tuple[str, str]] = set()


def _warn_ptx(arch: str, target: str, capability: Version | None = None) -> None:
    """One warning line per (arch, target) and process: why PTX, and the install for native code."""
    from .. import nvrtc

    if (arch, target) in _warned:
        return
    _warned.add((arch, target))
    v = nvrtc.version()
    if capability is not None and arch in nvrtc.supported_archs():
        why = f"{arch} cubins do not run on this compute capability {capability[0]}.{capability[1]} device"
    else:
        why = f"NVRTC {v[0]}.{v[1]} has no {arch} target"
    warnings.warn(f"fagen: {why}; the driver JIT-compiles PTX for {target} "
                  f"(native code: {nvrtc.install_hint(13)})", RuntimeWarning, stacklevel=3)


#: One ``CUtensorMap`` as a numpy element: 128 opaque bytes.
TENSOR_MAP_DTYPE = np.dtype((np.void, 128))


def tensor_map_arg(raw: bytes) -> np.ndarray:
    """The 128 bytes of a ``CUtensorMap`` as the kernel argument CuPy passes by value: a numpy
    array of **one** 128-byte element (shape ``(1,)``), in its own 64-byte aligned buffer.

    Every CuPy fagen allows (``>=13.6``; the form dates from CuPy 10) packs a size-one
    ``numpy.ndarray`` as ``CNumpyArray``: the driver copies the parameter's bytes from the array's
    data pointer (``cupy/cuda/function.pyx``, ``_pointer``). A ``numpy.void`` *scalar* of 128 bytes
    does not work everywhere: CuPy 13.x maps scalars to 1/2/4/8/16-byte C integers and raises
    ``TypeError('Unsupported type')``, CuPy 14.0 copies scalars into a 64-byte buffer and fails an
    assertion; only 14.1+ takes it. ``tests/test_gpu_launch.py`` hands this form to the installed
    CuPy's own launcher."""
    if len(raw) != TENSOR_MAP_DTYPE.itemsize:
        raise LaunchError("tensor map", "the 128 bytes of a CUtensorMap", f"{len(raw)} bytes")
    buf = np.zeros(2 * TENSOR_MAP_DTYPE.itemsize, np.uint8)
    at = -buf.__array_interface__["data"][0] % 64  # CUtensorMap is declared 64-byte aligned
    buf[at:at + 128] = np.frombuffer(raw, np.uint8)
    return buf[at:at + 128].view(TENSOR_MAP_DTYPE)


def to_cuda_arg(ctype: str, value: Any, name: str = "") -> Any:
    """``value`` as the numpy scalar whose bytes are exactly the C parameter ``ctype``; for the
    tensor-map kind (:data:`fagen.abi.TENSORMAP`) the one-element array of :func:`tensor_map_arg`
    holding the ``CUtensorMap`` that :func:`encode_tensor_map` makes of a
    :class:`fagen.tma.TensorMapFields`."""
    label = name or ctype
    if is_tensormap(ctype):
        from ..tma import TensorMapFields

        if not isinstance(value, TensorMapFields):
            raise LaunchError(label, "fagen.tma.TensorMapFields (see fagen.tma.tensor_map_for)", type(value).__name__)
        return tensor_map_arg(encode_tensor_map(value))
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
    get = seen.get

    def convert(value: Any) -> Any:
        if type(value) in exact:
            found = get(value)
            if found is None:
                found = to_cuda_arg(ctype, value, name)
                if len(seen) >= 64:
                    seen.clear()
                seen[value] = found
            return found
        return to_cuda_arg(ctype, value, name)
    convert.memo = seen  # type: ignore[attr-defined]  # read inline by _planned_packer
    return convert


def _packer(kernel: KernelInfo, convert: list[Any] | None = None) -> Any:
    """One function of the argument dict giving the kernel's converted arguments in parameter
    order: a single tuple expression of per-parameter :func:`_converter` calls (no per-argument
    loop or generator on the launch path)."""
    scope: dict[str, Any] = {}
    items = []
    for i, (ctype, name) in enumerate(kernel.params):
        scope[f"c{i}"] = _converter(ctype, name) if convert is None else convert[i]
        items.append(f"c{i}(a[{name!r}])")
    body = f"({', '.join(items)},)" if items else "()"
    exec(f"def pack(a):\n    return {body}\n", scope)  # noqa: S102 - names from the ABI's own table
    return scope["pack"]


_converters: dict[int, tuple[KernelInfo, Any, list[Any]]] = {}


def _planned_packer(kernel: KernelInfo, convert: list[Any], constants: Mapping[str, Any]) -> Any:
    """:func:`_packer` for the arguments of one launch plan (:class:`~fagen.runtime.args.LaunchArgs`):
    the parameters ``constants`` holds converted here, once, and built into the tuple expression
    as constants; only the others are read and converted per call (an int the parameter's
    converter remembers taken from its memo inline)."""
    scope: dict[str, Any] = {}
    items = []
    for i, (_ctype, name) in enumerate(kernel.params):
        if name in constants:
            scope[f"k{i}"] = convert[i](constants[name])
            items.append(f"k{i}")
        else:  # an int remembered by the converter is read inline (no call), anything else converted
            scope[f"c{i}"], scope[f"m{i}"] = convert[i], convert[i].memo
            items.append(f"(m{i}[x{i}] if type(x{i} := a[{name!r}]) is int and x{i} in m{i} else c{i}(x{i}))")
    body = f"({', '.join(items)},)" if items else "()"
    exec(f"def pack(a):\n    return {body}\n", scope)  # noqa: S102 - names from the ABI's own table
    return scope["pack"]


_plan_packers: dict[tuple[int, int], tuple[KernelInfo, Mapping[str, Any], Any]] = {}


def cuda_args(kernel: KernelInfo, args: dict[str, Any]) -> tuple[Any, ...]:
    """The kernel's arguments in parameter order, each as :func:`to_cuda_arg` makes it. For a
    :class:`~fagen.runtime.args.LaunchArgs` the plan's constant arguments are converted on its
    first launch of ``kernel`` and reused; any error is the one the full conversion gives."""
    entry = _converters.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        convert = [_converter(t, n) for t, n in kernel.params]
        entry = (kernel, _packer(kernel, convert), convert)
        if len(_converters) > 4096:
            _converters.clear()
        _converters[id(kernel)] = entry
    constants = getattr(args, "constants", None) if type(args) is LaunchArgs else None
    if constants is not None:
        planned = _plan_packers.get((id(kernel), id(constants)))
        try:
            if planned is None or planned[0] is not kernel or planned[1] is not constants:
                planned = (kernel, constants, _planned_packer(kernel, entry[2], constants))
                if len(_plan_packers) > 4096:
                    _plan_packers.clear()
                _plan_packers[(id(kernel), id(constants))] = planned
            return planned[2](args)
        except (KeyError, LaunchError):
            pass  # the full conversion below raises the error, in parameter order
    try:
        return entry[1](args)
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
        from .. import nvrtc

        self.spec = spec
        ensure_toolchain()
        target = ptx_target_for(spec.arch, nvrtc.supported_archs())
        if target is not None:
            check_ptx_driver(driver_version(), nvrtc.version())
            _warn_ptx(spec.arch, target)
        self.compiled = compile_spec(spec, ptx_target=target)
        self._path = _cubin_path(self.compiled.cubin, ".ptx" if target else ".cubin")
        self._per_device: dict[int, dict[str, Any]] = {}

    def _image_for(self, device: int) -> Path:
        """The cubin, or PTX for a device whose major the spec's cubin does not run on."""
        from .. import nvrtc

        try:
            import torch

            cap = tuple(int(x) for x in torch.cuda.get_device_capability(device))
        except Exception:  # noqa: BLE001 - no torch CUDA (a launch recorded on a CPU machine)
            return self._path
        target = ptx_target_for(self.spec.arch, nvrtc.supported_archs(), cap)  # type: ignore[arg-type]
        if target == self.compiled.ptx_target:
            return self._path
        if target is not None:
            check_ptx_driver(driver_version(), nvrtc.version())
            _warn_ptx(self.spec.arch, target, cap)  # type: ignore[arg-type]
        mod = compile_spec(self.spec, ptx_target=target)
        return _cubin_path(mod.cubin, ".ptx" if target else ".cubin")

    def _kernels(self, device: int) -> dict[str, Any]:
        """Kernel handles on ``device`` (call with that device current)."""
        kernels = self._per_device.get(device)
        if kernels is None:
            import cupy

            module = cupy.RawModule(path=str(self._image_for(device)))
            static = {r.kernel: r.static_smem_bytes for r in self.compiled.resources}
            optin_max = _device_smem_optin(device)
            kernels = {}
            for k in plan_of(self.spec).kernels:
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


def _cubin_path(cubin: bytes, suffix: str = ".cubin") -> Path:
    """The cubin as a file (``cupy.RawModule`` loads files): in the cache dir, written once; in a
    private temp file when the cache is read-only (a shared cache that already holds the entry)."""
    import hashlib
    import tempfile

    from ..cache import atomic_write, cache_root
    from ..errors import CacheDirError

    name = f"{hashlib.sha256(cubin).hexdigest()}{suffix}"
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
    """The spec arch for a torch CUDA device: the one whose cubins run on it
    (``fagen.spec.arch_for_capability``); for a device newer than every arch of the table, the
    newest arch below it (the module then loads PTX, see :class:`GpuModule`). Below sm_80:
    :class:`~fagen.errors.SpecError`."""
    import torch

    return arch_for_device_capability(tuple(int(x) for x in torch.cuda.get_device_capability(device)))


def arch_for_device_capability(capability: Version) -> str:
    """:func:`device_arch` for a compute capability."""
    from ..arch import MIN_CAPABILITY, newest_at_or_below
    from ..errors import SpecError
    from ..spec import ARCH_SMEM_OPTIN, arch_for_capability

    major, minor = capability
    if (major, minor) < MIN_CAPABILITY:
        raise SpecError(f"GPU compute capability {major}.{minor} is below sm_80 (fagen's kernels need mma.sync "
                        f"m16n8k16 with bf16 and cp.async); its targets are {list(ARCH_SMEM_OPTIN)}")
    arch = arch_for_capability((major, minor)) or newest_at_or_below((major, minor))
    assert arch is not None  # every capability >= 8.0 has one
    return arch


# --------------------------------------------------------------------------- tensor maps
# cuTensorMapEncodeTiled is called in the CUDA driver itself (libcuda, through ctypes): the
# driver is present wherever a kernel can run, CuPy's public API does not expose this entry
# point, and the CUDA Python driver bindings would be one more dependency for one call.
_CU_TENSOR_MAP_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle
_CU_L2_PROMOTION_128B = 2  # CUtensorMapL2promotion: CU_TENSOR_MAP_L2_PROMOTION_L2_128B


@functools.lru_cache(maxsize=1)
def tensor_map_encoder():
    """The driver's ``cuTensorMapEncodeTiled`` with its ctypes signature (a :class:`NoGPUError` without
    libcuda); :func:`encode_tensor_map` calls whatever this module attribute holds at the time."""
    import ctypes

    try:
        lib = _libcuda()
    except OSError as exc:
        from ..errors import NoGPUError

        raise NoGPUError(f"encoding a tensor map needs the CUDA driver (libcuda.so.1): {exc}") from None
    fn = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode_tensor_map(fields: Any) -> bytes:
    """The 128-byte ``CUtensorMap`` of ``fields`` (a :class:`fagen.tma.TensorMapFields`), from the
    driver's ``cuTensorMapEncodeTiled`` (interleave none, L2 promotion 128B, OOB fill zero or
    NaN as the fields say). Raises :class:`LaunchError` naming the driver's error code."""
    import ctypes

    rank = fields.rank
    out = (ctypes.c_ubyte * 192)()
    addr = ctypes.addressof(out) + (-ctypes.addressof(out) % 64)  # CUtensorMap is 64-byte aligned
    dims = (ctypes.c_uint64 * rank)(*fields.dims)
    strides = (ctypes.c_uint64 * max(1, rank - 1))(*(fields.strides or (0,)))
    box = (ctypes.c_uint32 * rank)(*fields.box)
    es = (ctypes.c_uint32 * rank)(*fields.element_strides)
    status = tensor_map_encoder()(addr, fields.data_type, rank, fields.global_address, dims, strides, box, es, 0,
                              _CU_TENSOR_MAP_SWIZZLE[fields.swizzle], _CU_L2_PROMOTION_128B,
                              int(fields.oob_fill == "nan"))
    if status != 0:
        raise LaunchError("tensor map", "fields cuTensorMapEncodeTiled accepts", f"CUresult {status} for {fields}")
    return ctypes.string_at(addr, 128)
