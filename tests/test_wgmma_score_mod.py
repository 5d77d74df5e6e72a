"""The Hopper family (``wgmma``, sm_90a) with softcap and ALiBi (partials/score_mod.cuh's score_fwd on S
before the online softmax; the backward recomputes P from the modified scores, dS through the softcap's
1 - tanh^2): selection, and both directions on the CPU emulator against the float64 oracle with
flash-attn's criterion (fp16 / bf16, causal of both alignments, a window, GQA, key padding, sinks,
a v head dim of its own, Nq != Nk, lengths off the tiles, rows with no key); racecheck and
AddressSanitizer of a softcap backward (clean, bit-identical) and one forward / backward pair at the
PTX level (opt-in, FAGEN_TEST_SLOW=1). Sweeps past the first case of each direction are in the slow tier."""
from __future__ import annotations

import os

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen.runtime import cpu

import sinkref as S
from featref import assert_close, assert_lse_close, attention

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SOFTCAP = 3.5


def _spec(direction: str, c: dict, **kw) -> KernelSpec:
    return KernelSpec(direction=direction, head_dim=c["d"], head_dim_v=c.get("dv", c["d"]), arch="sm_90a",
                      dtype=c["dtype"], causal=c.get("causal", False), causal_align=c.get("align", "bottom_right"),
                      key_padding=bool(c.get("kpm")), window="window" in c, sinks=bool(c.get("sinks")),
                      softcap=bool(c.get("softcap")), alibi=bool(c.get("alibi")), **kw)


# --------------------------------------------------------------------------- selection
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_softcap_and_alibi_resolve_to_wgmma(direction) -> None:
    for kw in (dict(softcap=True), dict(alibi=True), dict(softcap=True, alibi=True, causal=True)):
        spec = _spec(direction, dict(d=128, dtype="bfloat16", **kw))
        assert spec.impl == "wgmma", spec


def test_tiles_that_would_spill_are_shrunk_or_declined_by_name() -> None:
    """The registers of score_fwd's per-element work: the forward's key block and the backward's Q block."""
    assert _spec("fwd", dict(d=64, dtype="float16", softcap=True)).tile.block_c == 192
    assert _spec("fwd", dict(d=128, dtype="float16", softcap=True)).tile.block_c == 128  # 192 would spill
    assert _spec("fwd", dict(d=256, dtype="float16", alibi=True)).impl == "mma"
    assert _spec("fwd", dict(d=192, dv=128, dtype="float16", softcap=True, alibi=True)).tile.block_c == 64
    assert _spec("fwd", dict(d=192, dv=128, dtype="float16", softcap=True)).tile.block_c == 128
    with pytest.raises(ValueError, match=r"block_c=192 with softcap / alibi: .* 184 fp32 registers"):
        _spec("fwd", dict(d=128, dtype="float16", alibi=True), block_c=192, impl="wgmma")
    bwd = _spec("bwd", dict(d=64, dtype="float16", alibi=True))
    assert bwd.impl == "wgmma" and (bwd.tile.block_r, bwd.tile.block_c, bwd.num_warps) == (64, 64, 4)
    assert _spec("bwd", dict(d=64, dtype="float16", softcap=True)).tile.block_r == 128
    with pytest.raises(ValueError, match=r"block_r=128 with head_dim=64 and alibi: .* 256 fp32 registers"):
        _spec("bwd", dict(d=64, dtype="float16", alibi=True), num_warps=8, block_r=128, impl="wgmma")


# --------------------------------------------------------------------------- numerics
def _slow(cases: list[dict]) -> list:
    """The first case in the fast tier, the rest slow."""
    ids = ["-".join(f"{k}{v}" for k, v in c.items()) for c in cases]
    return [pytest.param(c, id=i, marks=() if n == 0 else pytest.mark.slow) for n, (c, i) in enumerate(zip(cases, ids))]


def _inputs(c: dict, seed: int = 23) -> dict:
    g = torch.Generator().manual_seed(seed)
    dt = DT[c["dtype"]]
    B, Nq, Nk, H, Hkv, d = (c[n] for n in ("B", "Nq", "Nk", "H", "Hkv", "d"))
    dv = c.get("dv", d)
    # scaled up so the softcap bends the scores (|s| beyond the cap)
    t = {"q": (2 * torch.randn(B, Nq, H, d, generator=g)).to(dt), "k": (2 * torch.randn(B, Nk, Hkv, d, generator=g)).to(dt),
         "v": torch.randn(B, Nk, Hkv, dv, generator=g).to(dt), "do": torch.randn(B, Nq, H, dv, generator=g).to(dt)}
    t["kpm"] = None
    if c.get("kpm"):
        t["kpm"] = torch.rand(B, Nk, generator=g) > 0.3
        t["kpm"][0, 0] = True
        if B > 1:
            t["kpm"][-1] = False  # the last batch: every key padded (zero rows, lse = -inf)
    t["sinks"] = torch.randn(H, generator=g) if c.get("sinks") else None
    # ALiBi: per-(batch, head) slopes ([B, H]) when B > 1, else per head ([H])
    t["alibi"] = (torch.rand(B, H, generator=g) * 0.5 if B > 1 else torch.rand(H, generator=g) * 0.5) \
        if c.get("alibi") else None
    return t


def _options(c: dict, t: dict) -> dict:
    kw: dict = dict(causal=c.get("causal", False), key_padding_mask=t["kpm"])
    if "align" in c:
        kw["causal_align"] = c["align"]
    if "window" in c:
        kw["window_size"] = c["window"]
    if t["sinks"] is not None:
        kw["sinks"] = t["sinks"]
    if c.get("softcap"):
        kw["softcap"] = SOFTCAP
    if t["alibi"] is not None:
        kw["alibi_slopes"] = t["alibi"]
    return kw


def _oracle(c: dict, t: dict, dtype: torch.dtype, grads: bool = False):
    """(o, lse, [dq, dk, dv] or None) of the oracle in ``dtype``: sinkref with sinks (softcap, no
    ALiBi, bottom-right), featref otherwise."""
    q, k, v = (t[n].detach().to(dtype).requires_grad_(grads) for n in ("q", "k", "v"))
    kw = dict(causal=c.get("causal", False), window=c.get("window", (-1, -1)), kpm=t["kpm"],
              softcap=SOFTCAP if c.get("softcap") else 0.0)
    if t["sinks"] is not None:
        assert t["alibi"] is None and c.get("align", "bottom_right") == "bottom_right"
        o, lse = S.attention(q, k, v, sinks=t["sinks"].to(torch.float64 if dtype == torch.float64 else torch.float32),
                             dtype=dtype, **kw)
    else:
        o, lse = attention(q, k, v, align=c.get("align", "bottom_right"), alibi=t["alibi"], **kw)
    if not grads:
        return o.detach(), lse.detach(), None
    (o * t["do"].to(dtype)).sum().backward()
    return o.detach(), lse.detach(), [q.grad, k.grad, v.grad]


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


@pytest.mark.parametrize("c", _slow(FWD_CASES))
def test_forward_matches_float64(c) -> None:
    t = _inputs(c)
    spec = _spec("fwd", c, num_warps=c["nw"])
    assert spec.impl == "wgmma", spec
    o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **_options(c, t))
    o64, lse64, _ = _oracle(c, t, torch.float64)
    o_pt, _, _ = _oracle(c, t, DT[c["dtype"]])
    _, lse32, _ = _oracle(c, t, torch.float32)
    S.criterion("o", o, o64, o_pt, DT[c["dtype"]])
    assert_lse_close("lse", lse, lse64, lse32)
    if c.get("kpm") and c["B"] > 1:  # the batch with every key padded: zero rows
        assert torch.equal(o[-1], torch.zeros_like(o[-1]))


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


def _backward(c: dict, t: dict, spec: KernelSpec):
    """The kernels' (dq, dk, dv) from the float64 oracle's o and lse, and the oracle's in float64 and
    in the inputs' dtype."""
    o64, lse64, g64 = _oracle(c, t, torch.float64, grads=True)
    _, _, g_pt = _oracle(c, t, DT[c["dtype"]], grads=True)
    ours = F.run_backward(spec, t["do"], t["q"], t["k"], t["v"], o64.to(t["q"].dtype), lse64.float(), **_options(c, t))
    return ours, g64, g_pt


@pytest.mark.parametrize("c", _slow(BWD_CASES))
def test_backward_matches_float64(c) -> None:
    t = _inputs(c)
    spec = _spec("bwd", c, num_warps=c["nw"])
    assert spec.impl == "wgmma", spec
    ours, g64, g_pt = _backward(c, t, spec)
    for name, a, r64, pt in zip(("dq", "dk", "dv"), ours, g64, g_pt):
        assert_close(name, a, r64, pt, DT[c["dtype"]])
    if c.get("kpm"):  # padded keys: zero dk, dv
        pad = ~t["kpm"]
        assert torch.equal(ours[1][pad], torch.zeros_like(ours[1][pad]))
        assert torch.equal(ours[2][pad], torch.zeros_like(ours[2][pad]))


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: A softcap backward (P^T and dS^T in one pass after both S^T and dP^T retire) with ALiBi, causal,
#: key padding, GQA (two q heads per kv head), Nq and Nk ending inside a tile.
CHECK_BWD = dict(d=64, dtype="float16", nw=4, B=1, Nq=50, Nk=60, H=2, Hkv=1, causal=True, kpm=True, softcap=True,
                 alibi=True)


@pytest.mark.slow
def test_a_softcap_backward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    t = _inputs(CHECK_BWD, seed=32)
    spec = _spec("bwd", CHECK_BWD, num_warps=CHECK_BWD["nw"])
    assert spec.impl == "wgmma"
    plain = _backward(CHECK_BWD, t, spec)[0]
    with cpu.racecheck():
        raced = _backward(CHECK_BWD, t, spec)[0]
    with cpu.sanitized() as rec:
        checked = _backward(CHECK_BWD, t, spec)[0]
    assert rec.roles == {"main", "pre", "post"}
    for a, b, c in zip(plain, raced, checked):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FAGEN_TEST_SLOW"), reason="heavy PTX-level run: set FAGEN_TEST_SLOW=1")
def test_a_forward_and_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs for a softcap + ALiBi forward and backward, translated and run on
    the CPU: the flash-attn criterion against the float64 oracle (opt-in, as tests/test_ptx_kernels.py's
    heavy rows: FAGEN_TEST_SLOW=1)."""
    c = dict(d=64, dtype="float16", nw=4, B=1, Nq=70, Nk=90, H=2, Hkv=1, causal=True, softcap=True, alibi=True)
    t = _inputs(c, seed=41)
    fwd, bwd = _spec("fwd", c, num_warps=4), _spec("bwd", c, num_warps=4)
    with cpu.ptx() as record:
        o, lse = F.run_forward(fwd, t["q"], t["k"], t["v"], **_options(c, t))
        grads, g64, g_pt = _backward(c, t, bwd)
    assert {s for s, _, _ in record.launches} == {fwd.name, bwd.name}
    o64, lse64, _ = _oracle(c, t, torch.float64)
    o_pt, _, _ = _oracle(c, t, torch.float16)
    _, lse32, _ = _oracle(c, t, torch.float32)
    S.criterion("o", o, o64, o_pt, torch.float16)
    assert_lse_close("lse", lse, lse64, lse32)
    for name, a, r64, pt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close(name, a, r64, pt, torch.float16)


@pytest.mark.slow
def test_alibi_on_huge_scores_takes_the_exact_path() -> None:
    """Scores of ~1e9 with ALiBi (tests/test_large_values.py's case at the family's head dim): the
    forward's lse_lo reaches the backward's exact P^T, both on the final scores."""
    import test_large_values as L
    from feature_harness import FeatCase

    L.test_features_at_large_scores("wgmma", "sm_90a", FeatCase("alibi", dtype="bfloat16", alibi="h", q_scale=2e4,
                                                                head_dim=64, batch=1, heads=2, heads_kv=1))
