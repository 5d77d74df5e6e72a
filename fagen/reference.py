"""Float64 reference for standard (non-flash) attention, written from the equations.

Layouts: ``q`` ``[B, Nq, H, d]``; ``k`` ``[B, Nk, H_kv, d]``; ``v`` ``[B, Nk, H_kv, dv]``
(GQA/MQA: ``H = g * H_kv``, q head ``h`` reads kv head ``h // g``); ``o``/``do``
``[B, Nq, H, dv]``; ``lse`` ``[B, H, Nq]``; ``keep_mask`` ``[B, H, Nq, Nk]``;
``key_padding_mask`` ``[B, Nk]`` (True = the key takes part); ``attn_mask`` (bool, True =
take part) and ``attn_bias`` (float) broadcastable to ``[B, H, Nq, Nk]``; ``alibi_slopes``
``[H]`` or ``[B, H]``. Varlen (``cu_seqlens_q``/``cu_seqlens_k``, int [B + 1]): ``q``
``[total_q, H, d]``, ``k``/``v`` ``[total_k, H_kv, d]``, ``lse`` ``[H, total_q]``; sequence
``b`` is rows ``cu[b]:cu[b + 1]`` and is computed on its own, with positions counted inside
it; ``keep_mask``/``attn_mask``/``attn_bias`` then index ``[B, H, max_q, max_k]``.

Forward, per batch ``b`` and q head ``h`` (``M`` = allowed pairs, ``Z`` = keep mask)::

    shift = Nk - Nq  (causal_align="bottom_right", flash-attn)  or 0 ("top_left", torch SDPA)
    M_ij  = 0 <= i < Nq, 0 <= j < Nk, key_padding[b, j], attn_mask[b, h, i, j],
            causal: j <= i + shift,
            window (l, r): (l < 0 or j >= i + shift - l) and (r < 0 or j <= i + shift + r)
    S     = scale * Q K^T                         (scale defaults to 1/sqrt(d))
    S     = softcap * tanh(S / softcap)            (softcap > 0)
    S    += -slope[b, h] * |i + shift - j|         (ALiBi, flash-attn's convention)
    S    += attn_bias[b, h, i, j]
    lse_i = log sum_{j: M_ij} exp(S_ij)           (-inf when row i allows no key)
    P_ij  = M_ij ? exp(S_ij - lse_i) : 0          (a row with no allowed key is 0)
    O     = (P o Z / (1 - p)) V

Backward (no autograd)::

    dV = (P o Z / (1 - p))^T dO                   (GQA: summed over the q heads of a kv head)
    dP = (dO V^T) o Z / (1 - p)
    D  = rowsum(dO o O)
    dS = P o (dP - D)                             (= dBias, reduced to attn_bias's shape)
    dS_raw = dS o (1 - tanh^2(scale Q K^T / softcap))   (softcap > 0; else dS)
    dQ = scale * dS_raw K,    dK = scale * dS_raw^T Q

Attention sinks (``sinks`` ``[H]``, one logit per q head): row ``i``'s softmax runs over its
scores and the sink logit, appended as a column and dropped after the softmax (the sink has no
value; it is neither scaled, softcapped, biased nor dropped out)::

    lse_i = log(exp(sink_h) + sum_{j: M_ij} exp(S_ij))    (= sink_h for a row with no allowed key)
    P_ij  = M_ij ? exp(S_ij - lse_i) : 0,    P_i,sink = exp(sink_h - lse_i)
    d sink_h = -sum_{b, i} P_i,sink D'_i

A gradient of ``lse`` (``dlse``) enters as ``D'_i = D_i - dlse_i`` in ``dS`` (and ``d sink``).

A row with no allowed key has output 0 and ``lse = -inf`` (flash-attn leaves such rows
undefined or reports lse = +inf; torch SDPA gives NaN for an all-False bool mask row).

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
from .inputs import validate_softcap as _check_softcap
from .masking import check_causal_align, check_window

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
    q: ArrayLike, k: ArrayLike, v: ArrayLike, ndim: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [.., N, H, d], k [.., Nk, H_kv, d], v [.., Nk, H_kv, dv] with H a multiple of H_kv."""
    q = _as_float_tensor("q", q, ndim)
    k = _as_float_tensor("k", k, ndim)
    v = _as_float_tensor("v", v, ndim)
    lead = tuple(q.shape[:-3])
    H, d = q.shape[-2], q.shape[-1]
    Hkv = k.shape[-2]
    if tuple(k.shape[:-3]) != lead or k.shape[-1] != d or Hkv <= 0 or H % Hkv:
        raise ValueError(
            f"k must have shape [{'B, ' if ndim == 4 else ''}Nk, H_kv, d={d}] with H={H} a multiple of H_kv "
            f"(and q's batch), got {tuple(k.shape)}"
        )
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v must have shape [{', '.join(map(str, k.shape[:-1]))}, dv], got {tuple(v.shape)}")
    if min(q.shape) <= 0 or min(v.shape[-2:]) <= 0 or (ndim == 4 and k.shape[1] <= 0):
        raise ValueError("q, k and v must have no empty dimension")
    return q, k, v


def _check_align(causal_align: Any) -> bool:
    """True for top-left alignment (the one alignment validator, :func:`fagen.masking.check_causal_align`)."""
    return check_causal_align(causal_align) == "top_left"


def _broadcast(name: str, x: Optional[ArrayLike], shape: tuple[int, ...], *, boolean: bool,
               device: torch.device) -> Optional[torch.Tensor]:
    """``x`` broadcast (a view, nothing materialised) to ``shape``; bool or floating."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if boolean and x.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype bool (True = take part), got {x.dtype}")
    if not boolean and not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    try:
        return x.to(device).expand(shape)
    except RuntimeError:
        raise ValueError(f"{name} must be broadcastable to {list(shape)}, got {tuple(x.shape)}") from None


def _check_slopes(alibi_slopes: Optional[ArrayLike], B: int, H: int, device: torch.device) -> Optional[torch.Tensor]:
    """ALiBi slopes as float64 [B, H]."""
    if alibi_slopes is None:
        return None
    s = torch.from_numpy(alibi_slopes) if isinstance(alibi_slopes, np.ndarray) else alibi_slopes
    if not isinstance(s, torch.Tensor) or not s.is_floating_point():
        raise TypeError(f"alibi_slopes must be a floating torch.Tensor [H] or [B, H], got {type(s).__name__} "
                        f"{getattr(s, 'dtype', '')}")
    if tuple(s.shape) == (H,):
        s = s[None, :].expand(B, H)
    elif tuple(s.shape) != (B, H):
        raise ValueError(f"alibi_slopes must have shape [H={H}] or [B={B}, H={H}], got {tuple(s.shape)}")
    return s.detach().to(device=device, dtype=torch.float64)


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


def _softmax(
    s: torch.Tensor, allowed: torch.Tensor, lse: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, P)`` of the final scores ``s`` in float64; ``lse`` is recomputed unless given.

    NaN flows like torch's: a NaN score on an allowed pair makes the row's lse and P NaN
    (masked pairs never contribute, whatever they hold); a row whose allowed scores are all
    ``-inf``, or that has a ``+inf`` score, has no softmax (NaN). Only a row with no allowed
    key (``lse = -inf``) is "fully masked": P = 0.
    """
    # The row's own softmax, stable at any magnitude: P = exp(s - m) / l with m the row's maximum
    # and lse = m + log l (exp(s - lse) alone is not: past |s| ~ 2^53 float64 rounds log l away).
    sm = s.masked_fill(~allowed, -math.inf)
    m = sm.amax(dim=-1) if sm.shape[-1] else torch.full(sm.shape[:-1], -math.inf, dtype=s.dtype, device=s.device)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(sm - m_safe[..., None])
    l_ = e.sum(dim=-1)
    own = m_safe + torch.log(l_)  # -inf on empty rows; NaN / inf rows below
    has_key = allowed.any(dim=-1).expand_as(own)
    undefined = (has_key & torch.isneginf(own)) | torch.isposinf(own) | torch.isnan(m)
    own = torch.where(undefined, torch.full_like(own, math.nan), own)
    if lse is None:
        lse = own
    dead = torch.isneginf(lse)  # fully masked rows
    lse_safe = torch.where(dead, torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe[..., None])
    # a given lse that is the row's own up to float64 rounding: P from the scores (exact at any size)
    same = torch.isfinite(lse) & ((lse - own).abs() <= 4 * torch.finfo(torch.float64).eps * own.abs())
    p = torch.where(same[..., None], e / l_[..., None], p)
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
    window_size: tuple[int, int] = (-1, -1),
    causal_align: str = "bottom_right",
) -> torch.Tensor:
    """Return the allowed-pairs matrix ``M`` as bool ``[B, 1, Nq, Nk]`` (True = allowed).

    With ``shift = Nk - Nq`` (``causal_align="bottom_right"``, flash-attn >= 2.1) or 0
    (``"top_left"``, torch SDPA's ``is_causal``): ``M[b, 0, i, j] = key_padding_mask[b, j]``
    and (not causal or ``j <= i + shift``) and, for ``window_size = (l, r)``, (``l < 0`` or
    ``j >= i + shift - l``) and (``r < 0`` or ``j <= i + shift + r``). This is the single
    definition of the structural masking rules used by every function in this module (an
    ``attn_mask`` is and-ed in per head).
    """
    for name, val in (("B", B), ("Nq", Nq), ("Nk", Nk)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or int(val) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    B, Nq, Nk = int(B), int(Nq), int(Nk)
    left, right = check_window(window_size)
    shift = 0 if _check_align(causal_align) else Nk - Nq
    if device is None:
        device = key_padding_mask.device if isinstance(key_padding_mask, torch.Tensor) else "cpu"
    allowed = torch.ones(B, 1, Nq, Nk, dtype=torch.bool, device=device)
    i = torch.arange(Nq, device=device)[:, None]
    j = torch.arange(Nk, device=device)[None, :]
    if causal:
        allowed = allowed & (j <= i + shift)
    if left >= 0:
        allowed = allowed & (j >= i + shift - left)
    if right >= 0:
        allowed = allowed & (j <= i + shift + right)
    if key_padding_mask is not None:
        kpm = _as_bool_tensor("key_padding_mask", key_padding_mask, (B, Nk), torch.device(device))
        allowed = allowed & kpm[:, None, None, :]
    return allowed


class _Problem:
    """One fixed-length problem: validated inputs and features (float64 on q's device)."""

    def __init__(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool, key_padding_mask: Any,
                 keep_mask: Any, dropout_p: float, softmax_scale: Any, window_size: Any, softcap: Any,
                 alibi_slopes: Any, attn_mask: Any, attn_bias: Any, causal_align: Any, sinks: Any = None) -> None:
        q, k, v = _check_qkv(q, k, v)
        self.q, self.k, self.v = q, k, v
        B, Nq, H, d = q.shape
        Nk, Hkv = k.shape[1], k.shape[2]
        self.B, self.Nq, self.Nk, self.H, self.Hkv, self.d = B, Nq, Nk, H, Hkv, d
        self.group = H // Hkv
        self.scale = _check_scale(softmax_scale, d)
        self.softcap = _check_softcap(softcap)
        dev = self.dev = q.device
        full = (B, H, Nq, Nk)
        self.zscale = _dropout_scale(keep_mask, dropout_p, full, dev)
        self.shift = 0 if _check_align(causal_align) else Nk - Nq
        allowed = mask_matrix(B, Nq, Nk, causal=causal, key_padding_mask=key_padding_mask, device=dev,
                              window_size=window_size, causal_align=causal_align)
        am = _broadcast("attn_mask", attn_mask, full, boolean=True, device=dev)
        self.allowed = allowed if am is None else allowed & am
        self.bias = _broadcast("attn_bias", attn_bias, full, boolean=False, device=dev)
        self.slopes = _check_slopes(alibi_slopes, B, H, dev)
        self.sinks = None if sinks is None else _as_float_tensor("sinks", sinks, 1).to(dev)
        if self.sinks is not None and tuple(self.sinks.shape) != (H,):
            raise ValueError(f"sinks must have shape [H] = [{H}], got {tuple(self.sinks.shape)}")

    def with_sink(self, lse: torch.Tensor) -> torch.Tensor:
        """The rows' lse [B, H, Nq] over the scores, with the sink column added (logaddexp)."""
        if self.sinks is None:
            return lse
        return torch.logaddexp(lse, self.sinks[None, :, None].expand_as(lse))

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """[B, Nk, H_kv, x] -> [B, Nk, H, x] (q head h reads kv head h // g)."""
        return t if self.group == 1 else t.repeat_interleave(self.group, dim=2)

    def reduce_kv(self, t: torch.Tensor) -> torch.Tensor:
        """[B, Nk, H, x] -> [B, Nk, H_kv, x]: the sum over each kv head's q heads."""
        if self.group == 1:
            return t
        B, Nk, _, X = t.shape
        return t.reshape(B, Nk, self.Hkv, self.group, X).sum(dim=3)

    def scores(self, q64: torch.Tensor, k64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s_raw, s)``: ``s_raw = scale Q K^T`` and the final scores (softcap, ALiBi, bias)."""
        s_raw = self.scale * torch.einsum("bihd,bjhd->bhij", q64, k64)
        s = self.softcap * torch.tanh(s_raw / self.softcap) if self.softcap > 0 else s_raw
        if self.slopes is not None:
            i = torch.arange(self.Nq, device=self.dev, dtype=torch.float64)[:, None]
            j = torch.arange(self.Nk, device=self.dev, dtype=torch.float64)[None, :]
            s = s - self.slopes[:, :, None, None] * (i + self.shift - j).abs()
        if self.bias is not None:
            s = s + self.bias.to(torch.float64)
        return s_raw, s


def _forward_fixed(pr: _Problem) -> tuple[torch.Tensor, torch.Tensor]:
    q64 = pr.q.detach().to(torch.float64)
    k64, v64 = (pr.expand_kv(t.detach().to(torch.float64)) for t in (pr.k, pr.v))
    _, s = pr.scores(q64, k64)
    lse, p = _softmax(s, pr.allowed)
    if pr.sinks is not None:  # the sink column joins the normalisation only
        lse_all = pr.with_sink(lse)
        p = p * torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.exp(lse - lse_all))[..., None]
        lse = lse_all
    pdrop = p if pr.zscale is None else p * pr.zscale
    return _pair_sum(pdrop, v64, pr.allowed), lse


def _backward_fixed(pr: _Problem, do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                    dlse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv, dS [B, H, Nq, Nk], dsinks [H] or None)."""
    q64 = pr.q.detach().to(torch.float64)
    k64, v64 = (pr.expand_kv(t.detach().to(torch.float64)) for t in (pr.k, pr.v))
    do64, o64, lse64 = (t.detach().to(device=pr.dev, dtype=torch.float64) for t in (do, o, lse))
    s_raw, s = pr.scores(q64, k64)
    _, p = _softmax(s, pr.allowed, lse=lse64)
    zscale = pr.zscale
    pdrop = p if zscale is None else p * zscale
    allowed = pr.allowed
    allowed_t = allowed.transpose(-1, -2)
    dv_ = _pair_sum(pdrop.transpose(-1, -2), do64, allowed_t)
    dp = torch.einsum("bihd,bjhd->bhij", do64, v64)
    if zscale is not None:
        dp = torch.where(zscale > 0, dp * zscale, torch.zeros_like(dp))  # a dropped pair has dP = 0
    D = torch.einsum("bihd,bihd->bhi", do64, o64)
    if dlse is not None:
        D = D - dlse.detach().to(device=pr.dev, dtype=torch.float64)
    dsinks = None
    if pr.sinks is not None:
        dsinks = -(torch.exp(pr.sinks[None, :, None] - lse64) * D).sum(dim=(0, 2))
    live = allowed & ~torch.isneginf(lse64)[..., None]  # pairs that take part
    ds = torch.where(live, p * (dp - D[..., None]), torch.zeros_like(p))
    ds_raw = ds
    if pr.softcap > 0:
        t = torch.tanh(s_raw / pr.softcap)
        ds_raw = torch.where(live, ds * (1 - t * t), torch.zeros_like(ds))
    dq = pr.scale * _pair_sum(ds_raw, k64, live)
    dk = pr.scale * _pair_sum(ds_raw.transpose(-1, -2), q64, live.transpose(-1, -2))
    return dq, pr.reduce_kv(dk), pr.reduce_kv(dv_), ds, dsinks


def _reduce_to(full: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum a [B, H, Nq, Nk] gradient down to a tensor broadcast from ``shape``."""
    out = full
    extra = out.dim() - len(shape)
    if extra > 0:
        out = out.sum(dim=tuple(range(extra)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and out.shape[i] != 1)
    if dims:
        out = out.sum(dim=dims, keepdim=True)
    return out.reshape(shape)


def _check_cu(name: str, cu: ArrayLike, total: int) -> list[int]:
    if isinstance(cu, np.ndarray):
        cu = torch.from_numpy(cu)
    if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 2:
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor [B + 1], got "
                        f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
    vals = [int(x) for x in cu.tolist()]
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])) or vals[-1] != total:
        raise ValueError(f"{name} must start at 0, never decrease and end at the token count {total}, got {vals}")
    return vals


def _varlen_slices(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any) -> list[tuple[int, int, int, int]]:
    if cu_seqlens_k is None or cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    cq = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), got {len(cq)} and {len(ck)}")
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _per_seq(x: Any, name: str, b: int, lq: int, lk: int, B: int, H: int, mq: int, mk: int, *, boolean: bool,
             device: torch.device) -> Any:
    """Sequence b's [1, H, lq, lk] view of a [B, H, max_q, max_k]-broadcastable tensor."""
    if x is None:
        return None
    full = _broadcast(name, x, (B, H, mq, mk), boolean=boolean, device=device)
    return full[b:b + 1, :, :lq, :lk]


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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[ArrayLike] = None,
    attn_mask: Optional[ArrayLike] = None,
    attn_bias: Optional[ArrayLike] = None,
    causal_align: str = "bottom_right",
    cu_seqlens_q: Optional[ArrayLike] = None,
    cu_seqlens_k: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention forward: return ``(o [B, Nq, H, dv], lse [B, H, Nq])`` (varlen:
    ``o [total_q, H, dv]``, ``lse [H, total_q]``); the module docstring states the equations.
    ``keep_mask`` is required when ``dropout_p > 0``; ``sinks`` ``[H]``: attention sinks.
    """
    kw = dict(causal=causal, key_padding_mask=key_padding_mask, keep_mask=keep_mask, dropout_p=dropout_p,
              softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
              attn_mask=attn_mask, attn_bias=attn_bias, causal_align=causal_align, sinks=sinks)
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return _forward_fixed(_Problem(q, k, v, **kw))
    q, k, v = _check_qkv(q, k, v, ndim=3)
    outs, lses = [], []
    for _, _, o_, l_ in _varlen_each(q, k, v, None, cu_seqlens_q, cu_seqlens_k, kw, backward=False):
        outs.append(o_)
        lses.append(l_)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def _varlen_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grads: Optional[tuple[torch.Tensor, ...]],
                 cu_seqlens_q: Any, cu_seqlens_k: Any, kw: dict[str, Any], *, backward: bool) -> Any:
    """Per sequence: forward -> (lq, lk, o [lq, H, dv], lse [H, lq]); backward (``grads`` = do, o,
    lse [H, total_q]) -> (lq, lk, (dq, dk, dv), dS [1, H, lq, lk])."""
    if kw["key_padding_mask"] is not None:
        raise ValueError("key_padding_mask is not taken with cu_seqlens (packed sequences have no padding)")
    spans = _varlen_slices(q, k, cu_seqlens_q, cu_seqlens_k)
    B, H, Hkv, dv = len(spans), q.shape[1], k.shape[1], v.shape[2]
    mq = max(e - s for s, e, _, _ in spans)
    mk = max(e - s for _, _, s, e in spans)
    dev = q.device
    slopes = kw["alibi_slopes"]
    if slopes is not None:
        slopes = _check_slopes(slopes, B, H, dev)
    sinks = kw.get("sinks")
    if sinks is not None:
        sinks = _as_float_tensor("sinks", sinks, 1).to(dev)
    for b, (q0, q1, k0, k1) in enumerate(spans):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:  # no query, or no key: rows fully masked (lse = the sink, if any)
            o_ = torch.zeros(lq, H, dv, dtype=torch.float64, device=dev)
            if backward:
                dsk = None
                if sinks is not None:  # o = 0, P_sink = 1: d sink = sum of dlse over the rows
                    dl = grads[3]
                    dsk = (torch.zeros(H, dtype=torch.float64, device=dev) if dl is None
                           else dl[:, q0:q1].to(torch.float64).sum(dim=1))
                yield lq, lk, (torch.zeros(lq, H, q.shape[2], dtype=torch.float64, device=dev),
                               torch.zeros(lk, Hkv, k.shape[2], dtype=torch.float64, device=dev),
                               torch.zeros(lk, Hkv, dv, dtype=torch.float64, device=dev), dsk), None
            else:
                lse_ = torch.full((H, lq), -math.inf, dtype=torch.float64, device=dev)
                if sinks is not None:
                    lse_ = sinks.to(torch.float64)[:, None].expand(H, lq).clone()
                yield lq, lk, o_, lse_
            continue
        one = dict(kw)
        one["key_padding_mask"] = None
        one["keep_mask"] = (None if kw["keep_mask"] is None else
                            _as_bool_tensor("keep_mask", kw["keep_mask"], (B, H, mq, mk), dev)[b:b + 1, :, :lq, :lk])
        one["attn_mask"] = _per_seq(kw["attn_mask"], "attn_mask", b, lq, lk, B, H, mq, mk, boolean=True, device=dev)
        one["attn_bias"] = _per_seq(kw["attn_bias"], "attn_bias", b, lq, lk, B, H, mq, mk, boolean=False, device=dev)
        one["alibi_slopes"] = None if slopes is None else slopes[b:b + 1]
        pr = _Problem(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **one)
        if not backward:
            o_, lse_ = _forward_fixed(pr)
            yield lq, lk, o_[0], lse_[0]
        else:
            do, o, lse, dlse = grads
            dq, dk, dv_, ds, dsk = _backward_fixed(pr, do[None, q0:q1], o[None, q0:q1], lse[None, :, q0:q1],
                                                   None if dlse is None else dlse[None, :, q0:q1])
            yield lq, lk, (dq[0], dk[0], dv_[0], dsk), ds


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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[ArrayLike] = None,
    attn_mask: Optional[ArrayLike] = None,
    attn_bias: Optional[ArrayLike] = None,
    causal_align: str = "bottom_right",
    cu_seqlens_q: Optional[ArrayLike] = None,
    cu_seqlens_k: Optional[ArrayLike] = None,
    bias_requires_grad: bool = False,
    sinks: Optional[ArrayLike] = None,
    dlse: Optional[ArrayLike] = None,
) -> tuple[torch.Tensor, ...]:
    """Float64 attention backward from the equations (no autograd): return ``(dq, dk, dv)``,
    plus ``dbias`` (float64, ``attn_bias``'s shape: dS summed over its broadcast dims) when
    ``bias_requires_grad``. ``o`` and ``lse`` are the forward outputs (``lse`` may be float32,
    as kernels store it); the module docstring states the equations. With ``sinks`` (``[H]``) the
    result ends with ``dsinks`` (float64 ``[H]``); ``dlse`` (lse's shape) is a gradient of lse.
    """
    kw = dict(causal=causal, key_padding_mask=key_padding_mask, keep_mask=keep_mask, dropout_p=dropout_p,
              softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
              attn_mask=attn_mask, attn_bias=attn_bias, causal_align=causal_align, sinks=sinks)
    if bias_requires_grad and attn_bias is None:
        raise ValueError("bias_requires_grad needs attn_bias")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    nd = 3 if varlen else 4
    q, k, v = _check_qkv(q, k, v, ndim=nd)
    do = _as_float_tensor("do", do, nd)
    o = _as_float_tensor("o", o, nd)
    lse = _as_float_tensor("lse", lse, nd - 1)
    if dlse is not None:
        dlse = _as_float_tensor("dlse", dlse, nd - 1)
        if tuple(dlse.shape) != tuple(lse.shape):
            raise ValueError(f"dlse must have lse's shape {tuple(lse.shape)}, got {tuple(dlse.shape)}")
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    expected = {"do": (do, out_shape), "o": (o, out_shape), "lse": (lse, lse_shape)}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    tail: tuple[torch.Tensor, ...] = ()
    if not varlen:
        pr = _Problem(q, k, v, **kw)
        dq, dk, dv_, ds, dsk = _backward_fixed(pr, do, o, lse, dlse)
        tail = () if dsk is None else (dsk,)
        if not bias_requires_grad:
            return (dq, dk, dv_) + tail
        return (dq, dk, dv_, _reduce_to(ds, tuple(torch.as_tensor(attn_bias).shape))) + tail
    dqs, dks, dvs, dss, dsks = [], [], [], [], []
    for lq, lk, (dq, dk, dv_, dsk), ds in _varlen_each(q, k, v, (do, o, lse, dlse), cu_seqlens_q, cu_seqlens_k,
                                                       kw, backward=True):
        dqs.append(dq)
        dks.append(dk)
        dvs.append(dv_)
        dss.append((lq, lk, ds))
        dsks.append(dsk)
    grads = (torch.cat(dqs), torch.cat(dks), torch.cat(dvs))
    if sinks is not None:
        tail = (torch.stack(dsks).sum(dim=0),)
    if not bias_requires_grad:
        return grads + tail
    mq, mk = max(lq for lq, _, _ in dss), max(lk for _, lk, _ in dss)
    full = torch.zeros(len(dss), q.shape[1], mq, mk, dtype=torch.float64, device=q.device)
    for b, (lq, lk, ds) in enumerate(dss):
        if ds is not None:
            full[b, :, :lq, :lk] = ds[0]
    return grads + (_reduce_to(full, tuple(torch.as_tensor(attn_bias).shape)),) + tail


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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[ArrayLike] = None,
    attn_mask: Optional[ArrayLike] = None,
    attn_bias: Optional[torch.Tensor] = None,
    causal_align: str = "bottom_right",
    cu_seqlens_q: Optional[ArrayLike] = None,
    cu_seqlens_k: Optional[ArrayLike] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plain, autograd-able PyTorch attention (every feature above); returns ``o`` only.
    ``sinks`` ``[H]``: the sink column is appended to the scores before the softmax and dropped
    after it (autograd gives its gradient).

    Computes ``softmax(softcap(scale Q K^T) + alibi + bias + mask) o Z / (1 - p) @ V`` in the
    input dtype, or in float64 when ``upcast`` (the result is then float64). It measures "the
    error of plain PyTorch attention in the same dtype" for flash-attn's test criterion, and
    ``attn_bias`` receives its gradient through autograd. A row with no allowed key gives a
    zero output row and zero gradients (never NaN): its scores are replaced by zeros before
    the softmax and its probabilities by 0 after.
    """
    kw = dict(causal=causal, key_padding_mask=key_padding_mask, keep_mask=keep_mask, dropout_p=dropout_p,
              softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
              attn_mask=attn_mask, attn_bias=attn_bias, causal_align=causal_align, sinks=sinks)
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return _torch_fixed(q, k, v, upcast=upcast, **kw)
    q, k, v = _check_qkv(q, k, v, ndim=3)
    if key_padding_mask is not None:
        raise ValueError("key_padding_mask is not taken with cu_seqlens (packed sequences have no padding)")
    spans = _varlen_slices(q, k, cu_seqlens_q, cu_seqlens_k)
    B, H = len(spans), q.shape[1]
    mq = max(e - s for s, e, _, _ in spans)
    mk = max(e - s for _, _, s, e in spans)
    dev = q.device
    slopes = None if alibi_slopes is None else _check_slopes(alibi_slopes, B, H, dev)
    outs = []
    for b, (q0, q1, k0, k1) in enumerate(spans):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            dt = torch.float64 if upcast else v.dtype
            outs.append(torch.zeros(lq, H, v.shape[2], dtype=dt, device=dev) + 0 * v.sum().to(dt)
                        + (0 * sinks.sum().to(dt) if sinks is not None else 0))
            continue
        one = dict(kw)
        one["keep_mask"] = (None if keep_mask is None else
                            _as_bool_tensor("keep_mask", keep_mask, (B, H, mq, mk), dev)[b:b + 1, :, :lq, :lk])
        one["attn_mask"] = _per_seq(attn_mask, "attn_mask", b, lq, lk, B, H, mq, mk, boolean=True, device=dev)
        one["attn_bias"] = _per_seq(attn_bias, "attn_bias", b, lq, lk, B, H, mq, mk, boolean=False, device=dev)
        one["alibi_slopes"] = None if slopes is None else slopes[b:b + 1]
        outs.append(_torch_fixed(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], upcast=upcast, **one)[0])
    return torch.cat(outs, dim=0)


def _torch_fixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, upcast: bool, causal: bool,
                 key_padding_mask: Any, keep_mask: Any, dropout_p: float, softmax_scale: Any, window_size: Any,
                 softcap: Any, alibi_slopes: Any, attn_mask: Any, attn_bias: Any, causal_align: Any,
                 sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    q, k, v = _check_qkv(q, k, v)
    B, Nq, H, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    scale = _check_scale(softmax_scale, d)
    cap = _check_softcap(softcap)
    dev = q.device
    p = check_dropout_p(dropout_p)
    if keep_mask is None and p > 0.0:
        raise ValueError("keep_mask is required when dropout_p > 0")
    if upcast:
        q, k, v = q.to(torch.float64), k.to(torch.float64), v.to(torch.float64)
    if H != Hkv:
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
    full = (B, H, Nq, Nk)
    allowed = mask_matrix(B, Nq, Nk, causal=causal, key_padding_mask=key_padding_mask, device=dev,
                          window_size=window_size, causal_align=causal_align)
    am = _broadcast("attn_mask", attn_mask, full, boolean=True, device=dev)
    if am is not None:
        allowed = allowed & am
    row_any = allowed.any(dim=-1, keepdim=True)  # [B, H or 1, Nq, 1]

    scores = torch.einsum("bihd,bjhd->bhij", q * scale, k)
    if cap > 0:
        scores = cap * torch.tanh(scores / cap)
    slopes = _check_slopes(alibi_slopes, B, H, dev)
    if slopes is not None:
        shift = 0 if _check_align(causal_align) else Nk - Nq
        i = torch.arange(Nq, device=dev)[:, None]
        j = torch.arange(Nk, device=dev)[None, :]
        scores = scores - (slopes[:, :, None, None] * (i + shift - j).abs()).to(scores.dtype)
    bias = _broadcast("attn_bias", attn_bias, full, boolean=False, device=dev)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if sinks is not None:  # the sink column: appended, softmax, dropped (a row with no key: all sink)
        scores = scores.masked_fill(~allowed, -math.inf)
        col = sinks.to(scores.dtype)[None, :, None, None].expand(B, H, Nq, 1)
        attn = torch.softmax(torch.cat([scores.expand(B, H, Nq, Nk), col], dim=-1), dim=-1)[..., :Nk]
    else:
        scores = scores.masked_fill(~allowed, -math.inf).masked_fill(~row_any, 0.0)
        attn = torch.softmax(scores, dim=-1).masked_fill(~row_any, 0.0)
    if keep_mask is not None:
        z = _as_bool_tensor("keep_mask", keep_mask, full, dev)
        attn = attn.masked_fill(~z, 0.0) / (1.0 - p)
    return torch.einsum("bhij,bjhd->bihd", attn.to(v.dtype), v)
