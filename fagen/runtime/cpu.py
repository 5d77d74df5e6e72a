"""CPU backend: the rendered kernel text, built and run by the SIMT emulator."""
from __future__ import annotations

import functools
from typing import Any

from ..renderer import KernelInfo, render
from ..spec import KernelSpec
from . import pack


class CpuModule:
    def __init__(self, spec: KernelSpec) -> None:
        from ..emulator import build

        self.spec = spec
        self.rendered = render(spec)
        self._emu = build(self.rendered.source, self.rendered.kernels)

    def launch(self, kernel: KernelInfo, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        values = [v for _, v in pack(kernel, args)]
        self._emu.launch(kernel.name, grid, kernel.block, kernel.smem_bytes, values)


@functools.lru_cache(maxsize=None)
def cpu_module(spec: KernelSpec) -> CpuModule:
    return CpuModule(spec)
