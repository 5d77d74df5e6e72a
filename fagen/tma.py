"""Tensor maps (TMA descriptors): the one computation of their fields, for the GPU and the emulator.

A Hopper kernel takes a tiled tensor map by value (ABI kind ``tensormap``:
``const __grid_constant__ FaTensorMap``, see :mod:`fagen.abi`). :func:`tensor_map_fields`
turns a tensor's address, shape and strides (torch order: outermost first, strides in
elements) plus a box into the driver's logical fields (innermost first, byte strides) and
checks them against the rules of ``cuTensorMapEncodeTiled`` and fagen's own: a swizzled
map's box is exactly one swizzle span wide (the smem image wgmma's descriptors read).
On a GPU, :func:`fagen.runtime.gpu.encode_tensor_map` hands the fields to the driver; on
the CPU, :meth:`TensorMapFields.emulator_bytes` packs the same fields into the emulator's
128-byte ``FaTensorMap`` (fagen/emulator/hopper.h).

>>> import numpy as np
>>> x = np.zeros((128, 64), np.float16)
>>> f = tensor_map_for(x, box=(64, 64), swizzle=128)
>>> f.dims, f.strides, f.box, f.box_bytes
((64, 128), (128,), (64, 64), 8192)
>>> len(f.emulator_bytes())
128
"""
from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InputError, InputTypeError

__all__ = ["TensorMapFields", "tensor_map_fields", "tensor_map_for", "layout_fits", "DTYPES", "EMULATOR_MAGIC"]

#: dtype name -> (CUtensorMapDataType value, bytes per element).
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (0, 1), "uint16": (1, 2), "uint32": (2, 4), "int32": (3, 4), "uint64": (4, 8), "int64": (5, 8),
    "float16": (6, 2), "float32": (7, 4), "float64": (8, 8), "bfloat16": (9, 2),
}
_FLOATS = {"float16", "float32", "float64", "bfloat16"}
SWIZZLES: dict[int, int] = {0: 0, 32: 1, 64: 2, 128: 3}  # span in bytes -> CUtensorMapSwizzle
EMULATOR_MAGIC = 0x6D744146  # "FAtm", FaTensorMap::magic in fagen/emulator/hopper.h
_EMU = struct.Struct("<6IQ5I5I5II4Q")  # FaTensorMap's fields, in order (128 bytes)


@dataclass(frozen=True)
class TensorMapFields:
    """The logical fields of a tiled tensor map, innermost dimension first."""

    global_address: int
    dtype: str
    dims: tuple[int, ...]  # elements
    strides: tuple[int, ...]  # bytes, of dims 1..rank-1
    box: tuple[int, ...]  # elements
    element_strides: tuple[int, ...]
    swizzle: int  # bytes: 0, 32, 64 or 128
    oob_fill: str  # "zero" or "nan"

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def elem_bytes(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def data_type(self) -> int:
        """The ``CUtensorMapDataType`` value."""
        return DTYPES[self.dtype][0]

    @property
    def box_bytes(self) -> int:
        """Bytes one load writes to shared memory (and counts toward complete_tx), OOB elements included."""
        return math.prod(-(-b // e) for b, e in zip(self.box, self.element_strides)) * self.elem_bytes

    def emulator_bytes(self) -> bytes:
        """The emulator's ``FaTensorMap`` (128 bytes)."""
        pad = lambda xs, n, fill: tuple(xs) + (fill,) * (n - len(xs))  # noqa: E731
        return _EMU.pack(EMULATOR_MAGIC, self.rank, self.elem_bytes, self.swizzle, int(self.oob_fill == "nan"),
                         self.data_type, self.global_address, *pad(self.dims, 5, 1), *pad(self.box, 5, 1),
                         *pad(self.element_strides, 5, 1), 0, *pad(self.strides, 4, 0))


def _ints(name: str, value: Any, n: int | None = None) -> tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        raise InputTypeError(name, "a sequence of ints", type(value).__name__) from None
    if any(isinstance(v, bool) or not hasattr(v, "__index__") for v in out):
        raise InputTypeError(name, "a sequence of ints", out)
    out = tuple(int(v) for v in out)
    if n is not None and len(out) != n:
        raise InputError(name, f"{n} entries (one per dimension)", len(out))
    return out


def _byte_strides(shape: tuple[int, ...], strides: tuple[int, ...], eb: int) -> tuple[int, ...] | None:
    """The map's byte strides of dims 1..rank-1 (innermost first), or None where a tensor map cannot
    have them: each a positive multiple of 16 below 2^40. A dimension of one element is never
    stepped along (its only in-bounds coordinate is 0), so whatever its stride (torch leaves any
    value there, 0 included) the map gets the dense one: the span of the dims inside it."""
    out: list[int] = []
    inner = eb  # bytes between consecutive elements of the dimension inside the current one
    for extent_in, extent, stride in zip(reversed(shape[1:]), reversed(shape[:-1]), reversed(strides[:-1])):
        b = -(-extent_in * inner // 16) * 16 if extent == 1 else stride * eb
        if b <= 0 or b % 16 or b >= 2**40:
            return None
        out.append(b)
        inner = b
    return tuple(out)


def layout_fits(shape: Sequence[int], strides: Sequence[int], elem_bytes: int, address: int | None = None) -> bool:
    """Whether a tensor map can describe a tensor of ``shape`` and element ``strides`` (torch order)
    at ``address`` (None: not checked): the innermost stride 1, the outer ones as
    :func:`tensor_map_fields` requires (a broadcast dimension, stride 0 over more than one element,
    does not fit; neither does a row of 68 halves), the address 16-byte aligned. The launchers
    copy a tensor that does not fit (``Family.tma_tensors``), so no family fails where another
    would not."""
    shape_t, strides_t = tuple(int(x) for x in shape), tuple(int(x) for x in strides)
    if not shape_t or len(strides_t) != len(shape_t) or (strides_t[-1] != 1 and shape_t[-1] != 1):
        return False
    if address is not None and address % 16:
        return False
    return _byte_strides(shape_t, strides_t, elem_bytes) is not None


def tensor_map_fields(address: int, dtype: str, shape: Sequence[int], strides: Sequence[int], box: Sequence[int], *,
                      swizzle: int = 0, element_strides: Sequence[int] | None = None,
                      oob_fill: str = "zero") -> TensorMapFields:
    """Fields of a tiled tensor map over a tensor of ``shape`` with element ``strides`` (torch
    order, outermost first; the last stride must be 1) starting at ``address``, loading boxes of
    ``box`` elements (same order). ``swizzle`` is the smem swizzle span in bytes (0, 32, 64,
    128): the box's innermost extent must then be exactly that many bytes. ``oob_fill``: what
    out-of-bounds elements of a load become ("zero", or "nan" for floating-point dtypes).
    Raises :class:`~fagen.errors.InputError` / :class:`~fagen.errors.InputTypeError` naming
    the argument whose value cuTensorMapEncodeTiled (or the emulator) cannot take."""
    if dtype not in DTYPES:
        raise InputTypeError("dtype", f"one of {sorted(DTYPES)}", repr(dtype))
    if isinstance(address, bool) or not hasattr(address, "__index__"):
        raise InputTypeError("address", "an int (device or host address)", type(address).__name__)
    address = int(address)
    shape_t = _ints("shape", shape)
    rank = len(shape_t)
    if not 1 <= rank <= 5:
        raise InputError("shape", "1 to 5 dimensions", rank)
    strides_t = _ints("strides", strides, rank)
    box_t = _ints("box", box, rank)
    es_t = _ints("element_strides", element_strides, rank) if element_strides is not None else (1,) * rank
    eb = DTYPES[dtype][1]
    if not 0 < address < 2**64 or address % 16:
        raise InputError("address", "a non-null 16-byte aligned address", hex(address))
    if any(not 1 <= s <= 2**32 for s in shape_t):
        raise InputError("shape", "every extent in [1, 2^32]", shape_t)
    if strides_t[-1] != 1:
        raise InputError("strides", "a contiguous innermost dimension (last stride 1)", strides_t)
    byte_strides = _byte_strides(shape_t, strides_t, eb)
    if byte_strides is None:
        raise InputError("strides", "outer strides positive, multiples of 16 bytes and below 2^40 bytes "
                         "(a dimension of one element: any)", tuple(strides_t))
    if any(not 1 <= b <= 256 for b in box_t):
        raise InputError("box", "every extent in [1, 256]", box_t)
    if any(not 1 <= e <= 8 for e in es_t):
        raise InputError("element_strides", "every stride in [1, 8]", es_t)
    if swizzle not in SWIZZLES or isinstance(swizzle, bool):
        raise InputError("swizzle", "0, 32, 64 or 128 (bytes)", swizzle)
    if oob_fill not in ("zero", "nan"):
        raise InputError("oob_fill", "'zero' or 'nan'", repr(oob_fill))
    if oob_fill == "nan" and dtype not in _FLOATS:
        raise InputError("oob_fill", f"'zero' for the integer dtype {dtype}", "'nan'")
    inner_bytes = -(-box_t[-1] // es_t[-1]) * eb
    if inner_bytes % 16:
        raise InputError("box", "an innermost extent of a multiple of 16 bytes", f"{inner_bytes} bytes")
    if swizzle and inner_bytes != swizzle:
        raise InputError("box", f"an innermost extent of exactly {swizzle} bytes (the swizzle span)",
                         f"{inner_bytes} bytes")
    return TensorMapFields(global_address=address, dtype=dtype, dims=tuple(reversed(shape_t)), strides=byte_strides,
                           box=tuple(reversed(box_t)), element_strides=tuple(reversed(es_t)), swizzle=swizzle,
                           oob_fill=oob_fill)


_NUMPY_DTYPES = {"float16": "float16", "float32": "float32", "float64": "float64", "uint8": "uint8",
                 "uint16": "uint16", "uint32": "uint32", "int32": "int32", "uint64": "uint64", "int64": "int64"}


def tensor_map_for(tensor: Any, box: Sequence[int], *, swizzle: int = 0, element_strides: Sequence[int] | None = None,
                   oob_fill: str = "zero") -> TensorMapFields:
    """:func:`tensor_map_fields` of a torch tensor (CPU or CUDA) or a numpy array."""
    if hasattr(tensor, "data_ptr") and hasattr(tensor, "stride"):  # torch
        dtype = str(tensor.dtype).removeprefix("torch.")
        return tensor_map_fields(int(tensor.data_ptr()), dtype, tuple(tensor.shape), tuple(tensor.stride()), box,
                                 swizzle=swizzle, element_strides=element_strides, oob_fill=oob_fill)
    iface = getattr(tensor, "__array_interface__", None)
    if iface is None:
        raise InputTypeError("tensor", "a torch tensor or a numpy array", type(tensor).__name__)
    name = str(tensor.dtype)
    if name not in _NUMPY_DTYPES:
        raise InputTypeError("tensor", f"an array of one of {sorted(_NUMPY_DTYPES)}", name)
    strides = tuple(s // tensor.itemsize for s in tensor.strides)
    if any(s * tensor.itemsize != b for s, b in zip(strides, tensor.strides)):
        raise InputError("tensor", "strides that are whole elements", tensor.strides)
    return tensor_map_fields(int(iface["data"][0]), name, tuple(tensor.shape), strides, box, swizzle=swizzle,
                             element_strides=element_strides, oob_fill=oob_fill)
