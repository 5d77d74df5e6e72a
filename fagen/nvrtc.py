"""Thin NVRTC access: locate the pip-wheel NVRTC and CUDA headers, compile to a cubin.

Uses cuda-pathfinder (a CuPy dependency) to find libnvrtc and the header
directory, and CuPy's low-level NVRTC binding, which needs no GPU.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _nvrtc():
    import cuda.pathfinder as pathfinder

    pathfinder.load_nvidia_dynamic_lib("nvrtc")
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


def include_dir() -> Path:
    """Directory holding cuda_fp16.h / cuda_bf16.h: the settings' override, else the
    nvidia-cuda-runtime wheel's (found by cuda-pathfinder). Used by NVRTC and the emulator."""
    from .settings import get_settings

    override = get_settings().cuda_include
    return override if override is not None else _wheel_include_dir()


@functools.lru_cache(maxsize=1)
def _wheel_include_dir() -> Path:
    import cuda.pathfinder as pathfinder

    found = pathfinder.find_nvidia_header_directory("cudart")
    if not found:
        raise FileNotFoundError("cuda-pathfinder found no CUDA runtime headers (install nvidia-cuda-runtime)")
    return Path(found)


@functools.lru_cache(maxsize=1)
def version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())  # type: ignore[return-value]


#: Headers the rendered source includes (directly or through cuda_fp16/bf16.h).
_HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp", "vector_types.h")


def headers_digest(directory: Path | None = None) -> str:
    """sha256 of the CUDA headers the kernels include (NVRTC and the emulator), so a header
    update is a cache miss for both."""
    return _headers_digest(str(directory if directory is not None else include_dir()))


@functools.lru_cache(maxsize=8)
def _headers_digest(directory: str) -> str:
    h = hashlib.sha256()
    for name in _HEADERS:
        p = Path(directory) / name
        h.update(name.encode())
        h.update(p.read_bytes() if p.exists() else b"<missing>")
    return h.hexdigest()


@dataclass(frozen=True)
class NvrtcResult:
    ok: bool
    cubin: bytes
    log: str


def compile_cubin(source: str, filename: str, options: list[str]) -> NvrtcResult:
    nv = _nvrtc()
    prog = nv.createProgram(source, filename, [], [])
    try:
        try:
            nv.compileProgram(prog, [*options, f"-I{include_dir()}"])
            ok = True
        except nv.NVRTCError:
            ok = False
        log = nv.getProgramLog(prog)
        if isinstance(log, bytes):
            log = log.decode(errors="replace")
        log = log.replace("\x00", "")
        cubin = nv.getCUBIN(prog) if ok else b""
        return NvrtcResult(ok, bytes(cubin), log)
    finally:
        nv.destroyProgram(prog)
