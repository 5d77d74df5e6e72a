"""Typed errors of the CPU emulator.

All derive from :class:`EmulatorError` (a ``RuntimeError``), so callers can
catch the family or one kind.
"""
from __future__ import annotations


class EmulatorError(RuntimeError):
    """Base class of every error the emulator raises on purpose."""


class EmulatorBuildError(EmulatorError):
    """g++ rejected the emulator translation unit; ``log`` holds its output."""

    def __init__(self, message: str, log: str = "") -> None:
        self.log = log
        super().__init__(f"{message}\n{log}" if log else message)


class EmulatorLaunchError(EmulatorError):
    """Bad launch: unknown kernel, wrong arguments, invalid grid/block."""


class _KernelFailure(EmulatorError):
    """A failure inside a running kernel, located at one block."""

    def __init__(self, message: str, kernel: str = "", block: tuple[int, int, int] | None = None) -> None:
        self.kernel = kernel
        self.block = block
        super().__init__(message)


class EmulatorDeadlockError(_KernelFailure):
    """A barrier that can never complete: divergent ``__syncthreads``, a warp
    collective not reached by every lane of its mask, threads that exited while
    others wait. The message names the kernel, block, barrier and source line."""


class EmulatorKernelError(_KernelFailure):
    """The kernel stopped itself: ``__trap()``, ``fagen_emu_fail(...)``, or an
    invalid warp collective (bad width, mask without the caller's lane)."""


class EmulatorRaceError(_KernelFailure):
    """A racecheck launch (``build(..., racecheck=True)``, ``fagen.runtime.cpu.racecheck()``) found a
    hazard: two accesses of the same shared-memory bytes by different threads, at least one a
    write, that no barrier, ``__syncwarp`` or cp.async wait orders (or plain stores of two blocks
    to the same global bytes). The message names the kernel, the kind, the buffer and offset,
    both threads (block, warp, lane) and both source lines.

    ``kind``: ``"read-after-write"``, ``"write-after-read"`` or ``"write-after-write"``;
    ``space``: ``"shared"`` or ``"global"``; ``offset``: byte offset in the block's dynamic shared
    memory (shared) or the address (global); ``buffer``: the shared-memory buffer's name when the
    launch knew the layout, else None; ``lines``: the two accesses' ``FILE:LINE``, first then second."""

    def __init__(self, message: str, kernel: str = "", block: tuple[int, int, int] | None = None, *,
                 kind: str = "", space: str = "", offset: int = 0, buffer: str | None = None,
                 lines: tuple[str, str] = ("", "")) -> None:
        self.kind, self.space, self.offset, self.buffer, self.lines = kind, space, offset, buffer, lines
        super().__init__(message, kernel, block)


class EmulatorMemoryError(EmulatorError):
    """AddressSanitizer (``sanitize=True``) found an invalid memory access;
    ``report`` holds the ASan report."""

    def __init__(self, message: str, report: str = "") -> None:
        self.report = report
        super().__init__(f"{message}\n{report}" if report else message)
