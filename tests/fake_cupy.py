"""A recording stand-in for CuPy (tests/test_gpu_launch.py, tests/test_cuda_env.py): it packs kernel
arguments the way CuPy does (numpy scalars by their own itemsize, a bare ``int`` as 8 bytes, a ``float``
as float64, a one-element numpy array by value) and takes grid/block only as tuples, like its Cython
signature; loads, attribute sets and launches are logged."""
from __future__ import annotations

import contextlib
import types

import numpy as np

_CUPY_SCALARS = {np.dtype(c).type for c in "?bhilqBHILQefdFD"}


def cupy_bytes(x: object) -> bytes:
    """The bytes CuPy's kernel launcher hands the driver for one argument."""
    if type(x) not in _CUPY_SCALARS:
        if isinstance(x, bool):
            x = np.bool_(x)
        elif isinstance(x, int):
            x = np.int64(x)
        elif isinstance(x, float):
            x = np.float64(x)
        else:
            raise TypeError(f"Unsupported type {type(x)}")
    return x.tobytes()


class FakeCupy:
    """Records loads, attribute sets and launches; packs arguments as CuPy does."""

    def __init__(self, optin: int = 232448, device: int = 0) -> None:
        self.log: list[tuple] = []
        log = self.log

        class Function:
            def __init__(self, name: str) -> None:
                object.__setattr__(self, "name", name)

            def __setattr__(self, key: str, value: object) -> None:
                log.append(("attr", self.name, key, value))
                object.__setattr__(self, key, value)

            def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
                if type(grid) is not tuple or type(block) is not tuple or type(args) is not tuple:
                    raise TypeError("grid, block and args must be tuples")  # CuPy's Cython signature
                log.append(("launch", self.name, grid, block, [cupy_bytes(a) for a in args],
                            [type(a) for a in args], shared_mem))

        class RawModule:
            def __init__(self, *, path: str) -> None:
                log.append(("load", path))

            def get_function(self, name: str) -> Function:
                return Function(name)

        @contextlib.contextmanager
        def dev(index: int):
            log.append(("device", index))
            yield

        @contextlib.contextmanager
        def from_external(s):
            log.append(("stream", s.__cuda_stream__()[1]))
            yield

        runtime = types.SimpleNamespace(
            pointerGetAttributes=lambda ptr: types.SimpleNamespace(device=device),
            deviceGetAttribute=lambda attr, d: log.append(("getattr", attr, d)) or optin,
            cudaDevAttrMaxSharedMemoryPerBlockOptin=97)
        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(Device=dev, Stream=types.SimpleNamespace(from_external=from_external),
                                          runtime=runtime)
