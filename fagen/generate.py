"""The standard matrix and generated/: emitted sources, written only if different."""
from __future__ import annotations

import json
from pathlib import Path

from .renderer import render
from .spec import KernelSpec

STANDARD_HEAD_DIMS = (32, 64, 96, 128)
STANDARD_DTYPES = ("float16", "bfloat16")
#: (causal, key_padding, dropout)
STANDARD_VARIANTS = ((False, False, False), (True, False, False), (True, True, True))
STANDARD_ARCH = "sm_90"


def standard_matrix() -> list[KernelSpec]:
    """head_dim x dtype x {plain, causal, causal+key_padding+dropout}, sm_90, backward and forward."""
    return [
        KernelSpec(direction=direction, head_dim=d, dtype=dt, causal=c, key_padding=kp, dropout=dr, arch=STANDARD_ARCH)
        for direction in ("bwd", "fwd")
        for d in STANDARD_HEAD_DIMS
        for dt in STANDARD_DTYPES
        for c, kp, dr in STANDARD_VARIANTS
    ]


def write_if_different(path: Path, text: str) -> bool:
    """Write ``text`` unless the file already holds exactly it. Returns True if written."""
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def expected_files(specs: list[KernelSpec]) -> dict[str, str]:
    """File name -> content for ``specs`` plus manifest.json (spec JSON -> file)."""
    files = {f"{s.name}.cu": render(s).source for s in specs}
    manifest = [{"spec": s.model_dump(), "file": f"{s.name}.cu"} for s in specs]
    files["manifest.json"] = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    return files


def generate(specs: list[KernelSpec], out: Path, *, prune: bool = False) -> list[Path]:
    """Emit ``specs`` into ``out``; returns the files that changed. ``prune`` removes stale .cu files."""
    files = expected_files(specs)
    changed = [out / n for n, text in files.items() if write_if_different(out / n, text)]
    if prune:
        for p in out.glob("*.cu"):
            if p.name not in files:
                p.unlink()
                changed.append(p)
    return changed
