"""fagen.tma: the fields of a tiled tensor map (one computation for cuTensorMapEncodeTiled and the
emulator's FaTensorMap), their checks (typed errors naming the argument), the ABI's tensor-map
parameter kind and its packing on both launch paths."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from fagen import abi, tma
from fagen.emulator import signature
from fagen.emulator.errors import EmulatorLaunchError
from fagen.errors import InputError, InputTypeError
from fagen.runtime import gpu


def test_fields_are_innermost_first_with_byte_strides() -> None:
    x = torch.zeros(4, 6, 40, 64, dtype=torch.bfloat16)
    f = tma.tensor_map_for(x[:, :, :, :], (1, 2, 16, 64), swizzle=128)
    assert f.dims == (64, 40, 6, 4)
    assert f.strides == (128, 40 * 128, 6 * 40 * 128)
    assert f.box == (64, 16, 2, 1) and f.element_strides == (1, 1, 1, 1)
    assert (f.rank, f.elem_bytes, f.data_type, f.box_bytes) == (4, 2, 9, 2 * 16 * 64 * 2)
    assert f.global_address == x.data_ptr()


def test_emulator_bytes_are_the_faTensorMap_struct() -> None:
    x = np.zeros((10, 32), np.float32)
    f = tma.tensor_map_for(x, (4, 32), swizzle=128, element_strides=(2, 1), oob_fill="nan")
    raw = f.emulator_bytes()
    assert len(raw) == 128
    fields = struct.unpack("<6IQ5I5I5II4Q", raw)
    assert fields[:7] == (tma.EMULATOR_MAGIC, 2, 4, 128, 1, 7, x.__array_interface__["data"][0])
    assert fields[7:12] == (32, 10, 1, 1, 1) and fields[12:17] == (32, 4, 1, 1, 1)
    assert fields[17:22] == (1, 2, 1, 1, 1) and fields[23:] == (128, 0, 0, 0)
    assert f.box_bytes == 2 * 32 * 4


@pytest.mark.parametrize("kwargs,argument", [
    (dict(box=(8, 32)), "box"),  # 64 bytes with a 128B swizzle
    (dict(box=(8, 64), swizzle=48), "swizzle"),
    (dict(box=(300, 64)), "box"),
    (dict(box=(8, 64), element_strides=(9, 1)), "element_strides"),
    (dict(box=(8, 64), oob_fill="inf"), "oob_fill"),
    (dict(box=(8, 64, 1)), "box"),
])
def test_bad_fields_name_the_argument(kwargs: dict, argument: str) -> None:
    x = np.zeros((16, 64), np.float16)
    kwargs = {"swizzle": 128, **kwargs}
    with pytest.raises(InputError) as err:
        tma.tensor_map_for(x, **kwargs)
    assert err.value.argument == argument


def test_bad_tensors_name_the_argument() -> None:
    with pytest.raises(InputError, match="strides"):
        tma.tensor_map_for(np.zeros((4, 70), np.float16), (4, 64), swizzle=128)  # 140-byte rows
    with pytest.raises(InputError, match="contiguous innermost"):
        tma.tensor_map_fields(1024, "float16", (4, 64), (1, 4), (4, 64))
    with pytest.raises(InputError, match="address"):
        tma.tensor_map_fields(1032, "float16", (4, 64), (64, 1), (4, 64))
    with pytest.raises(InputTypeError, match="dtype"):
        tma.tensor_map_fields(1024, "float8", (4, 64), (64, 1), (4, 64))
    with pytest.raises(InputError, match="oob_fill"):
        tma.tensor_map_fields(1024, "int32", (4, 64), (64, 1), (4, 32), oob_fill="nan")
    with pytest.raises(InputTypeError, match="tensor"):
        tma.tensor_map_for([1, 2, 3], (1,))


def test_the_abi_kind_on_both_launch_paths() -> None:
    assert abi.is_tensormap("const  __grid_constant__ FaTensorMap") and not abi.is_tensormap("const float*")
    assert signature.code_of(abi.TENSORMAP) == "M"
    assert signature.normalize_ctype(abi.TENSORMAP) == "const FaTensorMap"
    f = tma.tensor_map_for(np.zeros((16, 64), np.float16), (16, 64), swizzle=128)
    buf, addr = signature.tensormap_value(f, "arg")
    assert addr % 64 == 0
    with pytest.raises(EmulatorLaunchError, match="arg: expected fagen.tma.TensorMapFields"):
        signature.tensormap_value(7, "arg")
    with pytest.raises(gpu.LaunchError, match="tmap: expected fagen.tma.TensorMapFields"):
        gpu.to_cuda_arg(abi.TENSORMAP, b"\0" * 128, "tmap")
