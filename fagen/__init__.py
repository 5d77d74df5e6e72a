"""fagen: a compiler-style generator of specialised FlashAttention kernels.

The spec/render/compile layer imports no torch; the torch-facing API
(``attention_forward`` ..., ``flash_attn_func`` ...) is loaded on first use, so
``fagen inspect`` and ``fagen compile`` start fast.
"""
from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__
from .compiler import CompiledModule, KernelResources, compile
from .errors import CompileError, FagenError, InputError, InputTypeError, SpecError
from .renderer import Rendered, render
from .spec import KernelSpec

_LAZY = {
    "attention_forward": "functional", "attention_backward": "functional", "dropout_keep_mask": "functional",
    "run_forward": "functional", "run_backward": "functional",
    "flash_attn_func": "ops", "scaled_dot_product_attention": "ops", "draw_rng_state": "ops",
}

__all__ = [
    "__version__", "KernelSpec", "render", "Rendered", "compile", "CompiledModule", "KernelResources",
    "FagenError", "SpecError", "InputError", "InputTypeError", "CompileError", *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fagen' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
