"""A float64, autograd-able oracle of attention with every optional feature, written from
flash-attn's and torch's documented semantics (independent of the kernels and of fagen.reference):

* q [B, Nq, H, d], k, v [B, Nk, H_kv, d]; query head h reads kv head h // (H / H_kv) (torch's
  ``repeat_interleave`` / flash-attn's MQA-GQA);
* s = scale * q.k; softcap > 0: s = softcap * tanh(s / softcap); ALiBi: s -= slope[b?, h] * |i + shift - j|;
  additive bias: s += bias;
* query i sees key j iff causal: j <= i + shift; window (l, r): j >= i + shift - l (l >= 0) and
  j <= i + shift + r (r >= 0); key padding kpm[b, j]; bool mask[b, h, i, j] -- with shift = Nk - Nq
  (flash-attn, bottom-right) or 0 (torch SDPA ``is_causal``, top-left);
* softmax over the allowed keys; a row with none is 0 with lse = -inf; dropout: P * keep / (1 - p).

The criterion is flash-attn's: |ours - ref64| <= 2 * |same-dtype oracle - ref64| + atol.
"""
from __future__ import annotations

import math

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
ATOL = {torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float32: 2e-6, torch.float64: 1e-12}


def attention(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, kpm=None, mask=None, bias=None,
              scale=None, align="bottom_right", keep=None, dropout_p=0.0):
    """(o [B, Nq, H, d], lse [B, H, Nq]) in the inputs' dtype (float64 inputs: the reference)."""
    B, Nq, H, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk, vv = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))
    s = scale * torch.einsum("bihd,bjhd->bhij", q, kk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    shift = Nk - Nq if align == "bottom_right" else 0
    i = torch.arange(Nq)[:, None] + shift
    j = torch.arange(Nk)[None, :]
    if alibi is not None:
        slopes = alibi.to(s.dtype).reshape(-1, H)[:, :, None, None]
        s = s - slopes * (i - j).abs().to(s.dtype)
    if bias is not None:
        s = s + bias.to(s.dtype)
    allowed = torch.ones(Nq, Nk, dtype=torch.bool)
    left, right = window
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    allowed = allowed[None, None].expand(B, H, Nq, Nk)
    if kpm is not None:
        allowed = allowed & kpm[:, None, None, :]
    if mask is not None:
        allowed = allowed & mask
    dead = ~allowed.any(-1)
    sm = s.masked_fill(~allowed, -math.inf).masked_fill(dead[..., None], 0.0)
    lse = torch.logsumexp(sm, dim=-1)
    p = torch.exp(sm - lse[..., None]).masked_fill(~allowed, 0.0)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    o = torch.einsum("bhij,bjhd->bihd", p, vv)
    return o, lse.masked_fill(dead, -math.inf)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def run_oracle(inputs: dict, grads_of: tuple[str, ...], do: torch.Tensor, dtype: torch.dtype, **kw):
    """(o, lse, {name: grad}) of the oracle in ``dtype`` with autograd through ``grads_of``."""
    leaves = {n: inputs[n].detach().to(dtype).requires_grad_(n in grads_of) for n in inputs}
    o, lse = attention(leaves["q"], leaves["k"], leaves["v"], bias=leaves.get("bias"), **kw)
    o.backward(do.to(dtype))
    return o.detach(), lse.detach(), {n: leaves[n].grad for n in grads_of}


def flash_criterion(name: str, ours: torch.Tensor, ref64: torch.Tensor, same_dtype: torch.Tensor, atol: float, *,
                    zero_ok: bool = False) -> float:
    """|ours - ref64| <= 2 |same_dtype - ref64| + atol; returns ours' error.

    A reference that is all zero proves nothing (a kernel that writes zeros passes it): that
    fails unless the caller declares the output zero by construction (``zero_ok``: a fully
    masked case, or gradients that vanish because no row sees two keys).
    """
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    if ref64.numel() and not zero_ok:
        assert ref64.abs().max().item() > 0, (
            f"{name}: the float64 reference is all zero, so the comparison proves nothing "
            "(every key masked?); declare the case fully masked if that is its point")
    e, e_pt = max_err(ours, ref64), max_err(same_dtype, ref64)
    assert e <= 2 * e_pt + atol, f"{name}: error {e:.3g} > 2 x {e_pt:.3g} + {atol:.2g}"
    return e


def assert_close(name: str, ours: torch.Tensor, ref64: torch.Tensor, same_dtype: torch.Tensor,
                 dtype: torch.dtype, *, zero_ok: bool = False) -> None:
    """flash-attn's criterion (atol scaled by the magnitude of the reference)."""
    atol = ATOL[dtype] * max(1.0, ref64.abs().max().item() if ref64.numel() else 0.0)
    flash_criterion(name, ours, ref64, same_dtype, atol, zero_ok=zero_ok)


#: lse is kept in float32 whatever the input dtype: a few float32 roundings of its magnitude
LSE_ULPS = 4
EPS32 = torch.finfo(torch.float32).eps


def assert_lse_close(name: str, lse: torch.Tensor, lse64: torch.Tensor, lse32: torch.Tensor) -> float:
    """lse against the float64 one by flash-attn's criterion in float32 (lse's own dtype):
    |lse - lse64| <= 2 |lse32 - lse64| + LSE_ULPS eps32 max(1, |lse64|), with lse32 plain
    PyTorch's logsumexp of the same inputs in float32 (its error grows with the head dim and the
    number of keys as the kernel's does). -inf exactly where lse64 is (rows that see no key)."""
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite), f"{name}: -inf pattern differs from the float64 reference"
    if not finite.any():
        return 0.0
    ours, ref, pt = lse.double()[finite], lse64.double()[finite], lse32.double()[finite]
    atol = LSE_ULPS * EPS32 * max(1.0, ref.abs().max().item())
    e, e_pt = max_err(ours, ref), max_err(pt, ref)
    assert e <= 2 * e_pt + atol, f"{name}: error {e:.3g} > 2 x float32 torch {e_pt:.3g} + {atol:.2g}"
    return e
