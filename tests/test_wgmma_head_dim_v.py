"""The Hopper family (``wgmma``, sm_90a) with a v head dim of its own (``head_dim_v``, MLA: d = 192,
dv = 128): selection, tiles and declines; the forward (S = Q K_j^T of K = d, O += P V_j of N = dv)
and the backward (V_j / dO_i tiles and dV~ of dv, dP^T = V_w dO_i^T of K = dv, D = rowsum(dO o O)
over dv) on the CPU emulator against the float64 oracle with flash-attn's criterion (fp16 / bf16,
causal of both alignments, a window, GQA, key padding, sinks, Nq != Nk, lengths off the tiles);
racecheck and AddressSanitizer (clean, bit-identical) and one forward / backward pair at the PTX
level (the inline PTX the GPU runs; opt-in, FAGEN_TEST_SLOW=1). Sweeps past the first case are in the
slow tier."""
from __future__ import annotations

import re

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec, renderer
from fagen.families.wgmma import FWD_ACC_REGS, fwd_acc_regs
from fagen.runtime import cpu

import sinkref as S
import wgmma_cases as W


def _spec(direction: str, d: int, dv: int, **kw) -> KernelSpec:
    return KernelSpec(direction=direction, head_dim=d, head_dim_v=dv, arch="sm_90a", **{"dtype": "float16", **kw})


# --------------------------------------------------------------------------- selection
def test_the_family_takes_both_dims_and_sizes_the_tile_by_each() -> None:
    fwd = _spec("fwd", 192, 128)  # impl=None: wgmma, the preferred family on sm_90a
    assert fwd.impl == "wgmma" and fwd.name == "fa_fwd_d192_dv128_fp16_br128_bc128_w8_s2_wgmma_sm90a"
    lay = {b.name: b.count for b in fwd.smem_layout.buffers}
    assert lay["k"] == 2 * 128 * 192 and lay["v"] == 2 * 128 * 128 and lay["q"] == 128 * 192
    # d = 64, dv = 128: Q_i's tile is dv wide (O_i leaves through it); 192 keys as at d = 128
    wide = _spec("fwd", 64, 128)
    assert wide.tile.block_c == 192 and {b.name: b.count for b in wide.smem_layout.buffers}["q"] == 128 * 128
    # d = 64, dv = 256: the registers of O, S and P~ bound the key block (shared memory would take 128)
    big = _spec("fwd", 64, 256)
    assert big.impl == "wgmma" and big.tile.block_c == 64 and fwd_acc_regs(big.family_spec) <= FWD_ACC_REGS
    with pytest.raises(ValueError, match=r"block_c=128 with head_dim_v=256: .* 208 fp32 registers"):
        _spec("fwd", 64, 256, block_c=128, impl="wgmma")
    assert _spec("fwd", 64, 256, block_c=128).impl != "wgmma"  # impl=None: another family
    bwd = _spec("bwd", 128, 64)
    assert bwd.impl == "wgmma" and (bwd.tile.block_r, bwd.tile.block_c, bwd.num_warps) == (64, 128, 8)
    lay = {b.name: b.count for b in bwd.smem_layout.buffers}
    assert lay["v"] == 128 * 64 and lay["dout"] == 2 * 64 * 64 and lay["k"] == 128 * 128 and lay["q"] == 2 * 64 * 128
    # d = 64 with a wider dv: the wider dim's Q block (64 rows, not d = 64's 128) and one consumer
    # warpgroup (two could not split dQ_i's 64 columns into 64-column wgmmas)
    narrow = _spec("bwd", 64, 128)
    assert narrow.impl == "wgmma" and (narrow.tile.block_r, narrow.tile.block_c, narrow.num_warps) == (64, 64, 4)
    with pytest.raises(ValueError, match=r"block_r=128 with head_dim=64, head_dim_v=128: .* 288 fp32 registers"):
        _spec("bwd", 64, 128, num_warps=4, block_r=128, impl="wgmma")
    with pytest.raises(ValueError, match=r"cannot split dQ_i's 64 columns"):
        _spec("bwd", 64, 128, num_warps=8, impl="wgmma")
    # the constant that names v's panels exists only for such specs: the others render as before
    assert "PANELS_V" in renderer.render(fwd).source
    assert "PANELS_V" not in renderer.render(KernelSpec(direction="fwd", head_dim=192, arch="sm_90a")).source


@pytest.mark.parametrize("direction, d, dv, why", [
    ("fwd", 128, 80, "head_dim=128, head_dim_v=80 with softcap: the padded wgmma fwd"),
    ("bwd", 128, 80, "head_dim=128, head_dim_v=80 with softcap: the padded wgmma bwd"),
])
def test_pairs_it_cannot_take_are_declined_by_name(direction, d, dv, why) -> None:
    """A padded v head dim with softcap: mma issues fewer instructions per FLOP (heads.MAX_PADDING)."""
    assert _spec(direction, d, dv).impl == "wgmma"  # padded to 128 columns (tests/test_wgmma_head_dims.py)
    assert _spec(direction, d, dv, softcap=True).impl != "wgmma"
    with pytest.raises(ValueError, match=re.escape(why)):
        _spec(direction, d, dv, softcap=True, impl="wgmma")


# --------------------------------------------------------------------------- numerics
def _case_spec(direction: str, c: dict) -> KernelSpec:
    spec = W.spec(direction, c)
    assert spec.impl == "wgmma", spec
    return spec


FWD_CASES = [
    # MLA's pair: GQA, two consumer warpgroups, Nq != Nk, lengths off the 128 x 128 tile
    dict(d=192, dv=128, dtype="bfloat16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True),
    dict(d=128, dv=64, dtype="float16", nw=4, B=2, Nq=70, Nk=150, H=2, Hkv=1, kpm=True, sinks=True),
    dict(d=64, dv=128, dtype="float16", nw=8, B=1, Nq=130, Nk=200, H=1, Hkv=1, window=(40, 10), stages=3),
    dict(d=64, dv=256, dtype="bfloat16", nw=4, B=1, Nq=90, Nk=200, H=2, Hkv=1, causal=True, align="top_left"),
    # dv = 96 / d = 96: one and a half panels (zero-filled columns), the other dim whole panels
    dict(d=256, dv=96, dtype="bfloat16", nw=8, B=2, Nq=70, Nk=150, H=1, Hkv=1, kpm=True),
    dict(d=96, dv=192, dtype="float16", nw=4, B=1, Nq=150, Nk=120, H=2, Hkv=2, causal=True, sinks=True),
]


@pytest.mark.parametrize("c", W.slow(FWD_CASES))
def test_forward_matches_float64(c) -> None:
    t = W.inputs(c)
    o, lse = F.run_forward(_case_spec("fwd", c), t["q"], t["k"], t["v"], **W.options(c, t))
    W.check_forward(c, t, o, lse)


BWD_CASES = [
    # GQA, two consumer warpgroups, Nq != Nk, lengths off the 64 x 128 tile
    dict(d=128, dv=64, dtype="float16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True),
    dict(d=64, dv=128, dtype="bfloat16", nw=4, B=2, Nq=70, Nk=100, H=2, Hkv=2, kpm=True),
    dict(d=96, dv=64, dtype="float16", nw=8, B=1, Nq=130, Nk=100, H=3, Hkv=1, window=(30, 5), stages=3),
    dict(d=64, dv=96, dtype="bfloat16", nw=4, B=1, Nq=90, Nk=140, H=2, Hkv=1, causal=True, align="top_left"),
    dict(d=96, dv=128, dtype="float16", nw=8, B=1, Nq=128, Nk=128, H=1, Hkv=1),  # whole tiles only
    dict(d=128, dv=96, dtype="bfloat16", nw=4, B=1, Nq=150, Nk=60, H=2, Hkv=1, causal=True),  # rows that see no key
]


@pytest.mark.parametrize("c", W.slow(BWD_CASES))
def test_backward_matches_float64(c) -> None:
    t = W.inputs(c)
    W.check_backward(c, t, *W.backward(c, t, _case_spec("bwd", c)))


@pytest.mark.slow
def test_dlse_enters_d_over_the_v_head_dim() -> None:
    """D = rowsum(dO o O) - dlse (the pre kernel, over dv) through attention_backward's dlse."""
    c = BWD_CASES[0]
    t = W.inputs(c, seed=5)
    g = torch.Generator().manual_seed(6)
    dlse = torch.randn(c["B"], c["H"], c["Nq"], generator=g)
    fwd, bwd = _case_spec("fwd", c), _case_spec("bwd", c)
    o, lse = F.attention_forward(t["q"], t["k"], t["v"], spec=fwd, causal=True)
    ours = F.attention_backward(t["do"], t["q"], t["k"], t["v"], o, lse, dlse=dlse, spec=bwd, causal=True)
    inputs = {n: t[n] for n in ("q", "k", "v")}
    _, _, g64 = S.grads(S.attention, inputs, t["do"], dlse, torch.float64, causal=True)
    _, _, g_pt = S.grads(S.attention, inputs, t["do"], dlse, W.DT[c["dtype"]], causal=True)
    for name, a in zip("qkv", ours):
        S.criterion("d" + name, a, g64[name], g_pt[name], W.DT[c["dtype"]])


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: Causal, key padding, GQA (two q heads per kv head), Nq and Nk ending inside a tile. The forward on
#: one consumer warpgroup: the forward's whole loop is one barrier phase, and two warpgroups' reads of
#: its wide K/V tiles outgrow racecheck's read-vector budget (as tests/test_racecheck.py's d = 128 row).
CHECK_FWD = dict(d=64, dv=128, dtype="float16", nw=4, B=1, Nq=50, Nk=150, H=2, Hkv=1, causal=True, kpm=True)
CHECK_BWD = dict(d=128, dv=64, dtype="float16", nw=8, B=1, Nq=77, Nk=100, H=2, Hkv=1, causal=True, kpm=True)


@pytest.mark.slow
def test_kernels_run_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    t_f, t_b = W.inputs(CHECK_FWD, seed=31), W.inputs(CHECK_BWD, seed=32)
    fwd, bwd = _case_spec("fwd", CHECK_FWD), _case_spec("bwd", CHECK_BWD)

    def run():
        o, lse = F.run_forward(fwd, t_f["q"], t_f["k"], t_f["v"], **W.options(CHECK_FWD, t_f))
        return (o, lse) + tuple(W.backward(CHECK_BWD, t_b, bwd)[0])

    W.assert_clean_under_racecheck_and_asan(run)


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_and_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs (wgmma descriptors, TMA, mbarriers, stmatrix) for a pair of each
    direction, translated and run on the CPU: the flash-attn criterion against the float64 oracle.
    About 25 s of CPU: opt-in, as tests/test_ptx_kernels.py's heavy rows (FAGEN_TEST_SLOW=1)."""
    c_f = dict(CHECK_FWD, Nq=70, Nk=90, kpm=False)
    c_b = dict(CHECK_BWD, Nq=70, Nk=90, kpm=False)
    t_f, t_b = W.inputs(c_f, seed=41), W.inputs(c_b, seed=42)
    fwd, bwd = _case_spec("fwd", c_f), _case_spec("bwd", c_b)
    with cpu.ptx() as record:
        o, lse = F.run_forward(fwd, t_f["q"], t_f["k"], t_f["v"], causal=True)
        grads, g64, g_pt = W.backward(c_b, t_b, bwd)
    assert {s for s, _, _ in record.launches} == {fwd.name, bwd.name}
    W.check_forward(c_f, t_f, o, lse)
    W.check_backward(c_b, t_b, grads, g64, g_pt)
