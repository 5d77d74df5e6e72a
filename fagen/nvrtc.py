"""Thin NVRTC access: locate the pip-wheel NVRTC and CUDA headers, compile to a cubin.

cuda-pathfinder finds libnvrtc and the header directory; NVRTC's C API is
called through ``ctypes`` (no CuPy, no GPU needed). The cubin is read with
``nvrtcGetCUBINSize`` + ``nvrtcGetCUBIN`` (the whole buffer, every byte) and
checked to be a complete ELF before anyone stores it.

Cache identity of the toolchain: :func:`toolchain_id` (the full NVRTC version
such as ``13.5.37`` from the wheel's metadata, plus the library's GNU build
id) and :func:`headers_digest` (every CUDA header the kernels can include,
found by following ``#include`` lines from the headers the source names).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import elf
from .errors import FagenError

#: Headers the rendered kernels include (the emulator adds nothing else from the CUDA dir).
ROOT_HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "vector_types.h")
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.M)


class NvrtcError(FagenError, RuntimeError):
    """An NVRTC API call failed, or returned an unusable cubin (a compile error is a
    :class:`~fagen.errors.CompileError`, with the log)."""


@dataclass(frozen=True)
class _Nvrtc:
    lib: ctypes.CDLL
    path: Path | None


@functools.lru_cache(maxsize=1)
def _nvrtc() -> _Nvrtc:
    import cuda.pathfinder as pathfinder

    loaded = pathfinder.load_nvidia_dynamic_lib("nvrtc")
    if loaded.abs_path:
        lib = ctypes.CDLL(loaded.abs_path)
    else:  # already loaded by the process from somewhere pathfinder did not report
        lib = ctypes.CDLL(None, handle=loaded._handle_uint)  # noqa: SLF001
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    sigs = {
        "nvrtcCreateProgram": [ctypes.POINTER(vp), cp, cp, ctypes.c_int, ctypes.POINTER(cp), ctypes.POINTER(cp)],
        "nvrtcCompileProgram": [vp, ctypes.c_int, ctypes.POINTER(cp)],
        "nvrtcDestroyProgram": [ctypes.POINTER(vp)],
        "nvrtcGetProgramLogSize": [vp, ctypes.POINTER(sz)],
        "nvrtcGetProgramLog": [vp, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [vp, ctypes.POINTER(sz)],
        "nvrtcGetCUBIN": [vp, ctypes.c_char_p],
        "nvrtcVersion": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
    return _Nvrtc(lib, Path(loaded.abs_path) if loaded.abs_path else None)


def _check(status: int, call: str) -> None:
    if status != 0:
        msg = _nvrtc().lib.nvrtcGetErrorString(status)
        raise NvrtcError(f"{call} failed: {msg.decode() if msg else status}")


def library_path() -> Path | None:
    """The libnvrtc file in use (None when the process had it loaded from elsewhere)."""
    return _nvrtc().path


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
    """(major, minor) as reported by ``nvrtcVersion``."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_nvrtc().lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


@functools.lru_cache(maxsize=1)
def full_version() -> str:
    """The NVRTC release, e.g. ``13.5.37``: the wheel's version when it matches the loaded
    library's major.minor, else ``major.minor`` alone (a toolkit install; the build id
    in :func:`toolchain_id` still tells releases apart)."""
    from importlib import metadata

    major, minor = version()
    for dist in ("nvidia-cuda-nvrtc", f"nvidia-cuda-nvrtc-cu{major}"):
        try:
            v = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        parts = v.split(".")
        if parts[:2] == [str(major), str(minor)]:
            return ".".join(parts[:3])
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=1)
def toolchain_id() -> str:
    """What identifies the compiler for the cache: full version and the library's build id."""
    path = library_path()
    bid = elf.build_id(path) if path is not None else None
    if bid is None and path is not None:
        st = path.stat()
        bid = f"size={st.st_size},mtime={st.st_mtime_ns}"
    return f"nvrtc {full_version()} build-id {bid}"


def header_files(directory: Path | None = None, roots: tuple[str, ...] = ROOT_HEADERS) -> tuple[Path, ...]:
    """Every file under ``directory`` reachable by ``#include`` from ``roots`` (sorted).

    A superset of what the preprocessor opens: includes inside ``#if`` branches not
    taken are followed too, so any header change NVRTC could see is in the set.
    """
    return _header_files(str(directory if directory is not None else include_dir()), roots)


@functools.lru_cache(maxsize=16)
def _header_files(directory: str, roots: tuple[str, ...]) -> tuple[Path, ...]:
    base = Path(directory)
    seen: dict[Path, None] = {}
    todo = [(base, name) for name in roots]
    while todo:
        here, name = todo.pop()
        for cand in (here / name, base / name):
            if cand.is_file():
                path = Path(os.path.normpath(cand))
                if path not in seen:
                    seen[path] = None
                    todo += [(path.parent, m.decode()) for m in _INCLUDE.findall(path.read_bytes())]
                break
    return tuple(sorted(seen))


def headers_digest(directory: Path | None = None, roots: tuple[str, ...] = ROOT_HEADERS) -> str:
    """sha256 over (relative path, content) of :func:`header_files`, so a change to any
    CUDA header the kernels can see is a cache miss (NVRTC and the emulator)."""
    directory = Path(directory if directory is not None else include_dir())
    return _headers_digest(str(directory), roots)


@functools.lru_cache(maxsize=16)
def _headers_digest(directory: str, roots: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in roots:
        h.update(b"root\0" + name.encode() + b"\0")
    for path in _header_files(directory, roots):
        data = path.read_bytes()
        h.update(os.path.relpath(path, directory).encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def clear_caches() -> None:
    """Forget memoised header sets and digests (after editing headers in-process)."""
    _header_files.cache_clear()
    _headers_digest.cache_clear()


@dataclass(frozen=True)
class NvrtcResult:
    ok: bool
    cubin: bytes
    log: str


def _program_log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    n = ctypes.c_size_t()
    _check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n)), "nvrtcGetProgramLogSize")
    buf = ctypes.create_string_buffer(max(n.value, 1))
    _check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return buf.raw[: n.value].decode(errors="replace").replace("\x00", "")


def cubin_of(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> bytes:
    """All ``nvrtcGetCUBINSize`` bytes of the program's cubin."""
    n = ctypes.c_size_t()
    _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "nvrtcGetCUBINSize")
    buf = ctypes.create_string_buffer(max(n.value, 1))
    _check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
    return buf.raw[: n.value]


def compile_cubin(source: str, filename: str, options: list[str], arch: str | None = None) -> NvrtcResult:
    """Compile ``source``; on success the cubin is checked to be a complete ELF (for ``arch``)."""
    lib = _nvrtc().lib
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in [*options, f"-I{include_dir()}"]]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        log = _program_log(lib, prog)
        if status == 6:  # NVRTC_ERROR_COMPILATION: the log says why
            return NvrtcResult(False, b"", log)
        _check(status, "nvrtcCompileProgram")
        cubin = cubin_of(lib, prog)
        try:
            elf.check_cubin(cubin, arch)
        except elf.ElfError as exc:
            raise NvrtcError(f"NVRTC returned an unusable cubin for {filename}: {exc}") from None
        return NvrtcResult(True, cubin, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
