"""CPU emulator for fagen's CUDA kernels.

The same rendered CUDA source NVRTC compiles is compiled by g++ on top of a
shim (``shim.h``) and a fiber runtime (``runtime.h``): every CUDA thread of a
block is a user-level fiber, barriers and warp collectives are cooperative
switch points, blocks run one after another. See docs/emulator.md.

    mod = build(source, [KernelSig("k", (("float*", "out"), ("int", "n")))])
    mod.launch("k", grid=(4, 1, 1), block=(128, 1, 1), smem_bytes=0, args=[out.data_ptr(), n])
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .builder import build, clear_memo
from .errors import (
    EmulatorBuildError,
    EmulatorDeadlockError,
    EmulatorError,
    EmulatorKernelError,
    EmulatorLaunchError,
    EmulatorMemoryError,
    EmulatorRaceError,
)
from .module import Args, EmuModule
from .signature import KernelSig, SigLike


def run_sanitized(source: str, kernels: Sequence[KernelSig | SigLike], name: str, grid: int | Sequence[int],
                  block: int | Sequence[int], smem_bytes: int, args: Args, *,
                  cache_dir: Path | str | None = None, timeout: float | None = 600.0) -> dict[str, Any]:
    """Builds ``source`` with AddressSanitizer and runs one bounds-checked launch.

    Pointer arguments are numpy arrays (copied in and back out); returns the
    output buffers by parameter name. See :meth:`EmuModule.run_sanitized`.
    """
    module = build(source, kernels, sanitize=True, cache_dir=cache_dir)
    return module.run_sanitized(name, grid, block, smem_bytes, args, timeout=timeout)


__all__ = [
    "build", "clear_memo", "run_sanitized", "EmuModule", "KernelSig",
    "EmulatorError", "EmulatorBuildError", "EmulatorLaunchError", "EmulatorDeadlockError",
    "EmulatorKernelError", "EmulatorMemoryError", "EmulatorRaceError",
]
