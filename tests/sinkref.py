"""A small autograd-able oracle of attention with sinks and lse as an output, for the sink and
lse-gradient tests (written from the equations, independent of the kernels):

* s = scale * q.k (GQA: q head h reads kv head h // (H / H_kv)); softcap > 0: softcap * tanh(s / softcap);
* allowed pairs from :func:`fagen.reference.mask_matrix` (causal, window, key padding), bottom-right;
* the sink column (sinks[h], not scaled, capped or dropped) appended to the masked scores, softmax,
  dropped: lse_i = logsumexp over the row's scores and the sink; a row with no allowed key and no
  sink is 0 with lse = -inf;
* dropout: P * keep / (1 - p) on the key columns only.

Run in float64 it is the reference; in the inputs' dtype it is "plain PyTorch in the same dtype" of
flash-attn's criterion.
"""
from __future__ import annotations

import math

import torch

from fagen import reference as R

ATOL = {torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float32: 2e-6, torch.float64: 1e-12}


def attention(q, k, v, *, sinks=None, causal=False, window=(-1, -1), kpm=None, softcap=0.0, scale=None, keep=None,
              dropout_p=0.0, dtype=None):
    """(o [B, Nq, H, d], lse [B, H, Nq]) computed in ``dtype`` (default: q's), autograd-able."""
    dtype = dtype or q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    B, Nq, H, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk, vv = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))
    s = scale * torch.einsum("bihd,bjhd->bhij", q, kk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    allowed = R.mask_matrix(B, Nq, Nk, causal=causal, window_size=window, key_padding_mask=kpm).expand(B, H, Nq, Nk)
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(dtype)[None, :, None, None].expand(B, H, Nq, 1)], dim=-1)
    dead = ~torch.isfinite(s).any(-1)  # no key and no sink
    s = s.masked_fill(dead[..., None], 0.0)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])[..., :Nk].masked_fill(~allowed, 0.0)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    o = torch.einsum("bhij,bjhd->bihd", p, vv)
    return o, lse.masked_fill(dead, -math.inf)


def criterion(name: str, ours: torch.Tensor, ref64: torch.Tensor, same: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attn's: max|ours - ref64| <= 2 max|same - ref64| + atol; returns ours' error."""
    finite = torch.isfinite(ref64)
    assert torch.equal(finite, torch.isfinite(ours.double())), f"{name}: non-finite entries differ"
    ours, ref64, same = (t.double()[finite] for t in (ours, ref64, same))
    err = (ours - ref64).abs().max().item() if ours.numel() else 0.0
    bound = 2 * ((same - ref64).abs().max().item() if ours.numel() else 0.0) + ATOL[dtype]
    assert err <= bound, f"{name}: max error {err:.3g} > 2 x same-dtype's + atol = {bound:.3g}"
    return err


def grads(fn, inputs: dict, do: torch.Tensor, dlse: torch.Tensor | None, dtype: torch.dtype, **kw):
    """(o, lse, {name: grad}) of ``attention`` in ``dtype`` for the loss <o, do> + <lse, dlse>."""
    leaves = {n: t.detach().to(dtype if n != "sinks" else (torch.float64 if dtype == torch.float64 else torch.float32))
              .requires_grad_(True) for n, t in inputs.items()}
    o, lse = fn(leaves["q"], leaves["k"], leaves["v"], sinks=leaves.get("sinks"), dtype=dtype, **kw)
    loss = (o * do.to(o.dtype)).sum()
    if dlse is not None:
        live = torch.isfinite(lse)
        loss = loss + (torch.where(live, lse, torch.zeros_like(lse)) * dlse.to(lse.dtype)).sum()
    loss.backward()
    return o.detach(), lse.detach(), {n: t.grad for n, t in leaves.items()}
