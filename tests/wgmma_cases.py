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

import os
from collections.abc import Callable, Sequence

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen.runtime import cpu

import sinkref as S
from featref import assert_close, assert_lse_close, attention

__all__ = ["DT", "PTX_OPT_IN", "SOFTCAP", "assert_clean_under_racecheck_and_asan", "backward", "check_backward",
           "check_forward", "inputs", "options", "oracle", "slow", "spec"]

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SOFTCAP = 3.5


#: The mark of a heavy PTX-level run (the inline PTX the GPU gets, translated and run on the CPU): opt-in
#: with FAGEN_TEST_SLOW=1, as tests/test_ptx_kernels.py's heavy rows.
PTX_OPT_IN = pytest.mark.skipif(not os.environ.get("FAGEN_TEST_SLOW"), reason="heavy PTX-level run: set FAGEN_TEST_SLOW=1")


def assert_clean_under_racecheck_and_asan(run: Callable[[], Sequence[torch.Tensor]],
                                          roles: frozenset[str] = frozenset({"main", "pre", "post"})) -> None:
    """``run()`` (the launches, returning their outputs) plainly, under the race checker and under
    AddressSanitizer: no race, no memory error, the same bits every time, and ASan saw ``roles``."""
    plain = run()
    with cpu.racecheck():
        raced = run()
    with cpu.sanitized() as rec:
        checked = run()
    assert rec.roles == set(roles)
    assert len(plain) == len(raced) == len(checked)
    for a, b, c in zip(plain, raced, checked):
        assert torch.equal(a, b) and torch.equal(a, c)


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


def oracle(c: dict, t: dict, dtype: torch.dtype, grads: bool = False, **extra):
    """(o, lse, [dq, dk, dv] or None) of the oracle computed in ``dtype``: sinkref with sinks (bottom-right,
    no ALiBi), featref otherwise (either causal alignment); ``extra`` goes to both (a keep mask)."""
    q, k, v = (t[n].detach().to(dtype).requires_grad_(grads) for n in ("q", "k", "v"))
    kw = dict(causal=c.get("causal", False), window=c.get("window", (-1, -1)), kpm=t["kpm"],
              softcap=SOFTCAP if c.get("softcap") else 0.0, **extra)
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


def check_forward(c: dict, t: dict, o: torch.Tensor, lse: torch.Tensor, reference: Callable = oracle) -> None:
    """o and lse against the float64 ``reference`` (flash-attn's criterion); the batch with every key
    padded gives zero rows."""
    assert o.shape == (c["B"], c["Nq"], c["H"], c.get("dv", c["d"]))
    o64, lse64, _ = reference(c, t, torch.float64)
    o_pt, _, _ = reference(c, t, DT[c["dtype"]])
    _, lse32, _ = reference(c, t, torch.float32)
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
    return oracle(c, t, dtype, grads, keep=dropout_keep(c), dropout_p=c["dropout"])


def check_dropout_forward(c: dict, t: dict, o: torch.Tensor, lse: torch.Tensor) -> None:
    """:func:`check_forward` against the oracle with the keep mask."""
    check_forward(c, t, o, lse, reference=dropout_oracle)


def dropout_backward(c: dict, t: dict, spec: KernelSpec):
    """:func:`backward` with the keep mask: the kernels' (dq, dk, dv) from the oracle's o and lse, and the
    oracle's gradients in float64 and in the inputs' dtype (check with :func:`check_backward`)."""
    o64, lse64, g64 = dropout_oracle(c, t, torch.float64, grads=True)
    _, _, g_pt = dropout_oracle(c, t, DT[c["dtype"]], grads=True)
    ours = F.run_backward(spec, t["do"], t["q"], t["k"], t["v"], o64.to(t["q"].dtype), lse64.float(),
                          **dropout_options(c, t))
    return ours, g64, g_pt


# --------------------------------------------------------------------------- varlen (packed sequences)
# A varlen case has ``lens`` ((len_q, len_k) per sequence) in place of B / Nq / Nk and may name a tile
# (``tile``: (block_r, block_c), so short lengths span several blocks). Its tensors are packed
# ([total, H, d]) with cu_seqlens; the oracle runs each sequence alone (B = 1), sequence b taking row b
# of [B, H] ALiBi slopes; a sequence with no key gives zero rows with lse -inf (the sink's logit with
# sinks), one with no query nothing.
__all__ += ["check_varlen_backward", "check_varlen_forward", "cu_seqlens", "varlen_backward", "varlen_inputs",
            "varlen_options", "varlen_oracle", "varlen_spec"]


def varlen_spec(direction: str, c: dict, **kw) -> KernelSpec:
    """The case's spec with ``varlen`` (and its ``tile``, if any)."""
    tile = dict(block_r=c["tile"][0], block_c=c["tile"][1]) if "tile" in c else {}
    return spec(direction, c, varlen=True, **{**tile, **kw})


def cu_seqlens(lengths) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def varlen_inputs(c: dict, seed: int = 23, scale: float = 1.0) -> dict:
    """Packed q, k (times ``scale``), v, do, ``cu_q`` / ``cu_k`` and the case's sinks and ALiBi slopes
    ([B, H]); ``kpm`` None (packed sequences have none)."""
    g = torch.Generator().manual_seed(seed)
    dt = DT[c["dtype"]]
    lq, lk = [a for a, _ in c["lens"]], [b for _, b in c["lens"]]
    H, Hkv, d = c["H"], c["Hkv"], c["d"]
    dv = c.get("dv", d)
    t = {"q": (scale * torch.randn(sum(lq), H, d, generator=g)).to(dt),
         "k": (scale * torch.randn(sum(lk), Hkv, d, generator=g)).to(dt),
         "v": torch.randn(sum(lk), Hkv, dv, generator=g).to(dt), "do": torch.randn(sum(lq), H, dv, generator=g).to(dt),
         "cu_q": cu_seqlens(lq), "cu_k": cu_seqlens(lk), "kpm": None}
    t["sinks"] = torch.randn(H, generator=g) if c.get("sinks") else None
    t["alibi"] = torch.rand(len(lq), H, generator=g) * 0.5 if c.get("alibi") else None
    return t


def varlen_options(c: dict, t: dict) -> dict:
    """The keywords of run_forward / run_backward: :func:`options` and the packed sequences'."""
    return {**options(c, t), "cu_seqlens_q": t["cu_q"], "cu_seqlens_k": t["cu_k"],
            "max_seqlen_q": max(a for a, _ in c["lens"]), "max_seqlen_k": max(b for _, b in c["lens"])}


def _sequence(c: dict, t: dict, b: int) -> tuple[dict, dict]:
    """Sequence b alone as a fixed-length case (B = 1) and its tensors."""
    (lq, lk), cq, ck = c["lens"][b], t["cu_q"].tolist(), t["cu_k"].tolist()
    cb = {**{k: v for k, v in c.items() if k not in ("lens", "tile")}, "B": 1, "Nq": lq, "Nk": lk}
    tb = {n: t[n][None, lo[b]:lo[b + 1]] for n, lo in (("q", cq), ("k", ck), ("v", ck), ("do", cq))}
    tb.update(kpm=None, sinks=t["sinks"], alibi=None if t["alibi"] is None else t["alibi"][b])
    return cb, tb


def varlen_oracle(c: dict, t: dict, dtype: torch.dtype, grads: bool = False):
    """(o [total_q, H, dv], lse [H, total_q], [dq, dk, dv] packed or None) of :func:`oracle` run on each
    sequence alone, in ``dtype``."""
    H, dv = c["H"], c.get("dv", c["d"])
    o, lse, g = [], [], [[], [], []]
    for b, (lq, lk) in enumerate(c["lens"]):
        cb, tb = _sequence(c, t, b)
        if lk == 0:  # no key: zero rows; lse -inf, or the sink's logit
            o.append(torch.zeros(lq, H, dv, dtype=dtype))
            sink = torch.full((H,), float("-inf"), dtype=dtype) if t["sinks"] is None else t["sinks"].to(dtype)
            lse.append(sink[:, None].expand(H, lq))
            part = [torch.zeros(lq, H, c["d"], dtype=dtype), None, None]
        elif lq == 0:
            o.append(torch.zeros(0, H, dv, dtype=dtype))
            lse.append(torch.zeros(H, 0, dtype=dtype))
            part = [torch.zeros(0, H, c["d"], dtype=dtype), torch.zeros(lk, c["Hkv"], c["d"], dtype=dtype),
                    torch.zeros(lk, c["Hkv"], dv, dtype=dtype)]
        else:
            ob, lb, gb = oracle(cb, tb, dtype, grads)
            o.append(ob[0])
            lse.append(lb[0])
            part = [x[0] for x in gb] if grads else None
        if grads:
            for acc, x in zip(g, part):
                if x is not None:
                    acc.append(x)
    return torch.cat(o), torch.cat(lse, dim=1), ([torch.cat(x) for x in g] if grads else None)


def check_varlen_forward(c: dict, t: dict, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Each sequence's o and lse against the float64 oracle of that sequence alone (flash-attn's
    criterion); rows that see no key exactly zero."""
    assert o.shape == (t["q"].shape[0], c["H"], c.get("dv", c["d"])) and lse.shape == (c["H"], t["q"].shape[0])
    o64, lse64, _ = varlen_oracle(c, t, torch.float64)
    o_pt, _, _ = varlen_oracle(c, t, DT[c["dtype"]])
    _, lse32, _ = varlen_oracle(c, t, torch.float32)
    cq = t["cu_q"].tolist()
    for b in range(len(c["lens"])):
        r = slice(cq[b], cq[b + 1])
        if r.start == r.stop:
            continue
        S.criterion(f"o of sequence {b}", o[r], o64[r], o_pt[r], DT[c["dtype"]])
        assert_lse_close(f"lse of sequence {b}", lse[:, r], lse64[:, r], lse32[:, r])
    dead = torch.isneginf(lse64).transpose(0, 1)  # [total_q, H]: rows that see no key (no sinks)
    assert torch.equal(o[dead], torch.zeros_like(o[dead]))


def varlen_backward(c: dict, t: dict, spec: KernelSpec):
    """The kernels' (dq, dk, dv) from the float64 oracle's o and lse, and the oracle's packed gradients in
    float64 and in the inputs' dtype."""
    o64, lse64, g64 = varlen_oracle(c, t, torch.float64, grads=True)
    _, _, g_pt = varlen_oracle(c, t, DT[c["dtype"]], grads=True)
    ours = F.run_backward(spec, t["do"], t["q"], t["k"], t["v"], o64.to(t["q"].dtype), lse64.float(),
                          **varlen_options(c, t))
    return ours, g64, g_pt


def check_varlen_backward(c: dict, t: dict, ours, g64, g_pt) -> None:
    """Each sequence's dq, dk, dv against the float64 oracle of that sequence alone (a slice whose
    reference is all zero, such as dk of a one-key sequence, by the same criterion); dq of rows that see
    no key and dk, dv of a sequence with no query exactly zero."""
    assert [g.shape for g in ours] == [t["q"].shape, t["k"].shape, t["v"].shape]
    cq, ck = t["cu_q"].tolist(), t["cu_k"].tolist()
    for b in range(len(c["lens"])):
        for name, a, r64, pt, lo in zip(("dq", "dk", "dv"), ours, g64, g_pt, (cq, ck, ck)):
            r = slice(lo[b], lo[b + 1])
            if r.start == r.stop:
                continue
            assert_close(f"{name} of sequence {b}", a[r], r64[r], pt[r], DT[c["dtype"]], zero_ok=not r64[r].any())
            if name != "dq" and c["lens"][b][0] == 0:
                assert torch.equal(a[r], torch.zeros_like(a[r])), f"{name} of sequence {b}: no query, not zero"
    _, lse64, _ = varlen_oracle(c, t, torch.float64)
    dead = torch.isneginf(lse64).transpose(0, 1)  # [total_q, H]: rows that see no key (no sinks)
    assert torch.equal(ours[0][dead], torch.zeros_like(ours[0][dead])), "dq of rows that see no key: not zero"
