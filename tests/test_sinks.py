"""Attention sinks: ``sinks`` (fp32 [H], one logit per query head) in every entry point.

Row i's softmax runs over its scores and the sink logit (which contributes no value); lse includes
it; d sink_h = -sum_{b,i} P_i,sink D'_i. The sink is neither scaled, softcapped, biased nor
dropped out (FA4's learnable_sink: added raw to the row sum in the epilogue; softcap is a score
modification of q.k only; no dropout). Checked against tests/sinkref.py (the sink column appended,
then dropped) in float64 and with flash-attn's criterion for float16 / bfloat16 on the simt and mma
families: causal, window, GQA, key padding, dropout, softcap, varlen, Nq != Nk, lengths off the
tiles, rows that see no key; the Hopper family's forward (wgmma) with sinks as well.
"""
from __future__ import annotations

import math

import pytest
import torch

import fagen
import fagen.functional as F
from fagen import KernelSpec, flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention
from fagen import reference as R
from fagen.errors import InputError, InputTypeError

import sinkref as S


def _qkv(B, Nq, Nk, H, Hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Nq, H, d, generator=g).to(dtype), torch.randn(B, Nk, Hkv, d, generator=g).to(dtype),
            torch.randn(B, Nk, Hkv, d, generator=g).to(dtype))


def _sinks(H, seed=1):
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 2


# --------------------------------------------------------------------------- spec and families
def test_sinks_is_a_forward_flag_every_family_resolves() -> None:
    fwd = KernelSpec(direction="fwd", head_dim=64, causal=True, sinks=True)
    assert fwd.impl == "mma" and fwd.name.startswith("fa_fwd_d64_fp16_causal_sinks_")
    assert KernelSpec(direction="fwd", head_dim=64, dtype="float64", sinks=True).impl == "simt"
    # the Hopper family takes the forward flag (its epilogue); its backward needs none
    assert KernelSpec(direction="fwd", head_dim=64, causal=True, sinks=True, arch="sm_90a").impl == "wgmma"
    with pytest.raises(ValueError, match="forward only"):
        KernelSpec(direction="bwd", head_dim=64, sinks=True)


# --------------------------------------------------------------------------- numerics
CASES = [
    # dtype, impl, B, Nq, Nk, H, Hkv, d, causal, window, padding, dropout_p, softcap
    (torch.float16, None, 2, 37, 50, 4, 2, 32, True, (-1, -1), False, 0.0, 0.0),
    (torch.bfloat16, None, 2, 50, 37, 2, 2, 40, True, (-1, -1), True, 0.0, 0.0),  # rows that see no key
    (torch.float16, None, 1, 45, 45, 2, 1, 32, False, (8, 3), False, 0.17, 0.0),
    (torch.bfloat16, None, 1, 33, 40, 2, 2, 32, False, (-1, -1), False, 0.0, 5.0),
    (torch.float16, "simt", 2, 37, 50, 4, 2, 32, True, (-1, -1), True, 0.1, 0.0),
    (torch.bfloat16, "simt", 1, 40, 21, 2, 1, 24, False, (5, 5), False, 0.0, 3.0),
    (torch.float64, "simt", 2, 21, 30, 2, 1, 16, True, (-1, -1), True, 0.0, 0.0),
]


def _ids(c) -> str:
    dt, impl, B, Nq, Nk, H, Hkv, d, causal, window, pad, p, cap = c
    return (f"{str(dt)[6:]}-{impl or 'default'}-q{Nq}k{Nk}h{H}/{Hkv}d{d}" + ("-causal" if causal else "")
            + (f"-win{window[0]}_{window[1]}" if window != (-1, -1) else "") + ("-pad" if pad else "")
            + (f"-p{p}" if p else "") + (f"-cap{cap}" if cap else ""))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_sinks_forward_backward_flash_criterion(case) -> None:
    dtype, impl, B, Nq, Nk, H, Hkv, d, causal, window, padding, p, cap = case
    q, k, v = _qkv(B, Nq, Nk, H, Hkv, d, dtype, seed=Nq + Nk)
    sinks = _sinks(H)
    g = torch.Generator().manual_seed(7)
    do = torch.randn(B, Nq, H, d, generator=g).to(dtype)
    dlse = torch.randn(B, H, Nq, generator=g)
    kpm = None
    if padding:
        kpm = torch.rand(B, Nk, generator=g) > 0.3
        kpm[0, :] = False  # batch 0: every row sees no key (o = 0, lse = the sink)
    seed, offset = 5, 9
    keep = F.dropout_keep_mask(B, H, Nq, Nk, p, seed=seed, offset=offset) if p else None
    kw = dict(causal=causal, window_size=window, key_padding_mask=kpm, dropout_p=p, softcap=cap, seed=seed,
              offset=offset, sinks=sinks)
    if impl is None:
        o, lse = F.attention_forward(q, k, v, **kw)
        dq, dk, dv, dsinks = F.attention_backward(do, q, k, v, o, lse, dlse=dlse, **kw)
    else:
        flags = dict(head_dim=-(-d // 8) * 8, dtype=str(dtype)[6:], causal=causal, key_padding=padding,
                     dropout=p > 0, window=window != (-1, -1), softcap=cap > 0, impl=impl)
        o, lse = F.run_forward(KernelSpec(direction="fwd", sinks=True, **flags), q, k, v, **kw)
        dq, dk, dv, dsinks = F.run_backward(KernelSpec(direction="bwd", **flags), do, q, k, v, o, lse, dlse=dlse,
                                            **kw)
    okw = dict(causal=causal, window=window, kpm=kpm, keep=keep, dropout_p=p, softcap=cap)
    inputs = {"q": q, "k": k, "v": v, "sinks": sinks}
    o64, lse64, g64 = S.grads(S.attention, inputs, do, dlse, torch.float64, **okw)
    if padding:
        assert (o[0] == 0).all() and torch.equal(lse[0], sinks[:, None].expand(H, Nq))
    if dtype == torch.float64:
        torch.testing.assert_close(o, o64, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse.double(), lse64, rtol=1e-6, atol=1e-6)
        for name, ours in (("q", dq), ("k", dk), ("v", dv), ("sinks", dsinks)):
            torch.testing.assert_close(ours.double(), g64[name], rtol=1e-5, atol=1e-5)
        return
    o_pt, lse_pt, g_pt = S.grads(S.attention, inputs, do, dlse, dtype, **okw)
    S.criterion("out", o, o64, o_pt, dtype)
    S.criterion("lse", lse, lse64, S.grads(S.attention, inputs, do, dlse, torch.float32, **okw)[1], torch.float32)
    for name, ours in (("q", dq), ("k", dk), ("v", dv), ("sinks", dsinks)):
        S.criterion("d" + name, ours, g64[name], g_pt[name], dtype)
    # the float64 reference of fagen.reference agrees with the oracle
    ref_o, ref_lse = R.attention_forward_ref(q, k, v, causal=causal, window_size=window, key_padding_mask=kpm,
                                             keep_mask=keep, dropout_p=p, softcap=cap, sinks=sinks)
    torch.testing.assert_close(ref_o, o64, rtol=1e-9, atol=1e-9)
    ref = R.attention_backward_ref(do, q, k, v, o64, lse64, causal=causal, window_size=window, key_padding_mask=kpm,
                                   keep_mask=keep, dropout_p=p, softcap=cap, sinks=sinks, dlse=dlse)
    torch.testing.assert_close(ref[-1], g64["sinks"].double(), rtol=1e-6, atol=1e-6)


def test_gradcheck_float64_with_sinks() -> None:
    """q, k, v by gradcheck (float64, SIMT), with fixed sinks; o and lse both."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 6, 9, 2, 1, 8, torch.float64, seed=2))
    sinks = torch.tensor([0.5, -1.0])

    def fn(q, k, v):
        return flash_attn_func(q, k, v, 0.0, 0.5, True, (4, -1), sinks=sinks, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=5e-4, rtol=1e-3)  # lse: float32 in the kernels


def test_dsinks_against_finite_differences() -> None:
    """d sink from the backward equals the central difference of the loss in the sink (float64)."""
    q, k, v = _qkv(2, 13, 17, 2, 2, 8, torch.float64, seed=4)
    g = torch.Generator().manual_seed(5)
    do, dlse = torch.randn(2, 13, 2, 8, dtype=torch.float64, generator=g), torch.randn(2, 2, 13, generator=g)
    sinks = torch.tensor([0.25, -0.75], requires_grad=True)

    def loss(s):
        o, lse = flash_attn_func(q, k, v, causal=True, sinks=s, return_lse=True)
        return (o * do).sum() + (lse.double() * dlse).sum()

    loss(sinks).backward()
    for h in range(2):
        e = torch.zeros(2)
        e[h] = 1e-2
        fd = (loss(sinks.detach() + e) - loss(sinks.detach() - e)).item() / 2e-2
        assert abs(sinks.grad[h].item() - fd) <= 1e-4 * max(1.0, abs(fd)), (h, sinks.grad[h].item(), fd)


# --------------------------------------------------------------------------- entry points
def test_varlen_sinks_match_per_sequence_calls() -> None:
    lens_q, lens_k = (5, 0, 9, 3), (4, 6, 0, 11)
    cu_q = torch.tensor([0, 5, 5, 14, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 10, 10, 21], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(17, 2, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    k = torch.randn(21, 1, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    v = torch.randn(21, 1, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    sinks = _sinks(2).requires_grad_(True)
    o, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 11, causal=True, sinks=sinks, return_lse=True)
    (o.float().sum() + lse.sum()).backward()
    dsinks = sinks.grad.clone()
    total = torch.zeros(2)
    for b in range(4):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        if k1 == k0:  # no key: zero rows, lse = the sink
            assert (o[q0:q1] == 0).all() and torch.equal(lse[:, q0:q1], sinks.detach()[:, None].expand(2, q1 - q0))
            total += q1 - q0  # d lse / d sink = 1 on each such row
            continue
        s = sinks.detach().clone().requires_grad_(True)
        ob, lb = flash_attn_func(q.detach()[None, q0:q1], k.detach()[None, k0:k1], v.detach()[None, k0:k1],
                                 causal=True, sinks=s, return_lse=True)
        assert torch.equal(ob[0], o.detach()[q0:q1]) and torch.equal(lb[0], lse.detach()[:, q0:q1])
        (ob.float().sum() + lb.sum()).backward()
        total += s.grad
    torch.testing.assert_close(dsinks, total, rtol=1e-5, atol=1e-5)


def test_sdpa_and_functional_take_sinks() -> None:
    q, k, v = _qkv(1, 12, 12, 2, 2, 16, torch.float32, seed=8)
    sinks = _sinks(2)
    o_flash = flash_attn_func(q, k, v, causal=True, sinks=sinks)
    o_sdpa = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          sinks=sinks)
    assert torch.equal(o_sdpa.transpose(1, 2), o_flash)
    o_fun, lse = fagen.attention_forward(q, k, v, causal=True, sinks=sinks)
    assert torch.equal(o_fun, o_flash)
    o64, lse64 = S.attention(q, k, v, sinks=sinks, causal=True, dtype=torch.float64)
    torch.testing.assert_close(o_fun.double(), o64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-5)
    # -inf sinks are no sinks
    none = flash_attn_func(q, k, v, causal=True, sinks=torch.full((2,), -math.inf))
    torch.testing.assert_close(none, flash_attn_func(q, k, v, causal=True), rtol=1e-6, atol=1e-6)


def test_no_keys_gives_the_sink_lse_and_its_gradient() -> None:
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    k = v = torch.randn(1, 0, 2, 8)
    sinks = torch.tensor([0.5, 1.5], requires_grad=True)
    o, lse = flash_attn_func(q, k, v, sinks=sinks, return_lse=True)
    assert (o == 0).all() and torch.equal(lse, sinks.detach()[None, :, None].expand(1, 2, 3))
    lse.sum().backward()
    assert torch.equal(sinks.grad, torch.tensor([3.0, 3.0]))


@pytest.mark.parametrize("sinks, error", [
    (torch.zeros(2, dtype=torch.float16), InputTypeError),
    (torch.zeros(3), InputError),
    (torch.zeros(1, 2), InputError),
    ([0.0, 0.0], InputTypeError),
])
def test_sinks_errors_name_the_argument(sinks, error, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "get_module", lambda *a: pytest.fail("a kernel module was requested"))
    q, k, v = _qkv(1, 4, 4, 2, 2, 8, torch.float32)
    with pytest.raises(error) as err:
        flash_attn_func(q, k, v, sinks=sinks)
    assert err.value.argument == "sinks"


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_wgmma_forward_with_sinks(dtype) -> None:
    """The Hopper forward (sm_90a, one consumer warpgroup, in the emulator) with sinks, GQA, causal
    with rows that see no key, lengths off the tiles; the backward from its lse; and the forward clean
    under racecheck with the plain run's bits."""
    from fagen.runtime import cpu

    B, Nq, Nk, H, Hkv, d = 1, 70, 45, 2, 1, 64
    q, k, v = _qkv(B, Nq, Nk, H, Hkv, d, dtype, seed=13)
    sinks = _sinks(2, seed=3)
    g = torch.Generator().manual_seed(4)
    do, dlse = torch.randn(B, Nq, H, d, generator=g).to(dtype), torch.randn(B, H, Nq, generator=g)
    fwd = KernelSpec(direction="fwd", head_dim=d, dtype=str(dtype)[6:], causal=True, sinks=True, arch="sm_90a",
                     impl="wgmma", num_warps=4)
    o, lse = F.run_forward(fwd, q, k, v, sinks=sinks)
    dq, dk, dv, dsinks = F.attention_backward(do, q, k, v, o, lse, causal=True, sinks=sinks, dlse=dlse)
    inputs = {"q": q, "k": k, "v": v, "sinks": sinks}
    o64, lse64, g64 = S.grads(S.attention, inputs, do, dlse, torch.float64, causal=True)
    o_pt, _, g_pt = S.grads(S.attention, inputs, do, dlse, dtype, causal=True)
    S.criterion("out", o, o64, o_pt, dtype)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-5)
    for name, ours in (("q", dq), ("k", dk), ("v", dv), ("sinks", dsinks)):
        S.criterion("d" + name, ours, g64[name], g_pt[name], dtype)
    with cpu.racecheck():
        o2, lse2 = F.run_forward(fwd, q, k, v, sinks=sinks)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


# --------------------------------------------------------------------------- racecheck and sanitizer
@pytest.mark.parametrize("impl", [pytest.param("simt", marks=pytest.mark.slow), "mma"])
def test_sinks_and_dlse_kernels_run_clean_under_racecheck_and_asan(impl) -> None:
    """The forward with sinks and every backward role with dlse (GQA, causal with rows that see no
    key, key padding, lengths inside a tile): no shared-memory race, no access past a tensor, and
    the plain run's bits."""
    from fagen.runtime import cpu

    q, k, v = _qkv(1, 40, 24, 2, 1, 16, torch.float16, seed=11)
    sinks, do, dlse = _sinks(2), torch.randn(1, 40, 2, 16).to(torch.float16), torch.randn(1, 2, 40)
    kpm = torch.rand(1, 24, generator=torch.Generator().manual_seed(2)) > 0.3
    kpm[:, 0] = True
    tile = dict(block_r=16 if impl == "simt" else 32, block_c=16, num_warps=2)
    flags = dict(head_dim=16, dtype="float16", causal=True, key_padding=True, impl=impl, **tile)
    fwd, bwd = KernelSpec(direction="fwd", sinks=True, **flags), KernelSpec(direction="bwd", **flags)
    kw = dict(causal=True, key_padding_mask=kpm, sinks=sinks)

    def run():
        o, lse = F.attention_forward(q, k, v, spec=fwd, **kw)
        return (o, lse) + F.attention_backward(do, q, k, v, o, lse, spec=bwd, dlse=dlse, **kw)

    plain = run()
    with cpu.racecheck() as record:
        raced = run()
    assert {"main", "pre", "post"} <= set(record.roles)
    with cpu.sanitized() as record:
        checked = run()
    assert {"main", "pre", "post"} <= set(record.roles)
    for a, b, c in zip(plain, raced, checked):
        assert torch.equal(a, b) and torch.equal(a, c)
