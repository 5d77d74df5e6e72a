"""The Hopper family (``wgmma``, sm_90a) with a bool attn_mask and an additive bias (and its gradient):
selection, the register bounds of their tiles, and both directions on the CPU emulator against the float64
oracle with flash-attn's criterion through the public ``attention_forward`` / ``attention_backward``
(``tests/feature_harness.py``'s check_case: fp16 / bf16, masks and biases broadcast over the batch, the
heads, the rows or the keys, a broadcast bias's gradient reduced to its shape, rows every key of which the
mask drops (zero output and dq, lse -inf), causal of both alignments, a window, GQA, softcap / ALiBi /
dropout beside them, odd lengths, Nq != Nk, tiles whose mask / bias are read two keys
per load); torch's SDPA layout on CPU tensors taking ``wgmma`` under ``FAGEN_EMULATE_ARCH=sm_90a``;
racecheck and AddressSanitizer of a backward (clean, bit-identical) and one forward / backward pair at
the PTX level (opt-in, FAGEN_TEST_SLOW=1). Sweeps past the first case are in the slow tier."""
from __future__ import annotations

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen.families.wgmma.bwd import split_dkv
from fagen.runtime import cpu
from feature_harness import FeatCase, check_case, make_inputs, specs

import wgmma_cases as W

SM90A = dict(extra=dict(arch="sm_90a"))


def _spec(direction: str, **kw) -> KernelSpec:
    return KernelSpec(direction=direction, arch="sm_90a", dtype=kw.pop("dtype", "bfloat16"), **kw)


# --------------------------------------------------------------------------- selection
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_mask_and_bias_resolve_to_wgmma(direction) -> None:
    grad = dict(bias_grad=True) if direction == "bwd" else {}
    for kw in (dict(attn_mask=True), dict(bias=True), dict(bias=True, **grad),
               dict(attn_mask=True, bias=True, causal=True, window=True, varlen=True, **grad),
               dict(attn_mask=True, bias=True, softcap=True, dropout=True, **grad),
               dict(attn_mask=True, bias=True, softcap=True, alibi=True, **grad)):
        for d in (64, 96, 128):
            spec = _spec(direction, head_dim=d, **kw)
            # the backward's mixes of per-element features past d = 64 would spill on the one-accumulator tile: the
            # split tile, but for a bias with ALiBi (declined by name: another family)
            mix = direction == "bwd" and d > 64 and sum(kw.get(f, False) for f in
                                                        ("attn_mask", "bias", "softcap", "alibi", "dropout")) > 1
            declined = mix and kw.get("alibi") and kw.get("bias")
            assert (spec.impl != "wgmma") if declined else (spec.impl == "wgmma"), spec
            assert not mix or declined or split_dkv(spec.family_spec), spec


def test_tiles_that_would_spill_are_shrunk_or_declined_by_name() -> None:
    """The registers of the per-element reads beside S and O (forward: the key block) and beside S^T, dP^T,
    dK~, dV~ (backward: the Q block)."""
    assert _spec("fwd", head_dim=64, attn_mask=True).tile.block_c == 192
    assert _spec("fwd", head_dim=128, attn_mask=True).tile.block_c == 128  # 192 would spill
    assert _spec("fwd", head_dim=64, bias=True).tile.block_c == 128
    assert _spec("fwd", head_dim=128, attn_mask=True, bias=True).tile.block_c == 64
    assert _spec("fwd", head_dim=192, attn_mask=True, bias=True).tile.block_c == 64
    assert _spec("fwd", head_dim=256, attn_mask=True).tile.block_c == 64  # d = 256: 64 keys (168 registers)
    assert _spec("fwd", head_dim=256, bias=True).tile.block_c == 48  # 64 keys would spill beside a bias
    with pytest.raises(ValueError, match=r"block_c=192 with attn_mask: .* 184 fp32 registers"):
        _spec("fwd", head_dim=128, attn_mask=True, block_c=192, impl="wgmma")
    with pytest.raises(ValueError, match=r"block_c=128 with softcap / alibi and attn_mask and bias: .* 144 fp32"):
        _spec("fwd", head_dim=128, attn_mask=True, bias=True, softcap=True, block_c=128, impl="wgmma")
    bwd = _spec("bwd", head_dim=64, bias=True, bias_grad=True)
    assert bwd.impl == "wgmma" and (bwd.tile.block_r, bwd.tile.block_c, bwd.num_warps) == (64, 64, 4)
    assert _spec("bwd", head_dim=128, attn_mask=True).tile.block_r == 64
    with pytest.raises(ValueError, match=r"block_r=128 with head_dim=64 and attn_mask: .* 256 fp32 registers"):
        _spec("bwd", head_dim=64, attn_mask=True, num_warps=8, block_r=128, impl="wgmma")
    # no one-accumulator tile takes the mask beside a bias at d = 128: the split tile (tests/test_wgmma_feature_tiles.py)
    both = _spec("bwd", head_dim=128, attn_mask=True, bias=True, impl="wgmma")
    assert split_dkv(both.family_spec) and (both.tile.block_r, both.tile.block_c) == (64, 64)
    with pytest.raises(ValueError, match=r"bias with alibi beside attn_mask: the wgmma backward's split tile .* spill"):
        _spec("bwd", head_dim=128, attn_mask=True, bias=True, alibi=True, impl="wgmma")


# --------------------------------------------------------------------------- numerics
CASES = [
    # mask broadcast over the heads, bias over the batch (its gradient summed back), GQA, causal, odd lengths
    # Nq != Nk (the mask's rows at odd strides: one key per read)
    FeatCase("mask-bias-gqa", dtype="float16", batch=2, heads=2, heads_kv=1, seqlen_q=37, seqlen_k=45, head_dim=64,
             causal=True, mask=(2, 1, 37, 45), bias=(1, 2, 37, 45)),
    # a mask broadcast over the keys: about a third of the rows see no key (zero o and dq, lse -inf); a window;
    # bf16 at d = 128
    FeatCase("dead-rows", dtype="bfloat16", batch=2, heads=2, heads_kv=2, seqlen_q=70, seqlen_k=90, head_dim=128,
             window=(20, 10), mask=(1, 1, 70, 1)),
    # a bias broadcast over batch and heads at d = 96 (d = 128's tiles), GQA
    FeatCase("bias-d96", dtype="float16", batch=2, heads=2, heads_kv=1, seqlen_q=45, seqlen_k=33, head_dim=96,
             bias=(45, 33)),
    # even lengths past a tile: the interior tiles read the mask / bias two keys per load (forward) and at
    # 32-bit step offsets (backward) without bounds tests
    FeatCase("interior", dtype="float16", batch=1, heads=2, heads_kv=2, seqlen_q=150, seqlen_k=200, head_dim=64,
             mask=(1, 2, 150, 200), bias=(1, 2, 150, 200)),
    FeatCase("interior-d128", dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=140, seqlen_k=160, head_dim=128,
             causal=True, align="top_left", bias=(1, 1, 140, 160)),
    # beside softcap, ALiBi and dropout
    FeatCase("score-mods", dtype="float16", batch=1, heads=2, heads_kv=2, seqlen_q=50, seqlen_k=61, head_dim=64,
             softcap=4.0, alibi="bh", dropout_p=0.2, mask=(1, 2, 50, 61), bias=(1, 2, 50, 61), q_scale=2.0),
    # the mask with ALiBi alone beside it at d = 128: the forward's raw scores at 128 keys (FWD_MASK_ALIBI_REGS), the
    # backward's split tile
    FeatCase("mask-alibi-d128", dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=40, seqlen_k=70, head_dim=128,
             alibi="bh", mask=(1, 2, 40, 70)),
    # the mask and a bias beside causal and key broadcast at d = 64, bf16
    FeatCase("mask-bias-bf16", dtype="bfloat16", batch=2, heads=2, heads_kv=1, seqlen_q=45, seqlen_k=33, head_dim=64,
             causal=True, mask=(2, 2, 45, 33), bias=(2, 1, 1, 33)),
    # the deterministic backward (dQ_i's reduce-adds in turns) with both, GQA, causal
    FeatCase("deterministic", dtype="float16", batch=2, heads=2, heads_kv=1, seqlen_q=70, seqlen_k=90, head_dim=64,
             causal=True, deterministic=True, mask=(2, 1, 70, 90), bias=(1, 2, 70, 90)),
]


@pytest.mark.parametrize("c", [pytest.param(c, id=c.name, marks=() if n == 0 else pytest.mark.slow)
                               for n, c in enumerate(CASES)])
def test_forward_and_backward_match_float64(c) -> None:
    for direction in ("fwd", "bwd"):  # the case's specs resolve to this family (impl=None)
        spec = _spec(direction, head_dim=c.head_dim, dtype=c.dtype, causal=c.causal, causal_align=c.align,
                     window=c.window is not None, softcap=c.softcap > 0, alibi=c.alibi is not None,
                     dropout=c.dropout_p > 0, attn_mask=c.mask is not None, bias=c.bias is not None,
                     **({"bias_grad": c.bias is not None} if direction == "bwd" else {}))
        assert spec.impl == "wgmma", spec
    fwd, bwd = check_case(c, "wgmma", **SM90A)
    assert fwd.impl == bwd.impl == "wgmma" and bwd.bias_grad == (c.bias is not None)


@pytest.mark.slow
def test_sdpa_layout_on_cpu_tensors_takes_wgmma_under_emulate_arch(monkeypatch) -> None:
    """fagen's ``scaled_dot_product_attention`` with a bool mask and, separately, a differentiable float bias
    broadcast over the batch, as a GPU of sm_90 (``mma``) and of sm_90a (``wgmma``) runs it: the same
    outputs and gradients (the bias's at its own shape) to the 16-bit rounding of their summation orders."""
    from fagen import scaled_dot_product_attention, settings

    g = torch.Generator().manual_seed(5)
    q0, k0, v0 = (torch.randn(2, 2, n, 64, generator=g).half() for n in (70, 90, 90))
    mask = torch.rand(2, 1, 70, 90, generator=g) > 0.3
    bias0 = torch.randn(1, 2, 70, 90, generator=g).half()
    do = torch.randn(2, 2, 70, 64, generator=g).half()

    def step(arch: str | None, attn_mask_bias: str):
        settings.configure(emulate_arch=arch)
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        bias = bias0.clone().requires_grad_()
        o = scaled_dot_product_attention(q, k, v, attn_mask=mask if attn_mask_bias == "mask" else bias)
        o.backward(do)
        return [o.detach(), q.grad, k.grad, v.grad] + ([bias.grad] if attn_mask_bias == "bias" else [])

    monkeypatch.delenv("FAGEN_EMULATE_ARCH", raising=False)
    launched: list[str] = []
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda spec, *a, **kw: launched.append(spec.impl) or real(spec, *a, **kw))
    try:
        for what in ("mask", "bias"):
            mma, wgmma = step(None, what), step("sm_90a", what)
            for name, a, b in zip(("o", "dq", "dk", "dv", "dbias"), mma, wgmma):
                assert a.shape == b.shape, name
                torch.testing.assert_close(a.float(), b.float(), rtol=5e-3, atol=5e-3, msg=f"{what}: {name}")
    finally:
        settings.reset()
    assert "mma" in launched and "wgmma" in launched


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: A backward with the mask, the bias and its gradient (two q heads per kv head, lengths ending inside a tile).
CHECK = FeatCase("check", dtype="float16", batch=1, heads=2, heads_kv=1, seqlen_q=50, seqlen_k=60, head_dim=64,
                 causal=True, mask=(1, 2, 50, 60), bias=(1, 1, 50, 60))


@pytest.mark.slow
def test_a_mask_and_bias_backward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    _, bwd = specs(CHECK, "wgmma", **SM90A)
    assert bwd.impl == "wgmma" and bwd.bias_grad
    t, opt = make_inputs(CHECK)
    o, lse = F.attention_forward(t["q"], t["k"], t["v"], **opt)
    W.assert_clean_under_racecheck_and_asan(lambda: F.attention_backward(
        t["do"], t["q"], t["k"], t["v"], o, lse, spec=bwd, bias_requires_grad=True, **opt))


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_and_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs for a mask + bias forward and backward (with dBias), translated and run on
    the CPU: the flash-attn criterion against the float64 oracle (opt-in, as tests/test_ptx_kernels.py's
    heavy rows: FAGEN_TEST_SLOW=1)."""
    fwd, bwd = specs(CHECK, "wgmma", **SM90A)
    with cpu.ptx() as record:
        check_case(CHECK, "wgmma", **SM90A)
    assert {s for s, _, _ in record.launches} >= {fwd.name, bwd.name}
