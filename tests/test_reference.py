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
    # lse rounded to float32 moves every P by a factor exp(+-|lse| eps32 / 2); the gradients move by
    # at most twice that, relative to their size
    tol = torch.finfo(torch.float32).eps * lse.abs().max().item()
    for a, b in zip(got, ref):
        assert (a - b).abs().max() <= tol * b.abs().max()
    assert any(not torch.equal(a, b) for a, b in zip(got, ref))  # the float32 lse is taken as given


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


# --------------------------------------------------------------------------- issue-11 features
# GQA, sliding window, softcap, ALiBi, bool mask, float bias (and its gradient), alignment,
# varlen: against a loop-per-row float64 implementation written from flash-attn's docstrings
# and its tests' attention_ref (construct_local_mask), and against torch autograd.


def _naive_features(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None, mask=None,
                    bias=None, top_left=False, keep=None, p=0.0, scale=None):
    """Loop-per-row float64 attention with every feature; independent of fagen.reference."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    B, Nq, H, d = q.shape
    Nk, Hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = H // Hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    shift = 0 if top_left else Nk - Nq
    o = np.zeros((B, Nq, H, dv))
    lse = np.full((B, H, Nq), -np.inf)
    for b in range(B):
        for h in range(H):
            hk = h // g
            for i in range(Nq):
                js = []
                for j in range(Nk):
                    if causal and j > i + shift:
                        continue
                    if window[0] >= 0 and j < i + shift - window[0]:
                        continue
                    if window[1] >= 0 and j > i + shift + window[1]:
                        continue
                    if mask is not None and not mask[b, h, i, j]:
                        continue
                    js.append(j)
                if not js:
                    continue
                s = []
                for j in js:
                    x = scale * float(q[b, i, h] @ k[b, j, hk])
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if slopes is not None:
                        x -= float(slopes[b, h]) * abs(i + shift - j)
                    if bias is not None:
                        x += float(bias[b, h, i, j])
                    s.append(x)
                s = np.array(s)
                m = s.max()
                lse[b, h, i] = m + math.log(np.exp(s - m).sum())
                pr = np.exp(s - lse[b, h, i])
                if keep is not None:
                    pr = pr * np.array([keep[b, h, i, j] for j in js]) / (1 - p)
                o[b, i, h] = sum(pr[n] * v[b, j, hk] for n, j in enumerate(js))
    return o, lse


def _feature_inputs(B, Nq, Nk, H, Hkv, d, *, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Nq, H, d, generator=g, dtype=F64)
    k = torch.randn(B, Nk, Hkv, d, generator=g, dtype=F64)
    v = torch.randn(B, Nk, Hkv, d, generator=g, dtype=F64)
    do = torch.randn(B, Nq, H, d, generator=g, dtype=F64)
    return q, k, v, do, g


# (B, Nq, Nk, H, Hkv, d, features)
FEATURE_CASES = [
    (2, 5, 9, 4, 2, 8, dict(causal=True)),  # GQA, Nq < Nk
    (1, 7, 7, 3, 1, 8, dict(window_size=(2, 1))),  # MQA + window
    (2, 9, 5, 2, 2, 4, dict(window_size=(1, 3), causal=True)),  # causal + window, Nq > Nk
    (2, 6, 11, 2, 1, 8, dict(window_size=(-1, 2), causal_align="top_left")),
    (2, 6, 6, 2, 2, 8, dict(softcap=1.5)),
    (2, 5, 8, 4, 2, 8, dict(alibi="bh", causal=True)),
    (1, 8, 5, 2, 2, 8, dict(alibi="h", causal=True, causal_align="top_left")),
    (2, 6, 7, 2, 2, 8, dict(mask=True)),
    (2, 6, 7, 4, 2, 8, dict(bias="full", softcap=2.0, window_size=(3, 3))),
    (2, 5, 6, 2, 2, 8, dict(bias="row", mask=True, causal=True, dropout=0.3)),
    (2, 9, 9, 4, 1, 16, dict(causal=True, window_size=(4, 0), softcap=3.0, alibi="h", bias="head", dropout=0.2)),
]


def _feature_kwargs(case, g):
    B, Nq, Nk, H, Hkv, d, f = case
    f = dict(f)
    kw = dict(causal=f.pop("causal", False), window_size=f.pop("window_size", (-1, -1)),
              softcap=f.pop("softcap", 0.0), causal_align=f.pop("causal_align", "bottom_right"))
    alibi = f.pop("alibi", None)
    if alibi == "h":
        kw["alibi_slopes"] = torch.rand(H, generator=g).float() + 0.1
    elif alibi == "bh":
        kw["alibi_slopes"] = torch.rand(B, H, generator=g).float() + 0.1
    if f.pop("mask", False):
        m = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3  # broadcast over heads
        m[0, 0, 1] = False  # a row with no key
        kw["attn_mask"] = m
    bias = f.pop("bias", None)
    shapes = {"full": (B, H, Nq, Nk), "row": (Nq, Nk), "head": (1, H, 1, Nk)}
    if bias is not None:
        kw["attn_bias"] = torch.randn(*shapes[bias], generator=g, dtype=F64)
    p = f.pop("dropout", 0.0)
    if p:
        kw["dropout_p"] = p
        kw["keep_mask"] = torch.rand(B, H, Nq, Nk, generator=g) >= p
    assert not f
    return kw


def _naive_kwargs(kw, B, H, Nq, Nk):
    slopes = kw.get("alibi_slopes")
    if slopes is not None:
        slopes = slopes.double().expand(B, H).numpy()
    mask = kw.get("attn_mask")
    bias = kw.get("attn_bias")
    keep = kw.get("keep_mask")
    return dict(causal=kw["causal"], window=kw["window_size"], softcap=kw["softcap"], slopes=slopes,
                mask=None if mask is None else mask.expand(B, H, Nq, Nk).numpy(),
                bias=None if bias is None else bias.expand(B, H, Nq, Nk).numpy(),
                top_left=kw["causal_align"] == "top_left", keep=None if keep is None else keep.numpy(),
                p=kw.get("dropout_p", 0.0))


@pytest.mark.parametrize("case", FEATURE_CASES)
def test_features_forward_matches_naive_and_torch(case):
    B, Nq, Nk, H, Hkv, d, _ = case
    q, k, v, _, g = _feature_inputs(B, Nq, Nk, H, Hkv, d, seed=11)
    kw = _feature_kwargs(case, g)
    o, lse = attention_forward_ref(q, k, v, **kw)
    assert o.shape == (B, Nq, H, d) and lse.shape == (B, H, Nq)
    o_n, lse_n = _naive_features(q, k, v, **_naive_kwargs(kw, B, H, Nq, Nk))
    np.testing.assert_allclose(o.numpy(), o_n, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(lse_n))
    np.testing.assert_allclose(lse.numpy(), lse_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attention_ref_torch(q, k, v, **kw), o, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", FEATURE_CASES)
def test_features_backward_matches_autograd(case):
    """dq, dk, dv (GQA: summed over the group) and dbias (reduced to the bias's shape) against
    torch autograd of the plain float64 implementation."""
    B, Nq, Nk, H, Hkv, d, _ = case
    q, k, v, do, g = _feature_inputs(B, Nq, Nk, H, Hkv, d, seed=12)
    kw = _feature_kwargs(case, g)
    o, lse = attention_forward_ref(q, k, v, **kw)
    has_bias = "attn_bias" in kw
    grads = attention_backward_ref(do, q, k, v, o, lse, bias_requires_grad=has_bias, **kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    tkw = dict(kw)
    if has_bias:
        tkw["attn_bias"] = kw["attn_bias"].clone().requires_grad_()
        leaves.append(tkw["attn_bias"])
    attention_ref_torch(*leaves[:3], **tkw).backward(do)
    assert len(grads) == len(leaves)
    for got, leaf in zip(grads, leaves):
        assert got.shape == leaf.shape
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-10)


def test_softcap_and_bias_gradcheck():
    """The equation backward is the VJP of the forward for softcap + ALiBi + bias + GQA (finite differences)."""
    B, Nq, Nk, H, Hkv, d = 1, 3, 4, 2, 1, 3
    q, k, v, do, g = _feature_inputs(B, Nq, Nk, H, Hkv, d, seed=13)
    bias = torch.randn(1, H, Nq, Nk, generator=g, dtype=F64)
    kw = dict(causal=True, softcap=0.7, alibi_slopes=torch.tensor([0.3, 0.8]), window_size=(2, -1))
    o, lse = attention_forward_ref(q, k, v, attn_bias=bias, **kw)
    grads = attention_backward_ref(do, q, k, v, o, lse, attn_bias=bias, bias_requires_grad=True, **kw)
    eps = 1e-6
    xs = [q, k, v, bias]
    for idx, (x, gx) in enumerate(zip(xs, grads)):
        flat = x.reshape(-1)
        for n in range(flat.numel()):
            vals = []
            for sgn in (1, -1):
                xp = flat.clone()
                xp[n] += sgn * eps
                args = list(xs)
                args[idx] = xp.view_as(x)
                vals.append((attention_forward_ref(*args[:3], attn_bias=args[3], **kw)[0] * do).sum())
            assert abs((vals[0] - vals[1]) / (2 * eps) - gx.reshape(-1)[n]) < 1e-7


def test_alibi_window_causal_by_hand():
    """flash-attn docstrings, worked by hand on q = k = 0 (every qk = 0), so the scores are the bias:
    alibi "a bias of (-alibi_slope * |i + seqlen_k - seqlen_q - j|) is added to the attention score
    of query i and key j"; window "[i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k -
    seqlen_q + window_size[1]] inclusive"."""
    Nq, Nk = 2, 4
    q = torch.zeros(1, Nq, 1, 4, dtype=F64)
    k = torch.zeros(1, Nk, 1, 4, dtype=F64)
    v = torch.arange(Nk, dtype=F64).reshape(1, Nk, 1, 1).expand(1, Nk, 1, 4).contiguous()
    slope = 0.5
    o, lse = attention_forward_ref(q, k, v, alibi_slopes=torch.tensor([slope]))
    # shift = 2: row 0's scores are -0.5 * |0 + 2 - j| = [-1, -0.5, 0, -0.5]
    s0 = np.array([-1.0, -0.5, 0.0, -0.5])
    assert lse[0, 0, 0].item() == pytest.approx(math.log(np.exp(s0).sum()), abs=1e-14)
    w = np.exp(s0) / np.exp(s0).sum()
    assert o[0, 0, 0, 0].item() == pytest.approx(float(w @ np.arange(4)), abs=1e-14)
    # causal: row 0 sees keys 0..2 (bottom-right), each with its ALiBi score
    o, lse = attention_forward_ref(q, k, v, alibi_slopes=torch.tensor([slope]), causal=True)
    assert lse[0, 0, 0].item() == pytest.approx(math.log(np.exp(s0[:3]).sum()), abs=1e-14)
    # window (1, 0), Nq = 2, Nk = 4: row 0 sees keys 1..2, row 1 keys 2..3 (uniform weights)
    o, lse = attention_forward_ref(q, k, v, window_size=(1, 0))
    assert o[0, :, 0, 0].tolist() == [1.5, 2.5]
    assert lse[0, 0].tolist() == [pytest.approx(math.log(2))] * 2
    # top-left (torch SDPA is_causal): row 0 sees key 0 only, row 1 keys 0..1
    o, _ = attention_forward_ref(q, k, v, causal=True, causal_align="top_left")
    assert o[0, :, 0, 0].tolist() == [0.0, 0.5]
    # softcap: a score s becomes softcap * tanh(s / softcap)
    qs = torch.ones(1, 1, 1, 4, dtype=F64)
    ks = torch.tensor([[[[1.0] * 4]], [[[-1.0] * 4]]], dtype=F64).reshape(1, 2, 1, 4)
    _, lse = attention_forward_ref(qs, ks, ks, softcap=0.5, softmax_scale=1.0)
    assert lse.item() == pytest.approx(math.log(math.exp(0.5 * math.tanh(8)) + math.exp(0.5 * math.tanh(-8))))


def _varlen_pack(lens_q, lens_k, H, Hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, H, d, generator=g, dtype=F64)
    k = torch.randn(tk, Hkv, d, generator=g, dtype=F64)
    v = torch.randn(tk, Hkv, d, generator=g, dtype=F64)
    do = torch.randn(tq, H, d, generator=g, dtype=F64)
    cu_q = torch.tensor([0] + list(np.cumsum(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(lens_k)), dtype=torch.int32)
    return q, k, v, do, cu_q, cu_k, g


@pytest.mark.parametrize("features", [dict(causal=True), dict(window_size=(2, 1), softcap=2.0),
                                      dict(causal=True, alibi=True, bias=True, dropout=0.25)])
def test_varlen_is_each_sequence_on_its_own(features):
    """Packed sequences (lengths 0 and 1 included) equal separate fixed-length problems; lse is
    [H, total_q]; positions (causal shift, ALiBi, dropout, bias) count inside each sequence."""
    lens_q, lens_k = [3, 0, 1, 5, 2], [4, 2, 1, 3, 0]
    H, Hkv, d = 4, 2, 8
    q, k, v, do, cu_q, cu_k, g = _varlen_pack(lens_q, lens_k, H, Hkv, d, seed=14)
    B, mq, mk = len(lens_q), max(lens_q), max(lens_k)
    f = dict(features)
    kw = dict(causal=f.pop("causal", False), window_size=f.pop("window_size", (-1, -1)), softcap=f.pop("softcap", 0.0))
    if f.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(B, H, generator=g) + 0.1
    if f.pop("bias", False):
        kw["attn_bias"] = torch.randn(B, 1, mq, mk, generator=g, dtype=F64)
    p = f.pop("dropout", 0.0)
    if p:
        kw.update(dropout_p=p, keep_mask=torch.rand(B, H, mq, mk, generator=g) >= p)
    o, lse = attention_forward_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    assert o.shape == (sum(lens_q), H, d) and lse.shape == (H, sum(lens_q))
    bias_grad = "attn_bias" in kw
    grads = attention_backward_ref(do, q, k, v, o, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   bias_requires_grad=bias_grad, **kw)
    dbias = torch.zeros(B, 1, mq, mk, dtype=F64)
    for b in range(B):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        if k1 == k0:  # no key: the rows are fully masked
            assert (o[q0:q1] == 0).all() and torch.isneginf(lse[:, q0:q1]).all()
            assert (grads[0][q0:q1] == 0).all()
            continue
        one = dict(kw)
        if "alibi_slopes" in kw:
            one["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
        if "keep_mask" in kw:
            one["keep_mask"] = kw["keep_mask"][b:b + 1, :, :q1 - q0, :k1 - k0]
        if bias_grad:
            one["attn_bias"] = kw["attn_bias"][b:b + 1, :, :q1 - q0, :k1 - k0]
        o1, lse1 = attention_forward_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **one)
        torch.testing.assert_close(o[q0:q1], o1[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, q0:q1], lse1[0], rtol=0, atol=0)
        g1 = attention_backward_ref(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], o1, lse1,
                                    bias_requires_grad=bias_grad, **one)
        torch.testing.assert_close(grads[0][q0:q1], g1[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grads[1][k0:k1], g1[1][0], rtol=0, atol=0)
        torch.testing.assert_close(grads[2][k0:k1], g1[2][0], rtol=0, atol=0)
        if bias_grad:
            dbias[b:b + 1, :, :q1 - q0, :k1 - k0] = g1[3]
    if bias_grad:
        torch.testing.assert_close(grads[3], dbias, rtol=1e-12, atol=1e-12)
    # the plain torch version, autograd through the packed layout
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_ref_torch(*leaves, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    torch.testing.assert_close(out, o, rtol=1e-12, atol=1e-12)
    out.backward(do)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-10)


def test_feature_validation_errors():
    q, k, v, do, g = _feature_inputs(1, 4, 5, 4, 2, 8, seed=15)
    with pytest.raises(ValueError, match="k must"):
        attention_forward_ref(q, k[:, :, :1].expand(1, 5, 3, 8), v)  # 4 heads over 3 kv heads
    with pytest.raises(ValueError, match="window_size"):
        attention_forward_ref(q, k, v, window_size=(1,))
    with pytest.raises(ValueError, match="causal_align"):
        attention_forward_ref(q, k, v, causal_align="center")
    with pytest.raises(ValueError, match="softcap"):
        attention_forward_ref(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        attention_forward_ref(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="attn_mask"):
        attention_forward_ref(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        attention_forward_ref(q, k, v, attn_mask=torch.ones(4, 5))
    with pytest.raises(TypeError, match="attn_bias"):
        attention_forward_ref(q, k, v, attn_bias=torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="bias_requires_grad"):
        o, lse = attention_forward_ref(q, k, v)
        attention_backward_ref(do, q, k, v, o, lse, bias_requires_grad=True)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        attention_forward_ref(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu)  # total_k is 5
    with pytest.raises(ValueError, match="together"):
        attention_forward_ref(q[0], k[0], v[0], cu_seqlens_q=cu)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        attention_forward_ref(q[0], k[0], v[0], cu_seqlens_q=cu.float(), cu_seqlens_k=cu)
