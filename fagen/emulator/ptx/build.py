"""Building PTX for the CPU emulator: translate (translate.py), compile with g++ on top of the
fiber runtime, cache like the source-level builds.

The translation unit: ``runtime.h`` + ``racecheck.h`` + ``shim.h`` + ``hopper.h`` (always) +
``ptx_runtime.h`` (the prelude, precompiled once per flags like the source builds'), then the
translated entries under ``#line``-free C++ (reports name PTX lines through the collectives'
call sites and the hazard messages), then one launch wrapper per kernel. Cache key: the PTX
text, :data:`TRANSLATOR_VERSION`, the support headers, the wrappers, the compiler and the flags.
Next to ``<stem>.so``: ``<stem>.ptx`` (the PTX the lines refer to) and ``<stem>.cpp``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from ... import cache
from ...nvrtc import headers_digest
from ..builder import compile_flags, compile_unit, default_cache_dir, is_valid, prelude_header, support_text
from ..errors import EmulatorBuildError, EmulatorKernelError
from ..module import EmuModule
from ..signature import KernelSig, SigLike, as_sig
from ..toolchain import compiler, cuda_include_dir
from . import counters as _counters
from .errors import PtxHazardError, PtxUnsupportedError
from .translate import TRANSLATOR_VERSION, translate

_log = logging.getLogger("fagen.emulator.builder")
_memo: dict[tuple[str, str], PtxModule] = {}
_memo_lock = threading.Lock()



@functools.cache
def _ptx_runtime_text() -> str:
    return resources.files(__package__).joinpath("ptx_runtime.h").read_text()


def prelude() -> str:
    runtime, shim, hopper = support_text()
    return f"{runtime}\n{shim}\n{hopper}\n{_ptx_runtime_text()}\n"


class PtxModule(EmuModule):
    """An emulator module built from PTX (:func:`build_ptx`): launches like any
    :class:`~fagen.emulator.EmuModule`; a PTX-level hazard raises :class:`PtxHazardError`."""

    def __init__(self, path: Path, kernels: Sequence[KernelSig], ptx: str, sites: list | None = None,
                 racecheck: bool = False) -> None:
        super().__init__(path, kernels, sanitized=False, racecheck=racecheck)
        self.ptx = ptx
        #: built with memory counters (``build_ptx(..., counters=True)``): the memory instruction sites
        self.sites: list[_counters.Site] | None = sites

    def _counting_lib(self):
        if self.sites is None:
            raise EmulatorBuildError("this PTX module was built without memory counters (build it with counters=True)")
        lib = self._load()
        lib.fagen_pxc_read.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint]
        lib.fagen_pxc_read.restype = None
        lib.fagen_pxc_reset.argtypes, lib.fagen_pxc_reset.restype = [], None
        return lib

    def reset_counters(self) -> None:
        """Zeroes the memory counters (they add up over launches)."""
        lib = self._counting_lib()
        with self._launch_lock:
            lib.fagen_pxc_reset()

    def counters(self) -> dict[str, _counters.KernelCounters]:
        """The memory counters since the module was loaded or :meth:`reset_counters`, per kernel
        (docs/emulator.md, "Memory counters")."""
        lib = self._counting_lib()
        with self._launch_lock:
            return _counters.read(lib, self.sites or [])

    @property
    def ptx_path(self) -> Path:
        return self.path.with_suffix(".ptx")

    def launch(self, *args, **kwargs) -> None:  # type: ignore[override]
        try:
            super().launch(*args, **kwargs)
        except EmulatorKernelError as e:
            msg = str(e)
            if msg.startswith("PTX hazard"):
                import re

                m = re.search(r"\.ptx:(\d+)", msg)
                raise PtxHazardError(msg, e.kernel, e.block, int(m.group(1)) if m else 0) from None
            raise


def render_wrappers(kernels: Sequence[KernelSig], entries: dict[str, int], static_smem: int = 0) -> str:
    """One ``fagen_launch_<name>`` per kernel; ``static_smem``: the bytes of the module's static
    ``.shared`` variables, which the window holds before the launch's dynamic shared memory."""
    out = ["// ---- generated launch wrappers (PTX level)"]
    for k in kernels:
        if k.name not in entries:
            raise PtxUnsupportedError(".entry", f"kernel '{k.name}' is not an entry of the PTX (have "
                                      f"{sorted(entries)})")
        if entries[k.name] != len(k.params):
            raise EmulatorBuildError(f"kernel '{k.name}': the signature has {len(k.params)} parameters, the PTX "
                                     f"entry {entries[k.name]}")
        out.append(
            f"static void fagen_body_{k.name}(void* a) {{ ptx_entry_{k.name}(static_cast<void**>(a)); }}\n"
            f'extern "C" __attribute__((visibility("default"))) int fagen_launch_{k.name}(\n'
            f"        unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,\n"
            f"        size_t smem, void** args, char* errbuf, size_t errlen) {{\n"
            f'    return fagen_emu::launch("{k.name}", gx, gy, gz, bx, by, bz, smem{f" + {static_smem}" if static_smem else ""}, '
            f'&fagen_body_{k.name},\n'
            f"                             args, errbuf, errlen);\n"
            f"}}")
    return "\n".join(out) + "\n"


def build_ptx(ptx: str | bytes, kernels: Sequence[KernelSig | SigLike], *, debug: bool = False,
              extra_flags: Sequence[str] = (), cache_dir: Path | str | None = None,
              counters: bool = False, racecheck: bool = False) -> PtxModule:
    """Translates ``ptx`` (every ``.entry``) to C++ and compiles it for the emulator (or fetches
    it from the cache). ``kernels`` lists the entries to expose with their C parameter types
    (the launch packs arguments by them). Raises :class:`PtxUnsupportedError` for a PTX form
    the translator does not implement, :class:`EmulatorBuildError` when g++ fails. ``counters``:
    a build that counts shared-memory wavefronts and global sectors per memory instruction
    (:meth:`PtxModule.counters`; its own cache entry). ``racecheck``: a build whose launches track
    the happens-before order of the block's threads like the source level's racecheck build (every
    load, store and atomic of the translated PTX reports to racecheck.h with its PTX line; a hazard
    raises :class:`~fagen.emulator.EmulatorRaceError`; docs/emulator.md, "Racecheck at the PTX
    level")."""
    if isinstance(ptx, bytes):
        ptx = ptx.decode()
    sigs = tuple(as_sig(k) for k in kernels)
    cxx, cxx_id = compiler()
    include = cuda_include_dir()
    # the plain builds' flags: FAGEN_EMU_OPT sets the level (measured on the mma sm_80 forward, -O1
    # and -O2 build in about the same time and run alike: NVVM already optimised the code)
    if counters and racecheck:
        raise EmulatorBuildError("build_ptx: counters and racecheck are separate builds; ask for one of them")
    flags = compile_flags(sanitize=False, debug=debug) + (["-DFAGEN_EMU_RACECHECK"] if racecheck else []) + \
        [str(f) for f in extra_flags]
    text = prelude()
    key = cache.digest("ptx", TRANSLATOR_VERSION, text, ptx, repr([(k.name, k.params) for k in sigs]), cxx_id,
                       "\0".join(flags), include, headers_digest(Path(include)),
                       *(("counters", _counters.COUNTERS_VERSION, _counters.header_text()) if counters else ()))
    stem = key[:24]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    memo_key = (str(root.absolute()), stem)
    with _memo_lock:
        hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    so = root / f"{stem}.so"
    sites_json = root / f"{stem}.sites.json"
    sites = None
    if counters and is_valid(so) and sites_json.exists():
        sites = [_counters.Site(**d) for d in json.loads(sites_json.read_text())]
    if not is_valid(so) or (counters and sites is None):
        tr = translate(ptx, f"{stem}.ptx", counters=counters, racecheck=racecheck)  # before the lock: an unsupported form fails fast
        sites = tr.sites if counters else None
        wrappers = render_wrappers(sigs, tr.params, tr.static_smem)
        cache.make_dir(root)
        with cache.locked(so):
            if not is_valid(so):
                _log.info("building %s (PTX level) for the CPU emulator with %s", sigs[0].name if sigs else "?",
                          Path(cxx).name)
                full = flags + ["-I", include]
                pch = prelude_header(cxx, cxx_id, full, text, root)
                head = f'#include "{pch.include}"\n' if pch else text
                tu = f"{head}\n{_counters.header_text() if counters else ''}\n{tr.cpp}\n{wrappers}"
                cache.atomic_write(root / f"{stem}.ptx", ptx.encode())
                if counters:
                    cache.atomic_write(sites_json, json.dumps([dataclasses.asdict(x) for x in tr.sites]).encode())
                compile_unit(cxx, full, tu, tr.cpp, root, stem, pch.objects if pch else ())
    module = PtxModule(so, sigs, ptx, sites, racecheck=racecheck)
    with _memo_lock:
        return _memo.setdefault(memo_key, module)


def ptx_of_source(source: str, arch: str = "sm_90a", options: Sequence[str] = (), name: str = "kernel.cu") -> str:
    """NVRTC's PTX of a hand-written CUDA source for ``arch``'s virtual target (compute_XY)."""
    from ...errors import CompileError
    from ...nvrtc import compile_cubin

    target = arch.replace("sm_", "compute_")
    res = compile_cubin(source, name, [f"-arch={target}", "-std=c++17", *options], ptx=True)
    if not res.ok:
        raise CompileError(name, res.log)
    return res.cubin.decode()


def build_source_ptx(source: str, kernels: Sequence[KernelSig | SigLike], *, arch: str = "sm_90a",
                     options: Sequence[str] = (), debug: bool = False, extra_flags: Sequence[str] = (),
                     cache_dir: Path | str | None = None, counters: bool = False,
                     racecheck: bool = False) -> PtxModule:
    """NVRTC compiles ``source`` to PTX for ``arch``; the PTX is built with :func:`build_ptx`."""
    return build_ptx(ptx_of_source(source, arch, options), kernels, debug=debug, extra_flags=extra_flags,
                     cache_dir=cache_dir, counters=counters, racecheck=racecheck)


def clear_memo() -> None:
    with _memo_lock:
        _memo.clear()
