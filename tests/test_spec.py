"""KernelSpec: paper formula, feasible tiles, validation, names."""
from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from fagen import KernelSpec
from fagen.families import get_family
from fagen.spec import ARCH_SMEM_OPTIN, DTYPE_ITEMSIZE, paper_tile


@pytest.mark.parametrize("d", [8, 32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("sram", [32768, 65536, 101376, 232448])
def test_paper_point_matches_algorithm4_line2(d: int, dtype: str, sram: int) -> None:
    m = sram // DTYPE_ITEMSIZE[dtype]
    expected = (min(math.ceil(m / (4 * d)), d), math.ceil(m / (4 * d)))
    assert paper_tile(sram, DTYPE_ITEMSIZE[dtype], d) == expected
    try:
        s = KernelSpec(head_dim=d, dtype=dtype, sram_bytes=sram)
    except ValidationError as e:  # M too small for even a 16x16 tile: says so, on a tile field
        assert e.errors()[0]["loc"][0] in ("block_r", "block_c") and "smallest" in str(e)
        return
    assert (s.paper_block_r, s.paper_block_c) == expected


def test_issue_example_point() -> None:
    s = KernelSpec(head_dim=64, dtype="float16", sram_bytes=65536, arch="sm_90")
    assert (s.paper_block_r, s.paper_block_c) == (64, 128)
    assert s.smem_bytes <= 65536


@pytest.mark.parametrize("direction", ["bwd", "fwd"])
@pytest.mark.parametrize("d", [8, 16, 40, 64, 80, 96, 128, 160, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_feasible_tile_invariants(direction: str, d: int, dtype: str, arch: str) -> None:
    s = KernelSpec(direction=direction, head_dim=d, dtype=dtype, arch=arch)
    fam = get_family(s.impl)
    t = s.tile
    assert s.sram_bytes == ARCH_SMEM_OPTIN[arch]
    assert t.block_r % 16 == 0 and t.block_c % 16 == 0
    assert 16 <= t.block_r <= fam.max_block_r and 16 <= t.block_c <= fam.max_block_c
    assert t.block_r <= max(16, s.paper_block_r // 16 * 16) and t.block_c <= max(16, s.paper_block_c // 16 * 16)
    assert s.smem_bytes <= s.sram_bytes
    # the layout is exactly the sum of its aligned buffers
    assert s.smem_bytes == sum(s.smem_layout.breakdown().values())
    # no slack: growing both dimensions by one quantum would not fit (or passes the paper point / cap)
    start_r, start_c = fam.tile_caps(direction, d, s.num_warps)  # the family's default-tile caps
    assert t.block_r <= start_r and t.block_c <= start_c
    cap_r = min(start_r, max(16, s.paper_block_r // 16 * 16))
    cap_c = min(start_c, max(16, s.paper_block_c // 16 * 16))
    if t.block_r + 16 <= cap_r and t.block_c + 16 <= cap_c:
        grown = fam.smem_layout(direction, d, s.itemsize, t.block_r + 16, t.block_c + 16).total_bytes
        assert grown > s.sram_bytes


def test_smem_layout_counts_every_buffer() -> None:
    s = KernelSpec(head_dim=64, dtype="float16", block_r=64, block_c=128, impl="simt")
    b = s.smem_layout.breakdown()
    ld, p_ld = 64 + 2, 128 + 1  # rows padded to an odd number of 32-bit words (bank conflicts)
    assert b["k"] == b["v"] == 128 * ld * 2
    assert b["dk"] == b["dv"] == 128 * 64 * 4
    assert b["q"] == b["do_"] == 64 * ld * 2
    assert b["p"] == 64 * p_ld * 4
    assert b["lse"] == b["delta"] == 64 * 4
    assert s.smem_bytes == sum(b.values()) == 149760


def test_overrides_and_name() -> None:
    s = KernelSpec(head_dim=64, dtype="float16", causal=True, dropout=True, arch="sm_90", impl="simt")
    assert s.name == "fa_bwd_d64_fp16_causal_dropout_br64_bc128_w4_simt_sm90"
    o = s.replace(block_r=32, block_c=64, num_warps=8)
    assert (o.tile.block_r, o.tile.block_c) == (32, 64)
    assert o.name == "fa_bwd_d64_fp16_causal_dropout_br32_bc64_w8_simt_sm90"
    assert KernelSpec(head_dim=64, sram_bytes=65536).name.endswith("_m65536")
    assert s.cache_key == KernelSpec(head_dim=64, causal=True, dropout=True, impl="simt").cache_key
    assert s.cache_key != o.cache_key


def test_spec_is_frozen_and_strict() -> None:
    s = KernelSpec(head_dim=64)
    with pytest.raises(ValidationError):
        s.head_dim = 128  # type: ignore[misc]
    with pytest.raises(ValidationError, match="extra"):
        KernelSpec(head_dim=64, batch=2)  # runtime values are not spec fields


@pytest.mark.parametrize(
    "kwargs, field, needle",
    [
        ({"head_dim": 60}, "head_dim", "multiple of 8"),
        ({"head_dim": 264}, "head_dim", "8..256"),
        ({"head_dim": 0}, "head_dim", "8..256"),
        ({"head_dim": 64, "dtype": "float16x"}, "dtype", "float16"),
        ({"head_dim": 64, "dtype": "float64", "impl": "mma"}, "impl", "float64"),
        ({"head_dim": 64, "arch": "sm_70"}, "arch", "sm_80"),
        ({"head_dim": 64, "sram_bytes": 300000}, "sram_bytes", "232448"),
        ({"head_dim": 64, "arch": "sm_86", "sram_bytes": 166912}, "sram_bytes", "101376"),
        ({"head_dim": 64, "sram_bytes": -1}, "sram_bytes", "positive"),
        ({"head_dim": 64, "block_r": 24}, "block_r", "multiple of 16"),
        ({"head_dim": 64, "block_c": 256, "impl": "simt"}, "block_c", "16..128"),
        ({"head_dim": 64, "block_r": 128, "block_c": 128, "sram_bytes": 65536, "impl": "simt"}, "block_c", "65536"),
        ({"head_dim": 64, "dtype": "float32", "knobs": {"stages": 2}}, "knobs", "no knob 'stages'"),
        ({"head_dim": 64, "knobs": {"a": 1, "b": 2}, "impl": "simt"}, "knobs", "no knob 'a'"),
        ({"head_dim": 256, "dtype": "float32", "sram_bytes": 20000}, "block_c", "smallest"),
        ({"head_dim": 64, "num_warps": 3}, "num_warps", "(1, 2, 4, 8)"),
        ({"head_dim": 64, "impl": "wgmma"}, "impl", "simt"),
    ],
)
def test_validation_names_field_and_limit(kwargs: dict, field: str, needle: str) -> None:
    with pytest.raises(ValidationError) as ei:
        KernelSpec(**kwargs)
    err = ei.value.errors()[0]
    assert err["loc"] and err["loc"][0] == field
    assert needle in err["msg"]


def test_impl_and_knobs_are_resolved_and_stored() -> None:
    s = KernelSpec(head_dim=64, dtype="float32")
    assert s.impl == "simt" and s.knobs == ()  # resolved at validation: name and key carry them
    assert '"impl":"simt"' in s.model_dump_json()
    assert KernelSpec(**s.model_dump()) == s  # a dump rebuilds the same spec
    assert s.replace(impl=None) == s  # None: the default family of the fields
    with pytest.raises(ValidationError, match="impl must be one of"):
        KernelSpec(head_dim=64, impl="nope")
