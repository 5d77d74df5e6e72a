"""A third family needs nothing outside its two folders and its registration: a toy family, written
into a temporary folder (a Python package with its Family object, a template folder with one
kernel template, one role of its own), registers, validates as a KernelSpec, renders, compiles
with NVRTC and runs on the CPU emulator."""
from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fagen.families as families
from fagen import KernelSpec, render
from fagen.compiler import compile as compile_spec

FAMILY_PY = '''
"""Toy family: y[i] = SCALE * x[reversed i within its block], through shared memory."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fagen.abi import Role
from fagen.families.base import Constant, FamilyBase, FamilySpec
from fagen.layout import SmemLayout, place

REVERSE = Role("main", (("const T*", "x"), ("T*", "y"), ("int", "n")), "q", "block_r")


@dataclass(frozen=True)
class ToyFamily(FamilyBase):
    name: str = "toy"
    preference: int = 1000
    template_dir: str | None = str(Path(__file__).resolve().parent.parent / "templates" / "toy")

    def unsupported_reason(self, fs: FamilySpec) -> str | None:
        return None if (fs.direction, fs.dtype) == ("fwd", "float32") else "toy: float32 forward only"

    def smem_layout(self, fs: FamilySpec) -> SmemLayout:
        return place([("x", "T", fs.block_r, fs.itemsize)])

    def roles(self, fs: FamilySpec) -> tuple[Role, ...]:
        return (REVERSE,)

    def template_context(self, fs: FamilySpec) -> dict[str, Any]:
        return {"strides": {}, "constants": (Constant("SCALE", "int", 3, "toy: the factor"),
                                             Constant("REVERSED", "bool", True, "toy: reverse within a block"))}

    def templates(self, direction: str) -> tuple[str, ...]:
        return ("toy/main.cu.j2",)


TOY = ToyFamily()
'''

TEMPLATE = r'''{% from "partials/signature.j2" import entry %}
{% include "partials/header.cuh.j2" %}
{% include "toy/reverse.cuh" %}
static_assert(fa::BLOCK_R <= fa::NUM_THREADS * 8, "toy: a few rows per thread");

{{ entry(kernels["main"]) }}
{
    using namespace fa;
    const Smem s = smem_carve();
    const int i0 = blockIdx.x * BLOCK_R;
    for (int r = threadIdx.x; r < BLOCK_R; r += NUM_THREADS)
        s.x[r] = i0 + r < n ? x[i0 + r] : T(0);
    fa_sync();
    for (int r = threadIdx.x; r < BLOCK_R; r += NUM_THREADS)
        if (i0 + r < n) y[i0 + r] = T(SCALE) * s.x[toy_source_row(r)];
}
'''

HEADER = r'''namespace fa {
// The row of the block's tile that row r reads (the family's decision REVERSED).
FA_DEVICE int toy_source_row(int r) { return REVERSED ? BLOCK_R - 1 - r : r; }
}  // namespace fa
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The toy family's two folders in a temporary directory, imported and registered."""
    (tmp_path / "toyfam").mkdir()
    (tmp_path / "toyfam" / "__init__.py").write_text(textwrap.dedent(FAMILY_PY))
    (tmp_path / "templates" / "toy").mkdir(parents=True)
    (tmp_path / "templates" / "toy" / "main.cu.j2").write_text(TEMPLATE)
    (tmp_path / "templates" / "toy" / "reverse.cuh").write_text(HEADER)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("toyfam")
    families.register(module.TOY)
    yield module.TOY
    families.unregister("toy")
    sys.modules.pop("toyfam", None)


def test_a_toy_family_registers_compiles_and_runs(toy: families.Family) -> None:
    assert isinstance(toy, families.Family) and "toy" in families.family_names()
    spec = KernelSpec(direction="fwd", head_dim=64, dtype="float32", impl="toy", block_r=64)
    assert spec.name.endswith("_toy_sm90") and KernelSpec(direction="fwd", head_dim=64, dtype="float32").impl != "toy"
    rendered = render(spec)
    assert [k.name for k in rendered.kernels] == [f"{spec.name}_main"]
    assert "constexpr int SCALE = 3;" in rendered.source and "toy_source_row" in rendered.source

    mod = compile_spec(spec)  # NVRTC: the toy's own template with the shared header and partials
    assert mod.resource("main").spill_store_bytes == 0 and mod.cubin[:4] == b"\x7fELF"

    from fagen.runtime import get_module

    n = 150  # three blocks of 64, the last one partial
    x = torch.arange(n, dtype=torch.float32)
    y = torch.full((n,), -1.0)
    kern = rendered.kernel("main")
    get_module(spec, "cpu").launch(kern, kern.grid(batch=1, heads=1, seqlen_q=n, seqlen_k=n),
                                   {"x": x.data_ptr(), "y": y.data_ptr(), "n": n})
    want = torch.cat([3 * x[i:i + 64].flip(0) if i + 64 <= n else 3 * torch.cat(
        [x[i:], torch.zeros(i + 64 - n)]).flip(0)[:n - i] for i in range(0, n, 64)])
    assert torch.equal(y, want)


def test_a_family_outside_the_package_is_not_a_built_in(toy: families.Family) -> None:
    assert toy not in families.BUILTIN_FAMILIES
    assert [f.name for f in families.BUILTIN_FAMILIES] == ["simt", "mma"]
    with pytest.raises(TypeError, match="takes a Family"):
        families.register(object())  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no kernel family 'nope'"):
        families.unregister("nope")
