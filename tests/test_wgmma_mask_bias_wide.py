"""The Hopper family (``wgmma``, sm_90a) with a bool attn_mask and an additive bias (and its gradient) at head
dims past 128: the backward's split tile (``fagen.families.wgmma.bwd.split_dkv``: both warpgroups apply the mask
/ bias to S^T, warpgroup 0 stores dBias) at d = 192 (dv = 192 or 128) and the forward at d = 256 (64 keys, the
mask). Selection and the register bounds declined by name; both directions on the CPU emulator against the
float64 oracle with flash-attn's criterion (``tests/feature_harness.py``: fp16 / bf16, masks and biases broadcast,
a broadcast bias's gradient reduced to its shape, rows every key of which the mask drops, causal, GQA, odd
lengths, Nq != Nk, the deterministic backward); racecheck and AddressSanitizer of a backward and one forward /
backward pair at the PTX level (opt-in, FAGEN_TEST_SLOW=1). Cases past the first are in the slow tier."""
from __future__ import annotations

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen import reference as R
from fagen.runtime import cpu
from feature_harness import ATOL, DT, FeatCase, _keep, _lse32, make_inputs
from featref import assert_lse_close, flash_criterion

import wgmma_cases as W


def _spec(direction: str, **kw) -> KernelSpec:
    return KernelSpec(direction=direction, arch="sm_90a", dtype=kw.pop("dtype", "bfloat16"), **kw)


# --------------------------------------------------------------------------- selection
def test_the_split_tile_and_the_d256_forward_take_them() -> None:
    for kw in (dict(attn_mask=True), dict(bias=True), dict(bias=True, bias_grad=True),
               dict(attn_mask=True, causal=True, window=True, key_padding=True, varlen=True),
               dict(bias=True, bias_grad=True, deterministic=True, causal=True),
               dict(attn_mask=True, dropout=True), dict(bias=True, bias_grad=True, alibi=True),
               dict(attn_mask=True, softcap=True)):
        for d, dv in ((192, 192), (192, 128), (128, 192)):
            spec = _spec("bwd", head_dim=d, head_dim_v=dv, **kw)
            assert spec.impl == "wgmma" and (spec.tile.block_r, spec.tile.block_c) == (64, 64), spec
    assert _spec("bwd", head_dim=128, head_dim_v=256, attn_mask=True, causal=True).impl == "wgmma"
    fwd = _spec("fwd", head_dim=256, attn_mask=True, causal=True)
    assert fwd.impl == "wgmma" and fwd.tile.block_c == 64
    assert _spec("fwd", head_dim=64, head_dim_v=256, attn_mask=True).impl == "wgmma"


@pytest.mark.parametrize("direction, kw, why", [
    # the dK~ warpgroup's 208 registers at d = 256 would spill beside the mask / bias
    ("bwd", dict(head_dim=256, attn_mask=True), "208 fp32 registers per consumer thread, more than 176"),
    ("bwd", dict(head_dim=256, head_dim_v=128, bias=True), "208 fp32 registers per consumer thread, more than 176"),
    # the dV~ warpgroup's 176 at dv = 256 beside a bias
    ("bwd", dict(head_dim=128, head_dim_v=256, bias=True), "the dV~ warpgroup's 176 fp32 registers per thread"),
    ("bwd", dict(head_dim=192, head_dim_v=128, attn_mask=True, bias=True), "attn_mask with bias: the wgmma backward's "
                                                                          "split tile"),
    ("bwd", dict(head_dim=192, head_dim_v=128, bias=True, dropout=True, alibi=True), "bias with dropout and alibi"),
    ("fwd", dict(head_dim=256, bias=True, block_c=64), "block_c=64 with bias: the O accumulator, S and P~ take 168"),
    ("fwd", dict(head_dim=256, attn_mask=True, bias=True, block_c=64), "block_c=64 with attn_mask and bias"),
])
def test_what_would_spill_is_declined_by_name(direction, kw, why) -> None:
    if "block_c" not in kw:  # a tile the user names is blamed on its field; the forward's default shrinks instead
        assert _spec(direction, **kw).impl == "mma"  # impl=None: another family
    with pytest.raises(ValueError, match=why.replace("~", r"\~")):
        _spec(direction, impl="wgmma", **kw)


# --------------------------------------------------------------------------- numerics
def _check(c: FeatCase, dv: int | None = None, bwd_impl: str = "wgmma") -> tuple[KernelSpec, KernelSpec]:
    """tests/feature_harness.py's check_case with v / dO of head dim ``dv`` and the backward of family
    ``bwd_impl`` (the forward's is ``wgmma``): the forward and backward against the float64 oracle with flash-attn's
    criterion, lse against PyTorch's float32, rows that see no key exactly zero. Returns the specs run."""
    t, opt = make_inputs(c)
    if dv is not None:
        g = torch.Generator().manual_seed(c.seed)
        t["v"] = torch.randn(*t["v"].shape[:-1], dv, generator=g).to(DT[c.dtype])
        t["do"] = torch.randn(*t["do"].shape[:-1], dv, generator=g).to(DT[c.dtype])
    flags = dict(head_dim=c.head_dim, head_dim_v=dv or c.head_dim, dtype=c.dtype, causal=c.causal,
                 causal_align=c.align, dropout=c.dropout_p > 0, window=c.window is not None, softcap=c.softcap > 0,
                 alibi=c.alibi is not None, attn_mask=c.mask is not None, bias=c.bias is not None)
    sf = _spec("fwd", impl="wgmma", **flags)
    sb = _spec("bwd", impl=bwd_impl, deterministic=c.deterministic, bias_grad=c.bias is not None, **flags)
    o, lse = F.attention_forward(t["q"], t["k"], t["v"], spec=sf, **opt)
    grads = F.attention_backward(t["do"], t["q"], t["k"], t["v"], o, lse, spec=sb, deterministic=c.deterministic,
                                 bias_requires_grad=c.bias is not None, **opt)
    ours = {"o": o, "dq": grads[0], "dk": grads[1], "dv": grads[2]} | ({"dbias": grads[3]} if c.bias else {})

    rkw = {k: v for k, v in opt.items() if k not in ("seed", "offset")}
    rkw["keep_mask"] = _keep(c, t, opt)
    o64, lse64 = R.attention_forward_ref(t["q"], t["k"], t["v"], **rkw)
    ref = R.attention_backward_ref(t["do"], t["q"], t["k"], t["v"], o64, lse64, bias_requires_grad=c.bias is not None,
                                   **rkw)
    ref64 = {"o": o64, "dq": ref[0], "dk": ref[1], "dv": ref[2]} | ({"dbias": ref[3]} if c.bias else {})
    leaves = {n: t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
    tkw = dict(rkw)
    if c.bias is not None:
        leaves["bias"] = tkw["attn_bias"] = opt["attn_bias"].detach().clone().requires_grad_(True)
    ot = R.attention_ref_torch(leaves["q"], leaves["k"], leaves["v"], **tkw)
    ot.backward(t["do"])
    same = {"o": ot.detach()} | {f"d{n}": leaves[n].grad for n in leaves}
    atol = ATOL[c.dtype] * max(1.0, max(r.abs().max().item() for r in ref64.values()))
    for name, r in ref64.items():
        assert not torch.isnan(ours[name]).any(), f"{c}: NaN in {name}"
        flash_criterion(f"{c}: {name}", ours[name], r, same[name], atol)
    assert_lse_close(f"{c}: lse", lse, lse64, _lse32(c, t, opt))
    dead = ~torch.isfinite(lse64)
    if dead.any():  # rows that see no key: exactly zero output and dq
        rows = dead.permute(0, 2, 1)
        assert (o[rows] == 0).all() and (grads[0][rows] == 0).all(), f"{c}: fully masked rows not zero"
    return sf, sb


#: (case, dv, the backward's family): the split tile at d = 192 (dv = 128: MLA's pair), the forward at d = 256.
CASES = [
    # the mask broadcast over the heads and the keys (about a third of the rows see no key), GQA, causal, odd
    # lengths Nq != Nk, fp16, d = 192 with dv = 128
    (FeatCase("mask-d192-dv128", dtype="float16", batch=2, heads=2, heads_kv=1, seqlen_q=70, seqlen_k=75,
              head_dim=192, causal=True, mask=(2, 1, 70, 1)), 128, "wgmma"),
    # a bias broadcast over the batch with its gradient (summed back), GQA, bf16, d = 192
    (FeatCase("bias-d192", dtype="bfloat16", batch=2, heads=2, heads_kv=1, seqlen_q=67, seqlen_k=80, head_dim=192,
              bias=(1, 2, 67, 80)), None, "wgmma"),
    # a bias broadcast over batch and heads, causal top-left, fp16, d = 192 with dv = 128; the interior tiles read
    # it without bounds tests
    (FeatCase("bias-d192-dv128", dtype="float16", batch=1, heads=2, heads_kv=2, seqlen_q=128, seqlen_k=140,
              head_dim=192, causal=True, align="top_left", bias=(128, 140)), 128, "wgmma"),
    # the mask per element, bf16, d = 192 with dv = 128, the deterministic backward
    (FeatCase("mask-det", dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=90, seqlen_k=130, head_dim=192,
              deterministic=True, mask=(1, 2, 90, 130)), 128, "wgmma"),
    # the forward at d = 256 (64 keys) with the mask, GQA, causal, a row per batch without keys; its backward
    # is mma's (the split tile declines d = 256 with the mask)
    (FeatCase("fwd-mask-d256", dtype="bfloat16", batch=2, heads=2, heads_kv=1, seqlen_q=45, seqlen_k=100,
              head_dim=256, causal=True, mask=(2, 1, 45, 100)), None, "mma"),
    (FeatCase("fwd-mask-d256-fp16", dtype="float16", batch=1, heads=2, heads_kv=2, seqlen_q=64, seqlen_k=128,
              head_dim=256, mask=(1, 1, 64, 128)), None, "mma"),
]


@pytest.mark.parametrize("c, dv, bwd_impl", [pytest.param(*x, id=x[0].name, marks=() if n == 0 else pytest.mark.slow)
                                             for n, x in enumerate(CASES)])
def test_forward_and_backward_match_float64(c, dv, bwd_impl) -> None:
    sf, sb = _check(c, dv, bwd_impl)
    assert sf.impl == "wgmma" and sb.impl == bwd_impl and sb.bias_grad == (c.bias is not None)
    if bwd_impl == "wgmma":  # resolved without impl: the same family
        assert KernelSpec(**{**sb.model_dump(), "impl": None}).impl == "wgmma"


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: A split-tile backward with a bias and its gradient (two q heads per kv head, lengths ending inside a tile).
CHECK = FeatCase("check", dtype="float16", batch=1, heads=2, heads_kv=1, seqlen_q=50, seqlen_k=60, head_dim=192,
                 causal=True, bias=(1, 2, 50, 60))
CHECK_MASK = FeatCase("check-mask", dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=50, seqlen_k=60,
                      head_dim=192, mask=(1, 1, 50, 60))


@pytest.mark.slow
def test_a_split_tile_bias_backward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    t, opt = make_inputs(CHECK)
    bwd = _spec("bwd", head_dim=192, dtype="float16", causal=True, bias=True, bias_grad=True)
    assert bwd.impl == "wgmma"
    o, lse = F.attention_forward(t["q"], t["k"], t["v"], **opt)
    W.assert_clean_under_racecheck_and_asan(lambda: F.attention_backward(
        t["do"], t["q"], t["k"], t["v"], o, lse, spec=bwd, bias_requires_grad=True, **opt))


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_and_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs for a d = 192 mask forward and split-tile backward, translated and run on the
    CPU: the flash-attn criterion against the float64 oracle (opt-in: FAGEN_TEST_SLOW=1)."""
    with cpu.ptx() as record:
        fwd, bwd = _check(CHECK_MASK, 128)
    assert {s for s, _, _ in record.launches} >= {fwd.name, bwd.name}
