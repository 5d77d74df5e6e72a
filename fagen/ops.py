"""Autograd ops: ``flash_attn_func`` and ``scaled_dot_product_attention``.

Both are thin wrappers over two ``torch.library`` custom ops, so eager mode,
autograd and ``torch.compile(fullgraph=True)`` all see the same opaque kernels:

* ``fagen::fwd(q, k, v, key_padding_mask, dropout_p, softmax_scale, causal)
  -> (o, lse, rng_state)``
* ``fagen::bwd(do, q, k, v, o, lse, key_padding_mask, dropout_p, softmax_scale,
  causal, rng_state) -> (dq, dk, dv)``

Layout of the ops: q, o [B, Nq, H, d]; k, v [B, Nk, H, d]; lse float32
[B, H, Nq]; key_padding_mask bool [B, Nk] (True = the key takes part); causal is
bottom-right aligned. ``rng_state`` is an int64 CPU tensor ``[seed, offset]``:
the Philox key of the dropout keep-mask, drawn by :func:`draw_rng_state` from
torch's default CPU generator when ``dropout_p > 0`` (zeros otherwise), so
``torch.manual_seed`` reproduces a run. Autograd saves q, k, v, o, lse and
rng_state -- never an N x N tensor -- and the backward replays the same mask.

The draw happens inside ``fagen::fwd`` (tagged ``nondeterministic_seeded``), not
in Python around it: a compiled graph therefore draws a fresh state on every call
instead of baking one in as a constant.
"""
import inspect
from typing import Any, Optional

import torch

from . import functional as F
from .errors import InputError, InputTypeError, check_dropout_p

__all__ = ["flash_attn_func", "scaled_dot_product_attention", "draw_rng_state"]

Tensor = torch.Tensor


# --------------------------------------------------------------------------- helpers
def draw_rng_state() -> Tensor:
    """A fresh dropout key: int64 CPU tensor ``[seed, offset]``, each in ``[0, 2**63)``.

    Drawn from torch's default CPU generator (for CPU and CUDA inputs alike), so
    ``torch.manual_seed(s)`` followed by the same calls reproduces every mask.
    """
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, generator=torch.default_generator)


def _last_dim_contiguous(t: Tensor) -> Tensor:
    """The kernels need stride 1 in the head dimension; other strides pass through."""
    return t if t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


def _seed_offset(rng_state: Tensor) -> tuple[int, int]:
    seed, offset = (int(x) for x in rng_state.tolist())
    return seed, offset


def _custom_op_kwargs(*tags: torch.Tag) -> dict[str, Any]:
    """``tags=`` where this torch's ``custom_op`` accepts it (2.5+)."""
    return {"tags": tags} if "tags" in inspect.signature(torch.library.custom_op).parameters else {}


def _check_qkv_meta(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> None:
    """Shape/dtype/device validation shared by the real and fake implementations."""
    p = F.validate_qkv(_last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v))
    F.validate_key_padding_mask(key_padding_mask, p)


# --------------------------------------------------------------------------- fagen::fwd
@torch.library.custom_op("fagen::fwd", mutates_args=(),
                         **_custom_op_kwargs(torch.Tag.nondeterministic_seeded))
def _fwd(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dropout_p: float,
         softmax_scale: Optional[float], causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    rng_state = draw_rng_state() if dropout_p > 0 else torch.zeros(2, dtype=torch.int64)
    seed, offset = _seed_offset(rng_state)
    o, lse = F.attention_forward(
        _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), causal=causal,
        key_padding_mask=key_padding_mask, dropout_p=dropout_p, softmax_scale=softmax_scale,
        seed=seed, offset=offset)
    return o, lse, rng_state


@_fwd.register_fake
def _fwd_fake(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dropout_p: float,
              softmax_scale: Optional[float], causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    _check_qkv_meta(q, k, v, key_padding_mask)
    batch, seqlen_q, heads, _ = q.shape
    o = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    rng_state = q.new_empty((2,), dtype=torch.int64, device="cpu")
    return o, lse, rng_state


# --------------------------------------------------------------------------- fagen::bwd
@torch.library.custom_op("fagen::bwd", mutates_args=())
def _bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
         key_padding_mask: Optional[Tensor], dropout_p: float, softmax_scale: Optional[float],
         causal: bool, rng_state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = _seed_offset(rng_state)
    return F.attention_backward(
        _last_dim_contiguous(do), _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v),
        _last_dim_contiguous(o), lse, causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
        softmax_scale=softmax_scale, seed=seed, offset=offset)


@_bwd.register_fake
def _bwd_fake(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
              key_padding_mask: Optional[Tensor], dropout_p: float, softmax_scale: Optional[float],
              causal: bool, rng_state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    _check_qkv_meta(q, k, v, key_padding_mask)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --------------------------------------------------------------------------- autograd
def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    q, k, v, key_padding_mask, dropout_p, softmax_scale, causal = inputs
    o, lse, rng_state = output
    ctx.save_for_backward(q, k, v, o, lse, rng_state, key_padding_mask)
    ctx.dropout_p = dropout_p
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.mark_non_differentiable(lse, rng_state)


def _backward(ctx: Any, do: Tensor, _dlse: Optional[Tensor], _drng: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    q, k, v, o, lse, rng_state, key_padding_mask = ctx.saved_tensors
    dq, dk, dv = _bwd(do, q, k, v, o, lse, key_padding_mask, ctx.dropout_p, ctx.softmax_scale, ctx.causal,
                      rng_state)
    return dq, dk, dv, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- scalar validation
_check_scale = F.validate_softmax_scale  # None, or finite in float32
_check_bool = F.validate_flag  # Python bool or numpy bool_


def _check_tensors(**tensors: Any) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(name, "a torch.Tensor", type(t).__name__)


# --------------------------------------------------------------------------- public ops
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """FlashAttention in flash-attn's layout, differentiable: returns ``out`` [B, Nq, H, d].

    Args:
        q: [B, Nq, H, d]; k, v: [B, Nk, H, d]; float16, bfloat16 or float32, CPU or CUDA,
            head_dim d a multiple of 8 in 8..256. Any batch/seq/head strides.
        dropout_p: probability of dropping an attention weight (apply it only in training).
        softmax_scale: defaults to ``1 / sqrt(d)``.
        causal: bottom-right aligned mask (query i sees key j iff ``j <= i + Nk - Nq``), as
            flash-attn >= 2.1.
        key_padding_mask: bool [B, Nk], True = the key takes part; a query row with no key
            left gives a zero output row and zero gradients.

    A drop-in for ``flash_attn.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal)``
    (window_size, alibi_slopes, softcap and return_attn_probs are not supported).
    """
    _check_tensors(q=q, k=k, v=v)
    if key_padding_mask is not None:
        _check_tensors(key_padding_mask=key_padding_mask)
    o, _lse, _rng_state = _fwd(q, k, v, key_padding_mask, check_dropout_p(dropout_p),
                               _check_scale(softmax_scale, "softmax_scale"), _check_bool("causal", causal))
    return o


def sdpa_key_padding_mask(attn_mask: Any, batch: int, seqlen_k: int) -> Optional[Tensor]:
    """``attn_mask`` of :func:`scaled_dot_product_attention` as a bool [B, Nk] key-padding mask.

    Accepted: a bool tensor broadcastable to [B, 1, 1, Nk] ([B, 1, 1, Nk], [1, 1, 1, Nk],
    [B, 1, 1, 1], [Nk], ...), True = the key takes part. Anything else -- a float (additive)
    mask, or a mask that varies per query row or per head -- is an :class:`InputError` /
    :class:`InputTypeError` naming ``attn_mask``.
    """
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise InputTypeError("attn_mask", "a bool torch.Tensor or None", type(attn_mask).__name__)
    if attn_mask.dtype != torch.bool:
        raise InputTypeError("attn_mask", "dtype torch.bool (True = key takes part); additive float masks "
                             "are not supported", attn_mask.dtype)
    target = (batch, 1, 1, seqlen_k)
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(s not in (1, t) for s, t in zip(reversed(shape), reversed(target))):
        raise InputError("attn_mask", f"a key-padding mask broadcastable to [B, 1, 1, Nk] = {list(target)} "
                         "(per-query or per-head masks are not supported)", f"shape {list(shape)}")
    return attn_mask.expand(target).reshape(batch, seqlen_k)


def _check_sdpa_shapes(query: Tensor, key: Tensor, value: Tensor) -> None:
    """The shape relations in the caller's [B, H, N, d] layout (flash_attn_func, which runs on the
    transposed views, would word them in its own [B, N, H, d])."""
    B, H, _, d = query.shape
    if key.shape[0] != B or key.shape[1] != H or key.shape[3] != d:
        raise InputError("key", f"shape [B, H, Nk, d] = [{B}, {H}, Nk, {d}] matching query [B, H, Nq, d]",
                         tuple(key.shape))
    if tuple(value.shape) != tuple(key.shape):
        raise InputError("value", f"the shape of key {tuple(key.shape)} ([B, H, Nk, d])", tuple(value.shape))


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` in its layout: [B, H, N, d] -> [B, H, Nq, d].

    Differences from torch's:

    * ``attn_mask`` must be a bool key-padding mask broadcastable to [B, 1, 1, Nk] (see
      :func:`sdpa_key_padding_mask`); it may be combined with ``is_causal``.
    * ``is_causal`` with ``Nq != Nk`` raises: torch aligns the causal mask top-left, fagen
      bottom-right (use :func:`flash_attn_func` for that). For ``Nq == Nk`` they agree.
    * ``enable_gqa=True`` is not supported (k and v need as many heads as q).
    * Inputs must be 4-D.
    """
    _check_tensors(query=query, key=key, value=value)
    if _check_bool("enable_gqa", enable_gqa):
        raise InputError("enable_gqa", "False (grouped-query attention is not supported)", enable_gqa)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise InputError(name, "a 4-D tensor [batch, heads, seqlen, head_dim]", f"shape {tuple(t.shape)}")
    _check_sdpa_shapes(query, key, value)
    if _check_bool("is_causal", is_causal) and query.shape[2] != key.shape[2]:
        raise InputError("is_causal", "Nq == Nk: torch's causal mask is top-left aligned, fagen's bottom-right; "
                         "call fagen.flash_attn_func for bottom-right causal attention with Nq != Nk",
                         f"Nq={query.shape[2]}, Nk={key.shape[2]}")
    mask = sdpa_key_padding_mask(attn_mask, key.shape[0], key.shape[2])
    out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=dropout_p,
                          softmax_scale=_check_scale(scale, "scale"), causal=bool(is_causal), key_padding_mask=mask)
    return out.transpose(1, 2)
