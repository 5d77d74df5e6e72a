"""The host toolchain of the emulator: g++, the CUDA headers, libasan.

Found once per process and shared by the builder (compiles) and the
sanitized launcher (preloads libasan). Imports nothing else of the emulator.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from .errors import EmulatorBuildError, EmulatorError


@functools.cache
def cuda_include_dir() -> str:
    """Directory holding cuda_fp16.h / cuda_bf16.h (compiled in host mode): the same one NVRTC uses."""
    from ..nvrtc import include_dir

    try:
        found = include_dir()
    except Exception as exc:  # noqa: BLE001 - any failure means "not found"
        raise EmulatorBuildError(f"cannot locate the CUDA headers: {exc}") from exc
    # cuda_fp16.h -> vector_types.h -> crt/host_defines.h: NVRTC carries its own copy, g++ needs the file.
    # CUDA 13's wheels ship crt/ apart from the runtime headers (nvidia-cuda-crt).
    for header in ("cuda_fp16.h", "cuda_bf16.h", "crt/host_defines.h"):
        if not (Path(found) / header).is_file():
            fix = ("pip install 'nvidia-cuda-crt>=13.0'" if header.startswith("crt/") else
                   "pip install nvidia-cuda-runtime (or set FAGEN_CUDA_INCLUDE to a CUDA toolkit's include folder)")
            raise EmulatorBuildError(f"the CUDA headers at {found} lack {header}, which the emulator's g++ build "
                                     f"includes: {fix}")
    return str(found)


@functools.cache
def compiler() -> tuple[str, str]:
    """(path to g++, its identity string for the cache key)."""
    from ..settings import get_settings

    cxx = shutil.which(get_settings().cxx)
    if cxx is None:
        raise EmulatorBuildError(f"{get_settings().cxx} not found (set FAGEN_CXX to a C++17 compiler)")
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    machine = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, check=False).stdout
    return cxx, f"{cxx}|{out.splitlines()[0] if out else ''}|{machine.strip()}"


@functools.cache
def asan_runtime() -> str:
    """Path of g++'s libasan.so."""
    cxx, _ = compiler()
    out = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True,
                         check=False).stdout.strip()
    if not out or not os.path.isabs(out) or not os.path.exists(out):
        raise EmulatorError("libasan.so not found (g++ -print-file-name=libasan.so); install libasan")
    return out


@functools.cache
def linker_flags(cxx: str) -> tuple[str, ...]:
    """``-fuse-ld=gold`` when ``cxx`` can link with gold (it links a module about four times faster
    than GNU ld: a few hundredths of a second per build), else nothing (the default linker)."""
    try:
        proc = subprocess.run([cxx, "-fuse-ld=gold", "-Wl,--version"], capture_output=True, text=True,
                              check=False, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ()
    return ("-fuse-ld=gold",) if proc.returncode == 0 and "gold" in proc.stdout.lower() else ()
