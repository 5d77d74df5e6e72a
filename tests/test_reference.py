"""Tests for fagen.reference: float64 attention forward/backward from the equations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fagen.reference import (
    attention_backward_ref,
    attention_forward_ref,
    attention_ref_torch,
    mask_matrix,
)

F64 = torch.float64


def _inputs(B, Nq, Nk, H, d, dv=None, *, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(B, Nq, H, d, generator=g, dtype=F64).to(dtype)
    k = torch.randn(B, Nk, H, d, generator=g, dtype=F64).to(dtype)
    v = torch.randn(B, Nk, H, dv, generator=g, dtype=F64).to(dtype)
    do = torch.randn(B, Nq, H, dv, generator=g, dtype=F64).to(dtype)
    return q, k, v, do, g


def _padding(B, Nk, g, *, fully_masked_batch=None):
    kpm = torch.rand(B, Nk, generator=g) > 0.3
    kpm[:, 0] = True
    if fully_masked_batch is not None:
        kpm[fully_masked_batch] = False
    return kpm


def _naive_forward(q, k, v, *, causal, kpm, keep, p, scale):
    """Loop-per-row float64 attention, independent of mask_matrix."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    B, Nq, H, _ = q.shape
    Nk, dv = k.shape[1], v.shape[3]
    o = np.zeros((B, Nq, H, dv))
    lse = np.full((B, H, Nq), -np.inf)
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                js = [
                    j
                    for j in range(Nk)
                    if (kpm is None or kpm[b, j]) and (not causal or j - (Nk - Nq) <= i)
                ]
                if not js:
                    continue
                s = np.array([scale * q[b, i, h] @ k[b, j, h] for j in js])
                m = s.max()
                lse[b, h, i] = m + math.log(np.exp(s - m).sum())
                pr = np.exp(s - lse[b, h, i])
                if keep is not None:
                    pr = pr * np.array([keep[b, h, i, j] for j in js]) / (1 - p)
                o[b, i, h] = sum(pr[n] * v[b, j, h] for n, j in enumerate(js))
    return o, lse


# Cases: (B, Nq, Nk, H, d, dv, causal, padding, dropout_p)
CASES = [
    (2, 7, 7, 2, 8, 8, False, False, 0.0),
    (2, 7, 7, 2, 8, 8, True, False, 0.0),
    (2, 5, 9, 3, 4, 6, True, True, 0.0),  # Nq < Nk
    (2, 9, 5, 2, 4, 4, True, True, 0.25),  # Nq > Nk: first rows fully masked
    (3, 1, 6, 2, 8, 8, True, True, 0.0),  # Nq = 1
    (3, 1, 6, 2, 8, 8, False, True, 0.5),
    (2, 6, 1, 1, 4, 4, True, False, 0.1),  # Nk = 1
    (2, 16, 11, 2, 16, 8, False, True, 0.3),
]


def _case_kwargs(B, Nq, Nk, H, causal, padding, p, g):
    kpm = _padding(B, Nk, g, fully_masked_batch=B - 1) if padding else None
    keep = torch.rand(B, H, Nq, Nk, generator=g) >= p if p > 0 else None
    return dict(causal=causal, key_padding_mask=kpm, keep_mask=keep, dropout_p=p)


# --------------------------------------------------------------------------- mask_matrix


@pytest.mark.parametrize("Nq,Nk", [(4, 4), (3, 7), (7, 3), (1, 5), (5, 1)])
def test_mask_matrix_causal_bottom_right(Nq, Nk):
    m = mask_matrix(2, Nq, Nk, causal=True)
    assert m.shape == (2, 1, Nq, Nk) and m.dtype == torch.bool
    for i in range(Nq):
        for j in range(Nk):
            assert bool(m[1, 0, i, j]) == (j <= i + Nk - Nq)
    # The last query row always sees every key (bottom-right alignment).
    assert m[:, :, -1, :].all()
    assert mask_matrix(2, Nq, Nk, causal=False).all()


def test_mask_matrix_padding():
    kpm = torch.tensor([[True, False, True], [False, False, False]])
    m = mask_matrix(2, 2, 3, causal=False, key_padding_mask=kpm)
    assert torch.equal(m[:, 0, 0, :], kpm) and torch.equal(m[:, 0, 1, :], kpm)
    m = mask_matrix(2, 2, 3, causal=True, key_padding_mask=kpm.numpy())
    assert m[0, 0].tolist() == [[True, False, False], [True, False, True]]
    assert not m[1].any()


def test_mask_matrix_validation():
    with pytest.raises(ValueError, match="Nq"):
        mask_matrix(1, 0, 3)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mask_matrix(1, 2, 3, key_padding_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        mask_matrix(1, 2, 3, key_padding_mask=torch.ones(1, 3))


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("case", CASES)
def test_forward_matches_naive_and_torch(case):
    B, Nq, Nk, H, d, dv, causal, padding, p = case
    q, k, v, _, g = _inputs(B, Nq, Nk, H, d, dv)
    kw = _case_kwargs(B, Nq, Nk, H, causal, padding, p, g)
    o, lse = attention_forward_ref(q, k, v, **kw)
    assert o.dtype == F64 and lse.dtype == F64
    assert o.shape == (B, Nq, H, dv) and lse.shape == (B, H, Nq)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()

    kpm, keep = kw["key_padding_mask"], kw["keep_mask"]
    o_n, lse_n = _naive_forward(
        q, k, v, causal=causal, kpm=None if kpm is None else kpm.numpy(),
        keep=None if keep is None else keep.numpy(), p=p, scale=1 / math.sqrt(d),
    )
    np.testing.assert_allclose(o.numpy(), o_n, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse.numpy()), np.isinf(lse_n))
    np.testing.assert_allclose(lse.numpy(), lse_n, rtol=1e-12, atol=1e-12)

    o_t = attention_ref_torch(q, k, v, **kw)
    torch.testing.assert_close(o_t, o, rtol=1e-12, atol=1e-12)


def test_forward_softmax_scale_and_numpy_inputs():
    q, k, v, _, _ = _inputs(1, 4, 6, 2, 8)
    o1, lse1 = attention_forward_ref(q.numpy(), k.numpy(), v.numpy(), softmax_scale=0.3)
    o2, lse2 = attention_forward_ref(q * (0.3 * math.sqrt(8)), k, v)
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse1, lse2, rtol=1e-12, atol=1e-12)


def test_forward_float16_inputs_computed_in_float64():
    q, k, v, _, _ = _inputs(1, 5, 5, 1, 8, dtype=torch.float16)
    o, lse = attention_forward_ref(q, k, v, causal=True)
    o64, lse64 = attention_forward_ref(q.double(), k.double(), v.double(), causal=True)
    assert o.dtype == F64
    assert torch.equal(o, o64) and torch.equal(lse, lse64)


def test_fully_masked_rows_exact_zeros():
    B, Nq, Nk, H, d = 2, 6, 4, 2, 8
    q, k, v, do, g = _inputs(B, Nq, Nk, H, d)
    kpm = torch.ones(B, Nk, dtype=torch.bool)
    kpm[1] = False  # batch 1: every row masked
    keep = torch.rand(B, H, Nq, Nk, generator=g) >= 0.2
    kw = dict(causal=True, key_padding_mask=kpm, keep_mask=keep, dropout_p=0.2)
    o, lse = attention_forward_ref(q, k, v, **kw)
    # Causal with Nq > Nk: rows i < Nq - Nk have no key; batch 1 has none at all.
    dead = torch.zeros(B, Nq, dtype=torch.bool)
    dead[:, : Nq - Nk] = True
    dead[1] = True
    assert (o[dead] == 0).all() and torch.isfinite(o[~dead]).all()
    assert torch.isneginf(lse.transpose(1, 2)[dead]).all()
    assert torch.isfinite(lse.transpose(1, 2)[~dead]).all()

    dq, dk, dv = attention_backward_ref(do, q, k, v, o, lse, **kw)
    for t in (dq, dk, dv):
        assert not torch.isnan(t).any()
    assert (dq[dead] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()

    qa = q.clone().requires_grad_()
    ka = k.clone().requires_grad_()
    va = v.clone().requires_grad_()
    o_t = attention_ref_torch(qa, ka, va, **kw)
    assert (o_t[dead] == 0).all()
    o_t.backward(do)
    for t in (qa.grad, ka.grad, va.grad):
        assert not torch.isnan(t).any()
    assert (qa.grad[dead] == 0).all()
    assert (ka.grad[1] == 0).all() and (va.grad[1] == 0).all()


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_autograd(case):
    B, Nq, Nk, H, d, dv, causal, padding, p = case
    q, k, v, do, g = _inputs(B, Nq, Nk, H, d, dv, seed=1)
    kw = _case_kwargs(B, Nq, Nk, H, causal, padding, p, g)
    o, lse = attention_forward_ref(q, k, v, **kw)
    dq, dk, dv_ = attention_backward_ref(do, q, k, v, o, lse, **kw)
    assert dq.dtype == dk.dtype == dv_.dtype == F64
    assert dq.shape == q.shape and dk.shape == k.shape and dv_.shape == v.shape

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention_ref_torch(*leaves, **kw).backward(do)
    for got, leaf in zip((dq, dk, dv_), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)


def test_backward_accepts_float32_lse():
    q, k, v, do, _ = _inputs(2, 5, 7, 2, 8, seed=3)
    o, lse = attention_forward_ref(q, k, v, causal=True)
    ref = attention_backward_ref(do, q, k, v, o, lse, causal=True)
    got = attention_backward_ref(do, q, k, v, o, lse.float(), causal=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_rowsum_identity(p):
    """D = rowsum(dO o O) equals rowsum(P o dP) with dP = (dO V^T) o Z / (1 - p)."""
    B, Nq, Nk, H, d = 2, 6, 8, 2, 4
    q, k, v, do, g = _inputs(B, Nq, Nk, H, d, seed=4)
    keep = torch.rand(B, H, Nq, Nk, generator=g) >= p
    o, lse = attention_forward_ref(q, k, v, causal=True, keep_mask=keep, dropout_p=p)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
    allowed = mask_matrix(B, Nq, Nk, causal=True)
    P = torch.where(allowed, torch.exp(s - lse[..., None]), 0.0)
    dP = torch.einsum("bihd,bjhd->bhij", do, v) * keep / (1 - p)
    D = torch.einsum("bihd,bihd->bhi", do, o)
    torch.testing.assert_close(D, (P * dP).sum(-1), rtol=1e-12, atol=1e-12)
    # Rows of P sum to one.
    torch.testing.assert_close(P.sum(-1), torch.ones(B, H, Nq, dtype=F64))


# --------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize(
    "causal,padding,p,Nq,Nk",
    [(False, False, 0.0, 3, 4), (True, True, 0.3, 4, 3), (True, False, 0.0, 1, 3)],
)
def test_gradcheck(causal, padding, p, Nq, Nk):
    B, H, d = 2, 2, 3
    q, k, v, _, g = _inputs(B, Nq, Nk, H, d, seed=5)
    kw = _case_kwargs(B, Nq, Nk, H, causal, padding, p, g)
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda *x: attention_ref_torch(*x, **kw), leaves)


def test_equation_backward_is_vjp_of_reference():
    """gradcheck the equation-form backward: <dO, J x> against finite differences."""
    B, Nq, Nk, H, d = 1, 3, 4, 2, 3
    q, k, v, do, g = _inputs(B, Nq, Nk, H, d, seed=6)
    kw = dict(causal=True, key_padding_mask=None, keep_mask=None, dropout_p=0.0)
    o, lse = attention_forward_ref(q, k, v, **kw)
    grads = attention_backward_ref(do, q, k, v, o, lse, **kw)
    eps = 1e-6
    for idx, (x, gx) in enumerate(zip((q, k, v), grads)):
        flat = x.reshape(-1)
        for n in range(flat.numel()):
            xp, xm = flat.clone(), flat.clone()
            xp[n] += eps
            xm[n] -= eps
            args_p = [q, k, v]
            args_m = [q, k, v]
            args_p[idx] = xp.view_as(x)
            args_m[idx] = xm.view_as(x)
            fp = (attention_forward_ref(*args_p, **kw)[0] * do).sum()
            fm = (attention_forward_ref(*args_m, **kw)[0] * do).sum()
            assert abs((fp - fm) / (2 * eps) - gx.reshape(-1)[n]) < 1e-7


# --------------------------------------------------------------------------- attention_ref_torch


def test_ref_torch_dtypes():
    q, k, v, _, _ = _inputs(1, 4, 5, 2, 8, dtype=torch.bfloat16)
    o_lp = attention_ref_torch(q, k, v, causal=True)
    o_up = attention_ref_torch(q, k, v, causal=True, upcast=True)
    o_ref, _ = attention_forward_ref(q, k, v, causal=True)
    assert o_lp.dtype == torch.bfloat16 and o_up.dtype == F64
    torch.testing.assert_close(o_up, o_ref, rtol=1e-12, atol=1e-12)
    assert (o_lp.double() - o_ref).abs().max() < 5e-2


# --------------------------------------------------------------------------- validation


def test_validation_errors():
    q, k, v, do, _ = _inputs(1, 4, 5, 2, 8)
    with pytest.raises(ValueError, match="keep_mask"):
        attention_forward_ref(q, k, v, dropout_p=0.1)
    ones = torch.ones(1, 2, 4, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="dropout_p"):
        attention_forward_ref(q, k, v, dropout_p=1.0, keep_mask=ones)
    with pytest.raises(ValueError, match="keep_mask"):
        attention_forward_ref(q, k, v, dropout_p=0.1, keep_mask=ones.transpose(2, 3))
    with pytest.raises(TypeError, match="keep_mask"):
        attention_forward_ref(q, k, v, dropout_p=0.1, keep_mask=torch.ones(1, 2, 4, 5))
    with pytest.raises(ValueError, match="k must"):
        attention_forward_ref(q, k[..., :4], v)
    with pytest.raises(ValueError, match="v must"):
        attention_forward_ref(q, k, v[:, :3])
    with pytest.raises(ValueError, match="q must"):
        attention_forward_ref(q[0], k, v)
    with pytest.raises(TypeError, match="q must"):
        attention_forward_ref(q.long(), k, v)
    with pytest.raises(TypeError, match="softmax_scale"):
        attention_forward_ref(q, k, v, softmax_scale="1")
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention_forward_ref(q, k, v, key_padding_mask=torch.ones(1, 4, dtype=torch.bool))
    o, lse = attention_forward_ref(q, k, v)
    with pytest.raises(ValueError, match="lse"):
        attention_backward_ref(do, q, k, v, o, lse[..., :3])
    with pytest.raises(ValueError, match="do"):
        attention_backward_ref(do[:, :3], q, k, v, o, lse)
    with pytest.raises(ValueError, match="keep_mask"):
        attention_ref_torch(q, k, v, dropout_p=0.5)
