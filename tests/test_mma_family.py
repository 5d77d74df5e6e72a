"""The tensor-core family ``mma``: selection, accepted configurations, smem layout, the dropout
keep-mask bit for bit, and its kernels under AddressSanitizer (emulator)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import fagen.functional as F
from fagen.abi import neutral_args
from fagen import KernelSpec
from fagen.cli import main
from fagen.families.mma.rules import fwd_half_copy
from fagen.families import FamilySpec, Tile, default_family, family_names, get_family
from fagen.families.mma import padded_dim
from fagen.philox import drop_threshold
from fagen.renderer import render, template_context
from fagen.spec import ARCH_SMEM_OPTIN, HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_MULTIPLE

MMA = get_family("mma")


# ------------------------------------------------------------------ selection
def test_mma_is_the_default_for_half_types_and_simt_for_float32() -> None:
    assert [n for n in family_names() if n != "wgmma"][0] == "mma"  # wgmma: sm_90a only
    for dtype in ("float16", "bfloat16"):
        assert KernelSpec(head_dim=64, dtype=dtype).impl == "mma"
        assert KernelSpec(direction="fwd", head_dim=64, dtype=dtype).impl == "mma"
    assert KernelSpec(head_dim=64, dtype="float32").impl == "simt"
    assert default_family(FamilySpec("bwd", 64, "float32", "sm_80")) == "simt"


def test_float32_is_rejected_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="impl") as info:
        KernelSpec(head_dim=64, dtype="float32", impl="mma")
    assert "float16/bfloat16" in str(info.value)


@pytest.mark.parametrize("dtype,impl", [("float16", "mma"), ("float32", "simt")])
def test_cli_inspect_names_the_default_family(dtype: str, impl: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", "--head-dim", "64", "--dtype", dtype, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["impl"] == impl and info["name"].endswith(f"_{impl}_sm90")


# ------------------------------------------------------------- configurations
def test_each_warp_owns_16_rows_of_the_ctas_block() -> None:
    KernelSpec(head_dim=64, block_r=64, block_c=64, num_warps=4)
    with pytest.raises(ValidationError, match="block_c") as info:
        KernelSpec(head_dim=64, block_r=32, block_c=48, num_warps=2, impl="mma")  # backward: 16 K/V rows per warp
    assert "num_warps=2" in str(info.value)
    with pytest.raises(ValidationError, match="block_r"):
        KernelSpec(direction="fwd", head_dim=64, block_r=48, block_c=32, num_warps=2, impl="mma")  # forward: 16 Q rows per warp
    # fewer rows than warps x 16: the extra warps only copy (and share dQ)
    assert KernelSpec(head_dim=64, block_r=16, block_c=16, num_warps=8).tile.block_c == 16


@pytest.mark.parametrize("arch", sorted(ARCH_SMEM_OPTIN))
@pytest.mark.parametrize("direction", ["bwd", "fwd"])
def test_every_head_dim_has_a_default_tile_that_fits(arch: str, direction: str) -> None:
    for d in range(HEAD_DIM_MIN, HEAD_DIM_MAX + 1, HEAD_DIM_MULTIPLE):
        spec = KernelSpec(direction=direction, head_dim=d, dtype="bfloat16", arch=arch, causal=True, dropout=True,
                          impl="mma")  # sm_90a: the Hopper family is preferred where it applies
        assert spec.smem_bytes <= ARCH_SMEM_OPTIN[arch]
        rows = spec.tile.block_c if direction == "bwd" else spec.tile.block_r
        assert rows <= 16 * spec.num_warps


@pytest.mark.parametrize("d", range(HEAD_DIM_MIN, HEAD_DIM_MAX + 1, HEAD_DIM_MULTIPLE))
def test_smem_rows_are_ldmatrix_conflict_free(d: int) -> None:
    """ldmatrix reads 8 rows of 16 bytes per phase: with a row stride of an odd number of 16-byte
    units those rows start in 8 different groups of 4 banks."""
    spec = KernelSpec(head_dim=d)
    ld = MMA.template_context(spec.family_spec)["strides"]["LD"]
    assert ld == padded_dim(d) + 8 and padded_dim(d) % 16 == 0 and padded_dim(d) >= d
    groups = {(r * ld * 2 // 16) % 8 for r in range(8)}
    assert len(groups) == 8
    layout = MMA.smem_layout(FamilySpec("bwd", d, "float16", "sm_90").with_tile(64, 64))
    ds_ld = 64 + 8  # dS^T rows: BLOCK_R + 8 elements
    assert {(r * ds_ld * 2 // 16) % 8 for r in range(8)} == set(range(8))
    assert all(b.offset % 16 == 0 for b in layout.buffers)  # cp.async / ldmatrix need 16-byte rows


# -------------------------------------------------------- dropout bit for bit
TILES = [dict(), dict(block_r=16, block_c=16, num_warps=1), dict(block_r=32, block_c=48, num_warps=4)]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "default" if not t else "br{block_r}bc{block_c}w{num_warps}".format(**t))
def test_forward_and_backward_apply_exactly_the_keep_mask(tiles: dict) -> None:
    """q = 0 makes P uniform; v = identity (Nk == d) makes O[b, i, h, j] = Z_ij / ((1 - p) Nk); dO =
    identity rows (Nq == d) make dV[b, j, h, i] = Z_ij / ((1 - p) Nk). Whatever the tiles."""
    B, H, N, d = 2, 2, 64, 64
    p, seed, offset = 0.3, 2**40 + 99, 2**33 + 5
    q = torch.zeros(B, N, H, d, dtype=torch.float16)
    k = torch.randn(B, N, H, d).half()
    eye = torch.eye(d, dtype=torch.float16).expand(B, H, d, d).permute(0, 2, 1, 3).contiguous()
    flags = dict(head_dim=d, dtype="float16", dropout=True, impl="mma", **tiles)
    kw = dict(dropout_p=p, seed=seed, offset=offset)
    o, lse = F.run_forward(KernelSpec(direction="fwd", **flags), q, k, eye, **kw)
    expected = F.dropout_keep_mask(B, H, N, N, p, seed=seed, offset=offset)
    assert torch.equal((o > 0).permute(0, 2, 1, 3), expected)
    kept = o[o > 0].float()
    assert torch.allclose(kept, torch.full_like(kept, 1.0 / ((1 - p) * N)), rtol=1e-3)
    _, _, dv = F.run_backward(KernelSpec(direction="bwd", **flags), eye, q, k, torch.randn_like(k), o, lse, **kw)
    assert torch.equal(dv.permute(0, 2, 3, 1) > 0, expected)


# ---------------------------------------------------------------- sanitizer
def _strides(name: str, t: torch.Tensor) -> dict:
    return {f"stride_{name}_b": t.stride(0), f"stride_{name}_s": t.stride(1), f"stride_{name}_h": t.stride(2)}


@pytest.fixture(scope="module")
def asan_problem():
    B, H, NQ, NK, D, P = 1, 2, 37, 29, 40, 0.2  # odd lengths, d padded to 48 inside the kernel
    g = torch.Generator().manual_seed(5)
    q, do = (torch.randn(B, NQ, H, D, generator=g).half() for _ in range(2))
    k, v = (torch.randn(B, NK, H, D, generator=g).half() for _ in range(2))
    mask = torch.rand(B, NK, generator=g) > 0.2
    kw = dict(key_padding_mask=mask, dropout_p=P, seed=11)
    flags = dict(head_dim=D, dtype="float16", causal=True, key_padding=True, dropout=True, impl="mma",
                 block_r=16, block_c=16, num_warps=2)  # several tiles per CTA, one idle warp
    o, lse = F.run_forward(KernelSpec(direction="fwd", **flags), q, k, v, **kw)
    grads = F.run_backward(KernelSpec(**flags), do, q, k, v, o, lse, **kw)
    common = {**neutral_args(heads=H, seqlen_q=NQ, null=None, direction="fwd"),
              "kpm": mask.numpy().astype(np.uint8), "heads": H, "seqlen_q": NQ, "seqlen_k": NK,
              "scale": D ** -0.5, "seed": 11, "offset": 0, "drop_threshold": drop_threshold(P),
              "rp_keep": 1.0 / (1.0 - P), **_strides("q", q), **_strides("k", k), **_strides("v", v)}
    return dict(B=B, H=H, NQ=NQ, NK=NK, D=D, flags=flags, q=q, k=k, v=v, do=do, o=o, lse=lse, grads=grads,
                common=common)


def _launch_main(spec: KernelSpec, args: dict, pb: dict, seqlen_k: int | None = None) -> dict:
    from fagen.emulator import run_sanitized
    from fagen.renderer import render

    r = render(spec)
    kern = r.kernel("main")
    grid = kern.grid(pb["B"], pb["H"], pb["NQ"], seqlen_k or pb["NK"])
    return run_sanitized(r.source, r.kernels, kern.name, grid, kern.block, kern.smem_bytes, args)


def test_forward_kernel_is_clean_under_asan(asan_problem) -> None:
    pb = asan_problem
    o = np.zeros(pb["q"].shape, np.float16)
    lse = np.zeros((pb["B"], pb["H"], pb["NQ"]), np.float32)
    args = {**pb["common"], "q": pb["q"].numpy(), "k": pb["k"].numpy(), "v": pb["v"].numpy(), "o": o, "lse": lse,
            **_strides("o", pb["o"])}
    _launch_main(KernelSpec(direction="fwd", **pb["flags"]), args, pb)
    np.testing.assert_array_equal(o, pb["o"].numpy())
    np.testing.assert_array_equal(lse, pb["lse"].numpy())


def test_backward_kernel_is_clean_under_asan_and_an_overrun_is_caught(asan_problem) -> None:
    from fagen.emulator import EmulatorMemoryError

    pb = asan_problem
    B, H, NQ, NK, D = pb["B"], pb["H"], pb["NQ"], pb["NK"], pb["D"]
    delta = (pb["do"].float() * pb["o"].float()).sum(-1).permute(0, 2, 1).contiguous()

    def args(seqlen_k: int) -> dict:
        return {**pb["common"], **neutral_args(heads=H, seqlen_q=NQ, null=None), "seqlen_k": seqlen_k, "q": pb["q"].numpy(), "k": pb["k"].numpy(), "v": pb["v"].numpy(),
                "do_": pb["do"].numpy(), "lse": pb["lse"].numpy(), "delta": delta.numpy(),
                "dq_accum": np.zeros((B, NQ, H, D), np.float32), "dk": np.zeros((B, NK, H, D), np.float16),
                "dv": np.zeros((B, NK, H, D), np.float16), **_strides("do", pb["do"]), **_strides("dk", pb["k"]),
                **_strides("dv", pb["v"])}

    spec = KernelSpec(**pb["flags"])
    out = _launch_main(spec, args(NK), pb)
    dq, dk, dv = pb["grads"]
    np.testing.assert_array_equal(out["dk"], dk.numpy())
    np.testing.assert_array_equal(out["dv"], dv.numpy())
    np.testing.assert_allclose(out["dq_accum"], dq.float().numpy(), rtol=2e-3, atol=2e-3)
    with pytest.raises(EmulatorMemoryError):  # lie about seqlen_k: keys past the end of k are read
        _launch_main(spec, args(NK + 40), pb, seqlen_k=NK + 40)


# ------------------------------------------------------------------ autotuner cost
@pytest.mark.parametrize("direction", ["bwd", "fwd"])
@pytest.mark.parametrize("d,block_r,block_c,num_warps", [(64, 64, 64, 4), (128, 64, 128, 8), (32, 128, 128, 8),
                                                         (96, 32, 32, 2)])
def test_pair_cost_counts_exactly_the_tile_pairs_flops(direction: str, d: int, block_r: int, block_c: int,
                                                       num_warps: int) -> None:
    """One m16n8k16 is 2 x 16 x 8 x 16 FLOPs: the pair's mma count is its FLOPs (2 matmuls forward,
    5 backward, of 2 B_r B_c d each) when d is a multiple of 16."""
    if direction == "fwd":
        block_r, block_c = block_c, block_r  # the forward's warps own Q rows
    spec = KernelSpec(direction=direction, head_dim=d, block_r=block_r, block_c=block_c, num_warps=num_warps)
    pc = MMA.pair_cost(spec.family_spec)
    matmuls = 5 if direction == "bwd" else 2
    assert pc.warp_iterations * 2 * 16 * 8 * 16 == matmuls * 2 * block_r * block_c * d
    assert pc.atomics == (block_r * d if direction == "bwd" else 0)
    assert pc.lds_wavefronts > 0 and pc.warp_instructions > pc.warp_iterations
    assert pc.warp_balance(num_warps) == pytest.approx(1.0, abs=0.2)
    if direction == "bwd":  # deterministic: main 4 GEMMs (no dQ) + dq kernel 3 (S, dP recomputed, dQ), no atomics
        det = MMA.pair_cost(spec.replace(deterministic=True).family_spec)
        assert det.warp_iterations * 2 * 16 * 8 * 16 == 7 * 2 * block_r * block_c * d
        assert det.atomics == 0 and det.warp_instructions > pc.warp_instructions


def test_pair_cost_sees_idle_warps() -> None:
    spec = KernelSpec(head_dim=64, block_r=64, block_c=16, num_warps=8)  # one warp owns all 16 K/V rows
    assert MMA.pair_cost(spec.family_spec).warp_balance(8) < 0.5


def test_unaligned_slices_fall_back_to_element_copies() -> None:
    """Rows that are not 16-byte aligned cannot go through cp.async: the kernels copy them element
    by element and compute exactly what the aligned layout gives."""
    torch.manual_seed(4)
    B, N, H, d = 2, 37, 3, 40
    # head stride d + 1 (82 bytes): every head but the first starts off a 16-byte boundary
    q, k, v, do = (t[..., :d] for t in (torch.randn(B, N, H, d + 1, dtype=torch.bfloat16) for _ in range(4)))
    assert q.stride(2) == d + 1
    flags = dict(head_dim=d, dtype="bfloat16", causal=True, impl="mma")
    fwd, bwd = KernelSpec(direction="fwd", **flags), KernelSpec(direction="bwd", **flags)
    o, lse = F.run_forward(fwd, q, k, v)
    grads = F.run_backward(bwd, do, q, k, v, o, lse)
    c = [t.contiguous() for t in (q, k, v, do)]
    o_c, lse_c = F.run_forward(fwd, *c[:3])
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c)
    for a, b in zip(grads, F.run_backward(bwd, c[3], *c[:3], o_c, lse_c)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("unaligned", ["k", "kv"])
@pytest.mark.parametrize("tile", [dict(), dict(block_r=128, block_c=128, num_warps=4)], ids=["16-row", "32-row"])
def test_forward_half_copies_fall_back_with_either_tensor_unaligned(unaligned: str, tile: dict) -> None:
    """Where half the threads copy K_j and half V_j (FWD_HALF_COPY), an unaligned K or V sends both
    through the element copies on every thread: the result is exactly the aligned layout's."""
    torch.manual_seed(6)
    B, N, H, d = 1, 150, 2, 64
    spec = KernelSpec(direction="fwd", head_dim=d, dtype="float16", impl="mma", causal=True, **tile)
    assert fwd_half_copy(d, spec.num_warps)
    q, k, v = (torch.randn(B, N, H, d, dtype=torch.float16) for _ in range(3))

    def off(t: torch.Tensor) -> torch.Tensor:  # head stride d + 1: every head but the first off 16 bytes
        buf = torch.zeros(B, N, H, d + 1, dtype=t.dtype)
        buf[..., :d] = t
        return buf[..., :d]

    k_u = off(k)
    v_u = off(v) if unaligned == "kv" else v
    o, lse = F.run_forward(spec, q, k_u, v_u)
    o_c, lse_c = F.run_forward(spec, q, k, v)
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c)


def test_forward_row_stride_past_the_32_bit_pass_step_takes_element_copies() -> None:
    """The forward's K/V cp.async paths address a thread's chunks in 32 bits off the tile's row 0
    (FwdTileCopy::vec_ok): a 16-byte-aligned row stride whose pass of ROW_STEP rows exceeds 2^31 - 1
    bytes (the K/V slices then span gigabytes: here 3 rows of one shared buffer) is copied with
    64-bit addressing and gives exactly the contiguous layout's result."""
    torch.manual_seed(5)
    d, n = 16, 3
    spec = KernelSpec(direction="fwd", head_dim=d, dtype="float16", impl="mma", block_r=128, block_c=128, num_warps=8)
    threads = 32 * spec.num_warps // (2 if fwd_half_copy(d, spec.num_warps) else 1)  # a tensor's copying threads
    row_step = threads // (d // 8)  # 64 rows a pass (half the threads copy K_j, half V_j)
    stride = ((2**31 - 1) // (row_step * 2) // 8 + 1) * 8  # the least multiple of 8 elements past the limit
    assert stride * row_step * 2 > 2**31 - 1 and stride % 8 == 0
    q = torch.randn(1, n, 1, d, dtype=torch.float16)
    buf = torch.empty(stride * (n - 1) + d, dtype=torch.float16)
    k, v = (torch.as_strided(buf, (1, n, 1, d), (0, stride, d, 1)) for _ in range(2))
    k_c, v_c = torch.randn(1, n, 1, d, dtype=torch.float16), torch.randn(1, n, 1, d, dtype=torch.float16)
    k_buf = buf.clone()
    torch.as_strided(k_buf, (1, n, 1, d), (0, stride, d, 1)).copy_(k_c)
    torch.as_strided(buf, (1, n, 1, d), (0, stride, d, 1)).copy_(v_c)
    k = torch.as_strided(k_buf, (1, n, 1, d), (0, stride, d, 1))
    assert k.stride(1) == stride and torch.equal(k, k_c) and torch.equal(v, v_c)
    o, lse = F.run_forward(spec, q, k, v)
    o_c, lse_c = F.run_forward(spec, q, k_c, v_c)
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c)


@pytest.mark.parametrize("dtype,causal,p", [("float16", True, 0.0), ("bfloat16", False, 0.2)])
def test_gqa_through_the_mma_kernels(dtype: str, causal: bool, p: float) -> None:
    """k, v with fewer heads (GQA): the forward reads K/V head h / (H / H_kv); the backward CTA of a
    K/V head sums dK, dV over its q-head group. Judged like the numerics suite (flash-attn criterion)."""
    from fagen import reference as R
    from numerics import ATOL

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(8)
    B, Nq, Nk, H, Hk, d = 2, 37, 45, 6, 2, 64
    q, do = (torch.randn(B, Nq, H, d, generator=g).to(dt) for _ in range(2))
    k, v = (torch.randn(B, Nk, Hk, d, generator=g).to(dt) for _ in range(2))
    mask = torch.rand(B, Nk, generator=g) > 0.3
    kw = dict(causal=causal, key_padding_mask=mask, dropout_p=p, seed=3)
    assert F.spec_for("fwd", F.validate_qkv(q, k, v), causal=causal, key_padding=True, dropout=p > 0).impl == "mma"
    o, lse = F.attention_forward(q, k, v, **kw)
    grads = F.attention_backward(do, q, k, v, o, lse, **kw)
    keep = F.dropout_keep_mask(B, H, Nq, Nk, p, seed=3) if p else None
    rkw = dict(causal=causal, key_padding_mask=mask, keep_mask=keep, dropout_p=p)
    o64, lse64 = R.attention_forward_ref(q, k, v, **rkw)
    ref = (o64, *R.attention_backward_ref(do, q, k, v, o64, lse64, **rkw))
    qt, kt, vt = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ot = R.attention_ref_torch(qt, kt, vt, **rkw)
    ot.backward(do)
    base = (ot.detach(), qt.grad, kt.grad, vt.grad)
    atol = ATOL[dtype] * max(1.0, max(b.abs().max().item() for b in ref))
    for name, ours, pt, r in zip(("o", "dq", "dk", "dv"), (o, *grads), base, ref):
        assert ours.shape == r.shape
        e_ours, e_pt = (ours.double() - r).abs().max().item(), (pt.double() - r).abs().max().item()
        assert e_ours <= 2 * e_pt + atol, f"{name}: {e_ours:.3g} > 2 x {e_pt:.3g} + {atol:.2g}"


# ------------------------------------------------------------------ features
MMA_FEATURE_CASES = [  # the spec features the family lists and GQA, fp16/bf16 only
    ("gqa-causal-fp16", dict(heads=6, heads_kv=2, seqlen_q=37, seqlen_k=61, causal=True, tile=(16, 16, 1))),
    ("mqa-window-bf16", dict(dtype="bfloat16", batch=1, heads=4, heads_kv=1, seqlen_q=45, seqlen_k=33, head_dim=40,
                             window=(9, 4), tile=(16, 16, 2))),
    ("window-causal-nq>nk-fp16", dict(seqlen_q=50, seqlen_k=29, window=(6, -1), causal=True, tile=(16, 16, 1))),
    ("topleft-causal-nq<nk-bf16", dict(dtype="bfloat16", seqlen_q=29, seqlen_k=50, head_dim=16, causal=True,
                                       align="top_left")),
    ("topleft-causal-nq>nk-fp16", dict(seqlen_q=50, seqlen_k=29, head_dim=16, causal=True, align="top_left")),
    ("gqa-window-dropout-bf16", dict(dtype="bfloat16", heads=4, heads_kv=2, seqlen_q=130, seqlen_k=150, head_dim=64,
                                     causal=True, window=(40, -1), dropout_p=0.2)),
    ("d256-gqa-window-fp16", dict(batch=1, heads=2, heads_kv=1, seqlen_q=20, seqlen_k=33, head_dim=256, causal=True,
                                  window=(12, -1))),
    # score modifications (softcap, ALiBi, bias) on the fp32 accumulator, dBias = dS
    ("bias-1hqk-grad-fp16", dict(bias=(1, 4, 37, 45))),
    ("bias-b11k-grad-bf16", dict(dtype="bfloat16", bias=(2, 1, 1, 45), tile=(16, 16, 1))),
    ("softcap-alibi-bias-gqa-causal-kpad-fp16", dict(heads=4, heads_kv=2, seqlen_q=50, seqlen_k=61, head_dim=64,
                                                     causal=True, softcap=4.0, alibi="bh", bias=(1, 4, 50, 61),
                                                     q_scale=2.0, tile=(16, 16, 1))),
    ("combo-window-softcap-alibi-dropout-bf16", dict(dtype="bfloat16", heads=4, heads_kv=2, seqlen_q=41, seqlen_k=70,
                                                     causal=True, window=(20, -1), softcap=4.0, alibi="h",
                                                     dropout_p=0.2, q_scale=2.0, tile=(16, 16, 2))),
    # varlen: packed sequences (lengths 0 and 1 included); blocks past a sequence's length return
    ("varlen-gqa-causal-window-softcap-dropout-fp16", dict(heads=4, heads_kv=2, causal=True, window=(11, -1),
                                                          softcap=4.0, dropout_p=0.25, q_scale=2.0, tile=(16, 16, 1),
                                                          lens=((13, 20), (0, 5), (1, 1), (40, 33), (7, 0), (17, 17)))),
    ("varlen-alibi-causal-bf16", dict(dtype="bfloat16", heads=2, heads_kv=1, head_dim=64, alibi="bh", causal=True,
                                      lens=((40, 45), (3, 17), (25, 2)))),
    ("d128-softcap-bias-grad-topleft-fp16", dict(batch=1, heads=2, heads_kv=2, seqlen_q=70, seqlen_k=40, head_dim=128,
                                                 causal=True, align="top_left", softcap=3.0, bias=(1, 2, 70, 40))),
    # bool attn_mask with broadcast strides (per element; no tile is fully visible with it)
    ("mask-b1qk-causal-fp16", dict(mask=(2, 1, 37, 45), causal=True, tile=(16, 16, 1))),
    ("mask-1h1k-gqa-bf16", dict(dtype="bfloat16", heads=4, heads_kv=2, mask=(1, 4, 1, 45))),
    ("mask-softcap-alibi-bias-dropout-fp16", dict(head_dim=64, mask=(2, 1, 37, 45), softcap=4.0, alibi="h",
                                                  bias=(1, 4, 37, 45), dropout_p=0.2, q_scale=2.0, tile=(16, 16, 2))),
    ("d128-mask-window-dropout-bf16", dict(dtype="bfloat16", batch=1, heads=2, heads_kv=2, head_dim=128,
                                           mask=(1, 2, 1, 45), window=(15, 3), dropout_p=0.2)),
]


@pytest.mark.parametrize("name,kw", MMA_FEATURE_CASES, ids=[n for n, _ in MMA_FEATURE_CASES])
def test_features_through_the_mma_kernels(name: str, kw: dict) -> None:
    """Sliding window, top-left causal alignment and GQA/MQA on the mma kernels, judged by the
    feature suite's harness (float64 reference, flash-attn's criterion, fully masked rows zero)."""
    from feature_harness import FeatCase, check_case

    check_case(FeatCase(f"mma-{name}", **kw), "mma")


def test_features_without_an_mma_path_fall_back_to_simt() -> None:
    assert {"window", "top_left", "softcap", "alibi", "attn_mask", "bias", "bias_grad", "varlen",
            "deterministic"} <= MMA.features
    assert KernelSpec(head_dim=64, window=True, causal_align="top_left").impl == "mma"
    assert KernelSpec(head_dim=64, softcap=True, alibi=True, bias=True, bias_grad=True).impl == "mma"
    assert KernelSpec(head_dim=64, attn_mask=True).impl == "mma"
    assert KernelSpec(head_dim=64, deterministic=True).impl == "mma"
    assert KernelSpec(head_dim=64, dtype="float32", deterministic=True).impl == "simt"
    with pytest.raises(ValidationError, match="float64"):
        KernelSpec(head_dim=64, dtype="float64", impl="mma")


# ------------------------------------------------------------------ deterministic backward
MMA_DET_CASES = [  # the dq kernel: head dims 59/111/128/256, every feature, passes and pipeline variants
    ("d59-gqa-causal-fp16", dict(heads=4, heads_kv=2, seqlen_q=19, seqlen_k=23, head_dim=59, causal=True)),
    ("d111-window-bf16", dict(dtype="bfloat16", batch=1, heads=2, heads_kv=2, seqlen_q=17, seqlen_k=30, head_dim=111,
                              window=(8, 8))),
    ("d128-causal-dropout-fp16", dict(batch=1, heads=2, heads_kv=2, seqlen_q=40, seqlen_k=70, head_dim=128,
                                      causal=True, dropout_p=0.2)),
    ("d256-gqa-window-fp16", dict(batch=1, heads=2, heads_kv=1, seqlen_q=20, seqlen_k=33, head_dim=256, causal=True,
                                  window=(12, -1))),
    ("varlen-gqa-window-causal-dropout-softcap-fp16",
     dict(heads=4, heads_kv=2, causal=True, window=(11, -1), softcap=4.0, dropout_p=0.25, q_scale=2.0,
          tile=(32, 32, 2), lens=((13, 20), (0, 5), (1, 1), (70, 53), (7, 0), (17, 17)))),
    # block_c > block_r: one K/V stage; attn_mask with every score modification, dBias by the main kernel
    ("mask-softcap-alibi-bias-dropout-1stage-bf16",
     dict(dtype="bfloat16", head_dim=64, mask=(2, 1, 37, 45), softcap=4.0, alibi="bh", bias=(1, 4, 37, 45),
          dropout_p=0.2, q_scale=2.0, tile=(16, 32, 2))),
    ("topleft-causal-nq>nk-fp16", dict(seqlen_q=50, seqlen_k=29, head_dim=40, causal=True, align="top_left",
                                       tile=(32, 16, 2))),
]


@pytest.mark.parametrize("name,kw", MMA_DET_CASES, ids=[n for n, _ in MMA_DET_CASES])
def test_deterministic_backward_through_the_mma_kernels(name: str, kw: dict) -> None:
    """The deterministic backward (dq kernel with Q outer, no dQ atomics) on the mma kernels, judged
    by the feature suite's harness (float64 reference, flash-attn's criterion, fully masked rows zero)."""
    from feature_harness import FeatCase, check_case, specs

    case = FeatCase(f"mma-det-{name}", deterministic=True, **kw)
    assert [k.role.name for k in render(specs(case, "mma")[1]).kernels] == ["pre", "main", "dq", "post"]
    check_case(case, "mma")


def test_deterministic_dq_is_bitwise_independent_of_the_pipeline_and_dk_dv_of_the_mode() -> None:
    """The dq kernel's summation order is fixed by the code: one or two cp.async stages, and a Q block
    of 64 rows taken in two passes of 32 (2 warps) instead of one of 32, give the same dQ bits; dK/dV
    come from the same main kernel arithmetic with or without the deterministic dq pass."""
    g = torch.Generator().manual_seed(5)
    B, Nq, Nk, H, Hk, d = 2, 45, 77, 4, 2, 48
    q, do = (torch.randn(B, Nq, H, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(B, Nk, Hk, d, generator=g).half() for _ in range(2))
    mask = torch.rand(B, Nk, generator=g) > 0.2
    kw = dict(causal=True, key_padding_mask=mask, dropout_p=0.1, seed=9)
    base = dict(head_dim=d, causal=True, key_padding=True, dropout=True, block_r=32, block_c=32, num_warps=2,
                impl="mma")
    o, lse = F.run_forward(KernelSpec(direction="fwd", **base), q, k, v, **kw)
    det = [F.run_backward(KernelSpec(deterministic=True, knobs={"stages": s}, **base), do, q, k, v, o, lse, **kw)
           for s in (1, 2)]
    two_pass = F.run_backward(KernelSpec(deterministic=True, **{**base, "block_r": 64}), do, q, k, v, o, lse, **kw)
    atomic = F.run_backward(KernelSpec(**base), do, q, k, v, o, lse, **kw)
    assert torch.equal(det[0][0].view(torch.int16), two_pass[0].view(torch.int16))
    for name, a, b, c in zip(("dq", "dk", "dv"), det[0], det[1], atomic):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
        if name != "dq":
            assert torch.equal(a.view(torch.int16), c.view(torch.int16)), name
    torch.testing.assert_close(det[0][0], atomic[0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("d", [112, 128])
def test_attn_mask_with_a_score_modification_declines_past_the_register_budget(d: int) -> None:
    """The backward's dK~/dV~ accumulators (padded_dim registers) plus the masked score step pass the
    launch bounds' register budget: impl=None takes SIMT, impl="mma" says why; the forward, the
    mask alone, and head dims whose accumulators live in smem stay on mma."""
    from fagen.autotune.candidates import enumerate_candidates
    from fagen.families.mma import MASKED_SCORE_MOD_STEP_REGS

    assert padded_dim(d) + MASKED_SCORE_MOD_STEP_REGS > MMA.min_regs_per_thread
    spec = KernelSpec(head_dim=d, attn_mask=True, softcap=True)
    assert spec.impl == "simt"
    mma_cands = [c for c in enumerate_candidates(spec, sizes=(16, 64), warps=(4,)) if c.impl == "mma"]
    assert mma_cands and all(c.status == "rejected" and "attn_mask with softcap" in c.reason for c in mma_cands)
    with pytest.raises(ValidationError, match="attn_mask with softcap/alibi/bias"):
        KernelSpec(head_dim=d, attn_mask=True, bias=True, impl="mma")
    assert KernelSpec(head_dim=d, attn_mask=True, dropout=True, window=True).impl == "mma"
    assert KernelSpec(direction="fwd", head_dim=d, attn_mask=True, softcap=True, alibi=True).impl == "mma"
    assert KernelSpec(head_dim=256, attn_mask=True, softcap=True).impl == "mma"
    assert KernelSpec(head_dim=96, attn_mask=True, softcap=True, alibi=True, bias=True).impl == "mma"



@pytest.mark.parametrize("d,block_c,keys", [(64, 128, 64), (64, 48, 48), (128, 128, 64), (96, 96, 48), (256, 32, 32),
                                            (256, 48, 16), (192, 48, 48), (128, 80, 16)])
def test_dq_key_sub_step(d: int, block_c: int, keys: int) -> None:
    """The dq kernel's key sub-step: at most 64 keys, a multiple of 16 dividing block_c, S/dP plus the
    dQ accumulator within DQ_FRAG_REGS registers; the family emits it (DQ_KC) and the template
    static_asserts the rule's bounds (so every compile checks it)."""
    from fagen.families.mma import dq_key_chunk

    assert dq_key_chunk(d, block_c) == keys
    spec = KernelSpec(head_dim=d, block_r=16, block_c=block_c, num_warps=8, deterministic=True, impl="mma",
                      arch="sm_90")
    assert template_context(spec)["DQ_KC"] == keys


def test_deterministic_dq_keeps_the_nan_and_zero_semantics() -> None:
    """NaN in a q row poisons that row's dQ, NaN in a key the dQ of the rows that attend to it; a
    padded key holding NaN poisons nothing and rows with no allowed key stay exactly zero: the dq
    kernel gives the atomic backward's NaN pattern and agrees with it elsewhere."""
    g = torch.Generator().manual_seed(12)
    B, Nq, Nk, H, d = 1, 40, 29, 2, 32
    q, do = (torch.randn(B, Nq, H, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(B, Nk, H, d, generator=g).half() for _ in range(2))
    mask = torch.ones(B, Nk, dtype=torch.bool)
    mask[0, 3] = False
    k[0, 3, 0, 5] = float("nan")  # padded: takes no part
    k[0, 20, 1, 0] = float("nan")  # attended by the rows of head 1 that see key 20 (causal, bottom-right)
    q[0, 30, 0, 7] = float("nan")
    kw = dict(causal=True, key_padding_mask=mask)
    base = dict(head_dim=d, causal=True, key_padding=True, block_r=16, block_c=16, num_warps=1, impl="mma")
    o, lse = F.run_forward(KernelSpec(direction="fwd", **base), q, k, v, **kw)
    det = F.run_backward(KernelSpec(deterministic=True, **base), do, q, k, v, o, lse, **kw)[0]
    atomic = F.run_backward(KernelSpec(**base), do, q, k, v, o, lse, **kw)[0]
    nan = torch.isnan(det)
    assert torch.equal(nan, torch.isnan(atomic))
    rows_nan = nan.any(-1)[0]  # [Nq, H]
    # (a NaN k_j also reaches the dQ of rows of its tile that do not attend to it, through dS K's
    # 0 * NaN, as in plain PyTorch's dS @ K; the padded key's NaN reaches nothing)
    assert rows_nan[30, 0] and rows_nan[Nq - Nk + 20:, 1].all()
    assert not rows_nan[:30, 0].any() and not rows_nan[31:, 0].any()
    dead = torch.isinf(lse[0]).transpose(0, 1)  # [Nq, H]: rows before the causal band
    assert dead.any() and (det[0][dead] == 0).all()
    torch.testing.assert_close(det[~nan], atomic[~nan], rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------- forward softmax scale, 32-row warps
def _fwd_fs(d: int, block_r: int, block_c: int, num_warps: int) -> FamilySpec:
    return FamilySpec("fwd", d, "float16", "sm_90", tile=Tile(block_r, block_c), num_warps=num_warps)


@pytest.mark.parametrize("tile", [(16, 16, 1), (32, 16, 1), (64, 32, 2)], ids=lambda t: "t{}x{}w{}".format(*t))
@pytest.mark.parametrize("scale", [0.3, -0.3, 0.0, 1e-40])
def test_forward_softmax_scale_of_any_sign_and_32_row_warps(scale: float, tile: tuple) -> None:
    """The forward folds |scale| log2 e into its exp2 and takes the max of the raw q.k: a negative
    scale negates Q_i in smem (exact), a zero or subnormal one multiplies the scores instead. Each is
    against the float64 oracle by flash-attn's criterion, on 16-row warps and on 32-row warps (two
    m16 tiles per warp: block_r = 32 x num_warps), with key padding and causal edge tiles."""
    from featref import assert_close, assert_lse_close
    from featref import attention as oracle

    g = torch.Generator().manual_seed(7)
    B, H, Nq, Nk, d = 2, 2, 45, 37, 40
    q, k, v = (torch.randn(B, n, H, d, generator=g).to(torch.float16) for n in (Nq, Nk, Nk))
    kpm = torch.rand(B, Nk, generator=g) > 0.25
    kpm[:, 0] = True
    spec = KernelSpec(direction="fwd", head_dim=d, dtype="float16", causal=True, key_padding=True, impl="mma",
                      block_r=tile[0], block_c=tile[1], num_warps=tile[2])
    assert MMA.config_reason(_fwd_fs(d, *tile)) is None
    o, lse = F.run_forward(spec, q, k, v, key_padding_mask=kpm, softmax_scale=scale)
    kw = dict(causal=True, kpm=kpm, scale=scale)
    o64, lse64 = oracle(q.double(), k.double(), v.double(), **kw)
    o16, _ = oracle(q, k, v, **kw)
    _, lse32 = oracle(q.float(), k.float(), v.float(), **kw)
    assert_close(f"o scale={scale}", o, o64, o16, torch.float16)
    assert_lse_close(f"lse scale={scale}", lse, lse64, lse32)


def test_forward_32_row_warps_are_accepted_up_to_head_dim_128() -> None:
    """32 Q rows per warp (a multiple of 32 up to 32 x num_warps) up to padded head dim 128; beyond it,
    or for a block that is not a whole number of 32-row warps, block_r is refused by name."""
    assert MMA.config_reason(_fwd_fs(128, 128, 64, 4)) is None
    for d, br, w in ((136, 128, 4), (64, 96, 2), (64, 80, 4)):
        bad = MMA.config_reason(_fwd_fs(d, br, 32, w))
        assert bad is not None and bad.field == "block_r", (d, br, w, bad)


@pytest.mark.parametrize("arch,d,flags,tile,q_regs", [
    ("sm_90", 64, {}, (128, 256, 8), False),  # 256 keys a step (rules.fwd_widest_step): Q from smem beside S
    ("sm_90", 64, {"causal": True}, (128, 256, 8), False),
    ("sm_90", 32, {"causal": True, "varlen": True}, (128, 256, 8), False),
    ("sm_90", 64, {"causal": True, "window": True}, (128, 128, 8), True),  # a window's two bounds: 128 keys
    ("sm_90", 32, {"window": True}, (128, 128, 8), True),
    ("sm_80", 64, {}, (128, 256, 8), False),  # 162 KiB with two stages: sm_80's 163 KiB holds it
    ("sm_86", 64, {}, (128, 128, 8), True),  # 99 KiB: the 256-key tile does not fit, 128 keys
    ("sm_100", 64, {}, (128, 128, 8), True),  # ptxas spills the 256-key step on sm_100 / sm_120
    ("sm_90", 64, {"dropout": True}, (64, 128, 4), True),  # per-element state: 16-row warps, 4 of them
    ("sm_90", 64, {"key_padding": True}, (64, 128, 4), False),  # a data mask reads Q from smem
    ("sm_90", 64, {"causal": True, "window": True, "varlen": True}, (128, 128, 8), True),
    ("sm_90", 64, {"bias": True}, (64, 64, 4), True),  # a bias steps 64 keys up to d = 96
    ("sm_90", 128, {}, (128, 128, 8), False),  # Q, S and O of 128 keys: Q from smem
    ("sm_80", 128, {}, (64, 128, 4), False),  # a 128-row block of 128 keys exceeds sm_80's shared memory
    ("sm_80", 128, {"attn_mask": True}, (64, 64, 4), False),
    ("sm_90", 96, {}, (128, 128, 8), False),
    ("sm_90", 192, {}, (128, 64, 8), False),
    ("sm_90", 256, {"dropout": True}, (64, 32, 4), False),
])
def test_forward_default_tiles(arch: str, d: int, flags: dict, tile: tuple, q_regs: bool) -> None:
    """The forward's default tile and warps per head dim, arch and features (fagen.families.mma.rules:
    fwd_widest_step, fwd_default_block_c, fwd_q_in_regs; MmaFamily.default_warps), as
    docs/performance.md measures them."""
    spec = KernelSpec(direction="fwd", head_dim=d, dtype="float16", arch=arch, **flags)
    assert spec.impl == "mma" and (spec.tile.block_r, spec.tile.block_c, spec.num_warps) == tile
    consts = {c.name: c.value for c in MMA.template_context(spec.family_spec)["constants"]}
    assert consts["WARP_M_TILES"] == tile[0] // (16 * tile[2])
    config = MMA.codegen_config(spec.family_spec)  # the rule is the starting point; a searched class takes its table's
    assert bool(next(k.start for k in config.knobs if k.name == "fwd_q_in_regs")) is q_regs
    assert consts["Q_IN_REGS"] is bool(config.value("fwd_q_in_regs"))
    assert consts["FWD_HALF_STEP"] is (tile[1] > 128)


@pytest.mark.parametrize("d,block_r,block_c,num_warps", [(64, 128, 64, 4), (128, 64, 32, 2), (32, 128, 128, 4)])
def test_pair_cost_of_32_row_forward_warps(d: int, block_r: int, block_c: int, num_warps: int) -> None:
    """The cost model counts the forward's 32-row warps: the pair's FLOPs in HMMAs, every warp busy,
    each warp's K/V fragments shared by its two m16 tiles (fewer ldmatrix per HMMA than 16-row warps)."""
    spec = KernelSpec(direction="fwd", head_dim=d, block_r=block_r, block_c=block_c, num_warps=num_warps)
    pc = MMA.pair_cost(spec.family_spec)
    assert pc.warp_iterations * 2 * 16 * 8 * 16 == 2 * 2 * block_r * block_c * d
    assert pc.warp_balance(num_warps) == 1.0
    narrow = MMA.pair_cost(spec.replace(num_warps=2 * num_warps).family_spec)  # the same block, 16-row warps
    assert narrow.warp_iterations == pc.warp_iterations
    assert pc.lds_wavefronts < narrow.lds_wavefronts


# ------------------------------------------------------------------ the forward's 256-key step
WIDEST_CASES = [  # d <= 64 at the default 128 x 256 / 8-warp forward: whole steps, half steps, both mask paths
    ("plain-two-steps-fp16", "sm_90", 2, dict(batch=1, heads=2, heads_kv=2, seqlen_q=150, seqlen_k=400, head_dim=64)),
    ("causal-diagonal-halves-bf16", "sm_80", 2, dict(dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=260,
                                                     seqlen_k=270, head_dim=64, causal=True)),
    ("topleft-dead-rows-fp16", "sm_90", 1, dict(batch=1, heads=1, heads_kv=1, seqlen_q=300, seqlen_k=140, head_dim=48,
                                                causal=True, align="top_left")),
    ("gqa-three-steps-fp16", "sm_80", 1, dict(batch=1, heads=4, heads_kv=2, seqlen_q=130, seqlen_k=600,
                                              head_dim=64)),
    ("varlen-causal-bf16", "sm_90", 2, dict(dtype="bfloat16", heads=2, heads_kv=1, head_dim=32, causal=True,
                                            lens=((70, 130), (0, 5), (1, 1), (140, 300), (129, 129)))),
    ("block-c-192-causal-fp16", "sm_90", 2, dict(batch=1, heads=2, heads_kv=2, seqlen_q=200, seqlen_k=300, head_dim=64,
                                                 causal=True)),  # an explicit 128 x 192 forward: 96-key half steps
]
#: Forward tiles set explicitly by a case (the backward keeps its default).
WIDEST_FWD_TILES = {"block-c-192-causal-fp16": dict(block_r=128, block_c=192, num_warps=8)}


@pytest.mark.parametrize("name,arch,stages,kw", WIDEST_CASES, ids=[c[0] for c in WIDEST_CASES])
def test_forward_widest_step(name: str, arch: str, stages: int, kw: dict) -> None:
    """The default d <= 64 forward steps 256 keys (rules.fwd_widest_step) and a block's last step over
    the tile's first half alone where that covers its keys (FWD_HALF_STEP): sequences of one and two
    whole steps, causal diagonals ending in either half, fully masked rows, GQA, packed sequences
    of lengths 0, 1 and just past half a tile, judged by the feature suite's harness (float64
    reference, flash-attn's criterion, fully masked rows zero)."""
    from feature_harness import FeatCase, check_case

    made = check_case(FeatCase(f"mma-widest-{name}", **kw), "mma", extra={"arch": arch, "knobs": {"stages": stages}},
                      fwd_extra=WIDEST_FWD_TILES.get(name, {}))
    fwd = [s for s in made if s.direction == "fwd"]
    want = WIDEST_FWD_TILES.get(name, {}).get("block_c", 256)
    assert fwd and all(s.tile.block_c == want and template_context(s)["FWD_HALF_STEP"] is True
                       for s in fwd), [s.name for s in fwd]


def test_forward_steps_past_128_keys_only_without_dropout() -> None:
    """block_c past 128: the forward's limit is 256 in multiples of 32 (its half step is whole k16 chunks),
    but not with dropout (its keep bits of a fragment row pair take 64 bits) and not in the backward
    (16 K/V rows per warp); refused naming block_c."""
    assert MMA.config_reason(_fwd_fs(64, 128, 256, 8)) is None
    assert MMA.config_reason(_fwd_fs(64, 128, 192, 8)) is None
    for spec in (dataclasses.replace(_fwd_fs(64, 128, 256, 8), flags=frozenset({"dropout"})), _fwd_fs(64, 128, 272, 8),
                 _fwd_fs(64, 128, 144, 8)):
        bad = MMA.config_reason(spec)
        assert bad is not None and bad.field == "block_c", (spec, bad)
    with pytest.raises(ValidationError, match="block_c=256 must be at most 128") as e:
        KernelSpec(direction="bwd", head_dim=64, block_r=64, block_c=256, num_warps=8, impl="mma")
    assert e.value.errors()[0]["loc"] == ("block_c",)
    with pytest.raises(ValidationError, match="dropout keep bits") as e:
        KernelSpec(direction="fwd", head_dim=64, block_r=128, block_c=256, num_warps=8, dropout=True, impl="mma")
    assert e.value.errors()[0]["loc"] == ("block_c",)


# ------------------------------------------------------------------ the two-dimensional backward
TWO_D_CASES = [  # d = 128 at the 64 x 128 / 8-warp tile (the default with two stages): FlashAttention-2's layout
    ("plain-odd-fp16", dict(batch=1, heads=2, heads_kv=2, seqlen_q=150, seqlen_k=200, head_dim=128)),
    ("causal-dead-rows-bf16", dict(dtype="bfloat16", batch=1, heads=2, heads_kv=2, seqlen_q=200, seqlen_k=130,
                                   head_dim=128, causal=True)),
    ("gqa-window-fp16", dict(batch=1, heads=4, heads_kv=2, seqlen_q=100, seqlen_k=160, head_dim=128, window=(40, 10))),
    ("topleft-causal-bf16", dict(dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=90, seqlen_k=140,
                                 head_dim=128, causal=True, align="top_left")),
    ("varlen-causal-bf16", dict(dtype="bfloat16", heads=2, heads_kv=1, head_dim=128, causal=True,
                                lens=((70, 130), (0, 5), (1, 1), (140, 60)))),
]


@pytest.mark.parametrize("arch,stages", [("sm_90", 2), ("sm_80", 2), ("sm_90", 1)],
                         ids=["sm90", "sm80-one-dO-buffer", "one-stage"])
@pytest.mark.parametrize("name,kw", TWO_D_CASES, ids=[n for n, _ in TWO_D_CASES])
def test_two_dimensional_backward_layout(name: str, kw: dict, arch: str, stages: int) -> None:
    """The d = 128 backward in FlashAttention-2's warp layout (P and dS through shared memory; on sm_80 one
    dO_i buffer, the next copied after dV~; one cp.async stage): odd and unequal lengths, causal with
    fully masked rows, windows, top-left alignment, GQA and packed sequences, judged by the feature
    suite's harness (float64 reference, flash-attn's criterion, fully masked rows zero)."""
    from feature_harness import FeatCase, check_case

    made = check_case(FeatCase(f"mma-2d-{name}", tile=(64, 128, 8), **kw), "mma",
                      extra={"arch": arch, "knobs": {"stages": stages}})
    bwd = [s for s in made if s.direction == "bwd"]
    assert bwd and all(template_context(s)["BWD_2D"] is True for s in bwd), \
        [s.name for s in bwd]


PIN_CASES = [  # d = 64 on sm_80 at the default 128 x 128 / 8-warp tile: the lanes' offsets pinned (BWD_PIN)
    ("plain-odd-fp16", dict(batch=1, heads=2, heads_kv=2, seqlen_q=150, seqlen_k=200, head_dim=64)),
    ("causal-dead-rows-bf16", dict(dtype="bfloat16", batch=1, heads=2, heads_kv=2, seqlen_q=200, seqlen_k=130,
                                   head_dim=64, causal=True)),
    ("gqa-window-fp16", dict(batch=1, heads=4, heads_kv=2, seqlen_q=100, seqlen_k=160, head_dim=64, window=(40, 10))),
    ("topleft-causal-bf16", dict(dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=90, seqlen_k=140,
                                 head_dim=64, causal=True, align="top_left")),
]


@pytest.mark.parametrize("name,kw", PIN_CASES, ids=[n for n, _ in PIN_CASES])
def test_pinned_backward_lane_offsets(name: str, kw: dict) -> None:
    """The d = 64 backward on sm_80 with its lane offsets and dS^T pointer pinned (fa_pin: a shuffle from
    the lane itself) gives the same gradients as the float64 reference by the feature suite's criterion:
    odd and unequal lengths, causal with fully masked rows, a window with GQA, top-left alignment."""
    from feature_harness import FeatCase, check_case

    made = check_case(FeatCase(f"mma-pin-{name}", tile=(128, 128, 8), **kw), "mma", extra={"arch": "sm_80"})
    bwd = [s for s in made if s.direction == "bwd"]
    assert bwd and all(template_context(s)["BWD_PIN"] is True for s in bwd), [s.name for s in bwd]


@pytest.mark.parametrize("arch,do_stages", [("sm_80", 1), ("sm_90", 2), ("sm_100", 2)])
def test_two_dimensional_backward_is_the_d128_default(arch: str, do_stages: int) -> None:
    """The default d = 128 backward takes the two-dimensional layout where its 64 x 128 / 8-warp tile fits
    (sm_80: one dO_i buffer beside P and dS in 163 KiB; sm_90+: two); other head dims, per-element
    features and archs whose shared memory holds no 128-key block keep 16 K/V rows per warp."""
    from fagen.families.mma import rules

    for dtype in ("float16", "bfloat16"):
        for flags in ({}, {"causal": True}, {"window": True}, {"varlen": True}):
            spec = KernelSpec(direction="bwd", head_dim=128, dtype=dtype, arch=arch, **flags)
            assert (spec.tile.block_r, spec.tile.block_c, spec.num_warps) == rules.BWD_2D_TILE
            ctx = template_context(spec)
            assert ctx["BWD_2D"] is True and ctx["DO_STAGES"] == do_stages
            assert spec.smem_bytes <= ARCH_SMEM_OPTIN[arch]
    for fields in (dict(head_dim=96), dict(head_dim=64), dict(head_dim=128, dropout=True),
                   dict(head_dim=128, key_padding=True), dict(head_dim=128, deterministic=True),
                   dict(head_dim=128, softcap=True), dict(head_dim=128, arch="sm_86")):
        spec = KernelSpec(direction="bwd", dtype="float16", **{"arch": arch, **fields})
        if spec.impl == "mma":
            assert template_context(spec)["BWD_2D"] is False, spec.name
