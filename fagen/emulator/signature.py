"""Kernel signatures: the parameter list the launch wrappers are generated from."""
from __future__ import annotations

import ctypes
import operator
import re
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import EmulatorLaunchError


@dataclass(frozen=True)
class KernelSig:
    """An ``extern "C" __global__`` kernel: its name and ``(ctype, name)`` params.

    ``ctype`` is C++ spelling, e.g. ``"const __half*"`` or ``"long long"``.
    """

    name: str
    params: tuple[tuple[str, str], ...]


class SigLike(Protocol):
    name: str
    params: Any


# Scalar C types a kernel parameter may have, with their ctypes twins and the
# struct-module code the sanitizer child uses.
_SCALARS: dict[str, tuple[type, str]] = {
    "int": (ctypes.c_int, "i"),
    "unsigned int": (ctypes.c_uint, "I"),
    "unsigned": (ctypes.c_uint, "I"),
    "long long": (ctypes.c_longlong, "q"),
    "long long int": (ctypes.c_longlong, "q"),
    "unsigned long long": (ctypes.c_ulonglong, "Q"),
    "unsigned long long int": (ctypes.c_ulonglong, "Q"),
    "float": (ctypes.c_float, "f"),
    "double": (ctypes.c_double, "d"),
    "bool": (ctypes.c_bool, "?"),
}
_INT_RANGE = {"i": (-(2**31), 2**31 - 1), "I": (0, 2**32 - 1), "q": (-(2**63), 2**63 - 1), "Q": (0, 2**64 - 1)}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


#: A tensor map by value (fagen.abi.TENSORMAP), without __grid_constant__ (meaningless on the CPU).
TENSORMAP_CTYPE = "const FaTensorMap"


def normalize_ctype(ctype: str) -> str:
    """``"const __half* __restrict__"`` -> ``"const __half*"``; collapses spaces; drops
    ``__grid_constant__``."""
    t = ctype.replace("__restrict__", " ").replace("__grid_constant__", " ").replace("*", " * ")
    return " ".join(t.split()).replace(" *", "*")


def code_of(ctype: str) -> str:
    """One-letter kind of a parameter: ``"P"`` for any pointer, ``"M"`` for a tensor map
    (``FaTensorMap`` by value), else a struct code."""
    t = normalize_ctype(ctype)
    if t.endswith("*"):
        return "P"
    if t in (TENSORMAP_CTYPE, "FaTensorMap"):
        return "M"
    if t.startswith("const "):
        t = t[len("const "):]
    try:
        return _SCALARS[t][1]
    except KeyError:
        raise EmulatorLaunchError(f"unsupported kernel parameter type {ctype!r}") from None


def as_sig(k: SigLike) -> KernelSig:
    """Validates a (duck-typed) signature and returns it as a :class:`KernelSig`."""
    name = str(k.name)
    if not _IDENT.match(name):
        raise EmulatorLaunchError(f"invalid kernel name {name!r}")
    params = tuple((str(t), str(n)) for t, n in k.params)
    for t, _ in params:
        code_of(t)
    return KernelSig(name, params)


def pointer_value(value: object, what: str) -> int:
    """An address from an int, ``None`` (null), a torch tensor or a numpy array."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    data_ptr = getattr(value, "data_ptr", None)
    if callable(data_ptr):
        return int(data_ptr())
    iface = getattr(value, "__array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    raise EmulatorLaunchError(f"{what}: expected an address (int), got {type(value).__name__}")


def scalar_value(code: str, value: object, what: str) -> int | float | bool:
    """Checks a scalar argument against its C type (no silent wrap-around)."""
    if code in "fd":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise EmulatorLaunchError(f"{what}: expected a float, got {type(value).__name__}")
        return float(value)
    if code == "?":
        return bool(value)
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = operator.index(value)  # numpy integers
        except TypeError:
            raise EmulatorLaunchError(f"{what}: expected an int, got {type(value).__name__}") from None
    lo, hi = _INT_RANGE[code]
    if not lo <= value <= hi:
        raise EmulatorLaunchError(f"{what}: {value} does not fit the parameter's C type")
    return value


def tensormap_value(value: object, what: str) -> Any:
    """A 64-byte aligned ctypes buffer holding the emulator's FaTensorMap for ``value`` (a
    :class:`fagen.tma.TensorMapFields`, or its 128 packed bytes)."""
    data = value.emulator_bytes() if hasattr(value, "emulator_bytes") else value
    if not isinstance(data, (bytes, bytearray)) or len(data) != 128:
        raise EmulatorLaunchError(f"{what}: expected fagen.tma.TensorMapFields (or its 128 emulator bytes), "
                                  f"got {type(value).__name__}")
    raw = (ctypes.c_ubyte * 192)()
    offset = -ctypes.addressof(raw) % 64
    ctypes.memmove(ctypes.addressof(raw) + offset, bytes(data), 128)
    return raw, ctypes.addressof(raw) + offset


def ctypes_scalar(code: str) -> type:
    return next(ct for ct, c in _SCALARS.values() if c == code)
