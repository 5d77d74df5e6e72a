"""The Hopper family (``wgmma``, sm_90a) with softcap and ALiBi (partials/score_mod.cuh's score_fwd on S
before the online softmax; the backward recomputes P from the modified scores, dS through the softcap's
1 - tanh^2): selection, and both directions on the CPU emulator against the float64 oracle with
flash-attn's criterion (fp16 / bf16, causal of both alignments, a window, GQA, key padding, sinks,
a v head dim of its own, Nq != Nk, lengths off the tiles, rows with no key); racecheck and
AddressSanitizer of a softcap backward (clean, bit-identical) and one forward / backward pair at the
PTX level (opt-in, FAGEN_TEST_SLOW=1). Sweeps past the first case of each direction are in the slow tier."""
from __future__ import annotations


import pytest

import fagen.functional as F
from fagen import KernelSpec
from fagen.runtime import cpu

import wgmma_cases as W


# --------------------------------------------------------------------------- selection
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_softcap_and_alibi_resolve_to_wgmma(direction) -> None:
    for kw in (dict(softcap=True), dict(alibi=True), dict(softcap=True, alibi=True, causal=True)):
        spec = W.spec(direction, dict(d=128, dtype="bfloat16", **kw))
        assert spec.impl == "wgmma", spec


def test_tiles_that_would_spill_are_shrunk_or_declined_by_name() -> None:
    """The registers of score_fwd's per-element work: the forward's key block and the backward's Q block."""
    assert W.spec("fwd", dict(d=64, dtype="float16", softcap=True)).tile.block_c == 192
    assert W.spec("fwd", dict(d=128, dtype="float16", softcap=True)).tile.block_c == 128  # 192 would spill
    # d = 256: 64 keys spill with ALiBi beside a window and key padding; 48 keys issue fewer than mma
    # (wgmma.wide_o_small_keys), softcap's keep the 64-key default, which spills: mma
    assert W.spec("fwd", dict(d=256, dtype="float16", alibi=True)).tile.block_c == 64
    assert W.spec("fwd", dict(d=256, dtype="float16", alibi=True, window=(8, 8))).tile.block_c == 48
    assert W.spec("fwd", dict(d=256, dtype="float16", softcap=True)).impl == "mma"
    assert W.spec("fwd", dict(d=192, dv=128, dtype="float16", softcap=True, alibi=True)).tile.block_c == 64
    assert W.spec("fwd", dict(d=192, dv=128, dtype="float16", softcap=True)).tile.block_c == 128
    with pytest.raises(ValueError, match=r"block_c=192 with softcap / alibi: .* 184 fp32 registers"):
        W.spec("fwd", dict(d=128, dtype="float16", alibi=True, kpm=True), block_c=192, impl="wgmma")
    # ALiBi alone takes raw scores: the plain tile (192 keys), beside key padding 128
    assert W.spec("fwd", dict(d=128, dtype="float16", alibi=True)).tile.block_c == 192
    assert W.spec("fwd", dict(d=128, dtype="float16", alibi=True, kpm=True)).tile.block_c == 128
    bwd = W.spec("bwd", dict(d=64, dtype="float16", alibi=True))
    assert bwd.impl == "wgmma" and (bwd.tile.block_r, bwd.tile.block_c, bwd.num_warps) == (64, 64, 4)
    assert W.spec("bwd", dict(d=64, dtype="float16", softcap=True)).tile.block_r == 128
    with pytest.raises(ValueError, match=r"block_r=128 with head_dim=64 and alibi: .* 256 fp32 registers"):
        W.spec("bwd", dict(d=64, dtype="float16", alibi=True), num_warps=8, block_r=128, impl="wgmma")


# --------------------------------------------------------------------------- numerics
FWD_CASES = [
    # ALiBi ([B, H] slopes) + key padding (a batch with every key padded), rows with no key (top-left, Nq > Nk)
    dict(d=64, dtype="float16", nw=4, B=2, Nq=90, Nk=70, H=2, Hkv=1, causal=True, align="top_left", kpm=True,
         alibi=True),
    # softcap + causal, GQA, two consumer warpgroups, Nq != Nk, lengths off the 128 x 128 tile
    dict(d=128, dtype="bfloat16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True, softcap=True),
    dict(d=64, dtype="float16", nw=8, B=1, Nq=130, Nk=200, H=1, Hkv=1, window=(40, 10), softcap=True, alibi=True),
    dict(d=128, dv=64, dtype="bfloat16", nw=4, B=1, Nq=70, Nk=150, H=2, Hkv=1, softcap=True, sinks=True),
    dict(d=96, dtype="float16", nw=4, B=1, Nq=150, Nk=100, H=2, Hkv=2, causal=True, alibi=True),  # rows with no key
]


@pytest.mark.parametrize("c", W.slow(FWD_CASES))
def test_forward_matches_float64(c) -> None:
    t = W.inputs(c, scale=2.0)  # scaled up so the softcap bends the scores (|s| beyond the cap)
    spec = W.spec("fwd", c)
    assert spec.impl == "wgmma", spec
    o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **W.options(c, t))
    W.check_forward(c, t, o, lse)


BWD_CASES = [
    # softcap + causal, GQA (two q heads per kv head: ScoreParams per q head), two consumer warpgroups,
    # Nq != Nk, lengths off the 64 x 128 tile
    dict(d=128, dtype="float16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True, softcap=True),
    # ALiBi ([B, H] slopes), key padding (a batch with every key padded); d = 64 with ALiBi: 64 x 64 on
    # one consumer warpgroup (128 Q rows would spill)
    dict(d=64, dtype="bfloat16", nw=4, B=2, Nq=70, Nk=100, H=2, Hkv=1, kpm=True, alibi=True),
    dict(d=96, dtype="float16", nw=8, B=1, Nq=130, Nk=100, H=3, Hkv=1, window=(30, 5), softcap=True, alibi=True),
    # rows that see no key (top-left, Nq > Nk), one consumer warpgroup, a v head dim of its own
    dict(d=64, dv=128, dtype="bfloat16", nw=4, B=1, Nq=150, Nk=60, H=2, Hkv=1, causal=True, align="top_left",
         softcap=True),
    dict(d=128, dtype="bfloat16", nw=8, B=1, Nq=90, Nk=140, H=2, Hkv=2, causal=True, alibi=True, kpm=True),
]


@pytest.mark.parametrize("c", W.slow(BWD_CASES))
def test_backward_matches_float64(c) -> None:
    t = W.inputs(c, scale=2.0)
    spec = W.spec("bwd", c)
    assert spec.impl == "wgmma", spec
    W.check_backward(c, t, *W.backward(c, t, spec))


# ALiBi alone in the forward takes raw scores q.k - (slope / scale) |distance| (the scale stays in exp2's FFMA): a
# negative scale (the row extreme is the raw minimum), a zero one (2^-100 / log2 e stands in: the scores are
# -slope |distance| alone; Nq > Nk, so rows far from the keys have a row term of their own), and the default, at
# the default key block (192 at d = 128, 64 at d = 256).
@pytest.mark.parametrize("d, scale", [(128, -0.3), (128, 0.0), (64, 0.0), (256, None)])
def test_alibi_alone_forward_on_raw_scores_matches_float64(d, scale) -> None:
    import sinkref as S
    from featref import assert_lse_close, attention

    c = dict(d=d, dtype="bfloat16" if d == 128 else "float16", nw=8, B=1, Nq=230, Nk=90, H=2, Hkv=1, causal=d == 64,
             alibi=True)
    t = W.inputs(c, seed=31)
    spec = W.spec("fwd", c)
    assert spec.impl == "wgmma" and spec.tile.block_c == {64: 192, 128: 192, 256: 64}[d], spec
    kw = W.options(c, t) | ({} if scale is None else {"softmax_scale": scale})
    o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **kw)
    ref = dict(causal=c["causal"], alibi=t["alibi"], scale=scale)
    q, k, v = t["q"], t["k"], t["v"]
    o64, lse64 = attention(q.double(), k.double(), v.double(), **ref)
    o_pt, _ = attention(q, k, v, **ref)
    _, lse32 = attention(q.float(), k.float(), v.float(), **ref)
    S.criterion("o", o, o64, o_pt, W.DT[c["dtype"]])
    assert_lse_close("lse", lse, lse64, lse32)


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: A softcap backward (P^T and dS^T in one pass after both S^T and dP^T retire) with ALiBi, causal,
#: key padding, GQA (two q heads per kv head), Nq and Nk ending inside a tile.
CHECK_BWD = dict(d=64, dtype="float16", nw=4, B=1, Nq=50, Nk=60, H=2, Hkv=1, causal=True, kpm=True, softcap=True,
                 alibi=True)


@pytest.mark.slow
def test_a_softcap_backward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    t = W.inputs(CHECK_BWD, seed=32, scale=2.0)
    spec = W.spec("bwd", CHECK_BWD)
    assert spec.impl == "wgmma"
    W.assert_clean_under_racecheck_and_asan(lambda: W.backward(CHECK_BWD, t, spec)[0])


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_and_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs for a softcap + ALiBi forward and backward, translated and run on
    the CPU: the flash-attn criterion against the float64 oracle (opt-in, as tests/test_ptx_kernels.py's
    heavy rows: FAGEN_TEST_SLOW=1)."""
    c = dict(d=64, dtype="float16", nw=4, B=1, Nq=70, Nk=90, H=2, Hkv=1, causal=True, softcap=True, alibi=True)
    t = W.inputs(c, seed=41, scale=2.0)
    fwd, bwd = W.spec("fwd", c), W.spec("bwd", c)
    with cpu.ptx() as record:
        o, lse = F.run_forward(fwd, t["q"], t["k"], t["v"], **W.options(c, t))
        grads, g64, g_pt = W.backward(c, t, bwd)
    assert {s for s, _, _ in record.launches} == {fwd.name, bwd.name}
    W.check_forward(c, t, o, lse)
    W.check_backward(c, t, grads, g64, g_pt)


@pytest.mark.slow
def test_alibi_on_huge_scores_takes_the_exact_path() -> None:
    """Scores of ~1e9 with ALiBi (tests/test_large_values.py's case at the family's head dim): the
    forward's lse_lo reaches the backward's exact P^T, both on the final scores."""
    import test_large_values as L
    from feature_harness import FeatCase

    L.test_features_at_large_scores("wgmma", "sm_90a", FeatCase("alibi", dtype="bfloat16", alibi="h", q_scale=2e4,
                                                                head_dim=64, batch=1, heads=2, heads_kv=1))


# --------------------------------------------------------------------------- the forward's softcap tanh on the SFU
def test_the_softcap_sfu_knob_is_the_forwards_and_16_bit_only() -> None:
    """``softcap_sfu`` (off by default: the forward's lse leaves flash-attn's criterion with it) takes the
    forward with softcap on fp16 / bf16; the backward takes the SFU's tanh without it."""
    from fagen.renderer import spec_constants

    on = W.spec("fwd", dict(d=128, dtype="float16", softcap=True), knobs={"softcap_sfu": 1})
    assert on.name.endswith("_sfu1_wgmma_sm90a") and spec_constants(on)["SOFTCAP_TANH_APPROX"]
    assert not spec_constants(W.spec("fwd", dict(d=128, dtype="float16", softcap=True)))["SOFTCAP_TANH_APPROX"]
    assert spec_constants(W.spec("bwd", dict(d=128, dtype="float16", softcap=True)))["SOFTCAP_TANH_APPROX"]
    for direction, c in (("bwd", dict(d=128, dtype="float16", softcap=True)), ("fwd", dict(d=128, dtype="bfloat16"))):
        with pytest.raises(ValueError, match="softcap_sfu=1 needs the forward with softcap on float16 / bfloat16"):
            W.spec(direction, c, knobs={"softcap_sfu": 1}, impl="wgmma")


def test_no_family_forward_takes_the_sfu_tanh_by_default_and_the_autotuner_never_sets_it() -> None:
    """The forward's lse is an fp32 output: the SFU's tanh (2^-11) moved it past flash-attn's criterion on a GPU,
    so every family's forward keeps tanhf unless a user sets ``softcap_sfu`` (``Knob.numerics``), which the
    autotuner's enumeration leaves at its default; every family's 16-bit backward takes the SFU's."""
    from fagen.autotune.candidates import enumerate_candidates
    from fagen.families.wgmma import SOFTCAP_SFU
    from fagen.renderer import spec_constants

    assert SOFTCAP_SFU.numerics
    for impl, arch in (("mma", "sm_80"), ("simt", "sm_80"), ("wgmma", "sm_90a")):
        for dtype in ("float16", "bfloat16"):
            fwd = KernelSpec(direction="fwd", head_dim=64, dtype=dtype, arch=arch, softcap=True, impl=impl)
            bwd = KernelSpec(direction="bwd", head_dim=64, dtype=dtype, arch=arch, softcap=True, impl=impl)
            assert not spec_constants(fwd)["SOFTCAP_TANH_APPROX"], fwd.name
            assert spec_constants(bwd)["SOFTCAP_TANH_APPROX"], bwd.name
    spec = KernelSpec(direction="fwd", head_dim=64, dtype="float16", arch="sm_90a", softcap=True)
    keys = [c.key for c in enumerate_candidates(spec, sizes=(64, 128), warps=(4, 8))]
    assert any(k[0] == "wgmma" for k in keys)
    assert not any(dict(k[4]).get("softcap_sfu") for k in keys)


def test_the_softcap_sfu_forward_takes_the_sfu_and_fewer_instructions() -> None:
    """With the knob the forward's main kernel issues MUFU.TANH and no libm tanh branch: fewer instructions in
    its tile loop (d = 128: 1708 -> 719 per 1e6 FLOPs under NVRTC 13.5); 0 spills at d = 128."""
    from fagen import compile as compile_spec
    from fagen import sass

    tanh, total = {}, {}
    for v in (0, 1):
        spec = W.spec("fwd", dict(d=128, dtype="float16", softcap=True), knobs={"softcap_sfu": v})
        mod = compile_spec(spec)
        assert all(r.spill_bytes == 0 for r in mod.resources)
        code = sass.kernel_sass(mod.cubin)
        if code is None:
            pytest.skip("no disassembler")
        main = code[mod.rendered.kernel("main").name]
        tanh[v] = sum(i.mnemonic == "MUFU.TANH" for i in main)
        total[v] = len(main)
    assert tanh[0] == 0 and tanh[1] > 0 and total[1] < total[0]


def test_the_softcap_sfu_forward_matches_float64() -> None:
    c = FWD_CASES[1]  # softcap + causal, GQA, two consumer warpgroups, lengths off the tile
    t = W.inputs(c, scale=2.0)
    spec = W.spec("fwd", c, knobs={"softcap_sfu": 1})
    assert spec.impl == "wgmma" and spec.knobs == (("softcap_sfu", 1), ("stages", 2)), spec
    o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **W.options(c, t))
    W.check_forward(c, t, o, lse)
