"""The autograd op layer (fagen.ops) on CPU tensors, through the emulator.

Numerics use flash-attn's criterion per output and gradient:
``max|ours - ref64| <= 2 * max|torch_same_dtype - ref64| + atol``, with ref64 the
float64 reference and torch_same_dtype plain PyTorch attention in the input dtype.
Shapes are small and the specs few (each is one g++ build, shared by the tests).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fagen.functional as F
from fagen import reference as R
from fagen.errors import InputError, InputTypeError
from fagen.ops import draw_rng_state, flash_attn_func, scaled_dot_product_attention

from featref import flash_criterion
from numerics import ATOL
from ops_cases import CASES, Case, leaves, make_inputs, max_err, run_flash


# --------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("case", CASES, ids=str)
def test_autograd_matches_float64_reference(case: Case) -> None:
    q, k, v, do, mask = make_inputs(case)
    torch.manual_seed(11)
    rng_state = draw_rng_state() if case.dropout_p else torch.zeros(2, dtype=torch.int64)
    seed, offset = (int(x) for x in rng_state)
    out, dq, dk, dv = run_flash(case, q, k, v, do, mask, rng_seed=11)
    keep = None
    if case.dropout_p:
        keep = F.dropout_keep_mask(case.batch, case.heads, case.seqlen_q, case.seqlen_k, case.dropout_p,
                                   seed=seed, offset=offset)
    kw = dict(causal=case.causal, key_padding_mask=mask, keep_mask=keep, dropout_p=case.dropout_p)

    o64, lse64 = R.attention_forward_ref(q, k, v, **kw)
    grads64 = R.attention_backward_ref(do, q, k, v, o64, lse64, **kw)
    qt, kt, vt = leaves(q, k, v)
    out_pt = R.attention_ref_torch(qt, kt, vt, **kw)
    out_pt.backward(do)
    grads_pt = (qt.grad, kt.grad, vt.grad)

    atol = ATOL[case.dtype]
    for name, ours, pt, ref in [("out", out, out_pt.detach(), o64),
                                *zip(("dq", "dk", "dv"), (dq, dk, dv), grads_pt, grads64)]:
        assert ours.dtype == q.dtype and ours.shape == ref.shape, name
        assert not torch.isnan(ours).any(), f"{case}: NaN in {name}"
        flash_criterion(f"{case}: {name}", ours, ref, pt, atol)  # an all-zero reference fails too


def test_dropout_is_reproducible_from_torch_manual_seed() -> None:
    case = CASES[3]
    q, k, v, do, mask = make_inputs(case)
    first = run_flash(case, q, k, v, do, mask, rng_seed=5)
    again = run_flash(case, q, k, v, do, mask, rng_seed=5)
    other = run_flash(case, q, k, v, do, mask, rng_seed=6)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    for a, b in zip(first, other):
        assert not torch.equal(a, b)


def test_each_call_draws_a_fresh_dropout_key() -> None:
    case = CASES[3]
    q, k, v, _, mask = make_inputs(case)
    torch.manual_seed(0)
    a = flash_attn_func(q, k, v, dropout_p=0.2, causal=True, key_padding_mask=mask)
    b = flash_attn_func(q, k, v, dropout_p=0.2, causal=True, key_padding_mask=mask)
    assert not torch.equal(a, b)


def test_no_dropout_leaves_the_generator_alone() -> None:
    q, k, v, _, _ = make_inputs(CASES[0])
    before = torch.get_rng_state()
    flash_attn_func(q, k, v)
    assert torch.equal(torch.get_rng_state(), before)


def test_raw_op_returns_the_drawn_rng_state() -> None:
    q, k, v, _, mask = make_inputs(CASES[3])
    torch.manual_seed(3)
    expected = draw_rng_state()
    torch.manual_seed(3)
    o, lse, rng_state, _lo = torch.ops.fagen.fwd(q, k, v, mask, 0.2, None, True)
    assert torch.equal(rng_state, expected)
    assert lse.dtype == torch.float32 and lse.shape == (2, 2, 45)
    seed, offset = (int(x) for x in rng_state)
    o_functional, _ = F.attention_forward(q, k, v, causal=True, key_padding_mask=mask, dropout_p=0.2,
                                          seed=seed, offset=offset)
    assert torch.equal(o, o_functional)


# --------------------------------------------------------------------------- autograd plumbing
def test_saves_no_quadratic_tensor() -> None:
    """Autograd keeps q, k, v, o, lse, rng_state, lse_lo (and the mask): nothing of size Nq x Nk."""
    case = CASES[4]
    q, k, v, do, mask = make_inputs(case)
    ql, kl, vl = leaves(q, k, v)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = flash_attn_func(ql, kl, vl, dropout_p=0.17, causal=True, key_padding_mask=mask)
    out.backward(do)
    B, N, H, d = q.shape
    assert sorted(saved) == sorted([(B, N, H, d)] * 4 + [(B, H, N)] * 2 + [(2,), (B, N)])


def test_non_contiguous_inputs_match_contiguous() -> None:
    case = CASES[0]
    q, k, v, do, _ = make_inputs(case)
    ref = run_flash(case, q, k, v, do, None)
    # [B, H, N, d] storage viewed as [B, N, H, d]; and a head dim with stride != 1
    q_bhnd = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_strided = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert q_bhnd.stride(-1) == 1 and not q_bhnd.is_contiguous() and k_strided.stride(-1) != 1
    got = run_flash(case, q_bhnd, k_strided, v, do.transpose(1, 2).contiguous().transpose(1, 2), None)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_gradient_of_an_expanded_upstream_grad() -> None:
    """out.sum().backward() hands the op a stride-0 grad; the backward copes."""
    case = CASES[0]
    q, k, v, _, _ = make_inputs(case)
    ql, kl, vl = leaves(q, k, v)
    flash_attn_func(ql, kl, vl).sum().backward()
    ones = torch.ones(q.shape, dtype=q.dtype)
    ref = run_flash(case, q, k, v, ones, None)
    assert torch.equal(ql.grad, ref[1]) and torch.equal(vl.grad, ref[3])


def test_opcheck_custom_ops() -> None:
    case = CASES[2]
    q, k, v, do, mask = make_inputs(case)
    ql, kl, vl = leaves(q, k, v)
    torch.library.opcheck(torch.ops.fagen.fwd.default, (ql, kl, vl, mask, 0.0, None, False))
    o, lse, rng_state, _lo = torch.ops.fagen.fwd(q, k, v, mask, 0.0, None, False)
    torch.library.opcheck(torch.ops.fagen.bwd.default, (do, q, k, v, o, lse, mask, 0.0, None, False, rng_state))


def test_op_schemas_take_every_option_with_defaults() -> None:
    """The old positional prefix still works; the options follow with flash-attn's neutral defaults."""
    fwd = str(torch.ops.fagen.fwd.default._schema)
    bwd = str(torch.ops.fagen.bwd.default._schema)
    assert "Tensor? key_padding_mask, float dropout_p, float? softmax_scale, bool causal, SymInt window_left=-1" in fwd
    assert "float? softmax_scale, bool causal, Tensor rng_state, SymInt window_left=-1" in bwd
    for part in ("SymInt window_right=-1", "float softcap=0.", "Tensor? alibi_slopes=None", "Tensor? attn_mask=None",
                 "Tensor? attn_bias=None", 'str causal_align="bottom_right"', "Tensor? cu_seqlens_q=None",
                 "SymInt? max_seqlen_q=None", "bool deterministic=False"):
        assert part in fwd and part in bwd, part
    assert fwd.endswith("-> (Tensor, Tensor, Tensor, Tensor)")  # o, lse, rng_state, lse_lo
    assert ("bool bias_requires_grad=False, Tensor? sinks=None, Tensor? dlse=None, Tensor? lse_lo=None) -> (Tensor, "
            "Tensor, Tensor, Tensor, Tensor)") in bwd


# --------------------------------------------------------------------------- SDPA layout
def test_sdpa_equals_flash_layout_with_mask_causal_and_dropout() -> None:
    """A [B, 1, 1, Nk] bool attn_mask runs as a key-padding mask; Nq == Nk: both causal alignments
    agree; the same dropout key drops the same pairs."""
    case = CASES[4]
    q, k, v, do, mask = make_inputs(case)
    flash = run_flash(case, q, k, v, do, mask, rng_seed=9)
    qs, ks, vs = leaves(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    torch.manual_seed(9)
    out = scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[:, None, None, :], dropout_p=0.17, is_causal=True)
    out.backward(do.transpose(1, 2))
    assert out.shape == qs.shape
    for a, b in zip(flash, (out, qs.grad, ks.grad, vs.grad)):
        assert torch.equal(a, b.transpose(1, 2))


def test_sdpa_matches_torch_without_dropout() -> None:
    q, k, v, _, _ = make_inputs(CASES[0])
    qs, ks, vs = (t.transpose(1, 2).float() for t in (q, k, v))
    ours = scaled_dot_product_attention(*(t.to(torch.float16) for t in (qs, ks, vs)), scale=0.3)
    theirs = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=0.3)
    assert max_err(ours, theirs) < 2e-3


@pytest.mark.parametrize("shape", [(2, 1, 37, 69), (3, 1, 1, 70), (2, 3, 1, 70), (1, 2, 1, 1, 70)])
def test_attn_mask_not_broadcastable_is_rejected(shape: tuple[int, ...]) -> None:
    q, k, v, _, _ = make_inputs(CASES[0])
    with pytest.raises(InputError) as err:
        scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     attn_mask=torch.ones(shape, dtype=torch.bool))
    assert err.value.argument == "attn_mask"


def test_sdpa_shape_errors() -> None:
    q, k, v, _, _ = make_inputs(CASES[0])
    qs, ks, vs = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with pytest.raises(InputError, match="enable_gqa"):  # 2 q heads, 1 kv head, no enable_gqa
        scaled_dot_product_attention(qs, ks[:, :1], vs[:, :1])
    with pytest.raises(InputError) as err:
        scaled_dot_product_attention(qs[0, 0], ks, vs)
    assert err.value.argument == "query"
    with pytest.raises(InputTypeError) as err:
        scaled_dot_product_attention(qs, ks, vs, attn_mask=torch.ones(70, dtype=torch.int32))
    assert err.value.argument == "attn_mask"


# --------------------------------------------------------------------------- argument errors
@pytest.mark.parametrize("kwargs, error, argument", [
    ({"dropout_p": 1.0}, InputError, "dropout_p"),
    ({"dropout_p": True}, InputError, "dropout_p"),  # one validator, one error type (fagen.errors)
    ({"softmax_scale": float("nan")}, InputError, "softmax_scale"),
    ({"causal": 1}, InputTypeError, "causal"),
    ({"key_padding_mask": [True] * 70}, InputTypeError, "key_padding_mask"),
])
def test_flash_attn_func_scalar_errors(kwargs: dict, error: type, argument: str) -> None:
    q, k, v, _, _ = make_inputs(CASES[0])
    with pytest.raises(error) as err:
        flash_attn_func(q, k, v, **kwargs)
    assert err.value.argument == argument


def test_tensor_errors_name_the_argument() -> None:
    q, k, v, _, _ = make_inputs(CASES[0])
    with pytest.raises(InputTypeError) as err:
        flash_attn_func(q.numpy(), k, v)
    assert err.value.argument == "q"
    with pytest.raises(InputTypeError) as err:  # raised inside fagen::fwd, by the functional checks
        flash_attn_func(q, k.float(), v)
    assert err.value.argument == "k"
    with pytest.raises(InputError) as err:
        flash_attn_func(q, k, v, key_padding_mask=torch.ones(2, 69, dtype=torch.bool))
    assert err.value.argument == "key_padding_mask"


# --------------------------------------------------------------------------- torch.compile
class AttentionBlock(torch.nn.Module):
    """One self-attention layer: qkv projection, fagen attention, output projection."""

    def __init__(self, dim: int = 64, heads: int = 2, dropout_p: float = 0.2) -> None:
        super().__init__()
        self.heads, self.dropout_p = heads, dropout_p
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, D // self.heads).unbind(2)
        o = flash_attn_func(q, k, v, dropout_p=self.dropout_p, causal=True, key_padding_mask=key_padding_mask)
        return self.proj(o.reshape(B, N, D))


def _step(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, seed: int) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(seed)
    y = model(x, mask)
    y.square().sum().backward()
    return [y.detach()] + [p.grad.clone() for p in model.parameters()]


def _compile_inputs() -> tuple[AttentionBlock, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = AttentionBlock()
    x = torch.randn(2, 45, 64)  # float32, d = 32: the specs of CASES[3]
    mask = torch.ones(2, 45, dtype=torch.bool)
    mask[1, 30:] = False
    return model, x, mask


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_matches_eager(backend: str) -> None:
    torch._dynamo.reset()
    model, x, mask = _compile_inputs()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = _step(compiled, x, mask, seed=1)
    want = _step(model, x, mask, seed=1)
    tol = 0.0 if backend == "aot_eager" else 1e-4
    for a, b in zip(got, want):
        assert max_err(a, b) <= tol * max(1.0, b.abs().max().item())
    other = _step(compiled, x, mask, seed=2)  # the compiled graph draws a fresh dropout key
    assert not torch.equal(other[0], got[0])


# --------------------------------------------------------------------------- GPU argument packing
def test_cuda_argument_packing_covers_the_abi() -> None:
    """Every parameter type of every kernel role maps to a fixed-width numpy scalar (CPU-checkable)."""
    import numpy as np

    from fagen.abi import ROLES
    from fagen.runtime.gpu import to_cuda_arg

    widths = {"int": 4, "unsigned int": 4, "float": 4, "long long": 8, "unsigned long long": 8}
    for roles in ROLES.values():
        for role in roles:
            for ctype, name in role.params:
                arg = to_cuda_arg(ctype.replace("T*", "float*"), 2**63 + 5 if ctype.endswith("*") else 3)
                assert isinstance(arg, np.generic), (role.name, name)
                assert arg.nbytes == (8 if ctype.endswith("*") else widths[ctype]), (role.name, name)
    assert int(to_cuda_arg("const float*", 2**63 + 5)) == 2**63 + 5
    assert int(to_cuda_arg("unsigned long long", 2**64 - 1)) == 2**64 - 1


def test_gpu_launcher_wiring_with_a_fake_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """fagen.runtime.gpu against a recording stand-in for CuPy: per-device load of the cached cubin,
    smem opt-in above 48 KiB, the tensors' device and torch's stream, numpy-typed arguments."""
    import contextlib
    import types

    import numpy as np

    import fagen
    from fagen.runtime import gpu
    from fagen.spec import KernelSpec

    spec = KernelSpec(direction="fwd", head_dim=64, dtype="float16", arch="sm_90", impl="simt")  # smem > 48 KiB
    fagen.compile(spec)  # NVRTC (through the real CuPy bindings) before CuPy is replaced
    log: list[tuple] = []

    class Kernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def __setattr__(self, key: str, value: object) -> None:
            if key == "max_dynamic_shared_size_bytes":
                log.append(("smem_optin", self.name, value))
            object.__setattr__(self, key, value)

        def __call__(self, grid, block, args, *, shared_mem=0):
            log.append(("launch", self.name, grid, block, args, shared_mem))

    class RawModule:
        def __init__(self, *, path: str) -> None:
            log.append(("load", path))

        def get_function(self, name: str) -> Kernel:
            return Kernel(name)

    @contextlib.contextmanager
    def device(index: int):
        log.append(("device", index))
        yield

    @contextlib.contextmanager
    def stream_ctx(s):
        log.append(("stream", s.__cuda_stream__()[1]))
        yield

    fake_stream_cls = types.SimpleNamespace(from_external=stream_ctx)
    runtime = types.SimpleNamespace(pointerGetAttributes=lambda ptr: types.SimpleNamespace(device=1),
                                    deviceGetAttribute=lambda attr, dev: 232448)
    fake = types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(
        Device=device, Stream=fake_stream_cls, runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    torch_stream = types.SimpleNamespace(cuda_stream=0xABC, __cuda_stream__=lambda: (0, 0xABC))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: torch_stream)

    mod = gpu.GpuModule(spec)
    kern = mod.compiled.rendered.kernel("main")
    args = {name: (0x1000 if ctype.endswith("*") else 2) for ctype, name in kern.params}
    mod.launch(kern, (3, 2, 1), args)
    mod.launch(kern, (3, 2, 1), args)

    loads = [e for e in log if e[0] == "load"]
    assert len(loads) == 1 and Path(loads[0][1]).read_bytes() == mod.compiled.cubin  # once per device
    assert ("smem_optin", kern.name, kern.smem_bytes) in log and kern.smem_bytes > 48 * 1024
    assert log.count(("device", 1)) == 2 and log.count(("stream", 0xABC)) == 2
    launch = [e for e in log if e[0] == "launch"][0]
    assert launch[1:4] == (kern.name, (3, 2, 1), kern.block) and launch[5] == kern.smem_bytes
    assert [type(a) for a in launch[4]] == [
        np.uint64 if t.endswith("*") else gpu._SCALARS[t] for t, _ in kern.params]
