"""v head dim != q/k head dim (MLA: DeepSeek-V2/V3 train with d_qk = 192, d_v = 128).

The spec carries both (``head_dim``, ``head_dim_v``: the feature "head_dim_v"); the families that
list the feature take it (SIMT and mma: their V / dO tiles, O and dV~ accumulators are of d_v, the
smem layout and tile choice count each), the others decline it by name, so ``impl=None`` resolves to
the preferred family that takes it (mma for float16 / bfloat16, simt otherwise).
Checked against the float64 oracle with flash-attn's criterion (float16 / bfloat16) on both families,
by float64 gradcheck, and through flash_attn_func / varlen / the packed functions (kv: k and v of one
width only, so not kvpacked), with causal, window, GQA, dropout, key padding, sinks, the deterministic
backward, Nq != Nk, lengths off the tiles; racecheck and AddressSanitizer run clean; the mma kernels
compile without spills (NVRTC, sm_80 and sm_90).
"""
from __future__ import annotations

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec, flash_attn_func, flash_attn_varlen_func
from fagen.errors import InputError
from fagen.families import family_names, get_family

import sinkref as S


def _qkv(B, Nq, Nk, H, Hkv, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Nq, H, d, generator=g).to(dtype), torch.randn(B, Nk, Hkv, d, generator=g).to(dtype),
            torch.randn(B, Nk, Hkv, dv, generator=g).to(dtype))


def test_spec_carries_both_dims_and_the_families_choose() -> None:
    spec = KernelSpec(direction="bwd", head_dim=192, head_dim_v=128, causal=True, impl="simt")
    assert spec.name.startswith("fa_bwd_d192_dv128_fp16_causal_")
    assert spec.features == {"head_dim_v"} and spec.family_spec.dv == 128
    assert KernelSpec(direction="fwd", head_dim=64, head_dim_v=64).head_dim_v is None  # the same: no second dim
    layout = {b.name: b.count for b in spec.smem_layout.buffers}
    same = {b.name: b.count for b in KernelSpec(direction="bwd", head_dim=192, causal=True, impl="simt",
                                                block_r=spec.tile.block_r, block_c=spec.tile.block_c).smem_layout.buffers}
    assert layout["dv"] < same["dv"] and layout["v"] < same["v"] and layout["dk"] == same["dk"]
    # impl=None: the preferred family that takes it (mma for 16-bit dtypes, simt for float32)
    assert KernelSpec(direction="bwd", head_dim=192, head_dim_v=128, causal=True).impl == "mma"
    assert KernelSpec(direction="fwd", head_dim=192, head_dim_v=128, dtype="float32").impl == "simt"
    with pytest.raises(ValueError, match="head_dim_v"):
        KernelSpec(head_dim=64, head_dim_v=20)


@pytest.mark.parametrize("impl", family_names())
def test_families_listing_the_feature_take_it_the_others_decline_by_name(impl: str) -> None:
    """A family that lists "head_dim_v" in its ``features`` takes such a spec (MLA's d = 192, dv = 128
    and d = 128, dv = 64, forward; the Hopper family on sm_90a, the others on sm_90); its backward
    takes it too or declines it naming head_dim_v. A family that does not list it names head_dim_v in
    its refusal, so impl=None passes it by."""
    arch = "sm_90a" if impl == "wgmma" else "sm_90"
    takes = "head_dim_v" in get_family(impl).features
    tried = 0
    for direction, d, dv in (("fwd", 192, 128), ("fwd", 128, 64), ("bwd", 192, 128), ("bwd", 128, 64)):
        flags = dict(direction=direction, head_dim=d, dtype="bfloat16", arch=arch, impl=impl)
        try:
            KernelSpec(**flags)
        except ValueError:
            continue  # the family does not take this head dim or direction at all
        tried += 1
        if takes and direction == "fwd":
            spec = KernelSpec(head_dim_v=dv, **flags)
            assert spec.impl == impl and spec.family_spec.dv == dv
            continue
        try:
            spec = KernelSpec(head_dim_v=dv, **flags)
        except ValueError as err:
            assert "head_dim_v" in str(err), err
        else:
            assert takes and spec.family_spec.dv == dv
    assert tried
    if impl in ("simt", "mma"):  # these take every pair in both directions
        for direction in ("fwd", "bwd"):
            assert KernelSpec(direction=direction, head_dim=64, head_dim_v=128, dtype="float16", impl=impl).impl == impl


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


#: Pairs only the mma sweep adds (the slow tier): d = 64 / dv = 128 (dv wider), d = 256 / dv = 96.
MMA_CASES = [
    (torch.bfloat16, 2, 50, 37, 2, 2, 64, 128, True, (-1, -1), True, 0.1, False, True),
    (torch.float16, 1, 30, 41, 4, 1, 256, 96, False, (9, 3), False, 0.0, True, False),
]
#: The mma runs of the fast tier (the rest: slow): the MLA pair and the odd dims with every per-element flag.
MMA_FAST = (0, 2)


def _params():
    out = [pytest.param("simt", c, id="simt-" + _ids(c)) for c in CASES]
    for i, c in enumerate(CASES + MMA_CASES):
        marks = () if i in MMA_FAST else (pytest.mark.slow,)
        out.append(pytest.param("mma", c, id="mma-" + _ids(c), marks=marks))
    return out


def _spec(direction: str, impl: str, d: int, dv: int, dtype: torch.dtype, causal: bool, window, padding: bool, p: float,
          with_sinks: bool, det: bool) -> KernelSpec:
    """The spec of the inputs on family ``impl`` (default tile), head dims padded to 8 as the functions do."""
    extra = {"sinks": with_sinks} if direction == "fwd" else {"deterministic": det}
    return KernelSpec(direction=direction, head_dim=-(-d // 8) * 8, head_dim_v=-(-dv // 8) * 8, dtype=str(dtype)[6:],
                      causal=causal, window=window != (-1, -1), key_padding=padding, dropout=p > 0, impl=impl, **extra)


@pytest.mark.parametrize("impl, case", _params())
def test_head_dim_v_flash_criterion(impl: str, case) -> None:
    dtype, B, Nq, Nk, H, Hkv, d, dv, causal, window, padding, p, with_sinks, det = case
    specs = {direction: _spec(direction, impl, d, dv, dtype, causal, window, padding, p, with_sinks, det)
             for direction in ("fwd", "bwd")}
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
    o, lse = F.attention_forward(q, k, v, spec=specs["fwd"], **kw)
    assert o.shape == (B, Nq, H, dv)
    grads = F.attention_backward(do, q, k, v, o, lse, dlse=dlse, deterministic=det, spec=specs["bwd"], **kw)
    assert [t.shape for t in grads[:3]] == [q.shape, k.shape, v.shape]
    okw = dict(causal=causal, window=window, kpm=kpm, keep=keep, dropout_p=p)
    inputs = {"q": q, "k": k, "v": v, **({"sinks": sinks} if with_sinks else {})}
    o64, _, g64 = S.grads(S.attention, inputs, do, dlse, torch.float64, **okw)
    o_pt, _, g_pt = S.grads(S.attention, inputs, do, dlse, dtype, **okw)
    S.criterion("out", o, o64, o_pt, dtype)
    for name, ours in zip(("q", "k", "v", "sinks"), grads):
        S.criterion("d" + name, ours, g64[name], g_pt[name], dtype)
    if det:
        again = F.attention_backward(do, q, k, v, o, lse, dlse=dlse, deterministic=True, spec=specs["bwd"], **kw)
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


@pytest.mark.parametrize("impl, d, dv, tile", [
    ("simt", 32, 16, dict(block_r=16, block_c=16, num_warps=2)),
    ("mma", 16, 48, dict(block_r=32, block_c=16, num_warps=2)),   # dv wider: two Q blocks and two K/V blocks
])
def test_head_dim_v_kernels_run_clean_under_racecheck_and_asan(impl: str, d: int, dv: int, tile: dict) -> None:
    """Every role (forward; backward pre, main, deterministic dq, post) of both families with a v head
    dim of its own: bit-identical under the race checker and AddressSanitizer (mma: two K/V blocks, two
    Q blocks and their pipelines)."""
    from fagen.runtime import cpu

    q, k, v = _qkv(1, 40, 24, 2, 1, d, dv, torch.float16, seed=11)
    do = torch.randn(1, 40, 2, dv).to(torch.float16)
    kpm = torch.rand(1, 24, generator=torch.Generator().manual_seed(2)) > 0.3
    kpm[:, 0] = True
    flags = dict(head_dim=d, head_dim_v=dv, dtype="float16", causal=True, key_padding=True, impl=impl, **tile)
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
