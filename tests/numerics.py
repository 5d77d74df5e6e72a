"""Shared numerics harness: run fagen on CPU (emulator) and judge it like flash-attn's tests.

Criterion: |ours - ref64| <= 2 * |torch_same_dtype - ref64| + atol, per output, where
ref64 is fagen.reference in float64 and torch_same_dtype is plain PyTorch attention
in the input dtype (autograd for its gradients); lse (float32 whatever the input dtype) against
PyTorch's float32 logsumexp the same way (featref.assert_lse_close).

Key padding leaves key 0 of every batch visible, so padding never takes from a row every key
causal lets it see: a padded case compares real attention, not zeros. Rows that see no key are
their own, declared cases (``Case.masked_batch``: a batch whose keys are all masked; causal with
Nq > Nk: the top rows), and a comparison whose float64 reference is all zero fails unless the
case declares it (featref.flash_criterion).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import fagen.functional as F
from fagen import reference as R
from featref import assert_lse_close, flash_criterion
from featref import attention as attention_oracle

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
    masked_batch: int | None = None  # with padding: this batch's keys are all masked (rows that see no key)
    tile: tuple[int, int, int] | None = None  # (block_r, block_c, num_warps) of an explicit spec (needs impl)
    knobs: tuple[tuple[str, int], ...] = ()  # the family's knobs of an explicit spec (needs impl)

    def __str__(self) -> str:
        flags = "".join(f"-{f}" for f, on in (("causal", self.causal), ("pad", self.padding)) if on)
        drop = f"-p{self.dropout_p}" if self.dropout_p else ""
        fam = f"-{self.impl}" if self.impl else ""
        dead = f"-dead{self.masked_batch}" if self.masked_batch is not None else ""
        tile = "-t{}x{}w{}".format(*self.tile) if self.tile else ""
        knobs = "".join(f"-{k}{v}" for k, v in self.knobs)
        return (f"b{self.batch}h{self.heads}q{self.seqlen_q}k{self.seqlen_k}d{self.head_dim}-{self.dtype}"
                f"{flags}{drop}{dead}{fam}{tile}{knobs}")


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
        mask[:, 0] = True  # every row causal lets see a key keeps one: padding alone never empties a row
        if case.batch > 1:
            mask[1, :] = True  # one batch without padding
        if case.masked_batch is not None:
            mask[case.masked_batch, :] = False  # declared: every row of this batch sees no key
    elif case.masked_batch is not None:
        raise ValueError("masked_batch needs padding=True")
    return q, k, v, do, mask


def visibility(case: Case, mask: torch.Tensor | None) -> dict[str, float]:
    """Rows that see a key, as fractions of all rows and of the rows causal alone lets see one;
    ``max_keys``: the most keys a row sees (below 2, dq and dk vanish by construction)."""
    B, Nq, Nk = case.batch, case.seqlen_q, case.seqlen_k
    allowed = R.mask_matrix(B, Nq, Nk, causal=case.causal, key_padding_mask=mask)[:, 0]
    structural = R.mask_matrix(B, Nq, Nk, causal=case.causal)[:, 0].any(-1)
    if case.masked_batch is not None:  # the declared dead batch is not the padding's doing
        structural[case.masked_batch] = False
    alive = allowed.any(-1)
    n = structural.sum().item()
    return {"rows": alive.float().mean().item(),
            "of_causal": (alive & structural).sum().item() / n if n else 1.0,
            "max_keys": allowed.sum(-1).max().item()}


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
        assert case.tile is None and not case.knobs, "an explicit tile or knob needs an explicit impl"
        o, lse = F.attention_forward(q, k, v, dropout_p=case.dropout_p, seed=case.seed, offset=3, **kw)
        dq, dk, dv = F.attention_backward(do, q, k, v, o, lse, dropout_p=case.dropout_p, seed=case.seed, offset=3, **kw)
    else:
        from fagen import KernelSpec

        flags = dict(head_dim=case.head_dim, dtype=case.dtype, causal=case.causal, key_padding=case.padding,
                     dropout=case.dropout_p > 0, impl=case.impl)
        if case.tile is not None:
            flags.update(block_r=case.tile[0], block_c=case.tile[1], num_warps=case.tile[2])
        if case.knobs:
            flags["knobs"] = dict(case.knobs)
        rkw = dict(key_padding_mask=mask, dropout_p=case.dropout_p, seed=case.seed, offset=3)
        o, lse = F.run_forward(KernelSpec(direction="fwd", **flags), q, k, v, **rkw)
        dq, dk, dv = F.run_backward(KernelSpec(direction="bwd", **flags), do, q, k, v, o, lse, **rkw)
    for name, t in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{case}: NaN in {name}"
    vis = visibility(case, mask)
    # padding keeps most rows seeing a key (here: all that causal lets see one); whole-batch
    # masking is declared by the case, never a side effect of the mask helper
    assert vis["of_causal"] >= 0.5, f"{case}: padding leaves {vis['of_causal']:.0%} of the rows a key"
    fully_masked = vis["rows"] == 0
    assert not fully_masked or case.masked_batch is not None, f"{case}: every row fully masked, undeclared"

    rkw = dict(kw, keep_mask=keep, dropout_p=case.dropout_p)
    o64, lse64 = R.attention_forward_ref(q, k, v, **rkw)
    # backward reference from the same o / lse fagen produced, and from the exact float64 ones
    dq64, dk64, dv64 = R.attention_backward_ref(do, q, k, v, o64, lse64, **rkw)

    # plain PyTorch in the same dtype (autograd for gradients)
    qt, kt, vt = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ot = R.attention_ref_torch(qt, kt, vt, **rkw)
    ot.backward(do)
    baseline = {"o": (ot.detach(), o64), "dq": (qt.grad, dq64), "dk": (kt.grad, dk64), "dv": (vt.grad, dv64)}
    if vis["max_keys"] < 2:
        # one key per row: dq, dk are exactly zero in exact arithmetic, and in the kernel they are
        # scale * dO.(o64 - o) * k from D = rowsum(dO o) of the stored (rounded) o, which plain
        # PyTorch's autograd never forms; the float64 backward from the kernel's own o is their
        # reference, within atol (PyTorch's exact zeros measure no error to scale by)
        dq_own, dk_own, _ = R.attention_backward_ref(do, q, k, v, o, lse, **rkw)
        baseline["dq"], baseline["dk"] = (dq_own, dq_own), (dk_own, dk_own)
    ours = {"o": o, "dq": dq, "dk": dk, "dv": dv}
    atol = ATOL[case.dtype] * max(1.0, max(b.abs().max().item() if b.numel() else 0.0 for _, b in baseline.values()))
    report = {}
    for name, (pt, ref) in baseline.items():
        # one key per row at most: softmax is constant, dq and dk vanish by construction
        zero_ok = fully_masked or (name in ("dq", "dk") and vis["max_keys"] < 2)
        report[name] = flash_criterion(f"{case}: {name}", ours[name], ref, pt, atol, zero_ok=zero_ok)
    # lse: finite rows agree with the float64 logsumexp, fully masked rows are -inf
    lse32 = attention_oracle(q.float(), k.float(), v.float(), causal=case.causal, kpm=mask)[1]
    report["lse"] = assert_lse_close(f"{case}: lse", lse, lse64, lse32)
    finite = torch.isfinite(lse64)
    # fully masked rows: exactly zero output and dq
    dead = ~finite  # [B, H, Nq]
    if dead.any():
        dead_rows = dead.permute(0, 2, 1)  # [B, Nq, H]
        assert (o[dead_rows] == 0).all() and (dq[dead_rows] == 0).all(), f"{case}: fully masked rows not zero"
    return report
