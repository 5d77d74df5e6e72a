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


class EmulatorMemoryError(EmulatorError):
    """AddressSanitizer (``sanitize=True``) found an invalid memory access;
    ``report`` holds the ASan report."""

    def __init__(self, message: str, report: str = "") -> None:
        self.report = report
        super().__init__(f"{message}\n{report}" if report else message)
