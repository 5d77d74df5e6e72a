"""Huge scores: every family stays finite (and right) wherever the fp32 scores are finite.

The online softmax computes P~ = 2^(s sl2 - m sl2) as one FFMA against the rounded row maximum;
past |m sl2| ~ 2^31 that rounding alone is more than fp32's exponent range (the factor 2^(ulp/2)
overflowed P~ to inf and O to inf / inf = NaN on the tensor-core families). Rows that large take the
exact exponent (templates/partials/common.cuh); the backward gets what the fp32 lse cannot hold
of them from ``lse_lo``, the forward's optional output. Judged against the float64 reference with
flash-attn's criterion, PyTorch's float32 attention as the baseline (its same-dtype attention
overflows in fp16 at these magnitudes): |ours - ref64| <= 2 |torch32 - ref64| + 2 x the
reference's own rounding in the dtype.
"""
from __future__ import annotations

import math

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen import reference as R
from feature_harness import FeatCase, make_inputs, specs

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: families whose backward takes lse_lo (exact gradients of huge rows); the mma family's main
#: backward keeps the rounded fp32 lse (FlashAttention-2's precision: P within 2^(ulp(lse log2 e))
#: of the row's, rounded up past 2^24 so that P <= 1): its gradients of huge rows are judged
#: finite only (an exact path there cost 11% of its instructions at d = 64: docs/performance.md)
EXACT_BWD = {"simt", "wgmma"}
GRADS = ("dq", "dk", "dv", "dbias")
#: (family, arch): every family, both tensor-core archs of mma
FAMILIES = [("simt", "sm_90"), ("mma", "sm_80"), ("mma", "sm_90"), ("wgmma", "sm_90a")]
#: the largest input magnitude whose scores stay finite in fp32 at d = 64 (scale 1/8): fp16's
#: maximum, and for bf16 about 1.8e18 (scores ~2.6e37)
LARGEST = {"float16": 65504.0, "bfloat16": 1.8e18}


def _spec(direction: str, impl: str, arch: str, dtype: str, **flags) -> KernelSpec:
    return KernelSpec(direction=direction, impl=impl, arch=arch, head_dim=64, dtype=dtype, **flags)


def _run(impl: str, arch: str, q, k, v, do, *, lse_lo: bool = True, **opt):
    dtype = {v_: k_ for k_, v_ in DT.items()}[q.dtype]
    flags = {"causal": bool(opt.get("causal"))}
    lo = torch.empty(q.shape[0], q.shape[2], q.shape[1]) if lse_lo else None
    o, lse = F.attention_forward(q, k, v, spec=_spec("fwd", impl, arch, dtype, **flags), lse_lo=lo, **opt)
    dq, dk, dv = F.attention_backward(do, q, k, v, o, lse, spec=_spec("bwd", impl, arch, dtype, **flags),
                                      lse_lo=lo, **opt)
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _references(q, k, v, do, *, causal: bool = False):
    """(float64 reference, PyTorch baseline): fp32 attention with the 16-bit roundings every flash
    kernel makes -- P before P V and dV, dS before dQ and dK -- as PyTorch in the input dtype would
    (which at these magnitudes overflows in fp16 and rounds the scores away in bf16)."""
    o64, lse64 = R.attention_forward_ref(q, k, v, causal=causal)
    dq, dk, dv = R.attention_backward_ref(do, q, k, v, o64, lse64, causal=causal)
    dt, scale = q.dtype, 1 / math.sqrt(q.shape[-1])
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
    if causal:
        s = s.masked_fill(~R.mask_matrix(q.shape[0], q.shape[1], k.shape[1], causal=True), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    pr = p.to(dt).float()
    o = torch.einsum("bhij,bjhd->bihd", pr, vf)
    dp = torch.einsum("bihd,bjhd->bhij", dof, vf)
    delta = (dof * o).sum(-1).permute(0, 2, 1)[..., None]
    dsr = (p * (dp - delta)).to(dt).float()
    base = {"o": o, "lse": lse, "dq": torch.einsum("bhij,bjhd->bihd", dsr, kf) * scale,
            "dk": torch.einsum("bhij,bihd->bjhd", dsr, qf) * scale, "dv": torch.einsum("bhij,bihd->bjhd", pr, dof)}
    return {"o": o64, "lse": lse64, "dq": dq, "dk": dk, "dv": dv}, base


def _judge(ours: dict, ref: dict, base: dict, dtype: torch.dtype, what: str, *, grads: bool = True) -> None:
    """Finite wherever the reference is; within the criterion (gradients only with ``grads``)."""
    for name, r in ref.items():
        t = ours[name].double()
        fin = torch.isfinite(r)
        assert torch.isfinite(t[fin]).all(), f"{what}: {name} not finite where the reference is"
        if not fin.any() or (name in GRADS and not grads):
            continue
        err = (t[fin] - r[fin]).abs().max().item()
        err32 = (base[name].double()[fin] - r[fin]).abs().max().item()
        own = (r[fin].to(torch.float32 if name == "lse" else dtype).double() - r[fin]).abs().max().item()
        assert err <= 2 * err32 + 2 * own + 1e-30, f"{what}: {name} off by {err:.3g} (torch fp32 {err32:.3g}, rounding {own:.3g})"


@pytest.mark.parametrize("dtype,value", [("bfloat16", 133120.0), ("float16", 60000.0)])
@pytest.mark.parametrize("impl,arch", FAMILIES)
def test_torch_large_value_case(impl: str, arch: str, dtype: str, value: float) -> None:
    """torch's test_flash_atteention_large_bf16_nan_values (and its fp16 twin): q = k = v = value
    gives o = value exactly, a finite lse, dv = do and dq = dk = 0 (one key)."""
    q = torch.full((1, 1, 1, 64), value, dtype=DT[dtype])
    do = torch.linspace(-1, 1, 64, dtype=torch.float32).to(DT[dtype]).reshape(1, 1, 1, 64)
    out = _run(impl, arch, q, q, q, do)
    assert (out["o"].double() == value).all(), out["o"]
    # the fp32 dot product's own error bound, d 2^-24 sum |q k| (simt sums term by term)
    assert out["lse"].item() == pytest.approx(value * value * 64 / 8, rel=65 * 2 ** -24)
    if impl in EXACT_BWD:
        assert torch.equal(out["dv"], do)
    ref, base = _references(q, q, q, do)  # dq = dk = 0 up to the cancellation of dP - D
    _judge(out, ref, base, DT[dtype], f"{impl}/{arch}", grads=impl in EXACT_BWD)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("impl,arch", FAMILIES)
def test_equal_huge_scores_are_a_uniform_softmax(impl: str, arch: str, dtype: str) -> None:
    """Exact arithmetic at the largest magnitude: every key scores the same (~1e10 to 1e37), so
    P = 1 / Nk exactly and lse = s + log Nk -- which the fp32 lse rounds away: the backward's
    exact gradients need lse_lo (EXACT_BWD). Without it, and on mma, they stay finite."""
    dt, a = DT[dtype], LARGEST[dtype]
    g = torch.Generator().manual_seed(5)
    q = torch.full((1, 5, 2, 64), a, dtype=dt)
    q[:, 2] = -a  # a row of equally huge negative scores
    k = torch.full((1, 37, 2, 64), a, dtype=dt)
    v, do = torch.randn(1, 37, 2, 64, generator=g).to(dt), torch.randn(1, 5, 2, 64, generator=g).to(dt)
    ref, base = _references(q, k, v, do)
    _judge(_run(impl, arch, q, k, v, do), ref, base, dt, f"{impl}/{arch}", grads=impl in EXACT_BWD)
    plain = _run(impl, arch, q, k, v, do, lse_lo=False)
    for name, t in plain.items():
        assert torch.isfinite(t).all(), f"without lse_lo: {name} not finite"


def _sweep_inputs(dtype: str, magnitude: float, seqlen_q: int = 19, seqlen_k: int = 45):
    """randn q, k of this magnitude, some rows tiny (1e-3 of it), a row whose keys score +-huge
    (more apart than fp32's exponent range); v, do of order 1."""
    g = torch.Generator().manual_seed(int(math.log10(magnitude)) + 11)
    dt = DT[dtype]
    q = (torch.rand(2, seqlen_q, 2, 64, generator=g) * 2 - 1) * magnitude  # within the dtype's range
    k = (torch.rand(2, seqlen_k, 2, 64, generator=g) * 2 - 1) * magnitude
    q[:, 3::5] *= 1e-3
    k[:, 1::4] *= 1e-3
    q[:, 0] = magnitude
    k[:, 0::2, 0] = magnitude
    k[:, 1::2, 0] = -magnitude
    v, do = torch.randn(2, seqlen_k, 2, 64, generator=g), torch.randn(2, seqlen_q, 2, 64, generator=g)
    return q.to(dt), k.to(dt), v.to(dt), do.to(dt)


@pytest.mark.parametrize("dtype,causal", [("float16", False), ("bfloat16", True)])
@pytest.mark.parametrize("impl,arch", FAMILIES)
def test_magnitude_sweep(impl: str, arch: str, dtype: str, causal: bool) -> None:
    """Magnitudes from ordinary to the dtype's largest, each against the float64 reference."""
    mags = [1.0, 30.0, 1e3] + ([LARGEST[dtype]] if dtype == "float16" else [1e9, LARGEST[dtype]])
    for mag in mags:
        q, k, v, do = _sweep_inputs(dtype, mag)
        ref, base = _references(q, k, v, do, causal=causal)
        # ordinary magnitudes: every family's gradients; past them the rounded lse's (see EXACT_BWD)
        grads = impl in EXACT_BWD or mag <= 30
        _judge(_run(impl, arch, q, k, v, do, causal=causal), ref, base, DT[dtype], f"{impl}/{arch} |x|={mag:g}",
               grads=grads)


#: the features on a large-score row: scores of ~1e9 (bf16 inputs of ~2e4 at d = 32)
FEATURES = [
    FeatCase("softcap", dtype="bfloat16", softcap=30.0, q_scale=2e4),
    FeatCase("alibi", dtype="bfloat16", alibi="h", q_scale=2e4),
    FeatCase("bias", dtype="bfloat16", bias=(1, 4, 37, 45), q_scale=2e4),
    FeatCase("dropout", dtype="bfloat16", dropout_p=0.17, q_scale=2e4),
    FeatCase("window", dtype="bfloat16", causal=True, window=(7, 0), q_scale=2e4),
    FeatCase("varlen", dtype="bfloat16", lens=((37, 45), (5, 9), (20, 1)), q_scale=2e4),
    FeatCase("gqa", dtype="bfloat16", heads_kv=2, q_scale=2e4),
]


@pytest.mark.parametrize("case", FEATURES, ids=str)
@pytest.mark.parametrize("impl,arch", [f for f in FAMILIES if f != ("mma", "sm_80")])  # sm_80: the sweep's
def test_features_at_large_scores(impl: str, arch: str, case: FeatCase) -> None:
    """Every feature on huge scores (k scaled like q: |s| ~ 1e9): finite wherever the reference is,
    and within flash-attn's criterion (PyTorch in bf16) of the float64 reference."""
    sf, sb = specs(case, impl, extra={"arch": arch})
    t, opt = make_inputs(case)
    t["k"] = (t["k"].float() * case.q_scale).to(t["k"].dtype)
    lo = torch.empty(t["q"].shape[1], t["q"].shape[0]) if case.lens else torch.empty(
        t["q"].shape[0], t["q"].shape[2], t["q"].shape[1])
    o, lse = F.attention_forward(t["q"], t["k"], t["v"], spec=sf, lse_lo=lo, **opt)
    grads = F.attention_backward(t["do"], t["q"], t["k"], t["v"], o, lse, spec=sb, lse_lo=lo,
                                 bias_requires_grad=case.bias is not None, **opt)
    rkw = {k_: v_ for k_, v_ in opt.items() if k_ not in ("seed", "offset", "max_seqlen_q", "max_seqlen_k")}
    if case.dropout_p:
        rkw["keep_mask"] = F.dropout_keep_mask(case.batch, case.heads, case.seqlen_q, case.seqlen_k, case.dropout_p,
                                               seed=case.seed, offset=3)
    o64, lse64 = R.attention_forward_ref(t["q"], t["k"], t["v"], **rkw)
    r = R.attention_backward_ref(t["do"], t["q"], t["k"], t["v"], o64, lse64, bias_requires_grad=case.bias is not None,
                                 **rkw)
    # flash-attn's criterion as it stands: PyTorch in the input dtype (bf16 has fp32's range)
    leaves = {n: t[n].detach().clone().requires_grad_(True) for n in "qkv"}
    tkw = dict(rkw)
    if case.bias is not None:
        leaves["bias"] = opt["attn_bias"].detach().clone().requires_grad_(True)
        tkw["attn_bias"] = leaves["bias"]
    o32 = R.attention_ref_torch(leaves["q"], leaves["k"], leaves["v"], **tkw)
    o32.backward(t["do"])
    ours = {"o": o, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    ref = {"o": o64, "dq": r[0], "dk": r[1], "dv": r[2]}
    base = {"o": o32.detach(), "dq": leaves["q"].grad, "dk": leaves["k"].grad, "dv": leaves["v"].grad}
    if case.bias is not None:
        ours["dbias"], ref["dbias"], base["dbias"] = grads[3], r[3], leaves["bias"].grad
    assert torch.isfinite(lse[torch.isfinite(lse64)]).all()
    _judge(ours, ref, base, torch.bfloat16, f"{impl}/{arch} {case}", grads=impl in EXACT_BWD)


@pytest.mark.parametrize("dtype,arch", [(torch.float32, None), (torch.bfloat16, "sm_90a")], ids=["simt", "wgmma"])
def test_autograd_keeps_lse_lo(dtype: torch.dtype, arch: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the autograd ops (flash_attn_func): the forward's lse_lo reaches the backward, so a
    family that takes it (float32 inputs: simt; bf16 on sm_90a: wgmma) gives huge rows exact
    gradients there too (equal keys: P = 1 / Nk, dV_j = sum_i dO_i / Nk)."""
    from fagen import flash_attn_func
    from fagen import settings

    if arch is not None:
        monkeypatch.setenv("FAGEN_EMULATE_ARCH", arch)
    settings.reset()
    try:
        a = 133120.0  # scores 1.4e11: lse log2 e ~ 2^37.6, within lse_lo's exact range (common.cuh)
        g = torch.Generator().manual_seed(2)
        q = torch.full((1, 3, 1, 64), a, dtype=dtype)
        k = torch.full((1, 9, 1, 64), a, dtype=dtype)
        v = torch.randn(1, 9, 1, 64, generator=g).to(dtype).requires_grad_(True)
        do = torch.randn(1, 3, 1, 64, generator=g).to(dtype)
        flash_attn_func(q, k, v).backward(do)
        dv_ref = (do.double().sum(1, keepdim=True) / 9).expand(1, 9, 1, 64)
        torch.testing.assert_close(v.grad.double(), dv_ref, rtol=2e-2, atol=2e-2)
    finally:
        monkeypatch.delenv("FAGEN_EMULATE_ARCH", raising=False)
        settings.reset()


def test_lse_lo_is_checked_before_anything_runs() -> None:
    """A wrong lse_lo is a typed error naming it, in the forward (an output: contiguous float32 of
    lse's shape) and the backward (empty inputs included, where nothing launches)."""
    from fagen.errors import InputError, InputTypeError

    q = torch.randn(1, 5, 1, 64).to(torch.float16)
    with pytest.raises(InputError, match="lse_lo"):
        F.attention_forward(q, q, q, lse_lo=torch.empty(1, 1, 4))
    with pytest.raises(InputTypeError, match="lse_lo"):
        F.attention_forward(q, q, q, lse_lo=torch.empty(1, 1, 5, dtype=torch.float64))
    with pytest.raises(InputError, match="lse_lo"):
        F.attention_forward(q, q, q, lse_lo=torch.empty(1, 1, 10)[..., ::2])
    e = q[:, :0]
    with pytest.raises(InputError, match="lse_lo"):
        F.attention_backward(e, e, e, e, e, torch.empty(1, 1, 0), lse_lo=torch.empty(1, 1, 1))
