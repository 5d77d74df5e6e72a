"""fagen as an attention implementation of Hugging Face ``transformers`` (5.x).

``register(name="fagen")`` adds two functions under ``name``:

* a **mask function** (``AttentionMaskInterface``) that hands the attention a :class:`FagenMask` --
  the key-padding mask ``[B, Nk]`` sliced from the 2-D ``attention_mask``, whether the pattern is
  causal, its alignment and the sliding window -- instead of an ``Nq x Nk`` tensor. It recognises
  transformers' causal, sliding-window causal and bidirectional patterns, and packed sequences
  found from ``position_ids`` (run as fagen's varlen attention); any other pattern (chunked
  attention, custom ``or``/``and`` mask functions) is built as transformers' own 4-D bool mask,
  which fagen's kernels read as ``attn_mask``.
* an **attention function** (``AttentionInterface``) that runs fagen's ``fagen::fwd`` / ``fagen::bwd``
  custom ops on the module's ``[B, H, N, d]`` query/key/value: native GQA (no ``repeat_kv``), the
  module's ``scaling``, ``dropout`` (training), ``softcap``, attention sinks (gpt-oss's ``s_aux``,
  forward and backward: the parameter gets its gradient) and the mask above.

``transformers`` is imported only when :func:`register` runs (install ``fagen[transformers]``).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

import torch

from ..errors import InputError
from ..functional import AttentionOptions, Tensors
from ..ops import attention  # the autograd op with every option (window, alignment, masks)

__all__ = ["register", "FagenMask", "attention_forward", "mask_function", "SUPPORTED_TRANSFORMERS"]

Tensor = torch.Tensor

#: The transformers versions this adapter is tested with (the ``transformers`` extra asks for them).
SUPPORTED_TRANSFORMERS = ">=5.24,<6"
_MIN_VERSION = (5, 24)


class FagenMask:
    """What the mask function hands the attention function: no ``Nq x Nk`` tensor unless ``dense``.

    ``key_padding_mask``: bool ``[B, Nk]`` (True = the key takes part) or None; ``causal``;
    ``causal_align``: ``"top_left"`` or ``"bottom_right"`` (fagen's rule, see docs/api.md);
    ``window_left``: keys at most this far left of the diagonal (``-1`` = unbounded); ``dense``: a
    4-D bool ``[B, 1, Nq, Nk]`` mask for patterns the parameters cannot express (then the others are
    unused); ``cu_seqlens``: int32 ``[B * N + 1]`` when the batch holds packed sequences (found by
    transformers from ``position_ids``): the attention then runs fagen's varlen kernels over the
    flattened tokens, causal (and windowed) within each sequence. ``shape`` is the ``[B, 1, Nq, Nk]`` it stands for and ``ndim`` is 4, so transformers
    treats it as a prepared mask when ``generate`` hands it back to the model (static cache).
    """

    __slots__ = ("key_padding_mask", "causal", "causal_align", "window_left", "dense", "shape", "cu_seqlens")
    ndim = 4

    def __init__(self, shape: tuple[int, int, int, int], key_padding_mask: Optional[Tensor] = None,
                 causal: bool = False, causal_align: str = "bottom_right", window_left: int = -1,
                 dense: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None) -> None:
        self.shape = shape
        self.cu_seqlens = cu_seqlens
        self.key_padding_mask = key_padding_mask
        self.causal = causal
        self.causal_align = causal_align
        self.window_left = window_left
        self.dense = dense

    def __repr__(self) -> str:
        if self.dense is not None:
            return f"FagenMask(dense={tuple(self.dense.shape)})"
        kpm = None if self.key_padding_mask is None else tuple(self.key_padding_mask.shape)
        packed = "" if self.cu_seqlens is None else ", packed"
        return (f"FagenMask(key_padding_mask={kpm}, causal={self.causal}, causal_align={self.causal_align!r}, "
                f"window_left={self.window_left}{packed})")


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        raise ImportError(
            "fagen.integrations.transformers needs the `transformers` package "
            f"(tested: transformers{SUPPORTED_TRANSFORMERS}); install it with: pip install 'fagen[transformers]'"
        ) from err


def _version(text: str) -> tuple[int, int]:
    parts = (text.split("+")[0].split(".") + ["0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


_masking_utils: Any = None  # transformers.masking_utils, set by register() (a plain global: traceable)


def _mu() -> Any:
    global _masking_utils
    if _masking_utils is None:
        _masking_utils = importlib.import_module("transformers.masking_utils")
    return _masking_utils


def _closure(fn: Callable[..., Any]) -> dict[str, Any]:
    """A function's free variables by name (empty for a plain function)."""
    cells = getattr(fn, "__closure__", None) or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells)}


@torch.compiler.assume_constant_result  # evaluated once while tracing (reads closures, not tensors)
def _pattern(mask_function: Callable[..., Any]) -> Optional[tuple[bool, int]]:
    """``(causal, window)`` for transformers' standard patterns (window ``0`` = none), else None."""
    mu = _mu()
    if mask_function is mu.causal_mask_function:
        return True, 0
    if mask_function is mu.bidirectional_mask_function:
        return False, 0
    # sliding_window_causal_mask_function(w) = and_masks(sliding_window_overlay(w), causal_mask_function)
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        parts = _closure(mask_function).get("mask_functions")
        if isinstance(parts, tuple) and len(parts) == 2 and parts[1] is mu.causal_mask_function and \
                getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask":
            window = _closure(parts[0]).get("sliding_window")
            if isinstance(window, int) and not isinstance(window, bool) and window > 0:
                return True, window
    return None


@torch.compiler.assume_constant_result
def _packed_pattern(mask_function: Callable[..., Any]) -> Optional[tuple[bool, int]]:
    """``(causal, window)`` of the base pattern when ``mask_function`` is transformers' packed-sequence
    form ``and_masks(remap_positions_for_packed_sequence(base, position_ids),
    packed_sequence_mask_function(ids))`` with a standard causal base, else None."""
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _closure(mask_function).get("mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2 and
            getattr(parts[0], "__qualname__", "") == "remap_positions_for_packed_sequence.<locals>.inner_mask" and
            getattr(parts[1], "__qualname__", "") == "packed_sequence_mask_function.<locals>.inner_mask"):
        return None
    base = _pattern(_closure(parts[0]).get("mask_function"))
    return base if base is not None and base[0] else None


def _cu_seqlens(packed_ids: Tensor) -> Tensor:
    """Sequence ids ``[B, N]`` (transformers' ``find_packed_sequence_indices``) -> int32 cumulative
    lengths ``[B * N + 1]`` of the flattened tokens: the real boundaries, then empty sequences (a fixed
    size, so no host sync)."""
    B, N = packed_ids.shape
    T = B * N
    first = torch.zeros_like(packed_ids, dtype=torch.bool)
    first[:, 0] = True
    starts = (first | torch.diff(packed_ids, dim=-1, prepend=packed_ids[:, :1]).ne(0)).reshape(T)
    rank = torch.cumsum(starts, 0) - 1
    pos = torch.arange(T, device=packed_ids.device)
    cu = torch.full((T + 1,), T, dtype=torch.int64, device=packed_ids.device)
    cu.scatter_(0, torch.where(starts, rank, T), torch.where(starts, pos, T))
    return cu.to(torch.int32)


def mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
                  mask_function: Optional[Callable[..., Any]] = None, attention_mask: Optional[Tensor] = None,
                  **kwargs: Any) -> FagenMask:
    """transformers' mask-interface signature -> :class:`FagenMask` (see the module docstring).

    Positions are absolute: query ``i`` is at ``q_offset + i``, key ``j`` at ``kv_offset + j``; a
    causal pattern is ``kv_pos <= q_pos`` and a window ``w`` adds ``kv_pos > q_pos - w``. fagen's
    kernels take the shift ``q_offset - kv_offset`` as ``0`` (top-left) or ``Nk - Nq``
    (bottom-right); a single query (decoding) folds causality and window into the key mask, so a
    cache position held in a tensor (static cache) needs no host sync.
    """
    if isinstance(attention_mask, FagenMask):  # prepared earlier (generate with a static cache)
        return attention_mask
    mu = _mu()
    shape = (batch_size, 1, q_length, kv_length)
    fn = mu.causal_mask_function if mask_function is None else mask_function
    pattern = _pattern(fn)
    if pattern is None and attention_mask is None and q_length == kv_length and not torch.compiler.is_compiling() \
            and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0:
        packed = _packed_pattern(fn)
        if packed is not None:  # packed sequences: fagen's varlen kernels, causal within each sequence
            ids = _closure(_closure(fn)["mask_functions"][1])["packed_sequence_mask"]
            if isinstance(ids, torch.Tensor) and tuple(ids.shape) == (batch_size, q_length):
                return FagenMask(shape, causal=True, window_left=packed[1] - 1 if packed[1] else -1,
                                 cu_seqlens=_cu_seqlens(ids))
    kpm = None
    if attention_mask is not None:
        if not isinstance(kv_offset, int):
            pattern = None
        else:
            padded = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
            kpm = padded[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    if pattern is not None:
        causal, window = pattern
        if not causal:
            return FagenMask(shape, kpm, causal=False)
        left = window - 1 if window else -1
        shift = None
        if isinstance(q_offset, int) and not isinstance(q_offset, bool) and isinstance(kv_offset, int):
            shift = q_offset - kv_offset
        if shift == 0:
            return FagenMask(shape, kpm, causal=True, causal_align="top_left", window_left=left)
        if shift is not None and shift == kv_length - q_length:
            return FagenMask(shape, kpm, causal=True, causal_align="bottom_right", window_left=left)
        if q_length == 1 and isinstance(kv_offset, int):
            device = kwargs.get("device", attention_mask.device if attention_mask is not None else "cpu")
            kv_pos = torch.arange(kv_length, device=device) + kv_offset
            keys = kv_pos <= q_offset
            if window:
                keys = keys & (kv_pos > q_offset - window)
            keys = keys[None, :].expand(batch_size, kv_length)
            return FagenMask(shape, keys if kpm is None else keys & kpm, causal=False)
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    dense = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=fn, attention_mask=attention_mask,
                         allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)
    return FagenMask(shape, dense=dense)


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, softcap: Optional[float] = None,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-interface signature: query ``[B, H, Nq, d]``, key/value
    ``[B, H_kv, Nk, d]`` -> ``(out [B, Nq, H, d], None)``; runs ``fagen::fwd`` (autograd: ``fagen::bwd``).

    ``attention_mask`` is a :class:`FagenMask` from :func:`mask_function`, a 4-D bool or float mask
    (a model or user that prepared its own), or None (then causal follows the module's
    ``is_causal`` for more than one query, top-left aligned, as transformers' ``sdpa``).
    """
    if kwargs.get("position_bias") is not None:
        raise InputError("position_bias", "None: attn_implementation='fagen' has no additive position bias "
                         "(use attn_implementation='sdpa' or 'eager' for this model)", "a tensor")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None:  # gpt-oss: one learnable logit per q head (the module's parameter, any float dtype)
        if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != query.shape[1]:
            raise InputError("s_aux", f"attention sinks of shape [H] = [{query.shape[1]}] (one logit per query head)",
                             tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__)
        sinks = sinks.float()  # fagen takes fp32 sinks; the cast is differentiable (the parameter gets dsinks)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    Nq = q.shape[1]
    opts: dict[str, Any] = dict(causal=False, window_size=(-1, -1), causal_align="top_left")
    data: dict[str, Any] = {}
    if isinstance(attention_mask, FagenMask) and attention_mask.cu_seqlens is not None:
        B, H, d = q.shape[0], q.shape[2], q.shape[3]
        cu = attention_mask.cu_seqlens
        packed = AttentionOptions.of(dropout_p=float(dropout), softmax_scale=scaling,
                                     softcap=0.0 if softcap is None else float(softcap), causal=True,
                                     window_size=(attention_mask.window_left, -1))
        out, _lse, _rng = attention(q.reshape(B * Nq, H, d), k.reshape(B * Nq, k.shape[2], d),
                                    v.reshape(B * Nq, v.shape[2], v.shape[3]), packed,
                                    Tensors(cu_seqlens_q=cu, cu_seqlens_k=cu, sinks=sinks), max_seqlen_q=Nq,
                                    max_seqlen_k=Nq)
        return out.reshape(B, Nq, H, out.shape[-1]), None
    if isinstance(attention_mask, FagenMask):
        if attention_mask.dense is not None:
            data["attn_mask"] = attention_mask.dense
        else:
            data["key_padding_mask"] = attention_mask.key_padding_mask
            opts.update(causal=attention_mask.causal, causal_align=attention_mask.causal_align,
                        window_size=(attention_mask.window_left, -1))
    elif isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() != 4:
            raise InputError("attention_mask", "a 4-D [B, 1 or H, Nq, Nk] bool or float mask for "
                             "attn_implementation='fagen' (2-D masks go through the model's mask function)",
                             f"shape {tuple(attention_mask.shape)}")
        m = attention_mask[..., :k.shape[1]]
        if m.dtype == torch.bool:
            data["attn_mask"] = m
        else:
            data["attn_bias"] = m.to(q.dtype)
    elif attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        opts["causal"] = bool(causal) and Nq > 1
    else:
        raise InputError("attention_mask", "a FagenMask (from the 'fagen' mask function), a 4-D tensor or None",
                         type(attention_mask).__name__)
    cap = 0.0 if softcap is None else float(softcap)
    options = AttentionOptions.of(dropout_p=float(dropout), softmax_scale=scaling, softcap=cap, **opts)
    out, _lse, _rng = attention(q, k, v, options, Tensors(**data, sinks=sinks))
    return out, None


def register(name: str = "fagen") -> str:
    """Register fagen's attention and mask functions with transformers under ``name``; returns ``name``.

    Afterwards ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or
    ``from_pretrained(..., attn_implementation=name)``) runs fagen's kernels. Raises ImportError when
    transformers is missing or older than :data:`SUPPORTED_TRANSFORMERS`.
    """
    if not isinstance(name, str) or not name or name in ("sdpa", "eager", "flex_attention") or \
            name.startswith("flash_attention"):
        raise InputError("name", "a new non-empty attention-implementation name (not one of transformers' own)",
                         repr(name))
    tr = _transformers()
    if _version(tr.__version__) < _MIN_VERSION:
        raise ImportError(f"fagen.integrations.transformers needs transformers{SUPPORTED_TRANSFORMERS}, "
                          f"found {tr.__version__}; install it with: pip install 'fagen[transformers]'")
    _mu()
    tr.AttentionInterface.register(name, attention_forward)
    tr.AttentionMaskInterface.register(name, mask_function)
    return name
