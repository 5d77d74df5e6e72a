"""Issue 11 features through each kernel family's kernels, on the CPU emulator (SIMT implements all).

GQA/MQA, varlen (lengths 0 and 1 included), sliding window, causal alignment, softcap,
ALiBi, bool attn_mask, additive bias with its gradient, deterministic backward, float64 and
head dims that are not multiples of 8 -- alone and combined -- against fagen.reference in
float64 with flash-attn's criterion (tests/numerics.py): |ours - ref64| <= 2 |torch same
dtype - ref64| + atol. Every kernel runs from an explicit spec of the family under test
(``IMPLS``: every registered family; a case whose features a family does not implement is
skipped for it, with the family's reason). Also: the deterministic backward is bit for bit the
same under the emulator's reverse schedule (block and thread order) while the atomic one
is not, and its source has no atomics; the dropout keep-mask of packed sequences is
``dropout_keep_mask`` bit for bit; every flag compiles with NVRTC for sm_80 and sm_90
without spills.
"""
from __future__ import annotations

import itertools
from unittest import mock
from dataclasses import dataclass, field, replace

import pytest
import torch
from pydantic import ValidationError

import fagen.functional as F
import fagen.settings
from fagen import KernelSpec
from fagen import reference as R
from fagen.families import FamilySpec, family_names, get_family
from featref import assert_lse_close, flash_criterion
from featref import attention as attention_oracle

IMPLS = list(family_names())  # a family runs the cases whose features it implements (the others skip)
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
#: flash-attn's atol per dtype (tests/numerics.py); float64: the kernels keep lse, D and the dQ accumulator
#: in fp32 and take the scale as an fp32 argument (fagen.abi), so they agree to ~1e-7 relative.
ATOL = {"float16": 2e-4, "bfloat16": 2e-3, "float32": 2e-6, "float64": 2e-6}


@dataclass(frozen=True)
class FeatCase:
    name: str
    dtype: str = "float16"
    batch: int = 2
    heads: int = 4
    heads_kv: int = 4
    seqlen_q: int = 37
    seqlen_k: int = 45
    head_dim: int = 32
    causal: bool = False
    window: tuple[int, int] | None = None
    align: str = "bottom_right"
    softcap: float = 0.0
    alibi: str | None = None  # "h": slopes [H]; "bh": [B, H]
    mask: tuple[int, ...] | None = None  # shape broadcastable to [B, H, Nq, Nk]
    bias: tuple[int, ...] | None = None  # shape broadcastable to [B, H, Nq, Nk]; its gradient is checked
    dropout_p: float = 0.0
    lens: tuple[tuple[int, int], ...] | None = None  # varlen: (len_q, len_k) per sequence
    deterministic: bool = False
    q_scale: float = 1.0  # larger scores (softcap, fp32 overflow margins)
    tile: tuple[int, int, int] | None = None  # (block_r, block_c, num_warps): small tiles = many blocks per sequence
    seed: int = field(default=7)

    def __str__(self) -> str:
        return self.name


CASES = [
    FeatCase("gqa-causal-fp16", heads=6, heads_kv=2, seqlen_q=37, seqlen_k=61, causal=True, tile=(16, 16, 1)),
    FeatCase("mqa-window-bf16", "bfloat16", batch=1, heads=4, heads_kv=1, seqlen_q=45, seqlen_k=33, head_dim=40,
             window=(9, 4), tile=(16, 16, 2)),
    FeatCase("window-causal-nq>nk-fp16", seqlen_q=50, seqlen_k=29, window=(6, -1), causal=True,  # top rows: none
             tile=(16, 16, 1)),
    FeatCase("topleft-causal-nq<nk-fp32", "float32", seqlen_q=29, seqlen_k=50, head_dim=16, causal=True,
             align="top_left"),
    FeatCase("topleft-causal-nq>nk-fp32", "float32", seqlen_q=50, seqlen_k=29, head_dim=16, causal=True,
             align="top_left"),
    FeatCase("softcap-bf16", "bfloat16", head_dim=64, softcap=5.0, q_scale=3.0),
    FeatCase("softcap-strong-det-fp32", "float32", head_dim=64, softcap=1.5, q_scale=4.0, seqlen_q=40, seqlen_k=90,
             deterministic=True, tile=(16, 16, 2)),  # scores well inside tanh's bend
    FeatCase("alibi-h-causal-fp16", seqlen_q=33, seqlen_k=47, causal=True, alibi="h"),
    FeatCase("alibi-bh-fp16", heads=4, heads_kv=2, alibi="bh"),
    FeatCase("mask-b1qk-fp16", mask=(2, 1, 37, 45)),
    FeatCase("mask-qk-fp16", mask=(37, 45)),
    FeatCase("bias-1hqk-grad-fp32", "float32", bias=(1, 4, 37, 45)),
    FeatCase("bias-b11k-grad-fp32", "float32", bias=(2, 1, 1, 45)),
    FeatCase("bias-grad-gqa-mask-det-fp32", "float32", heads=4, heads_kv=2, bias=(1, 4, 37, 45), mask=(2, 1, 37, 45),
             causal=True, deterministic=True, tile=(16, 16, 2)),
    FeatCase("combo-fixed-det-bf16", "bfloat16", heads=4, heads_kv=2, seqlen_q=41, seqlen_k=70, causal=True,
             window=(20, -1), softcap=4.0, alibi="h", dropout_p=0.2, deterministic=True, q_scale=2.0,
             tile=(16, 16, 2)),
    FeatCase("combo-varlen-fp16", heads=4, heads_kv=2, causal=True, window=(11, -1), softcap=4.0, dropout_p=0.25,
             lens=((13, 20), (0, 5), (1, 1), (40, 33), (7, 0), (17, 17)), q_scale=2.0, tile=(16, 16, 1)),
    FeatCase("combo-varlen-det-fp16", heads=4, heads_kv=2, causal=True, window=(11, -1), softcap=4.0,
             dropout_p=0.25, lens=((13, 20), (0, 5), (1, 1), (40, 33), (7, 0), (17, 17)), deterministic=True,
             q_scale=2.0, tile=(16, 16, 1)),
    FeatCase("fp64-gqa-causal-softcap-bias", "float64", heads=4, heads_kv=2, seqlen_q=21, seqlen_k=30, head_dim=8,
             causal=True, softcap=3.0, bias=(1, 4, 21, 30)),
    FeatCase("fp64-varlen-det-window", "float64", heads=2, heads_kv=1, head_dim=8, window=(5, 3),
             lens=((9, 12), (1, 3), (20, 6)), deterministic=True, tile=(16, 16, 1)),
    FeatCase("d59-gqa-fp16", heads=4, heads_kv=2, seqlen_q=19, seqlen_k=23, head_dim=59, causal=True),
    FeatCase("d111-bf16", "bfloat16", batch=1, heads=2, heads_kv=2, seqlen_q=17, seqlen_k=30, head_dim=111,
             window=(8, 8)),
    FeatCase("d256-gqa-window-fp16", batch=1, heads=2, heads_kv=1, seqlen_q=20, seqlen_k=33, head_dim=256,
             causal=True, window=(12, -1)),
    FeatCase("d8-alibi-fp32", "float32", head_dim=8, alibi="h", causal=True, seqlen_q=45, seqlen_k=37),
]


# --------------------------------------------------------------------------- inputs and specs
def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def make_inputs(c: FeatCase) -> tuple[dict, dict]:
    """(tensors, options): q, k, v, do and the keyword arguments of attention_forward/backward."""
    g = torch.Generator().manual_seed(1000 + c.seed + c.seqlen_q * 7 + c.head_dim)
    dt = DT[c.dtype]
    if c.lens is None:
        B, Nq, Nk = c.batch, c.seqlen_q, c.seqlen_k
        sq, sk = (B, Nq, c.heads, c.head_dim), (B, Nk, c.heads_kv, c.head_dim)
    else:
        B = len(c.lens)
        Nq, Nk = max(lq for lq, _ in c.lens), max(lk for _, lk in c.lens)
        sq = (sum(lq for lq, _ in c.lens), c.heads, c.head_dim)
        sk = (sum(lk for _, lk in c.lens), c.heads_kv, c.head_dim)
    t = {"q": (torch.randn(sq, generator=g) * c.q_scale).to(dt), "k": torch.randn(sk, generator=g).to(dt),
         "v": torch.randn(sk, generator=g).to(dt), "do": torch.randn(sq, generator=g).to(dt)}
    opt: dict = {"causal": c.causal, "dropout_p": c.dropout_p, "seed": c.seed, "offset": 3, "softcap": c.softcap,
                 "causal_align": c.align}
    if c.window is not None:
        opt["window_size"] = c.window
    if c.alibi is not None:
        opt["alibi_slopes"] = torch.rand((c.heads,) if c.alibi == "h" else (B, c.heads), generator=g) + 0.1
    if c.mask is not None:
        m = torch.rand(c.mask, generator=g) > 0.3
        opt["attn_mask"] = m
    if c.bias is not None:
        opt["attn_bias"] = torch.randn(c.bias, generator=g).to(dt)
    if c.lens is not None:
        opt.update(cu_seqlens_q=_cu([lq for lq, _ in c.lens]), cu_seqlens_k=_cu([lk for _, lk in c.lens]),
                   max_seqlen_q=Nq, max_seqlen_k=Nk)
    return t, opt


def spec_or_skip(impl: str, **fields) -> KernelSpec:
    """KernelSpec(impl=impl, **fields); skips the test when the family does not implement these features."""
    try:
        return KernelSpec(impl=impl, **fields)
    except ValidationError as e:
        err = e.errors()[0]
        if err["loc"] == ("impl",) and err["type"] == "unsupported":
            pytest.skip(err["msg"])
        raise


def specs(c: FeatCase, impl: str) -> tuple[KernelSpec, KernelSpec]:
    """The (forward, backward) specs of the case in family ``impl`` (head dim padded to a multiple of 8);
    skips when the family does not implement the case's features."""
    flags = dict(head_dim=-(-c.head_dim // 8) * 8, dtype=c.dtype, causal=c.causal, dropout=c.dropout_p > 0,
                 window=c.window is not None, softcap=c.softcap > 0, alibi=c.alibi is not None,
                 attn_mask=c.mask is not None, bias=c.bias is not None, varlen=c.lens is not None)
    if c.align != "bottom_right":
        flags["causal_align"] = c.align
    if c.tile is not None:
        flags.update(block_r=c.tile[0], block_c=c.tile[1], num_warps=c.tile[2])
    fwd = spec_or_skip(impl, direction="fwd", **flags)
    bwd = spec_or_skip(impl, direction="bwd", deterministic=c.deterministic, bias_grad=c.bias is not None, **flags)
    return fwd, bwd


def run_kernels(c: FeatCase, impl: str, t: dict, opt: dict) -> dict[str, torch.Tensor]:
    sf, sb = specs(c, impl)
    o, lse = F.attention_forward(t["q"], t["k"], t["v"], spec=sf, **opt)
    grads = F.attention_backward(t["do"], t["q"], t["k"], t["v"], o, lse, spec=sb, deterministic=c.deterministic,
                                 bias_requires_grad=c.bias is not None, **opt)
    out = {"o": o, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if c.bias is not None:
        out["dbias"] = grads[3]
    return out


def _keep(c: FeatCase, t: dict, opt: dict) -> torch.Tensor | None:
    if not c.dropout_p:
        return None
    if c.lens is None:
        B, Nq, Nk = c.batch, c.seqlen_q, c.seqlen_k
    else:
        B, Nq, Nk = len(c.lens), opt["max_seqlen_q"], opt["max_seqlen_k"]
    return F.dropout_keep_mask(B, c.heads, Nq, Nk, c.dropout_p, seed=c.seed, offset=3)


def _lse32(c: FeatCase, t: dict, opt: dict) -> torch.Tensor:
    """Plain PyTorch's float32 lse of the case (tests/featref.py's oracle; per sequence when packed):
    the kernels keep lse in float32 whatever the input dtype."""
    kw = dict(causal=c.causal, window=c.window or (-1, -1), softcap=c.softcap, align=c.align,
              alibi=opt.get("alibi_slopes"))
    q, k, v = (t[n].float() for n in "qkv")
    if c.lens is None:
        return attention_oracle(q, k, v, mask=opt.get("attn_mask"), bias=opt.get("attn_bias"), **kw)[1]
    assert c.mask is None and c.bias is None, "per-sequence mask/bias: not needed yet"
    cq, ck = opt["cu_seqlens_q"].tolist(), opt["cu_seqlens_k"].tolist()
    slopes = kw.pop("alibi")
    out = []
    for b in range(len(c.lens)):
        qs, ks, vs = q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]]
        # [B, H] slopes: sequence b takes row b (flash-attn's varlen convention); [H] slopes are shared.
        alibi = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        if ks.shape[1] == 0:
            out.append(torch.full((c.heads, qs.shape[1]), float("-inf")))
        else:
            out.append(attention_oracle(qs, ks, vs, alibi=alibi, **kw)[1][0])
    return torch.cat(out, dim=1)


def check_case(c: FeatCase, impl: str) -> None:
    """Forward + backward of family ``impl`` vs the float64 reference, flash-attn's criterion."""
    t, opt = make_inputs(c)
    ours = run_kernels(c, impl, t, opt)
    for name, x in ours.items():
        assert not torch.isnan(x).any(), f"{c}: NaN in {name}"

    rkw = {k_: v_ for k_, v_ in opt.items() if k_ not in ("seed", "offset", "max_seqlen_q", "max_seqlen_k")}
    rkw["keep_mask"] = _keep(c, t, opt)
    o64, lse64 = R.attention_forward_ref(t["q"], t["k"], t["v"], **rkw)
    ref = R.attention_backward_ref(t["do"], t["q"], t["k"], t["v"], o64, lse64, bias_requires_grad=c.bias is not None,
                                   **rkw)
    ref64 = {"o": o64, "dq": ref[0], "dk": ref[1], "dv": ref[2]}
    if c.bias is not None:
        ref64["dbias"] = ref[3]

    # plain PyTorch in the same dtype, autograd for the gradients
    leaves = {n: t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
    tkw = dict(rkw)
    if c.bias is not None:
        leaves["bias"] = opt["attn_bias"].detach().clone().requires_grad_(True)
        tkw["attn_bias"] = leaves["bias"]
    ot = R.attention_ref_torch(leaves["q"], leaves["k"], leaves["v"], **tkw)
    ot.backward(t["do"])
    same = {"o": ot.detach(), "dq": leaves["q"].grad, "dk": leaves["k"].grad, "dv": leaves["v"].grad}
    if c.bias is not None:
        same["dbias"] = leaves["bias"].grad
    mag = max((r.abs().max().item() if r.numel() else 0.0) for r in ref64.values())
    atol = ATOL[c.dtype] * max(1.0, mag)
    for name, r in ref64.items():  # an all-zero reference fails: every case sees keys
        flash_criterion(f"{c}: {name}", ours[name], r, same[name], atol)

    assert_lse_close(f"{c}: lse", ours["lse"], lse64, _lse32(c, t, opt))
    finite = torch.isfinite(lse64)
    # fully masked rows (no allowed key): exactly zero output and dq
    dead = ~finite  # [B, H, Nq] or [H, total_q]
    if dead.any():
        rows = dead.transpose(0, 1) if c.lens is not None else dead.permute(0, 2, 1)
        assert (ours["o"][rows] == 0).all() and (ours["dq"][rows] == 0).all(), f"{c}: fully masked rows not zero"


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
    accumulator (fagen.functional._launch_backward: the last float32 tensor shaped like q), whose bits
    a float16 dq would round away."""
    made: list[torch.Tensor] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        made.append(real_empty(*args, **kwargs))
        return made[-1]

    fagen.settings.configure(emu_schedule=schedule)
    try:
        t, opt = make_inputs(c)
        with mock.patch.object(torch, "empty", empty):
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
def test_deterministic_source_has_no_atomics(impl: str) -> None:
    from fagen.renderer import render

    def kernel_text(spec: KernelSpec) -> str:
        src = render(spec).source
        return src[src.index('extern "C"'):]  # the entry points (after the shared device functions)

    _, det = specs(replace(det_case(impl), deterministic=True, bias=(1, 4, 40, 150)), impl)
    _, atomic = specs(det_case(impl), impl)
    reductions = ("fa_atomic_add", "fa_red_add", "atomicAdd", "atomicCAS", "atomicExch")
    for call in reductions:
        assert call not in kernel_text(det), call
    # the atomic backward reduces dQ into dq_accum (mma: from row pointers into it, vector pairs on sm_90)
    assert "fa_atomic_add(dq_accum" in kernel_text(atomic) or (
        "fa_red_add_f32x2(dq_row" in kernel_text(atomic) and "dq_accum" in kernel_text(atomic))
    roles = [k.role.name for k in render(det).kernels]
    assert roles == ["pre", "main", "dq", "post"]


# --------------------------------------------------------------------------- dropout keep-mask, packed
@pytest.mark.parametrize("impl", IMPLS)
def test_varlen_gqa_dropout_applies_the_keep_mask(impl: str) -> None:
    """q = 0 makes P uniform over a sequence's keys; v = identity rows per sequence makes
    o[token, h, j] = Z[b, h, i, j] / ((1 - p) len_k): the mask of (b, h, row, col) inside each
    packed sequence is dropout_keep_mask's, bit for bit."""
    p, seed, offset, d, H, Hkv = 0.4, 11, 2**33 + 5, 64, 4, 2
    lens = [(23, 64), (0, 9), (1, 1), (40, 17)]
    cq, ck = _cu([a for a, _ in lens]), _cu([b for _, b in lens])
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
