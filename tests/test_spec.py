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
    # the start point: the family's default tile where it states one, else the paper point
    start = fam.default_tile(s.family_spec, s.sram_bytes) or (s.paper_block_r, s.paper_block_c)
    assert t.block_r <= max(16, start[0] // 16 * 16) and t.block_c <= max(16, start[1] // 16 * 16)
    assert s.smem_bytes <= s.sram_bytes
    # the layout is exactly the sum of its aligned buffers
    assert s.smem_bytes == sum(s.smem_layout.breakdown().values())
    # no slack: growing both dimensions by one quantum would not fit (or passes the paper point / cap)
    start_r, start_c = fam.tile_caps(s.family_spec)  # the family's default-tile caps
    assert t.block_r <= start_r and t.block_c <= start_c
    cap_r = min(start_r, max(16, start[0] // 16 * 16))
    cap_c = min(start_c, max(16, start[1] // 16 * 16))
    if t.block_r + 16 <= cap_r and t.block_c + 16 <= cap_c:
        grown = fam.smem_layout(s.family_spec.with_tile(t.block_r + 16, t.block_c + 16)).total_bytes
        assert grown > s.sram_bytes


def test_smem_layout_counts_every_buffer() -> None:
    s = KernelSpec(head_dim=64, dtype="float16", block_r=64, block_c=128, impl="simt")
    b = s.smem_layout.breakdown()
    ld, p_ld = 64 + 2, 128 + 1  # rows padded to an odd number of 32-bit words (bank conflicts)
    assert b["k"] == b["v"] == 128 * ld * 2
    assert b["dk"] == b["dv"] == 128 * 64 * 4
    assert b["q"] == b["do_"] == 64 * ld * 2
    assert b["p"] == 64 * p_ld * 4
    assert b["lse"] == b["delta"] == b["lse_lo"] == 64 * 4  # lse_lo: a huge row's lse correction
    assert s.smem_bytes == sum(b.values()) == 150016


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
        ({"head_dim": 64, "impl": "nope"}, "impl", "simt"),
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


# --------------------------------------------------------------------------- optional features
def test_feature_flags_enter_name_and_cache_key() -> None:
    from fagen.spec import FLAG_FEATURES

    base = KernelSpec(head_dim=64, causal=True, impl="simt")
    names, keys = {base.name}, {base.cache_key}
    for flags, suffix in [({"window": True}, "_causal_win_"), ({"causal_align": "top_left"}, "_causal_tl_"),
                          ({"softcap": True}, "_softcap_"), ({"alibi": True}, "_alibi_"),
                          ({"attn_mask": True}, "_mask_"), ({"bias": True}, "_bias_"),
                          ({"bias": True, "bias_grad": True}, "_bias_dbias_"), ({"varlen": True}, "_varlen_"),
                          ({"deterministic": True}, "_det_"), ({"dtype": "float64"}, "_fp64_causal_")]:
        s = base.replace(**flags)
        assert suffix in s.name, (flags, s.name)
        names.add(s.name)
        keys.add(s.cache_key)
        assert set(s.features) <= set(get_family("simt").features)
    assert len(names) == len(keys) == 11
    every = base.replace(window=True, softcap=True, alibi=True, attn_mask=True, bias=True, bias_grad=True,
                         varlen=True, deterministic=True, key_padding=True, dropout=True, causal_align="top_left")
    assert every.name.startswith("fa_bwd_d64_fp16_causal_tl_kpad_dropout_win_softcap_alibi_mask_bias_dbias_varlen_det_")
    assert every.features == frozenset(FLAG_FEATURES) - {"sinks"} | {"top_left"}  # sinks: the forward's flag
    sinks = KernelSpec(direction="fwd", head_dim=64, causal=True, sinks=True, impl="simt")
    assert "_causal_sinks_" in sinks.name and sinks.features == {"sinks"}


@pytest.mark.parametrize(
    "kwargs, field, needle",
    [
        ({"bias_grad": True}, "bias_grad", "needs bias"),
        ({"bias": True, "bias_grad": True, "direction": "fwd"}, "bias_grad", "backward"),
        ({"deterministic": True, "direction": "fwd"}, "deterministic", "backward only"),
        ({"causal_align": "top_left"}, "causal_align", "causal, window or alibi"),
        ({"causal_align": "centre"}, "causal_align", "bottom_right"),
    ],
)
def test_feature_flag_validation(kwargs: dict, field: str, needle: str) -> None:
    with pytest.raises(ValidationError) as ei:
        KernelSpec(head_dim=64, **kwargs)
    err = ei.value.errors()[0]
    assert err["loc"][0] == field and needle in err["msg"], err


def test_a_family_takes_only_the_features_its_templates_implement() -> None:
    """impl=None falls back to a family that implements the features; an explicit family without
    them is refused with the missing features named; deterministic adds the dq role."""
    mma = get_family("mma")
    missing = {"window", "deterministic"} - set(mma.features)
    if missing:
        with pytest.raises(ValidationError, match="do not implement") as ei:
            KernelSpec(head_dim=64, window=True, deterministic=True, impl="mma")
        assert ei.value.errors()[0]["loc"][0] == "impl"
        assert sorted(missing)[0] in str(ei.value)
    s = KernelSpec(head_dim=64, causal=True, deterministic=True)
    assert "deterministic" in get_family(s.impl).features
    from fagen.renderer import kernel_infos

    roles = [k.role.name for k in kernel_infos(s)]
    assert roles == ["pre", "main", "dq", "post"]
    assert [k.role.name for k in kernel_infos(s.replace(deterministic=False))] == ["pre", "main", "post"]


def test_grid_over_kv_heads_and_neutral_args() -> None:
    from fagen.abi import BWD_DQ, BWD_MAIN, DBIAS_PARAMS, FEATURE_PARAMS, FWD_MAIN, neutral_args

    assert BWD_MAIN.grid(batch=2, heads=8, seqlen_q=100, seqlen_k=70, rows=32, heads_kv=2) == (3, 2, 2)
    assert BWD_MAIN.grid(batch=2, heads=8, seqlen_q=100, seqlen_k=70, rows=32) == (3, 2, 8)
    assert FWD_MAIN.grid(batch=2, heads=8, seqlen_q=100, seqlen_k=70, rows=32, heads_kv=2) == (4, 2, 8)
    assert BWD_DQ.params == BWD_MAIN.params and BWD_DQ.grid_seq == "q"
    names = [n for _, n in FWD_MAIN.params]
    assert names[-len(FEATURE_PARAMS):] == [n for _, n in FEATURE_PARAMS]
    assert [n for _, n in BWD_MAIN.params][-len(DBIAS_PARAMS):] == [n for _, n in DBIAS_PARAMS]
    n = neutral_args(heads=3, seqlen_q=10, direction="fwd")
    assert set(n) == {name for _, name in FEATURE_PARAMS}
    assert (n["heads_kv"], n["window_left"], n["window_right"], n["softcap"], n["mask"]) == (3, -1, -1, 0.0, 0)
    assert (n["stride_lse_b"], n["stride_lse_h"]) == (30, 10)
    assert neutral_args(heads=1, seqlen_q=1, null=None)["dbias"] is None


def test_feature_matrix_has_a_representative_per_feature() -> None:
    from fagen.families import FEATURES
    from fagen.generate import all_specs, feature_matrix

    specs = feature_matrix()
    covered = set().union(*(s.features for s in specs))
    assert covered == set(FEATURES)
    assert len({s.name for s in all_specs()}) == len(all_specs())


def test_autotune_candidates_skip_families_without_the_features() -> None:
    from fagen.autotune.candidates import enumerate_candidates

    s = KernelSpec(head_dim=64, causal=True, window=True)
    cands = enumerate_candidates(s)
    ok = {c.impl for c in cands if c.spec is not None}
    assert ok and all("window" in get_family(f).features for f in ok)
    for c in cands:
        if "window" not in get_family(c.impl).features:
            assert c.spec is None and "do not implement window" in c.reason


def test_num_warps_defaults_to_the_familys_choice() -> None:
    # a spec naming no num_warps takes its family's default_warps; one naming it keeps it
    from fagen.families import DEFAULT_NUM_WARPS, get_family

    fwd = KernelSpec(direction="fwd", head_dim=128, dtype="float16", arch="sm_90a")
    assert fwd.impl == "wgmma" and fwd.num_warps == get_family("wgmma").default_warps(fwd.family_spec) == 8
    assert KernelSpec(direction="fwd", head_dim=128, dtype="float16", arch="sm_90a", num_warps=4).num_warps == 4
    # a family that declines the spec does not leave its default behind for the next one
    capped = KernelSpec(direction="fwd", head_dim=224, dtype="float16", arch="sm_90a", softcap=True)
    assert capped.impl == "mma" and capped.num_warps == DEFAULT_NUM_WARPS
    assert KernelSpec(direction="fwd", head_dim=128, dtype="float32", impl="simt").num_warps == DEFAULT_NUM_WARPS
    # the resolved value is a field like any other: names, dumps and replace() carry it
    assert "_w8_" in fwd.name and fwd.model_dump()["num_warps"] == 8
    assert fwd.replace(causal=True).num_warps == 8


def test_a_family_whose_default_tile_does_not_fit_reports_impl_unsupported() -> None:
    """No tile was given and the family's own default does not fit: the family cannot take the spec as given
    (an ``impl`` error naming the default tile and why), so impl=None moves on to the next family; a tile the
    user chose is still blamed on its field."""
    from pydantic import ValidationError

    flags = dict(direction="bwd", head_dim=96, dropout=True, alibi=True, arch="sm_90a")
    with pytest.raises(ValidationError) as ei:
        KernelSpec(impl="wgmma", **flags)
    err = ei.value.errors()[0]
    assert (err["loc"], err["type"]) == (("impl",), "unsupported")
    assert "default tile 64x128" in err["msg"] and "registers" in err["msg"] and "block_r / block_c" in err["msg"]
    assert KernelSpec(**flags).impl == "mma"
    with pytest.raises(ValidationError) as ei:
        KernelSpec(impl="wgmma", block_r=64, block_c=128, **flags)
    assert (ei.value.errors()[0]["loc"], ei.value.errors()[0]["type"]) == (("block_r",), "config")
