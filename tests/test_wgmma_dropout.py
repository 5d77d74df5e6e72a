"""The Hopper family (``wgmma``, sm_90a) with dropout (templates/wgmma/dropout.cuh: partials/philox.cuh's
stream, one Philox call per four accumulator elements): selection and register bounds; the keep mask
both directions apply is ``dropout_keep_mask`` bit for bit (GQA, Nq != Nk, seed and offset past 2**32,
ring-step row / column offsets, fp16 / bf16) and the ``mma`` family's on sm_90; both directions on the
CPU emulator against the float64 oracle with the same keep mask (flash-attn's criterion: causal of both
alignments, a window, key padding, softcap, ALiBi, sinks, a v head dim of its own, lengths off the tiles,
rows with no key); p = 0 through a dropout spec is the plain kernel's output bit for bit; racecheck and
AddressSanitizer of a backward (clean, bit-identical) and one forward / backward pair at the PTX level
(opt-in, FAGEN_TEST_SLOW=1). Sweeps past the first case of each direction are in the slow tier."""
from __future__ import annotations

import re

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen.runtime import cpu

import wgmma_cases as W


# --------------------------------------------------------------------------- selection
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_dropout_resolves_to_wgmma(direction) -> None:
    for kw in (dict(), dict(causal=True, key_padding=True), dict(window=True, softcap=True),
               dict(causal=True, causal_align="top_left", alibi=True, d=64)):
        d = kw.pop("d", 128)
        spec = KernelSpec(direction=direction, head_dim=d, arch="sm_90a", dtype="bfloat16", dropout=True, **kw)
        assert spec.impl == "wgmma", spec
    assert KernelSpec(direction=direction, head_dim=64, arch="sm_90", dtype="float16", dropout=True).impl == "mma"


def test_tiles_that_would_spill_are_shrunk_or_declined_by_name() -> None:
    """The keep bits and the Philox state beside the accumulators: the forward's key block, the backward's
    Q block (benchmarks/sass_cost.py's spills; fagen.families.wgmma's FWD_DROPOUT_REGS, bwd.BWD_DROPOUT_REGS)."""
    fwd = lambda d, **kw: KernelSpec(direction="fwd", head_dim=d, arch="sm_90a", dtype="float16", dropout=True, **kw)
    bwd = lambda d, **kw: KernelSpec(direction="bwd", head_dim=d, arch="sm_90a", dtype="float16", dropout=True, **kw)
    assert fwd(64).tile.block_c == 192 and fwd(128).tile.block_c == 128  # 192 keys at d = 128 would spill
    assert fwd(256).tile.block_c == 32  # the wide O accumulator: 64 keys spilled 48 bytes, 48 keys 32
    with pytest.raises(ValueError, match=r"block_c=64 with dropout: .* 168 fp32 registers .* more than 148"):
        fwd(256, block_c=64, impl="wgmma")
    with pytest.raises(ValueError, match=r"block_c=192 with dropout: .* 184 fp32 registers .* more than 160"):
        fwd(128, block_c=192, impl="wgmma")
    # beside softcap (the forward's exact tanhf): 192 keys at d = 64 spilled 40 bytes (FWD_SOFTCAP_DROPOUT_REGS)
    assert fwd(64, softcap=True).tile.block_c == 128 and fwd(128, softcap=True).tile.block_c == 128
    with pytest.raises(ValueError, match=r"block_c=192 with softcap / alibi and dropout: .* 152 fp32 registers .* "
                                         r"more than 144"):
        fwd(64, softcap=True, block_c=192, impl="wgmma")
    b64 = bwd(64)
    assert b64.impl == "wgmma" and (b64.tile.block_r, b64.tile.block_c, b64.num_warps) == (64, 64, 4)
    assert (bwd(128).tile.block_r, bwd(128).num_warps) == (64, 8)
    with pytest.raises(ValueError, match=r"block_r=128 with head_dim=64, dropout: .* 256 fp32 registers"):
        bwd(64, num_warps=8, block_r=128, impl="wgmma")
    assert bwd(128, alibi=True).impl == "mma"
    with pytest.raises(ValueError, match=r"dropout and alibi: .* 224 fp32 registers .* more than 160"):
        bwd(128, alibi=True, impl="wgmma")


# --------------------------------------------------------------------------- the keep mask, bit for bit
def _keep_case(spec_kw: dict, dtype: torch.dtype, B: int, H: int, Hkv: int, Nq: int, Nk: int, p: float,
               rows: int = 0, cols: int = 0, arch: str = "sm_90a", impl: str = "wgmma", backward: bool = True):
    """q = 0 makes P uniform (1 / Nk) and v = the identity's first Nk rows (Nk <= dv) makes the forward's
    o[b, i, h, j] = Z[b, h, i, j] / ((1 - p) Nk); with H = Hkv, do = the identity's first Nq rows (Nq <= dv)
    makes the backward's dv[b, j, h, i] = Z[b, h, i, j] / ((1 - p) Nk). Returns (o, dv or None, the keep
    mask of (row offset + i, column offset + j))."""
    d, dv = spec_kw["head_dim"], spec_kw.get("head_dim_v", spec_kw["head_dim"])
    assert Nk <= dv
    q = torch.zeros(B, Nq, H, d, dtype=dtype)
    k = torch.randn(B, Nk, Hkv, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    v = torch.eye(dv)[:Nk][None, :, None, :].expand(B, Nk, Hkv, dv).contiguous().to(dtype)
    kw = dict(dropout_p=p, seed=W.DROPOUT_SEED, offset=W.DROPOUT_OFFSET, dropout_row_offset=rows,
              dropout_col_offset=cols)
    sf = KernelSpec(direction="fwd", arch=arch, dtype=str(dtype).split(".")[1], dropout=True, impl=impl, **spec_kw)
    o, lse = F.attention_forward(q, k, v, spec=sf, **kw)
    grad_v = None
    if backward:
        assert H == Hkv and Nq <= dv
        sb = KernelSpec(direction="bwd", arch=arch, dtype=str(dtype).split(".")[1], dropout=True, impl=impl, **spec_kw)
        do = torch.eye(dv)[:Nq][None, :, None, :].expand(B, Nq, H, dv).contiguous().to(dtype)
        grad_v = F.attention_backward(do, q, k, v, o, lse, spec=sb, **kw)[2]
    keep = F.dropout_keep_mask(B, H, rows + Nq, cols + Nk, p, seed=W.DROPOUT_SEED, offset=W.DROPOUT_OFFSET)
    return o, grad_v, keep[:, :, rows:, cols:]


def _assert_applies(o: torch.Tensor, grad_v: torch.Tensor | None, keep: torch.Tensor, p: float) -> None:
    Nk = keep.shape[-1]
    applied = (o > 0).permute(0, 2, 1, 3)[..., :Nk]  # [B, H, Nq, Nk]
    assert torch.equal(applied, keep), (applied != keep).sum().item()
    assert not (o[..., Nk:] != 0).any()
    kept = o[o > 0].float()
    assert torch.allclose(kept, torch.full_like(kept, 1.0 / ((1 - p) * Nk)), rtol=1e-2)
    if grad_v is not None:
        Nq = keep.shape[2]
        drawn = (grad_v > 0).permute(0, 2, 3, 1)[:, :, :Nq]  # [B, H, Nq (dv columns), Nk]
        assert torch.equal(drawn, keep), (drawn != keep).sum().item()
        assert not (grad_v[..., Nq:] != 0).any()
        kept = grad_v[grad_v > 0].float()
        assert torch.allclose(kept, torch.full_like(kept, 1.0 / ((1 - p) * Nk)), rtol=1e-2)


KEEP_CASES = [
    # GQA (the forward's: the backward's dV sums a group's q heads), Nq != Nk, two consumer warpgroups, fp16
    dict(spec=dict(head_dim=128, num_warps=8), dtype=torch.float16, B=2, H=4, Hkv=2, Nq=150, Nk=120, p=0.3),
    # three key tiles of 64 (d = 64, dv = 192: the forward's), bf16
    dict(spec=dict(head_dim=64, head_dim_v=192, num_warps=4), dtype=torch.bfloat16, B=1, H=2, Hkv=1, Nq=100,
         Nk=190, p=0.45),
    # both directions at d = 128 (Q blocks of 64 rows), a ring step's offsets: rows + 5, keys + 3 (the 4-key
    # Philox groups straddle the fragments' columns: one call per element)
    dict(spec=dict(head_dim=128, num_warps=8), dtype=torch.float16, B=1, H=2, Hkv=2, Nq=90, Nk=128, p=0.2,
         rows=5, cols=3),
    dict(spec=dict(head_dim=64, num_warps=4), dtype=torch.bfloat16, B=2, H=1, Hkv=1, Nq=64, Nk=64, p=0.5,
         rows=64, cols=128),
]


@pytest.mark.parametrize("c", W.slow(KEEP_CASES))
def test_the_keep_mask_is_dropout_keep_mask_bit_for_bit(c) -> None:
    o, grad_v, keep = _keep_case(c["spec"], c["dtype"], c["B"], c["H"], c["Hkv"], c["Nq"], c["Nk"], c["p"],
                                 c.get("rows", 0), c.get("cols", 0), backward=c["H"] == c["Hkv"])
    _assert_applies(o, grad_v, keep, c["p"])


def test_the_keep_pattern_is_the_mma_familys() -> None:
    """The same seed and offset give the same dropped elements on mma (sm_90) and wgmma (sm_90a), both
    directions: switching family never changes a training run's randomness."""
    args = (torch.float16, 1, 2, 2, 48, 60, 0.35)
    o_mma, dv_mma, keep = _keep_case(dict(head_dim=64), *args, arch="sm_90", impl="mma")
    o_wg, dv_wg, _ = _keep_case(dict(head_dim=64, num_warps=4), *args)
    assert torch.equal(o_mma > 0, o_wg > 0) and torch.equal(dv_mma > 0, dv_wg > 0)
    _assert_applies(o_wg, dv_wg, keep, 0.35)


# --------------------------------------------------------------------------- numerics
FWD_CASES = [
    # GQA, key padding (a batch with every key padded), rows with no key (top-left, Nq > Nk)
    dict(d=64, dtype="float16", nw=4, B=2, Nq=90, Nk=70, H=2, Hkv=1, causal=True, align="top_left", kpm=True,
         dropout=0.2),
    # softcap + causal, two consumer warpgroups, Nq != Nk, lengths off the 128 x 128 tile
    dict(d=128, dtype="bfloat16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True, softcap=True, dropout=0.3),
    dict(d=64, dtype="float16", nw=8, B=1, Nq=130, Nk=200, H=1, Hkv=1, window=(40, 10), alibi=True, dropout=0.25),
    dict(d=128, dv=64, dtype="bfloat16", nw=4, B=1, Nq=70, Nk=150, H=2, Hkv=1, softcap=True, sinks=True,
         dropout=0.1),
    dict(d=96, dtype="float16", nw=4, B=1, Nq=150, Nk=100, H=2, Hkv=2, causal=True, alibi=True, dropout=0.2),
    dict(d=192, dv=128, dtype="bfloat16", nw=8, B=1, Nq=70, Nk=130, H=2, Hkv=1, causal=True, dropout=0.15),
]


@pytest.mark.parametrize("c", W.slow(FWD_CASES))
def test_forward_matches_float64(c) -> None:
    t = W.inputs(c, scale=2.0 if c.get("softcap") else 1.0)
    spec = W.dropout_spec("fwd", c)
    assert spec.impl == "wgmma", spec
    o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **W.dropout_options(c, t))
    W.check_dropout_forward(c, t, o, lse)


BWD_CASES = [
    # softcap + causal, GQA (two q heads per kv head: each q head's keep bits), two consumer warpgroups,
    # Nq != Nk, lengths off the 64 x 128 tile
    dict(d=128, dtype="float16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True, softcap=True, dropout=0.2),
    # ALiBi ([B, H] slopes), key padding (a batch with every key padded); d = 64: 64 x 64 on one warpgroup
    dict(d=64, dtype="bfloat16", nw=4, B=2, Nq=70, Nk=100, H=2, Hkv=1, kpm=True, alibi=True, dropout=0.3),
    dict(d=96, dtype="float16", nw=8, B=1, Nq=130, Nk=100, H=3, Hkv=1, window=(30, 5), softcap=True, dropout=0.15),
    # rows that see no key (top-left, Nq > Nk), a v head dim of its own
    dict(d=64, dv=128, dtype="bfloat16", nw=4, B=1, Nq=150, Nk=60, H=2, Hkv=1, causal=True, align="top_left",
         softcap=True, dropout=0.25),
    dict(d=128, dtype="bfloat16", nw=8, B=1, Nq=90, Nk=140, H=2, Hkv=2, causal=True, kpm=True, dropout=0.4),
]


@pytest.mark.parametrize("c", W.slow(BWD_CASES))
def test_backward_matches_float64(c) -> None:
    t = W.inputs(c, scale=2.0 if c.get("softcap") else 1.0)
    spec = W.dropout_spec("bwd", c)
    assert spec.impl == "wgmma", spec
    W.check_backward(c, t, *W.dropout_backward(c, t, spec))


@pytest.mark.slow
def test_p_zero_through_a_dropout_spec_is_the_plain_kernel() -> None:
    """p = 0 keeps every element with 1 / (1 - p) = 1: o, lse, dq, dk, dv bit for bit the plain kernels'."""
    c = dict(d=64, dtype="float16", nw=4, B=1, Nq=70, Nk=90, H=2, Hkv=1, causal=True, dropout=0.0)
    t = W.inputs(c)
    outs = []
    for dropout in (False, True):  # the same tiles (dropout takes 64 Q rows at d = 64)
        sf, sb = W.spec("fwd", c, dropout=dropout), W.spec("bwd", c, dropout=dropout, block_r=64)
        assert sf.impl == sb.impl == "wgmma"
        kw = W.dropout_options(c, t) if dropout else W.options(c, t)
        o, lse = F.run_forward(sf, t["q"], t["k"], t["v"], **kw)
        outs.append([o, lse, *F.run_backward(sb, t["do"], t["q"], t["k"], t["v"], o, lse, **kw)])
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *outs):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: A backward with dropout, causal, key padding, GQA (two q heads per kv head), Nq and Nk ending inside a tile.
CHECK_BWD = dict(d=64, dtype="float16", nw=4, B=1, Nq=50, Nk=60, H=2, Hkv=1, causal=True, kpm=True, dropout=0.3)


@pytest.mark.slow
def test_a_dropout_backward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    t = W.inputs(CHECK_BWD, seed=32)
    spec = W.dropout_spec("bwd", CHECK_BWD)
    assert spec.impl == "wgmma"
    W.assert_clean_under_racecheck_and_asan(lambda: W.dropout_backward(CHECK_BWD, t, spec)[0])


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_and_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs for a dropout forward and backward, translated and run on the CPU: the
    flash-attn criterion against the float64 oracle with the keep mask (opt-in, FAGEN_TEST_SLOW=1)."""
    c = dict(d=64, dtype="float16", nw=4, B=1, Nq=70, Nk=90, H=2, Hkv=1, causal=True, dropout=0.25)
    t = W.inputs(c, seed=41)
    fwd, bwd = W.dropout_spec("fwd", c), W.dropout_spec("bwd", c)
    with cpu.ptx() as record:
        o, lse = F.run_forward(fwd, t["q"], t["k"], t["v"], **W.dropout_options(c, t))
        grads, g64, g_pt = W.dropout_backward(c, t, bwd)
    assert {s for s, _, _ in record.launches} == {fwd.name, bwd.name}
    W.check_dropout_forward(c, t, o, lse)
    W.check_backward(c, t, grads, g64, g_pt)


def test_the_rendered_source_draws_the_shared_philox_stream() -> None:
    """The keep bits come from partials/philox.cuh's fa_keep4 on fa_philox4x32_10 (no second generator:
    the stream is called only by the shared partial's two functions), and a spec without dropout renders
    none of the family's keep-bit code."""
    from fagen.renderer import render

    for direction in ("fwd", "bwd"):
        src = render(KernelSpec(direction=direction, head_dim=64, arch="sm_90a", dtype="float16", dropout=True)).source
        kernel = src[src.index("namespace fa {", src.index("fa_keep4(")):]  # what follows the shared partial
        assert "fa_keep4(" in kernel and "wg_keep_bits" in kernel
        assert len(re.findall(r"fa_philox4x32_10\(", src)) == 3  # the definition, fa_dropout_keep's and fa_keep4's calls
        plain = render(KernelSpec(direction=direction, head_dim=64, arch="sm_90a", dtype="float16")).source
        assert "wg_keep_bits" not in plain


def test_the_autotuners_estimate_counts_the_keep_bits() -> None:
    """Without a disassembler the pair cost estimates the loop from the tile: dropout adds its Philox work
    per score (fagen.families.wgmma.cost.DROPOUT_PER_SCORE), as the mma family's estimate does."""
    from fagen.families.wgmma.cost import DROPOUT_PER_SCORE, pair_cost

    spec = KernelSpec(direction="fwd", head_dim=128, arch="sm_90a", dtype="float16", dropout=True)
    plain = spec.replace(dropout=False, block_c=spec.tile.block_c)
    extra = pair_cost(spec.family_spec).warp_instructions - pair_cost(plain.family_spec).warp_instructions
    assert extra == spec.num_warps * DROPOUT_PER_SCORE * spec.tile.block_c // 2


@pytest.mark.slow
def test_a_packed_training_step_is_the_same_run_on_either_family(monkeypatch) -> None:
    """``flash_attn_varlen_func`` with dropout and causal, forward and backward, as a GPU of sm_90
    (``mma``) and of sm_90a (``wgmma``) runs it (``FAGEN_EMULATE_ARCH``): with the same torch seed the
    outputs and gradients agree to the 16-bit rounding of their different summation orders, while
    another seed (another keep mask) moves them by far more, so switching family changes no training
    run's randomness."""
    from fagen import flash_attn_varlen_func, settings

    lens = [(70, 90), (1, 3), (130, 128)]
    cq = torch.tensor([0, 70, 71, 201], dtype=torch.int32)
    ck = torch.tensor([0, 90, 93, 221], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(n, h, 64, generator=g).half() for n, h in ((201, 4), (221, 2), (221, 2)))
    do = torch.randn(201, 4, 64, generator=g).half()

    def step(arch: str | None, seed: int = 123):
        settings.configure(emulate_arch=arch)
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        torch.manual_seed(seed)  # the dropout seed the entry point draws
        o = flash_attn_varlen_func(q, k, v, cq, ck, max(a for a, _ in lens), max(b for _, b in lens),
                                   dropout_p=0.3, causal=True)
        o.backward(do)
        return o.detach(), q.grad, k.grad, v.grad

    monkeypatch.delenv("FAGEN_EMULATE_ARCH", raising=False)
    launched: list[str] = []
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda spec, *a, **kw: launched.append(spec.impl) or real(spec, *a, **kw))
    try:
        mma, wgmma, other = step(None), step("sm_90a"), step(None, seed=124)
    finally:
        settings.reset()
    assert "mma" in launched and "wgmma" in launched
    for name, a, b, c in zip(("o", "dq", "dk", "dv"), mma, wgmma, other):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=2e-3, msg=name)
        assert (a.float() - c.float()).abs().max() > 0.1, name
