"""Autograd ops: ``flash_attn_func``, ``flash_attn_varlen_func`` and ``scaled_dot_product_attention``.

All three run two ``torch.library`` custom ops, so eager mode, autograd and
``torch.compile(fullgraph=True)`` all see the same opaque kernels. Their schemas come from
:class:`fagen.AttentionOptions` (the scalar options) and :class:`fagen.functional.Tensors`
(the optional tensors):

* ``fagen::fwd(q, k, v, key_padding_mask, dropout_p, softmax_scale, causal, window_left=-1,
  window_right=-1, softcap=0., alibi_slopes=None, attn_mask=None, attn_bias=None,
  causal_align="bottom_right", cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
  max_seqlen_k=None, deterministic=False) -> (o, lse, rng_state, lse_lo)`` (the order
  :data:`OP_ORDER`; ``lse_lo``: what the fp32 lse cannot hold of rows with huge scores,
  :func:`fagen.functional.attention_forward`)
* ``fagen::bwd(do, q, k, v, o, lse, key_padding_mask, dropout_p, softmax_scale, causal,
  rng_state, <the rest of fwd's>, bias_requires_grad=False, sinks=None, dlse=None, lse_lo=None)
  -> (dq, dk, dv, dbias, dsinks)`` (``dbias`` / ``dsinks`` empty unless ``bias_requires_grad`` /
  ``sinks``).

Layout of the ops: q, o [B, Nq, H, d]; k, v [B, Nk, H_kv, d]; lse float32 [B, H, Nq]
(packed: q [total_q, H, d], lse [H, total_q]); see :mod:`fagen.functional`. ``rng_state`` is
an int64 CPU tensor ``[seed, offset]``: the Philox key of the dropout keep-mask, drawn by
:func:`draw_rng_state` from torch's default CPU generator when ``dropout_p > 0`` (zeros
otherwise), so ``torch.manual_seed`` reproduces a run. Autograd saves q, k, v, o, lse,
rng_state, lse_lo and the optional inputs -- never an N x N tensor -- and the backward replays the
same mask. The draw happens inside ``fagen::fwd`` (tagged ``nondeterministic_seeded``), so a
compiled graph draws a fresh state on every call instead of baking one in as a constant.

The public functions validate their options once (:class:`~fagen.AttentionOptions`) and call
fagen::fwd; the ops' Autograd kernels are the one autograd mechanism, for them and for direct
callers of ``torch.ops.fagen.fwd`` alike, in eager mode, under ``torch.compile`` and under
``torch.func``: ``vmap`` runs the ops' batching rules (the mapped dim folds into the batch: one
launch), ``grad`` / ``vjp`` / ``jacrev`` and per-sample gradients (``vmap(grad)``) the autograd
formula; forward-mode AD (``jvp``, ``jacfwd``) and double backward raise ``NotImplementedError``
(:data:`NO_FORWARD_AD`, :data:`NO_DOUBLE_BACKWARD`).
Nothing on the launch path reads a tensor value on the host or synchronises a device.
"""
import math
from typing import Any, Optional, Union

import torch

from . import functional as F
from .errors import FagenError, InputError, InputTypeError
from .functional import AttentionOptions, Tensors
from .masking import band

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "scaled_dot_product_attention", "attention",
           "draw_rng_state", "attn_probs", "custom_op_tags", "op_arguments", "OP_ORDER", "FWD_SCHEMA", "BWD_SCHEMA",
           "FWD_NAMES", "BWD_NAMES", "NO_FORWARD_AD", "NO_DOUBLE_BACKWARD"]

Tensor = torch.Tensor


# --------------------------------------------------------------------------- helpers
def draw_rng_state() -> Tensor:
    """A fresh dropout key: int64 CPU tensor ``[seed, offset]``, each in ``[0, 2**63)``.

    Drawn from torch's default CPU generator (for CPU and CUDA inputs alike), so
    ``torch.manual_seed(s)`` followed by the same calls reproduces every mask.
    """
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, generator=torch.default_generator)


def _lc(t: Optional[Tensor]) -> Optional[Tensor]:
    """The kernels need stride 1 in the head dimension (a size-1 one has no stride that
    matters); other strides pass through."""
    if t is None or t.stride(-1) == 1 or t.shape[-1] == 1 or t.numel() == 0:
        return t
    return t.contiguous()


def _lc_real(t: Optional[Tensor]) -> Optional[Tensor]:
    """:func:`_lc` of a real tensor (the implementations'): a contiguous one, the common case,
    passes first (one query instead of three)."""
    if t is None or t.is_contiguous():
        return t
    return _lc(t)


def _seed_offset(rng_state: Tensor) -> tuple[int, int]:
    """The key's two ints, read from the CPU tensor's memory (no device is involved)."""
    seed, offset = rng_state.numpy()
    return int(seed), int(offset)


def custom_op_tags(*tags: torch.Tag) -> dict[str, Any]:
    """``torch.library.custom_op``'s ``tags=`` keyword where this torch accepts it (2.5+)."""
    import inspect

    return {"tags": tags} if "tags" in inspect.signature(torch.library.custom_op).parameters else {}


_NO_RNG_STATE = torch.zeros(2, dtype=torch.int64)  # the key without dropout (copied per call: each call's own output)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- schemas
#: The ops' arguments after q, k, v (fagen::bwd puts rng_state after ``causal``): the options of
#: :class:`AttentionOptions`, the tensors of :class:`Tensors` and the packed bounds. The order
#: is stable -- the first schema's positional prefix (key_padding_mask, dropout_p,
#: softmax_scale, causal) still works -- and every type and default comes from those two.
OP_ORDER = ("key_padding_mask", "dropout_p", "softmax_scale", "causal", "window_left", "window_right", "softcap",
            "alibi_slopes", "attn_mask", "attn_bias", "causal_align", "cu_seqlens_q", "cu_seqlens_k",
            "max_seqlen_q", "max_seqlen_k", "deterministic", "sinks")
_PREFIX = 4  # arguments without defaults (the first schema's)


def _declarations() -> dict[str, tuple[str, str]]:
    """name -> (schema type, default) for every name of :data:`OP_ORDER`."""
    decl = {n: ("Tensor?", "None") for n in Tensors._fields}
    decl.update(max_seqlen_q=("SymInt?", "None"), max_seqlen_k=("SymInt?", "None"))
    decl.update({n: (t, d) for t, n, d in AttentionOptions.schema_fields()})
    missing = set(decl) ^ set(OP_ORDER)
    if missing:
        raise AssertionError(f"OP_ORDER and the options/tensors disagree on {sorted(missing)}")
    return decl


def _schema_args(names: tuple[str, ...], decl: dict[str, tuple[str, str]]) -> str:
    return ", ".join(f"{decl[n][0]} {n}" + ("" if OP_ORDER.index(n) < _PREFIX else f"={decl[n][1]}") for n in names)


_DECL = _declarations()
FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_schema_args(OP_ORDER, _DECL)}) -> (Tensor, Tensor, Tensor, Tensor)"
BWD_SCHEMA = (f"(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, {_schema_args(OP_ORDER[:_PREFIX], _DECL)}, "
              f"Tensor rng_state, {_schema_args(OP_ORDER[_PREFIX:-1], _DECL)}, bool bias_requires_grad=False, "
              "Tensor? sinks=None, Tensor? dlse=None, Tensor? lse_lo=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
# fagen::bwd takes sinks (the last of OP_ORDER) after bias_requires_grad, so its older positional form holds.
assert OP_ORDER[-1] == "sinks"
_TENSOR_POS = tuple(OP_ORDER.index(n) for n in Tensors._fields)
_OPTION_POS = tuple(OP_ORDER.index(n) for n in AttentionOptions.op_names())
_MAX_POS = (OP_ORDER.index("max_seqlen_q"), OP_ORDER.index("max_seqlen_k"))
_SCALAR_POS = tuple(i for i, n in enumerate(OP_ORDER) if n not in Tensors._fields)
_BIAS_INDEX = 3 + OP_ORDER.index("attn_bias")  # of attn_bias among fagen::fwd's inputs
_BIAS_DATA = Tensors._fields.index("attn_bias")
_SINKS_INDEX = 3 + OP_ORDER.index("sinks")  # of sinks among fagen::fwd's inputs
_SINKS_DATA = Tensors._fields.index("sinks")


def _get_tensors(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The :class:`Tensors` fields of :data:`OP_ORDER` arguments (plain indexing: traceable)."""
    return tuple([args[i] for i in _TENSOR_POS])


def _get_options(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple([args[i] for i in _OPTION_POS])


def _get_scalars(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple([args[i] for i in _SCALAR_POS])


def op_arguments(options: AttentionOptions, tensors: Tensors, max_seqlen_q: Any = None,
                 max_seqlen_k: Any = None) -> tuple[Any, ...]:
    """fagen::fwd's arguments after q, k, v, in :data:`OP_ORDER`."""
    t, o = tensors, options
    return (t.key_padding_mask, o.dropout_p, o.softmax_scale, o.causal, o.window_size[0], o.window_size[1],
            o.softcap, t.alibi_slopes, t.attn_mask, t.attn_bias, o.causal_align, t.cu_seqlens_q, t.cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, o.deterministic, t.sinks)


def _unpack(rest: tuple[Any, ...]) -> tuple[Tensors, Any, Any, AttentionOptions]:
    """The inverse of :func:`op_arguments` (the dispatcher drops trailing defaults: restored)."""
    if len(rest) < len(OP_ORDER):
        rest = rest + _DEFAULTS[len(rest):]
    return (Tensors._make(_get_tensors(rest)), rest[_MAX_POS[0]], rest[_MAX_POS[1]], _options_of(_get_options(rest)))


_OPTIONS_SEEN: dict[tuple[Any, ...], AttentionOptions] = {}


def _options_of(values: tuple[Any, ...]) -> AttentionOptions:
    """``AttentionOptions.from_op_args(*values)``, its result for the same values of the same types
    (a flat tuple: no per-value pairs to build) remembered here too; traced or unhashable values
    (symbolic window sides) take :meth:`~fagen.AttentionOptions.from_op_args` every time."""
    key = (*map(type, values), *values)
    try:
        opts = _OPTIONS_SEEN.get(key)
    except TypeError:  # unhashable
        return AttentionOptions.from_op_args(*values)
    if opts is None:
        opts = AttentionOptions.from_op_args(*values)
        if not torch.compiler.is_compiling():
            if len(_OPTIONS_SEEN) >= 256:
                _OPTIONS_SEEN.clear()
            _OPTIONS_SEEN[key] = opts
    elif torch.compiler.is_compiling():
        return AttentionOptions.from_op_args(*values)
    return opts


def _defaults() -> tuple[Any, ...]:
    return tuple(a.default_value for a in torch._C.parse_schema("fagen::x" + FWD_SCHEMA).arguments[3:])


_DEFAULTS = _defaults()


# --------------------------------------------------------------------------- fagen::fwd
def _run_fwd(q: Tensor, k: Tensor, v: Tensor, tensors: Tensors, max_q: Any, max_k: Any,
             opts: AttentionOptions) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fagen::fwd's implementation on unpacked arguments: (o, lse, rng_state, lse_lo) (lse_lo:
    :func:`fagen.functional.attention_forward`'s, for the backward's huge rows)."""
    if opts.dropout_p > 0:
        rng_state = draw_rng_state()
        seed, offset = _seed_offset(rng_state)
    else:
        rng_state, seed, offset = torch.zeros_like(_NO_RNG_STATE), 0, 0  # *_like: about 1 us less than torch.zeros
    o, lse, lse_lo = F.forward_lse_lo(_lc_real(q), _lc_real(k), _lc_real(v), opts, tensors, max_seqlen_q=max_q,
                                      max_seqlen_k=max_k, seed=seed, offset=offset)
    lse_dtype = _lse_dtype(q)
    return o, (lse if lse.dtype == lse_dtype else lse.to(lse_dtype)), rng_state, lse_lo


def _fwd_impl(q: Tensor, k: Tensor, v: Tensor, *rest: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_fwd(q, k, v, *_unpack(rest))


def _fwd_fake(q: Tensor, k: Tensor, v: Tensor, *rest: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    tensors, max_q, max_k, opts = _unpack(rest)
    p = F.validate(_lc(q), _lc(k), _lc(v), opts, tensors, max_seqlen_q=max_q, max_seqlen_k=max_k, check_values=False)
    o = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    lse = q.new_empty(p.lse_shape, dtype=_lse_dtype(q))
    rng_state = q.new_empty((2,), dtype=torch.int64, device="cpu")
    return o, lse, rng_state, q.new_empty(p.lse_shape, dtype=torch.float32)


# --------------------------------------------------------------------------- fagen::bwd
def _bwd_split(rest: tuple[Any, ...]) -> tuple[Tensor, tuple[Any, ...], bool, Optional[Tensor], Optional[Tensor]]:
    """fagen::bwd's arguments after lse: (rng_state, the OP_ORDER arguments, bias_requires_grad, dlse,
    lse_lo); fagen::bwd has sinks (OP_ORDER's last) after bias_requires_grad."""
    if len(rest) == _BWD_REST:  # every argument there (the autograd formula's call): sliced as they stand
        return rest[_PREFIX], rest[:_PREFIX] + rest[_PREFIX + 1:-4] + rest[-3:-2], rest[-4], rest[-2], rest[-1]
    m = len(OP_ORDER) - 1
    full = rest[:_PREFIX] + rest[_PREFIX + 1:]
    args = tuple(full[:m]) + _DEFAULTS[min(len(full), m):m]  # the dispatcher drops trailing defaults
    tail = full[m:]
    bias_grad = tail[0] if len(tail) > 0 else False
    sinks = tail[1] if len(tail) > 1 else None
    dlse = tail[2] if len(tail) > 2 else None
    lse_lo = tail[3] if len(tail) > 3 else None
    return rest[_PREFIX], args + (sinks,), bias_grad, dlse, lse_lo


def _run_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, rng_state: Tensor,
             tensors: Tensors, max_q: Any, max_k: Any, opts: AttentionOptions,
             bias_grad: bool, dlse: Optional[Tensor] = None, lse_lo: Optional[Tensor] = None,
             empties: bool = True) -> tuple[Tensor, Tensor, Tensor, Any, Any]:
    """fagen::bwd's implementation on unpacked arguments: (dq, dk, dv, dbias or an empty tensor,
    dsinks or an empty tensor; without ``empties`` None in place of the empty tensors, which only the
    op's schema needs). ``dlse``: the gradient of lse (None: zero); ``lse_lo``: fagen::fwd's."""
    seed, offset = _seed_offset(rng_state) if opts.dropout_p > 0 else (0, 0)
    if dlse is not None and dlse.dtype != torch.float32:
        dlse = dlse.to(torch.float32)
    grads = F.backward(_lc_real(do), _lc_real(q), _lc_real(k), _lc_real(v), _lc_real(o), lse, opts, tensors,
                       max_seqlen_q=max_q, max_seqlen_k=max_k, seed=seed, offset=offset, bias_requires_grad=bias_grad,
                       dlse=dlse, lse_lo=lse_lo)
    if not empties:
        return grads[0], grads[1], grads[2], grads[3] if bias_grad else None, grads[-1] if tensors.sinks is not None else None
    dbias = grads[3] if bias_grad else q.new_empty((0,))
    if tensors.sinks is not None:
        dsinks = grads[-1]
    else:  # *_like of an empty tensor: about 0.7 us less than new_empty
        dsinks = q.new_empty((0,)) if bias_grad else torch.empty_like(dbias)
    return grads[0], grads[1], grads[2], dbias, dsinks


def _bwd_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
              *rest: Any) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rng_state, args, bias_grad, dlse, lse_lo = _bwd_split(rest)
    return _run_bwd(do, q, k, v, o, lse, rng_state, *_unpack(args), bias_grad, dlse, lse_lo)


def _bwd_fake(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
              *rest: Any) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _rng, args, bias_grad, _dlse, _lo = _bwd_split(rest)
    tensors, max_q, max_k, opts = _unpack(args)
    F.validate(_lc(q), _lc(k), _lc(v), opts, tensors, max_seqlen_q=max_q, max_seqlen_k=max_k, check_values=False)
    bias = tensors.attn_bias
    dbias = bias.new_empty(bias.shape) if bias_grad and bias is not None else q.new_empty((0,))
    sinks = tensors.sinks
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dsinks


#: fagen::fwd's and fagen::bwd's argument names, in schema order.
FWD_NAMES = ("q", "k", "v") + OP_ORDER
BWD_NAMES = (("do", "q", "k", "v", "o", "lse") + OP_ORDER[:_PREFIX] + ("rng_state",) + OP_ORDER[_PREFIX:-1]
             + ("bias_requires_grad", "sinks", "dlse", "lse_lo"))
_BWD_DEFAULTS = tuple(a.default_value for a in torch._C.parse_schema("fagen::x" + BWD_SCHEMA).arguments)
_BWD_REST = len(BWD_NAMES) - 6  # fagen::bwd's arguments after lse


def _full(args: tuple[Any, ...], names: tuple[str, ...]) -> tuple[Any, ...]:
    """An op's arguments with the trailing defaults the dispatcher drops put back."""
    if len(args) >= len(names):
        return args
    return args + (_DEFAULTS[len(args) - 3:] if names is FWD_NAMES else _BWD_DEFAULTS[len(args):])


# --------------------------------------------------------------------------- registration
# The ops are defined with torch.library's Library API: the implementation (every backend),
# the fake kernel (meta, FakeTensor, torch.compile), the Autograd kernel (below) and the vmap
# rules (torch.func). torch.library.custom_op would generate the Autograd kernel itself, one that
# calls Python's autograd.Function.apply, which torch.func refuses there (torch 2.13: "must
# override the setup_context staticmethod", pytorch/pytorch#168393, #170834, #179652); the
# kernels registered here apply the formula as ATen's autograd kernels do (see below).
_LIB = torch.library.Library("fagen", "FRAGMENT")
_LIB.define("fwd" + FWD_SCHEMA, tags=(torch.Tag.nondeterministic_seeded, torch.Tag.pt2_compliant_tag))
_LIB.define("bwd" + BWD_SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))
_LIB.impl("fwd", _fwd_impl, "CompositeExplicitAutograd")
_LIB.impl("bwd", _bwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake("fagen::fwd", _fwd_fake, lib=_LIB)
torch.library.register_fake("fagen::bwd", _bwd_fake, lib=_LIB)
_FWD = torch.ops.fagen.fwd.default
_BWD = torch.ops.fagen.bwd.default
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
# Where the dispatch key set below autograd is a backend's alone (no dispatch mode, tracing,
# functionalization, fake or subclass tensor, functorch level), redispatching would only reach
# the ops' CompositeExplicitAutograd implementation: the Autograd kernels call it themselves
# then, saving a second conversion of every argument.
_BACKENDS = frozenset((torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA))
_IMPLS = {_FWD: _fwd_impl, _BWD: _bwd_impl}


# --------------------------------------------------------------------------- autograd
#: The error of forward-mode AD (torch.func.jvp / jacfwd / hessian, torch.autograd.forward_ad).
NO_FORWARD_AD = ("fagen attention has no forward-mode AD (jvp/jacfwd) yet: fagen::fwd and fagen::bwd have "
                 "no jvp formula; use reverse mode (backward, torch.func.grad / vjp / jacrev)")
#: The error of differentiating a gradient (double backward, grad of grad, jacrev of grad).
NO_DOUBLE_BACKWARD = ("fagen attention has no double backward: fagen::bwd has no autograd formula (its "
                      "gradients are not differentiable)")


def _merge(data: tuple[Any, ...], scalars: tuple[Any, ...]) -> list[Any]:
    """The OP_ORDER arguments from the tensors (Tensors order) and the scalars (_SCALAR_POS order)."""
    rest: list[Any] = [None] * len(OP_ORDER)
    for i, x in zip(_TENSOR_POS, data):
        rest[i] = x
    for i, x in zip(_SCALAR_POS, scalars):
        rest[i] = x
    return rest


def _op_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor],
              tensors: Optional[Tensors] = None) -> None:
    """What the backward needs (no N x N tensor): q, k, v, o, lse, rng_state and the optional
    tensors as given (``tensors``: those already unpacked); the scalar arguments."""
    rest = inputs[3:]
    o, lse, rng_state, lse_lo = output
    ctx.save_for_backward(*inputs[:3], o, lse, rng_state, lse_lo, *(_get_tensors(rest) if tensors is None else tensors))
    ctx.scalars = _get_scalars(rest)
    ctx.mark_non_differentiable(rng_state, lse_lo)  # lse is differentiable: its gradient enters D (no extra pass)
    ctx.set_materialize_grads(False)  # an unused o or lse hands the backward None, not zeros


def _records_nothing() -> bool:
    """Whether fagen::bwd's Autograd kernel would only redispatch below autograd (grad mode off as in a
    plain ``backward()``, no torch.func level, no forward-mode AD level): a call can skip the kernel."""
    return not (torch.is_grad_enabled() or torch._C._are_functorch_transforms_active()
                or torch.autograd.forward_ad._current_level >= 0)


#: The thread-local dispatch keys a thread includes by default (no functionalization or Python key turned on).
_DEFAULT_TLS_INCLUDE = torch._C._dispatch_tls_local_include_set().raw_repr()


def _dispatch_would_reach_the_implementation(do: Tensor, q: Tensor) -> bool:
    """Whether fagen::bwd, called below autograd on ``do`` and the forward's saved tensors (which took the
    forward's direct call: plain CPU / CUDA tensors), would go straight to its implementation: ``do`` a
    tensor of q's dispatch keys (no subclass, batched, functional or other device's tensor), the thread's
    default included keys, no dispatch mode, no profiler to record the op."""
    return (type(do) is Tensor and torch._C._dispatch_keys(do).raw_repr() == torch._C._dispatch_keys(q).raw_repr()
            and torch._C._dispatch_tls_local_include_set().raw_repr() == _DEFAULT_TLS_INCLUDE
            and not torch._C._len_torch_dispatch_stack() and not torch._C._autograd._profiler_enabled())


def _op_backward(ctx: Any, do: Optional[Tensor], dlse: Optional[Tensor], _drng: Any,
                 _dlo: Any = None) -> tuple[Optional[Tensor], ...]:
    """fagen::bwd on what :func:`_op_setup` kept: dq, dk, dv, and dbias / dsinks where attn_bias
    requires grad / sinks are given. ``do`` / ``dlse`` None: that output's gradient is zero."""
    q, k, v, o, lse, rng_state, lse_lo, *data = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    bias_grad = data[_BIAS_DATA] is not None and bool(ctx.needs_input_grad[_BIAS_INDEX])
    direct = getattr(ctx, "direct", None)
    if direct is not None and _records_nothing() and _dispatch_would_reach_the_implementation(do, q):
        # what the dispatcher would do below fagen::bwd's Autograd kernel, on the forward's own unpacked
        # arguments: no boxed call, no arguments converted to the schema's and back
        dq, dk, dv, dbias, dsinks = _run_bwd(do, q, k, v, o, lse, rng_state, Tensors._make(data), *direct, bias_grad,
                                             dlse, lse_lo, empties=False)
    else:
        rest = _merge(tuple(data), ctx.scalars)
        args = (do, q, k, v, o, lse, *rest[:_PREFIX], rng_state, *rest[_PREFIX:-1], bias_grad, rest[-1], dlse, lse_lo)
        if _records_nothing():  # what fagen::bwd's Autograd kernel would do: go below it (no boxed Python call there)
            with torch._C._AutoDispatchBelowAutograd():
                dq, dk, dv, dbias, dsinks = _BWD(*args)
        else:
            dq, dk, dv, dbias, dsinks = _BWD(*args)
    grads: list[Optional[Tensor]] = [dq, dk, dv] + [None] * len(OP_ORDER)
    if bias_grad:
        grads[_BIAS_INDEX] = dbias
    if data[_SINKS_DATA] is not None and ctx.needs_input_grad[_SINKS_INDEX]:
        grads[_SINKS_INDEX] = dsinks
    return tuple(grads)


def _reaches_the_implementation(keyset: Any) -> bool:
    """Whether a redispatch below autograd of an Autograd kernel's ``keyset`` would only reach the ops'
    implementation (the keys below autograd a backend's alone)."""
    return (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _BACKENDS


def _below_autograd(op: Any, args: tuple[Any, ...]) -> Any:
    """``op`` redispatched below autograd, as an ATen autograd kernel does: ``args`` are the op's
    arguments and (the kernel's dispatch key set, the caller's grad mode). Where functorch levels
    lie below, the grad mode is the caller's again (the Function's forward runs without it), so
    that they (the outer ``grad`` of ``grad(grad(f))``) record the op too."""
    keyset, grad_mode = args[-1]
    if _reaches_the_implementation(keyset):
        return _IMPLS[op](*args[:-1])
    below = keyset & _AFTER_AUTOGRAD
    with torch._C._AutoDispatchBelowAutograd():
        if not grad_mode or not below.has(torch._C.DispatchKey.FuncTorchDynamicLayerBackMode):
            return op.redispatch(below, *args[:-1])
        with torch.enable_grad():
            return op.redispatch(below, *args[:-1])


class _FwdFunction(torch.autograd.Function):
    """fagen::fwd's autograd formula (:func:`_op_setup`, :func:`_op_backward`), applied by the
    op's Autograd kernel; the forward redispatches the op below autograd. Inputs: the op's
    arguments and (the kernel's dispatch key set, grad mode)."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # type: ignore[override]
        keyset, inputs = args[-1][0], args[:-1]
        if _reaches_the_implementation(keyset):  # what _below_autograd would call, on the unpacked arguments
            tensors, max_q, max_k, opts = _unpack(inputs[3:])
            output = _run_fwd(inputs[0], inputs[1], inputs[2], tensors, max_q, max_k, opts)
            ctx.direct = (max_q, max_k, opts)  # the unpacked arguments, for a direct backward (_op_backward)
            _op_setup(ctx, inputs, output, tensors)
        else:
            output = _below_autograd(_FWD, args)
            ctx.direct = None
            _op_setup(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx: Any, do: Optional[Tensor], dlse: Optional[Tensor],  # type: ignore[override]
                 _drng: Any, _dlo: Any) -> tuple[Optional[Tensor], ...]:
        return _op_backward(ctx, do, dlse, _drng, _dlo) + (None,)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(NO_FORWARD_AD)


class _BwdFunction(torch.autograd.Function):
    """fagen::bwd where its inputs take a gradient (``create_graph=True``; torch.func's grad
    levels always ask for one): the gradients are computed as usual, and differentiating them
    raises :data:`NO_DOUBLE_BACKWARD` instead of treating them as constants."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> tuple[Tensor, ...]:  # type: ignore[override]
        return _below_autograd(_BWD, args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError(NO_DOUBLE_BACKWARD)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(NO_FORWARD_AD)


# The Autograd kernels apply the Functions with torch's C++ Function.apply, as an autograd kernel
# of ATen records its node: inside the dispatcher, at the Autograd key of the current functorch
# level (grad, vjp, jvp), on that level's tensors. (Python's Function.apply is for calls above the
# dispatcher: under torch.func it reroutes through functorch's custom_function_call, which needs
# the Function to run before the dispatcher -- the cause of the error torch's generated kernel
# gives.) vmap levels never reach these kernels with mapped tensors: the batching rules below
# run first (FuncTorchBatched precedes Autograd) and call the ops on the folded tensors.
_functorch = torch._C._functorch
_FWD_APPLY = super(torch.autograd.Function, _FwdFunction).apply  # type: ignore[misc]
_BWD_APPLY = super(torch.autograd.Function, _BwdFunction).apply  # type: ignore[misc]


def _differentiated(args: tuple[Any, ...]) -> bool:
    """Whether a call needs the autograd formula: an input that takes a gradient, or a
    forward-mode AD level (torch.func.jvp's included), whose tangents meet the jvp error."""
    return ((torch.is_grad_enabled() and torch._C._any_requires_grad(*args))
            or (torch.autograd.forward_ad._current_level >= 0 and torch._C._is_fwd_grad_enabled()))


def _apply_here(apply: Any, args: tuple[Any, ...]) -> Any:
    """``apply(*args)``, under a functorch level too (torch's C++ apply asserts that functorch
    allowed it: the flag functorch's own single-level Functions set)."""
    if not torch._C._are_functorch_transforms_active():
        return apply(*args)
    allowed = _functorch.get_single_level_autograd_function_allowed()
    _functorch.set_single_level_autograd_function_allowed(True)
    try:
        return apply(*args)
    finally:
        _functorch.set_single_level_autograd_function_allowed(allowed)


def _autograd_kernel(op: Any, names: tuple[str, ...], apply: Any) -> Any:
    """An op's Autograd kernel: its Function where the call is differentiated, else the op
    below autograd."""

    def kernel(keyset: Any, *args: Any) -> Any:
        args = _full(args, names)
        if _differentiated(args):
            return _apply_here(apply, args + ((keyset, torch.is_grad_enabled()),))
        return _below_autograd(op, args + ((keyset, torch.is_grad_enabled()),))

    return kernel


_LIB.impl("fwd", _autograd_kernel(_FWD, FWD_NAMES, _FWD_APPLY), "Autograd", with_keyset=True)
_LIB.impl("bwd", _autograd_kernel(_BWD, BWD_NAMES, _BWD_APPLY), "Autograd", with_keyset=True)


# --------------------------------------------------------------------------- vmap
def _mapped(x: Tensor, d: Optional[int], n: int) -> Tensor:
    """``x`` with its mapped dim first (an unmapped ``x`` broadcast to ``n`` copies, no copy)."""
    return x.movedim(d, 0) if d is not None else x.expand((n,) + tuple(x.shape))


def _fold(x: Tensor) -> Tensor:
    """[n, B, ...] -> [n * B, ...] (a view where the strides allow, else a copy)."""
    return x.reshape((x.shape[0] * x.shape[1],) + tuple(x.shape[2:]))


def _shape(x: Tensor, d: Optional[int]) -> tuple[int, ...]:
    """The shape one mapped call sees."""
    s = tuple(x.shape)
    return s if d is None else s[:d] + s[d + 1:]


def _fold_cu(cu: Tensor, d: Optional[int], n: int, total: int) -> Tensor:
    """cu_seqlens [B + 1] of each of ``n`` problems -> one [n * B + 1] over their concatenated
    tokens (problem i's tokens offset by ``i * total``), computed on cu's device."""
    c = _mapped(cu, d, n)
    shift = torch.arange(n, device=cu.device, dtype=cu.dtype)[:, None] * total
    return torch.cat([(c[:, :-1] + shift).reshape(-1), c[-1, -1:] + (n - 1) * total])


def _fold_mask(x: Optional[Tensor], d: Optional[int], n: int, B: int, own: bool = False) -> Optional[Tensor]:
    """An attn_mask / attn_bias (broadcastable to [B, H, Nq, Nk]) of ``n`` problems -> one of
    [n * B, h, nq, nk]. An unmapped one without a batch dim stays as it is (it broadcasts) unless
    ``own`` (each problem gets its own copy: its gradient is per problem)."""
    if x is None:
        return None
    s = _shape(x, d)
    if d is None and not own and (len(s) < 4 or s[0] == 1):
        return x
    m = _mapped(x, d, n)
    m = m.reshape((n,) + (1,) * (4 - len(s)) + s)
    return _fold(m.expand((n, B) + tuple(m.shape[2:])))


def _fold_tensors(t: Tensors, dims: dict[str, Optional[int]], n: int, B: int, totals: tuple[int, int],
                  own_bias: bool = False) -> Tensors:
    """The optional tensors of ``n`` problems folded into one problem's batch."""
    slopes = t.alibi_slopes
    if slopes is not None and (dims["alibi_slopes"] is not None or len(_shape(slopes, dims["alibi_slopes"])) == 2):
        m = _mapped(slopes, dims["alibi_slopes"], n)
        slopes = _fold((m if m.dim() == 3 else m[:, None]).expand((n, B, m.shape[-1])))
    kpm = None if t.key_padding_mask is None else _fold(_mapped(t.key_padding_mask, dims["key_padding_mask"], n))
    cu_q = cu_k = None
    if t.cu_seqlens_q is not None:
        cu_q = _fold_cu(t.cu_seqlens_q, dims["cu_seqlens_q"], n, totals[0])
        cu_k = _fold_cu(t.cu_seqlens_k, dims["cu_seqlens_k"], n, totals[1])
    return Tensors(kpm, slopes, _fold_mask(t.attn_mask, dims["attn_mask"], n, B),
                   _fold_mask(t.attn_bias, dims["attn_bias"], n, B, own_bias), cu_q, cu_k, None)


def _dims(names: tuple[str, ...], in_dims: tuple[Optional[int], ...]) -> dict[str, Optional[int]]:
    return dict(zip(names, tuple(in_dims) + (None,) * (len(names) - len(in_dims))))


def _check_random(info: Any, opts: AttentionOptions) -> None:
    if opts.dropout_p > 0 and info.randomness == "error":
        raise RuntimeError("vmap: called random operation while in randomness error mode. Please either use the "
                           "'same' or 'different' randomness flags on vmap or perform the randomness operation out "
                           "of vmap (fagen attention with dropout_p > 0)")
    if opts.dropout_p > 0 and info.randomness == "same":
        raise NotImplementedError("fagen attention under vmap(randomness='same') with dropout_p > 0: each mapped "
                                  "problem draws its own keep-mask (use randomness='different')")


def _sink_rows(sinks: Tensor, packed: bool) -> Tensor:
    """Mapped sinks [n, H] against lse of n problems ([n, B, H, Nq], or [H, n, total_q] packed)."""
    return sinks.t()[:, :, None] if packed else sinks[:, None, :, None]


def _fwd_vmap(info: Any, in_dims: tuple[Optional[int], ...], *args: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """fagen::fwd's batching rule: the mapped dim of ``n`` problems folds into the batch
    ([n * B, ...]; packed: n * total tokens, cu_seqlens shifted) and fagen::fwd runs once.
    Unmapped inputs are broadcast (q, k, v copied ``n`` times; masks without a batch dim not).
    Mapped sinks: the problems run without them and each gets its own in torch (the sink only
    rescales o and adds to lse)."""
    args = _full(args, FWD_NAMES)
    dims = _dims(FWD_NAMES, in_dims)
    n = info.batch_size
    q, k, v = args[:3]
    tensors, max_q, max_k, opts = _unpack(args[3:])
    _check_random(info, opts)
    packed = tensors.cu_seqlens_q is not None
    total_q, total_k = _shape(q, dims["q"])[0], _shape(k, dims["k"])[0]
    B = _shape(tensors.cu_seqlens_q, dims["cu_seqlens_q"])[0] - 1 if packed else total_q
    folded = _fold_tensors(tensors, dims, n, B, (total_q, total_k))
    sinks, mapped_sinks = tensors.sinks, dims["sinks"] is not None
    if sinks is not None and not mapped_sinks:
        folded = folded._replace(sinks=sinks)
    fq, fk, fv = (_fold(_mapped(x, dims[name], n)) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    o, lse, rng_state, lse_lo = _FWD(fq, fk, fv, *op_arguments(opts, folded, max_q, max_k))
    o = o.reshape((n, total_q) + tuple(o.shape[1:]))
    lse = lse.reshape((lse.shape[0], n, total_q)) if packed else lse.reshape((n, B) + tuple(lse.shape[1:]))
    lse_lo = lse_lo.reshape(lse.shape)
    if sinks is not None and mapped_sinks:
        with_sink = torch.logaddexp(lse, _sink_rows(_mapped(sinks, dims["sinks"], n), packed).to(lse.dtype))
        scale = torch.exp(lse - with_sink)  # Z / (Z + e^sink); 0 for a row that sees no key
        scale = scale.permute(1, 2, 0) if packed else scale.transpose(-1, -2)
        o, lse = (o * scale[..., None]).to(o.dtype), with_sink
        lse_lo = torch.zeros_like(lse_lo)  # the sink moved lse in torch: the rounded lse serves
    return (o, lse, rng_state, lse_lo), (0, 1 if packed else 0, None, 1 if packed else 0)


def _bwd_vmap(info: Any, in_dims: tuple[Optional[int], ...], *args: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """fagen::bwd's batching rule: the fold of :func:`_fwd_vmap` (the same batch order, so a
    dropout mask replays), fagen::bwd once; dbias summed back to each problem's attn_bias shape,
    dsinks per problem (-sum P_sink D' in float64, as the kernels' backward computes it)."""
    args = _full(args, BWD_NAMES)
    dims = _dims(BWD_NAMES, in_dims)
    n = info.batch_size
    a = dict(zip(BWD_NAMES, args))
    rest = tuple(a[name] for name in OP_ORDER)
    tensors, max_q, max_k, opts = _unpack(rest)
    if dims["rng_state"] is not None:
        raise NotImplementedError("vmap over fagen::bwd's rng_state: one dropout key serves every mapped problem")
    if opts.dropout_p > 0 and (dims["lse"] is None or dims["o"] is None):
        raise NotImplementedError("vmap over the backward of a dropout forward that was not vmapped: the folded "
                                  "problems would not replay its keep-mask (dropout_p > 0)")
    packed = tensors.cu_seqlens_q is not None
    q, k = a["q"], a["k"]
    total_q, total_k = _shape(q, dims["q"])[0], _shape(k, dims["k"])[0]
    B = _shape(tensors.cu_seqlens_q, dims["cu_seqlens_q"])[0] - 1 if packed else total_q
    bias_grad = bool(a["bias_requires_grad"]) and tensors.attn_bias is not None
    folded = _fold_tensors(tensors, dims, n, B, (total_q, total_k), own_bias=bias_grad)
    do, q, k, v, o = (_fold(_mapped(a[name], dims[name], n)) for name in ("do", "q", "k", "v", "o"))
    lse, dlse, lse_lo = a["lse"], a["dlse"], a["lse_lo"]
    lse_n = _mapped(lse, dims["lse"], n)  # [n, B, H, Nq] or packed [n, H, total_q]
    dlse_n = None if dlse is None else _mapped(dlse, dims["dlse"], n)
    lo_n = None if lse_lo is None else _mapped(lse_lo, dims["lse_lo"], n)

    def fold_lse(x: Optional[Tensor]) -> Optional[Tensor]:
        if x is None:
            return None
        return x.transpose(0, 1).reshape((x.shape[1], -1)) if packed else _fold(x)

    fa = op_arguments(opts, folded, max_q, max_k)
    dq, dk, dv, dbias, _ = _BWD(do, q, k, v, o, fold_lse(lse_n), *fa[:_PREFIX], a["rng_state"], *fa[_PREFIX:-1],
                                bias_grad, None, fold_lse(dlse_n), fold_lse(lo_n))
    out = [dq.reshape((n, total_q) + tuple(dq.shape[1:])), dk.reshape((n, total_k) + tuple(dk.shape[1:])),
           dv.reshape((n, total_k) + tuple(dv.shape[1:])), dbias, q.new_empty((0,))]
    out_dims: list[Optional[int]] = [0, 0, 0, None, None]
    if bias_grad:
        s = _shape(tensors.attn_bias, dims["attn_bias"])
        db = dbias.reshape((n, B) + tuple(dbias.shape[1:]))
        if len(s) < 4 or s[0] == 1:
            db = db.sum(1, keepdim=True)
        out[3], out_dims[3] = db.reshape((n,) + s), 0
    if tensors.sinks is not None:
        # D' = rowsum(dO o O) - dlse, per problem; dsinks_h = -sum_{b, i} exp(sink_h - lse) D'
        prod = (do.double() * o.double()).sum(-1)  # [n * B, Nq, H] or [n * total_q, H]
        delta = prod.reshape((n, total_q) + tuple(prod.shape[1:]))
        delta = delta.permute(0, 2, 1) if packed else delta.transpose(-1, -2)
        if dlse_n is not None:
            delta = delta - dlse_n.double()
        sinks = _mapped(tensors.sinks, dims["sinks"], n).double()
        rows = torch.exp((sinks[:, :, None] if packed else sinks[:, None, :, None]) - lse_n.double()) * delta
        out[4], out_dims[4] = (-rows.sum(dim=(2,) if packed else (1, 3))).to(tensors.sinks.dtype), 0
    return tuple(out), tuple(out_dims)


torch.library.register_vmap("fagen::fwd", _fwd_vmap, lib=_LIB)
torch.library.register_vmap("fagen::bwd", _bwd_vmap, lib=_LIB)


def _apply(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, tensors: Tensors,
           max_seqlen_q: Any = None, max_seqlen_k: Any = None) -> tuple[Tensor, Tensor, Tensor]:
    o, lse, rng_state, _lse_lo = _FWD(q, k, v, *op_arguments(options, tensors, max_seqlen_q, max_seqlen_k))
    return o, lse, rng_state  # lse_lo: kept by autograd for the backward (fagen.functional.attention_forward)

# --------------------------------------------------------------------------- validation
_PLAIN_TORCH_FUNCTION = (torch.Tensor.__torch_function__, torch._C._disabled_torch_function_impl)


def _check_tensors(**tensors: Any) -> None:
    """Tensors (or None), naming the argument. A tensor subclass with its own
    ``__torch_function__`` (a mask type such as torch's ``CausalBias``, ``MaskedTensor``) means
    more than its memory, so it is refused; subclasses that only dispatch (Parameter, the fake
    and functional tensors of tracing, DTensor) go through the ops like plain tensors."""
    for name, t in tensors.items():
        if t is None or type(t) is torch.Tensor:
            continue
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(name, "a torch.Tensor", type(t).__name__)
        if getattr(type(t).__torch_function__, "__func__", type(t).__torch_function__) not in _PLAIN_TORCH_FUNCTION:
            raise InputTypeError(name, "a plain torch.Tensor (a tensor subclass with its own __torch_function__ "
                                 "is not read as data)", type(t).__name__)


def _check_max_seqlen(max_seqlen_q: Any, max_seqlen_k: Any) -> None:
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, torch.SymInt))):
            raise InputError(name, "an int (the longest sequence)", repr(m))


def attention(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, tensors: Optional[Tensors] = None, *,
              max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Differentiable attention with every option: ``(o, lse, rng_state)`` in the layout of
    :func:`fagen.functional.forward` (q [B, Nq, H, d] or packed [total_q, H, d]). ``options``:
    a validated :class:`~fagen.AttentionOptions`; ``tensors``: the optional inputs
    (:class:`fagen.functional.Tensors`). The entry point of the integrations."""
    if type(options) is not AttentionOptions:
        raise InputTypeError("options", "a fagen.AttentionOptions", type(options).__name__)
    t = Tensors() if tensors is None else tensors
    if type(t) is not Tensors:
        raise InputTypeError("tensors", "a fagen.functional.Tensors (or None)", type(t).__name__)
    _check_tensors(q=q, k=k, v=v, **t._asdict())
    _check_max_seqlen(max_seqlen_q, max_seqlen_k)
    return _apply(q, k, v, options, t, max_seqlen_q, max_seqlen_k)


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
    rule of :func:`fagen.masking.band` (materialises N x N; no autograd)."""
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
    shift, lo, hi = band(Nq, Nk, causal=causal, window=(left, right))
    offs = torch.arange(Nk, device=q.device)[None, :] - torch.arange(Nq, device=q.device)[:, None] - shift
    allowed = torch.ones((B, 1, Nq, Nk), dtype=torch.bool, device=q.device)
    if lo is not None:
        allowed = allowed & (offs >= lo)
    if hi is not None:
        allowed = allowed & (offs <= hi)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(torch.bool)[:, None, None, :]
    lse_ = lse.to(acc)[..., None]
    p = torch.where(allowed & torch.isfinite(lse_), torch.exp(s - lse_), torch.zeros_like(s))
    if keep is not None:
        p = torch.where(keep.to(p.device), p, -p)
    return p.to(q.dtype)


# --------------------------------------------------------------------------- public ops
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, key_padding_mask: Optional[Tensor] = None,
                    sinks: Optional[Tensor] = None, return_lse: bool = False) -> Union[Tensor, tuple[Tensor, ...]]:
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
        sinks: fp32 [H], attention sinks (keyword-only): one logit per query head that joins every
            row's softmax denominator and contributes no value; lse includes it; differentiable.
        return_lse: also return ``softmax_lse`` (keyword-only), differentiable like ``out``.

    Returns ``out`` [B, Nq, H, d], ``(out, softmax_lse)`` with ``return_lse``, or ``(out, softmax_lse,
    S_dmask)`` with ``return_attn_probs``; ``softmax_lse`` [B, H, Nq] takes a gradient.
    """
    _check_tensors(q=q, k=k, v=v, key_padding_mask=key_padding_mask, alibi_slopes=alibi_slopes, sinks=sinks)
    want_probs = F.validate_flag("return_attn_probs", return_attn_probs)
    want_lse = F.validate_flag("return_lse", return_lse)
    opts = AttentionOptions.of(causal=causal, dropout_p=dropout_p, softmax_scale=softmax_scale,
                               window_size=window_size, softcap=softcap, deterministic=deterministic)
    o, lse, rng_state = _apply(q, k, v, opts, Tensors(key_padding_mask, alibi_slopes, sinks=sinks))
    if not want_probs:
        return (o, lse) if want_lse else o
    s_dmask = attn_probs(q, k, lse, rng_state, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         key_padding_mask=key_padding_mask)
    return o, lse, s_dmask


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, *, sinks: Optional[Tensor] = None,
                           return_lse: bool = False) -> Union[Tensor, tuple[Tensor, ...]]:
    """flash-attn's packed-sequence attention, differentiable.

    q: [total_q, H, d], k, v: [total_k, H_kv, d] -- sequence b is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]``; cu_seqlens_q/k: int32 [B + 1] on q's device (0 first,
    non-decreasing, last = total; lengths 0 allowed); max_seqlen_q/k: ints at least every length.
    Causal, window and ALiBi are aligned bottom-right per sequence. The other arguments as
    :func:`flash_attn_func` (``sinks`` and ``return_lse`` keyword-only). Returns ``out`` [total_q, H, d],
    ``(out, softmax_lse [H, total_q])`` with ``return_lse``, or ``(out, softmax_lse, S_dmask [B, H,
    max_seqlen_q, max_seqlen_k])`` with ``return_attn_probs``.
    """
    _check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
                   sinks=sinks)
    want_probs = F.validate_flag("return_attn_probs", return_attn_probs)
    want_lse = F.validate_flag("return_lse", return_lse)
    _check_max_seqlen(max_seqlen_q, max_seqlen_k)
    opts = AttentionOptions.of(causal=causal, dropout_p=dropout_p, softmax_scale=softmax_scale,
                               window_size=window_size, softcap=softcap, deterministic=deterministic)
    o, lse, rng_state = _apply(q, k, v, opts, Tensors(alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                                                      cu_seqlens_k=cu_seqlens_k, sinks=sinks),
                               max_seqlen_q, max_seqlen_k)
    if not want_probs:
        return (o, lse) if want_lse else o
    s_dmask = attn_probs(q, k, lse, rng_state, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k)
    return o, lse, s_dmask


# --------------------------------------------------------------------------- packed entry points
def _unpacked(t: Any, name: str, n: int, dim: int, layout: str) -> tuple[Tensor, ...]:
    """The ``n`` views ``t.unbind(dim)`` of a packed tensor (no copy; autograd sums their
    gradients back into ``t``), after checking its shape names ``name``."""
    _check_tensors(**{name: t})
    if t is None or not isinstance(t, torch.Tensor):
        raise InputTypeError(name, f"a torch.Tensor {layout}", type(t).__name__)
    if t.dim() != dim + 3 or t.shape[dim] != n:
        raise InputError(name, f"a {dim + 3}-D tensor {layout}", f"shape {tuple(t.shape)}")
    return t.unbind(dim)


def _packed_call(names: dict[str, str], fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (InputError, InputTypeError) as err:
        raise _renamed(err, names) from None


_QKV_NAMES = {"q": "qkv", "k": "qkv", "v": "qkv"}
_KV_NAMES = {"k": "kv", "v": "kv"}


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                              return_attn_probs: bool = False, **extra: Any) -> Union[Tensor, tuple[Tensor, ...]]:
    """flash-attn's ``flash_attn_qkvpacked_func``: ``qkv`` [B, N, 3, H, d] (q, k, v stacked in
    dim 2). Runs :func:`flash_attn_func` on the three views ``qkv.unbind(2)`` (no copy; the
    gradients flow back into ``qkv``). Returns as :func:`flash_attn_func`; fagen's keyword-only
    additions of :func:`flash_attn_func` are taken too."""
    q, k, v = _unpacked(qkv, "qkv", 3, 2, "[B, N, 3, H, d]")
    return _packed_call(_QKV_NAMES, flash_attn_func, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_attn_probs, **extra)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                             return_attn_probs: bool = False, **extra: Any) -> Union[Tensor, tuple[Tensor, ...]]:
    """flash-attn's ``flash_attn_kvpacked_func``: q [B, Nq, H, d], ``kv`` [B, Nk, 2, H_kv, d] (k, v
    stacked in dim 2; MQA/GQA: H a multiple of H_kv). Runs :func:`flash_attn_func` on
    ``kv.unbind(2)`` (views). Returns as :func:`flash_attn_func`."""
    k, v = _unpacked(kv, "kv", 2, 2, "[B, Nk, 2, H_kv, d]")
    return _packed_call(_KV_NAMES, flash_attn_func, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_attn_probs, **extra)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False,
                                     **extra: Any) -> Union[Tensor, tuple[Tensor, ...]]:
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` [total, 3, H, d] packed
    sequences (``cu_seqlens`` int32 [B + 1], ``max_seqlen``), the same lengths for queries and
    keys. Runs :func:`flash_attn_varlen_func` on ``qkv.unbind(1)`` (views). Returns as
    :func:`flash_attn_varlen_func`."""
    q, k, v = _unpacked(qkv, "qkv", 3, 1, "[total, 3, H, d]")
    names = {**_QKV_NAMES, "cu_seqlens_q": "cu_seqlens", "cu_seqlens_k": "cu_seqlens", "max_seqlen_q": "max_seqlen",
             "max_seqlen_k": "max_seqlen"}
    return _packed_call(names, flash_attn_varlen_func, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                        return_attn_probs, **extra)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False,
                                    **extra: Any) -> Union[Tensor, tuple[Tensor, ...]]:
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: q [total_q, H, d], ``kv`` [total_k, 2,
    H_kv, d]. Runs :func:`flash_attn_varlen_func` on ``kv.unbind(1)`` (views). Returns as
    :func:`flash_attn_varlen_func`."""
    k, v = _unpacked(kv, "kv", 2, 1, "[total_k, 2, H_kv, d]")
    return _packed_call(_KV_NAMES, flash_attn_varlen_func, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs, **extra)


# --------------------------------------------------------------------------- SDPA
_SDPA_NAMES = {"q": "query", "k": "key", "v": "value", "attn_bias": "attn_mask", "causal": "is_causal",
               "softmax_scale": "scale", "causal_align": "is_causal"}


def _renamed(err: FagenError, names: Optional[dict[str, str]] = None) -> FagenError:
    """An error from the flash layout, naming the caller's argument instead (SDPA's by default)."""
    name = (_SDPA_NAMES if names is None else names).get(getattr(err, "argument", ""), None)
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
    if tuple(value.shape[:-1]) != tuple(key.shape[:-1]):
        raise InputError("value", f"the shape of key {tuple(key.shape)} but for its head dim ({_layout(lead, 'Nk')})",
                         tuple(value.shape))


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
        kpm = attn_mask.reshape(padded).expand(lead + (1, 1, Nk)).reshape(math.prod(lead), Nk)
        return kpm.contiguous(), None, None
    m = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(query.dtype)
    if len(lead) > 1:  # several leading dims: flattened (a copy only when their strides do not merge)
        m = m.reshape(padded).expand(full).reshape((math.prod(lead), H, Nq, Nk))
    elif not lead and len(shape) == 3:
        m = m.unsqueeze(0)
    return (None, m, None) if m.dtype == torch.bool else (None, None, m)


def _causal_bias(attn_mask: Any, is_causal: bool, Nq: int, Nk: int) -> Optional[str]:
    """torch's ``CausalBias`` (``torch.nn.attention.bias.causal_upper_left/lower_right``) as
    torch's SDPA reads it: the alignment of a causal mask (no N x N mask), or None for other masks."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    if not isinstance(attn_mask, CausalBias):
        return None
    if is_causal:
        raise InputError("is_causal", "False with a CausalBias attn_mask (the bias is the causal mask)", True)
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (Nq, Nk):
        raise InputError("attn_mask", f"a CausalBias of [Nq, Nk] = [{Nq}, {Nk}] (the query and key lengths)",
                         f"[{attn_mask.seq_len_q}, {attn_mask.seq_len_kv}]")
    upper_left = attn_mask.variant == CausalVariant.UPPER_LEFT or Nq == Nk
    return "top_left" if upper_left else "bottom_right"


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, sinks: Optional[Tensor] = None) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with its layout and semantics.

    query [..., H, Nq, d], key/value [..., H_kv, Nk, d] (3-D [H, N, d] included; H_kv = H unless
    ``enable_gqa``) -> [..., H, Nq, d]. ``is_causal`` is top-left aligned as torch's (query i sees
    keys j <= i). ``attn_mask`` broadcastable to [..., H, Nq, Nk]: bool (True = take part) or an
    additive float bias (differentiable), read with its own strides (broadcast dims are stride 0,
    never expanded in memory); or torch's ``CausalBias`` (``causal_upper_left`` /
    ``causal_lower_right`` of [Nq, Nk]): a causal mask aligned top-left / bottom-right, as torch
    reads it, with no N x N mask. Other tensor subclasses are refused. A bool mask may be combined
    with ``is_causal`` (torch refuses). A query row that may attend to no key gets 0 (and zero
    gradients), as torch's fused CUDA kernels and its math backend return. Empty inputs (any
    size 0) give the empty or zero results torch gives. ``sinks`` (keyword-only, fp32 [H]):
    attention sinks, as :func:`flash_attn_func`'s.
    """
    if attn_mask is not None and type(attn_mask) is not torch.Tensor:
        _check_tensors(query=query, key=key, value=value)
        _sdpa_check(query, key, value, _bool_arg("enable_gqa", enable_gqa))
        align = _causal_bias(attn_mask, _bool_arg("is_causal", is_causal), query.shape[-2], key.shape[-2])
        if align is not None:
            return _sdpa(query, key, value, None, dropout_p, True, scale, enable_gqa, align, sinks)
        _check_tensors(attn_mask=attn_mask)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, "top_left", sinks)


def _bool_arg(name: str, value: Any) -> bool:
    return F.validate_flag(name, value)


def _sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: Any, is_causal: Any,
          scale: Any, enable_gqa: Any, causal_align: str, sinks: Optional[Tensor] = None) -> Tensor:
    _check_tensors(query=query, key=key, value=value, attn_mask=attn_mask, sinks=sinks)
    enable_gqa = _bool_arg("enable_gqa", enable_gqa)
    is_causal = _bool_arg("is_causal", is_causal)
    _sdpa_check(query, key, value, enable_gqa)
    lead = tuple(query.shape[:-3])
    H, Nq, d = query.shape[-3:]
    Hk, Nk = key.shape[-3], key.shape[-2]
    B = math.prod(lead)  # explicit: -1 cannot be inferred for empty tensors
    q4 = query.reshape((B, H, Nq, d))
    k4 = key.reshape((B, Hk, Nk, d))
    v4 = value.reshape((B, Hk, Nk, value.shape[-1]))
    kpm = mask = bias = None
    if attn_mask is not None:
        kpm, mask, bias = _sdpa_mask(attn_mask, query, lead + (H, Nq, Nk))
    try:
        opts = AttentionOptions.of(causal=is_causal, dropout_p=dropout_p, softmax_scale=scale,
                                   causal_align=causal_align)
        o, _lse, _rng = _apply(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), opts,
                               Tensors(kpm, None, mask, bias, sinks=sinks))
    except (InputError, InputTypeError) as err:
        raise _renamed(err) from None
    return o.transpose(1, 2).reshape(tuple(query.shape[:-1]) + (value.shape[-1],))
