"""fagen: a compiler-style generator of specialised FlashAttention kernels.

The spec/render/compile layer imports no torch; the torch-facing API
(``attention_forward`` ..., ``flash_attn_func`` ...) is loaded on first use, so
``fagen inspect`` and ``fagen compile`` start fast.

Long work (an NVRTC compile, an emulator build) is reported on the ``logging``
logger ``"fagen"`` at INFO; the library only adds a ``NullHandler``, so it is
silent until the application enables it, e.g.
``logging.basicConfig(level=logging.INFO)``.
"""
from __future__ import annotations

import importlib as _importlib
import logging as _logging
from types import ModuleType as _ModuleType
from typing import Any as _Any

from ._version import __version__
from .compiler import CompiledModule, KernelResources, compile
from .errors import CompileError, FagenError, InputError, InputTypeError, SpecError
from .renderer import Rendered, render
from .spec import KernelSpec

# Library logging is silent unless the application configures it (the CLI logs INFO to stderr):
# logger "fagen" says one line per NVRTC compile and per emulator build.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

_LAZY = {
    "attention_forward": "functional", "attention_backward": "functional", "dropout_keep_mask": "functional",
    "run_forward": "functional", "run_backward": "functional",
    "flash_attn_func": "ops", "flash_attn_varlen_func": "ops", "flash_attn_qkvpacked_func": "ops",
    "flash_attn_kvpacked_func": "ops", "flash_attn_varlen_qkvpacked_func": "ops", "flash_attn_varlen_kvpacked_func": "ops", "scaled_dot_product_attention": "ops",
    "draw_rng_state": "ops", "AttentionOptions": "inputs",
}

__all__ = [
    "__version__", "KernelSpec", "render", "Rendered", "compile", "CompiledModule", "KernelResources",
    "FagenError", "SpecError", "InputError", "InputTypeError", "CompileError", *_LAZY,
]


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fagen' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (``__all__``) and the subpackages, nothing this module imported for itself."""
    modules = {n for n, v in globals().items() if isinstance(v, _ModuleType) and not n.startswith("_")}
    return sorted(set(__all__) | modules)
