"""The standard matrix and generated/: emitted sources, written only if different.

``manifest.json`` in the output directory lists the files ``generate`` owns
there (spec JSON -> file). Other files in the directory are never touched:
pruning removes only files the previous manifest listed and the new one does not.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError
from .renderer import render
from .spec import KernelSpec

STANDARD_HEAD_DIMS = (32, 64, 96, 128)
STANDARD_DTYPES = ("float16", "bfloat16")
#: (causal, key_padding, dropout)
STANDARD_VARIANTS = ((False, False, False), (True, False, False), (True, True, True))
STANDARD_ARCH = "sm_90"
MANIFEST = "manifest.json"


def standard_matrix() -> list[KernelSpec]:
    """head_dim x dtype x {plain, causal, causal+key_padding+dropout}, sm_90, backward and forward."""
    return [
        KernelSpec(direction=direction, head_dim=d, dtype=dt, causal=c, key_padding=kp, dropout=dr, arch=STANDARD_ARCH)
        for direction in ("bwd", "fwd")
        for d in STANDARD_HEAD_DIMS
        for dt in STANDARD_DTYPES
        for c, kp, dr in STANDARD_VARIANTS
    ]


#: The Hopper family's target: the standard head dims, dtypes and variants where it takes them.
HOPPER_ARCH = "sm_90a"


def hopper_matrix() -> list[KernelSpec]:
    """The standard matrix for sm_90a, each spec kept where the Hopper family (wgmma) implements it
    (where it does not, sm_90a resolves to the mma family, whose sm_90 kernels are already there)."""
    out = []
    for direction in ("bwd", "fwd"):
        for d in STANDARD_HEAD_DIMS:
            for dt in STANDARD_DTYPES:
                for c, kp, dr in STANDARD_VARIANTS:
                    spec = KernelSpec(direction=direction, head_dim=d, dtype=dt, causal=c, key_padding=kp, dropout=dr,
                                      arch=HOPPER_ARCH)
                    if spec.impl == "wgmma":
                        out.append(spec)
    return out


#: One representative per optional feature (fagen.families.FEATURES): d = 64, fp16 (float64: the
#: dtype itself), both directions where the feature changes both kernels. The family is the preferred
#: one that implements the feature.
FEATURE_VARIANTS: tuple[tuple[tuple[str, ...], dict], ...] = (
    (("bwd", "fwd"), {"causal": True, "window": True}),
    (("bwd", "fwd"), {"causal": True, "causal_align": "top_left"}),
    (("bwd", "fwd"), {"softcap": True}),
    (("bwd", "fwd"), {"causal": True, "alibi": True}),
    (("bwd", "fwd"), {"attn_mask": True}),
    (("fwd",), {"bias": True}),
    (("bwd",), {"bias": True, "bias_grad": True}),
    (("bwd", "fwd"), {"causal": True, "varlen": True}),
    (("bwd",), {"causal": True, "deterministic": True}),
    (("bwd", "fwd"), {"dtype": "float64"}),
    (("fwd",), {"causal": True, "sinks": True}),
    (("bwd", "fwd"), {"causal": True, "head_dim_v": 32}),
)
FEATURE_HEAD_DIM = 64


def feature_matrix() -> list[KernelSpec]:
    """One spec per optional feature and direction it applies to (FEATURE_VARIANTS), sm_90."""
    return [
        KernelSpec(direction=direction, head_dim=FEATURE_HEAD_DIM, arch=STANDARD_ARCH, **{"dtype": "float16", **flags})
        for directions, flags in FEATURE_VARIANTS
        for direction in directions
    ]


def all_specs() -> list[KernelSpec]:
    """What ``fagen generate --all`` emits: the standard matrix, its sm_90a kernels of the Hopper
    family and one representative per feature."""
    return standard_matrix() + hopper_matrix() + feature_matrix()


def write_if_different(path: Path, text: str) -> bool:
    """Write ``text`` unless the file already holds exactly it. Returns True if written."""
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def _manifest_text(entries: list[dict]) -> str:
    return json.dumps(entries, indent=2, sort_keys=True) + "\n"


def expected_files(specs: list[KernelSpec]) -> dict[str, str]:
    """File name -> content for ``specs`` plus manifest.json (spec JSON -> file)."""
    files = {f"{s.name}.cu": render(s).source for s in specs}
    files[MANIFEST] = _manifest_text([{"spec": s.model_dump(), "file": f"{s.name}.cu"} for s in specs])
    return files


def read_manifest(out: Path) -> list[dict]:
    """Entries of ``out``'s manifest.json ([] when there is none).

    Raises :class:`InputError` when the file exists but is not a manifest this
    module wrote (so it is neither trusted for pruning nor overwritten).
    """
    path = out / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    try:
        entries = json.loads(text)
    except ValueError:
        entries = None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("file"), str) for e in entries):
        raise InputError("out", f"a directory whose {MANIFEST} was written by fagen generate",
                         f"{path} (not a fagen manifest; move it away or choose another directory)")
    return entries


def _owned(entry: dict) -> str | None:
    """The file an entry names, if it is a plain ``*.cu`` name inside the directory."""
    name = entry["file"]
    return name if name.endswith(".cu") and Path(name).name == name and name not in (".", "..") else None


def generate(specs: list[KernelSpec], out: Path, *, prune: bool = False) -> list[Path]:
    """Emit ``specs`` into ``out``; returns the files that changed (written or removed).

    Without ``prune`` the manifest keeps the entries of earlier runs and adds
    these specs. With ``prune`` (``fagen generate --all``) the manifest becomes
    exactly ``specs``, and the files the previous manifest listed that are no
    longer produced are removed; files it never listed are left alone.
    """
    previous = read_manifest(out)
    files = expected_files(specs)
    if not prune:
        kept = [e for e in previous if e["file"] not in files]
        if kept:
            files[MANIFEST] = _manifest_text(kept + json.loads(files[MANIFEST]))
    changed = [out / n for n, text in files.items() if write_if_different(out / n, text)]
    if prune:
        for name in sorted({n for e in previous if (n := _owned(e)) is not None} - files.keys()):
            path = out / name
            if path.is_file():
                path.unlink()
                changed.append(path)
    return changed
