"""Launch status codes of the emulator runtime and the exceptions they become.

One mapping, used by in-process launches (module.py) and by the sanitized
child's result (sanitize.py). The codes are FAGEN_EMU_* in runtime.h.
"""
from __future__ import annotations

from .errors import EmulatorDeadlockError, EmulatorError, EmulatorKernelError, EmulatorLaunchError

STATUS_OK, STATUS_DEADLOCK, STATUS_KERNEL_ERROR, STATUS_BAD_LAUNCH, STATUS_RACE = 0, 1, 2, 3, 4

Dim3 = tuple[int, int, int]


def raise_for_status(status: int, message: str, kernel: str, block: Dim3 | None) -> None:
    """Turns a launch status code into the matching exception."""
    if status == STATUS_OK:
        return
    if status == STATUS_DEADLOCK:
        raise EmulatorDeadlockError(message, kernel, block)
    if status == STATUS_KERNEL_ERROR:
        raise EmulatorKernelError(message, kernel, block)
    if status == STATUS_BAD_LAUNCH:
        raise EmulatorLaunchError(message)
    raise EmulatorError(f"kernel '{kernel}': unknown emulator status {status}: {message}")
