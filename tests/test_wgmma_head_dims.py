"""The Hopper family (``wgmma``, sm_90a) at every head dim that is a multiple of 8 in 8..256: each
computed in whole 128-byte panels (``padded_dim``: 64, 128, 192, 256), the TMA's zero fill past the
real head dim adding nothing, O / dQ / dK / dV written for the real columns only. Selection (which
dims resolve to wgmma, what is declined by name), both directions on the CPU emulator against the
float64 oracle with flash-attn's criterion (fp16 / bf16, odd numbers of 8-column groups, a v head dim
of its own, the split tile past 128, causal, GQA, Nq != Nk, lengths off the tiles, rows with no key,
softcap, dropout, varlen), outputs written into views of wider tensors (the columns past the head dim
untouched), racecheck and AddressSanitizer of a backward and one forward / backward pair at the PTX
level (opt-in, FAGEN_TEST_SLOW=1). Sweeps past the first case of each direction are in the slow tier."""
from __future__ import annotations

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen.families import get_family
from fagen.runtime import cpu

import wgmma_cases as W

# --------------------------------------------------------------------------- selection
PADDED = (8, 16, 32, 40, 48, 56, 72, 80, 88, 104, 112, 120, 136, 160, 176, 200, 224, 248)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_every_multiple_of_8_resolves_to_wgmma(direction) -> None:
    for d in PADDED:
        spec = KernelSpec(direction=direction, head_dim=d, arch="sm_90a", dtype="float16")
        assert spec.impl == "wgmma", spec
    for d, dv in ((160, 128), (40, 64), (80, 112), (224, 136)):
        spec = KernelSpec(direction=direction, head_dim=d, head_dim_v=dv, arch="sm_90a", dtype="bfloat16")
        assert spec.impl == "wgmma", spec


def test_the_tiles_are_the_padded_head_dims() -> None:
    """A padded head dim takes its panel width's tile: the backward's Q rows, the split tile past 128."""
    from fagen.families.wgmma import bwd, padded_dim

    assert [padded_dim(d) for d in (8, 40, 64, 72, 136, 200, 256)] == [64, 64, 64, 128, 192, 256, 256]
    for d, want in ((32, 128), (80, 64), (112, 64)):
        assert KernelSpec(direction="bwd", head_dim=d, arch="sm_90a").tile.block_r == want, d
    spec = KernelSpec(direction="bwd", head_dim=160, arch="sm_90a")
    assert bwd.split_dkv(spec.family_spec) and (spec.tile.block_r, spec.tile.block_c) == (64, 64)


@pytest.mark.parametrize("direction, d, feature", [
    ("fwd", 40, "softcap"), ("bwd", 112, "softcap"), ("fwd", 80, "alibi"), ("fwd", 48, "alibi"), ("bwd", 16, "alibi"),
    ("fwd", 16, "dropout"),
])
def test_a_padded_head_dim_that_costs_more_than_mma_is_declined_by_name(direction, d, feature) -> None:
    """Per-score features cost the padding too (heads.MAX_PADDING, measured): where the padded kernel issues
    more instructions per real FLOP than mma's, impl=None resolves to mma and impl=wgmma names why."""
    fields = dict(direction=direction, head_dim=d, arch="sm_90a", dtype="float16", **{feature: True})
    assert KernelSpec(**fields).impl == "mma"
    with pytest.raises(ValueError, match=rf"head_dim={d}, head_dim_v={d} with {feature}: the padded wgmma"):
        KernelSpec(**fields, impl="wgmma")
    for native in (64, 96, 128):  # the panel widths and d = 96 take the features as before
        assert KernelSpec(**{**fields, "head_dim": native}).impl == "wgmma"


def test_padding_is_padded_over_real_flops() -> None:
    from fagen.families.wgmma.heads import padding

    fs = lambda direction, d, dv: KernelSpec(direction=direction, head_dim=d, head_dim_v=dv, arch="sm_90a").family_spec
    assert padding(fs("fwd", 8, 8)) == 8 and padding(fs("bwd", 40, 40)) == 1.6 and padding(fs("fwd", 64, 64)) == 1
    assert padding(fs("fwd", 160, 128)) == (192 + 128) / 288 and padding(fs("bwd", 160, 128)) == (3 * 192 + 256) / 736


@pytest.fixture
def on_sm90a(monkeypatch: pytest.MonkeyPatch):
    """CPU tensors take sm_90a's specs for the test (``fagen.settings``' emulate_arch); yields the specs
    of the CPU modules the launches use, in order."""
    from fagen import settings

    monkeypatch.delenv("FAGEN_EMULATE_ARCH", raising=False)
    settings.reset()
    settings.configure(emulate_arch="sm_90a")
    seen: list[KernelSpec] = []
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda spec, *a, **kw: seen.append(spec) or real(spec, *a, **kw))
    yield seen
    settings.reset()


def test_a_head_dim_off_the_multiples_of_8_reaches_wgmma_through_the_public_api(on_sm90a) -> None:
    """d = 59 through flash_attn_func and autograd: the functional layer pads q, k, v to 64 for every
    family, and the padded call runs on wgmma both ways; against the float64 oracle."""
    import fagen

    c = dict(d=59, dtype="float16", B=1, Nq=40, Nk=50, H=2, Hkv=1, causal=True)
    t = W.inputs(c, seed=5)
    q, k, v = (t[n].clone().requires_grad_() for n in ("q", "k", "v"))
    o = fagen.flash_attn_func(q, k, v, causal=True)
    o.backward(t["do"])
    assert o.shape == (1, 40, 2, 59) and q.grad.shape == q.shape
    assert {s.direction for s in on_sm90a} >= {"fwd", "bwd"}
    assert all(s.impl == "wgmma" and s.head_dim == 64 for s in on_sm90a if s.direction in ("fwd", "bwd"))
    o64, _, g64 = W.oracle(c, t, torch.float64, grads=True)
    for ours, ref in zip((o, q.grad, k.grad, v.grad), (o64, *g64)):
        assert (ours.double() - ref).abs().max() < 2e-2


# --------------------------------------------------------------------------- numerics
FWD_CASES = [
    # an odd number of 8-column groups (the last k16 step half zero fill), causal, GQA, Nq != Nk
    dict(d=40, dtype="float16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True),
    dict(d=32, dtype="float16", nw=4, B=2, Nq=70, Nk=90, H=2, Hkv=2),
    dict(d=80, dtype="bfloat16", nw=8, B=1, Nq=150, Nk=100, H=2, Hkv=1, causal=True, kpm=True),  # rows with no key
    dict(d=112, dtype="float16", nw=8, B=2, Nq=90, Nk=130, H=2, Hkv=1, alibi=True),
    dict(d=160, dv=128, dtype="float16", nw=8, B=1, Nq=70, Nk=130, H=2, Hkv=1, causal=True, align="top_left"),
    dict(d=224, dtype="bfloat16", nw=8, B=1, Nq=90, Nk=70, H=1, Hkv=1, window=(30, 5)),
    dict(d=8, dtype="float16", nw=8, B=1, Nq=100, Nk=200, H=2, Hkv=2, causal=True, align="top_left"),
]


@pytest.mark.parametrize("c", W.slow(FWD_CASES))
def test_forward_matches_float64(c) -> None:
    t = W.inputs(c, scale=2.0)
    spec = W.spec("fwd", c)
    assert spec.impl == "wgmma", spec
    o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **W.options(c, t))
    W.check_forward(c, t, o, lse)


BWD_CASES = [
    dict(d=40, dtype="bfloat16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True),
    dict(d=32, dtype="float16", nw=8, B=2, Nq=70, Nk=100, H=2, Hkv=1, kpm=True),
    dict(d=80, dtype="bfloat16", B=1, Nq=130, Nk=100, H=2, Hkv=1, causal=True, alibi=True),
    # the split tile (past 128): d = 160 with a v head dim of its own, d = 224
    dict(d=160, dv=128, dtype="float16", nw=8, B=1, Nq=70, Nk=90, H=2, Hkv=1, causal=True),
    dict(d=224, dtype="bfloat16", nw=8, B=1, Nq=90, Nk=70, H=1, Hkv=1, causal=True, align="top_left"),
    dict(d=16, dv=48, dtype="float16", nw=8, B=1, Nq=50, Nk=60, H=2, Hkv=2, window=(20, 3)),
]


@pytest.mark.parametrize("c", W.slow(BWD_CASES))
def test_backward_matches_float64(c) -> None:
    t = W.inputs(c, scale=2.0)
    spec = W.spec("bwd", c)
    assert spec.impl == "wgmma", spec
    W.check_backward(c, t, *W.backward(c, t, spec))


# dropout (the keep bits of every family) and packed sequences at padded head dims
@pytest.mark.slow
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_dropout_at_a_padded_head_dim(direction) -> None:
    c = dict(d=48, dtype="bfloat16", B=1, Nq=130, Nk=90, H=2, Hkv=1, causal=True, dropout=0.2)
    t = W.inputs(c)
    spec = W.dropout_spec(direction, c)
    assert spec.impl == "wgmma", spec
    if direction == "fwd":
        o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **W.dropout_options(c, t))
        W.check_dropout_forward(c, t, o, lse)
    else:
        W.check_backward(c, t, *W.dropout_backward(c, t, spec))


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_varlen_at_a_padded_head_dim(direction) -> None:
    c = dict(d=72, dtype="float16", nw=8, lens=((70, 90), (1, 5), (0, 9), (130, 64)), H=2, Hkv=1, causal=True)
    t = W.varlen_inputs(c)
    spec = W.varlen_spec(direction, c)
    assert spec.impl == "wgmma", spec
    if direction == "fwd":
        o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **W.varlen_options(c, t))
        W.check_varlen_forward(c, t, o, lse)
    else:
        W.check_varlen_backward(c, t, *W.varlen_backward(c, t, spec))


# --------------------------------------------------------------------------- the columns past the head dim
@pytest.mark.slow
@pytest.mark.parametrize("d", [40, 160])
def test_the_columns_past_the_head_dim_are_never_read(d) -> None:
    """q, k, v and dO as views of tensors a panel wider whose columns past d are NaN (the tensor maps take
    the views' d and strides): the outputs and gradients equal, bit for bit, those of contiguous inputs, so
    the padded columns the wgmmas compute come from the TMA's zero fill alone."""
    c = dict(d=d, dtype="float16", nw=8, B=1, Nq=70, Nk=90, H=2, Hkv=1, causal=True)
    t = W.inputs(c)
    fwd, bwd = W.spec("fwd", c), W.spec("bwd", c)
    assert fwd.impl == bwd.impl == "wgmma"

    def run(t):
        o, lse = F.run_forward(fwd, t["q"], t["k"], t["v"], **W.options(c, t))
        return (o, lse, *F.run_backward(bwd, t["do"], t["q"], t["k"], t["v"], o, lse, **W.options(c, t)))

    def wide(x):
        w = torch.full((*x.shape[:-1], x.shape[-1] + 64), float("nan"), dtype=x.dtype)
        w[..., :d] = x
        return w[..., :d]

    want = run(t)
    got = run({**t, **{n: wide(t[n]) for n in ("q", "k", "v", "do")}})
    for a, b in zip(want, got):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: A backward at an odd number of 8-column groups (d = 40: the last k16 step half zero fill), causal, key
#: padding, GQA, Nq and Nk ending inside a tile.
CHECK_BWD = dict(d=40, dtype="float16", nw=8, B=1, Nq=50, Nk=60, H=2, Hkv=1, causal=True, kpm=True)


@pytest.mark.slow
def test_a_padded_backward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    t = W.inputs(CHECK_BWD, seed=32)
    spec = W.spec("bwd", CHECK_BWD)
    assert spec.impl == "wgmma"
    W.assert_clean_under_racecheck_and_asan(lambda: W.backward(CHECK_BWD, t, spec)[0])


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_and_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs for a padded forward and backward (d = 40), translated and run on the
    CPU: the flash-attn criterion against the float64 oracle (opt-in: FAGEN_TEST_SLOW=1)."""
    c = dict(d=40, dtype="float16", nw=4, B=1, Nq=70, Nk=90, H=2, Hkv=1, causal=True)
    t = W.inputs(c, seed=41)
    fwd, bwd = W.spec("fwd", c), W.spec("bwd", c)
    with cpu.ptx() as record:
        o, lse = F.run_forward(fwd, t["q"], t["k"], t["v"], **W.options(c, t))
        grads, g64, g_pt = W.backward(c, t, bwd)
    assert {s for s, _, _ in record.launches} == {fwd.name, bwd.name}
    W.check_forward(c, t, o, lse)
    W.check_backward(c, t, grads, g64, g_pt)
