"""spec -> cubin through NVRTC, with the on-disk cache and an in-process memo.

This is the one compile function: the CPU checks, the autotuner and the GPU
runtime all call :func:`compile`.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, replace

from . import cache, elf, nvrtc
from ._version import __version__
from .errors import CompileError
from .renderer import Rendered, render
from .spec import KernelSpec


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
    rendered: Rendered
    cubin: bytes
    options: tuple[str, ...]
    log: str
    resources: tuple[KernelResources, ...]
    compile_seconds: float  # wall time of the NVRTC call that produced the cubin
    cached: bool  # True when this process did not run NVRTC for it
    key: str

    def resource(self, kernel_role: str) -> KernelResources:
        name = self.rendered.kernel(kernel_role).name
        return next(r for r in self.resources if r.kernel == name)


def options_for(spec: KernelSpec) -> list[str]:
    """The defaults plus the spec's family's own NVRTC options."""
    from .families import get_family

    return [f"-arch={spec.arch}", "-std=c++17", "-Xptxas=-v", *get_family(spec.impl).nvrtc_options(spec)]


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


_memo: dict[tuple[str, str], CompiledModule] = {}
_memo_lock = threading.Lock()


def cache_key(rendered: Rendered, options: list[str]) -> str:
    """sha256 of everything that determines the cubin: source, options, fagen version,
    the NVRTC release and build, and the CUDA headers the source can include."""
    return cache.digest(rendered.source, nvrtc.toolchain_id(), rendered.spec.arch, "\0".join(options),
                        __version__, nvrtc.headers_digest())


def _usable(arch: str):
    """Entry check: the stored cubin is complete (as long as NVRTC said) and for ``arch``."""
    def valid(meta: dict, cubin: bytes) -> bool:
        if meta.get("cubin_size") != len(cubin):
            return False
        try:
            elf.check_cubin(cubin, arch)
        except elf.ElfError:
            return False
        return True
    return valid


def compile(spec: KernelSpec) -> CompiledModule:  # noqa: A001 - the package's verb
    """Compile every kernel of ``spec`` to a cubin for ``spec.arch`` (cached)."""
    root = str(cache.cache_root("cubin"))
    memo_key = (root, spec.model_dump_json())
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    rendered = render(spec)
    options = options_for(spec)
    key = cache_key(rendered, options)
    dyn = {k.name: k.smem_bytes for k in rendered.kernels}

    def build() -> tuple[dict, bytes]:
        t0 = time.perf_counter()
        res = nvrtc.compile_cubin(rendered.source, f"{spec.name}.cu", options, spec.arch)
        secs = time.perf_counter() - t0
        if not res.ok:
            raise CompileError(spec.name, res.log)
        return {"log": res.log, "options": options, "compile_seconds": secs, "spec": spec.name,
                "cubin_size": len(res.cubin)}, res.cubin

    meta, cubin, cached = cache.get_or_build(cache.cache_root("cubin") / f"{key}.bin", build, _usable(spec.arch))
    mod = CompiledModule(
        spec=spec, rendered=rendered, cubin=cubin, options=tuple(meta["options"]), log=meta["log"],
        resources=parse_ptxas(meta["log"], dyn), compile_seconds=float(meta["compile_seconds"]),
        cached=cached, key=key,
    )
    with _memo_lock:
        _memo[memo_key] = replace(mod, cached=True)  # a repeat in this process ran no NVRTC
    return mod


def clear_memo() -> None:
    """Forget in-process results (the disk cache is untouched)."""
    with _memo_lock:
        _memo.clear()
