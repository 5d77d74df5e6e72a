"""Validation of the functional API's arguments: tensors, flags and the optional features.

Every check raises :class:`~fagen.errors.InputError` / :class:`~fagen.errors.InputTypeError`
naming the argument. The result is a :class:`Problem` (the runtime shape) and a
:class:`Features` (the validated optional inputs), from which :mod:`fagen.functional`
picks the spec and builds the kernel arguments. No kernel is touched here.
"""
from __future__ import annotations

import math
import numbers
import struct
import functools
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from .errors import InputError, InputTypeError, check_dropout_p
from .masking import CAUSAL_ALIGNS, check_causal_align, check_window
from .philox import drop_threshold
from .spec import HEAD_DIM_MAX, HEAD_DIM_MULTIPLE, SEQLEN_MAX

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
_U64 = 2**64
GRID_YZ_MAX = 65535


def padded_head_dim(d: int) -> int:
    """The head dim the kernels run with: ``d`` rounded up to a multiple of 8 (zeros appended)."""
    return -(-d // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


@dataclass(frozen=True)
class Problem:
    """Validated runtime shape of one attention call.

    ``head_dim`` is what the kernels run with (a multiple of 8); ``true_head_dim`` is the
    caller's (smaller when padded). Varlen calls have ``total_q``/``total_k`` (packed tokens),
    ``batch`` = number of sequences and ``seqlen_q``/``seqlen_k`` = the max_seqlen bounds.
    """

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    device: torch.device
    heads_kv: int = 0  # 0: as many as heads
    true_head_dim: int = 0  # 0: head_dim
    total_q: int | None = None
    total_k: int | None = None
    head_dim_v: int = 0  # v's (and o's, do's) head dim the kernels run with; 0: head_dim
    true_head_dim_v: int = 0  # the caller's; 0: true_head_dim

    def __post_init__(self) -> None:
        if not self.heads_kv:
            object.__setattr__(self, "heads_kv", self.heads)
        if not self.true_head_dim:
            object.__setattr__(self, "true_head_dim", self.head_dim)
        if not self.head_dim_v:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if not self.true_head_dim_v:
            object.__setattr__(self, "true_head_dim_v", self.true_head_dim)

    @property
    def varlen(self) -> bool:
        return self.total_q is not None

    @property
    def padded(self) -> bool:
        return self.true_head_dim != self.head_dim or self.true_head_dim_v != self.head_dim_v

    @property
    def split_dims(self) -> bool:
        """v (o, do) has a head dim of its own (``head_dim_v``, MLA: d_qk 192, d_v 128)."""
        return self.true_head_dim_v != self.true_head_dim

    @property
    def empty(self) -> bool:
        if 0 in (self.batch, self.heads):
            return True
        return self.total_q == 0 if self.varlen else self.seqlen_q == 0

    @property
    def no_keys(self) -> bool:
        """No query can see any key: zero output, lse = -inf, nothing to launch."""
        return self.total_k == 0 or self.seqlen_k == 0

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.heads, self.total_q) if self.varlen else (self.batch, self.heads, self.seqlen_q)


# --------------------------------------------------------------------------- small validators
def check_tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(name, "a torch.Tensor", type(t).__name__)
    return t


def validate_flag(name: str, value: Any) -> bool:
    """A flag must be a Python bool or a numpy bool_ (``causal="False"`` is an error, not True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(name, "a bool", f"{value!r} ({type(value).__name__})")
    return bool(value)


def _finite_f32(x: float) -> bool:
    try:
        return math.isfinite(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:  # beyond float32's range: it would be inf in the kernel
        return False


def validate_softmax_scale(softmax_scale: Any, name: str = "softmax_scale") -> float | None:
    """None, or a real number that stays finite in float32 (the kernels take the scale as a float)."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise InputTypeError(name, "a float or None", f"{softmax_scale!r} ({type(softmax_scale).__name__})")
    scale = float(softmax_scale)
    if not _finite_f32(scale):
        raise InputError(name, "a float that is finite in float32 (|scale| <= 3.4028235e38) or None", softmax_scale)
    return scale


def validate_softcap(softcap: Any) -> float:
    """A float >= 0 finite in float32; 0 turns it off."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise InputTypeError("softcap", "a float >= 0 (0 = off)", f"{softcap!r} ({type(softcap).__name__})")
    value = float(softcap)
    if not (value >= 0 and _finite_f32(value)):
        raise InputError("softcap", "a float >= 0 that is finite in float32 (0 = off)", softcap)
    return value


def _is_int(x: Any) -> bool:
    return isinstance(x, (numbers.Integral, np.integer, torch.SymInt)) and not isinstance(x, (bool, np.bool_))


def validate_window_size(window_size: Any) -> tuple[int, int]:
    """``(left, right)``: two ints >= -1 (-1 = unbounded on that side); :func:`fagen.masking.check_window`."""
    return check_window(window_size, "window_size")


def validate_causal_align(causal_align: Any) -> str:
    return check_causal_align(causal_align, "causal_align")


# --------------------------------------------------------------------------- q, k, v
def _common_checks(q: Any, k: Any, v: Any, ndim: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != ndim:
            raise InputError(name, f"a {ndim}-D tensor {layout}", f"shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise InputTypeError(name, "dtype float16, bfloat16, float32 or float64", t.dtype)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InputTypeError("k" if k.dtype != q.dtype else "v", f"the same dtype as q ({q.dtype})",
                             k.dtype if k.dtype != q.dtype else v.dtype)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise InputError(name, f"the same device as q ({q.device})", t.device)
    if q.device.type not in ("cpu", "cuda", "meta"):
        raise InputError("q", "a CPU, CUDA or meta tensor", q.device)


def _check_heads_and_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout_k: str) -> tuple[int, int, int]:
    H, d = q.shape[-2], q.shape[-1]
    Hkv = k.shape[-2]
    if k.shape[-1] != d:
        raise InputError("k", f"head_dim {d} like q ({layout_k})", tuple(k.shape))
    if Hkv == 0 and H != 0 or Hkv and H % Hkv:
        raise InputError("k", f"a number of heads that divides q's {H} (grouped-query attention: "
                         f"H_q a multiple of H_kv; {layout_k})", f"{Hkv} heads")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise InputError("v", f"the shape of k {tuple(k.shape)} but for its head dim", f"{tuple(v.shape)}")
    if not 1 <= d <= HEAD_DIM_MAX:
        raise InputError("q", f"head_dim in 1..{HEAD_DIM_MAX} (padded internally to a multiple of "
                         f"{HEAD_DIM_MULTIPLE})", d)
    if not 1 <= v.shape[-1] <= HEAD_DIM_MAX:
        raise InputError("v", f"head_dim in 1..{HEAD_DIM_MAX} (padded internally to a multiple of "
                         f"{HEAD_DIM_MULTIPLE})", v.shape[-1])
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and t.shape[-1] != 1 and t.stride(-1) != 1:  # a size-1 dim: any stride
            raise InputError(name, "a contiguous last dimension (stride 1)", f"stride {t.stride(-1)}")
    if H > GRID_YZ_MAX:  # heads are the grid's z
        raise InputError("q", f"heads at most {GRID_YZ_MAX} (CUDA grid z limit)", H)
    return H, Hkv, d


def _check_seqlen(name: str, n: int) -> None:
    if n > SEQLEN_MAX:
        raise InputError(name, f"a sequence length at most {SEQLEN_MAX} (2**31 - 2**16: 32-bit row indices)", n)


def validate_qkv(q: Any, k: Any, v: Any) -> Problem:
    """Check q [B, Nq, H, d], k and v [B, Nk, H_kv, d] (H a multiple of H_kv; d in 1..256); the shape."""
    _common_checks(q, k, v, 4, "[batch, seqlen, heads, head_dim]")
    B, Nq = q.shape[0], q.shape[1]
    if k.shape[0] != B:
        raise InputError("k", f"shape [{B}, Nk, H_kv, {q.shape[3]}] matching q", f"{tuple(k.shape)}")
    H, Hkv, d = _check_heads_and_dim(q, k, v, "[B, Nk, H_kv, d]")
    if B > GRID_YZ_MAX:  # batch is the grid's y
        raise InputError("q", f"batch and heads at most {GRID_YZ_MAX} (CUDA grid y/z limit)", f"{B} x {H}")
    for name, n in (("q", Nq), ("k", k.shape[1])):
        _check_seqlen(name, n)
    return Problem(B, H, Nq, k.shape[1], padded_head_dim(d), DTYPES[q.dtype], q.device, heads_kv=Hkv,
                   true_head_dim=d, head_dim_v=padded_head_dim(v.shape[-1]), true_head_dim_v=v.shape[-1])


def check_cu_values(p: Problem, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """The cumulative lengths of a packed call: 0 first, non-decreasing, last = the total tokens,
    no sequence longer than max_seqlen. Read on the host only for CPU tensors (through numpy,
    no copy); meta tensors have no values. CUDA ones are never read (no synchronisation):
    their bounds are the caller's contract, as in flash-attn."""
    for name, cu, total, mname, mval in (("cu_seqlens_q", cu_seqlens_q, p.total_q, "max_seqlen_q", p.seqlen_q),
                                         ("cu_seqlens_k", cu_seqlens_k, p.total_k, "max_seqlen_k", p.seqlen_k)):
        if cu.device.type != "cpu":
            continue
        vals = cu.detach().numpy()
        if vals[0] != 0 or vals[-1] != total:
            raise InputError(name, f"cumulative lengths from 0 to the total tokens ({total})",
                             f"first {int(vals[0])}, last {int(vals[-1])}")
        lengths = np.diff(vals.astype(np.int64))
        if (lengths < 0).any():
            raise InputError(name, "non-decreasing cumulative lengths", [int(x) for x in vals])
        if lengths.size and int(lengths.max()) > mval:
            raise InputError(mname, f"at least the longest sequence ({int(lengths.max())})", mval)


def validate_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                    max_seqlen_k: Any, *, check_values: bool = True) -> Problem:
    """Packed sequences: q [total_q, H, d], k/v [total_k, H_kv, d], cu_seqlens int32 [B + 1] on q's
    device (0 first, non-decreasing, last = total), max_seqlen_* ints at least every length
    (the values are checked by :func:`check_cu_values` when ``check_values``: CPU tensors only)."""
    _common_checks(q, k, v, 3, "[total_tokens, heads, head_dim] (packed sequences)")
    H, Hkv, d = _check_heads_and_dim(q, k, v, "[total_k, H_kv, d]")
    batch = None
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        check_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise InputTypeError(name, "dtype torch.int32", cu.dtype)
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise InputError(name, "a 1-D tensor [batch + 1] of cumulative sequence lengths", tuple(cu.shape))
        if cu.device != q.device:
            raise InputError(name, f"the same device as q ({q.device})", cu.device)
        if batch is None:
            batch = cu.shape[0] - 1
        elif cu.shape[0] - 1 != batch:
            raise InputError(name, f"{batch + 1} entries like cu_seqlens_q", cu.shape[0])
    if batch > GRID_YZ_MAX:
        raise InputError("cu_seqlens_q", f"at most {GRID_YZ_MAX} sequences (CUDA grid y limit)", batch)
    maxes = []
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(m) or int(m) < 0:
            raise InputError(name, "an int >= 0 (the longest sequence)", repr(m))
        _check_seqlen(name, int(m))
        maxes.append(int(m))
    p = Problem(batch, H, maxes[0], maxes[1], padded_head_dim(d), DTYPES[q.dtype], q.device, heads_kv=Hkv,
                true_head_dim=d, total_q=q.shape[0], total_k=k.shape[0], head_dim_v=padded_head_dim(v.shape[-1]),
                true_head_dim_v=v.shape[-1])
    if check_values:
        check_cu_values(p, cu_seqlens_q, cu_seqlens_k)
    return p


def check_like(name: str, t: Any, ref: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``t`` has ref's dtype and device, a contiguous last dim and ref's shape (or ``shape``)."""
    check_tensor(name, t)
    want = tuple(ref.shape) if shape is None else tuple(shape)
    if tuple(t.shape) != want:
        raise InputError(name, f"shape {want} (like q{'' if shape is None else ', with v head dim'})",
                         f"{tuple(t.shape)}")
    if t.dtype != ref.dtype:
        raise InputTypeError(name, f"dtype {ref.dtype} (like q)", t.dtype)
    if t.device != ref.device:
        raise InputError(name, f"the same device as q ({ref.device})", t.device)
    if t.numel() and t.shape[-1] != 1 and t.stride(-1) != 1:  # a size-1 dim: any stride
        raise InputError(name, "a contiguous last dimension (stride 1)", f"stride {t.stride(-1)}")
    return t


def check_lse(lse: Any, p: Problem, name: str = "lse") -> None:
    """``lse`` (or, with ``name``, a tensor shaped like it: ``dlse``): float32 (float64 for float64
    inputs), lse's shape, q's device. The caller decides whether it needs a contiguous copy."""
    check_tensor(name, lse)
    like, shape = ("", "shape") if name == "lse" else (", like lse", "lse's shape")
    if lse.dtype != torch.float32 and not (lse.dtype == torch.float64 and p.dtype == "float64"):
        raise InputTypeError(name, f"dtype float32 (float32 or float64 for float64 inputs){like}", lse.dtype)
    if tuple(lse.shape) != p.lse_shape:
        layout = "[H, total_q]" if p.varlen else "[B, H, Nq]"
        raise InputError(name, f"{shape} {layout} = {list(p.lse_shape)}", f"{list(lse.shape)}")
    if lse.device != p.device:
        raise InputError(name, f"the same device as q ({p.device})", lse.device)


# --------------------------------------------------------------------------- optional inputs
def validate_key_padding_mask(mask: Any, p: Problem) -> torch.Tensor | None:
    """None, or a contiguous bool [B, Nk] mask on q's device."""
    if mask is None:
        return None
    check_tensor("key_padding_mask", mask)
    if p.varlen:
        raise InputError("key_padding_mask", "None with packed sequences (cu_seqlens give the lengths)", "a mask")
    if mask.dtype != torch.bool:
        raise InputTypeError("key_padding_mask", "dtype torch.bool (True = key takes part)", mask.dtype)
    if tuple(mask.shape) != (p.batch, p.seqlen_k):
        raise InputError("key_padding_mask", f"shape [B, Nk] = {[p.batch, p.seqlen_k]}", f"{list(mask.shape)}")
    if mask.device != p.device:
        raise InputError("key_padding_mask", f"the same device as q ({p.device})", mask.device)
    return mask.contiguous()


def validate_alibi_slopes(slopes: Any, p: Problem) -> torch.Tensor | None:
    """None, or float32 slopes [H] or [B, H] on q's device (returned with a contiguous last dim)."""
    if slopes is None:
        return None
    check_tensor("alibi_slopes", slopes)
    if slopes.dtype != torch.float32:
        raise InputTypeError("alibi_slopes", "dtype torch.float32", slopes.dtype)
    if tuple(slopes.shape) not in ((p.heads,), (p.batch, p.heads)):
        raise InputError("alibi_slopes", f"shape [H] = [{p.heads}] or [B, H] = [{p.batch}, {p.heads}]",
                         list(slopes.shape))
    if slopes.device != p.device:
        raise InputError("alibi_slopes", f"the same device as q ({p.device})", slopes.device)
    return slopes if slopes.numel() == 0 or slopes.stride(-1) == 1 else slopes.contiguous()


def validate_sinks(sinks: Any, p: Problem) -> torch.Tensor | None:
    """None, or float32 attention-sink logits [H] (one per q head) on q's device, contiguous."""
    if sinks is None:
        return None
    check_tensor("sinks", sinks)
    if sinks.dtype != torch.float32:
        raise InputTypeError("sinks", "dtype torch.float32 (one logit per query head)", sinks.dtype)
    if tuple(sinks.shape) != (p.heads,):
        raise InputError("sinks", f"shape [H] = [{p.heads}] (one logit per query head)", list(sinks.shape))
    if sinks.device != p.device:
        raise InputError("sinks", f"the same device as q ({p.device})", sinks.device)
    return sinks if sinks.numel() <= 1 or sinks.stride(0) == 1 else sinks.contiguous()


def _broadcast4(name: str, t: torch.Tensor, p: Problem) -> torch.Tensor:
    """``t`` expanded (a view: stride 0 on broadcast dims) to [B, H, Nq, Nk]."""
    target = (p.batch, p.heads, p.seqlen_q, p.seqlen_k)
    shape = tuple(t.shape)
    if p.varlen:
        raise InputError(name, "None with packed sequences (cu_seqlens)", f"shape {list(shape)}")
    if len(shape) > 4 or any(s not in (1, n) for s, n in zip(reversed(shape), reversed(target))):
        raise InputError(name, f"a shape broadcastable to [B, H, Nq, Nk] = {list(target)}", f"shape {list(shape)}")
    if t.device != p.device:
        raise InputError(name, f"the same device as q ({p.device})", t.device)
    return t.reshape((1,) * (4 - len(shape)) + shape).expand(target)


def validate_attn_mask(mask: Any, p: Problem) -> torch.Tensor | None:
    """None, or a bool mask broadcastable to [B, H, Nq, Nk] (True = the pair takes part), returned
    as a uint8 view expanded to [B, H, Nq, Nk] (stride 0 on broadcast dims, nothing copied)."""
    if mask is None:
        return None
    check_tensor("attn_mask", mask)
    if mask.dtype != torch.bool:
        raise InputTypeError("attn_mask", "dtype torch.bool (True = take part); pass a float mask as attn_bias",
                             mask.dtype)
    mask = _broadcast4("attn_mask", mask, p)
    return mask.view(torch.uint8) if mask.device.type != "meta" else mask


def validate_attn_bias(bias: Any, p: Problem, dtype: torch.dtype) -> torch.Tensor | None:
    """None, or an additive float bias of q's dtype broadcastable to [B, H, Nq, Nk], returned
    expanded to [B, H, Nq, Nk] (a view)."""
    if bias is None:
        return None
    check_tensor("attn_bias", bias)
    if bias.dtype != dtype:
        raise InputTypeError("attn_bias", f"dtype {dtype} (like q)", bias.dtype)
    return _broadcast4("attn_bias", bias, p)


def reduce_to_shape(full: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum a [B, H, Nq, Nk] gradient over the dims ``shape`` broadcasts (the bias's gradient)."""
    lead = full.dim() - len(shape)
    g = full.sum(dim=tuple(range(lead))) if lead else full
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    return g.reshape(shape)


_OP = "op"  # dataclass field metadata: the field's arguments in the custom ops' schema


@dataclass(frozen=True)
class AttentionOptions:
    """The scalar options of one attention call, validated once when built.

    Every entry point builds one (typed errors naming the argument); from it come the spec's
    feature flags (:meth:`Features.spec_fields`), the kernels' scalar arguments
    (:meth:`kernel_args`), the custom ops' schema (:meth:`schema`, :meth:`op_args`,
    :meth:`from_op_args`) and the reference's arguments (:meth:`reference_kwargs`).
    ``deterministic`` only changes the backward. The tensors of a call (masks, biases, slopes,
    cu_seqlens) are data, not options: they travel next to it.
    """

    causal: bool = field(default=False, metadata={_OP: (("bool", "causal", "False"),)})
    dropout_p: float = field(default=0.0, metadata={_OP: (("float", "dropout_p", "0."),)})
    softmax_scale: float | None = field(default=None, metadata={_OP: (("float?", "softmax_scale", "None"),)})
    window_size: tuple[int, int] = field(default=(-1, -1), metadata={
        _OP: (("SymInt", "window_left", "-1"), ("SymInt", "window_right", "-1"))})
    softcap: float = field(default=0.0, metadata={_OP: (("float", "softcap", "0."),)})
    causal_align: str = field(default="bottom_right", metadata={_OP: (("str", "causal_align", '"bottom_right"'),)})
    deterministic: bool = field(default=False, metadata={_OP: (("bool", "deterministic", "False"),)})

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "causal", validate_flag("causal", self.causal))
        put(self, "dropout_p", check_dropout_p(self.dropout_p))
        put(self, "softmax_scale", validate_softmax_scale(self.softmax_scale))
        put(self, "window_size", validate_window_size(self.window_size))
        put(self, "softcap", validate_softcap(self.softcap))
        put(self, "causal_align", validate_causal_align(self.causal_align))
        put(self, "deterministic", validate_flag("deterministic", self.deterministic))

    @classmethod
    def of(cls, **options: Any) -> AttentionOptions:
        """``AttentionOptions(**options)``, remembered for hashable arguments (keyed by type and
        value, so ``causal=1`` is refused even after ``causal=True`` was seen)."""
        if torch.compiler.is_compiling():  # traced: built (and checked) while tracing, no memo
            return cls(**options)
        try:
            return _options_memo(tuple((n, type(v), v) for n, v in options.items()))
        except TypeError as err:  # unhashable (a list window): built and checked every time
            if "unhashable" not in str(err):
                raise
            return cls(**options)

    # ----------------------------------------------------------------- custom-op schema
    @classmethod
    def schema_fields(cls) -> tuple[tuple[str, str, str], ...]:
        """(schema type, argument name, default) of each custom-op argument of the options, in
        field order (the window is two: window_left, window_right)."""
        return tuple(x for f in fields(cls) for x in f.metadata[_OP])

    @classmethod
    def op_names(cls) -> tuple[str, ...]:
        """The names of :meth:`op_args`, in order."""
        return tuple(n for _, n, _ in cls.schema_fields())

    def op_args(self) -> tuple[Any, ...]:
        """The values of :meth:`schema`'s arguments, in order."""
        return (self.causal, self.dropout_p, self.softmax_scale, *self.window_size, self.softcap, self.causal_align,
                self.deterministic)

    @classmethod
    def from_op_args(cls, *args: Any) -> AttentionOptions:
        """The inverse of :meth:`op_args` (validated: the ops may be called directly). The values
        come through the dispatcher, which gives each the schema's type, so they key a memo."""
        typed = tuple([(type(a), a) for a in args])
        if torch.compiler.is_compiling():  # traced: built (and checked) while tracing, no memo
            return _from_op_args_memo.__wrapped__(typed)
        try:
            return _from_op_args_memo(typed)
        except TypeError as err:
            if "unhashable" not in str(err):
                raise
            return _from_op_args_memo.__wrapped__(typed)

    # ----------------------------------------------------------------- derived values
    def scale(self, head_dim: int) -> float:
        """The softmax scale: the given one, else ``1 / sqrt(head_dim)`` (the caller's head dim)."""
        return 1.0 / math.sqrt(head_dim) if self.softmax_scale is None else self.softmax_scale

    def window(self, seqlen_k: int) -> tuple[int, int]:
        """The effective window, flash-attn's rules: a side >= Nk (max_seqlen_k when packed) is
        unbounded; causal means right = 0; (-1, -1) when nothing bounds it."""
        left, right = self.window_size
        if left >= seqlen_k:
            left = -1
        if right >= seqlen_k:
            right = -1
        if self.causal:
            right = 0
        return (left, right) if left >= 0 or right >= 0 else (-1, -1)

    def kernel_args(self, p: Problem) -> dict[str, Any]:
        """The kernels' scalar option arguments (fagen.abi): scale, window, softcap, dropout."""
        left, right = self.window(p.seqlen_k)
        if self.causal and left < 0:  # causal alone: the causal flag bounds it, no window
            left, right = -1, -1
        p_drop = self.dropout_p
        return {"scale": self.scale(p.true_head_dim), "window_left": left, "window_right": right,
                "softcap": self.softcap, "drop_threshold": drop_threshold(p_drop), "rp_keep": 1.0 / (1.0 - p_drop)}

    def reference_kwargs(self) -> dict[str, Any]:
        """The arguments of :mod:`fagen.reference`'s functions that these options set."""
        return {"causal": self.causal, "dropout_p": self.dropout_p, "softmax_scale": self.softmax_scale,
                "window_size": self.window_size, "softcap": self.softcap, "causal_align": self.causal_align}


@functools.lru_cache(maxsize=256)
def _from_op_args_memo(typed: tuple[tuple[type, Any], ...]) -> AttentionOptions:
    causal, dropout_p, softmax_scale, left, right, softcap, causal_align, deterministic = (a for _, a in typed)
    return AttentionOptions(causal=causal, dropout_p=dropout_p, softmax_scale=softmax_scale, window_size=(left, right),
                            softcap=softcap, causal_align=causal_align, deterministic=deterministic)


@functools.lru_cache(maxsize=256)
def _options_memo(key: tuple[tuple[str, type, Any], ...]) -> AttentionOptions:
    return AttentionOptions(**{n: v for n, _, v in key})


@dataclass(frozen=True)
class Features:
    """The validated optional inputs of one call (runtime values; flags derive from them)."""

    causal: bool = False
    causal_align: str = "bottom_right"
    window: tuple[int, int] = (-1, -1)  # effective (causal folded in: right = 0)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    key_padding_mask: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None  # uint8 [B, H, Nq, Nk] view
    attn_bias: torch.Tensor | None = None  # [B, H, Nq, Nk] view, q's dtype
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    dropout_p: float = 0.0
    scale: float = 1.0
    deterministic: bool = False
    sinks: torch.Tensor | None = None  # fp32 [H]

    @property
    def uses_window(self) -> bool:
        return self.window != (-1, -1) and not (self.causal and self.window[0] < 0)

    def spec_fields(self, p: Problem, direction: str = "fwd", bias_grad: bool = False) -> dict[str, Any]:
        """The spec's feature flags (non-default ones only, so a spec without them stays as it was)."""
        flags: dict[str, Any] = {
            "causal": self.causal, "key_padding": self.key_padding_mask is not None, "dropout": self.dropout_p > 0,
        }
        extra = {
            "window": self.uses_window, "softcap": self.softcap > 0, "alibi": self.alibi_slopes is not None,
            "attn_mask": self.attn_mask is not None, "bias": self.attn_bias is not None, "varlen": p.varlen,
        }
        if p.split_dims:
            flags["head_dim_v"] = p.head_dim_v
        if direction == "bwd":
            extra.update(deterministic=self.deterministic, bias_grad=bias_grad)
        else:  # the backward reads the sink through lse: no flag
            extra.update(sinks=self.sinks is not None)
        flags.update({k: True for k, on in extra.items() if on})
        # the alignment only matters where the diagonal does, and not at all when Nq == Nk
        diagonal = self.causal or self.uses_window or self.alibi_slopes is not None
        if self.causal_align != "bottom_right" and diagonal and (p.varlen or p.seqlen_q != p.seqlen_k):
            flags["causal_align"] = self.causal_align
        return flags


def validate_features(p: Problem, dtype: torch.dtype, opts: AttentionOptions, *, key_padding_mask: Any = None,
                      alibi_slopes: Any = None, attn_mask: Any = None, attn_bias: Any = None,
                      cu_seqlens_q: Any = None, cu_seqlens_k: Any = None, sinks: Any = None) -> Features:
    """Every optional tensor checked against the problem, with the options resolved for it
    (flash-attn's window rules: causal means right = 0; a side >= Nk is unbounded)."""
    return Features(
        causal=opts.causal, causal_align=opts.causal_align, window=opts.window(p.seqlen_k), softcap=opts.softcap,
        alibi_slopes=validate_alibi_slopes(alibi_slopes, p),
        key_padding_mask=validate_key_padding_mask(key_padding_mask, p), attn_mask=validate_attn_mask(attn_mask, p),
        attn_bias=validate_attn_bias(attn_bias, p, dtype), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        dropout_p=opts.dropout_p, scale=opts.scale(p.true_head_dim), deterministic=opts.deterministic,
        sinks=validate_sinks(sinks, p))


def check_seed_offset(seed: Any, offset: Any) -> tuple[int, int]:
    """The dropout key: two ints in [0, 2**64)."""
    if type(seed) is int and type(offset) is int and 0 <= seed < _U64 and 0 <= offset < _U64:
        return seed, offset
    for name, val in (("seed", seed), ("offset", offset)):
        if not _is_int(val) or not (0 <= int(val) < _U64):
            raise InputError(name, "an integer in [0, 2**64)", val)
    return int(seed), int(offset)
