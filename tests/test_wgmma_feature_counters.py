"""Memory counters of the Hopper family's feature kernels (``benchmarks/memory_counters.py --spec``;
docs/performance.md, "memory counters of the feature kernels").

* The script's ``--spec key=value,...`` rows: the fields parsed as benchmarks/sass_cost.py's, the
  backward-only flags (``bias_grad``, ``deterministic``) kept off the forward, and inputs whose
  options turn each flag on.
* A model of the global accesses that the feature kernels add per element of an m64nNk16
  accumulator (thread ``4 g + t4`` of its warp holds rows ``g``, ``g + 8``, columns ``8 n + 2 t4``,
  ``+ 1``): the backward's S^T has keys for rows, so one request of the mask / bias reads or the dBias
  stores is 4 Q rows x 8 keys, 4 sectors: dBias's fp32 fills them (4 = ideal), the fp16 bias half
  of each (ideal 2), the uint8 mask a quarter (ideal 1); the other 8 keys of the warp (rows g + 8)
  are in the same sectors. The forward (rows = Q rows) reads two keys per load: 8 rows of 8 keys,
  8 sectors (ideal 4 for the bias, 2 for the mask). The counters measured these figures at the PTX
  level (the slow test).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fagen_memory_counters", REPO / "benchmarks" / "memory_counters.py")
MC = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = MC
_spec.loader.exec_module(MC)


# --------------------------------------------------------------------------- the script's rows
def test_spec_option_parses_kernel_spec_fields() -> None:
    assert MC.parse_spec("head_dim=192,head_dim_v=128,dropout=true,causal=False,knobs=stages:3;x:1,impl=wgmma") == {
        "head_dim": 192, "head_dim_v": 128, "dropout": True, "causal": False, "knobs": {"stages": 3, "x": 1},
        "impl": "wgmma"}


def test_backward_only_flags_stay_off_the_forward() -> None:
    fwd, bwd = MC.specs_of("wgmma", "sm_90a", 64, {"direction": "fwd", "attn_mask": True, "bias": True,
                                                   "bias_grad": True, "deterministic": True})
    assert (fwd.direction, bwd.direction) == ("fwd", "bwd")
    assert fwd.bias and bwd.bias and fwd.attn_mask and bwd.attn_mask
    assert not fwd.bias_grad and not fwd.deterministic and bwd.bias_grad and bwd.deterministic
    assert fwd.impl == bwd.impl == "wgmma"


def test_inputs_turn_every_flag_on() -> None:
    import fagen.functional as F

    fwd, _ = MC.specs_of("wgmma", "sm_90a", 64, dict(dropout=True, softcap=True, alibi=True, window=True,
                                                     key_padding=True, varlen=True))
    (q, k, v, do), opts = MC.inputs_of(fwd, 128)
    assert q.shape == k.shape == v.shape == do.shape == (128, 1, 64)  # packed
    assert opts["dropout_p"] > 0 and opts["softcap"] > 0 and opts["window_size"] == (64, 64)
    assert opts["cu_seqlens_q"].tolist() == [0, 64, 128] and opts["max_seqlen_k"] == 64
    assert opts["alibi_slopes"].shape == (1,) and opts["key_padding_mask"].shape == (1, 128)
    F._explicit("run_forward", fwd, None, opts)  # every option is one run_forward takes
    fwd, _ = MC.specs_of("wgmma", "sm_90a", 64, dict(attn_mask=True, bias=True))
    assert MC.inputs_of(fwd, 128)[1]["attn_mask"].shape == MC.inputs_of(fwd, 128)[1]["attn_bias"].shape == (1, 1, 128, 128)
    fwd, _ = MC.specs_of("wgmma", "sm_90a", 192, dict(head_dim_v=128))
    (q, k, v, do), opts = MC.inputs_of(fwd, 128)
    assert q.shape[-1] == k.shape[-1] == 192 and v.shape[-1] == do.shape[-1] == 128 and not opts


# --------------------------------------------------------------------------- the accesses' model
def _sectors(addresses: list[int], size: int) -> tuple[int, int]:
    """(sectors, ideal sectors) of one warp request: distinct 32-byte segments its bytes touch, and
    ceil(distinct bytes / 32) (docs/emulator.md, "Global sectors")."""
    touched = {a + i for a in addresses for i in range(size)}
    return len({b // 32 for b in touched}), -(-len(touched) // 32)


def _bwd_element(size: int, x: int, seqlen_k: int = 256, key0: int = 64, warp: int = 1) -> list[int]:
    """Byte addresses of accumulator element x of S^T (keys = rows) over a warp: key key0 + 16 warp + g
    + 8 ((x >> 1) & 1), Q row 8 (x >> 2) + 2 t4 + (x & 1) of a [Nq, Nk] operand of ``size`` bytes."""
    return [size * ((8 * (x >> 2) + 2 * t4 + (x & 1)) * seqlen_k + key0 + 16 * warp + g + 8 * ((x >> 1) & 1))
            for g in range(8) for t4 in range(4)]


def _fwd_pair(size: int, x: int, seqlen_k: int = 256, key0: int = 64, warp: int = 1) -> list[int]:
    """The forward's two-key loads (elements x, x + 1, x even): Q row 16 warp + g + 8 ((x >> 1) & 1), keys
    key0 + 8 (x >> 2) + 2 t4 (+ 1)."""
    return [size * ((16 * warp + g + 8 * ((x >> 1) & 1)) * seqlen_k + key0 + 8 * (x >> 2) + 2 * t4)
            for g in range(8) for t4 in range(4)]


@pytest.mark.parametrize("size, ideal", [(4, 4), (2, 2), (1, 1)], ids=["dbias-fp32", "bias-fp16", "mask-u8"])
def test_backward_element_requests_are_4_sectors(size: int, ideal: int) -> None:
    for x in range(32):
        assert _sectors(_bwd_element(size, x), size) == (4, ideal), x
    # the warp's other 8 keys (rows g + 8, element x + 2) of a 16-bit or 8-bit operand are in the same sectors
    for x in (0, 1, 4, 13):
        both = _bwd_element(size, x) + _bwd_element(size, x ^ 2)
        assert _sectors(both, size)[0] == (4 if size <= 2 else 8)


@pytest.mark.parametrize("size, ideal", [(2, 4), (1, 2)], ids=["bias-fp16", "mask-u8"])
def test_forward_pair_loads_are_8_sectors(size: int, ideal: int) -> None:
    for x in range(0, 32, 2):
        assert _sectors(_fwd_pair(size, x), 2 * size) == (8, ideal), x


# --------------------------------------------------------------------------- measured at the PTX level
@pytest.mark.slow
def test_split_tile_and_dbias_counters_at_the_ptx_level() -> None:
    """The split tile (d = 192, dv = 128) and the d = 64 mask + bias + dBias backward: no excess wavefront
    outside the tile loop, the loop's only excess the plain rows' (the dQ_i staging store that NVVM splits
    into two ``st.shared.f32``), every global store (O, dK, dV, dBias, the pre / post kernels') at its
    ideal sectors, the backward's mask / bias reads 4 sectors per request."""
    for d, extra in ((192, {"head_dim_v": 128}), (64, {"attn_mask": True, "bias": True, "bias_grad": True})):
        got = MC.count("wgmma", "sm_90a", d, 256, extra)
        for name, r in got.items():
            assert r["other"]["excess_wavefronts"] == 0, name
            excess = [s for s in r["sites"] if s["wavefronts"] > s["ideal_wavefronts"]]
            assert all(s["opcode"] == "st.shared.f32" and s["tile_loop"] for s in excess), (name, excess)
            assert len(excess) <= 2
            stores = [s for s in r["sites"] if s["opcode"].startswith("st.global") and s["global_requests"]]
            assert all(s["sectors"] == s["ideal_sectors"] for s in stores), (name, stores)
            if r["role"] == "main" and r["spec"].startswith("fa_bwd") and extra.get("bias"):
                reads = [s for s in r["sites"] if s["tile_loop"] and s["opcode"] in ("ld.global.u8", "ld.global.u16")]
                assert reads and all(s["sectors"] == 4 * s["global_requests"] for s in reads)


@pytest.mark.slow
@pytest.mark.parametrize("d", [96, 40])
def test_part_panel_epilogues_read_back_without_excess_wavefronts(d: int) -> None:
    """A row whose 16-byte chunks end in a part panel (d = 96: 4 past the first panel, d = 40: 5): the epilogues
    read O / dK / dV back from the swizzled tile with no excess wavefront (``wg_epi_item``: row by row put rows
    r and r + 1 in one quarter warp, 8 excess wavefronts per warp), and store them at their ideal sectors."""
    got = MC.count("wgmma", "sm_90a", d, 128, {})
    mains = {name: r for name, r in got.items() if r["role"] == "main"}
    assert len(mains) == 2
    for name, r in mains.items():
        assert r["other"]["excess_wavefronts"] == 0, name
        stores = [s for s in r["sites"] if s["opcode"].startswith("st.global") and s["global_requests"]]
        assert stores and all(s["sectors"] == s["ideal_sectors"] for s in stores), (name, stores)


# --------------------------------------------------------------------------- the split tile's stages
@pytest.mark.parametrize("d, dv, stages", [(192, 128, 3), (192, 64, 3), (160, 128, 3), (128, 192, 3), (64, 256, 3),
                                           (192, 192, 2), (256, 128, 2), (128, 256, 2), (256, 256, 1)])
def test_split_tile_takes_three_stages_where_they_fit(d: int, dv: int, stages: int) -> None:
    """The backward's split tile (head dims past 128) defaults to three Q_i / dO_i stages where they fit the
    227 KiB (benchmarks/sass_cost.py: fewer instructions per FLOP on every such row, d = 192 / dv = 128
    376 -> 365), else two, else one."""
    from fagen import KernelSpec

    for kw in ({}, {"causal": True, "dropout": True}, {"attn_mask": True})[:1 if d == 256 else 3]:  # d256: mma
        spec = KernelSpec(direction="bwd", head_dim=d, head_dim_v=dv, arch="sm_90a", impl="wgmma", **kw)
        assert spec.knob_values == {"stages": stages} and spec.smem_bytes <= 227 * 1024, (kw, spec.name)


def test_three_stage_split_backward_matches_float64() -> None:
    """MLA's d = 192 / dv = 128 with its default three stages: the producer two steps ahead of the dQ_i it
    reduce-adds, three Q blocks per K/V block, causal, key padding, GQA."""
    import wgmma_cases as W
    from fagen.families.wgmma import bwd as B

    c = dict(d=192, dv=128, dtype="float16", nw=8, B=1, Nq=200, Nk=90, H=2, Hkv=1, causal=True, align="top_left",
             kpm=True)
    t = W.inputs(c)
    spec = W.spec("bwd", c)
    assert spec.impl == "wgmma" and B.split_dkv(spec.family_spec) and spec.knob_values == {"stages": 3}
    W.check_backward(c, t, *W.backward(c, t, spec))
