"""Typed errors of the PTX level of the emulator (all :class:`fagen.emulator.EmulatorError`)."""
from __future__ import annotations

from ..errors import EmulatorError, EmulatorKernelError


class PtxUnsupportedError(EmulatorError):
    """The translator met a PTX instruction (or directive) form it does not implement. Never
    skipped: ``opcode`` and ``line`` (the PTX line) say which; ``kernel`` the entry when known."""

    def __init__(self, opcode: str, reason: str, line: int = 0, kernel: str = "", text: str = "") -> None:
        self.opcode, self.reason, self.line, self.kernel, self.text = opcode, reason, line, kernel, text
        where = f"PTX line {line}" + (f" of kernel '{kernel}'" if kernel else "")
        shown = f": {text.strip()[:160]!r}" if text else ""
        super().__init__(f"unsupported PTX {opcode or 'statement'} at {where} ({reason}){shown}")


class PtxHazardError(EmulatorKernelError):
    """A hazard only the PTX level sees (raised by a PTX-level launch): a register of an in-flight
    ``wgmma.mma_async`` (its accumulator or its A fragment) accessed before the
    ``wgmma.wait_group`` that retires it, or a wgmma issued without ``wgmma.fence`` after its
    registers were accessed; a cp.async destination accessed before its thread's wait (or read by
    another thread before the barrier that publishes it); shared memory the async proxy reads
    (wgmma operand, bulk / TMA store source) written through the generic proxy with no
    ``fence.proxy.async`` by its writer since; a thread exiting with bulk stores not drained by
    ``cp.async.bulk.wait_group``. The message names the kernel, the CTA, the PTX line, the warp and
    the thread (and the PTX line of the other instruction involved); ``ptx_line`` is the PTX line
    of the offending instruction."""

    def __init__(self, message: str, kernel: str = "", block: tuple[int, int, int] | None = None,
                 ptx_line: int = 0) -> None:
        self.ptx_line = ptx_line
        super().__init__(message, kernel, block)
