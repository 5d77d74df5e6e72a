"""The Hopper family (``wgmma``, sm_90a) takes the feature rows that no tile of it took before, instead of ``mma``
or ``simt``:

- the forward with the wide O accumulator (padded head_dim_v 256) and softcap, ALiBi, dropout or a bias: key
  blocks below 64 in 16s (``fagen.families.wgmma.FWD_WIDE_O_REGS`` and its siblings: 48, 32 or 16 keys);
- the backward at d = 96 / 128 with the mask or a bias beside softcap, ALiBi, dropout or each other: the split tile
  (``fagen.families.wgmma.bwd.one_acc_declines``: two warpgroups of one accumulator each).

Selection (what resolves where, what stays declined by name, block_c's quantum per direction), and both directions
on the CPU emulator against the float64 oracle with flash-attn's criterion (``tests/feature_harness.py``: GQA, odd
lengths, Nq != Nk, causal, broadcast masks and biases with rows that see no key, dBias reduced to its shape, the
deterministic backward); racecheck of a split-tile backward and the PTX the GPU runs (opt-in, FAGEN_TEST_SLOW=1).
Cases past the first of each kind are in the slow tier."""
from __future__ import annotations

import pytest

import fagen.functional as F
from fagen import KernelSpec
from fagen.families.wgmma import bwd as B
from fagen.runtime import cpu
from feature_harness import FeatCase, check_case, make_inputs, specs

import wgmma_cases as W

H100 = dict(arch="sm_90a")


def _spec(direction: str, **kw) -> KernelSpec:
    return KernelSpec(direction=direction, arch="sm_90a", dtype=kw.pop("dtype", "bfloat16"), **kw)


# --------------------------------------------------------------------------- selection
@pytest.mark.parametrize("kw, block_c", [
    (dict(bias=True), 48), (dict(softcap=True, attn_mask=True), 32), (dict(softcap=True, bias=True), 32),
    (dict(dropout=True), 32), (dict(alibi=True, dropout=True, causal=True), 32), (dict(attn_mask=True, bias=True), 32),
    (dict(alibi=True, dropout=True, attn_mask=True), 32),
    (dict(softcap=True, dropout=True, bias=True, varlen=True), 16),
    (dict(alibi=True, dropout=True, bias=True, attn_mask=True), 16),
    (dict(attn_mask=True, causal=True), 64),  # the mask alone: 64 keys, as before
    (dict(alibi=True), 64), (dict(alibi=True, window=True, key_padding=True), 48),  # ALiBi on raw scores
])
def test_the_d256_forward_takes_the_mask_a_bias_or_dropout_at_a_key_block_that_fits(kw, block_c) -> None:
    for d, dv in ((256, 256), (128, 256)):
        spec = _spec("fwd", head_dim=d, head_dim_v=dv, **kw)
        assert spec.impl == "wgmma" and spec.tile.block_c == block_c and spec.tile.block_r == 128, spec
    # d = 224 computes in d = 256's tiles (softcap there costs more per real FLOP than mma: declined by cost)
    if "softcap" not in kw:
        assert _spec("fwd", head_dim=224, **kw).tile.block_c == block_c


@pytest.mark.parametrize("kw, block_c", [
    (dict(softcap=True), 48), (dict(softcap=True, alibi=True), 32),
    (dict(softcap=True, dropout=True), 32),
])
def test_where_mma_issues_fewer_the_default_is_declined_but_a_named_key_block_is_taken(kw, block_c) -> None:
    """softcap without the mask, a bias or dropout (or beside dropout or ALiBi) at d = 256: below 64 keys the
    forward would issue more per FLOP than mma's (fagen.families.wgmma.wide_o_small_keys), so the default stays at
    64 keys, which spill: impl=None takes mma, impl='wgmma' says why, and the key block a user names is taken."""
    assert _spec("fwd", head_dim=256, **kw).impl == "mma"
    with pytest.raises(ValueError, match=r"default tile 128x64: block_c=64 with .* pass block_r / block_c"):
        _spec("fwd", head_dim=256, impl="wgmma", **kw)
    assert _spec("fwd", head_dim=256, impl="wgmma", block_c=block_c, **kw).tile.block_c == block_c
    with pytest.raises(ValueError, match=rf"block_c={block_c + 16} with "):
        _spec("fwd", head_dim=256, impl="wgmma", block_c=block_c + 16, **kw)


def test_block_c_takes_16s_in_the_forward_only() -> None:
    assert _spec("fwd", head_dim=128, impl="wgmma", block_c=48).tile.block_c == 48
    with pytest.raises(ValueError, match=r"block_c=40 must be a multiple of 16 in 16\.\.256 \(wgmma template limit\)"):
        _spec("fwd", head_dim=128, impl="wgmma", block_c=40)
    with pytest.raises(ValueError, match=r"block_c=48 must be a multiple of 64"):  # the backward: 64 per warpgroup
        _spec("bwd", head_dim=128, impl="wgmma", block_c=48, num_warps=8)
    # an explicit key block the registers do not allow is still declined by name
    with pytest.raises(ValueError, match=r"block_c=64 with dropout: the O accumulator, S and P~ take 168"):
        _spec("fwd", head_dim=256, impl="wgmma", dropout=True, block_c=64)
    # the other families keep their quantum
    with pytest.raises(ValueError, match=r"block_c=24 must be a multiple of 16"):
        _spec("fwd", head_dim=128, impl="mma", block_c=24)


@pytest.mark.parametrize("kw", [
    dict(attn_mask=True, bias=True), dict(attn_mask=True, bias=True, bias_grad=True, causal=True),
    dict(attn_mask=True, softcap=True), dict(attn_mask=True, alibi=True), dict(attn_mask=True, dropout=True),
    dict(bias=True, bias_grad=True, dropout=True), dict(attn_mask=True, dropout=True, alibi=True),
    dict(attn_mask=True, bias=True, deterministic=True, varlen=True),
    dict(attn_mask=True, bias=True, bias_grad=True, softcap=True),
])
def test_the_d128_backward_with_the_mask_or_a_bias_beside_another_feature_takes_the_split_tile(kw) -> None:
    for d, dv in ((128, 128), (96, 96), (64, 128), (128, 64)):
        spec = _spec("bwd", head_dim=d, head_dim_v=dv, **kw)
        assert spec.impl == "wgmma" and B.split_dkv(spec.family_spec), spec
        assert (spec.tile.block_r, spec.tile.block_c, spec.num_warps) == (64, 64, 8)
    # the one-accumulator tile where it fits: the mask or a bias alone, d = 64
    for fits in (dict(head_dim=128, attn_mask=True), dict(head_dim=128, bias=True, bias_grad=True),
                 dict(head_dim=64, **kw)):
        spec = _spec("bwd", **fits)
        assert spec.impl == "wgmma" and not B.split_dkv(spec.family_spec), spec


@pytest.mark.parametrize("kw, why", [
    (dict(attn_mask=True, bias=True, bias_grad=True, alibi=True), "bias with alibi beside attn_mask: the wgmma "
                                                                  "backward's split tile"),
    (dict(attn_mask=True, bias=True, alibi=True, dropout=True), "bias with alibi beside attn_mask"),
    # a bias beside softcap or ALiBi without the mask: mma issues fewer than the split tile, the register bound stands
    (dict(bias=True, bias_grad=True, alibi=True), "and bias and alibi: .* more than 160"),
    (dict(bias=True, bias_grad=True, softcap=True), "and bias and softcap: .* more than 160"),
    (dict(attn_mask=True, dropout=True, window=True), "dropout beside attn_mask with a window or key padding"),
    (dict(bias=True, dropout=True, key_padding=True), "dropout beside bias with a window or key padding"),
    (dict(attn_mask=True, dropout=True, deterministic=True, softcap=True), "the deterministic order and softcap"),
    (dict(attn_mask=True, dropout=True, varlen=True, head_dim_v=64), "head_dim_v=64 and varlen"),
])
def test_what_the_split_tile_cannot_take_at_d128_is_declined_by_name(kw, why) -> None:
    assert _spec("bwd", head_dim=128, **kw).impl != "wgmma"
    with pytest.raises(ValueError, match=why.replace("~", r"\~")):
        _spec("bwd", head_dim=128, impl="wgmma", **kw)


def test_without_the_mask_or_a_bias_the_one_accumulator_tiles_rule_stands() -> None:
    """Dropout with ALiBi at d = 128: the split tile would issue more than mma (S^T and the per-element work twice),
    so it stays declined by the register bound (the deterministic order with ALiBi takes the 64 x 128 tile)."""
    assert _spec("bwd", head_dim=128, deterministic=True, alibi=True).impl == "wgmma"
    for kw in (dict(dropout=True, alibi=True),):
        assert _spec("bwd", head_dim=128, **kw).impl == "mma"
        with pytest.raises(ValueError, match="more than 160"):
            _spec("bwd", head_dim=128, impl="wgmma", **kw)


# --------------------------------------------------------------------------- numerics
#: (case, the key block / split tile the default specs must take, the backward's family)
CASES = [
    # forward d = 256 with a bias: 48 keys (the backward at d = 256 with a bias is mma's: the split tile's dK~
    # warpgroup would spill beside it)
    (FeatCase("fwd-bias-d256", dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=70, seqlen_k=101,
              head_dim=256, causal=True, bias=(1, 2, 70, 101)), 48, "mma"),
    # the d = 128 split tile: the mask and a bias with dBias, GQA, odd lengths, rows without keys
    (FeatCase("bwd-mask-bias-d128", dtype="float16", batch=2, heads=2, heads_kv=1, seqlen_q=67, seqlen_k=90,
              head_dim=128, mask=(2, 1, 67, 1), bias=(1, 2, 67, 90)), "split", "wgmma"),
    # forward d = 256 with dropout and ALiBi: 32 keys; the split tile's backward at d = 256 takes dropout
    (FeatCase("fwd-dropout-d256", dtype="float16", batch=1, heads=2, heads_kv=2, seqlen_q=50, seqlen_k=77,
              head_dim=256, dropout_p=0.2), 32, "wgmma"),
    (FeatCase("fwd-bias-dropout-softcap-d256", dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=45,
              seqlen_k=60, head_dim=256, softcap=3.0, dropout_p=0.25, bias=(1, 2, 45, 60), q_scale=2.0), 16, "mma"),
    (FeatCase("fwd-mask-alibi-d256", dtype="float16", batch=2, heads=2, heads_kv=2, seqlen_q=40, seqlen_k=70,
              head_dim=256, alibi="bh", mask=(2, 1, 40, 70)), 32, "mma"),
    (FeatCase("bwd-mask-dropout-d96", dtype="bfloat16", batch=1, heads=4, heads_kv=2, seqlen_q=80, seqlen_k=70,
              head_dim=96, causal=True, dropout_p=0.2, mask=(1, 4, 80, 70)), "split", "wgmma"),
    (FeatCase("bwd-mask-softcap-det-d128", dtype="float16", batch=1, heads=2, heads_kv=1, seqlen_q=90, seqlen_k=130,
              head_dim=128, softcap=4.0, q_scale=2.0, deterministic=True, mask=(1, 1, 90, 130)), "split", "wgmma"),
    # dBias with softcap on the split tile (the dK~ warpgroup's P^T pass stores it, the dV~ warpgroup's does not)
    (FeatCase("bwd-softcap-dbias-d192", dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=70, seqlen_k=90,
              head_dim=192, causal=True, softcap=4.0, q_scale=2.0, bias=(1, 2, 70, 90)), "split", "wgmma"),
    (FeatCase("bwd-mask-softcap-dbias-d128", dtype="float16", batch=2, heads=2, heads_kv=2, seqlen_q=50, seqlen_k=61,
              head_dim=128, softcap=3.0, q_scale=2.0, mask=(2, 1, 50, 61), bias=(2, 2, 50, 61)), "split", "wgmma"),
    # ALiBi at d = 256 beside a window: 48 keys, Nq != Nk; the split tile's backward
    (FeatCase("fwd-alibi-window-d256", dtype="float16", batch=1, heads=2, heads_kv=1, seqlen_q=60, seqlen_k=83,
              head_dim=256, alibi="bh", window=(30, 8)), 48, "wgmma"),
    (FeatCase("bwd-mask-alibi-window-d128", dtype="bfloat16", batch=2, heads=2, heads_kv=2, seqlen_q=64,
              seqlen_k=64, head_dim=128, alibi="bh", window=(20, 5), mask=(2, 2, 64, 64)), "split", "wgmma"),
]


def _default_specs(c: FeatCase, bwd_impl: str = "wgmma") -> tuple[KernelSpec, KernelSpec]:
    return specs(c, "wgmma", extra=H100, bwd_impl=bwd_impl)


def _assert_takes(c: FeatCase, want: int | str, bwd_impl: str) -> None:
    """The specs the case runs are the ones impl=None resolves to: the forward on wgmma at its key block, the
    backward on ``bwd_impl`` (the split tile where ``want`` says so)."""
    sf, sb = (KernelSpec(**{**s.model_dump(), "impl": None}) for s in _default_specs(c, bwd_impl))
    assert sf.impl == "wgmma" and sb.impl == bwd_impl, (sf, sb)
    if want == "split":
        assert B.split_dkv(sb.family_spec) and (sb.tile.block_r, sb.tile.block_c) == (64, 64)
    else:
        assert sf.tile.block_c == want


@pytest.mark.parametrize("c, want, bwd_impl", [pytest.param(*x, id=x[0].name, marks=() if n < 2 else pytest.mark.slow)
                                               for n, x in enumerate(CASES)])
def test_forward_and_backward_match_float64(c, want, bwd_impl) -> None:
    _assert_takes(c, want, bwd_impl)
    check_case(c, "wgmma", extra=H100, bwd_impl=bwd_impl)


# --------------------------------------------------------------------------- racecheck, PTX
#: A d = 128 split-tile backward with the mask, softcap and a bias with dBias (warpgroup 0's P^T pass stores it).
CHECK = FeatCase("check", dtype="bfloat16", batch=1, heads=2, heads_kv=1, seqlen_q=50, seqlen_k=60, head_dim=128,
                 causal=True, softcap=3.0, mask=(1, 1, 50, 60), bias=(1, 2, 50, 60))


@pytest.mark.slow
def test_a_d128_split_tile_backward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    t, opt = make_inputs(CHECK)
    sf, sb = _default_specs(CHECK)
    assert B.split_dkv(sb.family_spec)
    o, lse = F.attention_forward(t["q"], t["k"], t["v"], spec=sf, **opt)
    W.assert_clean_under_racecheck_and_asan(lambda: F.attention_backward(
        t["do"], t["q"], t["k"], t["v"], o, lse, spec=sb, bias_requires_grad=True, **opt))


@pytest.mark.slow
@W.PTX_OPT_IN
@pytest.mark.parametrize("c, bwd_impl", [(CASES[0][0], "mma"), (CASES[2][0], "wgmma"), (CASES[3][0], "mma"),
                                         (CHECK, "wgmma")], ids=["fwd-48-keys", "fwd-32-keys", "fwd-16-keys", "split-d128"])
def test_the_ptx_the_gpu_runs(c, bwd_impl) -> None:
    """The inline PTX of the d = 256 forward at 48, 32 and 16 keys (wgmma N of S, k steps of O += P V_j, the TMA
    boxes) and a d = 128 split-tile backward, translated and run on the CPU: the flash-attn criterion against the
    float64 oracle (opt-in: FAGEN_TEST_SLOW=1)."""
    with cpu.ptx() as record:
        sf, sb = check_case(c, "wgmma", extra=H100, bwd_impl=bwd_impl)
    assert {s for s, _, _ in record.launches} >= {sf.name, sb.name}
