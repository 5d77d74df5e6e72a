"""Fiber stacks shared by every emulator module of the process.

Each emulator thread runs on a fiber stack with a guard page below it: two
memory mappings per thread. Loaded modules are never unloaded, so stacks kept
per module would add ~2 x block-size mappings for every spec a process ever
uses, up to ``vm.max_map_count``. Instead each launch borrows an arena (one
stack per thread of its block) from this pool and gives it back afterwards:
the mappings grow with the number of launches running at the same time, not
with the number of modules.

Arenas are mapped by a module's ``fagen_emu_map_stacks`` (runtime.h owns the
layout) and keyed by the module's stack stride (``-DFAGEN_EMU_STACK_BYTES``).
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import EmulatorLaunchError

MAX_BLOCK_THREADS = 1024  # CUDA's limit; the runtime rejects larger blocks itself
_MIN_ARENA = 32


@dataclass
class _Arena:
    base: int
    count: int
    lib: ctypes.CDLL  # the module that mapped it (its fagen_emu_unmap_stacks frees it)


_idle: dict[int, list[_Arena]] = {}  # stride -> arenas no launch is using
_lock = threading.Lock()


def _arena_size(nthreads: int) -> int:
    """Power of two >= nthreads (so a few growth steps cover every block size)."""
    n = _MIN_ARENA
    while n < nthreads:
        n *= 2
    return min(n, MAX_BLOCK_THREADS)


def _take(lib: ctypes.CDLL, stride: int, nthreads: int) -> _Arena:
    with _lock:
        idle = _idle.setdefault(stride, [])
        fits = [a for a in idle if a.count >= nthreads]
        if fits:
            arena = min(fits, key=lambda a: a.count)
            idle.remove(arena)
            return arena
        if idle:  # too small for this block: replace it instead of keeping both
            small = idle.pop()
            small.lib.fagen_emu_unmap_stacks(small.base, small.count)
    count = _arena_size(nthreads)
    base = lib.fagen_emu_map_stacks(count)
    if not base:
        raise EmulatorLaunchError(f"cannot map {count} fiber stacks of {stride} bytes")
    return _Arena(base, count, lib)


@contextmanager
def borrowed(lib: ctypes.CDLL, nthreads: int) -> Iterator[tuple[int, int]]:
    """(base, count) of stacks for a block of ``nthreads`` threads, for the duration of the block."""
    stride = lib.fagen_emu_stack_stride()
    arena = _take(lib, stride, max(1, min(nthreads, MAX_BLOCK_THREADS)))
    try:
        yield arena.base, arena.count
    finally:
        with _lock:
            _idle.setdefault(stride, []).append(arena)


def declare(lib: ctypes.CDLL) -> None:
    """Sets the ctypes signatures of a module's stack functions."""
    lib.fagen_emu_stack_stride.argtypes, lib.fagen_emu_stack_stride.restype = [], ctypes.c_size_t
    lib.fagen_emu_map_stacks.argtypes, lib.fagen_emu_map_stacks.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.fagen_emu_unmap_stacks.argtypes, lib.fagen_emu_unmap_stacks.restype = [ctypes.c_void_p, ctypes.c_size_t], None
    lib.fagen_emu_use_stacks.argtypes, lib.fagen_emu_use_stacks.restype = [ctypes.c_void_p, ctypes.c_size_t], None
