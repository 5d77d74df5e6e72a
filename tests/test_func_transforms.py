"""torch.func over the autograd ops (issue 36): ``vmap`` through the batching rules of fagen::fwd /
fagen::bwd (the mapped dim folds into the batch, one launch), ``grad``, ``vjp``, ``jacrev``,
per-sample gradients (``vmap(grad(...))``), ``gradcheck(check_batched_grad=True)`` in float64 on
the CPU (the SIMT family), and the errors of what is not there: forward-mode AD (``jvp``,
``jacfwd``) and double backward. Small float64 shapes: every spec is one emulator build, shared.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as TF
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import fagen.functional as F
from fagen import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention as sdpa
from fagen.ops import NO_DOUBLE_BACKWARD, NO_FORWARD_AD

F64 = torch.float64
GRADCHECK = dict(eps=1e-6, atol=1e-7, rtol=1e-5, check_batched_grad=True)
V = 3  # the mapped size


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _stack(fn: Any, *xs: Any, dims: tuple[Any, ...] | None = None) -> Any:
    """The loop vmap replaces: fn on each mapped slice, stacked (outputs of fn may be tuples)."""
    dims = dims or (0,) * len(xs)
    outs = [fn(*(x if d is None else x.select(d, i) for x, d in zip(xs, dims))) for i in range(V)]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(o) for o in zip(*outs))
    return torch.stack(outs)


def _close(ours: Any, ref: Any, rtol: float = 1e-9, atol: float = 1e-9) -> None:
    if isinstance(ours, (tuple, list)):
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref):
            _close(a, b, rtol, atol)
        return
    torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol)


class OpCalls(TorchDispatchMode):
    """torch's dispatch: every fagen::fwd / fagen::bwd call with its q's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "fagen":
            self.calls.append((func._opname, tuple(args[1 if func._opname == "bwd" else 0].shape)))
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- vmap
Q3, K3, Vv3 = _randn(V, 2, 5, 8, seed=1), _randn(V, 2, 6, 8, seed=2), _randn(V, 2, 6, 8, seed=3)  # [V, H, N, d]


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, None), (None, 0, 0), (None, None, 0), (1, 1, 1), (2, 0, 1)],
                         ids=str)
def test_vmap_sdpa_matches_a_loop(in_dims: tuple[Any, ...]) -> None:
    """Any mapped dim of any input (None: shared by every mapped call, broadcast)."""
    q, k, v = (x[0] if d is None else x.movedim(0, d) for x, d in zip((Q3, K3, Vv3), in_dims))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k, v, is_causal=True)

    out = vmap(fn, in_dims=in_dims)(q, k, v)
    _close(out, _stack(fn, q, k, v, dims=in_dims))
    _close(out[0], TF.scaled_dot_product_attention(*(x if d is None else x.select(d, 0) for x, d in
                                                     zip((q, k, v), in_dims)), is_causal=True), 1e-6, 1e-6)


@pytest.mark.parametrize("mask", ["bool-mapped", "bool-shared", "float-mapped", "float-shared-with-batch"])
def test_vmap_sdpa_with_masks(mask: str) -> None:
    q, k, v = _randn(V, 2, 2, 5, 8, seed=4), _randn(V, 2, 2, 6, 8, seed=5), _randn(V, 2, 2, 6, 8, seed=6)
    if mask.startswith("bool"):
        m = _randn(V, 2, 1, 5, 6, seed=7) > -0.5
        m[..., 0] = True
    else:
        m = _randn(V, 2, 2, 5, 6, seed=7)
    if mask == "bool-shared":
        m = m[0, 0]  # [1, Nq, Nk]: no batch dim, broadcast
    elif mask == "float-shared-with-batch":
        m = m[0]  # [B, H, Nq, Nk]: copied for each mapped problem

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k, v, attn_mask=m)

    dims = (0, 0, 0, 0 if "mapped" in mask else None)
    out = vmap(fn, in_dims=dims)(q, k, v, m)
    _close(out, _stack(fn, q, k, v, m, dims=dims))
    ref = TF.scaled_dot_product_attention(q[1], k[1], v[1], attn_mask=m[1] if "mapped" in mask else m)
    _close(out[1], ref, 1e-6, 1e-6)


def test_vmap_flash_attn_func_options_and_lse() -> None:
    """lse as an output; ALiBi slopes [H] shared, [B, H] and [H] mapped; a key-padding mask; GQA;
    sinks shared and mapped (mapped ones rescale o and lse per problem)."""
    B, N, H, d = 2, 5, 4, 8
    q, k, v = _randn(V, B, N, H, d, seed=8), _randn(V, B, N + 2, 2, d, seed=9), _randn(V, B, N + 2, 2, d, seed=10)
    kpm = _randn(V, B, N + 2, seed=11) > -0.5
    kpm[..., 0] = True
    slopes = _randn(V, B, H, seed=12, dtype=torch.float32).abs()
    sinks = _randn(V, H, seed=13, dtype=torch.float32)

    def fn(q: Any, k: Any, v: Any, kpm: Any, slopes: Any, sinks: Any) -> Any:
        return flash_attn_func(q, k, v, causal=True, key_padding_mask=kpm, alibi_slopes=slopes, sinks=sinks,
                               return_lse=True)

    for dims, args in [((0, 0, 0, 0, 0, None), (q, k, v, kpm, slopes, sinks[0])),
                       ((0, None, None, None, None, 0), (q, k[0], v[0], kpm[0], slopes[0, 0], sinks)),
                       ((0, 0, 0, None, 0, 0), (q, k, v, kpm[0], slopes[:, 0], sinks))]:
        _close(vmap(fn, in_dims=dims)(*args), _stack(fn, *args, dims=dims), 1e-6, 1e-6)


def test_vmap_varlen() -> None:
    """Packed sequences: the tokens of the mapped problems concatenate, cu_seqlens shift (also mapped ones)."""
    H, d = 2, 8
    q, k, v = _randn(V, 5, H, d, seed=14), _randn(V, 6, H, d, seed=15), _randn(V, 6, H, d, seed=16)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([[0, 3, 6], [0, 6, 6], [0, 1, 6]], dtype=torch.int32)

    def fn(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any) -> Any:
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 6, causal=True, return_lse=True)

    dims = (0, 0, 0, None, 0)
    _close(vmap(fn, in_dims=dims)(q, k, v, cu_q, cu_k), _stack(fn, q, k, v, cu_q, cu_k, dims=dims))


def test_nested_vmap() -> None:
    q = _randn(2, V, 2, 5, 8, seed=17)

    def fn(q: torch.Tensor) -> torch.Tensor:
        return sdpa(q, K3[0], Vv3[0])

    out = vmap(vmap(fn))(q)
    _close(out, torch.stack([torch.stack([fn(q[i, j]) for j in range(V)]) for i in range(2)]))


def test_vmap_launches_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One fagen::fwd call (torch's dispatch sees the folded [V * B, ...] problem) and the launches of
    one call, not V of them; per-sample gradients: one fagen::fwd and one fagen::bwd."""
    launches: list[str] = []
    real = F.get_module

    class Counting:
        def __init__(self, module: Any) -> None:
            self.module = module

        def launch(self, kernel: Any, grid: Any, args: Any) -> None:
            launches.append(kernel.name)
            self.module.launch(kernel, grid, args)

    monkeypatch.setattr(F, "get_module", lambda spec, device_type: Counting(real(spec, device_type)))
    q = _randn(V, 2, 5, 2, 8, seed=18)
    flash_attn_func(q[0], q[0], q[0])
    one = len(launches)
    launches.clear()
    with OpCalls() as seen:
        vmap(lambda x: flash_attn_func(x, x, x))(q)
    assert seen.calls == [("fwd", (V * 2, 5, 2, 8))] and len(launches) == one
    with OpCalls() as seen:
        vmap(grad(lambda x: flash_attn_func(x, x, x).sum()))(q)
    assert seen.calls == [("fwd", (V * 2, 5, 2, 8)), ("bwd", (V * 2, 5, 2, 8))]


def test_vmap_dropout_randomness() -> None:
    """dropout_p > 0 is a random op: vmap's default mode refuses it, 'same' is not available (the mapped
    problems draw their masks as one batch), 'different' is the folded call's masks (torch.manual_seed)."""
    q = _randn(V, 2, 5, 2, 8, seed=19)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return flash_attn_func(x, x, x, dropout_p=0.3)

    with pytest.raises(RuntimeError, match="randomness"):
        vmap(fn)(q)
    with pytest.raises(NotImplementedError, match="randomness='same'"):
        vmap(fn, randomness="same")(q)
    torch.manual_seed(3)
    out = vmap(fn, randomness="different")(q)
    torch.manual_seed(3)
    _close(out, fn(q.reshape(V * 2, 5, 2, 8)).reshape(q.shape), 0, 0)
    torch.manual_seed(4)
    per_sample = vmap(grad(lambda x: fn(x).pow(2).sum()), randomness="different")(q)
    leaf = q.reshape(V * 2, 5, 2, 8).clone().requires_grad_(True)
    torch.manual_seed(4)
    (ref,) = torch.autograd.grad(fn(leaf).pow(2).sum(), leaf)
    _close(per_sample, ref.reshape(q.shape))


# --------------------------------------------------------------------------- grad, vjp, jacrev
def _autograd(fn: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    return torch.autograd.grad(fn(*leaves), leaves)


def test_grad_vjp_jacrev() -> None:
    q, k, v = Q3[0], K3[0], Vv3[0]

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k, v, is_causal=True).pow(2).sum()

    _close(grad(loss, argnums=(0, 1, 2))(q, k, v), _autograd(loss, q, k, v))
    out, pullback = vjp(lambda q, k, v: sdpa(q, k, v, is_causal=True), q, k, v)
    do = _randn(*out.shape, seed=20)
    _close(pullback(do), _autograd(lambda *x: (sdpa(*x, is_causal=True) * do).sum(), q, k, v))
    qs, ks, vs = _randn(1, 3, 4, seed=21), _randn(1, 4, 4, seed=22), _randn(1, 4, 4, seed=23)
    jac = jacrev(lambda q, v: sdpa(q, ks, v), argnums=(0, 1))(qs, vs)
    ref = torch.autograd.functional.jacobian(lambda q, v: TF.scaled_dot_product_attention(q, ks, v), (qs, vs))
    _close(jac, ref, 1e-6, 1e-6)


def test_jacrev_of_lse() -> None:
    q, k, v = _randn(1, 3, 1, 4, seed=24), _randn(1, 4, 1, 4, seed=25), _randn(1, 4, 1, 4, seed=26)
    jac = jacrev(lambda q: flash_attn_func(q, k, v, return_lse=True)[1])(q)
    ref = torch.autograd.functional.jacobian(lambda q: torch.logsumexp(
        torch.einsum("bihd,bjhd->bhij", q, k) / 2.0, -1), q)
    _close(jac, ref, 1e-5, 1e-6)  # lse is float32 in the kernels


def test_raw_ops_under_torch_func() -> None:
    """torch.ops.fagen.fwd itself (what the public functions call) under grad and vmap."""
    from fagen import AttentionOptions
    from fagen.ops import op_arguments

    rest = op_arguments(AttentionOptions.of(causal=True), F.Tensors())
    q = _randn(1, 5, 2, 8, seed=27)

    def loss(q: torch.Tensor) -> torch.Tensor:
        o, lse, _, _lo = torch.ops.fagen.fwd(q, q, q, *rest)
        return o.pow(2).sum() + lse.sum()

    _close(grad(loss)(q), _autograd(loss, q)[0], 1e-6, 1e-6)
    qs = _randn(V, 1, 5, 2, 8, seed=28)
    _close(vmap(grad(loss))(qs), torch.stack([_autograd(loss, x)[0] for x in qs]), 1e-6, 1e-6)


# --------------------------------------------------------------------------- per-sample gradients
class Tiny(torch.nn.Module):
    """Linear -> fagen SDPA (self-attention, causal) -> sum."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 24, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [H, N, 8]
        q, k, v = self.proj(x).chunk(3, dim=-1)
        return sdpa(q, k, v, is_causal=True).sum()


def test_per_sample_gradients_of_a_small_model() -> None:
    torch.manual_seed(0)
    model = Tiny()
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = _randn(4, 2, 5, 8, seed=29)

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (x,))

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        model.zero_grad()
        model(x[i]).backward()
        for name, p in model.named_parameters():
            _close(per_sample[name][i], p.grad)


def test_per_sample_gradients_of_bias_sinks_and_lse() -> None:
    """A shared float mask and shared sinks get one gradient per sample; lse takes a gradient too."""
    q, k, v = _randn(V, 1, 5, 2, 8, seed=30), _randn(V, 1, 6, 2, 8, seed=31), _randn(V, 1, 6, 2, 8, seed=32)
    sinks = _randn(2, seed=33, dtype=torch.float32)
    bias = _randn(2, 5, 6, seed=34)

    def loss(q: Any, k: Any, v: Any, sinks: Any) -> torch.Tensor:
        o, lse = flash_attn_func(q, k, v, causal=True, sinks=sinks, return_lse=True)
        return o.pow(2).sum() + lse.sum()

    grads = vmap(grad(loss, argnums=(0, 1, 2, 3)), in_dims=(0, 0, 0, None))(q, k, v, sinks)
    refs = [_autograd(loss, q[i], k[i], v[i], sinks) for i in range(V)]
    _close(grads, tuple(torch.stack(g) for g in zip(*refs)), 1e-5, 1e-6)  # dsinks: float32

    def sdpa_loss(q: Any, bias: Any) -> torch.Tensor:
        return sdpa(q, k[0, 0].transpose(0, 1), v[0, 0].transpose(0, 1), attn_mask=bias).pow(2).sum()

    qs = q[:, 0].transpose(1, 2)  # [V, H, N, d]
    grads = vmap(grad(sdpa_loss, argnums=(0, 1)), in_dims=(0, None))(qs, bias)
    refs = [_autograd(sdpa_loss, qs[i], bias) for i in range(V)]
    _close(grads, tuple(torch.stack(g) for g in zip(*refs)), 1e-6, 1e-6)  # dbias: summed in float32


# --------------------------------------------------------------------------- gradcheck, batched gradients
def _leaves(*shapes: tuple[int, ...], seed: int = 40) -> list[torch.Tensor]:
    return [_randn(*s, seed=seed + i).requires_grad_(True) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("case", ["3d", "4d-causal-gqa", "bool-mask", "float-mask"])
def test_gradcheck_batched_grad_sdpa(case: str) -> None:
    if case == "3d":
        args = _leaves((2, 4, 8), (2, 5, 8), (2, 5, 8))
        assert torch.autograd.gradcheck(sdpa, args, **GRADCHECK)
    elif case == "4d-causal-gqa":
        args = _leaves((1, 2, 4, 8), (1, 1, 5, 8), (1, 1, 5, 8))
        fn = lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        assert torch.autograd.gradcheck(fn, args, **GRADCHECK)
    elif case == "bool-mask":
        args = _leaves((1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8))
        mask = _randn(1, 2, 4, 5, seed=50) > -0.5
        mask[..., 0] = True
        assert torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, attn_mask=mask), args, **GRADCHECK)
    else:
        args = _leaves((2, 4, 8), (2, 5, 8), (2, 5, 8), (2, 1, 5))
        assert torch.autograd.gradcheck(lambda q, k, v, b: sdpa(q, k, v, attn_mask=b), args, **GRADCHECK)


@pytest.mark.parametrize("case", ["4d-causal", "lse-and-padding"])
def test_gradcheck_batched_grad_flash_attn_func(case: str) -> None:
    args = _leaves((1, 4, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8))
    if case == "4d-causal":
        assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=True), args, **GRADCHECK)
    else:
        kpm = torch.tensor([[True, True, False, True, False]])

        def fn(q: Any, k: Any, v: Any) -> Any:
            return flash_attn_func(q, k, v, key_padding_mask=kpm, return_lse=True)

        # lse is float32 in the kernels: a coarser difference step (tests/test_lse_grad.py)
        assert torch.autograd.gradcheck(fn, args, eps=1e-3, atol=5e-4, rtol=1e-3, check_batched_grad=True)


# --------------------------------------------------------------------------- what is not there
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's forward AD setup
def test_forward_mode_ad_is_a_clear_error() -> None:
    q, k, v = Q3[0], K3[0], Vv3[0]
    fn = lambda q: sdpa(q, k, v)  # noqa: E731
    assert "no forward-mode AD (jvp/jacfwd)" in NO_FORWARD_AD
    with pytest.raises(NotImplementedError, match=r"no forward-mode AD \(jvp/jacfwd\)"):
        jvp(fn, (q,), (torch.ones_like(q),))
    with pytest.raises(NotImplementedError, match=r"no forward-mode AD \(jvp/jacfwd\)"):
        jacfwd(fn)(q)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match=r"no forward-mode AD \(jvp/jacfwd\)"):
            fn(fwAD.make_dual(q, torch.ones_like(q)))
        assert fwAD.unpack_dual(fn(q)).tangent is None  # no tangent: no error


def test_double_backward_is_a_clear_error() -> None:
    q, k, v = Q3[0], K3[0], Vv3[0]
    with pytest.raises(NotImplementedError, match="no double backward"):
        grad(lambda q: grad(lambda q: sdpa(q, k, v).sum())(q).sum())(q)
    leaf = q.clone().requires_grad_(True)
    (dq,) = torch.autograd.grad(sdpa(leaf, k, v).sum(), leaf, create_graph=True)
    with pytest.raises(NotImplementedError, match=NO_DOUBLE_BACKWARD[:30]):
        dq.sum().backward()

