"""The family contract: default family by preference, knobs in the name and key, per-buffer smem
alignment, family-owned launch geometry, NVRTC options and partials."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

import fagen.families as families
from fagen import KernelSpec
from fagen.compiler import options_for
from fagen.families import (Family, FamilyBase, FamilySpec, Knob, Launch, Reason, default_family, family_names,
                            get_family)
from fagen.families.simt import SimtFamily
from fagen.layout import place
from fagen.renderer import kernel_infos, render, templates_dir


@dataclasses.dataclass(frozen=True)
class Piped(SimtFamily):
    """A test family: SIMT's kernels, preferred for fp16 only, with a `stages` knob, a 128-byte
    aligned P tile, its own NVRTC option and a main kernel launched with BLOCK_C/16 warps."""

    name: str = "piped"
    preference: int = 10
    knobs: tuple[Knob, ...] = (Knob("stages", "s", 2, (2, 3)),)

    def unsupported_reason(self, fs: FamilySpec) -> str | None:
        return None if fs.dtype == "float16" else f"dtype {fs.dtype} (fp16 only)"

    def smem_layout(self, fs: FamilySpec) -> Any:
        base = super().smem_layout(fs)
        stages = fs.knob_values.get("stages", 2)
        entries = [(b.name, b.ctype, b.count, b.itemsize, 128 if b.name == "p" else 16) for b in base.buffers]
        return place(entries + [("ring", "T", stages * 8 * fs.head_dim, fs.itemsize, 256)])

    def config_reason(self, fs: FamilySpec) -> Any:
        if fs.num_warps == 8:
            return Reason("num_warps", "num_warps=8: piped runs 1, 2 or 4 warps")
        return super().config_reason(fs)

    def launch(self, fs: FamilySpec, role: Any) -> Launch:
        if role.name == "main":
            return Launch((32 * (fs.block_c // 16), 1, 1), fs.block_c)
        return super().launch(fs, role)

    def nvrtc_options(self, fs: FamilySpec) -> tuple[str, ...]:
        return (f"-DFA_STAGES={fs.knob_values['stages']}",)


@pytest.fixture
def piped() -> Iterator[Family]:
    """The registry holds SIMT and the test family only (whatever else is registered)."""
    fam = Piped()
    with families.registered_only(get_family("simt"), fam):
        yield fam


def test_simt_satisfies_the_protocol() -> None:
    simt = get_family("simt")
    assert isinstance(simt, Family)
    assert simt.knobs == () and simt.math_unit == "fp32"
    assert get_family("simt").roles(FamilySpec("bwd", 64, "float16", "sm_90"))[1].name == "main"
    assert get_family("mma").roles(KernelSpec(head_dim=64, deterministic=True).family_spec)[2].name == "dq"


def test_unknown_family_is_a_named_error() -> None:
    with pytest.raises(KeyError, match="no kernel family 'nope'"):
        get_family("nope")


def test_impl_defaults_to_the_preferred_family_that_supports_the_spec(piped: Family) -> None:
    assert family_names()[0] == "piped"
    assert default_family(FamilySpec("bwd", 64, "float16", "sm_90")) == "piped"
    assert default_family(FamilySpec("bwd", 64, "float32", "sm_90")) == "simt"
    s16, s32 = KernelSpec(head_dim=64), KernelSpec(head_dim=64, dtype="float32")
    assert (s16.impl, s32.impl) == ("piped", "simt")
    # the resolved impl is in the name and the key: the default spec equals the explicit one
    assert s16.name.endswith("_w4_s2_piped_sm90") and s32.name.endswith("_w4_simt_sm90")
    assert s16 == KernelSpec(head_dim=64, impl="piped", knobs={"stages": 2})
    assert s16.cache_key == KernelSpec(head_dim=64, impl="piped").cache_key
    # the default is the first family that takes the spec as given: piped rejects 8 warps
    assert KernelSpec(head_dim=64, num_warps=8).impl == "simt"
    with pytest.raises(ValidationError, match=r"no kernel family accepts this spec \(piped: .*; simt: .*\)") as e:
        KernelSpec(head_dim=64, block_c=256)
    assert e.value.errors()[0]["loc"] == ("block_c",)
    # an explicit impl is still validated
    with pytest.raises(ValidationError, match="fp16 only") as e:
        KernelSpec(head_dim=64, dtype="bfloat16", impl="piped")
    assert e.value.errors()[0]["loc"] == ("impl",)


def test_with_simt_alone_the_default_is_simt() -> None:
    with families.registered_only(get_family("simt")):
        assert KernelSpec(head_dim=64).impl == "simt" == default_family(FamilySpec("bwd", 64, "float16", "sm_90"))
        assert KernelSpec(head_dim=64, dtype="float32").impl == "simt"
    assert family_names() == tuple(sorted(family_names(), key=lambda n: (get_family(n).preference, n)))
    assert {"simt", "mma", "wgmma"} <= set(family_names())  # the registry is back


def test_knobs_enter_name_key_and_validation(piped: Family) -> None:
    s2, s3 = KernelSpec(head_dim=64), KernelSpec(head_dim=64, knobs={"stages": 3})
    assert s3.name == s2.name.replace("_s2_", "_s3_")
    assert s2.cache_key != s3.cache_key and s3.knob_values == {"stages": 3}
    assert s3.smem_bytes > s2.smem_bytes  # the family's layout sees the knob
    assert "constexpr int STAGES = 3;" in render(s3).source
    with pytest.raises(ValidationError, match=r"stages=4 must be one of \(2, 3\)") as e:
        KernelSpec(head_dim=64, knobs={"stages": 4})
    assert e.value.errors()[0]["loc"] == ("knobs",)
    with pytest.raises(ValidationError, match="has no knob 'stages'"):
        KernelSpec(head_dim=64, impl="simt", knobs={"stages": 2})
    # a new family starts from its own knob defaults; tuning fields are not part of without_tiles
    assert s3.replace(impl="simt").knobs == ()
    assert s3.without_tiles() == KernelSpec(head_dim=64, dtype="float16", impl="simt").without_tiles()


def test_family_owns_launch_geometry_and_nvrtc_options(piped: Family) -> None:
    s = KernelSpec(head_dim=64, block_r=32, block_c=64, knobs={"stages": 3})
    main = next(k for k in kernel_infos(s) if k.role.name == "main")
    assert main.block == (128, 1, 1) and main.rows_per_block == 64
    s = s.replace(block_c=128)
    main = render(s).kernel("main")
    assert main.block == (256, 1, 1)  # BLOCK_C / 16 warps, whatever num_warps says
    assert f"__launch_bounds__(256, fa::MIN_BLOCKS_PER_SM) {main.name}(" in render(s).source
    assert options_for(s)[-1] == "-DFA_STAGES=3"
    assert options_for(s.replace(impl="simt"))[:3] == [f"-arch={s.arch}", "-std=c++17", "-Xptxas=-v"]


def test_per_buffer_alignment() -> None:
    lay = place([("a", "T", 3, 2), ("b", "float", 5, 4, 128), ("c", "T", 1, 2)])
    assert [b.offset for b in lay.buffers] == [0, 128, 160]
    assert lay.max_align == 128 and lay.total_bytes == 176
    with pytest.raises(ValueError, match="power of two"):
        place([("a", "T", 1, 2, 24)])


def test_aligned_layout_compiles_with_its_static_asserts(piped: Family) -> None:
    """The header's static_asserts follow the alignment: the rendered module builds (emulator g++)."""
    s = KernelSpec(head_dim=32, block_r=16, block_c=32, knobs={"stages": 3})
    p = next(b for b in s.smem_layout.buffers if b.name == "p")
    assert p.offset % 128 == 0 and p.align == 128
    src = render(s).source
    assert "constexpr int SMEM_P_ALIGN = 128;" in src and "constexpr int SMEM_ALIGN = 256;" in src
    from fagen.runtime import get_module

    get_module(s, "cpu")  # g++ evaluates every static_assert of the layout


def test_simt_partials_live_under_templates_simt() -> None:
    common = (templates_dir() / "partials" / "common.cuh").read_text()
    assert "block_gemm" not in common and "load_tile" not in common
    src = render(KernelSpec(head_dim=64, impl="simt")).source
    assert "FA_DEVICE void block_gemm(" in src and "FA_DEVICE void load_tile(" in src
    assert (templates_dir() / "simt" / "tiles.cuh").is_file()


def test_family_base_rejects_bad_configs() -> None:
    fam = FamilyBase(name="x", knobs=(Knob("stages", "s", 2, (2, 3)),), warp_choices=(2, 4))
    fs = FamilySpec("bwd", 64, "float16", "sm_90")
    assert fam.config_reason(fs.with_tile(24, 64)).field == "block_r"
    assert fam.config_reason(fs.with_tile(16, 256)).field == "block_c"
    assert fam.config_reason(fs.with_tile(16, 16, num_warps=3)).field == "num_warps"
    assert fam.config_reason(fs.with_tile(16, 16, num_warps=8)).field == "num_warps"  # its own warp choices
    assert fam.config_reason(fs.with_tile(16, 16, knobs=(("stages", 5),))).field == "knobs"
    assert fam.config_reason(fs.with_tile(16, 16, knobs=(("stages", 3),))) is None
    with pytest.raises(ValueError, match="no tile"):
        fam.config_reason(fs)


def test_family_spec_is_what_a_family_sees() -> None:
    """KernelSpec builds one frozen FamilySpec: its fields, flags and tile; families take nothing else."""
    s = KernelSpec(head_dim=96, dtype="bfloat16", causal=True, causal_align="top_left", dropout=True,
                   deterministic=True, num_warps=8, arch="sm_80")
    fs = s.family_spec
    assert (fs.direction, fs.head_dim, fs.dtype, fs.arch, fs.num_warps) == ("bwd", 96, "bfloat16", "sm_80", 8)
    assert fs.flags == {"causal", "top_left", "dropout", "deterministic"} and fs.has("dropout") and not fs.has("window")
    assert fs.features == s.features == {"top_left", "deterministic"}
    assert fs.tile == s.tile and (fs.block_r, fs.block_c) == (s.tile.block_r, s.tile.block_c)
    assert fs.knob_values == s.knob_values and fs.itemsize == s.itemsize == 2 and fs.num_threads == 256
    assert get_family(s.impl).smem_layout(fs) == s.smem_layout
    assert FamilySpec("fwd", 64, "float64", "sm_90").features == {"float64"}
    assert [FamilySpec("fwd", 64, d, "sm_90").itemsize for d in ("float16", "float32", "float64")] == [2, 4, 8]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fs.head_dim = 64  # type: ignore[misc]
    assert hash(fs) == hash(s.family_spec)  # a cache key (tile resolution is keyed by it)
