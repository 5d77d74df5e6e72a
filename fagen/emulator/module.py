"""A compiled emulator module and its launches."""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import stacks
from .errors import EmulatorError, EmulatorLaunchError
from .racereport import SmemBuffers, race_error
from .sanitize import run_in_child
from .signature import KernelSig, code_of, ctypes_scalar, pointer_value, scalar_value, tensormap_value
from .status import STATUS_OK, STATUS_RACE, Dim3, raise_for_status

_ERRLEN = 8192

Args = Sequence[Any] | Mapping[str, Any]


def dim3(value: int | Sequence[int], what: str) -> Dim3:
    """``4`` or ``(4,)`` or ``(4, 2)`` -> ``(4, 1, 1)`` / ``(4, 2, 1)``."""
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and d >= 1 for d in dims):
        raise EmulatorLaunchError(f"{what}: expected 1 to 3 positive ints, got {value!r}")
    return (dims + (1, 1))[:3]  # type: ignore[return-value]


def ordered_args(sig: KernelSig, args: Args) -> list[Any]:
    """Arguments in signature order, from a sequence or a name -> value mapping."""
    names = [n for _, n in sig.params]
    if isinstance(args, Mapping):
        missing = [n for n in names if n not in args]
        extra = [n for n in args if n not in names]
        if missing or extra:
            raise EmulatorLaunchError(f"kernel '{sig.name}': missing arguments {missing}, unknown {extra}")
        return [args[n] for n in names]
    args = list(args)
    if len(args) != len(names):
        raise EmulatorLaunchError(f"kernel '{sig.name}' takes {len(names)} arguments ({', '.join(names)}), "
                                  f"got {len(args)}")
    return args


class EmuModule:
    """Kernels compiled for the CPU emulator (made by :func:`fagen.emulator.build`)."""

    def __init__(self, path: Path, kernels: Sequence[KernelSig], *, sanitized: bool, racecheck: bool = False) -> None:
        self.path = Path(path)
        self.sanitized = sanitized
        self.racecheck = racecheck
        self.kernels: dict[str, KernelSig] = {k.name: k for k in kernels}
        self._codes = {k.name: [code_of(t) for t, _ in k.params] for k in kernels}
        self._lib: ctypes.CDLL | None = None
        self._fns: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._launch_lock = threading.Lock()  # lending stacks and launching are one step
        if not sanitized:
            self._load()

    def __repr__(self) -> str:
        return (f"EmuModule({str(self.path)!r}, kernels={list(self.kernels)}, sanitized={self.sanitized}, "
                f"racecheck={self.racecheck})")

    @property
    def source_path(self) -> Path:
        """The kernel source as compiled (lines in error messages refer to it)."""
        return self.path.with_suffix(".cu")

    def sig(self, name: str) -> KernelSig:
        try:
            return self.kernels[name]
        except KeyError:
            raise EmulatorLaunchError(f"no kernel '{name}' in this module (have {list(self.kernels)})") from None

    def _load(self) -> ctypes.CDLL:
        with self._lock:
            if self._lib is None:
                if self.sanitized and not _asan_loaded():
                    raise EmulatorError(
                        "this module is built with AddressSanitizer, which is not loaded in this process; "
                        "launch it with run_sanitized() (a child process with libasan preloaded)")
                self._lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
                last = self._lib.fagen_emu_last_block
                last.argtypes, last.restype = [ctypes.POINTER(ctypes.c_uint)], None
                stacks.declare(self._lib)
            return self._lib

    def _fn(self, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self._load(), f"fagen_launch_{name}")
            fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                                                 ctypes.c_char_p, ctypes.c_size_t]
            fn.restype = ctypes.c_int
            self._fns[name] = fn
        return fn

    def launch(self, name: str, grid: int | Sequence[int], block: int | Sequence[int], smem_bytes: int,
               args: Args, *, smem_buffers: SmemBuffers | None = None) -> None:
        """Runs kernel ``name`` over ``grid`` x ``block`` threads, to completion.

        ``args`` in signature order (or by parameter name): pointers as
        addresses (ints; torch tensors / numpy arrays are accepted and their
        data pointer used), scalars as Python numbers. Raises
        :class:`EmulatorDeadlockError`, :class:`EmulatorKernelError` or
        :class:`EmulatorLaunchError`. The GIL is released while it runs.
        A racecheck module raises :class:`EmulatorRaceError` on a hazard; ``smem_buffers``
        (``(name, offset, nbytes)`` per buffer of the dynamic shared memory) names the buffer.
        """
        sig = self.sig(name)
        g, b = dim3(grid, "grid"), dim3(block, "block")
        if not isinstance(smem_bytes, int) or smem_bytes < 0:
            raise EmulatorLaunchError(f"smem_bytes: expected an int >= 0, got {smem_bytes!r}")
        holders: list[Any] = []
        addresses: list[int] = []
        for (ctype, pname), code, value in zip(sig.params, self._codes[name], ordered_args(sig, args)):
            what = f"kernel '{name}' argument '{pname}' ({ctype})"
            if code == "M":  # a tensor map by value: a 64-byte aligned FaTensorMap
                buf, addr = tensormap_value(value, what)
                holders.append(buf)
                addresses.append(addr)
                continue
            if code == "P":
                holders.append(ctypes.c_void_p(pointer_value(value, what)))
            else:
                holders.append(ctypes_scalar(code)(scalar_value(code, value, what)))
            addresses.append(ctypes.addressof(holders[-1]))
        argv = (ctypes.c_void_p * max(1, len(addresses)))(*addresses)
        err = ctypes.create_string_buffer(_ERRLEN)
        fn, lib = self._fn(name), self._load()
        with self._launch_lock, stacks.borrowed(lib, b[0] * b[1] * b[2]) as (base, count):
            lib.fagen_emu_use_stacks(base, count)
            try:
                status = fn(*g, *b, smem_bytes, argv, err, _ERRLEN)
            finally:
                lib.fagen_emu_use_stacks(None, 0)
        if status != STATUS_OK:
            where = (ctypes.c_uint * 3)()
            self._lib.fagen_emu_last_block(where)  # type: ignore[union-attr]
            if status == STATUS_RACE and self.racecheck:
                raise race_error(lib, self.path, err.value.decode(errors="replace"), name, tuple(where),  # type: ignore[arg-type]
                                 smem_buffers)
            raise_for_status(status, err.value.decode(errors="replace"), name, tuple(where))  # type: ignore[arg-type]

    def race_markers(self) -> int:
        """Racecheck modules: how many times the last launch's threads passed
        ``fagen_emu_race_marker()`` (see docs/emulator.md, "Racecheck")."""
        if not self.racecheck:
            raise EmulatorError("race_markers needs a module built with build(..., racecheck=True)")
        fn = self._load().fagen_emu_race_markers
        fn.argtypes, fn.restype = [], ctypes.c_ulonglong
        return int(fn())

    def race_gate(self, gate: int) -> None:
        """Select the barrier gate ``fagen_emu_race_gate(gate)`` that skips its barrier in the
        following launches (in a racecheck module a marker takes its place); -1 opens every gate,
        -2 makes every gate a marker that keeps its barrier (racecheck: which gates a launch
        passes)."""
        if isinstance(gate, bool) or not isinstance(gate, int) or gate < -2:
            raise EmulatorError(f"race_gate: gate must be an int >= -2, got {gate!r}")
        fn = self._load().fagen_emu_race_gate_select
        fn.argtypes, fn.restype = [ctypes.c_int], None
        fn(gate)

    def race_marker_lines(self) -> set[int]:
        """Racecheck modules: the kernel-source lines of the markers the last launch passed."""
        if not self.racecheck:
            raise EmulatorError("race_marker_lines needs a module built with build(..., racecheck=True)")
        fn = self._load().fagen_emu_race_marker_lines
        fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_int), ctypes.c_uint], ctypes.c_uint
        buf = (ctypes.c_int * 4096)()
        n = int(fn(buf, 4096))
        return {int(buf[i]) for i in range(min(n, 4096))}

    def run_sanitized(self, name: str, grid: int | Sequence[int], block: int | Sequence[int], smem_bytes: int,
                      args: Args, *, timeout: float | None = 600.0) -> dict[str, Any]:
        """Runs one launch bounds-checked, in a child process with AddressSanitizer.

        Pointer arguments are numpy arrays (or ``None``): each is copied into
        its own exact-size malloc in the child, so any access past its end
        hits a redzone and raises :class:`EmulatorMemoryError` with the ASan
        report. A tensor map (:class:`fagen.tma.TensorMapFields`) must point into
        one of the pointer arguments' arrays: the child points it at its copy. After the launch the buffers are copied back into the given
        arrays (when writable) and also returned, by parameter name.
        Needs a module built with ``sanitize=True``.
        """
        if not self.sanitized:
            raise EmulatorError("run_sanitized needs a module built with build(..., sanitize=True)")
        sig = self.sig(name)
        return run_in_child(self.path, sig, self._codes[name], dim3(grid, "grid"), dim3(block, "block"),
                            smem_bytes, ordered_args(sig, args), timeout=timeout)


def _asan_loaded() -> bool:
    try:
        ctypes.CDLL(None).__asan_init  # noqa: B018 - probing for the symbol
        return True
    except AttributeError:
        return False
