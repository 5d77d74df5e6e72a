"""Every feature through each kernel family's kernels, on the CPU emulator (SIMT implements all).

GQA/MQA, varlen (lengths 0 and 1 included), sliding window, causal alignment, softcap,
ALiBi, bool attn_mask, additive bias with its gradient, deterministic backward, float64 and
head dims that are not multiples of 8 -- alone and combined -- judged by the feature harness
(tests/feature_harness.py: fagen.reference in float64, flash-attn's criterion). Every kernel runs
from an explicit spec of the family under test (``IMPLS``: every registered family; a case whose
features a family does not implement is skipped for it, with the family's reason). Also: the
deterministic backward is bit for bit the same under the emulator's reverse schedule (block and
thread order) while the atomic one is not, and its source has no atomics; the dropout keep-mask of
packed sequences is ``dropout_keep_mask`` bit for bit; every flag compiles with NVRTC for sm_80 and
sm_90 without spills.
"""
from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch

import fagen.functional as F
import fagen.settings
from fagen import KernelSpec
from fagen.families import FamilySpec, family_names, get_family
from feature_harness import CASES, FeatCase, cu_seqlens, check_case, make_inputs, run_kernels, spec_or_skip, specs

IMPLS = list(family_names())  # a family runs the cases whose features it implements (the others skip)




@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_feature_numerics(case: FeatCase, impl: str) -> None:
    check_case(case, impl)


def test_cases_cover_every_feature() -> None:
    """The matrix above uses each issue-11 feature at least once (and the combination)."""
    used = set()
    for c in CASES:
        for impl_spec in specs(c, "simt"):  # the family that implements them all
            used |= impl_spec.features
        if c.heads_kv != c.heads:
            used.add("gqa")
        if c.head_dim % 8:
            used.add("padded_head_dim")
    assert used >= {"top_left", "window", "softcap", "alibi", "attn_mask", "bias", "bias_grad", "varlen",
                    "deterministic", "float64", "gqa", "padded_head_dim"}


# --------------------------------------------------------------------------- deterministic backward
DET = FeatCase("det-schedule", "float32", batch=2, heads=4, heads_kv=2, seqlen_q=40, seqlen_k=150, head_dim=16,
               causal=True, softcap=4.0, dropout_p=0.1, tile=(16, 16, 2))


def det_case(impl: str) -> FeatCase:
    """DET in float32 where the family takes it, else float16 (the tensor-core family)."""
    fp32 = get_family(impl).unsupported_reason(FamilySpec("bwd", DET.head_dim, "float32", "sm_80")) is None
    return DET if fp32 else replace(DET, dtype="float16")


def _grads_under(schedule: str, c: FeatCase, impl: str) -> dict[str, torch.Tensor]:
    """The kernels' outputs under an emulator schedule, plus ``dq_accum``: the backward's fp32 dQ
    accumulator (the backward's last float32 allocation shaped like q, torch.empty or torch.empty_like), whose bits
    a float16 dq would round away."""
    made: list[torch.Tensor] = []

    def recording(real):
        def alloc(*args, **kwargs):
            made.append(real(*args, **kwargs))
            return made[-1]
        return alloc

    fagen.settings.configure(emu_schedule=schedule)
    try:
        t, opt = make_inputs(c)
        with mock.patch.object(torch, "empty", recording(torch.empty)), \
                mock.patch.object(torch, "empty_like", recording(torch.empty_like)):
            out = run_kernels(c, impl, t, opt)
    finally:
        fagen.settings.reset()
    out["dq_accum"] = [x for x in made if x.dtype == torch.float32 and x.shape == t["q"].shape][-1]
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_backward_is_schedule_independent(impl: str) -> None:
    """Reverse block and thread order: the deterministic backward gives bitwise the same dQ, dK, dV;
    the atomic dQ of the default backward changes its rounding (so the probe can tell them apart)."""
    base = det_case(impl)
    det = replace(base, deterministic=True)
    fwd_order, rev_order = _grads_under("forward", det, impl), _grads_under("reverse", det, impl)
    for name in ("o", "lse", "dq_accum", "dq", "dk", "dv"):
        assert torch.equal(_bits(fwd_order[name]), _bits(rev_order[name])), name
    a, b = _grads_under("forward", base, impl), _grads_under("reverse", base, impl)
    assert not torch.equal(_bits(a["dq_accum"]), _bits(b["dq_accum"])), "the atomic dQ should depend on the block order"
    torch.testing.assert_close(a["dq_accum"], b["dq_accum"], rtol=1e-5, atol=1e-5)
    # the two modes differ in summation order (and, on tensor cores, in which fp16 rounding of dS feeds dQ)
    tol = 1e-5 if base.dtype == "float32" else 2e-3
    torch.testing.assert_close(a["dq_accum"], fwd_order["dq_accum"], rtol=tol, atol=tol)
    for name in ("dk", "dv"):  # on chip in both modes (GQA included): no atomics
        assert torch.equal(_bits(a[name]), _bits(b[name])), name


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_backward_reduces_dq_in_a_kernel_of_its_own(impl: str) -> None:
    """The deterministic backward has the dq role (dQ summed in a fixed order there); whether any of its
    kernels still reduces with atomics is a property of the machine code (test_deterministic_sass_has_no_atomics:
    the reductions live in shared device functions, so the source text cannot tell)."""
    from fagen.renderer import render

    _, det = specs(replace(det_case(impl), deterministic=True, bias=(1, 4, 40, 150)), impl)
    _, atomic = specs(det_case(impl), impl)
    assert [k.role.name for k in render(det).kernels] == ["pre", "main", "dq", "post"]
    assert "dq" not in [k.role.name for k in render(atomic).kernels]


# --------------------------------------------------------------------------- dropout keep-mask, packed
@pytest.mark.parametrize("impl", IMPLS)
def test_varlen_gqa_dropout_applies_the_keep_mask(impl: str) -> None:
    """q = 0 makes P uniform over a sequence's keys; v = identity rows per sequence makes
    o[token, h, j] = Z[b, h, i, j] / ((1 - p) len_k): the mask of (b, h, row, col) inside each
    packed sequence is dropout_keep_mask's, bit for bit."""
    p, seed, offset, d, H, Hkv = 0.4, 11, 2**33 + 5, 64, 4, 2
    lens = [(23, 64), (0, 9), (1, 1), (40, 17)]
    cq, ck = cu_seqlens([a for a, _ in lens]), cu_seqlens([b for _, b in lens])
    q = torch.zeros(int(cq[-1]), H, d)
    k = torch.randn(int(ck[-1]), Hkv, d)
    v = torch.cat([torch.eye(d)[:lk] for _, lk in lens])[:, None, :].expand(-1, Hkv, d).contiguous()
    sf = spec_or_skip(impl, direction="fwd", head_dim=d, dtype="float32", dropout=True, varlen=True)
    Mq, Mk = max(a for a, _ in lens), max(b for _, b in lens)
    o, _ = F.attention_forward(q, k, v, dropout_p=p, seed=seed, offset=offset, cu_seqlens_q=cq, cu_seqlens_k=ck,
                               max_seqlen_q=Mq, max_seqlen_k=Mk, spec=sf)
    keep = F.dropout_keep_mask(len(lens), H, Mq, Mk, p, seed=seed, offset=offset)
    for b, (lq, lk) in enumerate(lens):
        ob = o[int(cq[b]):int(cq[b + 1])]  # [lq, H, d]
        applied = (ob > 0).permute(1, 0, 2)[:, :, :lk]  # [H, lq, lk]
        assert torch.equal(applied, keep[b, :, :lq, :lk]), b
        assert not (ob[..., lk:] != 0).any()
        kept = ob[ob > 0]
        assert torch.allclose(kept, torch.full_like(kept, 1.0 / ((1 - p) * lk)), rtol=1e-6)


# --------------------------------------------------------------------------- NVRTC: every flag, no spills
def _nvrtc_available() -> bool:
    try:
        from fagen import nvrtc

        nvrtc.toolchain_id()
        return True
    except Exception:  # noqa: BLE001 - any missing piece of the toolchain
        return False


ALL_FLAGS = dict(causal=True, dropout=True, window=True, softcap=True, alibi=True, attn_mask=True, bias=True,
                 causal_align="top_left")


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", ["fp16-d128", "bf16-d256-varlen", "fp64-d64"])
def test_every_flag_compiles_without_spills(variant: str, arch: str, impl: str) -> None:
    import fagen

    dtype, d = {"fp16-d128": ("float16", 128), "bf16-d256-varlen": ("bfloat16", 256),
                "fp64-d64": ("float64", 64)}[variant]
    extra = {"varlen": True} if "varlen" in variant else {"key_padding": True}
    for direction, more in (("fwd", {}), ("bwd", {"bias_grad": True}), ("bwd", {"bias_grad": True,
                                                                              "deterministic": True})):
        spec = spec_or_skip(impl, direction=direction, head_dim=d, dtype=dtype, arch=arch, **ALL_FLAGS, **extra,
                            **more)
        for r in fagen.compile(spec).resources:
            assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0, (spec.name, r)


def _nvdisasm_available() -> bool:
    from fagen import sass

    return _nvrtc_available() and sass.nvdisasm_path() is not None


@pytest.mark.skipif(not _nvdisasm_available(), reason="NVRTC or nvdisasm not installed")
@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_sass_has_no_atomics(impl: str) -> None:
    """In the machine code: the deterministic backward has no global reduction or atomic (RED/ATOM)
    in any kernel; the default one reduces dQ with RED in its main kernel (the probe sees them)."""
    import fagen
    from fagen import sass

    def reductions(deterministic: bool) -> dict[str, list[str]]:
        spec = spec_or_skip(impl, head_dim=64, dtype="float16", causal=True, deterministic=deterministic,
                            arch="sm_80")
        mix = sass.instruction_mix(fagen.compile(spec).cubin)
        return {k: sorted(op for op in m if op.startswith(("RED", "ATOM"))) for k, m in mix.items()}

    det = reductions(True)
    assert len(det) == 4 and not any(det.values()), det
    assert any(ops for name, ops in reductions(False).items() if name.endswith("_main"))
