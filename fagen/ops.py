"""Autograd ops: ``flash_attn_func``, ``flash_attn_varlen_func`` and ``scaled_dot_product_attention``.

All three are thin wrappers over two ``torch.library`` custom ops, so eager mode,
autograd and ``torch.compile(fullgraph=True)`` all see the same opaque kernels:

* ``fagen::fwd(q, k, v, key_padding_mask, dropout_p, softmax_scale, causal, window_left=-1,
  window_right=-1, softcap=0., alibi_slopes=None, attn_mask=None, attn_bias=None,
  causal_align="bottom_right", cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
  max_seqlen_k=None, deterministic=False) -> (o, lse, rng_state)``
* ``fagen::bwd(do, q, k, v, o, lse, key_padding_mask, dropout_p, softmax_scale, causal,
  rng_state, <the same options>, bias_requires_grad=False) -> (dq, dk, dv, dbias)``
  (``dbias`` is empty unless ``bias_requires_grad``).

Layout of the ops: q, o [B, Nq, H, d]; k, v [B, Nk, H_kv, d]; lse float32 [B, H, Nq]
(packed: q [total_q, H, d], lse [H, total_q]); see :mod:`fagen.functional`. ``rng_state`` is
an int64 CPU tensor ``[seed, offset]``: the Philox key of the dropout keep-mask, drawn by
:func:`draw_rng_state` from torch's default CPU generator when ``dropout_p > 0`` (zeros
otherwise), so ``torch.manual_seed`` reproduces a run. Autograd saves q, k, v, o, lse,
rng_state and the optional inputs -- never an N x N tensor -- and the backward replays the
same mask. The draw happens inside ``fagen::fwd`` (tagged ``nondeterministic_seeded``), so a
compiled graph draws a fresh state on every call instead of baking one in as a constant.
"""
import inspect
import math
from typing import Any, Optional, Union

import torch

from . import functional as F
from .errors import FagenError, InputError, InputTypeError, check_dropout_p
from .inputs import validate_softcap, validate_window_size
from .reference import mask_matrix

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention", "draw_rng_state",
           "attn_probs"]

Tensor = torch.Tensor


# --------------------------------------------------------------------------- helpers
def draw_rng_state() -> Tensor:
    """A fresh dropout key: int64 CPU tensor ``[seed, offset]``, each in ``[0, 2**63)``.

    Drawn from torch's default CPU generator (for CPU and CUDA inputs alike), so
    ``torch.manual_seed(s)`` followed by the same calls reproduces every mask.
    """
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, generator=torch.default_generator)


def _lc(t: Optional[Tensor]) -> Optional[Tensor]:
    """The kernels need stride 1 in the head dimension; other strides pass through."""
    return t if t is None or t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


def _seed_offset(rng_state: Tensor) -> tuple[int, int]:
    seed, offset = (int(x) for x in rng_state.tolist())
    return seed, offset


def _custom_op_kwargs(*tags: torch.Tag) -> dict[str, Any]:
    """``tags=`` where this torch's ``custom_op`` accepts it (2.5+)."""
    return {"tags": tags} if "tags" in inspect.signature(torch.library.custom_op).parameters else {}


def _options(window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
             attn_mask: Optional[Tensor], attn_bias: Optional[Tensor], causal_align: str,
             cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: Optional[int],
             max_seqlen_k: Optional[int]) -> dict[str, Any]:
    return dict(window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                attn_mask=attn_mask, attn_bias=attn_bias, causal_align=causal_align, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- fagen::fwd
@torch.library.custom_op("fagen::fwd", mutates_args=(),
                         **_custom_op_kwargs(torch.Tag.nondeterministic_seeded))
def _fwd(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dropout_p: float,
         softmax_scale: Optional[float], causal: bool, window_left: int = -1, window_right: int = -1,
         softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
         attn_bias: Optional[Tensor] = None, causal_align: str = "bottom_right",
         cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
         max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
         deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    rng_state = draw_rng_state() if dropout_p > 0 else torch.zeros(2, dtype=torch.int64)
    seed, offset = _seed_offset(rng_state)
    o, lse = F.attention_forward(
        _lc(q), _lc(k), _lc(v), causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
        softmax_scale=softmax_scale, seed=seed, offset=offset,
        **_options(window_left, window_right, softcap, alibi_slopes, attn_mask, attn_bias, causal_align,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return o, lse.to(_lse_dtype(q)), rng_state


@_fwd.register_fake
def _fwd_fake(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dropout_p: float,
              softmax_scale: Optional[float], causal: bool, window_left: int = -1, window_right: int = -1,
              softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
              attn_bias: Optional[Tensor] = None, causal_align: str = "bottom_right",
              cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
              max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
              deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    p = F.validate(_lc(q), _lc(k), _lc(v), check_values=False, causal=causal, key_padding_mask=key_padding_mask,
                   dropout_p=dropout_p, softmax_scale=softmax_scale,
                   **_options(window_left, window_right, softcap, alibi_slopes, attn_mask, attn_bias, causal_align,
                              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    o = q.new_empty(q.shape)
    lse = q.new_empty(p.lse_shape, dtype=_lse_dtype(q))
    rng_state = q.new_empty((2,), dtype=torch.int64, device="cpu")
    return o, lse, rng_state


# --------------------------------------------------------------------------- fagen::bwd
@torch.library.custom_op("fagen::bwd", mutates_args=())
def _bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
         key_padding_mask: Optional[Tensor], dropout_p: float, softmax_scale: Optional[float],
         causal: bool, rng_state: Tensor, window_left: int = -1, window_right: int = -1,
         softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
         attn_bias: Optional[Tensor] = None, causal_align: str = "bottom_right",
         cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
         max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
         deterministic: bool = False, bias_requires_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    seed, offset = _seed_offset(rng_state)
    grads = F.attention_backward(
        _lc(do), _lc(q), _lc(k), _lc(v), _lc(o), lse, causal=causal, key_padding_mask=key_padding_mask,
        dropout_p=dropout_p, softmax_scale=softmax_scale, seed=seed, offset=offset, deterministic=deterministic,
        bias_requires_grad=bias_requires_grad,
        **_options(window_left, window_right, softcap, alibi_slopes, attn_mask, attn_bias, causal_align,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    dbias = grads[3] if bias_requires_grad else q.new_empty((0,))
    return grads[0], grads[1], grads[2], dbias


@_bwd.register_fake
def _bwd_fake(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
              key_padding_mask: Optional[Tensor], dropout_p: float, softmax_scale: Optional[float],
              causal: bool, rng_state: Tensor, window_left: int = -1, window_right: int = -1,
              softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
              attn_bias: Optional[Tensor] = None, causal_align: str = "bottom_right",
              cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
              max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
              deterministic: bool = False, bias_requires_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    F.validate(_lc(q), _lc(k), _lc(v), check_values=False, causal=causal, key_padding_mask=key_padding_mask,
               dropout_p=dropout_p, softmax_scale=softmax_scale,
               **_options(window_left, window_right, softcap, alibi_slopes, attn_mask, attn_bias, causal_align,
                          cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    dbias = attn_bias.new_empty(attn_bias.shape) if bias_requires_grad and attn_bias is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


# --------------------------------------------------------------------------- autograd
_OPTION_NAMES = ("window_left", "window_right", "softcap", "alibi_slopes", "attn_mask", "attn_bias", "causal_align",
                 "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "deterministic")
_FWD_PARAMS = tuple(inspect.signature(_fwd_fake).parameters)
_TENSOR_OPTIONS = ("alibi_slopes", "attn_mask", "attn_bias", "cu_seqlens_q", "cu_seqlens_k")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    args = dict(zip(_FWD_PARAMS, inputs))
    for name in _FWD_PARAMS[len(inputs):]:  # defaults not passed
        args[name] = inspect.signature(_fwd_fake).parameters[name].default
    o, lse, rng_state = output
    ctx.save_for_backward(args["q"], args["k"], args["v"], o, lse, rng_state, args["key_padding_mask"],
                          *(args[n] for n in _TENSOR_OPTIONS))
    ctx.scalars = {n: args[n] for n in ("dropout_p", "softmax_scale", "causal") + _OPTION_NAMES
                   if n not in _TENSOR_OPTIONS}
    ctx.bias_index = _FWD_PARAMS.index("attn_bias")
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(lse, rng_state)


def _backward(ctx: Any, do: Tensor, _dlse: Optional[Tensor], _drng: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    q, k, v, o, lse, rng_state, key_padding_mask, *tensor_opts = ctx.saved_tensors
    s = ctx.scalars
    opts = dict(zip(_TENSOR_OPTIONS, tensor_opts))
    bias_grad = opts["attn_bias"] is not None and ctx.needs_input_grad[ctx.bias_index]
    dq, dk, dv, dbias = _bwd(do, q, k, v, o, lse, key_padding_mask, s["dropout_p"], s["softmax_scale"], s["causal"],
                             rng_state, s["window_left"], s["window_right"], s["softcap"], opts["alibi_slopes"],
                             opts["attn_mask"], opts["attn_bias"], s["causal_align"], opts["cu_seqlens_q"],
                             opts["cu_seqlens_k"], s["max_seqlen_q"], s["max_seqlen_k"], s["deterministic"], bias_grad)
    grads: list[Optional[Tensor]] = [dq, dk, dv] + [None] * (ctx.n_inputs - 3)
    if bias_grad:
        grads[ctx.bias_index] = dbias
    return tuple(grads)


_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- scalar validation
_check_scale = F.validate_softmax_scale  # None, or finite in float32
_check_bool = F.validate_flag  # Python bool or numpy bool_


def _check_tensors(**tensors: Any) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise InputTypeError(name, "a torch.Tensor", type(t).__name__)


def _call(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor], dropout_p: Any,
          softmax_scale: Any, causal: Any, window_size: Any = (-1, -1), softcap: Any = 0.0,
          alibi_slopes: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
          attn_bias: Optional[Tensor] = None, causal_align: str = "bottom_right",
          cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
          max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
          deterministic: Any = False) -> tuple[Tensor, Tensor, Tensor]:
    """Python-side validation of the scalars (so the op gets plain ints/floats/bools), then fagen::fwd."""
    left, right = validate_window_size(window_size)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, torch.SymInt))):
            raise InputError(name, "an int (the longest sequence)", repr(m))
    return _fwd(q, k, v, key_padding_mask, check_dropout_p(dropout_p), _check_scale(softmax_scale, "softmax_scale"),
                _check_bool("causal", causal), left, right, validate_softcap(softcap), alibi_slopes, attn_mask,
                attn_bias, causal_align, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                _check_bool("deterministic", deterministic))


# --------------------------------------------------------------------------- attention probabilities
def attn_probs(q: Tensor, k: Tensor, lse: Tensor, rng_state: Tensor, *, dropout_p: float = 0.0,
               softmax_scale: Optional[float] = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
               softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
               key_padding_mask: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
               cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
               max_seqlen_k: Optional[int] = None) -> Tensor:
    """flash-attn's ``S_dmask`` for testing: the softmax probabilities [B, H, Nq, Nk] (packed:
    [B, H, max_seqlen_q, max_seqlen_k], zero past each sequence), negated where dropout drops
    the pair. Recomputed in torch from q, k, the forward's lse and rng_state with the masking
    rule of :func:`fagen.reference.mask_matrix` (materialises N x N; no autograd)."""
    with torch.no_grad():
        if cu_seqlens_q is None:
            B, Nq, H, _ = q.shape
            keep = _keep(B, H, Nq, k.shape[1], dropout_p, rng_state)
            return _probs_dense(q, k, lse, keep, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                key_padding_mask, k.shape[1])
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        B, H = len(cq) - 1, q.shape[1]
        out = q.new_zeros((B, H, max_seqlen_q, max_seqlen_k))
        keep_all = _keep(B, H, max_seqlen_q, max_seqlen_k, dropout_p, rng_state)
        for b in range(B):
            nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            if nq == 0 or nk == 0:
                continue  # no pair: zeros
            slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
            keep = None if keep_all is None else keep_all[b:b + 1, :, :nq, :nk]
            out[b, :, :nq, :nk] = _probs_dense(q[cq[b]:cq[b + 1]][None], k[ck[b]:ck[b + 1]][None],
                                               lse[None, :, cq[b]:cq[b + 1]], keep, softmax_scale, causal,
                                               window_size, softcap, slopes, None, max_seqlen_k)[0]
        return out


def _keep(B: int, H: int, Nq: int, Nk: int, dropout_p: float, rng_state: Tensor) -> Optional[Tensor]:
    if dropout_p <= 0 or 0 in (B, H, Nq, Nk):
        return None
    seed, offset = _seed_offset(rng_state)
    return F.dropout_keep_mask(B, H, Nq, Nk, dropout_p, seed=seed, offset=offset)


def _probs_dense(q: Tensor, k: Tensor, lse: Tensor, keep: Optional[Tensor], softmax_scale: Optional[float],
                 causal: bool, window_size: tuple[int, int], softcap: float, alibi_slopes: Optional[Tensor],
                 key_padding_mask: Optional[Tensor], window_norm: int) -> Tensor:
    """One fixed-length problem: q [B, Nq, H, d], k [B, Nk, H_kv, d], lse [B, H, Nq] -> [B, H, Nq, Nk]."""
    B, Nq, H, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    if 0 in (B, H, Nq, Nk):
        return q.new_zeros((B, H, Nq, Nk))
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    s = scale * torch.einsum("bihd,bjhd->bhij", q.to(acc), k.to(acc).repeat_interleave(H // Hkv, dim=2))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:  # -slope * |i + Nk - Nq - j|
        dist = (torch.arange(Nq, device=q.device)[:, None] + (Nk - Nq) - torch.arange(Nk, device=q.device)).abs()
        s = s - alibi_slopes.to(acc).reshape(-1, H)[:, :, None, None] * dist.to(acc)
    left, right = (-1 if w >= window_norm else w for w in window_size)  # flash-attn: a side >= Nk is unbounded
    allowed = mask_matrix(B, Nq, Nk, causal=causal, key_padding_mask=key_padding_mask, device=q.device,
                          window_size=(left, right))
    lse_ = lse.to(acc)[..., None]
    p = torch.where(allowed & torch.isfinite(lse_), torch.exp(s - lse_), torch.zeros_like(s))
    if keep is not None:
        p = torch.where(keep.to(p.device), p, -p)
    return p.to(q.dtype)


# --------------------------------------------------------------------------- public ops
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *,
                    key_padding_mask: Optional[Tensor] = None) -> Union[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """FlashAttention in flash-attn's layout and signature, differentiable.

    Args:
        q: [B, Nq, H, d]; k, v: [B, Nk, H_kv, d] (H a multiple of H_kv: MQA/GQA); float16,
            bfloat16, float32 (float64 where a family implements it), CPU or CUDA; d in 1..256
            (padded internally to a multiple of 8). Any batch/seq/head strides.
        dropout_p: probability of dropping an attention weight (apply it only in training).
        softmax_scale: defaults to ``1 / sqrt(d)``.
        causal: bottom-right aligned (query i sees key j iff ``j <= i + Nk - Nq``), as flash-attn >= 2.1.
        window_size: (left, right), -1 = unbounded: query i sees keys in
            ``[i + Nk - Nq - left, i + Nk - Nq + right]``; causal sets right = 0.
        softcap: > 0 caps the scores: ``softcap * tanh(s / softcap)``; 0 = off.
        alibi_slopes: float32 [H] or [B, H]; adds ``-slope * |i + Nk - Nq - j|`` to the scores.
        deterministic: a backward without order-dependent atomics (bitwise-reproducible dq).
        return_attn_probs: also return ``softmax_lse`` [B, H, Nq] and ``S_dmask`` (see :func:`attn_probs`;
            for testing only: it is N x N).
        key_padding_mask: bool [B, Nk], True = the key takes part (a fagen addition, keyword-only).

    Returns ``out`` [B, Nq, H, d], or ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs``.
    """
    _check_tensors(q=q, k=k, v=v, key_padding_mask=key_padding_mask, alibi_slopes=alibi_slopes)
    want_probs = _check_bool("return_attn_probs", return_attn_probs)
    o, lse, rng_state = _call(q, k, v, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
                              softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                              alibi_slopes=alibi_slopes, deterministic=deterministic)
    if not want_probs:
        return o
    s_dmask = attn_probs(q, k, lse, rng_state, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         key_padding_mask=key_padding_mask)
    return o, lse, s_dmask


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False) -> Union[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """flash-attn's packed-sequence attention, differentiable.

    q: [total_q, H, d], k, v: [total_k, H_kv, d] -- sequence b is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]``; cu_seqlens_q/k: int32 [B + 1] on q's device (0 first,
    non-decreasing, last = total; lengths 0 allowed); max_seqlen_q/k: ints at least every length.
    Causal, window and ALiBi are aligned bottom-right per sequence. The other arguments as
    :func:`flash_attn_func`. Returns ``out`` [total_q, H, d], or ``(out, softmax_lse [H, total_q],
    S_dmask [B, H, max_seqlen_q, max_seqlen_k])`` with ``return_attn_probs``.
    """
    _check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
    want_probs = _check_bool("return_attn_probs", return_attn_probs)
    o, lse, rng_state = _call(q, k, v, key_padding_mask=None, dropout_p=dropout_p, softmax_scale=softmax_scale,
                              causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                              max_seqlen_k=max_seqlen_k, deterministic=deterministic)
    if not want_probs:
        return o
    s_dmask = attn_probs(q, k, lse, rng_state, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k)
    return o, lse, s_dmask


# --------------------------------------------------------------------------- SDPA
_SDPA_NAMES = {"q": "query", "k": "key", "v": "value", "attn_bias": "attn_mask", "causal": "is_causal",
               "softmax_scale": "scale", "causal_align": "is_causal"}


def _renamed(err: FagenError) -> FagenError:
    """An error from the flash layout, naming the SDPA argument instead."""
    name = _SDPA_NAMES.get(getattr(err, "argument", ""), None)
    if name is None:
        return err
    new = type(err)(name, err.expected)
    new.args = (name + str(err)[len(err.argument):],)
    return new


def _layout(lead: tuple[int, ...], what: str) -> str:
    return {0: f"[H, {what}, d]", 1: f"[B, H, {what}, d]"}.get(len(lead), f"[..., H, {what}, d]")


def _sdpa_check(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> None:
    """The shape relations in the caller's [..., H, N, d] layout."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 3:
            raise InputError(name, "at least 3 dims [..., heads, seqlen, head_dim]", f"shape {tuple(t.shape)}")
    lead = tuple(query.shape[:-3])
    Hq, d = query.shape[-3], query.shape[-1]
    Hk = key.shape[-3]
    heads_ok = (Hk and Hq % Hk == 0) if enable_gqa else Hk == Hq
    if tuple(key.shape[:-3]) != lead or key.shape[-1] != d or not heads_ok:
        heads = "H_kv dividing H" if enable_gqa else "H"
        want = ", ".join(map(str, lead + ("H_kv" if enable_gqa else Hq, "Nk", d)))
        hint = "" if enable_gqa or Hk == Hq else " (enable_gqa=True for grouped-query attention)"
        raise InputError("key", f"shape {_layout(lead, 'Nk')} = [{want}] matching query ({heads}){hint}",
                         tuple(key.shape))
    if tuple(value.shape) != tuple(key.shape):
        raise InputError("value", f"the shape of key {tuple(key.shape)} ({_layout(lead, 'Nk')})", tuple(value.shape))


def _sdpa_mask(attn_mask: Tensor, query: Tensor, full: tuple[int, ...]) -> tuple[Optional[Tensor], ...]:
    """(key_padding_mask [B, Nk], attn_mask, attn_bias) in the flattened [B, H, Nq, Nk] problem: a
    bool mask constant over heads and queries is a key-padding mask; other masks keep their strides."""
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise InputTypeError("attn_mask", "a bool mask (True = take part) or a float additive mask", attn_mask.dtype)
    shape = tuple(attn_mask.shape)
    if len(shape) > len(full) or any(s not in (1, n) for s, n in zip(reversed(shape), reversed(full))):
        raise InputError("attn_mask", f"a shape broadcastable to {list(full)}", f"shape {list(shape)}")
    lead, (H, Nq, Nk) = full[:-3], full[-3:]
    padded = (1,) * (len(full) - len(shape)) + shape
    if attn_mask.dtype == torch.bool and padded[-3] == 1 and padded[-2] == 1:
        kpm = attn_mask.reshape(padded).expand(lead + (1, 1, Nk)).reshape(-1, Nk)
        return kpm.contiguous(), None, None
    m = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(query.dtype)
    if len(lead) > 1:  # several leading dims: flattened (a copy only when their strides do not merge)
        m = m.reshape(padded).expand(full).reshape((-1, H, Nq, Nk))
    elif not lead and len(shape) == 3:
        m = m.unsqueeze(0)
    return (None, m, None) if m.dtype == torch.bool else (None, None, m)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with its layout and semantics.

    query [..., H, Nq, d], key/value [..., H_kv, Nk, d] (3-D [H, N, d] included; H_kv = H unless
    ``enable_gqa``) -> [..., H, Nq, d]. ``is_causal`` is top-left aligned as torch's (query i sees
    keys j <= i). ``attn_mask`` broadcastable to [..., H, Nq, Nk]: bool (True = take part) or an
    additive float bias (differentiable), read with its own strides (broadcast dims are stride 0,
    never expanded in memory). It may be combined with ``is_causal`` (torch refuses).
    """
    _check_tensors(query=query, key=key, value=value, attn_mask=attn_mask)
    enable_gqa = _check_bool("enable_gqa", enable_gqa)
    is_causal = _check_bool("is_causal", is_causal)
    _sdpa_check(query, key, value, enable_gqa)
    lead = tuple(query.shape[:-3])
    H, Nq, d = query.shape[-3:]
    Hk, Nk = key.shape[-3], key.shape[-2]
    q4 = query.reshape((-1, H, Nq, d)) if lead else query.unsqueeze(0)
    k4 = key.reshape((-1, Hk, Nk, d)) if lead else key.unsqueeze(0)
    v4 = value.reshape((-1, Hk, Nk, d)) if lead else value.unsqueeze(0)
    kpm = mask = bias = None
    if attn_mask is not None:
        kpm, mask, bias = _sdpa_mask(attn_mask, query, lead + (H, Nq, Nk))
    try:
        o, _lse, _rng = _call(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), key_padding_mask=kpm,
                              dropout_p=dropout_p, softmax_scale=_check_scale(scale, "scale"), causal=is_causal,
                              attn_mask=mask, attn_bias=bias, causal_align="top_left")
    except (InputError, InputTypeError) as err:
        raise _renamed(err) from None
    return o.transpose(1, 2).reshape(query.shape)
