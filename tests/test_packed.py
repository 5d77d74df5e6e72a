"""flash-attn's packed entry points, ported from flash-attn's own tests to CPU tensors (emulator).

``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``, ``flash_attn_varlen_qkvpacked_func``
and ``flash_attn_varlen_kvpacked_func`` (flash-attn's ``flash_attn/flash_attn_interface.py``
signatures) are views over ``flash_attn_func`` / ``flash_attn_varlen_func``. The tests follow
flash-attn's ``tests/test_flash_attn.py`` -- ``test_flash_attn_qkvpacked``,
``test_flash_attn_varlen_qkvpacked`` and the ``kvpacked=True`` cases of ``test_flash_attn_output``
and ``test_flash_attn_varlen_output`` -- with flash-attn's criterion (``|ours - ref64| <= 2
|pytorch - ref64|`` plus an atol for outputs that are exactly representable) and its dropout
fraction check, on small shapes that are not multiples of the tiles and a covering sample of
its parameter grid instead of the full product (each flag set is one emulator build).
"""
from __future__ import annotations

import pytest
import torch

import fagen
import fagen.functional as F
from fagen import reference as R
from fagen.errors import InputError
from fagen.ops import (draw_rng_state, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)

ATOL = {torch.float16: 2e-4, torch.bfloat16: 2e-3}


def _max(a: torch.Tensor) -> float:
    return a.abs().max().item() if a.numel() else 0.0


def _criterion(name: str, ours: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor, dtype: torch.dtype) -> None:
    err, bound = _max(ours.double() - ref.double()), 2 * _max(pt.double() - ref.double()) + ATOL[dtype]
    assert err <= bound, f"{name}: max error {err:.3g} > 2 x pytorch's + atol = {bound:.3g}"


def _rng(dropout_p: float, seed: int) -> torch.Tensor:
    """The dropout key the op draws after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return draw_rng_state() if dropout_p > 0 else torch.zeros(2, dtype=torch.int64)


def _window(local: bool, seqlen: int, g: torch.Generator) -> tuple[int, int]:
    return (-1, -1) if not local else tuple(int(x) for x in torch.randint(0, seqlen, (2,), generator=g))


def _dropout_fraction(keep: torch.Tensor, allowed: torch.Tensor) -> float:
    return 1.0 - keep[allowed].float().mean().item()


class _Recorder:
    """Records the data pointers q, k, v reach the functional API with (the views' storage): the
    autograd op's forward (forward_lse_lo) or the plain one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ptrs: list[tuple[int, int, int]] = []
        for name in ("forward", "forward_lse_lo"):
            real = getattr(F, name)

            def forward(q, k, v, *args, _real=real, **kwargs):
                self.ptrs.append((q.data_ptr(), k.data_ptr(), v.data_ptr()))
                return _real(q, k, v, *args, **kwargs)

            monkeypatch.setattr(F, name, forward)


# flash-attn: seqlen x d x dropout_p x causal x local x alibi x deterministic x dtype; here a covering
# sample (each flag on and off, the pairs that share a kernel path), lengths off the tiles.
QKV_CASES = [
    # seqlen, d, dropout_p, causal, local, alibi, deterministic, dtype
    (37, 32, 0.0, False, False, False, False, torch.float16),
    (37, 59, 0.17, True, False, False, False, torch.bfloat16),
    (45, 32, 0.0, True, True, True, True, torch.float16),
    (33, 32, 0.17, False, False, True, False, torch.float16),
]


@pytest.mark.parametrize("seqlen, d, dropout_p, causal, local, alibi, deterministic, dtype", QKV_CASES)
def test_flash_attn_qkvpacked(seqlen, d, dropout_p, causal, local, alibi, deterministic, dtype,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    batch_size, nheads = 2, 3
    window_size = _window(local, seqlen, g)
    qkv = torch.randn(batch_size, seqlen, 3, nheads, d, generator=g).to(dtype).requires_grad_(True)
    alibi_slopes = torch.rand(batch_size, nheads, generator=g) * 0.3 if alibi else None
    rec = _Recorder(monkeypatch)
    torch.manual_seed(5)
    out, lse, S_dmask = flash_attn_qkvpacked_func(qkv, dropout_p, causal=causal, window_size=window_size,
                                                  alibi_slopes=alibi_slopes, deterministic=deterministic,
                                                  return_attn_probs=True)
    # thin views: the kernels read the packed tensor's own storage
    step = qkv.stride(2) * qkv.element_size()
    assert rec.ptrs == [(qkv.data_ptr(), qkv.data_ptr() + step, qkv.data_ptr() + 2 * step)]
    assert out.shape == (batch_size, seqlen, nheads, d) and lse.shape == (batch_size, nheads, seqlen)
    keep = None
    if dropout_p > 0:
        rng = _rng(dropout_p, 5)
        keep = F.dropout_keep_mask(batch_size, nheads, seqlen, seqlen, dropout_p, seed=int(rng[0]),
                                   offset=int(rng[1]))
        allowed = R.mask_matrix(batch_size, seqlen, seqlen, causal=causal, window_size=window_size)
        allowed = allowed.expand(batch_size, nheads, seqlen, seqlen)
        assert (S_dmask[allowed & (S_dmask != 0)] < 0).eq(~keep[allowed & (S_dmask != 0)]).all()
        assert abs(_dropout_fraction(keep, allowed) - dropout_p) <= (0.03 if not local else 0.05)
    kw = dict(causal=causal, window_size=window_size, alibi_slopes=alibi_slopes, keep_mask=keep, dropout_p=dropout_p)
    q, k, v = qkv.unbind(2)
    out_ref = R.attention_ref_torch(q, k, v, upcast=True, **kw)
    out_pt = R.attention_ref_torch(q, k, v, upcast=False, **kw)
    _criterion("out", out, out_ref, out_pt, dtype)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    (dqkv,) = torch.autograd.grad(out, qkv, grad)
    (dqkv_ref,) = torch.autograd.grad(out_ref, qkv, grad.double())
    (dqkv_pt,) = torch.autograd.grad(out_pt, qkv, grad)
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    for i, name in enumerate(("dq", "dk", "dv")):
        _criterion(name, dqkv[:, :, i], dqkv_ref[:, :, i], dqkv_pt[:, :, i], dtype)


def _padding_mask(seqlen: int, batch: int, g: torch.Generator) -> torch.Tensor:
    """flash-attn's ``generate_random_padding_mask(mode="random")``: each sequence keeps a random
    prefix of at least ``seqlen - 20`` tokens (here at least 1; batch 0 keeps all)."""
    lengths = torch.randint(max(1, seqlen - 20), seqlen + 1, (batch,), generator=g)
    lengths[0] = seqlen
    return torch.arange(seqlen)[None, :] < lengths[:, None]


def _cu(mask: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0)).to(torch.int32)


VARLEN_QKV_CASES = [
    (41, 32, 0.0, True, False, False, False, torch.float16),
    (29, 24, 0.17, False, True, True, True, torch.bfloat16),
]


@pytest.mark.parametrize("seqlen, d, dropout_p, causal, local, alibi, deterministic, dtype", VARLEN_QKV_CASES)
def test_flash_attn_varlen_qkvpacked(seqlen, d, dropout_p, causal, local, alibi, deterministic, dtype) -> None:
    g = torch.Generator().manual_seed(1)
    batch_size, nheads = 3, 2
    window_size = _window(local, seqlen, g)
    qkv_pad = torch.randn(batch_size, seqlen, 3, nheads, d, generator=g).to(dtype)
    mask = _padding_mask(seqlen, batch_size, g)
    alibi_slopes = torch.rand(batch_size, nheads, generator=g) * 0.3 if alibi else None
    qkv_unpad = qkv_pad[mask].detach().clone().requires_grad_(True)  # [total, 3, H, d]
    cu_seqlens = _cu(mask)
    torch.manual_seed(9)
    out_unpad, sm_lse, S_dmask = flash_attn_varlen_qkvpacked_func(
        qkv_unpad, cu_seqlens, seqlen, dropout_p, causal=causal, window_size=window_size,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=True)
    assert sm_lse.shape == (nheads, int(mask.sum())) and S_dmask.shape == (batch_size, nheads, seqlen, seqlen)
    keep = None
    if dropout_p > 0:
        rng = _rng(dropout_p, 9)
        keep = F.dropout_keep_mask(batch_size, nheads, seqlen, seqlen, dropout_p, seed=int(rng[0]),
                                   offset=int(rng[1]))
    qkv = qkv_pad.detach().clone().requires_grad_(True)
    kw = dict(causal=causal, window_size=window_size, alibi_slopes=alibi_slopes, keep_mask=keep,
              dropout_p=dropout_p, key_padding_mask=mask)
    q, k, v = qkv.unbind(2)
    out_ref = R.attention_ref_torch(q, k, v, upcast=True, **kw)
    out_pt = R.attention_ref_torch(q, k, v, upcast=False, **kw)
    _criterion("out", out_unpad, out_ref[mask], out_pt[mask], dtype)
    grad = torch.randn(out_unpad.shape, generator=g).to(dtype)
    grad_pad = torch.zeros(out_ref.shape, dtype=dtype)
    grad_pad[mask] = grad  # padded query rows carry no gradient
    (dqkv_unpad,) = torch.autograd.grad(out_unpad, qkv_unpad, grad)
    (dqkv_ref,) = torch.autograd.grad(out_ref, qkv, grad_pad.double())
    (dqkv_pt,) = torch.autograd.grad(out_pt, qkv, grad_pad)
    for i, name in enumerate(("dq", "dk", "dv")):
        _criterion(name, dqkv_unpad[:, i], dqkv_ref[mask][:, i], dqkv_pt[mask][:, i], dtype)


# test_flash_attn_output(kvpacked=True): seqlen_q != seqlen_k, mha / mqa / gqa, softcap
KV_CASES = [
    # seqlen_q, seqlen_k, d, dropout_p, causal, local, alibi, deterministic, mha_type, softcap, dtype
    (33, 47, 32, 0.0, True, False, False, False, "gqa", 0.0, torch.float16),
    (47, 21, 40, 0.17, False, False, True, False, "mqa", 0.0, torch.bfloat16),
    (25, 25, 32, 0.0, False, True, False, True, "mha", 50.0, torch.float16),
]


@pytest.mark.parametrize("seqlen_q, seqlen_k, d, dropout_p, causal, local, alibi, deterministic, mha_type, "
                         "softcap, dtype", KV_CASES)
def test_flash_attn_output_kvpacked(seqlen_q, seqlen_k, d, dropout_p, causal, local, alibi, deterministic, mha_type,
                                    softcap, dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(2)
    batch_size, nheads = 2, 6
    nheads_k = nheads if mha_type == "mha" else (1 if mha_type == "mqa" else 3)
    window_size = _window(local, seqlen_k, g)
    q = (torch.randn(batch_size, seqlen_q, nheads, d, generator=g) * (4 if softcap else 1)).to(dtype)
    kv = torch.randn(batch_size, seqlen_k, 2, nheads_k, d, generator=g).to(dtype)
    q, kv = q.requires_grad_(True), kv.requires_grad_(True)
    alibi_slopes = torch.rand(batch_size, nheads, generator=g) * 0.3 if alibi else None
    rec = _Recorder(monkeypatch)
    torch.manual_seed(3)
    out, lse, S_dmask = flash_attn_kvpacked_func(q, kv, dropout_p, causal=causal, window_size=window_size,
                                                 softcap=softcap, alibi_slopes=alibi_slopes,
                                                 deterministic=deterministic, return_attn_probs=True)
    step = kv.stride(2) * kv.element_size()
    assert rec.ptrs == [(q.data_ptr(), kv.data_ptr(), kv.data_ptr() + step)]
    keep = None
    if dropout_p > 0:
        rng = _rng(dropout_p, 3)
        keep = F.dropout_keep_mask(batch_size, nheads, seqlen_q, seqlen_k, dropout_p, seed=int(rng[0]),
                                   offset=int(rng[1]))
    k, v = kv.unbind(2)
    kw = dict(causal=causal, window_size=window_size, alibi_slopes=alibi_slopes, keep_mask=keep, dropout_p=dropout_p,
              softcap=softcap)
    out_ref = R.attention_ref_torch(q, k, v, upcast=True, **kw)
    out_pt = R.attention_ref_torch(q, k, v, upcast=False, **kw)
    _criterion("out", out, out_ref, out_pt, dtype)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad)
    dq_ref, dkv_ref = torch.autograd.grad(out_ref, (q, kv), grad.double())
    dq_pt, dkv_pt = torch.autograd.grad(out_pt, (q, kv), grad)
    assert dkv.shape == kv.shape
    _criterion("dq", dq, dq_ref, dq_pt, dtype)
    _criterion("dk", dkv[:, :, 0], dkv_ref[:, :, 0], dkv_pt[:, :, 0], dtype)
    _criterion("dv", dkv[:, :, 1], dkv_ref[:, :, 1], dkv_pt[:, :, 1], dtype)


# test_flash_attn_varlen_output(kvpacked=True): different query and key lengths per sequence
VARLEN_KV_CASES = [
    (35, 52, 32, 0.0, True, False, "gqa", 0.0, torch.bfloat16),
    (29, 17, 32, 0.17, False, True, "mha", 0.0, torch.float16),
]


@pytest.mark.parametrize("seqlen_q, seqlen_k, d, dropout_p, causal, local, mha_type, softcap, dtype", VARLEN_KV_CASES)
def test_flash_attn_varlen_output_kvpacked(seqlen_q, seqlen_k, d, dropout_p, causal, local, mha_type, softcap,
                                           dtype) -> None:
    g = torch.Generator().manual_seed(3)
    batch_size, nheads = 3, 4
    nheads_k = nheads if mha_type == "mha" else 2
    window_size = _window(local, seqlen_k, g)
    q_pad = torch.randn(batch_size, seqlen_q, nheads, d, generator=g).to(dtype)
    kv_pad = torch.randn(batch_size, seqlen_k, 2, nheads_k, d, generator=g).to(dtype)
    mq, mk = _padding_mask(seqlen_q, batch_size, g), _padding_mask(seqlen_k, batch_size, g)
    q_unpad = q_pad[mq].detach().clone().requires_grad_(True)
    kv_unpad = kv_pad[mk].detach().clone().requires_grad_(True)
    torch.manual_seed(4)
    out_unpad, lse, _ = flash_attn_varlen_kvpacked_func(q_unpad, kv_unpad, _cu(mq), _cu(mk), seqlen_q, seqlen_k,
                                                        dropout_p, causal=causal, window_size=window_size,
                                                        softcap=softcap, return_attn_probs=True)
    keep = None
    if dropout_p > 0:
        rng = _rng(dropout_p, 4)
        keep = F.dropout_keep_mask(batch_size, nheads, seqlen_q, seqlen_k, dropout_p, seed=int(rng[0]),
                                   offset=int(rng[1]))
    # per sequence: the reference on the unpadded tokens of each (bottom-right alignment per sequence)
    cq, ck = _cu(mq).tolist(), _cu(mk).tolist()
    qr = q_unpad.detach().clone().requires_grad_(True)
    kvr = kv_unpad.detach().clone().requires_grad_(True)
    kw = dict(causal=causal, window_size=window_size, softcap=softcap, dropout_p=dropout_p,
              cu_seqlens_q=_cu(mq), cu_seqlens_k=_cu(mk))
    if keep is not None:
        kw["keep_mask"] = keep
    out_ref = R.attention_ref_torch(qr, *kvr.unbind(1), upcast=True, **kw)
    out_pt = R.attention_ref_torch(qr, *kvr.unbind(1), upcast=False, **kw)
    assert len(cq) == len(ck) == batch_size + 1
    _criterion("out", out_unpad, out_ref, out_pt, dtype)
    grad = torch.randn(out_unpad.shape, generator=g).to(dtype)
    dq, dkv = torch.autograd.grad(out_unpad, (q_unpad, kv_unpad), grad)
    dq_ref, dkv_ref = torch.autograd.grad(out_ref, (qr, kvr), grad.double())
    dq_pt, dkv_pt = torch.autograd.grad(out_pt, (qr, kvr), grad)
    _criterion("dq", dq, dq_ref, dq_pt, dtype)
    _criterion("dk", dkv[:, 0], dkv_ref[:, 0], dkv_pt[:, 0], dtype)
    _criterion("dv", dkv[:, 1], dkv_ref[:, 1], dkv_pt[:, 1], dtype)


def test_packed_entry_points_are_exported() -> None:
    for name in ("flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func"):
        assert name in fagen.__all__ and getattr(fagen, name) is getattr(fagen.ops, name)


@pytest.mark.parametrize("call, argument", [
    (lambda: flash_attn_qkvpacked_func(torch.randn(2, 5, 2, 2, 8)), "qkv"),  # 2 instead of 3
    (lambda: flash_attn_qkvpacked_func(torch.randn(5, 3, 2, 8)), "qkv"),  # varlen layout
    (lambda: flash_attn_kvpacked_func(torch.randn(2, 5, 2, 8), torch.randn(2, 5, 3, 2, 8)), "kv"),
    (lambda: flash_attn_kvpacked_func(torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 3, 8)), "kv"),  # heads
    (lambda: flash_attn_varlen_qkvpacked_func(torch.randn(5, 3, 2, 8), torch.tensor([0, 4], dtype=torch.int32), 5),
     "cu_seqlens"),  # last != total
    (lambda: flash_attn_varlen_kvpacked_func(torch.randn(5, 2, 8), torch.randn(5, 2, 2, 8, 1),
                                             *(torch.tensor([0, 5], dtype=torch.int32),) * 2, 5, 5), "kv"),
])
def test_packed_argument_errors_name_the_packed_argument(call, argument, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "get_module", lambda *a: pytest.fail("a kernel module was requested"))
    with pytest.raises(InputError) as err:
        call()
    assert err.value.argument == argument
