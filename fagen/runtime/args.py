"""Argument packing shared by both launchers: values in a kernel's parameter order (fagen.abi)."""
from __future__ import annotations

from typing import Any, Mapping

from ..plan import KernelInfo


def pack(kernel: KernelInfo, args: dict[str, Any]) -> list[tuple[str, Any]]:
    """(ctype, value) in the kernel's parameter order; a missing argument is a bug, named."""
    missing = [n for _, n in kernel.params if n not in args]
    if missing:
        raise KeyError(f"{kernel.name}: missing kernel arguments {missing}")
    return [(t, args[n]) for t, n in kernel.params]


class LaunchArgs(dict):
    """A launch's arguments, name -> value (a plain dict to every launcher), that also keeps
    ``constants``: the launch plan's own mapping of the arguments that do not change from call
    to call (sizes, strides, scale, ...), the same object for every call of the plan and never
    changed. A launcher may convert those once per plan and only the others per call
    (:func:`fagen.runtime.gpu.cuda_args`)."""

    __slots__ = ("constants",)

    def __init__(self, constants: Mapping[str, Any], per_call: Mapping[str, Any]) -> None:
        if not constants.keys().isdisjoint(per_call):
            raise ValueError(f"per-call launch arguments {sorted(constants.keys() & per_call.keys())} are constants")
        dict.__init__(self, constants)
        self.update(per_call)
        self.constants = constants
