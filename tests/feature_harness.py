"""The cross-family feature harness: a feature case (FeatCase) run through one family's forward and
backward kernels from explicit specs and judged against fagen.reference in float64 with flash-attn's
criterion (tests/featref.py): |ours - ref64| <= 2 |torch same dtype - ref64| + atol, lse against
PyTorch's float32 logsumexp, fully masked rows exactly zero.

Tests steer the specs through ``check_case``'s arguments (``extra`` for both directions,
``fwd_extra`` / ``bwd_extra`` for one), never by patching this module; ``check_case`` returns the
(forward, backward) specs it ran so a test can state what it exercised.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
import torch
from pydantic import ValidationError

import fagen.functional as F
from fagen import KernelSpec
from fagen import reference as R
from featref import assert_lse_close, flash_criterion
from featref import attention as attention_oracle

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


#: The feature matrix: every feature alone and combined, odd lengths, Nq != Nk both ways, fully masked rows
#: (tests/test_features.py runs it on the CPU emulator, tests/test_gpu_features.py on a CUDA GPU).
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
def cu_seqlens(lengths: list[int]) -> torch.Tensor:
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
        opt.update(cu_seqlens_q=cu_seqlens([lq for lq, _ in c.lens]), cu_seqlens_k=cu_seqlens([lk for _, lk in c.lens]),
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


def specs(c: FeatCase, impl: str, *, extra: Mapping | None = None, fwd_extra: Mapping | None = None,
          bwd_extra: Mapping | None = None, bwd_impl: str | None = None) -> tuple[KernelSpec, KernelSpec]:
    """The (forward, backward) specs of the case in family ``impl`` (the backward's: ``bwd_impl`` where given;
    head dim padded to a multiple of 8), with ``extra`` spec fields in both and ``fwd_extra`` / ``bwd_extra`` in
    one (arch, knobs, tiles); skips when the family does not implement the case's features."""
    flags = dict(head_dim=-(-c.head_dim // 8) * 8, dtype=c.dtype, causal=c.causal, dropout=c.dropout_p > 0,
                 window=c.window is not None, softcap=c.softcap > 0, alibi=c.alibi is not None,
                 attn_mask=c.mask is not None, bias=c.bias is not None, varlen=c.lens is not None)
    if c.align != "bottom_right":
        flags["causal_align"] = c.align
    if c.tile is not None:
        flags.update(block_r=c.tile[0], block_c=c.tile[1], num_warps=c.tile[2])
    flags.update(extra or {})
    fwd = spec_or_skip(impl, direction="fwd", **{**flags, **(fwd_extra or {})})
    bwd = spec_or_skip(bwd_impl or impl, direction="bwd", deterministic=c.deterministic, bias_grad=c.bias is not None,
                       **{**flags, **(bwd_extra or {})})
    return fwd, bwd


def _to(x: object, device: str) -> object:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def run_kernels(c: FeatCase, impl: str, t: dict, opt: dict, specs_: tuple[KernelSpec, KernelSpec] | None = None,
                device: str = "cpu") -> dict[str, torch.Tensor]:
    """The family's forward and backward kernels on ``device`` (inputs copied there, outputs back on the CPU)."""
    sf, sb = specs_ or specs(c, impl)
    t = {n: _to(x, device) for n, x in t.items()}
    opt = {n: _to(x, device) for n, x in opt.items()}
    o, lse = F.attention_forward(t["q"], t["k"], t["v"], spec=sf, **opt)
    grads = F.attention_backward(t["do"], t["q"], t["k"], t["v"], o, lse, spec=sb, deterministic=c.deterministic,
                                 bias_requires_grad=c.bias is not None, **opt)
    out = {"o": o, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if c.bias is not None:
        out["dbias"] = grads[3]
    return {n: x.cpu() for n, x in out.items()}


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


def check_case(c: FeatCase, impl: str, device: str = "cpu", **spec_fields: Mapping | None
               ) -> tuple[KernelSpec, KernelSpec]:
    """Forward + backward of family ``impl`` on ``device`` (the emulator on "cpu") vs the float64 reference
    computed on the CPU, flash-attn's criterion; returns the (forward, backward) specs run. ``spec_fields``:
    ``extra`` / ``fwd_extra`` / ``bwd_extra`` / ``bwd_impl`` of :func:`specs`."""
    used = specs(c, impl, **spec_fields)
    t, opt = make_inputs(c)
    ours = run_kernels(c, impl, t, opt, used, device=device)
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
    return used
