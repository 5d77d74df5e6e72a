"""Functional API on torch tensors: validation, spec selection, launches.

Layout: q, o, do [B, Nq, H, d]; k, v [B, Nk, H, d] (any batch/seq/head strides,
contiguous last dim); lse float32 [B, H, Nq]; key_padding_mask bool [B, Nk]
(True = the key takes part); causal is bottom-right aligned. CUDA tensors run
the NVRTC cubin through CuPy, CPU tensors run the same source in the emulator.
"""
from __future__ import annotations

import functools
import math
import numbers
import struct
from dataclasses import dataclass
from typing import Any

import torch

from .abi import neutral_args
from .choices import tuned_or_default
from .errors import InputError, InputTypeError, check_dropout_p
from .philox import drop_threshold, keep_mask
from .renderer import KernelInfo, kernel_infos
from .runtime import get_module
from .spec import HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_MULTIPLE, SEQLEN_MAX, KernelSpec

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_U64 = 2**64
_GRID_YZ_MAX = 65535
#: Longest sequence: kernels index rows and keys with 32-bit ints, including up to one tile past the
#: end (the longest tile of any family is far below 2**16), so a length must leave that much headroom.


@dataclass(frozen=True)
class Problem:
    """Validated runtime shape of one attention call."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    device: torch.device

    @property
    def empty(self) -> bool:
        return 0 in (self.batch, self.heads, self.seqlen_q)


# --------------------------------------------------------------------------- validation
def _check_tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(name, "a torch.Tensor", type(t).__name__)
    return t


def validate_qkv(q: Any, k: Any, v: Any) -> Problem:
    """Check q, k, v (types, dtypes, shapes, devices, head dim, strides); the runtime shape."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.dim() != 4:
            raise InputError(name, "a 4-D tensor [batch, seqlen, heads, head_dim]", f"shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise InputTypeError(name, "dtype float16, bfloat16 or float32", t.dtype)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InputTypeError("k" if k.dtype != q.dtype else "v", f"the same dtype as q ({q.dtype})",
                             k.dtype if k.dtype != q.dtype else v.dtype)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise InputError(name, f"the same device as q ({q.device})", t.device)
    B, Nq, H, d = q.shape
    if k.shape[0] != B or k.shape[2] != H or k.shape[3] != d:
        raise InputError("k", f"shape [{B}, Nk, {H}, {d}] matching q", f"{tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise InputError("v", f"the shape of k {tuple(k.shape)}", f"{tuple(v.shape)}")
    if not (HEAD_DIM_MIN <= d <= HEAD_DIM_MAX) or d % HEAD_DIM_MULTIPLE:
        raise InputError("q", f"head_dim a multiple of {HEAD_DIM_MULTIPLE} in {HEAD_DIM_MIN}..{HEAD_DIM_MAX}", d)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and t.stride(-1) != 1:
            raise InputError(name, "a contiguous last dimension (stride 1)", f"stride {t.stride(-1)}")
    if q.device.type not in ("cpu", "cuda", "meta"):
        raise InputError("q", "a CPU, CUDA or meta tensor", q.device)
    if B > _GRID_YZ_MAX or H > _GRID_YZ_MAX:  # batch and heads are grid y and z
        raise InputError("q", f"batch and heads at most {_GRID_YZ_MAX} (CUDA grid y/z limit)", f"{B} x {H}")
    for name, n in (("q", Nq), ("k", k.shape[1])):
        if n > SEQLEN_MAX:
            raise InputError(name, f"a sequence length at most {SEQLEN_MAX} (2**31 - 2**16: 32-bit row indices)", n)
    return Problem(B, H, Nq, k.shape[1], d, _DTYPES[q.dtype], q.device)


def _check_like(name: str, t: Any, ref: torch.Tensor) -> torch.Tensor:
    _check_tensor(name, t)
    if tuple(t.shape) != tuple(ref.shape):
        raise InputError(name, f"shape {tuple(ref.shape)} (like q)", f"{tuple(t.shape)}")
    if t.dtype != ref.dtype:
        raise InputTypeError(name, f"dtype {ref.dtype} (like q)", t.dtype)
    if t.device != ref.device:
        raise InputError(name, f"the same device as q ({ref.device})", t.device)
    if t.numel() and t.stride(-1) != 1:
        raise InputError(name, "a contiguous last dimension (stride 1)", f"stride {t.stride(-1)}")
    return t


def _check_lse(lse: Any, p: Problem) -> torch.Tensor:
    _check_tensor("lse", lse)
    if lse.dtype != torch.float32:
        raise InputTypeError("lse", "dtype float32", lse.dtype)
    if tuple(lse.shape) != (p.batch, p.heads, p.seqlen_q):
        raise InputError("lse", f"shape [B, H, Nq] = {[p.batch, p.heads, p.seqlen_q]}", f"{list(lse.shape)}")
    if lse.device != p.device:
        raise InputError("lse", f"the same device as q ({p.device})", lse.device)
    return lse.contiguous()


def validate_key_padding_mask(mask: Any, p: Problem) -> torch.Tensor | None:
    """None, or a contiguous bool [B, Nk] mask on q's device."""
    if mask is None:
        return None
    _check_tensor("key_padding_mask", mask)
    if mask.dtype != torch.bool:
        raise InputTypeError("key_padding_mask", "dtype torch.bool (True = key takes part)", mask.dtype)
    if tuple(mask.shape) != (p.batch, p.seqlen_k):
        raise InputError("key_padding_mask", f"shape [B, Nk] = {[p.batch, p.seqlen_k]}", f"{list(mask.shape)}")
    if mask.device != p.device:
        raise InputError("key_padding_mask", f"the same device as q ({p.device})", mask.device)
    return mask.contiguous()


def validate_flag(name: str, value: Any) -> bool:
    """A flag must be a Python bool or a numpy bool_ (``causal="False"`` is an error, not True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(name, "a bool", f"{value!r} ({type(value).__name__})")
    return bool(value)


def validate_softmax_scale(softmax_scale: Any, name: str = "softmax_scale") -> float | None:
    """None, or a real number that stays finite in float32 (the kernels take the scale as a float)."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise InputTypeError(name, "a float or None", f"{softmax_scale!r} ({type(softmax_scale).__name__})")
    scale = float(softmax_scale)
    try:
        finite = math.isfinite(struct.unpack("f", struct.pack("f", scale))[0])
    except OverflowError:  # beyond float32's range: it would be inf in the kernel
        finite = False
    if not finite:
        raise InputError(name, "a float that is finite in float32 (|scale| <= 3.4028235e38) or None", softmax_scale)
    return scale


def _check_scalars(dropout_p: Any, softmax_scale: Any, seed: Any, offset: Any, head_dim: int) -> float:
    check_dropout_p(dropout_p)
    for name, val in (("seed", seed), ("offset", offset)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or not (0 <= int(val) < _U64):
            raise InputError(name, "an integer in [0, 2**64)", val)
    scale = validate_softmax_scale(softmax_scale)
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


# --------------------------------------------------------------------------- spec choice
def default_arch(device: torch.device) -> str:
    if device.type == "cuda":
        from .runtime.gpu import device_arch

        return device_arch(device)
    return "sm_90"  # the emulator runs any arch; tiles follow sm_90's M


@functools.lru_cache(maxsize=512)
def _default_spec(direction: str, head_dim: int, dtype: str, causal: bool, key_padding: bool, dropout: bool,
                  arch: str) -> KernelSpec:
    return KernelSpec(direction=direction, head_dim=head_dim, dtype=dtype, causal=causal,
                      key_padding=key_padding, dropout=dropout, arch=arch)


def spec_for(direction: str, p: Problem, *, causal: bool, key_padding: bool, dropout: bool) -> KernelSpec:
    """The spec of the inputs: default tiles, or a tuned choice when one is recorded."""
    spec = _default_spec(direction, p.head_dim, p.dtype, causal, key_padding, dropout, default_arch(p.device))
    return tuned_or_default(spec, batch=p.batch, heads=p.heads, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, device=p.device)


@functools.lru_cache(maxsize=512)
def _kernels(spec: KernelSpec) -> dict[str, KernelInfo]:
    """The spec's entry points by role, without rendering its source (a first call stays cheap)."""
    return {k.role.name: k for k in kernel_infos(spec)}


def _strides(name: str, t: torch.Tensor) -> dict[str, int]:
    return {f"stride_{name}_b": t.stride(0), f"stride_{name}_s": t.stride(1), f"stride_{name}_h": t.stride(2)}


def _dropout_args(dropout_p: float, seed: int, offset: int) -> dict[str, Any]:
    return {"seed": seed, "offset": offset, "drop_threshold": drop_threshold(dropout_p),
            "rp_keep": 1.0 / (1.0 - dropout_p)}


def _check_spec(spec: KernelSpec, direction: str, p: Problem, mask: torch.Tensor | None, dropout_p: float) -> None:
    """An explicit spec must match the tensors (causal comes from the spec itself)."""
    if spec.direction != direction:
        raise InputError("spec", f"a {direction} spec", spec.direction)
    if spec.head_dim != p.head_dim or spec.dtype != p.dtype:
        raise InputError("spec", f"head_dim={p.head_dim}, dtype={p.dtype} (from the tensors)", f"{spec.head_dim}, {spec.dtype}")
    if (mask is not None) != spec.key_padding:
        raise InputError("key_padding_mask", "a mask exactly when spec.key_padding is set", mask is not None)
    if dropout_p > 0 and not spec.dropout:
        raise InputError("dropout_p", "0 for a spec compiled without dropout", dropout_p)


# --------------------------------------------------------------------------- forward
def _launch_forward(spec: KernelSpec, p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, dropout_p: float, scale: float, seed: int,
                    offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_spec(spec, "fwd", p, mask, dropout_p)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((p.batch, p.heads, p.seqlen_q), dtype=torch.float32, device=q.device)
    if p.empty or p.device.type == "meta":  # meta: shapes only
        return o, lse
    if p.seqlen_k == 0:
        return o.zero_(), lse.fill_(-math.inf)
    kern = _kernels(spec)["main"]
    args = {**neutral_args(heads=p.heads, seqlen_q=p.seqlen_q),
            "q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "kpm": mask.data_ptr() if mask is not None else 0,
            "o": o.data_ptr(), "lse": lse.data_ptr(), "heads": p.heads, "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k,
            "scale": scale, **_strides("q", q), **_strides("k", k), **_strides("v", v), **_strides("o", o),
            **_dropout_args(dropout_p, seed, offset)}
    get_module(spec, p.device.type).launch(kern, kern.grid(p.batch, p.heads, p.seqlen_q, p.seqlen_k), args)
    return o, lse


def run_forward(spec: KernelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                softmax_scale: float | None = None, seed: int = 0, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward with an explicit spec (used by the autotuner and for experiments with tiles)."""
    p = validate_qkv(q, k, v)
    scale = _check_scalars(dropout_p, softmax_scale, seed, offset, p.head_dim)
    mask = validate_key_padding_mask(key_padding_mask, p)
    return _launch_forward(spec, p, q, k, v, mask, float(dropout_p), scale, int(seed), int(offset))


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      softmax_scale: float | None = None, seed: int = 0, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward: returns (o [B, Nq, H, d], lse float32 [B, H, Nq])."""
    p = validate_qkv(q, k, v)
    scale = _check_scalars(dropout_p, softmax_scale, seed, offset, p.head_dim)
    mask = validate_key_padding_mask(key_padding_mask, p)
    spec = spec_for("fwd", p, causal=validate_flag("causal", causal), key_padding=mask is not None,
                    dropout=float(dropout_p) > 0)
    return _launch_forward(spec, p, q, k, v, mask, float(dropout_p), scale, int(seed), int(offset))


# --------------------------------------------------------------------------- backward
def _launch_backward(spec: KernelSpec, p: Problem, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None,
                     dropout_p: float, scale: float, seed: int,
                     offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Algorithm 4: preprocess (D, dQ accumulator = 0), main, postprocess (dQ -> dtype)."""
    _check_like("o", o, q)
    _check_like("do", do, q)
    lse = _check_lse(lse, p)
    _check_spec(spec, "bwd", p, mask, dropout_p)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if p.device.type == "meta":  # shapes only
        return dq, dk, dv
    if p.empty or p.seqlen_k == 0:
        return dq.zero_(), dk, dv
    delta = torch.empty((p.batch, p.heads, p.seqlen_q), dtype=torch.float32, device=q.device)
    dq_accum = torch.empty((p.batch, p.seqlen_q, p.heads, p.head_dim), dtype=torch.float32, device=q.device)
    args = {
        **neutral_args(heads=p.heads, seqlen_q=p.seqlen_q),
        "q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": o.data_ptr(), "do_": do.data_ptr(),
        "lse": lse.data_ptr(), "delta": delta.data_ptr(), "dq_accum": dq_accum.data_ptr(),
        "kpm": mask.data_ptr() if mask is not None else 0,
        "dq": dq.data_ptr(), "dk": dk.data_ptr(), "dv": dv.data_ptr(),
        "heads": p.heads, "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "scale": scale,
        **_strides("q", q), **_strides("k", k), **_strides("v", v), **_strides("o", o), **_strides("do", do),
        **_strides("dq", dq), **_strides("dk", dk), **_strides("dv", dv),
        **_dropout_args(dropout_p, seed, offset),
    }
    mod = get_module(spec, p.device.type)
    kernels = _kernels(spec)
    for role in ("pre", "main", "post"):
        kern = kernels[role]
        mod.launch(kern, kern.grid(p.batch, p.heads, p.seqlen_q, p.seqlen_k), args)
    return dq, dk, dv


def run_backward(spec: KernelSpec, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, *, key_padding_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, softmax_scale: float | None = None, seed: int = 0,
                 offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward with an explicit spec (used by the autotuner and for experiments with tiles)."""
    p = validate_qkv(q, k, v)
    scale = _check_scalars(dropout_p, softmax_scale, seed, offset, p.head_dim)
    mask = validate_key_padding_mask(key_padding_mask, p)
    return _launch_backward(spec, p, do, q, k, v, o, lse, mask, float(dropout_p), scale, int(seed), int(offset))


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, *, causal: bool = False, key_padding_mask: torch.Tensor | None = None,
                       dropout_p: float = 0.0, softmax_scale: float | None = None, seed: int = 0,
                       offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention backward (Algorithm 4): returns (dq, dk, dv) in the input dtype and layout."""
    p = validate_qkv(q, k, v)
    scale = _check_scalars(dropout_p, softmax_scale, seed, offset, p.head_dim)
    mask = validate_key_padding_mask(key_padding_mask, p)
    spec = spec_for("bwd", p, causal=validate_flag("causal", causal), key_padding=mask is not None,
                    dropout=float(dropout_p) > 0)
    return _launch_backward(spec, p, do, q, k, v, o, lse, mask, float(dropout_p), scale, int(seed), int(offset))


def dropout_keep_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, *,
                      seed: int = 0, offset: int = 0) -> torch.Tensor:
    """The keep-mask the kernels apply, bool [B, H, Nq, Nk] (True = kept)."""
    return torch.from_numpy(keep_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed=seed, offset=offset))
