"""CPU backend: the rendered kernel text, built and run by the SIMT emulator.

Inside :func:`sanitized` every CPU launch is bounds-checked instead: the spec's
AddressSanitizer build runs it in a child process (:meth:`EmuModule.run_sanitized`),
each pointer argument copied into its own exact-size ``malloc``. Inside :func:`racecheck`
every CPU launch runs the spec's racecheck build (hazards between threads become
:class:`fagen.emulator.EmulatorRaceError`). Inside :func:`ptx` (or with ``FAGEN_EMU_LEVEL=ptx``)
every CPU launch runs the spec's PTX build: NVRTC's PTX for the spec's real target, translated to
C++ (:mod:`fagen.emulator.ptx`); PTX-level hazards become
:class:`fagen.emulator.ptx.PtxHazardError`.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import gc
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ..plan import KernelInfo, plan_of
from ..renderer import Rendered, render
from ..spec import KernelSpec
from .args import pack

#: g++ flags of each emulator thread order (see fagen/emulator/runtime.h).
SCHEDULE_FLAGS = {"forward": (), "reverse": ("-DFAGEN_EMU_REVERSE_SCHEDULE",)}


@dataclass
class SanitizedLaunches:
    """What :func:`sanitized` yields: the launches made under AddressSanitizer so far."""

    timeout: float | None
    #: (spec name, kernel role, kernel name) per launch, in launch order.
    launches: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def roles(self) -> set[str]:
        return {role for _, role, _ in self.launches}


_SANITIZE: ContextVar[SanitizedLaunches | None] = ContextVar("fagen_cpu_sanitize", default=None)


@dataclass
class RacecheckedLaunches:
    """What :func:`racecheck` yields: the launches made with hazard tracking so far."""

    #: (spec name, kernel role, kernel name) per launch, in launch order.
    launches: list[tuple[str, str, str]] = field(default_factory=list)
    #: ``fagen_emu_race_marker()`` passes summed over the launches (see docs/emulator.md).
    markers: int = 0
    #: (spec name, kernel-source line) of every marker passed.
    marker_lines: set[tuple[str, int]] = field(default_factory=set)

    @property
    def roles(self) -> set[str]:
        return {role for _, role, _ in self.launches}


_RACECHECK: ContextVar[RacecheckedLaunches | None] = ContextVar("fagen_cpu_racecheck", default=None)


@contextlib.contextmanager
def racecheck() -> Iterator[RacecheckedLaunches]:
    """Every CPU kernel launch inside the block runs with hazard tracking.

    Each launch uses the spec's racecheck build (once per spec, cached like any emulator build):
    every shared-memory load and store of the kernel goes through an exact happens-before
    model (barriers, ``__syncwarp``, cp.async waits; see docs/emulator.md, "Racecheck"), and
    plain global stores of two blocks to the same bytes are tracked too. A hazard raises
    :class:`fagen.emulator.EmulatorRaceError` naming the kernel, the kind, the shared-memory
    buffer of the spec's layout and the offset, both threads and both source lines. Results
    are the same as without it. Yields a :class:`RacecheckedLaunches` record. Inside
    :func:`sanitized` as well, the sanitizer wins (one instrumentation per build). Inside
    :func:`ptx` (or with ``FAGEN_EMU_LEVEL=ptx``) the launches run the spec's PTX-level racecheck
    build instead: the same model over the translated PTX, reports naming PTX lines.
    """
    record = RacecheckedLaunches()
    token = _RACECHECK.set(record)
    try:
        yield record
    finally:
        _RACECHECK.reset(token)


@dataclass
class PtxLaunches:
    """What :func:`ptx` yields: the launches made at the PTX level so far."""

    #: (spec name, kernel role, kernel name) per launch, in launch order.
    launches: list[tuple[str, str, str]] = field(default_factory=list)
    #: ``ptx(counters=True)``: the memory counters per kernel name, summed over its launches
    #: (:class:`fagen.emulator.ptx.counters.KernelCounters`; docs/emulator.md, "Memory counters").
    counters: dict[str, Any] = field(default_factory=dict)
    counting: bool = False

    @property
    def roles(self) -> set[str]:
        return {role for _, role, _ in self.launches}


_PTX: ContextVar[PtxLaunches | None] = ContextVar("fagen_cpu_ptx", default=None)


@contextlib.contextmanager
def ptx(*, counters: bool = False) -> Iterator[PtxLaunches]:
    """Every CPU kernel launch inside the block runs the spec's PTX build.

    The spec's kernels are compiled by NVRTC to PTX for the spec's real target (``compute_80``,
    ``compute_90a``, ...: the same source and options as its cubin, without ``FAGEN_EMULATOR``),
    the PTX is translated to C++ and built on the emulator's fiber runtime (once per spec, cached
    like any emulator build), so the inline PTX of the device-function layer and NVVM's
    optimisations are what runs. A register of an in-flight ``wgmma`` accessed before its
    ``wgmma.wait_group`` (and the other PTX-level hazards) raises
    :class:`fagen.emulator.ptx.PtxHazardError`. Yields a :class:`PtxLaunches` record. Inside
    :func:`sanitized` as well, the sanitizer wins (it instruments the source build); inside
    :func:`racecheck` as well, the launches run the PTX level's racecheck build.
    ``FAGEN_EMU_LEVEL=ptx`` (the ``emu_level`` setting) does the same for a whole process.
    ``counters=True``: the launches run a build with memory counters (shared-memory wavefronts,
    global sectors per PTX instruction), gathered in ``record.counters`` per kernel.
    """
    record = PtxLaunches(counting=counters)
    token = _PTX.set(record)
    try:
        yield record
    finally:
        _PTX.reset(token)


def _ptx_level() -> PtxLaunches | None:
    """The PTX record of this context, or a throwaway one when the settings ask for the PTX level;
    None at the source level."""
    record = _PTX.get()
    if record is not None:
        return record
    from ..settings import get_settings

    return PtxLaunches() if get_settings().emu_level == "ptx" else None


@contextlib.contextmanager
def sanitized(*, timeout: float | None = 600.0) -> Iterator[SanitizedLaunches]:
    """Every CPU kernel launch inside the block runs bounds-checked under AddressSanitizer.

    Each launch builds (once per spec, cached like any emulator build) the spec's source with
    ``-fsanitize=address`` and runs it in a child process. Pointer arguments must lie inside
    live torch CPU tensors (what :mod:`fagen.functional` passes): each becomes a ``malloc`` of
    exactly the bytes from the pointer to the end of the tensor storage that holds it (the
    allocation), so a read or write past that allocation is an :class:`EmulatorMemoryError`
    naming the argument. Output buffers (non-``const`` pointers) are copied back; results are
    the same as without the sanitizer. Yields a :class:`SanitizedLaunches` record.
    """
    record = SanitizedLaunches(timeout)
    token = _SANITIZE.set(record)
    try:
        yield record
    finally:
        _SANITIZE.reset(token)


class CpuModule:
    def __init__(self, spec: KernelSpec, schedule: str = "forward", rendered: Rendered | None = None) -> None:
        """``rendered``: a variant of the spec's module (``fagen.renderer.render_with``) to build instead."""
        self.spec = spec
        self.rendered = render(spec) if rendered is None else rendered
        self._flags = SCHEDULE_FLAGS[schedule]
        self._builds: dict[tuple[bool, bool], Any] = {}
        self._ptx_build: Any = None
        self._ptx_counting_build: Any = None
        self._ptx_racecheck_build: Any = None
        self._variant = rendered is not None

    def ptx_build(self, counters: bool = False, racecheck: bool = False) -> Any:
        """The spec's PTX-level build (:func:`fagen.emulator.ptx.build_ptx` of NVRTC's PTX for the
        spec's target), made on first use; ``counters``: the build with memory counters;
        ``racecheck``: the build with hazard tracking."""
        if racecheck:
            if self._ptx_racecheck_build is None:
                from ..emulator.ptx import build_ptx

                self._ptx_racecheck_build = build_ptx(self.ptx_text(), self.rendered.kernels,
                                                      extra_flags=self._flags, racecheck=True)
            return self._ptx_racecheck_build
        if counters:
            if self._ptx_counting_build is None:
                from ..emulator.ptx import build_ptx

                self._ptx_counting_build = build_ptx(self.ptx_text(), self.rendered.kernels, extra_flags=self._flags,
                                                     counters=True)
            return self._ptx_counting_build
        if self._ptx_build is None:
            from ..emulator.ptx import build_ptx

            self._ptx_build = build_ptx(self.ptx_text(), self.rendered.kernels, extra_flags=self._flags)
        return self._ptx_build

    def ptx_text(self) -> bytes:
        """NVRTC's PTX of the spec (or of the variant) for the spec's target."""
        from ..compiler import compile as nvrtc_compile
        from ..compiler import options_for

        target = self.spec.arch.replace("sm_", "compute_")
        if self._variant:  # a variant of the spec's source: its own PTX (not the spec's, cached)
            from ..errors import CompileError
            from ..nvrtc import compile_cubin

            res = compile_cubin(self.rendered.source, f"{self.spec.name}.cu", options_for(self.spec, target),
                                ptx=True)
            if not res.ok:
                raise CompileError(self.spec.name, res.log)
            text = res.cubin
        else:
            text = nvrtc_compile(self.spec, ptx_target=target).cubin
        return text

    def _build(self, *, sanitize: bool, racecheck: bool = False) -> Any:
        """The plain (or AddressSanitizer, or racecheck) emulator build, made on first use."""
        emu = self._builds.get((sanitize, racecheck))
        if emu is None:
            from ..emulator import build

            emu = build(self.rendered.source, self.rendered.kernels, sanitize=sanitize, racecheck=racecheck,
                        extra_flags=self._flags)
            self._builds[(sanitize, racecheck)] = emu
        return emu

    def smem_buffers(self) -> list[tuple[str, int, int]]:
        """(name, offset, nbytes) of the spec's shared-memory buffers (s_<name> in the templates)."""
        return [(b.name, b.offset, b.nbytes) for b in plan_of(self.spec).smem_layout.buffers]

    def launch(self, kernel: KernelInfo, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        record = _SANITIZE.get()
        if record is not None:
            self._launch_sanitized(kernel, grid, args, record)
            return
        values = [v for _, v in pack(kernel, args)]
        races = _RACECHECK.get()
        if races is not None:
            level = _ptx_level()  # racecheck inside ptx() (or FAGEN_EMU_LEVEL=ptx): the PTX level's racecheck build
            emu = self.ptx_build(racecheck=True) if level is not None else self._build(sanitize=False, racecheck=True)
            emu.launch(kernel.name, grid, kernel.block, kernel.smem_bytes, values, smem_buffers=self.smem_buffers())
            races.launches.append((self.spec.name, kernel.role.name, kernel.name))
            if level is not None:
                level.launches.append((self.spec.name, kernel.role.name, kernel.name))
            races.markers += emu.race_markers()
            races.marker_lines |= {(self.spec.name, line) for line in emu.race_marker_lines()}
            return
        level = _ptx_level()
        if level is not None:
            if level.counting:
                emu = self.ptx_build(counters=True)
                emu.reset_counters()
                emu.launch(kernel.name, grid, kernel.block, kernel.smem_bytes, values)
                got = emu.counters().get(kernel.name)
                if got is not None:
                    mine = level.counters.get(kernel.name)
                    if mine is None:
                        from ..emulator.ptx.counters import KernelCounters

                        mine = level.counters[kernel.name] = KernelCounters(kernel.name)
                    mine.add(got)
            else:
                self.ptx_build().launch(kernel.name, grid, kernel.block, kernel.smem_bytes, values)
            level.launches.append((self.spec.name, kernel.role.name, kernel.name))
            return
        self._build(sanitize=False).launch(kernel.name, grid, kernel.block, kernel.smem_bytes, values)

    def _launch_sanitized(self, kernel: KernelInfo, grid: tuple[int, int, int], args: dict[str, Any],
                          record: SanitizedLaunches) -> None:
        values = host_buffers(kernel, pack(kernel, args))
        self._build(sanitize=True).run_sanitized(kernel.name, grid, kernel.block, kernel.smem_bytes, values,
                                                 timeout=record.timeout)
        record.launches.append((self.spec.name, kernel.role.name, kernel.name))


def host_buffers(kernel: KernelInfo, packed: list[tuple[str, Any]]) -> list[Any]:
    """The launch's values with each non-null pointer replaced by a numpy view of its allocation:
    the bytes from the address to the end of the torch CPU tensor storage holding it (read-only
    for ``const`` parameters). Raises EmulatorLaunchError for an address inside no live tensor and
    for output buffers that overlap (their copies would overwrite each other)."""
    import numpy as np

    from ..emulator import EmulatorLaunchError

    starts, ends = _allocations()
    out: list[Any] = []
    written: list[tuple[int, int, str]] = []
    for (ctype, value), (_, name) in zip(packed, kernel.params):
        if not ctype.rstrip().endswith("*"):
            out.append(value)
            continue
        addr = int(value)
        if addr == 0:
            out.append(None)
            continue
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr >= ends[i]:
            raise EmulatorLaunchError(f"kernel '{kernel.name}' argument '{name}': address {addr:#x} is inside no live "
                                      "torch CPU tensor (a sanitized launch copies the tensor's allocation)")
        nbytes = ends[i] - addr
        view = np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(addr))
        if ctype.lstrip().startswith("const"):
            view.flags.writeable = False
        else:
            for lo, hi, other in written:
                if addr < hi and lo < ends[i]:
                    raise EmulatorLaunchError(f"kernel '{kernel.name}': output arguments '{other}' and '{name}' "
                                              "share an allocation; a sanitized launch needs them apart")
            written.append((addr, ends[i], name))
        out.append(view)
    return out


def _allocations() -> tuple[list[int], list[int]]:
    """(starts, ends) of the storages of every live strided torch CPU tensor, sorted by start."""
    import torch

    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - a torch without fake tensors
        FakeTensor = ()  # noqa: N806
    spans: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): no attribute access on odd objects
            continue
        if issubclass(type(obj), FakeTensor):  # tracing leftovers: no storage of their own
            continue
        try:
            if obj.device.type != "cpu" or obj.layout != torch.strided:
                continue
            storage = obj.untyped_storage()
            start, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without real storage
            continue
        if nbytes and start:
            spans[start] = max(spans.get(start, 0), nbytes)
    ordered = sorted(spans.items())
    return [s for s, _ in ordered], [s + n for s, n in ordered]


def cpu_module(spec: KernelSpec) -> CpuModule:
    """The emulator build of ``spec`` in the settings' thread order (memoised)."""
    from ..settings import get_settings

    return _cpu_module(spec, get_settings().emu_schedule)


@functools.lru_cache(maxsize=None)
def _cpu_module(spec: KernelSpec, schedule: str) -> CpuModule:
    return CpuModule(spec, schedule)
