"""Argument packing shared by both launchers: values in a kernel's parameter order (fagen.abi)."""
from __future__ import annotations

from typing import Any

from ..plan import KernelInfo


def pack(kernel: KernelInfo, args: dict[str, Any]) -> list[tuple[str, Any]]:
    """(ctype, value) in the kernel's parameter order; a missing argument is a bug, named."""
    missing = [n for _, n in kernel.params if n not in args]
    if missing:
        raise KeyError(f"{kernel.name}: missing kernel arguments {missing}")
    return [(t, args[n]) for t, n in kernel.params]
