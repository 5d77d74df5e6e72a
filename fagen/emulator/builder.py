"""Compiling kernel sources for the CPU emulator, with an on-disk cache.

The translation unit is ``runtime.h`` + ``shim.h`` + ``#define FAGEN_EMULATOR 1``
+ the rendered kernel source (under ``#line 1 "<stem>.cu"``, so reported lines
are lines of the source) + one generated launch wrapper per kernel. g++ turns
it into a shared object cached as ``<cache>/<stem>.so``, where ``stem`` is a
prefix of the sha256 over everything that determines the binary. Next to it:
``<stem>.so.sha256`` (a truncated or corrupt .so is rebuilt, never loaded),
``<stem>.cpp`` (the whole TU) and ``<stem>.cu`` (the kernel source), which is
what gdb shows when stepping through kernel code.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import threading
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import NamedTuple

from .. import cache
from ..nvrtc import headers_digest
from ..settings import EMU_OPT_LEVELS, get_settings
from .errors import EmulatorBuildError
from .module import EmuModule
from .signature import KernelSig, SigLike, as_sig, normalize_ctype
from .toolchain import compiler, cuda_include_dir, linker_flags

_log = logging.getLogger(__name__)  # one INFO line per g++ build (silent unless configured)
_memo: dict[tuple[str, str], EmuModule] = {}
_memo_lock = threading.Lock()


def _default_cache_dir() -> Path:
    """``<settings.cache_dir>/emu``."""
    from ..cache import cache_root

    return cache_root("emu")


@functools.cache
def _support_text() -> tuple[str, str, str]:
    """(runtime.h + racecheck.h, shim.h, hopper.h) as shipped in the package."""
    pkg = resources.files(__package__)
    runtime = pkg.joinpath("runtime.h").read_text() + "\n" + pkg.joinpath("racecheck.h").read_text()
    return runtime, pkg.joinpath("shim.h").read_text(), pkg.joinpath("hopper.h").read_text()


#: Racecheck instrumentation: every kernel load/store calls __tsan_read*/__tsan_write*, which
#: racecheck.h defines (libtsan is never linked: the object is linked without -fsanitize).
RACECHECK_FLAGS = ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0", "-DFAGEN_EMU_RACECHECK")


def instrumented_opt(level: str) -> str:
    """The optimisation level of a racecheck or ASan build: the ``emu_opt`` setting, at most O1 (the
    instrumentation dominates such a build's run, and g++ builds an instrumented O2 module slowest)."""
    return level if EMU_OPT_LEVELS.index(level) <= EMU_OPT_LEVELS.index("O1") else "O1"


def compile_flags(*, sanitize: bool, debug: bool, racecheck: bool = False) -> list[str]:
    """g++ flags (the include dir is added separately). A plain build's optimisation level is the
    ``emu_opt`` setting (``FAGEN_EMU_OPT``, default O2: O1 builds about a fifth faster and runs
    10-35% slower; Og builds about a third faster than O1), a racecheck or ASan build's the same,
    at most O1 (:func:`instrumented_opt`)."""
    if sanitize and racecheck:
        raise EmulatorBuildError("build: sanitize and racecheck are separate builds; ask for one of them")
    flags = ["-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing",
             "-Wno-unknown-pragmas"]
    level = get_settings().emu_opt
    if racecheck:
        flags += [f"-{instrumented_opt(level)}", "-g1", *RACECHECK_FLAGS]
    elif sanitize:
        flags += [f"-{instrumented_opt(level)}", "-g1", "-fsanitize=address", "-fno-omit-frame-pointer"]
    elif debug:
        flags += ["-O0", "-g"]
    else:
        flags += [f"-{level}"]
    return flags


def render_wrappers(kernels: Sequence[KernelSig]) -> str:
    """One ``fagen_launch_<name>`` per kernel, unpacking ``void** args`` like
    cuLaunchKernel's kernelParams (``args[i]`` points at parameter i's value)."""
    out = ["// ---- generated launch wrappers"]
    for k in kernels:
        unpack = ", ".join(
            f"*reinterpret_cast<{normalize_ctype(t)}*>(args[{i}])" for i, (t, _) in enumerate(k.params)
        )
        out.append(
            f"static void fagen_body_{k.name}(void* a) {{\n"
            f"    void** args = static_cast<void**>(a);\n"
            f"    (void)args;\n"
            f"    {k.name}({unpack});\n"
            f"}}\n"
            f'extern "C" __attribute__((visibility("default"))) int fagen_launch_{k.name}(\n'
            f"        unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,\n"
            f"        size_t smem, void** args, char* errbuf, size_t errlen) {{\n"
            f'    return fagen_emu::launch("{k.name}", gx, gy, gz, bx, by, bz, smem, &fagen_body_{k.name},\n'
            f"                             args, errbuf, errlen);\n"
            f"}}"
        )
    return "\n".join(out) + "\n"


#: A source that defines this (templates/wgmma/hopper.cuh does) gets fagen/emulator/hopper.h
#: pasted after the shim; other sources do not pay for compiling it.
HOPPER_MARKER = "FAGEN_HOPPER_PRIMITIVES"


def prelude(source: str) -> str:
    """What every translation unit starts with: the runtime, the shim and, for a source that
    uses the Hopper primitives, hopper.h."""
    runtime, shim, hopper = _support_text()
    if HOPPER_MARKER not in source:
        hopper = ""
    return f"{runtime}\n{shim}\n{hopper}\n"


def translation_unit(source: str, wrappers: str, stem: str, prelude_header: Prelude | None = None) -> str:
    """The emulator's C++ for ``source``: the prelude (pasted, or ``#include``d from
    ``prelude_header``, whose precompiled header g++ then takes), the kernel source and the
    launch wrappers."""
    head = f'#include "{prelude_header.include}"\n' if prelude_header else prelude(source)
    return (
        f"{head}\n#define FAGEN_EMULATOR 1\n#line 1 \"{stem}.cu\"\n{source}\n"
        f"#line 1 \"{stem}.wrappers\"\n{wrappers}"
    )


class Prelude(NamedTuple):
    """A precompiled prelude: the header a translation unit ``#include``s (its ``.gch`` beside it) and
    the objects its module links (the runtime object: the runtime's out-of-line functions and globals,
    compiled once; the header then only declares them)."""

    include: str
    objects: tuple[str, ...] = ()


#: Put ahead of the prelude in the header of a unit linked against the runtime object (runtime.h).
RUNTIME_DECLS_ONLY = "#define FAGEN_EMU_RUNTIME_DEFS 0\n"


def prelude_header(cxx: str, cxx_id: str, flags: list[str], text: str, root: Path) -> Prelude | None:
    """The prelude as a header in ``root`` with its precompiled header beside it, and the runtime
    object, built once per (prelude, compiler, flags) and shared by every module built with them:
    g++ then neither parses the runtime, the shim and the CUDA headers again (about a quarter of a
    module's build) nor compiles the runtime's out-of-line code (about as much again). None when the
    precompiled header cannot be made (the prelude is then pasted into the unit); without the
    runtime object (g++ rejected the prelude as a unit of its own) the header defines the runtime."""
    digest = cache.digest(text, cxx_id, chr(0).join(flags))[:24]
    obj_name = f"runtime-{digest}.o"
    obj = root / obj_name

    def files(split: bool) -> tuple[str, Path, Path]:
        """(header name, header, its .gch) of the split (runtime object) or self-contained prelude."""
        name = f"prelude-{digest}{'-split' if split else ''}.h"
        return name, root / name, root / f"{name}.gch"

    def ready(split: bool) -> Prelude | None:
        name, header, gch = files(split)
        if _done(gch) and header.exists() and (not split or _done(obj)):
            return Prelude(name, (obj_name,) if split else ())
        return None

    for split in (True, False):  # a finished build, split or not
        if (done := ready(split)) is not None:
            return done
    unit_flags = [f for f in flags if f != "-shared"]
    try:
        with cache.locked(obj):
            for split in (True, False):
                if (done := ready(split)) is not None:
                    return done
            split = runtime_object(cxx, unit_flags, text, root, obj)
            name, header, gch = files(split)
            cache.atomic_write(header, ((RUNTIME_DECLS_ONLY if split else "") + text).encode())
            if not _gxx(cxx, [*unit_flags, "-x", "c++-header", name], gch, root, "no precompiled emulator prelude"):
                return None
            return Prelude(name, (obj_name,) if split else ())
    except OSError:
        return None


def runtime_object(cxx: str, flags: list[str], text: str, root: Path, obj: Path) -> bool:
    """The prelude compiled on its own into ``obj`` (the runtime object); False when g++ rejects it.
    :func:`prelude_header` calls it through this module's attribute (a seam: a test makes it fail)."""
    src = obj.with_suffix(".cpp")
    cache.atomic_write(src, text.encode())
    return _gxx(cxx, [*flags, "-c", src.name], obj, root, "no emulator runtime object")


def _done(out: Path) -> bool:
    """Whether ``out`` was completed by :func:`_gxx` (its ``.ok`` marker is written after it)."""
    return out.exists() and out.with_name(out.name + ".ok").exists()


def _gxx(cxx: str, args: list[str], out: Path, root: Path, failure: str) -> bool:
    """g++ ``args`` (run in ``root``) writes ``out`` through a temp file, then its ``.ok`` marker; False
    (``failure`` and g++'s first words logged) when g++ fails."""
    tmp = cache.temp_path(out)
    try:
        proc = subprocess.run([cxx, *args, "-o", tmp.name], cwd=root, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            _log.info("%s (%s): %s", failure, out.name, proc.stderr.strip()[:200])
            return False
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    cache.atomic_write(out.with_name(out.name + ".ok"), b"")
    return True


def build(
    source: str,
    kernels: Sequence[KernelSig | SigLike],
    *,
    sanitize: bool = False,
    debug: bool = False,
    racecheck: bool = False,
    extra_flags: Sequence[str] = (),
    cache_dir: Path | str | None = None,
) -> EmuModule:
    """Compiles ``source`` for the emulator (or fetches it from the cache).

    ``kernels`` lists the ``extern "C" __global__`` functions to expose.
    ``sanitize`` builds with AddressSanitizer (launch it with
    :meth:`EmuModule.run_sanitized`); ``debug`` builds ``-O0 -g`` for gdb; ``racecheck``
    builds the hazard-tracking module (every launch raises :class:`EmulatorRaceError` on a
    shared-memory hazard between threads, or on plain stores of two blocks to the same bytes).
    ``extra_flags`` go to g++ as well (e.g. ``-DFAGEN_EMU_STACK_BYTES=1048576``,
    ``-DFAGEN_EMU_UCONTEXT``); they are part of the cache key.
    Raises :class:`EmulatorBuildError` with g++'s log when compilation fails.
    """
    sigs = tuple(as_sig(k) for k in kernels)
    names = [k.name for k in sigs]
    if len(set(names)) != len(names):
        raise EmulatorBuildError(f"duplicate kernel names in {names}")
    wrappers = render_wrappers(sigs)
    cxx, cxx_id = compiler()
    include = cuda_include_dir()
    flags = compile_flags(sanitize=sanitize, debug=debug, racecheck=racecheck) + [str(f) for f in extra_flags]
    runtime, shim, hopper = _support_text()
    key = cache.digest(runtime, shim, hopper if HOPPER_MARKER in source else "", source, wrappers, cxx_id, "\0".join(flags), include, headers_digest(Path(include)))
    stem = key[:24]
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    memo_key = (str(root.absolute()), stem)
    with _memo_lock:
        hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    so = root / f"{stem}.so"
    if not _is_valid(so):
        cache.make_dir(root)
        with cache.locked(so):
            if not _is_valid(so):  # another process may have built it meanwhile
                _log.info("building %s%s for the CPU emulator with %s", names[0],
                          f" (+{len(names) - 1} more)" if len(names) > 1 else "", Path(cxx).name)
                full = flags + ["-I", include]
                pch = prelude_header(cxx, cxx_id, full, prelude(source), root)
                compile_unit(cxx, full, translation_unit(source, wrappers, stem, pch), source, root, stem,
                             pch.objects if pch else ())
    module = EmuModule(so, sigs, sanitized=sanitize, racecheck=racecheck)
    with _memo_lock:
        return _memo.setdefault(memo_key, module)


def clear_memo() -> None:
    """Forgets the in-process memo (the disk cache stays)."""
    with _memo_lock:
        _memo.clear()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_valid(so: Path) -> bool:
    check = so.with_name(so.name + ".sha256")
    try:
        return check.read_text().strip() == _sha256_file(so)
    except OSError:
        return False


def compile_unit(cxx: str, flags: list[str], tu: str, source: str, root: Path, stem: str,
                 objects: Sequence[str] = ()) -> None:
    """g++ compiles a translation unit into ``<root>/<stem>.so`` (with ``.cu`` / ``.cpp`` beside it),
    linked with ``objects`` (names in ``root``: the runtime object of :func:`prelude_header`);
    :func:`build` calls it (and :func:`prelude_header`) through this module's attributes."""
    cache.remove_stale_temps(root)  # e.g. the .so of a build that was killed
    cache.atomic_write(root / f"{stem}.cu", source.encode())
    cache.atomic_write(root / f"{stem}.cpp", tu.encode())
    tmp = cache.temp_path(root / f"{stem}.so")  # g++ creates it: mode 0o777 minus the umask
    # the soname: gold names the output file in the module otherwise (a rebuild would differ in it)
    link = (*linker_flags(cxx), f"-Wl,-soname,{stem}.so")
    try:
        # Relative source name + cwd=root: debug info points gdb at root.
        if "-fsanitize=thread" in flags:
            # Instrument, but link without -fsanitize=thread (which would pull in libtsan).
            obj = tmp.with_name(tmp.name + ".o")
            try:
                proc = subprocess.run([cxx, *flags, "-c", f"{stem}.cpp", "-o", obj], cwd=root, capture_output=True,
                                      text=True, check=False)
                if proc.returncode == 0:
                    proc = subprocess.run([cxx, *link, "-shared", "-fPIC", obj, *objects, "-o", tmp], cwd=root,
                                          capture_output=True, text=True, check=False)
            finally:
                obj.unlink(missing_ok=True)
        else:
            proc = subprocess.run([cxx, *flags, *link, f"{stem}.cpp", *objects, "-o", tmp], cwd=root,
                                  capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise EmulatorBuildError(
                f"g++ failed to compile the emulator module ({root / f'{stem}.cpp'}; kernel source lines are "
                f"reported as {stem}.cu:LINE)", proc.stderr + proc.stdout)
        digest = _sha256_file(tmp)
        os.replace(tmp, root / f"{stem}.so")
        cache.atomic_write(root / f"{stem}.so.sha256", digest.encode())
    finally:
        tmp.unlink(missing_ok=True)


# ---- seams for the PTX level (fagen/emulator/ptx/build.py builds its translated C++ with these)
#: The shipped runtime texts: (runtime.h + racecheck.h, shim.h, hopper.h).
support_text = _support_text
#: ``<settings.cache_dir>/emu``.
default_cache_dir = _default_cache_dir
#: Whether a cached ``.so`` is complete (its checksum file matches).
is_valid = _is_valid
