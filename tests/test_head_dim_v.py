"""v head dim != q/k head dim (MLA: DeepSeek-V2/V3 train with d_qk = 192, d_v = 128).

The spec carries both (``head_dim``, ``head_dim_v``: the feature "head_dim_v"); the SIMT family
takes it (its V / dO tiles, O and dV~ accumulators are of d_v, the smem layout and tile choice
count each); the tensor-core families decline it by name, so ``impl=None`` resolves to simt.
Checked against the float64 oracle with flash-attn's criterion (float16 / bfloat16), by float64
gradcheck, and through flash_attn_func / varlen / the packed functions (kv: k and v of one width
only, so not kvpacked), with causal, window, GQA, dropout, key padding, sinks, the deterministic
backward, Nq != Nk, lengths off the tiles; racecheck and AddressSanitizer run clean.
"""
from __future__ import annotations

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec, flash_attn_func, flash_attn_varlen_func
from fagen.errors import InputError

import sinkref as S


def _qkv(B, Nq, Nk, H, Hkv, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Nq, H, d, generator=g).to(dtype), torch.randn(B, Nk, Hkv, d, generator=g).to(dtype),
            torch.randn(B, Nk, Hkv, dv, generator=g).to(dtype))


def test_spec_carries_both_dims_and_the_families_choose() -> None:
    spec = KernelSpec(direction="bwd", head_dim=192, head_dim_v=128, causal=True)
    assert spec.impl == "simt" and spec.name.startswith("fa_bwd_d192_dv128_fp16_causal_")
    assert spec.features == {"head_dim_v"} and spec.family_spec.dv == 128
    assert KernelSpec(direction="fwd", head_dim=64, head_dim_v=64).head_dim_v is None  # the same: no second dim
    layout = {b.name: b.count for b in spec.smem_layout.buffers}
    same = {b.name: b.count for b in KernelSpec(direction="bwd", head_dim=192, causal=True, impl="simt",
                                                block_r=spec.tile.block_r, block_c=spec.tile.block_c).smem_layout.buffers}
    assert layout["dv"] < same["dv"] and layout["v"] < same["v"] and layout["dk"] == same["dk"]
    for impl in ("mma", "wgmma"):
        with pytest.raises(ValueError, match="head_dim_v"):
            KernelSpec(direction="fwd", head_dim=128, head_dim_v=64, impl=impl, arch="sm_90a")
    with pytest.raises(ValueError, match="head_dim_v"):
        KernelSpec(head_dim=64, head_dim_v=20)


CASES = [
    # dtype, B, Nq, Nk, H, Hkv, d, dv, causal, window, padding, dropout_p, sinks, deterministic
    (torch.float16, 1, 37, 50, 2, 1, 192, 128, True, (-1, -1), False, 0.0, False, False),
    (torch.bfloat16, 2, 33, 33, 2, 2, 128, 64, False, (-1, -1), True, 0.0, True, False),
    (torch.float16, 1, 45, 29, 4, 2, 24, 40, True, (6, -1), False, 0.17, False, True),
    (torch.bfloat16, 1, 21, 40, 2, 2, 59, 33, False, (-1, -1), False, 0.0, False, False),
]


def _ids(c) -> str:
    dt, B, Nq, Nk, H, Hkv, d, dv, causal, window, pad, p, sinks, det = c
    return (f"{str(dt)[6:]}-q{Nq}k{Nk}h{H}/{Hkv}-d{d}dv{dv}" + ("-causal" if causal else "")
            + (f"-win{window[0]}" if window != (-1, -1) else "") + ("-pad" if pad else "") + (f"-p{p}" if p else "")
            + ("-sinks" if sinks else "") + ("-det" if det else ""))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_head_dim_v_flash_criterion(case) -> None:
    dtype, B, Nq, Nk, H, Hkv, d, dv, causal, window, padding, p, with_sinks, det = case
    q, k, v = _qkv(B, Nq, Nk, H, Hkv, d, dv, dtype, seed=d + dv)
    g = torch.Generator().manual_seed(3)
    do = torch.randn(B, Nq, H, dv, generator=g).to(dtype)
    dlse = torch.randn(B, H, Nq, generator=g)
    kpm = None
    if padding:
        kpm = torch.rand(B, Nk, generator=g) > 0.3
        kpm[:, 0] = True
    sinks = torch.randn(H, generator=g) if with_sinks else None
    keep = F.dropout_keep_mask(B, H, Nq, Nk, p, seed=2, offset=1) if p else None
    kw = dict(causal=causal, window_size=window, key_padding_mask=kpm, dropout_p=p, seed=2, offset=1, sinks=sinks)
    o, lse = F.attention_forward(q, k, v, **kw)
    assert o.shape == (B, Nq, H, dv)
    grads = F.attention_backward(do, q, k, v, o, lse, dlse=dlse, deterministic=det, **kw)
    assert [t.shape for t in grads[:3]] == [q.shape, k.shape, v.shape]
    okw = dict(causal=causal, window=window, kpm=kpm, keep=keep, dropout_p=p)
    inputs = {"q": q, "k": k, "v": v, **({"sinks": sinks} if with_sinks else {})}
    o64, _, g64 = S.grads(S.attention, inputs, do, dlse, torch.float64, **okw)
    o_pt, _, g_pt = S.grads(S.attention, inputs, do, dlse, dtype, **okw)
    S.criterion("out", o, o64, o_pt, dtype)
    for name, ours in zip(("q", "k", "v", "sinks"), grads):
        S.criterion("d" + name, ours, g64[name], g_pt[name], dtype)
    if det:
        again = F.attention_backward(do, q, k, v, o, lse, dlse=dlse, deterministic=True, **kw)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_gradcheck_float64_head_dim_v() -> None:
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 6, 9, 2, 1, 16, 8, torch.float64, seed=1))

    def fn(q, k, v):
        return flash_attn_func(q, k, v, 0.0, 0.25, True, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=5e-4, rtol=1e-3)  # lse: float32 in the kernels
    o = flash_attn_func(q, k, v, 0.0, 0.25, True)
    do = torch.randn_like(o)
    ours = torch.autograd.grad(o, (q, k, v), do)
    _, _, g64 = S.grads(S.attention, {"q": q, "k": k, "v": v}, do, None, torch.float64, causal=True, scale=0.25)
    for a, name in zip(ours, "qkv"):
        torch.testing.assert_close(a, g64[name], rtol=1e-6, atol=1e-6)


def test_varlen_head_dim_v_matches_per_sequence() -> None:
    cu_q = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11, 30], dtype=torch.int32)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(20, 2, 32, generator=g).requires_grad_(True)
    k = torch.randn(30, 1, 32, generator=g).requires_grad_(True)
    v = torch.randn(30, 1, 16, generator=g).requires_grad_(True)
    o = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 19, causal=True)
    assert o.shape == (20, 2, 16)
    o.sum().backward()
    for b in range(3):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        ob = flash_attn_func(q.detach()[None, q0:q1], k.detach()[None, k0:k1], v.detach()[None, k0:k1], causal=True)
        torch.testing.assert_close(o.detach()[q0:q1], ob[0], rtol=1e-5, atol=1e-5)


def test_head_dim_v_kernels_run_clean_under_racecheck_and_asan() -> None:
    from fagen.runtime import cpu

    q, k, v = _qkv(1, 40, 24, 2, 1, 32, 16, torch.float16, seed=11)
    do = torch.randn(1, 40, 2, 16).to(torch.float16)
    kpm = torch.rand(1, 24, generator=torch.Generator().manual_seed(2)) > 0.3
    kpm[:, 0] = True
    flags = dict(head_dim=32, head_dim_v=16, dtype="float16", causal=True, key_padding=True, impl="simt",
                 block_r=16, block_c=16, num_warps=2)
    fwd, bwd = KernelSpec(direction="fwd", **flags), KernelSpec(direction="bwd", deterministic=True, **flags)
    kw = dict(causal=True, key_padding_mask=kpm)

    def run():
        o, lse = F.attention_forward(q, k, v, spec=fwd, **kw)
        return (o, lse) + F.attention_backward(do, q, k, v, o, lse, spec=bwd, deterministic=True, **kw)

    plain = run()
    with cpu.racecheck():
        raced = run()
    with cpu.sanitized() as record:
        checked = run()
    assert {"main", "pre", "dq", "post"} <= set(record.roles)
    for a, b, c in zip(plain, raced, checked):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_v_of_another_shape_is_refused_naming_it() -> None:
    q, k, v = _qkv(1, 4, 5, 2, 2, 16, 8, torch.float32)
    with pytest.raises(InputError) as err:
        flash_attn_func(q, k, v[:, :4])
    assert err.value.argument == "v"
    o = flash_attn_func(q, k, v)
    with pytest.raises(InputError) as err:
        F.attention_backward(torch.zeros_like(q), q, k, v, o, torch.zeros(1, 2, 4))
    assert err.value.argument == "do"
