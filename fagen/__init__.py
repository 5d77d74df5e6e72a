"""fagen: a compiler-style generator of specialised FlashAttention kernels."""
from __future__ import annotations

from ._version import __version__
from .compiler import CompiledModule, KernelResources, compile
from .errors import CompileError, FagenError, InputError, InputTypeError, SpecError
from .functional import attention_backward, attention_forward, dropout_keep_mask, run_backward, run_forward
from .ops import draw_rng_state, flash_attn_func, scaled_dot_product_attention
from .renderer import Rendered, render
from .spec import KernelSpec

__all__ = [
    "__version__", "KernelSpec", "render", "Rendered", "compile", "CompiledModule", "KernelResources",
    "FagenError", "SpecError", "InputError", "InputTypeError", "CompileError",
    "attention_forward", "attention_backward", "dropout_keep_mask", "run_forward", "run_backward",
    "flash_attn_func", "scaled_dot_product_attention", "draw_rng_state",
]
