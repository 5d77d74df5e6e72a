"""Float64 reference for standard (non-flash) attention, written from the equations.

Layouts: ``q`` ``[B, Nq, H, d]``; ``k`` ``[B, Nk, H, d]``; ``v`` ``[B, Nk, H, dv]``;
``o``/``do`` ``[B, Nq, H, dv]``; ``lse`` ``[B, H, Nq]``; ``keep_mask`` ``[B, H, Nq, Nk]``;
``key_padding_mask`` ``[B, Nk]`` (True = the key takes part).

Forward, per batch ``b`` and head ``h`` (``M`` = :func:`mask_matrix`, ``Z`` = keep mask)::

    S     = scale * Q K^T                         (scale defaults to 1/sqrt(d))
    lse_i = log sum_{j: M_ij} exp(S_ij)           (-inf when row i allows no key)
    P_ij  = M_ij ? exp(S_ij - lse_i) : 0          (a row with no allowed key is 0)
    O     = (P o Z / (1 - p)) V

Backward (no autograd)::

    dV = (P o Z / (1 - p))^T dO
    dP = (dO V^T) o Z / (1 - p)
    D  = rowsum(dO o O)
    dS = P o (dP - D)
    dQ = scale * dS K,    dK = scale * dS^T Q

Masking rules live in :func:`mask_matrix`: causal masking is bottom-right aligned
(query ``i`` may see key ``j`` iff ``j <= i + Nk - Nq``, as flash-attn >= 2.1).

Non-finite inputs (the NaN semantics every kernel family follows): only allowed pairs
take part, and they propagate NaN as IEEE arithmetic does -- a NaN in ``q_i`` makes row
``i`` NaN (o, lse, dq) and the dk, dv of every key it attends to; a NaN in ``k_j`` or
``v_j`` reaches every row that attends to key ``j``; a row whose allowed scores are all
``-inf`` or include ``+inf`` has NaN lse and output (as torch's softmax). Masked pairs never
contribute, whatever they hold (unlike a plain ``P @ V``, where ``0 * NaN`` is NaN), and a
row with no allowed key stays exactly zero with ``lse = -inf``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import numpy as np
import torch

from .errors import check_dropout_p

__all__ = [
    "mask_matrix",
    "attention_forward_ref",
    "attention_backward_ref",
    "attention_ref_torch",
]

ArrayLike = Any  # torch.Tensor or numpy.ndarray


# --------------------------------------------------------------------------- helpers


def _as_float_tensor(name: str, x: ArrayLike, ndim: int) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def _as_bool_tensor(
    name: str, x: ArrayLike, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if x.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype bool, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    return x.to(device)


def _check_scale(softmax_scale: Optional[float], d: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {softmax_scale!r}")
    s = float(softmax_scale)
    if not math.isfinite(s):
        raise ValueError(f"softmax_scale must be finite, got {s}")
    return s


def _check_qkv(
    q: ArrayLike, k: ArrayLike, v: ArrayLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = _as_float_tensor("q", q, 4)
    k = _as_float_tensor("k", k, 4)
    v = _as_float_tensor("v", v, 4)
    B, Nq, H, d = q.shape
    if k.shape[0] != B or k.shape[2] != H or k.shape[3] != d:
        raise ValueError(f"k must have shape [B={B}, Nk, H={H}, d={d}], got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must have shape [B={B}, Nk={k.shape[1]}, H={H}, dv], got {tuple(v.shape)}"
        )
    if min(B, Nq, H, d, k.shape[1], v.shape[3]) <= 0:
        raise ValueError("q, k and v must have no empty dimension")
    return q, k, v


def _dropout_scale(
    keep_mask: Optional[ArrayLike], dropout_p: float, shape: tuple[int, ...], device: torch.device
) -> Optional[torch.Tensor]:
    """Return ``Z / (1 - p)`` as float64 ``[B, H, Nq, Nk]``, or None when there is no dropout."""
    p = check_dropout_p(dropout_p)
    if keep_mask is None:
        if p > 0.0:
            raise ValueError("keep_mask is required when dropout_p > 0")
        return None
    z = _as_bool_tensor("keep_mask", keep_mask, shape, device)
    return z.to(torch.float64) / (1.0 - p)


def _scores_and_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(lse, P)`` in float64; ``lse`` is recomputed unless given (backward pass).

    NaN flows like torch's: a NaN score on an allowed pair makes the row's lse and P NaN
    (masked pairs never contribute, whatever they hold); a row whose allowed scores are all
    ``-inf``, or that has a ``+inf`` score, has no softmax (NaN). Only a row with no allowed
    key (``lse = -inf``) is "fully masked": P = 0.
    """
    s = scale * torch.einsum("bihd,bjhd->bhij", q, k)  # [B, H, Nq, Nk]
    if lse is None:
        lse = torch.logsumexp(s.masked_fill(~allowed, -math.inf), dim=-1)  # -inf on empty rows
        has_key = allowed.any(dim=-1).expand_as(lse)
        undefined = (has_key & torch.isneginf(lse)) | torch.isposinf(lse)  # softmax of all -inf / of +inf
        lse = torch.where(undefined, torch.full_like(lse, math.nan), lse)
    dead = torch.isneginf(lse)  # fully masked rows
    lse_safe = torch.where(dead, torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe[..., None])
    p = torch.where(allowed & ~dead[..., None], p, torch.zeros_like(p))
    return lse, p


def _pair_sum(w: torch.Tensor, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``out[b, i, h, :] = sum_j w[b, h, i, j] * x[b, j, h, :]`` over the allowed pairs only.

    ``w`` is 0 on masked pairs; a plain product would still turn ``0 * NaN`` (or ``0 * inf``)
    of a non-finite ``x`` row into NaN for rows that never attend to it. Here a non-finite
    entry of ``x`` reaches exactly the rows whose pair with it is allowed.
    """
    finite = torch.isfinite(x)
    out = torch.einsum("bhij,bjhx->bihx", w, torch.where(finite, x, torch.zeros_like(x)))
    for b, j, h in (~finite).any(dim=-1).nonzero().tolist():  # the (few) keys holding inf / NaN
        bad = ~finite[b, j, h]  # [X]
        pair = allowed[b, h if allowed.shape[1] > 1 else 0, :, j]  # [I]
        contrib = w[b, h, :, j, None] * torch.where(bad, x[b, j, h], torch.zeros_like(x[b, j, h]))[None, :]
        out[b, :, h] += torch.where(pair[:, None] & bad[None, :], contrib, torch.zeros_like(contrib))
    return out


# --------------------------------------------------------------------------- public API


def mask_matrix(
    B: int,
    Nq: int,
    Nk: int,
    *,
    causal: bool = False,
    key_padding_mask: Optional[ArrayLike] = None,
    device: Optional[torch.device | str] = None,
) -> torch.Tensor:
    """Return the allowed-pairs matrix ``M`` as bool ``[B, 1, Nq, Nk]`` (True = allowed).

    ``M[b, 0, i, j] = key_padding_mask[b, j] and (not causal or j <= i + Nk - Nq)``:
    causal masking is bottom-right aligned, as in flash-attn >= 2.1.  This is the
    single definition of the masking rules used by every function in this module.
    """
    for name, val in (("B", B), ("Nq", Nq), ("Nk", Nk)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or int(val) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    B, Nq, Nk = int(B), int(Nq), int(Nk)
    if device is None:
        device = key_padding_mask.device if isinstance(key_padding_mask, torch.Tensor) else "cpu"
    allowed = torch.ones(B, 1, Nq, Nk, dtype=torch.bool, device=device)
    if causal:
        i = torch.arange(Nq, device=device)[:, None]
        j = torch.arange(Nk, device=device)[None, :]
        allowed = allowed & (j <= i + (Nk - Nq))
    if key_padding_mask is not None:
        kpm = _as_bool_tensor("key_padding_mask", key_padding_mask, (B, Nk), torch.device(device))
        allowed = allowed & kpm[:, None, None, :]
    return allowed


def attention_forward_ref(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    causal: bool = False,
    key_padding_mask: Optional[ArrayLike] = None,
    keep_mask: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention forward: return ``(o [B, Nq, H, dv], lse [B, H, Nq])``.

    ``S = scale Q K^T``; ``lse = logsumexp`` of the allowed entries of each row
    (``-inf`` for a row with no allowed key); ``P = exp(S - lse)`` on allowed entries,
    0 elsewhere; ``O = (P o Z / (1 - p)) V`` with ``Z = keep_mask`` (all ones if None).
    ``keep_mask`` is required when ``dropout_p > 0``.
    """
    q, k, v = _check_qkv(q, k, v)
    B, Nq, H, d = q.shape
    Nk = k.shape[1]
    scale = _check_scale(softmax_scale, d)
    dev = q.device
    zscale = _dropout_scale(keep_mask, dropout_p, (B, H, Nq, Nk), dev)
    allowed = mask_matrix(B, Nq, Nk, causal=causal, key_padding_mask=key_padding_mask, device=dev)
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))

    lse, p = _scores_and_probs(q64, k64, allowed, scale)
    pdrop = p if zscale is None else p * zscale
    o = _pair_sum(pdrop, v64, allowed)
    return o, lse


def attention_backward_ref(
    do: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    o: ArrayLike,
    lse: ArrayLike,
    *,
    causal: bool = False,
    key_padding_mask: Optional[ArrayLike] = None,
    keep_mask: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 attention backward from the equations (no autograd): return ``(dq, dk, dv)``.

    ``P = exp(S - lse)`` (0 on masked entries and on rows with ``lse = -inf``);
    ``dV = (P o Z/(1-p))^T dO``; ``dP = (dO V^T) o Z/(1-p)``; ``D = rowsum(dO o O)``;
    ``dS = P o (dP - D)``; ``dQ = scale dS K``; ``dK = scale dS^T Q``.
    ``o`` and ``lse`` are the forward outputs (``lse`` may be float32, as kernels store it).
    """
    q, k, v = _check_qkv(q, k, v)
    B, Nq, H, d = q.shape
    Nk, dv = k.shape[1], v.shape[3]
    do = _as_float_tensor("do", do, 4)
    o = _as_float_tensor("o", o, 4)
    lse = _as_float_tensor("lse", lse, 3)
    expected = {"do": (do, (B, Nq, H, dv)), "o": (o, (B, Nq, H, dv)), "lse": (lse, (B, H, Nq))}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    scale = _check_scale(softmax_scale, d)
    dev = q.device
    zscale = _dropout_scale(keep_mask, dropout_p, (B, H, Nq, Nk), dev)
    allowed = mask_matrix(B, Nq, Nk, causal=causal, key_padding_mask=key_padding_mask, device=dev)
    q64, k64, v64, do64, o64, lse64 = (
        t.detach().to(device=dev, dtype=torch.float64) for t in (q, k, v, do, o, lse)
    )

    _, p = _scores_and_probs(q64, k64, allowed, scale, lse=lse64)
    pdrop = p if zscale is None else p * zscale
    allowed_t = allowed.transpose(-1, -2)
    dv_ = _pair_sum(pdrop.transpose(-1, -2), do64, allowed_t)
    dp = torch.einsum("bihd,bjhd->bhij", do64, v64)
    if zscale is not None:
        dp = torch.where(zscale > 0, dp * zscale, torch.zeros_like(dp))  # a dropped pair has dP = 0
    D = torch.einsum("bihd,bihd->bhi", do64, o64)
    live = allowed & ~torch.isneginf(lse64)[..., None]  # pairs that take part
    ds = torch.where(live, p * (dp - D[..., None]), torch.zeros_like(p))
    dq = scale * _pair_sum(ds, k64, live)
    dk = scale * _pair_sum(ds.transpose(-1, -2), q64, live.transpose(-1, -2))
    return dq, dk, dv_


def attention_ref_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Optional[ArrayLike] = None,
    keep_mask: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    upcast: bool = False,
) -> torch.Tensor:
    """Plain, autograd-able PyTorch attention; returns ``o`` only.

    Computes ``softmax(scale Q K^T + mask) o Z / (1 - p) @ V`` in the input dtype, or in
    float64 when ``upcast`` (the result is then float64).  It measures "the error of
    plain PyTorch attention in the same dtype" for flash-attn's test criterion.
    A row with no allowed key gives a zero output row and zero gradients (never NaN):
    its scores are replaced by zeros before the softmax and its probabilities by 0 after.
    """
    q, k, v = _check_qkv(q, k, v)
    B, Nq, H, d = q.shape
    Nk = k.shape[1]
    scale = _check_scale(softmax_scale, d)
    dev = q.device
    p = check_dropout_p(dropout_p)
    if keep_mask is None and p > 0.0:
        raise ValueError("keep_mask is required when dropout_p > 0")
    if upcast:
        q, k, v = q.to(torch.float64), k.to(torch.float64), v.to(torch.float64)
    allowed = mask_matrix(B, Nq, Nk, causal=causal, key_padding_mask=key_padding_mask, device=dev)
    row_any = allowed.any(dim=-1, keepdim=True)  # [B, 1, Nq, 1]

    scores = torch.einsum("bihd,bjhd->bhij", q * scale, k)
    scores = scores.masked_fill(~allowed, -math.inf).masked_fill(~row_any, 0.0)
    attn = torch.softmax(scores, dim=-1).masked_fill(~row_any, 0.0)
    if keep_mask is not None:
        z = _as_bool_tensor("keep_mask", keep_mask, (B, H, Nq, Nk), dev)
        attn = attn.masked_fill(~z, 0.0) / (1.0 - p)
    return torch.einsum("bhij,bjhd->bihd", attn.to(v.dtype), v)
