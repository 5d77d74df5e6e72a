"""Shared numerics harness: run fagen on CPU (emulator) and judge it like flash-attn's tests.

Criterion: |ours - ref64| <= 2 * |torch_same_dtype - ref64| + atol, per output, where
ref64 is fagen.reference in float64 and torch_same_dtype is plain PyTorch attention
in the input dtype (autograd for its gradients).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import fagen.functional as F
from fagen import reference as R

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ATOL = {"float16": 2e-4, "bfloat16": 2e-3, "float32": 2e-6}


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    causal: bool = False
    padding: bool = False
    dropout_p: float = 0.0
    seed: int = 0
    impl: str | None = None  # kernel family; None: the default for the spec

    def __str__(self) -> str:
        flags = "".join(f"-{f}" for f, on in (("causal", self.causal), ("pad", self.padding)) if on)
        drop = f"-p{self.dropout_p}" if self.dropout_p else ""
        fam = f"-{self.impl}" if self.impl else ""
        return f"b{self.batch}h{self.heads}q{self.seqlen_q}k{self.seqlen_k}d{self.head_dim}-{self.dtype}{flags}{drop}{fam}"


def make_inputs(case: Case):
    g = torch.Generator().manual_seed(1234 + case.seqlen_q * 7 + case.seqlen_k + case.head_dim)
    dt = DTYPES[case.dtype]
    shape_q = (case.batch, case.seqlen_q, case.heads, case.head_dim)
    shape_k = (case.batch, case.seqlen_k, case.heads, case.head_dim)
    q = torch.randn(shape_q, generator=g).to(dt)
    k = torch.randn(shape_k, generator=g).to(dt)
    v = torch.randn(shape_k, generator=g).to(dt)
    do = torch.randn(shape_q, generator=g).to(dt)
    mask = None
    if case.padding:
        mask = torch.rand(case.batch, case.seqlen_k, generator=g) > 0.3
        mask[0, :] = False  # batch 0: every row fully masked -> lse -inf, zero grads
        if case.batch > 1:
            mask[1, :] = True
    return q, k, v, do, mask


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check(case: Case) -> dict[str, float]:
    """Forward + backward through fagen's functional API on CPU vs the references; raises on failure."""
    q, k, v, do, mask = make_inputs(case)
    kw = dict(causal=case.causal, key_padding_mask=mask)
    keep = None
    if case.dropout_p:
        keep = F.dropout_keep_mask(case.batch, case.heads, case.seqlen_q, case.seqlen_k, case.dropout_p,
                                   seed=case.seed, offset=3)
    if case.impl is None:
        o, lse = F.attention_forward(q, k, v, dropout_p=case.dropout_p, seed=case.seed, offset=3, **kw)
        dq, dk, dv = F.attention_backward(do, q, k, v, o, lse, dropout_p=case.dropout_p, seed=case.seed, offset=3, **kw)
    else:
        from fagen import KernelSpec

        flags = dict(head_dim=case.head_dim, dtype=case.dtype, causal=case.causal, key_padding=case.padding,
                     dropout=case.dropout_p > 0, impl=case.impl)
        rkw = dict(key_padding_mask=mask, dropout_p=case.dropout_p, seed=case.seed, offset=3)
        o, lse = F.run_forward(KernelSpec(direction="fwd", **flags), q, k, v, **rkw)
        dq, dk, dv = F.run_backward(KernelSpec(direction="bwd", **flags), do, q, k, v, o, lse, **rkw)
    for name, t in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{case}: NaN in {name}"

    rkw = dict(kw, keep_mask=keep, dropout_p=case.dropout_p)
    o64, lse64 = R.attention_forward_ref(q, k, v, **rkw)
    # backward reference from the same o / lse fagen produced, and from the exact float64 ones
    dq64, dk64, dv64 = R.attention_backward_ref(do, q, k, v, o64, lse64, **rkw)

    # plain PyTorch in the same dtype (autograd for gradients)
    qt, kt, vt = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ot = R.attention_ref_torch(qt, kt, vt, **rkw)
    ot.backward(do)
    baseline = {"o": (ot.detach(), o64), "dq": (qt.grad, dq64), "dk": (kt.grad, dk64), "dv": (vt.grad, dv64)}
    ours = {"o": o, "dq": dq, "dk": dk, "dv": dv}
    atol = ATOL[case.dtype] * max(1.0, max(b.abs().max().item() if b.numel() else 0.0 for _, b in baseline.values()))
    report = {}
    for name, (pt, ref) in baseline.items():
        e_ours, e_pt = _err(ours[name], ref), _err(pt, ref)
        report[name] = e_ours
        assert e_ours <= 2 * e_pt + atol, f"{case}: {name} error {e_ours:.3g} > 2 x torch {e_pt:.3g} + {atol:.2g}"
    # lse: finite rows agree with the float64 logsumexp, fully masked rows are -inf
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite), f"{case}: lse -inf pattern differs"
    if finite.any():
        e = (lse.double()[finite] - lse64[finite]).abs().max().item()
        assert e <= 1e-3, f"{case}: lse error {e:.3g}"
    # fully masked rows: exactly zero output and dq
    dead = ~finite  # [B, H, Nq]
    if dead.any():
        dead_rows = dead.permute(0, 2, 1)  # [B, Nq, H]
        assert (o[dead_rows] == 0).all() and (dq[dead_rows] == 0).all(), f"{case}: fully masked rows not zero"
    return report
