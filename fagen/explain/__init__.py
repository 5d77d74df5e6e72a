"""``fagen explain``: what a generated kernel does, as data (:func:`explain`) and as one
self-contained HTML page (:func:`render_html`, :func:`write_html`). See docs/explain.md.

Loaded lazily, so the CLI that registers the subcommand starts fast."""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"explain": "facts", "tile_counts": "facts", "render_html": "page",
         "write_html": "page"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fagen.explain' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
