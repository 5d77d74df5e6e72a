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

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from pydantic import ValidationError

from .abi import DQ_COPIES, DQ_SEM, dq_sem_count
from .choices import tuned_or_default
from .arch import ARCH_SPECIFIC, arch_info
from .errors import InputError, InputTypeError
from .inputs import (SEQLEN_MAX, AttentionOptions, Features, Problem, check_cu_values, check_like,  # noqa: F401
                     check_lse, check_seed_offset, check_tensor, reduce_to_shape, validate_features, validate_flag, validate_qkv,
                     validate_softmax_scale, validate_varlen)
from .philox import keep_mask
from .plan import KernelInfo, ModulePlan, plan_of
from .runtime import get_module
from .runtime.args import LaunchArgs
from .settings import get_settings
from .spec import KernelSpec

__all__ = ["attention_forward", "attention_backward", "forward", "backward", "run_forward", "run_backward",
           "dropout_keep_mask", "spec_for", "default_arch", "validate", "AttentionOptions", "Tensors", "Problem",
           "SEQLEN_MAX", "clear_launch_plans"]

#: spec field -> the argument a caller passes for it (errors name the argument).
FIELD_ARGUMENT = {
    "causal": "causal", "key_padding": "key_padding_mask", "dropout": "dropout_p", "window": "window_size",
    "softcap": "softcap", "alibi": "alibi_slopes", "attn_mask": "attn_mask", "bias": "attn_bias",
    "bias_grad": "attn_bias", "varlen": "cu_seqlens_q", "deterministic": "deterministic",
    "causal_align": "causal_align", "sinks": "sinks", "head_dim_v": "v",
}


# --------------------------------------------------------------------------- spec choice
def default_arch(device: torch.device) -> str:
    if device.type == "cuda":
        from .runtime.gpu import device_arch

        return device_arch(device)
    emulate = get_settings().emulate_arch  # FAGEN_EMULATE_ARCH: the GPU whose choices CPU tensors take
    if emulate is None:
        return "sm_90"  # the emulator runs any arch; tiles follow sm_90's M
    return arch_info(emulate).cubin_arch  # sm_90a: a 9.0 GPU's sm_90, made arch-specific as on the GPU


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
    special = _arch_specific_spec(direction, p, arch, flags)
    if special is not None:
        return tuned_or_default(special, batch=p.batch, heads=p.heads, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k,
                                device=p.device)
    try:
        spec = _default_spec(direction, p.head_dim, p.dtype, arch, tuple(sorted(flags.items())))
    except ValidationError as err:
        raise _unsupported(direction, p, arch, flags, err) from None
    return tuned_or_default(spec, batch=p.batch, heads=p.heads, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, device=p.device)




def _arch_specific_spec(direction: str, p: Problem, arch: str, flags: dict[str, Any]) -> KernelSpec | None:
    """On a GPU whose generic arch has an arch-specific target: the default spec for that target
    when the family it picks needs it (takes the spec there, not on the generic arch); else None,
    and the generic arch's spec stands."""
    special = ARCH_SPECIFIC.get(arch)
    if p.device.type != "cuda" and get_settings().emulate_arch != special:
        special = None  # CPU tensors: only when FAGEN_EMULATE_ARCH names the arch-specific target
    if special is None:
        return None
    try:
        spec = _default_spec(direction, p.head_dim, p.dtype, special, tuple(sorted(flags.items())))
    except ValidationError:
        return None
    generic = dataclasses.replace(spec.family_spec, arch=arch)
    return spec if spec.family.unsupported_reason(generic) is not None else None


def _kernel(spec: KernelSpec, role: str) -> KernelInfo:
    return plan_of(spec).kernel(role)


def _spec_flag(spec: KernelSpec, field: str) -> Any:
    return getattr(spec, field, "bottom_right" if field == "causal_align" else False)


def _check_spec(spec: KernelSpec, direction: str, p: Problem, flags: dict[str, Any]) -> None:
    """An explicit spec must match the tensors and the options (causal comes from the spec itself)."""
    if spec.direction != direction:
        raise InputError("spec", f"a {direction} spec", spec.direction)
    if spec.head_dim != p.head_dim or spec.dtype != p.dtype:
        raise InputError("spec", f"head_dim={p.head_dim}, dtype={p.dtype} (from the tensors)", f"{spec.head_dim}, {spec.dtype}")
    if (spec.head_dim_v or spec.head_dim) != p.head_dim_v:
        raise InputError("spec", f"head_dim_v={p.head_dim_v} (v's head dim, from the tensors)", spec.head_dim_v)
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


#: The pointer argument of each optional tensor (:class:`Tensors` field) the kernels read.
_OPTIONAL_POINTERS = (("kpm", "key_padding_mask"), ("alibi_slopes", "alibi_slopes"), ("mask", "attn_mask"),
                      ("bias", "attn_bias"), ("cu_seqlens_q", "cu_seqlens_q"), ("cu_seqlens_k", "cu_seqlens_k"),
                      ("sinks", "sinks"))


def _null_pointers(t: "Tensors", names: tuple[tuple[str, str], ...]) -> tuple[dict[str, int], tuple[str, ...]]:
    """(the pointer arguments of the optional tensors ``t`` lacks, all 0: constants of the plan,
    as presence is part of its key; the pointer arguments of those it has, set per call)."""
    return ({arg: 0 for arg, field in names if getattr(t, field) is None},
            tuple(arg for arg, field in names if getattr(t, field) is not None))


def _strides(name: str, t: torch.Tensor, varlen: bool) -> dict[str, int]:
    """The batch/sequence/head strides; a size-1 dimension's is 0 (only index 0 is read, so
    whatever stride torch reports for it never matters)."""
    s = [0 if n == 1 else x for n, x in zip(t.shape, t.stride())]
    if varlen:  # [total, H, d]: the sequence offset comes from cu_seqlens, stride_b is ignored
        return {f"stride_{name}_b": 0, f"stride_{name}_s": s[0], f"stride_{name}_h": s[1]}
    return {f"stride_{name}_b": s[0], f"stride_{name}_s": s[1], f"stride_{name}_h": s[2]}


def _bhqk(name: str, t: torch.Tensor | None) -> dict[str, int]:
    s = (0, 0, 0, 0) if t is None else t.stride()
    return {f"stride_{name}_{x}": int(v) for x, v in zip("bhqk", s)}


def _feature_args(p: Problem, f: Features, lse_strides: tuple[int, ...],
                  dbias: torch.Tensor | None = None) -> dict[str, Any]:
    """The feature parameters of the ABI (fagen.abi) that do not change from call to call:
    heads, strides of the masks and biases (the pointers are set per call)."""
    slopes = f.alibi_slopes
    lse_b, lse_h = (0, lse_strides[0]) if p.varlen else lse_strides[:2]
    return {
        "heads_kv": p.heads_kv, "stride_alibi_b": slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
        **_bhqk("mask", f.attn_mask), **_bhqk("bias", f.attn_bias), "stride_lse_b": lse_b, "stride_lse_h": lse_h,
        **_bhqk("dbias", dbias),
    }


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


def _dims(p: Problem, v: bool) -> tuple[int, int]:
    """(the kernels' head dim, the caller's) of q/k (``v=False``) or of v, o, do (``v=True``)."""
    return (p.head_dim_v, p.true_head_dim_v) if v else (p.head_dim, p.true_head_dim)


def _pad(t: torch.Tensor, p: Problem, v: bool = False) -> torch.Tensor:
    """Zeros appended to the head dim up to the kernels' multiple of 8 (a copy only when padding).
    ``v``: a tensor of v's head dim (v, o, do)."""
    dim, true = _dims(p, v)
    return torch.nn.functional.pad(t, (0, dim - true)) if dim != true else t


def _padded_meta(t: torch.Tensor, p: Problem, v: bool = False) -> torch.Tensor:
    """What :func:`_pad` makes of ``t``, as a meta tensor (its strides key the launch plan)."""
    dim, true = _dims(p, v)
    if dim == true:
        return t
    return _pad(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"), p, v)


def _unpad(t: torch.Tensor, p: Problem, v: bool = False) -> torch.Tensor:
    dim, true = _dims(p, v)
    return t[..., :true].contiguous() if dim != true else t


# --------------------------------------------------------------------------- problem + options
class Tensors(NamedTuple):
    """The optional tensor inputs of one call (data next to the :class:`AttentionOptions`)."""

    key_padding_mask: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    attn_bias: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # fp32 [H]: attention-sink logits (forward flag; dsinks from the backward)


def _problem(q: Any, k: Any, v: Any, t: Tensors, max_seqlen_q: Any, max_seqlen_k: Any,
             check_values: bool) -> Problem:
    if t.cu_seqlens_q is not None or t.cu_seqlens_k is not None:
        if t.cu_seqlens_q is None or t.cu_seqlens_k is None:
            missing = "cu_seqlens_q" if t.cu_seqlens_q is None else "cu_seqlens_k"
            raise InputError(missing, "int32 cumulative lengths [B + 1] (both cu_seqlens_q and cu_seqlens_k)", None)
        return validate_varlen(q, k, v, t.cu_seqlens_q, t.cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               check_values=check_values)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None:
            raise InputError(name, "None without cu_seqlens (the lengths come from the tensors)", m)
    return validate_qkv(q, k, v)


def _prepare(q: Any, k: Any, v: Any, opts: AttentionOptions, t: Tensors, max_seqlen_q: Any, max_seqlen_k: Any,
             check_values: bool = True) -> tuple[Problem, Features]:
    p = _problem(q, k, v, t, max_seqlen_q, max_seqlen_k, check_values)
    return p, validate_features(p, q.dtype, opts, **t._asdict())


def _as_options(options: Any) -> AttentionOptions:
    if not isinstance(options, AttentionOptions):
        raise InputTypeError("options", "a fagen.AttentionOptions", type(options).__name__)
    return options


def _as_tensors(tensors: Any) -> Tensors:
    if tensors is None:
        return Tensors()
    if not isinstance(tensors, Tensors):
        raise InputTypeError("tensors", "a fagen.functional.Tensors (or None)", type(tensors).__name__)
    return tensors


def validate(q: Any, k: Any, v: Any, options: AttentionOptions | None = None, tensors: Tensors | None = None, *,
             max_seqlen_q: Any = None, max_seqlen_k: Any = None, check_values: bool = True, **kwargs: Any) -> Problem:
    """Check the inputs and options of :func:`attention_forward` without launching anything; the
    runtime shape. The options either as :func:`attention_forward`'s keywords or as one
    :class:`AttentionOptions` (with the optional tensors as one :class:`Tensors`).
    ``check_values=False`` skips reading cu_seqlens (fake tensors under tracing)."""
    if options is None:
        opts, rest = _explicit("validate", None, kwargs.pop("causal", False), kwargs)
        tensors = rest["tensors"]
    else:
        if kwargs:
            raise TypeError(f"validate() got an unexpected keyword argument {sorted(kwargs)[0]!r} with options")
        opts = _as_options(options)
    p, _ = _prepare(q, k, v, opts, _as_tensors(tensors), max_seqlen_q, max_seqlen_k, check_values)
    return p


def _select(direction: str, p: Problem, flags: dict[str, Any], spec: KernelSpec | None) -> KernelSpec:
    if spec is None:
        spec = spec_for(direction, p, **flags)
    else:
        _check_spec(spec, direction, p, flags)
    _check_gqa(spec, p)
    return spec


# --------------------------------------------------------------------------- launch plans
# A plan is everything a call needs that depends only on the tensors' metadata (dtype, device,
# shape, strides, which optional inputs are present) and the options: the validated problem,
# the spec, the launches with their grids and every non-pointer kernel argument. It is built
# (with every check) the first time such a call is seen and replayed afterwards: a repeated
# call validates nothing twice, reads no tensor value on the host and only allocates its
# outputs, sets the pointers and launches.
@dataclass(frozen=True)
class _Plan:
    p: Problem
    spec: KernelSpec
    launches: tuple[tuple[KernelInfo, tuple[int, int, int]], ...]  # () for empty inputs, no keys, meta
    args: dict[str, Any]  # non-pointer kernel arguments (LaunchArgs' constants: never changed)
    lse_dtype: torch.dtype
    acc_dtype: torch.dtype = torch.float32
    kpm_copy: bool = False  # key_padding_mask / alibi_slopes need a contiguous copy
    alibi_copy: bool = False
    check_cu: bool = False  # CPU varlen: cu_seqlens values are read (no device to synchronise)
    lse_ready: bool = True  # the backward's lse is contiguous and of the kernels' dtype
    sinks_copy: bool = False  # sinks need a contiguous copy
    dlse_ready: bool = True  # the backward's dlse (if any) is contiguous float32
    tma: tuple[str, ...] = ()  # inputs the family reads through tensor maps (address checked per call)
    tma_copy: frozenset[str] = frozenset()  # of those, the ones whose strides no tensor map takes: copied
    dq_sem: int = 0  # elements of the backward's dQ turn counters (fagen.abi.DQ_SEM; 0: no kernel takes them)
    given: tuple[str, ...] = ()  # pointer arguments of the optional tensors given (the others are null constants)
    lo_ready: bool | None = None  # the backward's lse_lo checked (needs no copy); None: checked per call

    @property
    def module(self) -> ModulePlan:
        """The spec's module plan (its family's decisions: kernels, tensor maps)."""
        return plan_of(self.spec)


_PLANS: dict[tuple[Any, ...], _Plan] = {}
_CONTIGUOUS = torch.contiguous_format
_NO_TENSORS = (None,) * len(Tensors._fields)
_PLANS_MAX = 1024


def _meta(t: Any) -> Any:
    """A tensor's plan-relevant metadata (a non-tensor raises AttributeError: no plan)."""
    if t is None:
        return None
    return type(t), t.dtype, t.device, t.shape, t.stride()


def _metas(t: Tensors) -> tuple[Any, ...]:
    """:func:`_meta` of each optional tensor; without any (the common call) the Nones themselves."""
    return t if t == _NO_TENSORS else tuple(map(_meta, t))


def _lookup(key: Any) -> tuple[Any, _Plan | None]:
    """(key, its plan or None); the key None when it cannot key a plan (unhashable: symbolic
    sizes under tracing), so that the plan is built and not remembered."""
    if key is None:
        return None, None
    try:
        return key, _PLANS.get(key)
    except TypeError:
        return None, None


def clear_launch_plans() -> None:
    """Forget the remembered launch plans (per options and tensor metadata): the next call builds its
    plan anew, asking the module plan (``fagen.plan.plan_of``) for the spec's kernels again."""
    _PLANS.clear()


def _remember(key: tuple[Any, ...] | None, plan: _Plan) -> _Plan:
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _planned(key_of: Callable[[Tensors], tuple[Any, ...]], build: Callable[[AttentionOptions, Tensors], _Plan],
             options: Any, tensors: Any, offsets: tuple[int, int]) -> tuple[_Plan, Tensors]:
    """A call's launch plan and its optional tensors: the remembered plan of ``key_of(tensors)``
    (tensor metadata, options, ...) when the call can key one, else ``build`` from the validated
    options and tensors (remembered when the key is hashable)."""
    t = Tensors() if tensors is None else tensors
    try:
        key = key_of(t) if type(t) is Tensors and type(options) is AttentionOptions else None
    except AttributeError:  # not a tensor: the checks name it
        key = None
    if key is not None:  # a CPU tensor's spec follows FAGEN_EMULATE_ARCH
        key = (key, get_settings().emulate_arch)
    key, plan = _lookup(key)
    if plan is None:
        opts, t = _as_options(options), _as_tensors(tensors)
        _dropout_offsets(*offsets)
        plan = _remember(key, build(opts, t))
    return plan, t


def _cu_check(p: Problem, t: Tensors) -> None:
    """CPU varlen: the cu_seqlens values (host memory, nothing to synchronise) against the
    totals and max_seqlen; the emulator would read out of bounds otherwise. On a GPU the
    bounds stay on the device, the caller's contract as in flash-attn."""
    check_cu_values(p, t.cu_seqlens_q, t.cu_seqlens_k)


# --------------------------------------------------------------------------- forward
def _forward_plan(q: Any, k: Any, v: Any, opts: AttentionOptions, t: Tensors, max_seqlen_q: Any, max_seqlen_k: Any,
                  spec: KernelSpec | None, offsets: tuple[int, int]) -> _Plan:
    p, f = _prepare(q, k, v, opts, t, max_seqlen_q, max_seqlen_k, check_values=False)
    spec = _select("fwd", p, f.spec_fields(p), spec)
    kern = _kernel(spec, "main")
    lse_dtype = _acc_dtype(kern, "lse")
    common = dict(p=p, lse_dtype=lse_dtype, check_cu=p.varlen and p.device.type == "cpu",
                  kpm_copy=t.key_padding_mask is not None and not t.key_padding_mask.is_contiguous(),
                  alibi_copy=f.alibi_slopes is not None and f.alibi_slopes is not t.alibi_slopes,
                  sinks_copy=f.sinks is not None and f.sinks is not t.sinks)
    if p.empty or p.no_keys or p.device.type == "meta":
        return _Plan(spec=spec, launches=(), args={}, **common)
    shape_o = tuple(q.shape[:-1]) + (p.head_dim_v,)
    meta = {"q": _padded_meta(q, p), "k": _padded_meta(k, p), "v": _padded_meta(v, p, True),
            "o": torch.empty(shape_o, device="meta")}
    tma, tma_copy = _tma_inputs(spec, p, q=q, k=k, v=v)
    meta.update({n: torch.empty(tuple(meta[n].shape), device="meta") for n in tma_copy})
    lse_strides = torch.empty(p.lse_shape, device="meta").stride()
    null, given = _null_pointers(t, _OPTIONAL_POINTERS)
    args = {"heads": p.heads, "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "row_offset": offsets[0],
            "col_offset": offsets[1], **opts.kernel_args(p), **_feature_args(p, f, lse_strides), **null, "dbias": 0}
    for name, x in meta.items():
        args.update(_strides(name, x, p.varlen))
    return _Plan(spec=spec, launches=((kern, _grid(kern, p)),), args=args, tma=tma, tma_copy=tma_copy, given=given,
                 **common)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions,
            tensors: Tensors | None = None, *, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
            seed: int = 0, offset: int = 0, spec: KernelSpec | None = None,
            dropout_row_offset: int = 0, dropout_col_offset: int = 0,
            lse_lo: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_forward` with its options as one validated :class:`AttentionOptions`
    and the optional tensors as one :class:`Tensors`: (o, lse). ``lse_lo``: see
    :func:`attention_forward`."""
    o, lse, _ = _forward(q, k, v, options, tensors, max_seqlen_q, max_seqlen_k, seed, offset, spec,
                         (dropout_row_offset, dropout_col_offset), lse_lo)
    return o, lse


def forward_lse_lo(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions,
                   tensors: Tensors | None = None, *, max_seqlen_q: int | None = None,
                   max_seqlen_k: int | None = None, seed: int = 0,
                   offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`forward` that also allocates and returns lse_lo: (o, lse, lse_lo) (the autograd ops')."""
    return _forward(q, k, v, options, tensors, max_seqlen_q, max_seqlen_k, seed, offset, None, (0, 0), None,
                    new_lo=True)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions, tensors: Tensors | None,
             max_seqlen_q: int | None, max_seqlen_k: int | None, seed: int, offset: int, spec: KernelSpec | None,
             offsets: tuple[int, int], lse_lo: torch.Tensor | None,
             new_lo: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(o, lse, lse_lo) of :func:`forward`; ``new_lo``: lse_lo allocated here (the plan knows its shape)."""
    plan, t = _planned(
        lambda t: ("fwd", _meta(q), _meta(k), _meta(v), *_metas(t), max_seqlen_q, max_seqlen_k, options, spec,
                   offsets),
        lambda opts, t: _forward_plan(q, k, v, opts, t, max_seqlen_q, max_seqlen_k, spec, offsets),
        options, tensors, offsets)
    seed, offset = check_seed_offset(seed, offset)
    if plan.check_cu:
        _cu_check(plan.p, t)
    p = plan.p
    if p.padded:
        q, k, v = _pad(q, p), _pad(k, p), _pad(v, p, True)
    if plan.tma:
        q, k, v = _tma_ready(plan, q=q, k=k, v=v)
    _check_lse_lo(lse_lo, p, out=True)  # before anything is written
    if p.head_dim_v == q.shape[-1]:
        o = torch.empty_like(q, memory_format=_CONTIGUOUS)
    else:
        o = torch.empty(tuple(q.shape[:-1]) + (p.head_dim_v,), dtype=q.dtype, device=q.device)
    lse = torch.empty(p.lse_shape, dtype=plan.lse_dtype, device=q.device)
    if new_lo:  # like the fresh lse where it is float32: about 0.8 us less than torch.empty(shape, ...)
        lse_lo = (torch.empty_like(lse) if plan.lse_dtype == torch.float32
                  else torch.empty(p.lse_shape, dtype=torch.float32, device=q.device))
    if lse_lo is not None and not plan.launches and p.device.type != "meta":
        lse_lo.zero_()
    if not plan.launches:
        if p.no_keys and not p.empty and p.device.type != "meta":
            o.zero_()
            lse.fill_(-math.inf)
            if t.sinks is not None:  # no key: the row's softmax is the sink's alone
                lse.copy_(_sink_rows(t.sinks, p).expand(p.lse_shape))
        return _unpad(o, p, True), lse, lse_lo
    kpm = t.key_padding_mask.contiguous() if plan.kpm_copy else t.key_padding_mask
    slopes = t.alibi_slopes.contiguous() if plan.alibi_copy else t.alibi_slopes
    sinks = t.sinks.contiguous() if plan.sinks_copy else t.sinks
    ptrs = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": o.data_ptr(), "lse": lse.data_ptr(),
            "seed": seed, "offset": offset, "lse_lo": _ptr(lse_lo)}
    if plan.given:
        optional = {"kpm": kpm, "alibi_slopes": slopes, "mask": t.attn_mask, "bias": t.attn_bias,
                    "cu_seqlens_q": t.cu_seqlens_q, "cu_seqlens_k": t.cu_seqlens_k, "sinks": sinks}
        ptrs.update({n: optional[n].data_ptr() for n in plan.given})
    args = LaunchArgs(plan.args, ptrs)
    mod = get_module(plan.spec, p.device.type)
    for kern, grid in plan.launches:
        if kern.has_tensormaps:
            mod.launch(kern, grid, {**args, **plan.module.tensor_maps(kern, {"q": q, "k": k, "v": v})})
        else:
            mod.launch(kern, grid, args)
    return (_unpad(o, p, True) if p.padded else o), lse, lse_lo


def _sink_rows(sinks: torch.Tensor, p: Problem) -> torch.Tensor:
    """sinks [H] shaped to broadcast against lse ([B, H, Nq], or [H, total_q] when packed)."""
    return sinks[:, None] if p.varlen else sinks[None, :, None]


def _dsinks(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, p: Problem) -> torch.Tensor:
    """d sink_h = -sum_{b,i} P_sink(b, h, i) D'_(b, h, i), P_sink = exp(sink_h - lse): the sink has no value,
    so its probability enters o_i = sum_j P_ij v_j only through the normalisation (d o_i / d sink =
    -P_sink o_i) and lse (d lse_i / d sink = P_sink); D' = rowsum(dO o O) - dlse (the pre kernel's
    delta). In float64 over a fixed shape (torch's reductions run in a fixed order: deterministic)."""
    rows = torch.exp(_sink_rows(sinks.double(), p) - lse.double()) * delta.double()
    dims = (1,) if p.varlen else (0, 2)
    return (-rows.sum(dim=dims)).to(sinks.dtype)


def _tma_inputs(spec: KernelSpec, p: Problem, **tensors: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    """The inputs ``spec``'s family reads through tensor maps (``Family.tma_tensors``), and those
    of them whose strides no tensor map describes (:func:`fagen.tma.layout_fits`: a dO broadcast
    over the batch, rows 68 halves apart): the launch passes contiguous copies of these, so a
    family never raises where another would not. Padded inputs are contiguous copies already."""
    from .tma import layout_fits

    names = tuple(n for n in plan_of(spec).tma_tensors if n in tensors)
    if p.padded:
        return names, frozenset()
    return names, frozenset(n for n in names
                            if not layout_fits(tensors[n].shape, tensors[n].stride(), tensors[n].element_size()))


def _tma_ready(plan: _Plan, **tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors as the plan's tensor maps take them: those in ``plan.tma_copy`` contiguous; one
    read through a tensor map whose address is not 16-byte aligned (a view at an odd element
    offset) copied into a fresh tensor of the same strides (the plan's stride arguments hold)."""
    out = []
    for name, x in tensors.items():
        if name in plan.tma_copy:
            x = x.contiguous()
        elif name in plan.tma and x.data_ptr() % 16:
            x = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
        out.append(x)
    return out


def _options_of(causal: Any, dropout_p: Any, softmax_scale: Any, window_size: Any, softcap: Any,
                causal_align: Any, deterministic: Any = False) -> AttentionOptions:
    return AttentionOptions.of(causal=causal, dropout_p=dropout_p, softmax_scale=softmax_scale,
                               window_size=window_size, softcap=softcap, causal_align=causal_align,
                               deterministic=deterministic)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      softmax_scale: float | None = None, seed: int = 0, offset: int = 0,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                      attn_bias: torch.Tensor | None = None, causal_align: str = "bottom_right",
                      cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                      max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                      spec: KernelSpec | None = None, dropout_row_offset: int = 0,
                      dropout_col_offset: int = 0, sinks: torch.Tensor | None = None,
                      lse_lo: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward: (o like q, lse float32 [B, H, Nq] or [H, total_q] when packed).
    ``sinks``: fp32 [H] attention-sink logits (each row's softmax also runs over its head's sink,
    which has no value; lse includes it).

    ``lse_lo``: an optional output, a contiguous float32 tensor of lse's shape the forward fills
    with what the fp32 lse cannot hold of rows whose scores are huge (|lse| of about 700 and up:
    the row's exact lse in log2 units minus the backward's fp32 value of it; 0 for every other
    row). Pass it to :func:`attention_backward` with lse: such rows then get exact gradients;
    without it their P is bounded by 1 (finite, as precise as the fp32 lse).

    ``spec``: an explicit KernelSpec (tiles, family) that must match the inputs and options.
    ``dropout_row_offset``/``dropout_col_offset``: q row i and key j draw the keep-mask bit of
    (row_offset + i, col_offset + j), as when these tensors are a block of a longer sequence
    (ring attention, :mod:`fagen.distributed`); masks and scores keep the local indices."""
    opts = _options_of(causal, dropout_p, softmax_scale, window_size, softcap, causal_align)
    return forward(q, k, v, opts, Tensors(key_padding_mask, alibi_slopes, attn_mask, attn_bias, cu_seqlens_q,
                                          cu_seqlens_k, sinks), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   seed=seed, offset=offset, spec=spec, dropout_row_offset=dropout_row_offset,
                   dropout_col_offset=dropout_col_offset, lse_lo=lse_lo)


_TENSOR_NAMES = frozenset(Tensors._fields) | {"max_seqlen_q", "max_seqlen_k", "seed", "offset",
                                              "dropout_row_offset", "dropout_col_offset", "dlse", "lse_lo"}
_OPTION_NAMES = frozenset(f for f in AttentionOptions.__dataclass_fields__ if f != "deterministic")


def _explicit(caller: str, spec: KernelSpec | None, causal: bool | None, options: dict[str, Any],
              deterministic: Any = False) -> tuple[AttentionOptions, dict[str, Any]]:
    """Keyword options as one :class:`AttentionOptions` and the rest: unknown names refused like
    a Python call would; with a spec (:func:`run_forward`/:func:`run_backward`) ``causal`` and
    ``causal_align`` come from it unless given."""
    unknown = sorted(set(options) - _OPTION_NAMES - _TENSOR_NAMES)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    kw = {n: options[n] for n in _OPTION_NAMES if n in options}
    if causal is None:
        causal = spec.causal if spec is not None else False
    kw["causal"] = causal
    if spec is not None:
        kw.setdefault("causal_align", _spec_flag(spec, "causal_align"))
    opts = AttentionOptions.of(**kw, deterministic=deterministic)
    rest = {n: v for n, v in options.items() if n in _TENSOR_NAMES}
    tensors = Tensors(**{n: rest.pop(n) for n in Tensors._fields if n in rest})
    return opts, {"tensors": tensors, **rest}


def run_forward(spec: KernelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                causal: bool | None = None, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward with an explicit spec (used by the autotuner and for experiments with tiles);
    ``causal`` defaults to the spec's; the other options as :func:`attention_forward`'s."""
    opts, kw = _explicit("run_forward", spec, causal, options)
    return forward(q, k, v, opts, spec=spec, **kw)


def _check_lse_lo(lse_lo: Any, p: Problem, *, out: bool) -> bool:
    """None, or lse_lo (:func:`attention_forward`): float32, lse's shape, q's device; as the
    forward's output buffer contiguous too. True when it needs no contiguous float32 copy."""
    if lse_lo is None:
        return True
    check_lse(lse_lo, p, name="lse_lo")
    if lse_lo.dtype != torch.float32:
        raise InputTypeError("lse_lo", "dtype float32", lse_lo.dtype)
    if out and not lse_lo.is_contiguous():
        raise InputError("lse_lo", "a contiguous tensor (the forward writes it)", "a strided view")
    return lse_lo.is_contiguous()


def _lse_lo_ready(lse_lo: Any, p: Problem) -> bool | None:
    """:func:`_check_lse_lo` of the backward's lse_lo, for its plan (the check reads metadata
    only, part of the plan's key); None when it fails: each call checks again and raises then,
    after the checks that come before it."""
    try:
        return _check_lse_lo(lse_lo, p, out=False)
    except Exception:  # noqa: BLE001 - raised again by the call's own check
        return None


# --------------------------------------------------------------------------- backward
def _check_dlse(dlse: Any, p: Problem) -> bool:
    """None, or the gradient of lse: lse's shape, float32 (float64 for float64 inputs), q's device.
    True when it needs no contiguous float32 copy."""
    if dlse is None:
        return True
    check_lse(dlse, p, name="dlse")
    return dlse.dtype == torch.float32 and dlse.is_contiguous()


def _backward_plan(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, opts: AttentionOptions, t: Tensors,
                   max_seqlen_q: Any, max_seqlen_k: Any, bias_grad: Any, spec: KernelSpec | None,
                   offsets: tuple[int, int], dlse: Any = None, lse_lo: Any = None) -> _Plan:
    p, f = _prepare(q, k, v, opts, t, max_seqlen_q, max_seqlen_k, check_values=False)
    shape_o = None if not p.split_dims else tuple(q.shape[:-1]) + (p.true_head_dim_v,)
    check_like("o", o, q, shape_o)
    check_like("do", do, q, shape_o)
    dlse_ready = _check_dlse(dlse, p)
    bias_grad = validate_flag("bias_requires_grad", bias_grad)
    if bias_grad and f.attn_bias is None:
        raise InputError("bias_requires_grad", "False without attn_bias", True)
    check_lse(lse, p)
    spec = _select("bwd", p, f.spec_fields(p, "bwd", bias_grad), spec)
    main = _kernel(spec, "main")
    lse_dtype = _acc_dtype(main, "lse")
    common = dict(p=p, lse_dtype=lse_dtype, acc_dtype=_acc_dtype(main, "dq_accum"),
                  lse_ready=lse.is_contiguous() and lse.dtype == lse_dtype, check_cu=p.varlen and p.device.type == "cpu",
                  kpm_copy=t.key_padding_mask is not None and not t.key_padding_mask.is_contiguous(),
                  alibi_copy=f.alibi_slopes is not None and f.alibi_slopes is not t.alibi_slopes,
                  sinks_copy=f.sinks is not None and f.sinks is not t.sinks, dlse_ready=dlse_ready,
                  lo_ready=_lse_lo_ready(lse_lo, p))
    if p.empty or p.no_keys or p.device.type == "meta":
        return _Plan(spec=spec, launches=(), args={}, **common)
    shape_q = tuple(q.shape[:-1]) + (p.head_dim,)
    shape_k = tuple(k.shape[:-1]) + (p.head_dim,)
    meta = {n: _padded_meta(x, p, n in ("v", "o", "do")) for n, x in (("q", q), ("k", k), ("v", v), ("o", o),
                                                                     ("do", do))}
    tma, tma_copy = _tma_inputs(spec, p, q=q, k=k, v=v, do=do)
    meta.update({n: torch.empty(tuple(meta[n].shape), device="meta") for n in tma_copy})
    meta.update(dq=torch.empty(shape_q, device="meta"), dk=torch.empty(shape_k, device="meta"),
                dv=torch.empty(tuple(k.shape[:-1]) + (p.head_dim_v,), device="meta"))
    dbias = torch.empty((p.batch, p.heads, p.seqlen_q, p.seqlen_k), device="meta") if bias_grad else None
    lse_strides = torch.empty(p.lse_shape, device="meta").stride()
    null, given = _null_pointers(t, _OPTIONAL_POINTERS[:-1])
    if not bias_grad:
        null["dbias"] = 0
    if dlse is None:
        null["dlse"] = 0
    args = {"heads": p.heads, "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "row_offset": offsets[0],
            "col_offset": offsets[1], **opts.kernel_args(p), **_feature_args(p, f, lse_strides, dbias), **null,
            "sinks": 0}
    for name, x in meta.items():
        args.update(_strides(name, x, p.varlen))
    launches = tuple((kern, _grid(kern, p)) for kern in plan_of(spec).kernels)  # pre, main, (dq,) post
    if any(name == DQ_SEM[1] for kern, _ in launches for _, name in kern.params):  # zeroed per call
        common.update(dq_sem=dq_sem_count(p.batch, p.heads, p.seqlen_q, spec.tile.block_r))
    if not common.get("dq_sem"):  # no counters: a null pointer
        args[DQ_SEM[1]] = 0
    return _Plan(spec=spec, launches=launches, args=args, tma=tma, tma_copy=tma_copy, given=given, **common)


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, options: AttentionOptions, tensors: Tensors | None = None, *,
             max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, seed: int = 0, offset: int = 0,
             bias_requires_grad: bool = False, spec: KernelSpec | None = None, dropout_row_offset: int = 0,
             dropout_col_offset: int = 0, dlse: torch.Tensor | None = None,
             lse_lo: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`attention_backward` with its options as one :class:`AttentionOptions` (its
    ``deterministic`` chooses the backward) and the optional tensors as one :class:`Tensors`."""
    offsets = (dropout_row_offset, dropout_col_offset)
    plan, t = _planned(
        lambda t: ("bwd", _meta(do), _meta(q), _meta(k), _meta(v), _meta(o), _meta(lse), *_metas(t), max_seqlen_q,
                   max_seqlen_k, options, type(bias_requires_grad), bias_requires_grad, spec, offsets, _meta(dlse),
                   _meta(lse_lo)),
        lambda opts, t: _backward_plan(do, q, k, v, o, lse, opts, t, max_seqlen_q, max_seqlen_k, bias_requires_grad,
                                       spec, offsets, dlse, lse_lo),
        options, tensors, offsets)
    seed, offset = check_seed_offset(seed, offset)
    if plan.check_cu:
        _cu_check(plan.p, t)
    p = plan.p
    lo_ready = plan.lo_ready if plan.lo_ready is not None else _check_lse_lo(lse_lo, p, out=False)
    bias_grad = bool(bias_requires_grad)
    if p.padded:
        do, q, k, v, o = _pad(do, p, True), _pad(q, p), _pad(k, p), _pad(v, p, True), _pad(o, p, True)
    if plan.tma:
        do, q, k, v = _tma_ready(plan, do=do, q=q, k=k, v=v)
    dq = torch.empty_like(q, memory_format=_CONTIGUOUS)  # *_like: about 1.5 us less than torch.empty(shape, ...)
    # The main kernel writes every element of dK and dV (each K/V block's rows below Nk, every
    # head-dim column, zeros for padded keys and for keys no query sees; GQA: one CTA per K/V
    # head sums its group), so they need no zero-fill -- except packed sequences, where tokens
    # outside every sequence (cu_seqlens bounds stay on the device, unchecked on a GPU) get 0.
    alloc = torch.zeros_like if p.varlen or not plan.launches else torch.empty_like
    dk = alloc(k, memory_format=_CONTIGUOUS)
    dv = alloc(v, memory_format=_CONTIGUOUS)
    dbias = None
    if bias_grad:
        dbias = torch.zeros((p.batch, p.heads, p.seqlen_q, p.seqlen_k), dtype=torch.float32, device=q.device)
    dlse_t = dlse if plan.dlse_ready else dlse.contiguous().to(torch.float32)
    delta = None
    if not plan.launches:
        if p.device.type != "meta":
            dq.zero_()
    else:
        lse_t = lse if plan.lse_ready else lse.contiguous().to(plan.lse_dtype)
        lo_t = lse_lo if lo_ready else lse_lo.contiguous()
        delta = torch.empty(p.lse_shape, dtype=plan.acc_dtype, device=q.device)
        if plan.dq_sem:  # turn counters: fresh zeros every call (fagen.abi.DQ_SEM), DQ_COPIES partial sums of dQ
            dq_sem = torch.zeros(plan.dq_sem, dtype=torch.int32, device=q.device)
            dq_accum = torch.empty((*q.shape[:-2], q.shape[-2] * DQ_COPIES, q.shape[-1]), dtype=plan.acc_dtype,
                                   device=q.device)  # zeroed by the pre kernel
        else:
            dq_sem = None
            dq_accum = torch.empty_like(q, dtype=plan.acc_dtype, memory_format=_CONTIGUOUS)  # zeroed by the pre kernel
        kpm = t.key_padding_mask.contiguous() if plan.kpm_copy else t.key_padding_mask
        slopes = t.alibi_slopes.contiguous() if plan.alibi_copy else t.alibi_slopes
        ptrs = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": o.data_ptr(), "do_": do.data_ptr(),
                "lse": lse_t.data_ptr(), "delta": delta.data_ptr(), "dq_accum": dq_accum.data_ptr(),
                "dq": dq.data_ptr(), "dk": dk.data_ptr(), "dv": dv.data_ptr(), "seed": seed, "offset": offset,
                "lse_lo": _ptr(lo_t)}
        if plan.given:
            optional = {"kpm": kpm, "alibi_slopes": slopes, "mask": t.attn_mask, "bias": t.attn_bias,
                        "cu_seqlens_q": t.cu_seqlens_q, "cu_seqlens_k": t.cu_seqlens_k}
            ptrs.update({n: optional[n].data_ptr() for n in plan.given})
        if dbias is not None:
            ptrs["dbias"] = dbias.data_ptr()
        if dlse_t is not None:
            ptrs["dlse"] = dlse_t.data_ptr()
        if dq_sem is not None:
            ptrs[DQ_SEM[1]] = dq_sem.data_ptr()
        args = LaunchArgs(plan.args, ptrs)
        mod = get_module(plan.spec, p.device.type)
        for kern, grid in plan.launches:
            if kern.has_tensormaps:
                maps = plan.module.tensor_maps(kern, {"q": q, "k": k, "v": v, "do": do, "dq_accum": dq_accum})
                mod.launch(kern, grid, {**args, **maps})
            else:
                mod.launch(kern, grid, args)
    out = (_unpad(dq, p), _unpad(dk, p), _unpad(dv, p, True)) if p.padded else (dq, dk, dv)
    if bias_grad:
        bias = t.attn_bias
        out = out + (reduce_to_shape(dbias, tuple(bias.shape)).to(bias.dtype),)
    if t.sinks is not None:
        if p.device.type == "meta":
            return out + (torch.empty_like(t.sinks),)
        if delta is None:  # nothing launched: o = 0, so D = 0 and D' = -dlse
            delta = torch.zeros(p.lse_shape, dtype=torch.float32, device=q.device)
            if dlse_t is not None:
                delta = delta - dlse_t
        out = out + (_dsinks(t.sinks, lse, delta, p),)
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
                       dropout_col_offset: int = 0, sinks: torch.Tensor | None = None,
                       dlse: torch.Tensor | None = None, lse_lo: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """FlashAttention backward (Algorithm 4): (dq, dk, dv) in the input dtype and shapes, plus dbias
    (summed to attn_bias's shape, in its dtype) when ``bias_requires_grad``, plus dsinks (fp32 [H])
    when ``sinks`` are given. Pass the forward's o and lse and the same options. ``dlse``: the
    gradient of lse (its shape), which enters D_i = rowsum(dO o O) - dlse_i. ``lse_lo``: the
    forward's (:func:`attention_forward`), for exact gradients of rows with huge scores. ``deterministic``: no order-dependent atomics (a separate
    dQ kernel), bitwise-reproducible dq on a GPU. ``dropout_row_offset``/``dropout_col_offset``: as
    :func:`attention_forward`'s."""
    opts = _options_of(causal, dropout_p, softmax_scale, window_size, softcap, causal_align, deterministic)
    return backward(do, q, k, v, o, lse, opts, Tensors(key_padding_mask, alibi_slopes, attn_mask, attn_bias,
                                                       cu_seqlens_q, cu_seqlens_k, sinks),
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seed=seed, offset=offset,
                    bias_requires_grad=bias_requires_grad, spec=spec, dropout_row_offset=dropout_row_offset,
                    dropout_col_offset=dropout_col_offset, dlse=dlse, lse_lo=lse_lo)


def run_backward(spec: KernelSpec, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, *, causal: bool | None = None, deterministic: bool | None = None,
                 bias_requires_grad: bool | None = None, **options: Any) -> tuple[torch.Tensor, ...]:
    """Backward with an explicit spec (used by the autotuner and for experiments with tiles);
    ``causal``, ``deterministic`` and ``bias_requires_grad`` default to the spec's flags."""
    det = _spec_flag(spec, "deterministic") if deterministic is None else deterministic
    bg = _spec_flag(spec, "bias_grad") if bias_requires_grad is None else bias_requires_grad
    opts, kw = _explicit("run_backward", spec, causal, options, det)
    return backward(do, q, k, v, o, lse, opts, bias_requires_grad=bg, spec=spec, **kw)


def dropout_keep_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, *,
                      seed: int = 0, offset: int = 0) -> torch.Tensor:
    """The keep-mask the kernels apply, bool [B, H, Nq, Nk] (True = kept). Packed sequences use
    the same mask with max_seqlen: sequence b keeps ``mask[b, :, :len_q, :len_k]``."""
    return torch.from_numpy(keep_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed=seed, offset=offset))
