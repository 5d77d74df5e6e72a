"""Load and launch: one interface, two backends, chosen by tensor device.

* CUDA tensors -> :mod:`fagen.runtime.gpu` (the cubin from :func:`fagen.compile`,
  loaded with ``cupy.RawModule``, launched on torch's current stream).
* CPU tensors -> :mod:`fagen.runtime.cpu` (the same rendered source built by
  the SIMT emulator).
Arguments are packed by name from :mod:`fagen.abi`, so launchers never restate
a kernel's parameter order.
"""
from __future__ import annotations

from typing import Any, Protocol

from ..plan import KernelInfo
from ..spec import KernelSpec
from .args import pack

__all__ = ["Module", "get_module", "pack"]


class Module(Protocol):
    def launch(self, kernel: KernelInfo, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        """Launch ``kernel`` with ``args`` (name -> value; pointers as ints)."""


def get_module(spec: KernelSpec, device_type: str) -> Module:
    """The loaded module of ``spec`` for ``device_type`` ("cuda" or "cpu"), memoised."""
    if device_type == "cuda":
        from .gpu import gpu_module

        return gpu_module(spec)
    if device_type == "cpu":
        from .cpu import cpu_module

        return cpu_module(spec)
    raise ValueError(f"unsupported device type {device_type!r}")
