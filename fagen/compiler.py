"""spec -> cubin through NVRTC, with the on-disk cache and an in-process memo.

This is the one compile function: the CPU checks, the autotuner and the GPU
runtime all call :func:`compile`.

Three ways to an answer, fastest first:

* the in-process memo, keyed by (cache dir, spec);
* the *index* of the disk cache (``<cache>/cubin/index/<fast key>.json``): the fast
  key digests the spec, the fagen version, the NVRTC options, the templates'
  contents and the stat (size, mtime) of fagen's Python files; the index entry
  names the full cache key plus the stat of the NVRTC library and of every CUDA
  header the kernels can include, all re-checked on use. This path renders
  nothing and loads neither NVRTC nor CuPy;
* the full path: render, digest the source with the toolchain identity and the
  headers' contents (:func:`cache_key`), load or build ``<key>.bin``, and
  (re)write the index entry.

Any change the index cannot vouch for (a template, a Python file, the library,
a header) makes its entry miss, and the full path decides.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from . import cache, elf, nvrtc
from ._version import __version__
from .errors import CacheDirError, CompileError
from .plan import plan_of
from .renderer import Rendered, render, templates_dir
from .settings import get_settings
from .spec import KernelSpec

_log = logging.getLogger(__name__)  # one INFO line per NVRTC compile (silent unless configured)


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int
    static_smem_bytes: int
    dynamic_smem_bytes: int
    barriers: int
    ptxas_ms: float

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    @property
    def smem_bytes(self) -> int:
        return self.static_smem_bytes + self.dynamic_smem_bytes


@dataclass(frozen=True)
class CompiledModule:
    spec: KernelSpec
    cubin: bytes
    options: tuple[str, ...]
    log: str
    resources: tuple[KernelResources, ...]
    compile_seconds: float  # wall time of the NVRTC call that produced the cubin
    cached: bool  # True when this process did not run NVRTC for it
    key: str
    #: None: ``cubin`` is SASS for ``spec.arch``; "compute_XY": ``cubin`` holds PTX for that
    #: virtual arch, JIT-compiled by the driver at load (no ptxas report: ``resources`` is empty).
    ptx_target: str | None = None

    @property
    def rendered(self) -> Rendered:
        """The spec's source and entry points (rendered on first access, memoised by the renderer)."""
        return render(self.spec)

    def resource(self, kernel_role: str) -> KernelResources:
        """ptxas's report of the role's kernel; LookupError naming the kernels reported when it has none."""
        name = plan_of(self.spec).kernel(kernel_role).name
        found = next((r for r in self.resources if r.kernel == name), None)
        if found is None:
            raise LookupError(f"no ptxas resource report for {name} (reported: {[r.kernel for r in self.resources]})")
        return found


def options_for(spec: KernelSpec, ptx_target: str | None = None) -> list[str]:
    """The defaults plus the spec's family's own NVRTC options; ``ptx_target`` ("compute_XY"):
    PTX for that virtual arch instead of a cubin for ``spec.arch``."""
    arch = ptx_target if ptx_target is not None else spec.arch
    verbose = [] if ptx_target is not None else ["-Xptxas=-v"]
    return [f"-arch={arch}", "-std=c++17", *verbose, *plan_of(spec).nvrtc_options]


def check_target(spec: KernelSpec, ptx_target: str | None = None) -> None:
    """:class:`CompileError`-free refusal, before rendering, of a target the loaded NVRTC
    cannot emit: one line naming the arch, the NVRTC release and the install that can."""
    from .arch import ARCHS, arch_info

    if ptx_target is not None:
        if not re.fullmatch(r"compute_\d+a?", ptx_target) or \
                ptx_target.replace("compute_", "sm_") not in ARCHS:
            raise ValueError(f"ptx_target must be compute_XY for a target in {list(ARCHS)}, got {ptx_target!r}")
        name = ptx_target.replace("compute_", "sm_")
    else:
        name = spec.arch
    if name not in nvrtc.supported_archs():
        need = arch_info(name).nvrtc_min
        have = nvrtc.version()
        hint = nvrtc.install_hint(need[0]) if need[0] > have[0] else nvrtc.install_hint(have[0], need)
        raise nvrtc.NvrtcError(f"NVRTC {have[0]}.{have[1]} cannot target {name} (it needs NVRTC "
                               f"{need[0]}.{need[1]} or newer): {hint}")


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")
_TIME = re.compile(r"Compile time = ([\d.]+) ms")


def parse_ptxas(log: str, dynamic_smem: dict[str, int]) -> tuple[KernelResources, ...]:
    """Per-kernel resources from an ``-Xptxas=-v`` log."""
    out = []
    chunks = _ENTRY.split(log)
    for name, text in zip(chunks[1::2], chunks[2::2]):
        sp = _SPILL.search(text)
        used = _USED.search(text)
        bar = _BARRIERS.search(text)
        smem = _SMEM.search(text)
        tm = _TIME.search(text)
        out.append(KernelResources(
            kernel=name,
            registers=int(used.group(1)) if used else 0,
            spill_store_bytes=int(sp.group(2)) if sp else 0,
            spill_load_bytes=int(sp.group(3)) if sp else 0,
            stack_frame_bytes=int(sp.group(1)) if sp else 0,
            static_smem_bytes=int(smem.group(1)) if smem else 0,
            dynamic_smem_bytes=dynamic_smem.get(name, 0),
            barriers=int(bar.group(1)) if bar else 0,
            ptxas_ms=float(tm.group(1)) if tm else 0.0,
        ))
    order = {k: i for i, k in enumerate(dynamic_smem)}
    return tuple(sorted(out, key=lambda r: order.get(r.kernel, len(order))))


_memo: dict[Path, dict[tuple[KernelSpec, str | None], CompiledModule]] = {}  # cache dir -> (spec, ptx) -> module
_memo_lock = threading.Lock()


def cache_key(rendered: Rendered, options: list[str], ptx_target: str | None = None) -> str:
    """sha256 of everything that determines the cubin: source, options, fagen version,
    the NVRTC major, release and build (NVRTC 12 and 13 never share an entry), the output
    (cubin, or PTX for ``ptx_target``) and the CUDA headers the source can include."""
    return cache.digest(rendered.source, f"nvrtc-major {nvrtc.version()[0]}", nvrtc.toolchain_id(),
                        rendered.spec.arch, f"output {ptx_target or 'cubin'}", "\0".join(options),
                        __version__, nvrtc.headers_digest())


def _usable(arch: str, ptx_target: str | None = None):
    """Entry check: the stored cubin is complete (as long as NVRTC said) and for ``arch``
    (its ELF's SM: sm_90 for sm_90a); PTX: as long as NVRTC said, for ``ptx_target``."""
    from .arch import arch_info

    arch = arch_info(arch).cubin_arch

    def valid(meta: dict, cubin: bytes) -> bool:
        if meta.get("cubin_size") != len(cubin):
            return False
        if ptx_target is not None:
            return meta.get("ptx_target") == ptx_target and f".target {ptx_target.replace('compute_', 'sm_')}" \
                in cubin.decode(errors="replace")
        try:
            elf.check_cubin(cubin, arch)
        except elf.ElfError:
            return False
        return True
    return valid


# --------------------------------------------------------------------------- index (fast path)
_PACKAGE = Path(__file__).resolve().parent
_TEMPLATE_SUFFIXES = (".j2", ".cuh", ".h")


def _walk(folder: str, suffixes: tuple[str, ...], out: list[os.DirEntry]) -> None:
    try:
        it = os.scandir(folder)
    except OSError:
        return
    with it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                if e.name != "__pycache__":
                    _walk(e.path, suffixes, out)
            elif e.name.endswith(suffixes):
                out.append(e)


def _templates_dir() -> Path:
    """:func:`fagen.renderer.templates_dir` by two path checks (``importlib.resources`` costs ms)."""
    for cand in (_PACKAGE / "_templates", _PACKAGE.parent / "templates"):
        if (cand / "partials").is_dir():
            return cand
    return templates_dir()


def source_digest(templates: Path | None = None, package: Path | None = None) -> str:
    """sha256 of the templates' contents and of (path, size, mtime) of the package's Python
    and data files (the codegen knob tables): what renders the source, computed without rendering."""
    import hashlib

    h = hashlib.sha256()
    found: list[os.DirEntry] = []
    _walk(str(templates if templates is not None else _templates_dir()), _TEMPLATE_SUFFIXES, found)
    for e in sorted(found, key=lambda e: e.path):
        with open(e.path, "rb") as f:
            data = f.read()
        h.update(f"T{e.path}\0{len(data)}\0".encode() + data)
    found = []
    _walk(str(package if package is not None else _PACKAGE), (".py", ".json"), found)  # .json: codegen tables
    for e in sorted(found, key=lambda e: e.path):
        st = e.stat()
        h.update(f"P{e.path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


_source_digests: dict[str, str] = {}


def installed_source_digest() -> str:
    """:func:`source_digest` of the installed package, once per process (see :func:`clear_memo`)."""
    found = _source_digests.get("")
    if found is None:
        found = _source_digests[""] = source_digest()
    return found


def fast_key(spec: KernelSpec, options: list[str]) -> str:
    """Key of the index entry: everything except what the entry itself records and re-checks."""
    s = get_settings()
    env = "\0".join(os.environ.get(v, "") for v in ("CUDA_HOME", "CUDA_PATH"))
    return cache.digest(spec.model_dump_json(), __version__, "\0".join(options), installed_source_digest(),
                        str(s.cuda_include or ""), sys.prefix, env, nvrtc.selection_id())


def _stat_record(path: Path) -> list:
    st = os.stat(path)
    return [str(path), st.st_size, st.st_mtime_ns]


def _unchanged(files: object) -> bool:
    if not isinstance(files, list) or not files:
        return False
    try:
        for path, size, mtime in files:
            st = os.stat(path)
            if st.st_size != size or st.st_mtime_ns != mtime:
                return False
    except (OSError, TypeError, ValueError):
        return False
    return True


def _index_path(root: Path, spec: KernelSpec, options: list[str]) -> Path:
    return root / "index" / f"{fast_key(spec, options)}.json"


def _write_index(path: Path, key: str) -> None:
    lib = nvrtc.library_path()
    if lib is None:  # no file to vouch for the compiler: always take the full path
        return
    files = [_stat_record(lib)] + [_stat_record(h) for h in nvrtc.header_files()]
    try:
        cache.atomic_write(path, json.dumps({"key": key, "files": files}).encode())
    except (OSError, CacheDirError):  # the index only speeds things up (a read-only cache still serves hits)
        pass


def _from_index(spec: KernelSpec, root: Path, options: list[str]) -> CompiledModule | None:
    try:
        rec = json.loads(_index_path(root, spec, options).read_bytes())
        key = rec["key"]
        files = rec["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(key, str) and re.fullmatch(r"[0-9a-f]{64}", key)) or not _unchanged(files):
        return None
    hit = cache.read_entry(root / f"{key}.bin")
    ptx_target = _ptx_target_of(options)
    if hit is None or not _usable(spec.arch, ptx_target)(*hit):
        return None
    return _module(spec, key, hit[0], hit[1], cached=True)


def _ptx_target_of(options: list[str]) -> str | None:
    arch = next(o for o in options if o.startswith("-arch="))[len("-arch="):]
    return arch if arch.startswith("compute_") else None


def _module(spec: KernelSpec, key: str, meta: dict, cubin: bytes, *, cached: bool) -> CompiledModule:
    try:  # [[kernel, dynamic smem bytes], ...] in launch order
        dyn = {str(name): int(n) for name, n in meta["dynamic_smem"]}
    except (KeyError, TypeError, ValueError):
        dyn = {k.name: k.smem_bytes for k in plan_of(spec).kernels}
    return CompiledModule(
        spec=spec, cubin=cubin, options=tuple(meta["options"]), log=meta["log"],
        resources=parse_ptxas(meta["log"], dyn), compile_seconds=float(meta["compile_seconds"]),
        cached=cached, key=key, ptx_target=meta.get("ptx_target"),
    )


# --------------------------------------------------------------------------- compile
def compile(spec: KernelSpec, *, ptx_target: str | None = None) -> CompiledModule:  # noqa: A001 - the package's verb
    """Compile every kernel of ``spec`` to a cubin for ``spec.arch`` (cached). ``ptx_target``
    ("compute_XY"): PTX for that virtual arch instead, which the driver JIT-compiles for a
    device newer than every arch the loaded NVRTC knows (``fagen.runtime.gpu``)."""
    cache_dir = get_settings().cache_dir
    per_dir = _memo.get(cache_dir)
    memo_key = (spec, ptx_target)
    if per_dir is not None:
        hit = per_dir.get(memo_key)
        if hit is not None:
            return hit
    root = cache.cache_root("cubin")
    options = options_for(spec, ptx_target)
    # The index vouches for templates/ and fagen's own files only: a family registered from
    # elsewhere (Family.template_dir) always takes the full path (render, hash the source).
    mod = _from_index(spec, root, options) if plan_of(spec).family.template_dir is None else None
    if mod is None:
        check_target(spec, ptx_target)
        mod = compile_full(spec, root, options, ptx_target)
    with _memo_lock:
        _memo.setdefault(cache_dir, {})[memo_key] = replace(mod, cached=True)  # a repeat in this process ran no NVRTC
    return mod


def compile_full(spec: KernelSpec, root: Path, options: list[str], ptx_target: str | None = None) -> CompiledModule:
    """The full path of :func:`compile` (no index, or the index could not vouch): render, then the
    full-key cache entry or NVRTC, and write the index. :func:`compile` calls it through this module's
    attribute."""
    from .arch import arch_info

    rendered = render(spec)
    key = cache_key(rendered, options, ptx_target)
    dyn = {k.name: k.smem_bytes for k in rendered.kernels}

    def build() -> tuple[dict, bytes]:
        _log.info("compiling %s for %s with NVRTC", spec.name, ptx_target or spec.arch)
        t0 = time.perf_counter()
        res = nvrtc.compile_cubin(rendered.source, f"{spec.name}.cu", options, arch_info(spec.arch).cubin_arch,
                                  ptx=ptx_target is not None)
        secs = time.perf_counter() - t0
        _log.debug("compiled %s in %.2f s", spec.name, secs)
        if not res.ok:
            raise CompileError(spec.name, res.log)
        return {"log": res.log, "options": options, "compile_seconds": secs, "spec": spec.name,
                "cubin_size": len(res.cubin), "dynamic_smem": [[k, n] for k, n in dyn.items()],
                "ptx_target": ptx_target, "nvrtc_major": nvrtc.version()[0]}, res.cubin

    cache.make_dir(root)  # in case it was removed since this process first used it
    meta, cubin, cached = cache.get_or_build(root / f"{key}.bin", build, _usable(spec.arch, ptx_target))
    _write_index(_index_path(root, spec, options), key)
    return _module(spec, key, meta, cubin, cached=cached)


def clear_memo() -> None:
    """Forget in-process results: compiled modules and the memoised CUDA header digests (the
    disk cache is untouched). The digest of fagen's own sources stays: it describes the code
    this process runs, which editing files does not change."""
    with _memo_lock:
        _memo.clear()
    nvrtc.clear_caches()
