"""lse as a differentiable output of the autograd ops (``return_lse=True`` / ``return_attn_probs``).

Its gradient enters the backward as D_i' = rowsum(dO o O)_i - dlse_i in dS_ij = P_ij (dP_ij - D_i'),
in the pre kernel (a nullable pointer: no extra pass, nothing when lse takes no gradient). Checked by
torch.autograd.gradcheck in float64 (the SIMT family), and with flash-attn's criterion against the
float64 oracle of tests/sinkref.py for float16 / bfloat16 on the simt and mma families (causal,
window, GQA, key padding, dropout, varlen, Nq != Nk, lengths off the tiles).
"""
from __future__ import annotations

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec, flash_attn_func, flash_attn_varlen_func
from fagen.ops import draw_rng_state

import sinkref as S


def _qkv(B, Nq, Nk, H, Hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Nq, H, d, generator=g).to(dtype), torch.randn(B, Nk, Hkv, d, generator=g).to(dtype),
            torch.randn(B, Nk, Hkv, d, generator=g).to(dtype))


# --------------------------------------------------------------------------- float64 gradcheck (SIMT)
# The kernels keep lse in float32 (float64 inputs included), so its finite differences carry float32's
# rounding, about 1.2e-7 / (2 eps): eps = 1e-3 keeps that below 1e-4 (the central difference's own
# error is O(eps^2)). The analytic gradients are also checked against the float64 oracle directly.
GRADCHECK = dict(eps=1e-3, atol=5e-4, rtol=1e-3)


@pytest.mark.parametrize("kw", [
    dict(causal=True, window_size=(3, -1), softcap=2.0),
    dict(causal=False),
], ids=["causal-window-softcap", "plain"])
def test_gradcheck_float64_of_out_and_lse(kw) -> None:
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 5, 7, 2, 1, 6, torch.float64))

    def fn(q, k, v):
        return flash_attn_func(q, k, v, 0.0, 0.5, return_lse=True, **kw)

    assert torch.autograd.gradcheck(fn, (q, k, v), **GRADCHECK)
    g = torch.Generator().manual_seed(2)
    do, dlse = torch.randn(1, 5, 2, 6, dtype=torch.float64, generator=g), torch.randn(1, 2, 5, generator=g)
    o, lse = fn(q, k, v)
    ours = torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), (q, k, v))
    okw = dict(causal=kw["causal"], window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0), scale=0.5)
    _, _, g64 = S.grads(S.attention, {"q": q, "k": k, "v": v}, do, dlse, torch.float64, **okw)
    for a, name in zip(ours, "qkv"):
        torch.testing.assert_close(a, g64[name], rtol=1e-6, atol=1e-6)


def test_gradcheck_float64_lse_alone_varlen() -> None:
    """Only lse takes a gradient (the backward gets no dO: zeros), packed sequences incl. empty ones."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(9, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(8, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(8, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 4, 4, 9], dtype=torch.int32), torch.tensor([0, 3, 3, 8], dtype=torch.int32)

    def fn(q, k, v):
        _, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, softmax_scale=0.5, return_lse=True)
        return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # rows that see no key: -inf

    assert torch.autograd.gradcheck(fn, (q, k, v), **GRADCHECK)


# --------------------------------------------------------------------------- flash-attn's criterion
CASES = [
    # dtype, impl, B, Nq, Nk, H, Hkv, d, causal, window, padding, dropout_p
    (torch.float16, None, 2, 37, 50, 4, 2, 32, True, (-1, -1), False, 0.0),
    (torch.bfloat16, None, 2, 50, 37, 2, 2, 40, False, (9, 4), True, 0.0),
    (torch.float16, None, 1, 33, 33, 2, 1, 32, True, (-1, -1), False, 0.17),
    (torch.bfloat16, "simt", 2, 37, 50, 4, 2, 32, True, (-1, -1), False, 0.0),
    (torch.float16, "simt", 1, 40, 21, 2, 2, 24, False, (5, 5), True, 0.1),
]


def _ids(c) -> str:
    dt, impl, B, Nq, Nk, H, Hkv, d, causal, window, pad, p = c
    return (f"{str(dt)[6:]}-{impl or 'default'}-q{Nq}k{Nk}h{H}/{Hkv}d{d}" + ("-causal" if causal else "")
            + (f"-win{window[0]}_{window[1]}" if window != (-1, -1) else "") + ("-pad" if pad else "")
            + (f"-p{p}" if p else ""))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_lse_gradient_flash_criterion(case) -> None:
    dtype, impl, B, Nq, Nk, H, Hkv, d, causal, window, padding, p = case
    q, k, v = _qkv(B, Nq, Nk, H, Hkv, d, dtype, seed=Nq)
    g = torch.Generator().manual_seed(7)
    do = torch.randn(B, Nq, H, d, generator=g).to(dtype)
    dlse = torch.randn(B, H, Nq, generator=g)
    kpm = None
    if padding:
        kpm = torch.rand(B, Nk, generator=g) > 0.3
        kpm[:, -1] = True
    seed, offset = 11, 3
    keep = F.dropout_keep_mask(B, H, Nq, Nk, p, seed=seed, offset=offset) if p else None
    kw = dict(causal=causal, window_size=window, key_padding_mask=kpm, dropout_p=p, seed=seed, offset=offset)
    if impl is None:
        o, lse = F.attention_forward(q, k, v, **kw)
        dq, dk, dv = F.attention_backward(do, q, k, v, o, lse, dlse=dlse, **kw)
    else:
        flags = dict(head_dim=-(-d // 8) * 8, dtype=str(dtype)[6:], causal=causal, key_padding=padding,
                     dropout=p > 0, window=window != (-1, -1), impl=impl)
        o, lse = F.run_forward(KernelSpec(direction="fwd", **flags), q, k, v, **kw)
        dq, dk, dv = F.run_backward(KernelSpec(direction="bwd", **flags), do, q, k, v, o, lse, dlse=dlse, **kw)
    okw = dict(causal=causal, window=window, kpm=kpm, keep=keep, dropout_p=p)
    inputs = {"q": q, "k": k, "v": v}
    o64, lse64, g64 = S.grads(S.attention, inputs, do, dlse, torch.float64, **okw)
    o_pt, _, g_pt = S.grads(S.attention, inputs, do, dlse, dtype, **okw)
    S.criterion("out", o, o64, o_pt, dtype)
    for name, ours in (("q", dq), ("k", dk), ("v", dv)):
        S.criterion("d" + name, ours, g64[name], g_pt[name], dtype)


def test_lse_gradient_through_the_autograd_op_and_attn_probs() -> None:
    """return_lse and return_attn_probs hand out the same differentiable lse; the lse-only loss,
    the out-only loss and their sum are linear in the backward."""
    q, k, v = _qkv(2, 21, 30, 2, 1, 16, torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    do, dlse = torch.randn(2, 21, 2, 16, generator=g), torch.randn(2, 2, 21, generator=g)

    def run(which: str, probs: bool = False):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        if probs:
            o, lse, _ = flash_attn_func(*leaves, causal=True, return_attn_probs=True)
        else:
            o, lse = flash_attn_func(*leaves, causal=True, return_lse=True)
        loss = {"o": (o * do).sum(), "lse": (lse * dlse).sum(), "both": (o * do).sum() + (lse * dlse).sum()}[which]
        loss.backward()
        return [t.grad for t in leaves]

    both, o_only, lse_only = run("both"), run("o"), run("lse")
    for a, b, c in zip(both, o_only, lse_only):
        torch.testing.assert_close(a, b + c, rtol=1e-5, atol=1e-5)
    for a, b in zip(run("both", probs=True), both):
        assert torch.equal(a, b)
    o64, lse64, g64 = S.grads(S.attention, {"q": q, "k": k, "v": v}, torch.zeros_like(do), dlse, torch.float64,
                              causal=True)
    for ours, name in zip(lse_only, "qkv"):
        torch.testing.assert_close(ours.double(), g64[name], rtol=1e-4, atol=1e-5)


def test_deterministic_backward_with_dlse_is_bitwise_reproducible() -> None:
    q, k, v = _qkv(1, 40, 40, 2, 2, 32, torch.float16, seed=5)
    dlse = torch.randn(1, 2, 40)

    def run():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        torch.manual_seed(0)
        o, lse = flash_attn_func(*leaves, dropout_p=0.1, causal=True, deterministic=True, return_lse=True)
        (o.float().sum() + (lse * dlse).sum()).backward()
        return [t.grad for t in leaves]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)
    assert draw_rng_state().shape == (2,)


def test_torch_compile_matches_eager_with_lse_loss() -> None:
    """The registered autograd formula (fagen::bwd with dlse) under torch.compile equals eager."""
    q, k, v = _qkv(1, 19, 23, 2, 2, 16, torch.float32, seed=6)
    dlse = torch.randn(1, 2, 19)

    def loss(q, k, v):
        o, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        return o.sum() + (lse * dlse).sum()

    def step(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for a, b in zip(step(compiled), step(loss)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
