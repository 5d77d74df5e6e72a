"""Rendering: the whole matrix renders, deterministically, with Algorithm 4 comments; generated/ is fresh."""
from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from fagen import KernelSpec, render
from fagen.generate import all_specs, expected_files, standard_matrix
from fagen.renderer import ALG4, _env

REPO = Path(__file__).resolve().parent.parent


def test_standard_matrix_shape() -> None:
    specs = standard_matrix()
    assert len(specs) == 4 * 2 * 3 * 2
    assert {s.head_dim for s in specs} == {32, 64, 96, 128}
    assert {s.arch for s in specs} == {"sm_90"}
    assert len({s.name for s in specs}) == len(specs)


@pytest.mark.parametrize("spec", standard_matrix(), ids=lambda s: s.name)
def test_matrix_renders(spec: KernelSpec) -> None:
    r = render(spec)
    assert r.source.count('extern "C" __global__') == len(r.kernels)
    for k in r.kernels:
        assert k.name in r.source
        for _, pname in k.params:
            assert pname in r.source
    assert f"constexpr int BLOCK_R = {spec.tile.block_r};" in r.source
    assert f"static_assert(SMEM_BYTES == {spec.smem_bytes}" in r.source
    assert f"constexpr bool IS_CAUSAL = {str(spec.causal).lower()};" in r.source
    if spec.direction == "bwd":
        for line in (7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 20, 21, 22, 24):
            assert f"// Algorithm 4 line {line}: {ALG4[line]}" in r.source


def test_render_is_byte_identical() -> None:
    spec = KernelSpec(head_dim=96, dtype="bfloat16", causal=True, key_padding=True, dropout=True)
    render.cache_clear()
    a = render(spec).source
    render.cache_clear()
    b = render(spec).source
    assert a == b


def test_runtime_values_are_not_baked_in() -> None:
    src = render(KernelSpec(head_dim=64)).source
    for runtime in ("seqlen_q", "seqlen_k", "heads", "scale", "seed", "offset", "drop_threshold"):
        assert f"constexpr int {runtime}" not in src
        assert runtime in src  # ...they are kernel arguments


def test_strict_undefined() -> None:
    with pytest.raises(jinja2.UndefinedError):
        _env().get_template("partials/header.cuh.j2").render()


def test_generated_is_fresh() -> None:
    """generated/ must equal what the templates emit now: run `fagen generate --all --out generated/`."""
    gen = REPO / "generated"
    files = expected_files(all_specs())
    stale = [n for n, text in files.items() if not (gen / n).exists() or (gen / n).read_text() != text]
    extra = sorted(p.name for p in gen.glob("*.cu") if p.name not in files)
    assert not stale and not extra, f"generated/ is stale ({stale[:3]}...) or has extra files {extra[:3]}: run `fagen generate --all --out generated/`"
