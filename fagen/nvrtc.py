"""Thin NVRTC access: locate the pip-wheel NVRTC and CUDA headers, compile to a cubin.

The NVRTC is one of the pip-wheel sets found on ``sys.path`` (or in the folder
``FAGEN_NVRTC`` names): CUDA 13 (``nvidia-cuda-nvrtc``) or CUDA 12
(``nvidia-cuda-nvrtc-cu12``), each with the headers of its own release
(:func:`toolkits`, :func:`chosen_toolkit`; the GPU runtime picks, with :func:`select`, the one
the driver can load). Without a wheel set, cuda-pathfinder finds libnvrtc and the
header directory (a system CUDA install). NVRTC's C API is called through
``ctypes`` (no CuPy, no GPU needed). The cubin is read with
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
class Toolkit:
    """One NVRTC with the CUDA headers of the same release: a pip-wheel set (CUDA 13:
    ``nvidia/cu13/{lib,include}``; CUDA 12: ``nvidia/cuda_nvrtc/lib`` + ``nvidia/cuda_runtime/include``)."""

    major: int
    library: Path
    include: Path
    release: str | None = None  # the nvidia-cuda-nvrtc wheel's version beside it, e.g. "12.9.86"


#: (library relative to a site-packages folder, its headers, CUDA major), newest first.
_WHEEL_LAYOUTS = (
    ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/include", 13),
    ("nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cuda_runtime/include", 12),
)

_selected: list[int | None] = [None]  # the major pinned in-process by select()


def _toolkits_in(folder: Path) -> list[Toolkit]:
    out = []
    for lib, inc, major in _WHEEL_LAYOUTS:
        if (folder / lib).is_file() and (folder / inc / "cuda_fp16.h").is_file():
            dists = sorted(folder.glob(f"nvidia_cuda_nvrtc*-{major}.*.dist-info"))
            release = dists[-1].name.removesuffix(".dist-info").split("-")[1] if dists else None
            out.append(Toolkit(major, folder / lib, folder / inc, release))
    return out


def _pinned_folder() -> Path | None:
    from .settings import get_settings

    return get_settings().nvrtc


def get_pinned_folder() -> Path | None:
    """The folder ``FAGEN_NVRTC`` names (None when unset)."""
    return _pinned_folder()


def toolkits() -> tuple[Toolkit, ...]:
    """The NVRTC wheel sets this process can use, one per CUDA major, newest major first:
    the folder ``FAGEN_NVRTC`` names (wheels installed with ``pip install --target``) and the
    ``sys.path`` folders, in that order (the first set of a major wins)."""
    import sys

    pinned = _pinned_folder()
    folders = ([pinned] if pinned is not None else []) + [Path(p) for p in sys.path if p]
    return _toolkits(tuple(str(f) for f in folders))


@functools.lru_cache(maxsize=8)
def _toolkits(folders: tuple[str, ...]) -> tuple[Toolkit, ...]:
    found: dict[int, Toolkit] = {}
    for f in folders:
        for tk in _toolkits_in(Path(f)):
            found.setdefault(tk.major, tk)
    return tuple(found[m] for m in sorted(found, reverse=True))


def select(major: int | None) -> None:
    """Compile with the NVRTC of CUDA ``major`` from now on in this process (None: the default
    choice again). Forgets every memoised fact of the previous one; callers that memoise
    compiled modules (``fagen.compiler.clear_memo``) clear theirs too."""
    if major is not None and not any(tk.major == major for tk in toolkits()):
        have = [tk.major for tk in toolkits()]
        raise NvrtcError(f"no NVRTC for CUDA {major} is installed (found CUDA {have or 'none'}): "
                         f"{install_hint(major)}")
    _selected[0] = major
    clear_toolkit()


def selected() -> int | None:
    """The CUDA major :func:`select` pinned in this process (None: the default choice)."""
    return _selected[0]


def install_hint(major: int, minimum: tuple[int, int] | None = None) -> str:
    """The one command that installs fagen's CUDA ``major`` set (README, "CUDA"); with
    ``minimum``, the upgrade of that major's NVRTC wheels to at least that release."""
    if minimum is None:
        return f"pip install 'fagen[cuda{major}]'"
    suffix = "" if major >= 13 else f"-cu{major}"
    want = f">={minimum[0]}.{minimum[1]}"
    return f"pip install -U 'nvidia-cuda-nvrtc{suffix}{want}' 'nvidia-cuda-runtime{suffix}{want}'"


def chosen_toolkit() -> Toolkit | None:
    """The wheel set compiles use: the major :func:`select` pinned, else the folder
    ``FAGEN_NVRTC`` names, else the newest major found; None when no wheel set is found
    (then cuda-pathfinder finds an NVRTC, e.g. of a system CUDA install)."""
    found = toolkits()
    major = _selected[0]
    if major is not None:
        return next(tk for tk in found if tk.major == major)
    pinned = _pinned_folder()
    if pinned is not None:
        own = _toolkits_in(pinned)
        if not own:
            raise NvrtcError(f"FAGEN_NVRTC={pinned} holds no NVRTC wheel set (expected "
                             f"{' or '.join(lib for lib, _i, _m in _WHEEL_LAYOUTS)} under it)")
        return own[0]
    return found[0] if found else None


def selection_id() -> str:
    """What names the NVRTC compiles use without loading it (a part of the compile index key)."""
    tk = chosen_toolkit()
    return f"{tk.library}" if tk is not None else "pathfinder"


def clear_toolkit() -> None:
    """Forget the loaded NVRTC and every fact derived from it (next use loads the chosen one)."""
    _toolkits.cache_clear()
    for fn in (_nvrtc, version, full_version, toolchain_id, _wheel_include_dir, supported_archs):
        getattr(fn, "cache_clear", lambda: None)()  # (a test may have replaced one)
    clear_caches()


@dataclass(frozen=True)
class _Nvrtc:
    lib: ctypes.CDLL
    path: Path | None


@functools.lru_cache(maxsize=1)
def _nvrtc() -> _Nvrtc:
    tk = chosen_toolkit()
    if tk is not None:
        # NVRTC dlopens its builtins library by soname at the first compile; a wheel set's own copy,
        # loaded first by path, is the one it then finds (else the loader's search path decides, and a
        # set outside it fails with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE).
        for builtins in sorted(tk.library.parent.glob("libnvrtc-builtins.so.*")):
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        lib, path = ctypes.CDLL(str(tk.library)), tk.library
    else:
        import cuda.pathfinder as pathfinder

        loaded = pathfinder.load_nvidia_dynamic_lib("nvrtc")
        if loaded.abs_path:
            lib = ctypes.CDLL(loaded.abs_path)
        else:  # already loaded by the process from somewhere pathfinder did not report
            lib = ctypes.CDLL(None, handle=loaded._handle_uint)  # noqa: SLF001
        path = Path(loaded.abs_path) if loaded.abs_path else None
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    ip = ctypes.POINTER(ctypes.c_int)
    sigs = {
        "nvrtcCreateProgram": [ctypes.POINTER(vp), cp, cp, ctypes.c_int, ctypes.POINTER(cp), ctypes.POINTER(cp)],
        "nvrtcCompileProgram": [vp, ctypes.c_int, ctypes.POINTER(cp)],
        "nvrtcDestroyProgram": [ctypes.POINTER(vp)],
        "nvrtcGetProgramLogSize": [vp, ctypes.POINTER(sz)],
        "nvrtcGetProgramLog": [vp, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [vp, ctypes.POINTER(sz)],
        "nvrtcGetCUBIN": [vp, ctypes.c_char_p],
        "nvrtcGetPTXSize": [vp, ctypes.POINTER(sz)],
        "nvrtcGetPTX": [vp, ctypes.c_char_p],
        "nvrtcVersion": [ip, ip],
        "nvrtcGetNumSupportedArchs": [ip],
        "nvrtcGetSupportedArchs": [ip],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
    return _Nvrtc(lib, path)


@functools.lru_cache(maxsize=1)
def supported_archs() -> frozenset[str]:
    """The spec archs (fagen.arch.ARCHS) the loaded NVRTC can emit SASS for
    (``nvrtcGetSupportedArchs``; an ``a`` target when its generic one is there and the
    release is new enough for it)."""
    from .arch import ARCHS

    lib = _nvrtc().lib
    n = ctypes.c_int()
    _check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    arr = (ctypes.c_int * max(n.value, 1))()
    _check(lib.nvrtcGetSupportedArchs(arr), "nvrtcGetSupportedArchs")
    sms = set(arr[: n.value])
    have = version()
    return frozenset(name for name, a in ARCHS.items() if a.sm in sms and have >= a.nvrtc_min)


def _check(status: int, call: str) -> None:
    if status != 0:
        msg = _nvrtc().lib.nvrtcGetErrorString(status)
        raise NvrtcError(f"{call} failed: {msg.decode() if msg else status}")


def library_path() -> Path | None:
    """The libnvrtc file in use (None when the process had it loaded from elsewhere)."""
    return _nvrtc().path


def include_dir() -> Path:
    """Directory holding cuda_fp16.h / cuda_bf16.h: the settings' override, else the chosen
    NVRTC wheel set's (:func:`chosen_toolkit`), else what cuda-pathfinder finds. Used by NVRTC
    and the emulator."""
    from .settings import get_settings

    override = get_settings().cuda_include
    return override if override is not None else _wheel_include_dir()


@functools.lru_cache(maxsize=1)
def _wheel_include_dir() -> Path:
    tk = chosen_toolkit()
    if tk is not None:
        return tk.include
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
    tk = chosen_toolkit()
    if tk is not None and tk.release and tk.release.split(".")[:2] == [str(major), str(minor)]:
        return ".".join(tk.release.split(".")[:3])
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
    """What identifies the compiler for the cache: full version (so NVRTC 12 and 13 never share an
    entry) and the library's build id."""
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


def ptx_of(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> bytes:
    """The program's PTX (without the terminating NUL)."""
    n = ctypes.c_size_t()
    _check(lib.nvrtcGetPTXSize(prog, ctypes.byref(n)), "nvrtcGetPTXSize")
    buf = ctypes.create_string_buffer(max(n.value, 1))
    _check(lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
    return buf.raw[: n.value].rstrip(b"\0")


def compile_cubin(source: str, filename: str, options: list[str], arch: str | None = None,
                  *, ptx: bool = False) -> NvrtcResult:
    """Compile ``source``; on success the cubin is checked to be a complete ELF (for ``arch``).
    ``ptx=True`` (options naming a ``-arch=compute_XY``): the result holds the PTX text instead,
    for the driver to JIT-compile."""
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
        if ptx:
            text = ptx_of(lib, prog)
            if not text.lstrip().startswith((b"//", b".version")):
                raise NvrtcError(f"NVRTC returned no PTX for {filename}")
            return NvrtcResult(True, text, log)
        cubin = cubin_of(lib, prog)
        try:
            elf.check_cubin(cubin, arch)
        except elf.ElfError as exc:
            raise NvrtcError(f"NVRTC returned an unusable cubin for {filename}: {exc}") from None
        return NvrtcResult(True, cubin, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
