"""Functional API on torch tensors: spec selection and launches (no autograd).

Layout: q, o, do [B, Nq, H, d]; k, v [B, Nk, H_kv, d] (H a multiple of H_kv: grouped-query
attention); packed (varlen) calls take q [total_q, H, d], k, v [total_k, H_kv, d] and int32
cu_seqlens [B + 1]. Any batch/seq/head strides, contiguous last dim. lse float32 [B, H, Nq]
([H, total_q] packed). Head dims that are not multiples of 8 are padded with zeros to the
next one (the scale stays 1/sqrt(true d)) and the results sliced back. Optional features
(window, softcap, ALiBi, bool mask, additive bias, deterministic backward) become spec flags
and runtime arguments; argument validation lives in :mod:`fagen.inputs`. CUDA tensors run the
NVRTC cubin through CuPy, CPU tensors run the same source in the emulator.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch
from pydantic import ValidationError

from .choices import tuned_or_default
from .errors import InputError, InputTypeError
from .inputs import (SEQLEN_MAX, Features, Problem, check_like, check_lse, reduce_to_shape,  # noqa: F401
                     validate_features, validate_flag, validate_key_padding_mask, validate_qkv,
                     validate_softmax_scale, validate_varlen)
from .philox import drop_threshold, keep_mask
from .renderer import KernelInfo, kernel_infos
from .runtime import get_module
from .spec import KernelSpec

__all__ = ["attention_forward", "attention_backward", "run_forward", "run_backward", "dropout_keep_mask",
           "spec_for", "default_arch", "Problem", "SEQLEN_MAX"]

#: spec field -> the argument a caller passes for it (errors name the argument).
FIELD_ARGUMENT = {
    "causal": "causal", "key_padding": "key_padding_mask", "dropout": "dropout_p", "window": "window_size",
    "softcap": "softcap", "alibi": "alibi_slopes", "attn_mask": "attn_mask", "bias": "attn_bias",
    "bias_grad": "attn_bias", "varlen": "cu_seqlens_q", "deterministic": "deterministic",
    "causal_align": "causal_align",
}


# --------------------------------------------------------------------------- spec choice
def default_arch(device: torch.device) -> str:
    if device.type == "cuda":
        from .runtime.gpu import device_arch

        return device_arch(device)
    return "sm_90"  # the emulator runs any arch; tiles follow sm_90's M


@functools.lru_cache(maxsize=512)
def _default_spec(direction: str, head_dim: int, dtype: str, arch: str, flags: tuple[tuple[str, Any], ...]) -> KernelSpec:
    return KernelSpec(direction=direction, head_dim=head_dim, dtype=dtype, arch=arch, **dict(flags))


def _unsupported(direction: str, p: Problem, arch: str, flags: dict[str, Any], err: ValidationError) -> InputError:
    """The argument to blame when no family builds the spec: the first feature whose removal
    makes it buildable (else the dtype, else the head dim)."""
    why = err.errors()[0]["msg"]
    optional = [f for f, v in flags.items() if v not in (False, "bottom_right")
                and f not in ("causal", "key_padding", "dropout")]
    for field in optional + [f for f in ("causal", "key_padding", "dropout") if flags.get(f)]:
        rest = {k: v for k, v in flags.items() if k != field and not (field == "bias" and k == "bias_grad")}
        if field in ("causal", "window", "alibi") and rest.get("causal_align") == "top_left" and not any(
                rest.get(f) for f in ("causal", "window", "alibi")):
            rest.pop("causal_align")
        try:
            _default_spec(direction, p.head_dim, p.dtype, arch, tuple(sorted(rest.items())))
        except ValidationError:
            continue
        return InputError(FIELD_ARGUMENT.get(field, field),
                          f"an option some kernel family implements with the others given ({why})", flags[field])
    if p.dtype == "float64":
        return InputTypeError("q", f"a dtype some kernel family implements with these options ({why})", "float64")
    return InputError("q", f"inputs some kernel family implements ({why})", f"head_dim {p.true_head_dim}, {p.dtype}")


def spec_for(direction: str, p: Problem, *, causal: bool = False, key_padding: bool = False, dropout: bool = False,
             **features: Any) -> KernelSpec:
    """The spec of the inputs: default tiles (the first family in preference order that implements
    every flag), or a tuned choice when one is recorded. ``features``: the other spec flags.
    No family implementing the combination is an InputError naming the argument to change."""
    flags = {"causal": causal, "key_padding": key_padding, "dropout": dropout, **features}
    arch = default_arch(p.device)
    try:
        spec = _default_spec(direction, p.head_dim, p.dtype, arch, tuple(sorted(flags.items())))
    except ValidationError as err:
        raise _unsupported(direction, p, arch, flags, err) from None
    return tuned_or_default(spec, batch=p.batch, heads=p.heads, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, device=p.device)


@functools.lru_cache(maxsize=512)
def _kernels(spec: KernelSpec) -> tuple[KernelInfo, ...]:
    """The spec's entry points in launch order, without rendering its source (a first call stays cheap)."""
    return tuple(kernel_infos(spec))


def _kernel(spec: KernelSpec, role: str) -> KernelInfo:
    return next(k for k in _kernels(spec) if k.role.name == role)


def _spec_flag(spec: KernelSpec, field: str) -> Any:
    return getattr(spec, field, "bottom_right" if field == "causal_align" else False)


def _check_spec(spec: KernelSpec, direction: str, p: Problem, flags: dict[str, Any]) -> None:
    """An explicit spec must match the tensors and the options (causal comes from the spec itself)."""
    if spec.direction != direction:
        raise InputError("spec", f"a {direction} spec", spec.direction)
    if spec.head_dim != p.head_dim or spec.dtype != p.dtype:
        raise InputError("spec", f"head_dim={p.head_dim}, dtype={p.dtype} (from the tensors)", f"{spec.head_dim}, {spec.dtype}")
    if flags["key_padding"] != spec.key_padding:
        raise InputError("key_padding_mask", "a mask exactly when spec.key_padding is set", flags["key_padding"])
    if flags["dropout"] and not spec.dropout:
        raise InputError("dropout_p", "0 for a spec compiled without dropout", "> 0")
    for field, argument in FIELD_ARGUMENT.items():
        if field in ("causal", "key_padding", "dropout", "causal_align"):
            continue
        given, compiled = bool(flags.get(field, False)), bool(_spec_flag(spec, field))
        if given != compiled and not (field == "window" and compiled):  # a window kernel runs unbounded too
            raise InputError(argument, f"an option exactly when spec.{field} is set", given)
    if "causal_align" in flags and flags["causal_align"] != _spec_flag(spec, "causal_align"):
        raise InputError("causal_align", f"spec.causal_align ({_spec_flag(spec, 'causal_align')})", flags["causal_align"])


# --------------------------------------------------------------------------- arguments
def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _strides(name: str, t: torch.Tensor, varlen: bool) -> dict[str, int]:
    if varlen:  # [total, H, d]: the sequence offset comes from cu_seqlens, stride_b is ignored
        return {f"stride_{name}_b": 0, f"stride_{name}_s": t.stride(0), f"stride_{name}_h": t.stride(1)}
    return {f"stride_{name}_b": t.stride(0), f"stride_{name}_s": t.stride(1), f"stride_{name}_h": t.stride(2)}


def _bhqk(name: str, t: torch.Tensor | None) -> dict[str, int]:
    s = (0, 0, 0, 0) if t is None else t.stride()
    return {f"stride_{name}_{x}": int(v) for x, v in zip("bhqk", s)}


def _feature_args(p: Problem, f: Features, lse: torch.Tensor, dbias: torch.Tensor | None = None) -> dict[str, Any]:
    """Every feature parameter of the ABI (fagen.abi): the values when used, neutral ones otherwise
    (null pointers, window -1, softcap 0, zero strides)."""
    slopes = f.alibi_slopes
    window = f.window if f.uses_window else (-1, -1)
    if p.varlen:
        lse_b, lse_h = 0, lse.stride(0)
    else:
        lse_b, lse_h = lse.stride(0), lse.stride(1)
    return {
        "heads_kv": p.heads_kv, "cu_seqlens_q": _ptr(f.cu_seqlens_q), "cu_seqlens_k": _ptr(f.cu_seqlens_k),
        "window_left": window[0], "window_right": window[1], "softcap": f.softcap,
        "alibi_slopes": _ptr(slopes), "stride_alibi_b": slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
        "mask": _ptr(f.attn_mask), **_bhqk("mask", f.attn_mask), "bias": _ptr(f.attn_bias), **_bhqk("bias", f.attn_bias),
        "stride_lse_b": lse_b, "stride_lse_h": lse_h, "dbias": _ptr(dbias), **_bhqk("dbias", dbias),
    }


def _dropout_args(dropout_p: float, seed: int, offset: int, offsets: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    return {"seed": seed, "offset": offset, "drop_threshold": drop_threshold(dropout_p),
            "rp_keep": 1.0 / (1.0 - dropout_p), "row_offset": offsets[0], "col_offset": offsets[1]}


def _dropout_offsets(row: Any, col: Any) -> tuple[int, int]:
    """(dropout_row_offset, dropout_col_offset): ints in [0, 2**31), the global row/column of the
    first q row/key in the dropout keep-mask (a block of a longer sequence, e.g. a ring step)."""
    for name, x in (("dropout_row_offset", row), ("dropout_col_offset", col)):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**31:
            raise InputError(name, "an int in [0, 2**31)", repr(x))
    return row, col


def _acc_dtype(kern: KernelInfo, param: str) -> torch.dtype:
    """float32, or float64 where the kernel declares the buffer as double (float64 specs)."""
    ctype = next((t for t, n in kern.params if n == param), "float*")
    return torch.float64 if "double" in ctype else torch.float32


def _grid(kern: KernelInfo, p: Problem) -> tuple[int, int, int]:
    if p.heads_kv == p.heads:
        return kern.grid(p.batch, p.heads, p.seqlen_q, p.seqlen_k)
    return kern.grid(p.batch, p.heads, p.seqlen_q, p.seqlen_k, heads_kv=p.heads_kv)


def _check_gqa(spec: KernelSpec, p: Problem) -> None:
    if p.heads_kv != p.heads and not any(n == "heads_kv" for _, n in _kernel(spec, "main").params):
        raise InputError("k", f"as many heads as q ({p.heads}): the {spec.impl} kernels have no grouped-query "
                         "support yet", p.heads_kv)


def _pad(t: torch.Tensor, p: Problem) -> torch.Tensor:
    """Zeros appended to the head dim up to the kernels' multiple of 8 (a copy only when padding)."""
    return torch.nn.functional.pad(t, (0, p.head_dim - p.true_head_dim)) if p.padded else t


def _unpad(t: torch.Tensor, p: Problem) -> torch.Tensor:
    return t[..., :p.true_head_dim].contiguous() if p.padded else t


# --------------------------------------------------------------------------- problem + options
def _prepare(q: Any, k: Any, v: Any, *, causal: Any, key_padding_mask: Any, dropout_p: Any, softmax_scale: Any,
             seed: Any, offset: Any, window_size: Any, softcap: Any, alibi_slopes: Any, attn_mask: Any,
             attn_bias: Any, causal_align: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
             max_seqlen_k: Any, check_values: bool = True) -> tuple[Problem, Features]:
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            missing = "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k"
            raise InputError(missing, "int32 cumulative lengths [B + 1] (both cu_seqlens_q and cu_seqlens_k)", None)
        p = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_values=check_values)
    else:
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if m is not None:
                raise InputError(name, "None without cu_seqlens (the lengths come from the tensors)", m)
        p = validate_qkv(q, k, v)
    f = validate_features(p, q.dtype, causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
                          softmax_scale=softmax_scale, seed=seed, offset=offset, window_size=window_size,
                          softcap=softcap, alibi_slopes=alibi_slopes, attn_mask=attn_mask, attn_bias=attn_bias,
                          causal_align=causal_align, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return p, f


def validate(q: Any, k: Any, v: Any, *, check_values: bool = True, **options: Any) -> Problem:
    """Check the inputs and options of :func:`attention_forward` without launching anything; the
    runtime shape. ``check_values=False`` skips reading cu_seqlens (fake tensors under tracing)."""
    p, _ = _prepare(q, k, v, **{**_DEFAULTS, **options}, check_values=check_values)
    return p


def _flags(direction: str, p: Problem, f: Features, deterministic: bool = False,
           bias_grad: bool = False) -> dict[str, Any]:
    flags = f.spec_fields(p)
    if direction == "bwd":
        if deterministic:
            flags["deterministic"] = True
        if bias_grad:
            flags["bias_grad"] = True
    return flags


def _select(direction: str, p: Problem, flags: dict[str, Any], spec: KernelSpec | None) -> KernelSpec:
    if spec is None:
        spec = spec_for(direction, p, **flags)
    else:
        _check_spec(spec, direction, p, flags)
    _check_gqa(spec, p)
    return spec


# --------------------------------------------------------------------------- forward
def _launch_forward(spec: KernelSpec, p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    f: Features, offsets: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward on padded q, k, v: (o, lse) with o padded like q."""
    kern = _kernel(spec, "main")
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.lse_shape, dtype=_acc_dtype(kern, "lse"), device=q.device)
    if p.empty or p.device.type == "meta":  # meta: shapes only
        return o, lse
    if p.no_keys:
        return o.zero_(), lse.fill_(-math.inf)
    args = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "kpm": _ptr(f.key_padding_mask),
            "o": o.data_ptr(), "lse": lse.data_ptr(), "heads": p.heads, "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k,
            "scale": f.scale, **_strides("q", q, p.varlen), **_strides("k", k, p.varlen), **_strides("v", v, p.varlen),
            **_strides("o", o, p.varlen), **_dropout_args(f.dropout_p, f.seed, f.offset, offsets), **_feature_args(p, f, lse)}
    get_module(spec, p.device.type).launch(kern, _grid(kern, p), args)
    return o, lse


def _forward(q: Any, k: Any, v: Any, spec: KernelSpec | None, offsets: tuple[int, int] = (0, 0),
             **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    p, f = _prepare(q, k, v, **options)
    spec = _select("fwd", p, _flags("fwd", p, f), spec)
    o, lse = _launch_forward(spec, p, _pad(q, p), _pad(k, p), _pad(v, p), f, offsets)
    return _unpad(o, p), lse


_DEFAULTS: dict[str, Any] = dict(
    causal=False, key_padding_mask=None, dropout_p=0.0, softmax_scale=None, seed=0, offset=0, window_size=(-1, -1),
    softcap=0.0, alibi_slopes=None, attn_mask=None, attn_bias=None, causal_align="bottom_right", cu_seqlens_q=None,
    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      softmax_scale: float | None = None, seed: int = 0, offset: int = 0,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                      attn_bias: torch.Tensor | None = None, causal_align: str = "bottom_right",
                      cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                      max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                      spec: KernelSpec | None = None, dropout_row_offset: int = 0,
                      dropout_col_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward: (o like q, lse float32 [B, H, Nq] or [H, total_q] when packed).

    ``spec``: an explicit KernelSpec (tiles, family) that must match the inputs and options.
    ``dropout_row_offset``/``dropout_col_offset``: q row i and key j draw the keep-mask bit of
    (row_offset + i, col_offset + j), as when these tensors are a block of a longer sequence
    (ring attention, :mod:`fagen.distributed`); masks and scores keep the local indices."""
    return _forward(q, k, v, spec, _dropout_offsets(dropout_row_offset, dropout_col_offset), causal=causal,
                    key_padding_mask=key_padding_mask, dropout_p=dropout_p,
                    softmax_scale=softmax_scale, seed=seed, offset=offset, window_size=window_size, softcap=softcap,
                    alibi_slopes=alibi_slopes, attn_mask=attn_mask, attn_bias=attn_bias, causal_align=causal_align,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k)


def run_forward(spec: KernelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                causal: bool | None = None, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward with an explicit spec (used by the autotuner and for experiments with tiles);
    ``causal`` defaults to the spec's; the other options as :func:`attention_forward`'s."""
    return _forward(q, k, v, spec, **_explicit_options("run_forward", spec, causal, options))


def _explicit_options(caller: str, spec: KernelSpec, causal: bool | None, options: dict[str, Any]) -> dict[str, Any]:
    """The options of :func:`run_forward`/:func:`run_backward`: unknown names refused like a
    Python call would, the rest defaulted, ``causal`` and ``causal_align`` from the spec unless given."""
    unknown = sorted(set(options) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    kw = {**_DEFAULTS, **options, "causal": spec.causal if causal is None else causal}
    if "causal_align" not in options:
        kw["causal_align"] = _spec_flag(spec, "causal_align")
    return kw


# --------------------------------------------------------------------------- backward
def _launch_backward(spec: KernelSpec, p: Problem, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, f: Features,
                     bias_grad: bool, offsets: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, ...]:
    """Algorithm 4 on padded tensors: preprocess (D, dQ accumulator = 0), main (and dq when
    deterministic), postprocess (dQ -> dtype); dbias fp32 [B, H, Nq, Nk] when ``bias_grad``."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dbias = None
    if bias_grad:
        dbias = torch.zeros((p.batch, p.heads, p.seqlen_q, p.seqlen_k), dtype=torch.float32, device=q.device)
    if p.device.type == "meta":  # shapes only
        return dq, dk, dv, dbias
    if p.empty or p.no_keys:
        return dq.zero_(), dk, dv, dbias
    main = _kernel(spec, "main")
    acc = _acc_dtype(main, "dq_accum")
    delta = torch.empty(p.lse_shape, dtype=_acc_dtype(main, "delta"), device=q.device)
    dq_accum = torch.empty(q.shape, dtype=acc, device=q.device)  # [B, Nq, H, d] or [total_q, H, d]
    args = {
        "q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": o.data_ptr(), "do_": do.data_ptr(),
        "lse": lse.data_ptr(), "delta": delta.data_ptr(), "dq_accum": dq_accum.data_ptr(),
        "kpm": _ptr(f.key_padding_mask), "dq": dq.data_ptr(), "dk": dk.data_ptr(), "dv": dv.data_ptr(),
        "heads": p.heads, "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "scale": f.scale,
        **{k_: v_ for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("dq", dq), ("dk", dk),
                                   ("dv", dv)) for k_, v_ in _strides(name, t, p.varlen).items()},
        **_dropout_args(f.dropout_p, f.seed, f.offset, offsets), **_feature_args(p, f, lse, dbias),
    }
    mod = get_module(spec, p.device.type)
    for kern in _kernels(spec):  # pre, main, (dq,) post
        mod.launch(kern, _grid(kern, p), args)
    return dq, dk, dv, dbias


def _backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, spec: KernelSpec | None, deterministic: Any,
              bias_requires_grad: Any, offsets: tuple[int, int] = (0, 0), **options: Any) -> tuple[torch.Tensor, ...]:
    p, f = _prepare(q, k, v, **options)
    check_like("o", o, q)
    check_like("do", do, q)
    deterministic = validate_flag("deterministic", deterministic)
    bias_grad = validate_flag("bias_requires_grad", bias_requires_grad)
    if bias_grad and f.attn_bias is None:
        raise InputError("bias_requires_grad", "False without attn_bias", True)
    lse_t = check_lse(lse, p)
    spec = _select("bwd", p, _flags("bwd", p, f, deterministic, bias_grad), spec)
    lse_t = lse_t.to(_acc_dtype(_kernel(spec, "main"), "lse"))
    dq, dk, dv, dbias = _launch_backward(spec, p, _pad(do, p), _pad(q, p), _pad(k, p), _pad(v, p), _pad(o, p),
                                         lse_t, f, bias_grad, offsets)
    out = (_unpad(dq, p), _unpad(dk, p), _unpad(dv, p))
    if bias_grad:
        bias = options["attn_bias"]
        return out + (reduce_to_shape(dbias, tuple(bias.shape)).to(bias.dtype),)
    return out


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, *, causal: bool = False, key_padding_mask: torch.Tensor | None = None,
                       dropout_p: float = 0.0, softmax_scale: float | None = None, seed: int = 0, offset: int = 0,
                       window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                       alibi_slopes: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                       attn_bias: torch.Tensor | None = None, causal_align: str = "bottom_right",
                       cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                       max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                       deterministic: bool = False, bias_requires_grad: bool = False,
                       spec: KernelSpec | None = None, dropout_row_offset: int = 0,
                       dropout_col_offset: int = 0) -> tuple[torch.Tensor, ...]:
    """FlashAttention backward (Algorithm 4): (dq, dk, dv) in the input dtype and shapes, plus dbias
    (summed to attn_bias's shape, in its dtype) when ``bias_requires_grad``. Pass the forward's
    o and lse and the same options. ``deterministic``: no order-dependent atomics (a separate
    dQ kernel), bitwise-reproducible dq on a GPU. ``dropout_row_offset``/``dropout_col_offset``: as
    :func:`attention_forward`'s."""
    return _backward(do, q, k, v, o, lse, spec, deterministic, bias_requires_grad,
                     _dropout_offsets(dropout_row_offset, dropout_col_offset), causal=causal,
                     key_padding_mask=key_padding_mask, dropout_p=dropout_p, softmax_scale=softmax_scale, seed=seed,
                     offset=offset, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                     attn_mask=attn_mask, attn_bias=attn_bias, causal_align=causal_align, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def run_backward(spec: KernelSpec, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, *, causal: bool | None = None, deterministic: bool | None = None,
                 bias_requires_grad: bool | None = None, **options: Any) -> tuple[torch.Tensor, ...]:
    """Backward with an explicit spec (used by the autotuner and for experiments with tiles);
    ``causal``, ``deterministic`` and ``bias_requires_grad`` default to the spec's flags."""
    kw = _explicit_options("run_backward", spec, causal, options)
    det = _spec_flag(spec, "deterministic") if deterministic is None else deterministic
    bg = _spec_flag(spec, "bias_grad") if bias_requires_grad is None else bias_requires_grad
    return _backward(do, q, k, v, o, lse, spec, det, bg, **kw)


def dropout_keep_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, *,
                      seed: int = 0, offset: int = 0) -> torch.Tensor:
    """The keep-mask the kernels apply, bool [B, H, Nq, Nk] (True = kept). Packed sequences use
    the same mask with max_seqlen: sequence b keeps ``mask[b, :, :len_q, :len_k]``."""
    return torch.from_numpy(keep_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed=seed, offset=offset))
