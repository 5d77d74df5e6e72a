"""fagen: a compiler-style generator of specialised FlashAttention kernels."""
from __future__ import annotations

from ._version import __version__
from .compiler import CompiledModule, KernelResources, compile
from .errors import CompileError, FagenError, InputError, InputTypeError, SpecError
from .renderer import Rendered, render
from .spec import KernelSpec

__all__ = [
    "__version__", "KernelSpec", "render", "Rendered", "compile", "CompiledModule", "KernelResources",
    "FagenError", "SpecError", "InputError", "InputTypeError", "CompileError",
]
