"""CPU emulator for fagen's CUDA kernels.

The same rendered CUDA source NVRTC compiles is compiled by g++ on top of a
shim (``shim.h``) and a fiber runtime (``runtime.h``): every CUDA thread of a
block is a user-level fiber, barriers and warp collectives are cooperative
switch points, blocks run one after another. See docs/emulator.md.

    mod = build(source, [KernelSig("k", (("float*", "out"), ("int", "n")))])
    mod.launch("k", grid=(4, 1, 1), block=(128, 1, 1), smem_bytes=0, args=[out.data_ptr(), n])

``build(..., level="ptx", arch="sm_90a")`` runs the level below instead: NVRTC's PTX of the source
for that target, translated to C++ (``fagen.emulator.ptx``; ``build_ptx`` takes PTX text).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .builder import build as _build_source
from .builder import clear_memo as _clear_source_memo
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
from .ptx import PtxHazardError, PtxModule, PtxUnsupportedError, build_ptx
from .ptx.build import build_source_ptx
from .ptx.build import clear_memo as _clear_ptx_memo
from .signature import KernelSig, SigLike

#: The emulator's levels: the CUDA source compiled by g++ ("source"), or NVRTC's PTX for a real
#: target translated to C++ ("ptx"; docs/emulator.md, "Two levels: source and PTX").
LEVELS = ("source", "ptx")


def build(source: str, kernels: Sequence[KernelSig | SigLike], *, level: str = "source", arch: str | None = None,
          sanitize: bool = False, debug: bool = False, racecheck: bool = False, extra_flags: Sequence[str] = (),
          cache_dir: Path | str | None = None, counters: bool = False) -> EmuModule:
    """Compiles ``source`` for the emulator (or fetches it from the cache).

    ``level="source"`` (default): the CUDA source itself, with ``FAGEN_EMULATOR`` defined, on the
    shim (see :func:`fagen.emulator.builder.build` for ``sanitize``, ``debug``, ``racecheck``,
    ``extra_flags``). ``level="ptx"``: NVRTC compiles the source to PTX for ``arch``'s virtual
    target (``sm_90a`` -> ``compute_90a``; default ``sm_90a``) and the PTX is translated and built
    (:func:`fagen.emulator.ptx.build_ptx`); its launches raise
    :class:`~fagen.emulator.ptx.PtxHazardError` on PTX-level hazards; ``racecheck=True`` tracks the
    translated PTX's shared-memory accesses (reports name PTX lines). Sanitizer builds are
    source-level only. ``counters=True`` (PTX level only): a build that counts shared-memory
    wavefronts and global sectors per memory instruction (``module.counters()``).
    """
    if level == "source":
        if counters:
            raise ValueError("build: counters are counted at level='ptx'")
        if arch is not None:
            raise ValueError("build: arch is for level='ptx' (the source level runs no target's code)")
        return _build_source(source, kernels, sanitize=sanitize, debug=debug, racecheck=racecheck,
                             extra_flags=extra_flags, cache_dir=cache_dir)
    if level == "ptx":
        if sanitize:
            raise EmulatorBuildError("build: sanitize instruments the source level; level='ptx' does not take it")
        return build_source_ptx(source, kernels, arch=arch or "sm_90a", debug=debug, extra_flags=extra_flags,
                                cache_dir=cache_dir, counters=counters, racecheck=racecheck)
    raise ValueError(f"build: level must be one of {LEVELS}, got {level!r}")


def clear_memo() -> None:
    """Forgets the in-process memo of built modules, both levels (the disk cache stays)."""
    _clear_source_memo()
    _clear_ptx_memo()


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
    "build", "build_ptx", "clear_memo", "run_sanitized", "EmuModule", "PtxModule", "KernelSig", "LEVELS",
    "PtxHazardError", "PtxUnsupportedError",
    "EmulatorError", "EmulatorBuildError", "EmulatorLaunchError", "EmulatorDeadlockError",
    "EmulatorKernelError", "EmulatorMemoryError", "EmulatorRaceError",
]
