"""Cases of the Hopper family's (``wgmma``, sm_90a) numerics tests, shared by its feature test files.

A case is a dict: ``d``, ``dv`` (default d), ``dtype``, ``nw`` (consumer warps), ``B``, ``Nq``, ``Nk``,
``H``, ``Hkv`` and the features it turns on: ``causal``, ``align`` (``"top_left"``), ``kpm`` (a key
padding mask, the last batch with every key padded), ``window`` ((left, right)), ``sinks``,
``softcap`` (capped at :data:`SOFTCAP`), ``alibi`` (slopes [B, H] when B > 1, else [H]), ``stages``.
:func:`spec` makes its kernel spec, :func:`inputs` its tensors, :func:`options` the keywords of
``fagen.functional.run_forward`` / ``run_backward``, :func:`oracle` the reference (sinkref with sinks,
featref otherwise) in any dtype, and :func:`check_forward` / :func:`check_backward` apply flash-attn's
criterion against the float64 oracle with the reference's own error in the inputs' dtype.
"""
from __future__ import annotations

import pytest
import sinkref as S
import torch
from featref import assert_close, assert_lse_close, attention

import fagen.functional as F
from fagen import KernelSpec

__all__ = ["DT", "SOFTCAP", "backward", "check_backward", "check_forward", "inputs", "options", "oracle", "slow",
           "spec"]

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SOFTCAP = 3.5


def slow(cases: list[dict]) -> list:
    """pytest params of the cases: the first in the fast tier, the rest marked slow."""
    ids = ["-".join(f"{k}{v}" for k, v in c.items()) for c in cases]
    return [pytest.param(c, id=i, marks=() if n == 0 else pytest.mark.slow) for n, (c, i) in enumerate(zip(cases, ids))]


def spec(direction: str, c: dict, **kw) -> KernelSpec:
    """The case's spec on sm_90a (``num_warps`` from ``nw``, the stages knob from ``stages``); ``kw``
    adds or overrides fields."""
    fields = dict(direction=direction, head_dim=c["d"], head_dim_v=c.get("dv", c["d"]), arch="sm_90a",
                  dtype=c["dtype"], causal=c.get("causal", False), causal_align=c.get("align", "bottom_right"),
                  key_padding=bool(c.get("kpm")), window="window" in c, sinks=bool(c.get("sinks")),
                  softcap=bool(c.get("softcap")), alibi=bool(c.get("alibi")))
    if "nw" in c:
        fields["num_warps"] = c["nw"]
    if "stages" in c:
        fields["knobs"] = {"stages": c["stages"]}
    return KernelSpec(**{**fields, **kw})


def inputs(c: dict, seed: int = 23, scale: float = 1.0) -> dict:
    """q, k ([B, N, H(kv), d], times ``scale``: a softcap case scales them up so the cap bends the
    scores), v, do, and the case's key padding mask, sinks and ALiBi slopes (None where off)."""
    g = torch.Generator().manual_seed(seed)
    dt = DT[c["dtype"]]
    B, Nq, Nk, H, Hkv, d = (c[n] for n in ("B", "Nq", "Nk", "H", "Hkv", "d"))
    dv = c.get("dv", d)
    t = {"q": (scale * torch.randn(B, Nq, H, d, generator=g)).to(dt),
         "k": (scale * torch.randn(B, Nk, Hkv, d, generator=g)).to(dt),
         "v": torch.randn(B, Nk, Hkv, dv, generator=g).to(dt), "do": torch.randn(B, Nq, H, dv, generator=g).to(dt)}
    t["kpm"] = None
    if c.get("kpm"):
        t["kpm"] = torch.rand(B, Nk, generator=g) > 0.3
        t["kpm"][0, 0] = True
        if B > 1:
            t["kpm"][-1] = False  # the last batch: every key padded (zero rows, lse = -inf)
    t["sinks"] = torch.randn(H, generator=g) if c.get("sinks") else None
    t["alibi"] = (torch.rand(B, H, generator=g) * 0.5 if B > 1 else torch.rand(H, generator=g) * 0.5) \
        if c.get("alibi") else None
    return t


def options(c: dict, t: dict) -> dict:
    """The keywords of run_forward / run_backward for the case."""
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


def oracle(c: dict, t: dict, dtype: torch.dtype, grads: bool = False):
    """(o, lse, [dq, dk, dv] or None) of the oracle computed in ``dtype``: sinkref with sinks (bottom-right,
    no ALiBi), featref otherwise (either causal alignment)."""
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


def check_forward(c: dict, t: dict, o: torch.Tensor, lse: torch.Tensor) -> None:
    """o and lse against the float64 oracle (flash-attn's criterion); the batch with every key padded
    gives zero rows."""
    assert o.shape == (c["B"], c["Nq"], c["H"], c.get("dv", c["d"]))
    o64, lse64, _ = oracle(c, t, torch.float64)
    o_pt, _, _ = oracle(c, t, DT[c["dtype"]])
    _, lse32, _ = oracle(c, t, torch.float32)
    S.criterion("o", o, o64, o_pt, DT[c["dtype"]])
    assert_lse_close("lse", lse, lse64, lse32)
    if c.get("kpm") and c["B"] > 1:
        assert torch.equal(o[-1], torch.zeros_like(o[-1]))


def backward(c: dict, t: dict, spec: KernelSpec):
    """The kernels' (dq, dk, dv) from the float64 oracle's o and lse, and the oracle's in float64 and
    in the inputs' dtype."""
    o64, lse64, g64 = oracle(c, t, torch.float64, grads=True)
    _, _, g_pt = oracle(c, t, DT[c["dtype"]], grads=True)
    ours = F.run_backward(spec, t["do"], t["q"], t["k"], t["v"], o64.to(t["q"].dtype), lse64.float(), **options(c, t))
    return ours, g64, g_pt


def check_backward(c: dict, t: dict, ours, g64, g_pt) -> None:
    """(dq, dk, dv) against the float64 oracle's; padded keys give zero dk, dv, the batch with every key
    padded zero dq."""
    assert [g.shape for g in ours] == [t["q"].shape, t["k"].shape, t["v"].shape]
    for name, a, r64, pt in zip(("dq", "dk", "dv"), ours, g64, g_pt):
        assert_close(name, a, r64, pt, DT[c["dtype"]])
    if c.get("kpm"):
        pad = ~t["kpm"]
        assert torch.equal(ours[1][pad], torch.zeros_like(ours[1][pad]))
        assert torch.equal(ours[2][pad], torch.zeros_like(ours[2][pad]))
        if c["B"] > 1:
            assert torch.equal(ours[0][-1], torch.zeros_like(ours[0][-1]))


# --------------------------------------------------------------------------- dropout (test_wgmma_dropout.py)
# A case's ``dropout`` key is its p; the kernels and the oracle draw the keep mask of
# fagen.functional.dropout_keep_mask at DROPOUT_SEED / DROPOUT_OFFSET (both past 2**32).
DROPOUT_SEED, DROPOUT_OFFSET = 2**40 + 17, 2**33 + 5
__all__ += ["DROPOUT_OFFSET", "DROPOUT_SEED", "check_dropout_forward", "dropout_backward", "dropout_keep",
            "dropout_options", "dropout_oracle", "dropout_spec"]


def dropout_spec(direction: str, c: dict, **kw) -> KernelSpec:
    """:func:`spec` with dropout compiled in."""
    return spec(direction, c, dropout=True, **kw)


def dropout_options(c: dict, t: dict) -> dict:
    """:func:`options` with the case's p, seed and offset."""
    return {**options(c, t), "dropout_p": c["dropout"], "seed": DROPOUT_SEED, "offset": DROPOUT_OFFSET}


def dropout_keep(c: dict) -> torch.Tensor:
    """The case's keep mask [B, H, Nq, Nk] (True = kept)."""
    return F.dropout_keep_mask(c["B"], c["H"], c["Nq"], c["Nk"], c["dropout"], seed=DROPOUT_SEED,
                               offset=DROPOUT_OFFSET)


def dropout_oracle(c: dict, t: dict, dtype: torch.dtype, grads: bool = False):
    """:func:`oracle` with the case's keep mask: O = (P o Z) V / (1 - p), lse of the undropped P."""
    q, k, v = (t[n].detach().to(dtype).requires_grad_(grads) for n in ("q", "k", "v"))
    kw = dict(causal=c.get("causal", False), window=c.get("window", (-1, -1)), kpm=t["kpm"],
              softcap=SOFTCAP if c.get("softcap") else 0.0, keep=dropout_keep(c), dropout_p=c["dropout"])
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


def check_dropout_forward(c: dict, t: dict, o: torch.Tensor, lse: torch.Tensor) -> None:
    """:func:`check_forward` against the oracle with the keep mask."""
    assert o.shape == (c["B"], c["Nq"], c["H"], c.get("dv", c["d"]))
    o64, lse64, _ = dropout_oracle(c, t, torch.float64)
    o_pt, _, _ = dropout_oracle(c, t, DT[c["dtype"]])
    _, lse32, _ = dropout_oracle(c, t, torch.float32)
    S.criterion("o", o, o64, o_pt, DT[c["dtype"]])
    assert_lse_close("lse", lse, lse64, lse32)
    if c.get("kpm") and c["B"] > 1:
        assert torch.equal(o[-1], torch.zeros_like(o[-1]))


def dropout_backward(c: dict, t: dict, spec: KernelSpec):
    """:func:`backward` with the keep mask: the kernels' (dq, dk, dv) from the oracle's o and lse, and the
    oracle's gradients in float64 and in the inputs' dtype (check with :func:`check_backward`)."""
    o64, lse64, g64 = dropout_oracle(c, t, torch.float64, grads=True)
    _, _, g_pt = dropout_oracle(c, t, DT[c["dtype"]], grads=True)
    ours = F.run_backward(spec, t["do"], t["q"], t["k"], t["v"], o64.to(t["q"].dtype), lse64.float(),
                          **dropout_options(c, t))
    return ours, g64, g_pt
