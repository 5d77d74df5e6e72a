"""Kernel families: each owns its templates, tile limits and smem layout.

A family is looked up by ``KernelSpec.impl``. The portable SIMT family is
``simt``; a tensor-core family registers itself here under its own name and
nothing else in the pipeline changes.
"""
from __future__ import annotations

from typing import Protocol

from ..layout import SmemLayout


class Family(Protocol):
    name: str
    tile_multiple: int
    max_block_r: int
    max_block_c: int

    def unsupported_reason(self, direction: str, head_dim: int, dtype: str, arch: str) -> str | None:
        """Why this family cannot implement the spec, or None."""

    def smem_layout(self, direction: str, head_dim: int, itemsize: int, block_r: int, block_c: int) -> SmemLayout:
        """Exact dynamic-smem layout of the kernel that uses the most shared memory."""

    def strides(self, head_dim: int, itemsize: int, block_c: int) -> dict[str, int]:
        """Named smem row strides (elements) the layout uses, emitted as constexprs."""

    def templates(self, direction: str) -> tuple[str, ...]:
        """Template files (under templates/) rendered, in order, for this direction."""


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    _REGISTRY[family.name] = family
    return family


def get_family(name: str) -> Family:
    return _REGISTRY[name]


def family_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


from . import simt as _simt  # noqa: E402,F401  (registers itself)
