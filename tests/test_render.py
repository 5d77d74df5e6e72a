"""Rendering: the whole matrix renders, deterministically, with Algorithm 4 comments; generated/ is fresh."""
from __future__ import annotations

import re
from pathlib import Path

import jinja2
import jinja2.meta
import pytest

from fagen import KernelSpec, render
from fagen.generate import all_specs, expected_files, standard_matrix
from fagen.families import get_family
from fagen.renderer import ALG4, environment, template_context

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
        environment().get_template("partials/header.cuh.j2").render()


def test_generated_is_fresh() -> None:
    """generated/ must equal what the templates emit now: run `fagen generate --all --out generated/`."""
    gen = REPO / "generated"
    files = expected_files(all_specs())
    stale = [n for n, text in files.items() if not (gen / n).exists() or (gen / n).read_text() != text]
    extra = sorted(p.name for p in gen.glob("*.cu") if p.name not in files)
    assert not stale and not extra, f"generated/ is stale ({stale[:3]}...) or has extra files {extra[:3]}: run `fagen generate --all --out generated/`"


def _template_names() -> list[str]:
    root = REPO / "templates"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("name", _template_names())
def test_templates_receive_decisions(name: str) -> None:
    """No template reads the spec: every value it prints or branches on is a named constant (or the
    layout, knobs, kernels) that Python put into the context."""
    text = (REPO / "templates" / name).read_text()
    used = jinja2.meta.find_undeclared_variables(environment().parse(text))
    assert not {v for v in used if "spec" in v or v == "tile"}, f"{name} reads {sorted(used)}"
    assert not re.search(r"\bspec\.", text), f"{name} names a spec field"
    assert not re.search(r"\{[{%][^}]*\bspec", text), f"{name} has a Jinja expression on the spec"


def test_context_has_no_spec_and_matches_generated() -> None:
    """The standard matrix and the feature representatives render, from a context without a spec,
    to exactly the committed generated/ sources; the family's Constants are named in the context
    and declared once in the source."""
    gen = REPO / "generated"
    for spec in all_specs():
        ctx = template_context(spec)
        assert "spec" not in ctx and "tile" not in ctx
        assert ctx["HEAD_DIM"] == spec.head_dim and ctx["IS_DETERMINISTIC"] is spec.deterministic
        src = "".join(environment().get_template(t).render(**ctx) for t in get_family(spec.impl).templates(spec.direction))
        assert src == (gen / f"{spec.name}.cu").read_text(), spec.name
        for c in ctx["constants"]:
            assert ctx[c.name] == c.value
            assert src.count(f"constexpr {c.ctype} {c.name} = ") == 1, (spec.name, c.name)


def test_mma_decisions_are_constants() -> None:
    """The mma family's register/smem and dq sub-step decisions come from Python as constants."""
    from fagen.families.mma import MAX_REG_ACC_DIM, dq_key_chunk

    wide = KernelSpec(head_dim=256, deterministic=True, impl="mma")
    narrow = KernelSpec(head_dim=64, attn_mask=True, impl="mma")
    fwd = KernelSpec(direction="fwd", head_dim=256, impl="mma")
    c_wide, c_narrow, c_fwd = template_context(wide), template_context(narrow), template_context(fwd)
    assert c_wide["ACC_IN_SMEM"] is True and 256 > MAX_REG_ACC_DIM and c_narrow["ACC_IN_SMEM"] is False
    assert c_wide["KV_IN_REGS"] is False and c_narrow["KV_IN_REGS"] is True
    assert c_narrow["LSE_NOW"] is True and template_context(KernelSpec(head_dim=64, impl="mma"))["LSE_NOW"] is False
    assert c_wide["DQ_KC"] == dq_key_chunk(256, wide.tile.block_c) and "DQ_KC" not in c_narrow
    assert c_fwd["Q_IN_REGS"] is False and "ACC_IN_SMEM" not in c_fwd
    src = render(wide).source
    assert "constexpr bool ACC_IN_SMEM = true;" in src and "DqKeyChunk" not in src
    assert f"constexpr int DS_LD = {wide.tile.block_r + 8};" in src


def test_a_context_name_given_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from fagen.families import Constant

    spec = KernelSpec(head_dim=64, impl="mma")
    fam = get_family("mma")
    monkeypatch.setattr(type(fam), "template_context",
                        lambda self, s: {"strides": {}, "constants": (Constant("HEAD_DIM", "int", 1, "x"),)})
    with pytest.raises(ValueError, match="HEAD_DIM"):
        template_context(spec)
