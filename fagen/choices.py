"""Persisted tuning choices: one JSON file under ``cache_root("autotune")``.

This module sits below the functional API (which looks choices up on every call)
and below the autotuner (which records them), so neither imports the other.

Format (``choices.json``)::

    {"format": 1,
     "entries": {"<sha256 of the canonical key>": {
         "key": {"device_name", "capability", "fagen_version", "nvrtc_version", "spec", "seqlen_bucket"},
         "choice": {"block_r", "block_c", "num_warps", "impl", "knobs"},
         "problem": {"batch", "heads", "seqlen_q", "seqlen_k"},
         "measured_ms", "predicted_ms", "default_ms", "recorded_at"}}}

Writers read-modify-write under a file lock and replace the file atomically,
so readers never see a torn file and concurrent tuners keep each other's
entries. A file that does not parse is ignored with a warning and rewritten by
the next ``record``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from . import cache, nvrtc
from ._version import __version__
from .settings import get_settings
from .spec import KernelSpec

FORMAT = 1
FILENAME = "choices.json"

_memo: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}
_memo_lock = threading.Lock()


def seqlen_bucket(n: int) -> int:
    """Smallest power of two >= n (at least 16): choices are keyed by this bucket."""
    return max(16, 1 << max(0, (n - 1).bit_length()))


def store_path() -> Path:
    return cache.cache_root("autotune") / FILENAME


def make_key(spec: KernelSpec, *, seqlen_q: int, seqlen_k: int, device_name: str,
             capability: tuple[int, int]) -> dict[str, Any]:
    return {
        "device_name": device_name,
        "capability": [int(capability[0]), int(capability[1])],
        "fagen_version": __version__,
        "nvrtc_version": list(nvrtc.version()),
        "spec": spec.without_tiles(),
        "seqlen_bucket": [seqlen_bucket(seqlen_q), seqlen_bucket(seqlen_k)],
    }


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _parse(raw: bytes, path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except ValueError as e:
        warnings.warn(f"autotune: ignoring corrupt tuning file {path} ({e}); it will be rewritten", stacklevel=3)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        warnings.warn(f"autotune: ignoring tuning file {path} of an unknown format; it will be rewritten", stacklevel=3)
        return None
    return data


def load(path: Path | None = None) -> dict[str, Any]:
    """The parsed file (memoised on mtime and size); empty when missing or corrupt."""
    path = path or store_path()
    try:
        st = path.stat()
    except FileNotFoundError:
        return {"format": FORMAT, "entries": {}}
    stamp = (st.st_mtime_ns, st.st_size)
    with _memo_lock:
        hit = _memo.get(str(path))
        if hit is not None and hit[0] == stamp:
            return hit[1]
    data = _parse(path.read_bytes(), path) or {"format": FORMAT, "entries": {}}
    with _memo_lock:
        _memo[str(path)] = (stamp, data)
    return data


def record(spec: KernelSpec, *, seqlen_q: int, seqlen_k: int, device_name: str, capability: tuple[int, int],
           batch: int | None = None, heads: int | None = None, measured_ms: float | None = None,
           predicted_ms: float | None = None, default_ms: float | None = None) -> dict[str, Any]:
    """Persist ``spec``'s tile, warps and family as the choice for its key. Returns the entry."""
    key = make_key(spec, seqlen_q=seqlen_q, seqlen_k=seqlen_k, device_name=device_name, capability=capability)
    t = spec.tile
    entry = {
        "key": key,
        "choice": {"block_r": t.block_r, "block_c": t.block_c, "num_warps": spec.num_warps, "impl": spec.impl,
                   "knobs": spec.knob_values},
        "problem": {"batch": batch, "heads": heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k},
        "measured_ms": measured_ms, "predicted_ms": predicted_ms, "default_ms": default_ms,
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = store_path()
    with cache.locked(path):
        data: dict[str, Any] | None = None
        if path.exists():
            data = _parse(path.read_bytes(), path)
        data = data or {"format": FORMAT, "entries": {}}
        data["entries"][key_digest(key)] = entry
        cache.atomic_write(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
    return entry


def lookup(spec: KernelSpec, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device_name: str,
           capability: tuple[int, int]) -> KernelSpec | None:
    """The tuned spec for this problem and device, or None (no entry, or lookups turned off).

    ``batch`` and ``heads`` are accepted for the ops' convenience; choices are keyed by the
    seqlen bucket only (they are recorded with the problem they were tuned on).
    """
    if not get_settings().autotune_lookup:
        return None
    entries = load().get("entries", {})
    if not entries:  # nothing tuned: skip building the key (it asks NVRTC for its version)
        return None
    key = make_key(spec, seqlen_q=seqlen_q, seqlen_k=seqlen_k, device_name=device_name, capability=capability)
    entry = entries.get(key_digest(key))
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    choice = entry.get("choice")
    if not isinstance(choice, dict):
        return None
    try:
        knobs = choice.get("knobs")
        return spec.replace(block_r=int(choice["block_r"]), block_c=int(choice["block_c"]),
                            num_warps=int(choice["num_warps"]), impl=str(choice["impl"]),
                            knobs={str(k): int(v) for k, v in knobs.items()} if isinstance(knobs, dict) else None)
    except (KeyError, TypeError, ValueError, AttributeError, ValidationError):
        return None  # a stale choice (e.g. a family that no longer exists) is no choice


def tuned_or_default(spec: KernelSpec, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                     device: Any) -> KernelSpec:
    """``lookup`` for a torch device; ``spec`` unchanged on CPU devices or without an entry."""
    if getattr(device, "type", str(device)) != "cuda" or not get_settings().autotune_lookup:
        return spec
    import torch

    idx = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
    name, cap = _device_identity(int(idx))
    found = lookup(spec, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                   device_name=name, capability=cap)
    return found if found is not None else spec


@functools.lru_cache(maxsize=16)
def _device_identity(index: int) -> tuple[str, tuple[int, int]]:
    import torch

    cap = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), (int(cap[0]), int(cap[1]))
