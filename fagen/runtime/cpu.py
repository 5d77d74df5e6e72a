"""CPU backend: the rendered kernel text, built and run by the SIMT emulator."""
from __future__ import annotations

import functools
from typing import Any

from ..renderer import KernelInfo, render
from ..spec import KernelSpec
from . import pack


#: g++ flags of each emulator thread order (see fagen/emulator/runtime.h).
SCHEDULE_FLAGS = {"forward": (), "reverse": ("-DFAGEN_EMU_REVERSE_SCHEDULE",)}


class CpuModule:
    def __init__(self, spec: KernelSpec, schedule: str = "forward") -> None:
        from ..emulator import build

        self.spec = spec
        self.rendered = render(spec)
        self._emu = build(self.rendered.source, self.rendered.kernels, extra_flags=SCHEDULE_FLAGS[schedule])

    def launch(self, kernel: KernelInfo, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        values = [v for _, v in pack(kernel, args)]
        self._emu.launch(kernel.name, grid, kernel.block, kernel.smem_bytes, values)


def cpu_module(spec: KernelSpec) -> CpuModule:
    """The emulator build of ``spec`` in the settings' thread order (memoised)."""
    from ..settings import get_settings

    return _cpu_module(spec, get_settings().emu_schedule)


@functools.lru_cache(maxsize=None)
def _cpu_module(spec: KernelSpec, schedule: str) -> CpuModule:
    return CpuModule(spec, schedule)
