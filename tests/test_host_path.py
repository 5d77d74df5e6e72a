"""The launch path on the host: no synchronisation, the same launches for the same call (what
a CUDA graph replays), launch plans that follow the tensors' metadata, empty inputs at every
entry point, size-1 dimensions whose stride does not matter, dK/dV written by the kernels
without a zero-fill, tensor subclasses, and the one options object.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as TF

import fagen
import fagen.functional as F
import fagen.ops as O
from fagen import AttentionOptions, flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention
from fagen.errors import InputError, InputTypeError
from fagen.reference import attention_forward_ref
from fagen.spec import KernelSpec

REPO = Path(__file__).resolve().parent.parent


class Recorder:
    """A launcher that records every launch (kernel name, grid, the kernel's arguments by
    parameter) and runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple[int, int, int], dict[str, Any], frozenset[str]]] = []

    def launch(self, kernel: Any, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        pointers = frozenset(n for t, n in kernel.params if t.endswith("*"))
        self.launches.append((kernel.name, grid, {n: args[n] for _, n in kernel.params}, pointers))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(F, "get_module", lambda spec, device_type: rec)
    return rec


def _inputs(B: int = 2, N: int = 64, H: int = 4, d: int = 32, *, Hkv: int | None = None, dtype=torch.float16,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    q = torch.randn(B, N, H, d, generator=g).to(dtype)
    k = torch.randn(B, N, Hkv, d, generator=g).to(dtype)
    v = torch.randn(B, N, Hkv, d, generator=g).to(dtype)
    do = torch.randn(B, N, H, d, generator=g).to(dtype)
    return q, k, v, do


def _leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in ts]


# --------------------------------------------------------------------------- no host synchronisation
def _refuse(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("a host synchronisation was reached on the launch path")


@pytest.fixture
def no_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way of reading a tensor value on the host, or waiting for a device, raises."""
    for name in ("item", "tolist", "cpu", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, _refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", _refuse)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", _refuse)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", _refuse)


def test_the_refusals_are_real(no_sync: None) -> None:
    with pytest.raises(AssertionError, match="synchronisation"):
        torch.ones(2).tolist()
    with pytest.raises(AssertionError, match="synchronisation"):
        torch.ones(1).item()


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_no_host_sync_in_a_forward_and_backward(recorder: Recorder, dropout_p: float) -> None:
    q, k, v, do = _inputs()
    leaves = _leaves(q, k, v)
    mask = torch.ones(2, 64, dtype=torch.bool)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "cpu", "__int__", "__float__", "__index__"):
            mp.setattr(torch.Tensor, name, _refuse)
        mp.setattr(torch.cuda, "synchronize", _refuse)
        flash_attn_func(*leaves, dropout_p=dropout_p, causal=True, key_padding_mask=mask).backward(do)
    assert len(recorder.launches) >= 4 and all(x.grad is not None for x in leaves)


def test_no_host_sync_in_varlen_and_sdpa(recorder: Recorder, no_sync: None) -> None:
    """Packed sequences take max_seqlen from the caller; the sequence bounds stay on the device."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(11, 2, 16, generator=g).half().requires_grad_(True) for _ in range(3))
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
    out.backward(torch.ones_like(out))
    qs, ks, vs = (torch.randn(2, 2, 24, 16, generator=g).requires_grad_(True) for _ in range(3))
    bias = torch.randn(2, 1, 24, 24, generator=g, requires_grad=True)
    scaled_dot_product_attention(qs, ks, vs, attn_mask=bias).sum().backward()
    assert bias.grad is not None and q.grad is not None


def test_varlen_values_are_checked_on_the_cpu() -> None:
    """CPU tensors (the emulator reads them) are still checked, through numpy: no device involved."""
    q = k = v = torch.zeros(11, 2, 16, dtype=torch.float16)
    with pytest.raises(InputError, match="max_seqlen_q"):
        flash_attn_varlen_func(q, k, v, torch.tensor([0, 4, 11], dtype=torch.int32),
                               torch.tensor([0, 4, 11], dtype=torch.int32), 5, 7)
    with pytest.raises(InputError, match="cu_seqlens_k"):
        flash_attn_varlen_func(q, k, v, torch.tensor([0, 4, 11], dtype=torch.int32),
                               torch.tensor([0, 4, 10], dtype=torch.int32), 7, 7)


# --------------------------------------------------------------------------- the same call, the same launches
def _record_step(recorder: Recorder, seed: int, **kw: Any) -> list[tuple[Any, ...]]:
    recorder.launches.clear()
    q, k, v, do = _inputs()
    torch.manual_seed(seed)
    flash_attn_func(*_leaves(q, k, v), **kw).backward(do)
    return list(recorder.launches)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(dropout_p=0.1, window_size=(8, 0), softcap=5.0)], ids=str)
def test_the_same_call_twice_makes_the_same_launches(recorder: Recorder, kw: dict) -> None:
    """What a CUDA graph captures: the same kernels, grids and arguments, except data pointers
    (fresh tensors each call); with torch.manual_seed, the same dropout key."""
    first = _record_step(recorder, 5, **kw)
    second = _record_step(recorder, 5, **kw)
    assert [x[:2] for x in first] == [x[:2] for x in second] and len(first) >= 4
    for (name, _grid, a, pointers), (_n, _g, b, _p) in zip(first, second):
        scalars = {n for n in a if n not in pointers}
        assert {n: a[n] for n in scalars} == {n: b[n] for n in scalars}, name
    # the arguments left out above are the data pointers (the allocator may hand the second call's
    # fresh outputs the first call's freed addresses, so their values are not compared either way)
    assert all(ptrs and all(n in a for n in ptrs) for (_n, _g, a, ptrs) in first)


def test_a_new_stride_is_a_new_plan(recorder: Recorder) -> None:
    """Plans are keyed by the tensors' metadata: a transposed-storage q launches with its own strides."""
    q, k, v, _ = _inputs()
    F.attention_forward(q, k, v)
    F.attention_forward(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)
    (_, _, a, _), (_, _, b, _) = recorder.launches
    assert (a["stride_q_s"], a["stride_q_h"]) == (4 * 32, 32)
    assert (b["stride_q_s"], b["stride_q_h"]) == (32, 64 * 32)
    assert a["stride_k_s"] == b["stride_k_s"]


def test_a_repeated_call_validates_nothing_again(recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, _ = _inputs(N=48)
    opts = AttentionOptions(causal=True)
    F.forward(q, k, v, opts)
    monkeypatch.setattr(F, "validate_qkv", _refuse)
    monkeypatch.setattr(F, "spec_for", _refuse)
    F.forward(q, k, v, opts)
    with pytest.raises(AssertionError):  # other metadata: validated (and planned) anew
        F.forward(q[:, :40], k, v, opts)


# --------------------------------------------------------------------------- empty inputs
EMPTY = [(0, 8, 2, 8), (2, 0, 2, 8), (2, 8, 0, 0), (2, 8, 2, 0)]  # (B, Nq, H, Nk)


@pytest.mark.parametrize("B,Nq,H,Nk", EMPTY, ids=str)
def test_empty_inputs_flash_layout(B: int, Nq: int, H: int, Nk: int) -> None:
    q = torch.randn(B, Nq, H, 8, requires_grad=True)
    k = torch.randn(B, Nk, H, 8, requires_grad=True)
    v = torch.randn(B, Nk, H, 8, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == q.shape and not out.any()
    out.backward(torch.ones_like(out))
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.any()
    o, lse = F.attention_forward(q.detach(), k.detach(), v.detach())
    assert lse.shape == (B, H, Nq) and (Nk > 0 or bool((lse == -math.inf).all()))
    grads = F.attention_backward(torch.ones_like(o), q.detach(), k.detach(), v.detach(), o, lse)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and not any(g.any() for g in grads)


@pytest.mark.parametrize("lead,H,Nq,Nk", [((2,), 2, 0, 8), ((2,), 0, 8, 8), ((2,), 2, 8, 0), ((0, 3), 2, 8, 8),
                                          ((), 2, 0, 5)], ids=str)
def test_empty_inputs_sdpa_match_torch(lead: tuple[int, ...], H: int, Nq: int, Nk: int) -> None:
    g = torch.Generator().manual_seed(2)
    shapes = ((*lead, H, Nq, 8), (*lead, H, Nk, 8), (*lead, H, Nk, 8))
    ours = [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]
    theirs = _leaves(*ours)
    mask = torch.ones((Nq, Nk), dtype=torch.bool)
    for fn, xs in ((scaled_dot_product_attention, ours), (TF.scaled_dot_product_attention, theirs)):
        out = fn(*xs, attn_mask=mask)
        out.backward(torch.ones_like(out))
    got = scaled_dot_product_attention(*[x.detach() for x in ours])
    want = TF.scaled_dot_product_attention(*[x.detach() for x in theirs])
    assert got.shape == want.shape and torch.equal(got, want)
    for a, b in zip(ours, theirs):
        assert a.grad.shape == b.grad.shape and torch.equal(a.grad, b.grad)


def test_empty_inputs_varlen() -> None:
    q = torch.zeros(0, 2, 8, requires_grad=True)
    k = torch.randn(5, 2, 8, requires_grad=True)
    v = torch.randn(5, 2, 8, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 0, 0], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 3)
    assert out.shape == (0, 2, 8)
    out.sum().backward()
    assert k.grad.shape == k.shape and not k.grad.any() and not v.grad.any()
    none = torch.tensor([0], dtype=torch.int32)  # no sequence at all
    assert flash_attn_varlen_func(q.detach(), k.detach()[:0], v.detach()[:0], none, none, 0, 0).shape == (0, 2, 8)


# --------------------------------------------------------------------------- size-1 dimensions
def test_a_size_one_head_dim_with_any_stride() -> None:
    """d = 1 as a view with last-dimension stride != 1 (legal: the stride of a size-1 dim never matters)."""
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(1, 9, 2, 4, generator=g) for _ in range(3)]
    strided = [b[..., ::4] for b in base]
    assert all(t.shape[-1] == 1 and t.stride(-1) == 4 for t in strided)
    dense = [t.contiguous() for t in strided]
    got = flash_attn_func(*strided, causal=True)
    assert torch.equal(got, flash_attn_func(*dense, causal=True))
    ref, _ = attention_forward_ref(*(t.double() for t in dense), causal=True)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
    heads1 = torch.randn(1, 9, 1, 8, generator=g).as_strided((1, 9, 1, 8), (9 * 8, 8, 12345, 1))
    got = flash_attn_func(heads1, heads1, heads1)  # a size-1 head dim of any stride
    assert torch.equal(got, flash_attn_func(*(heads1.contiguous(),) * 3))


# --------------------------------------------------------------------------- dK, dV need no zero-fill
def _poisoned_empty(real: Any) -> Any:
    def empty(*args: Any, **kw: Any) -> torch.Tensor:
        t = real(*args, **kw)
        return t.fill_(math.nan) if t.is_floating_point() else t
    return empty


@pytest.mark.parametrize("impl", ["simt", "mma"])
@pytest.mark.parametrize("case", [
    dict(Nq=20, Nk=37, Hkv=1, causal=True, causal_align="top_left"),  # GQA, keys no query sees, an Nk tail
    dict(Nq=17, Nk=40, window_size=(4, 2), key_padding=True),  # a window, padded keys
], ids=str)
def test_dk_dv_are_written_by_the_kernels(monkeypatch: pytest.MonkeyPatch, impl: str, case: dict) -> None:
    """Every torch.empty of the call is filled with NaN: the main kernel writes every element of
    dK and dV (padded keys and unseen keys included) for each family."""
    case = dict(case)
    Nq, Nk, Hkv = case.pop("Nq"), case.pop("Nk"), case.pop("Hkv", 2)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, Nq, 2, 16, generator=g).half()
    k, v = (torch.randn(1, Nk, Hkv, 16, generator=g).half() for _ in range(2))
    if case.pop("key_padding", False):
        case["key_padding_mask"] = torch.rand(1, Nk, generator=g) > 0.3
    o, lse = F.attention_forward(q, k, v, **case)
    flags = dict(causal=case.get("causal", False), key_padding="key_padding_mask" in case)
    if "window_size" in case:
        flags["window"] = True
    if "causal_align" in case:
        flags["causal_align"] = case["causal_align"]
    spec = KernelSpec(direction="bwd", head_dim=16, dtype="float16", arch="sm_90", impl=impl, **flags)
    monkeypatch.setattr(torch, "empty", _poisoned_empty(torch.empty))
    dq, dk, dv = F.attention_backward(torch.ones_like(o), q, k, v, o, lse, spec=spec, **case)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not t.isnan().any(), f"{name}: {int(t.isnan().sum())} elements never written"
    if "key_padding_mask" in case:
        assert not dk[:, ~case["key_padding_mask"][0]].any()


# --------------------------------------------------------------------------- tensor subclasses
class Tagged(torch.Tensor):
    """A subclass with Python-level semantics of its own (like torch's CausalBias)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclasses_with_their_own_torch_function_are_refused() -> None:
    q, k, v, _ = _inputs(N=8)
    with pytest.raises(InputTypeError, match="^q: .*Tagged"):
        flash_attn_func(q.as_subclass(Tagged), k, v)
    with pytest.raises(InputTypeError, match="^alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(4).as_subclass(Tagged))
    with pytest.raises(InputTypeError, match="^attn_mask"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool).as_subclass(Tagged))
    p = torch.nn.Parameter(q.float())  # a Parameter is a plain tensor
    assert type(flash_attn_func(p, p, p)) is torch.Tensor


# --------------------------------------------------------------------------- one options object
def test_options_are_validated_once_with_the_argument_named() -> None:
    opts = AttentionOptions(causal=True, window_size=[3, -1], softcap=2)
    assert opts.window_size == (3, -1) and opts.softcap == 2.0 and type(opts.softcap) is float
    with pytest.raises(Exception):
        opts.causal = False  # frozen
    for kw, err, name in ((dict(causal=1), InputTypeError, "causal"), (dict(window_size=(-2, 0)), InputError,
                                                                           "window_size"),
                          (dict(window_size=(1,)), InputError, "window_size"),
                          (dict(window_size=4), InputTypeError, "window_size"),
                          (dict(softcap=-1.0), InputError, "softcap"), (dict(causal_align="x"), InputError,
                                                                           "causal_align"),
                          (dict(dropout_p=1.0), InputError, "dropout_p"),
                          (dict(softmax_scale="a"), InputTypeError, "softmax_scale"),
                          (dict(deterministic=None), InputTypeError, "deterministic")):
        with pytest.raises(err, match=f"^{name}"):
            AttentionOptions(**kw)
        with pytest.raises(err, match=f"^{name}"):
            AttentionOptions.of(**kw)  # the memo keys by type: causal=1 is refused after causal=True
    assert AttentionOptions.of(causal=True) is AttentionOptions.of(causal=True)


def test_the_op_schema_and_arguments_come_from_the_options() -> None:
    schema = str(torch.ops.fagen.fwd.default._schema)
    for typ, name, default in AttentionOptions.schema_fields():
        assert f"{typ} {name}" in schema
    for name in F.Tensors._fields:
        assert f"Tensor? {name}" in schema
    opts = AttentionOptions(causal=True, dropout_p=0.25, softmax_scale=0.5, window_size=(7, 3), softcap=1.5,
                            causal_align="top_left", deterministic=True)
    tensors = F.Tensors(*(torch.full((1,), float(i)) for i in range(len(F.Tensors._fields))))
    args = O.op_arguments(opts, tensors, 11, 12)
    by_name = dict(zip(O.OP_ORDER, args))
    assert [a.name for a in torch.ops.fagen.fwd.default._schema.arguments[3:]] == list(O.OP_ORDER)
    for name in F.Tensors._fields:
        assert by_name[name] is getattr(tensors, name)
    assert (by_name["max_seqlen_q"], by_name["max_seqlen_k"]) == (11, 12)
    assert dict(zip(AttentionOptions.op_names(), opts.op_args())) == {
        n: by_name[n] for n in AttentionOptions.op_names()}
    assert AttentionOptions.from_op_args(*opts.op_args()) == opts
    ref = opts.reference_kwargs()
    assert ref["window_size"] == (7, 3) and ref["causal_align"] == "top_left" and "deterministic" not in ref


def test_ops_take_the_mask_rule_from_masking_not_from_the_oracle() -> None:
    tree = ast.parse((REPO / "fagen" / "ops.py").read_text())
    imported = {(n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "reference" not in imported and "masking" in imported
    for mod in ("ops.py", "integrations/transformers.py", "distributed/ring.py"):
        tree = ast.parse((REPO / "fagen" / mod).read_text())
        private = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level
                   for a in n.names if a.name.startswith("_")]
        assert not private, (mod, private)


def test_public_exports() -> None:
    assert fagen.AttentionOptions is AttentionOptions and "AttentionOptions" in fagen.__all__


def test_plans_keep_no_tensor_of_the_call_alive(recorder: Recorder) -> None:
    import gc
    import weakref

    q, k, v, _ = _inputs(N=16)
    bias = torch.randn(2, 4, 16, 16).half()
    alive = weakref.ref(bias)
    F.attention_forward(q, k, v, attn_bias=bias, alibi_slopes=torch.ones(4))
    del bias
    gc.collect()
    assert alive() is None


def test_the_host_cost_benchmark_runs() -> None:
    """benchmarks/jit.py --host-only: fagen's and the bare custom-op pair's per-call host time and
    their ratio, measured in one process (the numbers are the benchmark's, not asserted here)."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "jit.py"), "--host-only", "--json", "--rounds", "1"],
                         capture_output=True, text=True, check=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    result = json.loads(out.stdout)
    assert set(result) == {"fagen", "bare", "packing", "ratio"}
    assert result["ratio"] == pytest.approx(result["fagen"] / result["bare"]) and result["bare"] > 0


def test_modes_and_tracing_see_the_custom_ops(recorder: Recorder) -> None:
    """Every call runs fagen::fwd and fagen::bwd (the ops' Autograd kernels are the one autograd
    mechanism): a dispatch mode (what tracing, fake tensors and recorders use) sees each op once,
    and a plain eager call makes the same launches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v, do = _inputs(N=16)
    leaves = _leaves(q, k, v)
    with Seen():
        flash_attn_func(*leaves, causal=True).backward(do)
    assert seen.count("fagen.fwd.default") == 1 and seen.count("fagen.bwd.default") == 1
    first = len(recorder.launches)
    flash_attn_func(*_leaves(q, k, v), causal=True).backward(do)
    assert len(recorder.launches) == 2 * first  # the same launches outside the mode


def test_the_profiler_sees_the_backward_op_and_both_paths_agree() -> None:
    """A plain ``backward()`` calls fagen::bwd's implementation directly where the dispatcher would only
    reach it (fagen.ops: the forward's unpacked arguments, no boxed call); with the profiler on, the op is
    dispatched and recorded, and the gradients are the same bits either way."""
    q, k, v, do = _inputs(N=16)
    leaves = _leaves(q, k, v)
    flash_attn_func(*leaves, causal=True).backward(do)
    direct = [x.grad.clone() for x in leaves]
    leaves = _leaves(q, k, v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flash_attn_func(*leaves, causal=True).backward(do)
    names = {e.name for e in prof.events()}
    assert {"fagen::fwd", "fagen::bwd"} <= names, sorted(n for n in names if "fagen" in n)
    assert all(torch.equal(a, x.grad) for a, x in zip(direct, leaves))
