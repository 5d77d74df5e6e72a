"""Every kernel role of every family under AddressSanitizer, on a covering sample of specs.

``fagen.runtime.cpu.sanitized()`` routes each CPU launch through the spec's ASan build in a
child process, every pointer argument in an exact-size ``malloc`` (the bytes from the pointer
to the end of its tensor's allocation). Each sampled spec runs the normal functional forward
and backward (all of its kernels: forward; backward pre, main, dq when deterministic, post)
and is judged against the float64 reference with flash-attn's criterion, so a clean run is
also a correct one.

The sample (``ROWS``) is a strength-2 covering design per family: for every dtype the family
supports, every flag it implements appears both on and off; every two flags appear in every
on/off combination the API allows. Lengths are not multiples of the 16-row tiles and Nq != Nk
(packed sequences include lengths 0 and 1); head dims include ones the kernels pad; tiles are
16 x 16 (many tiles per sequence) except in one row per family, which takes the default tiles.
"""
from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen import reference as R
from fagen.abi import neutral_args
from fagen.emulator import EmulatorLaunchError, EmulatorMemoryError, run_sanitized
from fagen.families import FamilySpec, get_family
from fagen.renderer import KernelInfo, render
from fagen.runtime.cpu import cpu_module, host_buffers, sanitized

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
#: flash-attn's atol per dtype (tests/numerics.py); float64 kernels keep lse/D/dQ in fp32 (fagen.abi).
ATOL = {"float16": 2e-4, "bfloat16": 2e-3, "float32": 2e-6, "float64": 2e-6}
#: lse is an fp32 result from the same inputs as the reference: <= 2.3e-7 relative to 1 + |lse| measured
#: over the sample (4 fp32 ulps); the bound is 16 ulps.
LSE_RTOL = 1e-6

#: The sampled flags ("gqa": fewer K/V heads than Q heads; "top_left": causal_align="top_left").
FLAGS = ("causal", "key_padding", "dropout", "window", "softcap", "alibi", "attn_mask", "bias", "bias_grad",
         "varlen", "deterministic", "top_left", "gqa")


def feasible(on: frozenset[str]) -> bool:
    """The flag combinations the functional API takes: packed sequences have no key padding,
    attn_mask or bias; bias_grad needs bias; top-left alignment needs a diagonal."""
    if "varlen" in on and on & {"key_padding", "attn_mask", "bias"}:
        return False
    if "bias_grad" in on and "bias" not in on:
        return False
    return "top_left" not in on or bool(on & {"causal", "window", "alibi"})


@dataclass(frozen=True)
class Row:
    impl: str
    dtype: str
    flags: str  # space-separated FLAGS; a flag the family does not implement is dropped (family_flags)
    seqlen_q: int = 37
    seqlen_k: int = 45
    head_dim: int = 16
    lens: tuple[tuple[int, int], ...] | None = None  # varlen: (len_q, len_k) per sequence
    warps: int | None = 1  # None: the family's default tiles and warps (else 16 x 16 tiles)

    @property
    def on(self) -> frozenset[str]:
        return frozenset(self.flags.split()) & family_flags(self.impl)

    def __str__(self) -> str:
        return f"{self.impl}-{self.dtype}-{'-'.join(sorted(self.on)) or 'plain'}"


LENS_A = ((13, 20), (0, 5), (1, 1), (40, 33))
LENS_B = ((17, 9), (3, 0), (33, 40))
ROWS = [
    # SIMT: every dtype, every flag.
    Row("simt", "float16", "", 45, 29, head_dim=24, warps=None),
    Row("simt", "bfloat16", "causal key_padding dropout window softcap alibi attn_mask bias bias_grad deterministic "
        "top_left gqa", warps=2),
    Row("simt", "float32", "window softcap alibi varlen deterministic top_left gqa", lens=LENS_A),
    Row("simt", "float32", "causal key_padding dropout attn_mask bias bias_grad", 50, 29, head_dim=8),
    Row("simt", "float64", "causal dropout varlen top_left gqa", head_dim=8, lens=LENS_B),
    Row("simt", "float64", "softcap alibi attn_mask bias bias_grad deterministic", 19, 50, head_dim=12),
    Row("simt", "bfloat16", "key_padding window", 33, 47, head_dim=40),
    Row("simt", "float16", "key_padding dropout window alibi bias bias_grad deterministic gqa", 29, 37),
    Row("simt", "float16", "causal softcap attn_mask top_left", 45, 33),
    Row("simt", "bfloat16", "varlen deterministic", lens=((21, 17), (1, 30), (5, 0))),
    Row("simt", "float64", "key_padding window alibi bias", 23, 41, head_dim=8),
    Row("simt", "float16", "varlen", lens=((35, 19), (0, 7), (16, 16))),
    # Tensor cores (float16/bfloat16); deterministic rows count once the family implements it.
    Row("mma", "float16", "", 45, 29, head_dim=24, warps=None),
    Row("mma", "bfloat16", "causal key_padding dropout window softcap alibi attn_mask bias bias_grad deterministic "
        "top_left gqa", warps=2),
    Row("mma", "float16", "window softcap alibi varlen deterministic top_left gqa", lens=LENS_A),
    Row("mma", "float16", "causal key_padding dropout attn_mask bias bias_grad", 50, 29, head_dim=40),
    Row("mma", "bfloat16", "causal dropout varlen top_left gqa", lens=LENS_B),
    Row("mma", "bfloat16", "softcap alibi attn_mask bias bias_grad deterministic", 19, 50, head_dim=12),
    Row("mma", "float16", "key_padding window bias deterministic", 33, 47),
    Row("mma", "float16", "key_padding dropout window alibi attn_mask gqa", 29, 37, warps=2),
    Row("mma", "float16", "causal softcap varlen", lens=((35, 19), (0, 7), (16, 16))),
    Row("mma", "float16", "alibi bias bias_grad top_left", 41, 23),
]


def family_flags(impl: str) -> frozenset[str]:
    """The sampled flags family ``impl`` implements (the three base flags and GQA are in every family)."""
    return frozenset({"causal", "key_padding", "dropout", "gqa"} | (set(FLAGS) & get_family(impl).features))


def family_dtypes(impl: str) -> list[str]:
    fam = get_family(impl)
    return [d for d in DT if fam.unsupported_reason(FamilySpec("bwd", 16, d, "sm_90")) is None
            and (d != "float64" or "float64" in fam.features)]


# --------------------------------------------------------------------------- inputs, specs, judge
def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def make_inputs(row: Row) -> tuple[dict[str, torch.Tensor], dict]:
    """(q, k, v, do; the keyword arguments of attention_forward/backward) of the row."""
    g = torch.Generator().manual_seed(17 + row.seqlen_q * 7 + row.seqlen_k + row.head_dim)
    on, dt = row.on, DT[row.dtype]
    B, H = (len(row.lens) if row.lens else 2), 2
    Hkv = 1 if "gqa" in on else H
    Nq, Nk = (max(a for a, _ in row.lens), max(b for _, b in row.lens)) if row.lens else (row.seqlen_q, row.seqlen_k)
    if row.lens:
        sq = (sum(a for a, _ in row.lens), H, row.head_dim)
        sk = (sum(b for _, b in row.lens), Hkv, row.head_dim)
    else:
        sq, sk = (B, Nq, H, row.head_dim), (B, Nk, Hkv, row.head_dim)
    t = {"q": torch.randn(sq, generator=g).to(dt), "k": torch.randn(sk, generator=g).to(dt),
         "v": torch.randn(sk, generator=g).to(dt), "do": torch.randn(sq, generator=g).to(dt)}
    opt: dict = {"causal": "causal" in on, "seed": 5, "offset": 3}
    if "dropout" in on:
        opt["dropout_p"] = 0.2
    if "key_padding" in on:
        kpm = torch.rand(B, Nk, generator=g) > 0.3
        kpm[:, 0], kpm[:, -1] = True, False  # every batch sees a key; a padded tail
        opt["key_padding_mask"] = kpm
    if "window" in on:
        opt["window_size"] = (11, 4) if "causal" not in on else (9, -1)
    if "softcap" in on:
        opt["softcap"] = 3.0
    if "alibi" in on:
        opt["alibi_slopes"] = torch.rand((H,) if B % 2 else (B, H), generator=g) + 0.1
    if "attn_mask" in on:
        opt["attn_mask"] = torch.rand((B, 1, Nq, Nk), generator=g) > 0.3
    if "bias" in on:
        opt["attn_bias"] = torch.randn((1, H, Nq, Nk) if "attn_mask" in on else (B, 1, 1, Nk), generator=g).to(dt)
    if "top_left" in on:
        opt["causal_align"] = "top_left"
    if row.lens:
        opt.update(cu_seqlens_q=_cu([a for a, _ in row.lens]), cu_seqlens_k=_cu([b for _, b in row.lens]),
                   max_seqlen_q=Nq, max_seqlen_k=Nk)
    return t, opt


def specs(row: Row) -> tuple[KernelSpec, KernelSpec]:
    on = row.on
    flags = {f: True for f in on - {"gqa", "top_left", "deterministic", "bias_grad"}}
    if "top_left" in on:
        flags["causal_align"] = "top_left"
    tiles = {} if row.warps is None else dict(block_r=16, block_c=16, num_warps=row.warps)
    common = dict(head_dim=-(-row.head_dim // 8) * 8, dtype=row.dtype, impl=row.impl, **tiles, **flags)
    return (KernelSpec(direction="fwd", **common),
            KernelSpec(direction="bwd", deterministic="deterministic" in on, bias_grad="bias_grad" in on, **common))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def judge(row: Row, t: dict[str, torch.Tensor], opt: dict, ours: dict[str, torch.Tensor]) -> None:
    """flash-attn's criterion: |ours - ref64| <= 2 |torch same dtype - ref64| + atol, per output."""
    for name, x in ours.items():
        assert not torch.isnan(x).any(), f"{row}: NaN in {name}"
    bias_grad = "bias_grad" in row.on
    rkw = {k: v for k, v in opt.items() if k not in ("seed", "offset", "max_seqlen_q", "max_seqlen_k")}
    if opt.get("dropout_p"):
        B, Nq, Nk = ((len(row.lens), opt["max_seqlen_q"], opt["max_seqlen_k"]) if row.lens
                     else (t["q"].shape[0], t["q"].shape[1], t["k"].shape[1]))
        rkw["keep_mask"] = F.dropout_keep_mask(B, t["q"].shape[-2], Nq, Nk, opt["dropout_p"], seed=5, offset=3)
    o64, lse64 = R.attention_forward_ref(t["q"], t["k"], t["v"], **rkw)
    grads = R.attention_backward_ref(t["do"], t["q"], t["k"], t["v"], o64, lse64, bias_requires_grad=bias_grad, **rkw)
    ref = dict(zip(("o", "dq", "dk", "dv", "dbias"), (o64, *grads)))
    visible = torch.isfinite(lse64).float().mean().item()
    assert visible >= 0.5, f"{row}: only {visible:.0%} of the rows see a key (the check would prove little)"

    leaves = {n: t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
    if bias_grad:
        leaves["bias"] = opt["attn_bias"].detach().clone().requires_grad_(True)
        rkw["attn_bias"] = leaves["bias"]
    ot = R.attention_ref_torch(leaves["q"], leaves["k"], leaves["v"], **rkw)
    ot.backward(t["do"])
    same = {"o": ot.detach(), **{f"d{n}": leaves[n].grad for n in leaves}}
    atol = ATOL[row.dtype] * max(1.0, max(r.abs().max().item() if r.numel() else 0.0 for r in ref.values()))
    for name, r in ref.items():
        e_ours, e_pt = _err(ours[name], r), _err(same[name], r)
        assert e_ours <= 2 * e_pt + atol, f"{row}: {name} error {e_ours:.3g} > 2 x torch {e_pt:.3g} + {atol:.2g}"
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(ours["lse"]), finite), f"{row}: lse -inf pattern differs"
    e_lse = (ours["lse"].double()[finite] - lse64[finite]).abs()
    assert (e_lse <= LSE_RTOL * (1 + lse64[finite].abs())).all(), f"{row}: lse error {e_lse.max():.3g}"
    dead = ~finite  # rows without an allowed key: exactly zero
    rows = dead.transpose(0, 1) if row.lens else dead.permute(0, 2, 1)
    assert (ours["o"][rows] == 0).all() and (ours["dq"][rows] == 0).all(), f"{row}: fully masked rows not zero"


# --------------------------------------------------------------------------- the sample
@pytest.mark.parametrize("row", ROWS, ids=str)
def test_every_kernel_is_clean_under_asan(row: Row) -> None:
    t, opt = make_inputs(row)
    sf, sb = specs(row)
    compiled = sb.features | {f for f in ("causal", "key_padding", "dropout") if getattr(sb, f)}
    assert compiled >= row.on - {"gqa"}, f"{row}: the spec lacks a sampled flag"
    det, bias_grad = "deterministic" in row.on, "bias_grad" in row.on
    with sanitized() as record:
        o, lse = F.attention_forward(t["q"], t["k"], t["v"], spec=sf, **opt)
        grads = F.attention_backward(t["do"], t["q"], t["k"], t["v"], o, lse, spec=sb, deterministic=det,
                                     bias_requires_grad=bias_grad, **opt)
    launched = [name for _, _, name in record.launches]
    expected = [k.name for k in render(sf).kernels + render(sb).kernels]
    assert launched == expected, f"{row}: launched {launched}, the specs' kernels are {expected}"
    judge(row, t, opt, dict(zip(("o", "lse", "dq", "dk", "dv", "dbias"), (o, lse, *grads))))


def _pairs(dtype: str, on: frozenset[str], flags: frozenset[str]) -> set[tuple]:
    value = {f: f in on for f in flags}
    return ({("dtype", dtype, f, value[f]) for f in flags}
            | {(f, value[f], g, value[g]) for f, g in itertools.combinations(sorted(flags), 2)})


@pytest.mark.parametrize("impl", ["simt", "mma"])
def test_sample_covers_every_dtype_flag_and_flag_pair(impl: str) -> None:
    flags = family_flags(impl)
    rows = [r for r in ROWS if r.impl == impl]
    covered = set().union(*(_pairs(r.dtype, r.on, flags) for r in rows))
    universe = set()
    for bits in itertools.product((False, True), repeat=len(flags)):
        on = frozenset(f for f, b in zip(sorted(flags), bits) if b)
        if feasible(on):
            for dtype in family_dtypes(impl):
                universe |= _pairs(dtype, on, flags)
    assert not universe - covered, f"{impl}: uncovered {sorted(universe - covered, key=str)[:8]}"
    assert all(feasible(r.on) for r in rows)
    # lengths that are not multiples of the 16-row tiles, and Nq != Nk, in every row
    for r in rows:
        lengths = r.lens or ((r.seqlen_q, r.seqlen_k),)
        assert any(a % 16 and b % 16 and a != b for a, b in lengths), r


def test_sample_launches_every_role_of_every_family() -> None:
    for impl in ("simt", "mma"):
        roles = {(s.direction, k.role.name) for r in ROWS if r.impl == impl for s in specs(r)
                 for k in render(s).kernels}
        want = {("fwd", "main"), ("bwd", "pre"), ("bwd", "main"), ("bwd", "post")}
        if "deterministic" in get_family(impl).features:
            want.add(("bwd", "dq"))
        assert roles == want, impl


# --------------------------------------------------------------------------- the mechanism
B1, H1, NQ1, NK1, D1 = 1, 2, 19, 23, 16
FWD32 = KernelSpec(direction="fwd", head_dim=D1, dtype="float32", block_r=16, block_c=16, num_warps=1)


def _forward_args(null: object, tensors: dict, seqlen_k: int, ptr) -> dict:
    """The forward kernel's arguments by hand: pointers through ``ptr``, features off."""
    def elements(t):  # strides in elements (numpy's are in bytes)
        return [s // t.itemsize for s in t.strides] if isinstance(t, np.ndarray) else t.stride()

    strides = {f"stride_{n}_{x}": s for n in ("q", "k", "v", "o") for x, s in zip("bsh", elements(tensors[n])[:3])}
    return {**neutral_args(heads=H1, seqlen_q=NQ1, null=null, direction="fwd"), **strides,
            **{n: ptr(t) for n, t in tensors.items()}, "kpm": null, "heads": H1, "seqlen_q": NQ1,
            "seqlen_k": seqlen_k, "scale": D1 ** -0.5, "seed": 0, "offset": 0, "drop_threshold": 0, "rp_keep": 1.0,
            "row_offset": 0, "col_offset": 0}


def test_sanitized_runtime_reports_an_overrun_naming_the_tensor() -> None:
    """Through the CPU runtime: the kernel told one key more than k holds reads past k's
    allocation, and the report names k."""
    g = torch.Generator().manual_seed(3)
    t = {"q": torch.randn(B1, NQ1, H1, D1, generator=g), "k": torch.randn(B1, NK1, H1, D1, generator=g),
         "v": torch.randn(B1, NK1, H1, D1, generator=g), "o": torch.empty(B1, NQ1, H1, D1),
         "lse": torch.empty(B1, H1, NQ1)}
    kern = render(FWD32).kernel("main")
    args = _forward_args(0, t, NK1 + 1, lambda x: x.data_ptr())
    with sanitized(), pytest.raises(EmulatorMemoryError, match="argument 'k'"):
        cpu_module(FWD32).launch(kern, kern.grid(B1, H1, NQ1, NK1), args)
    args["seqlen_k"] = NK1  # the honest launch is clean and matches the float64 reference
    with sanitized() as record:
        cpu_module(FWD32).launch(kern, kern.grid(B1, H1, NQ1, NK1), args)
    assert record.roles == {"main"}
    o64, lse64 = R.attention_forward_ref(t["q"], t["k"], t["v"])
    torch.testing.assert_close(t["o"].double(), o64, rtol=0, atol=2e-6)
    torch.testing.assert_close(t["lse"].double(), lse64, rtol=LSE_RTOL, atol=LSE_RTOL)
    sanitized_o, sanitized_lse = t["o"].clone(), t["lse"].clone()
    t["o"].zero_(), t["lse"].zero_()
    cpu_module(FWD32).launch(kern, kern.grid(B1, H1, NQ1, NK1), args)  # a plain launch: the same bits
    assert torch.equal(t["o"], sanitized_o) and torch.equal(t["lse"], sanitized_lse)


def test_run_sanitized_names_the_buffer_of_a_raw_launch() -> None:
    """The low-level API: numpy buffers, each in its own exact-size malloc."""
    rng = np.random.default_rng(1)
    t = {"q": rng.standard_normal((B1, NQ1, H1, D1), dtype=np.float32),
         "k": rng.standard_normal((B1, NK1, H1, D1), dtype=np.float32),
         "v": rng.standard_normal((B1, NK1, H1, D1), dtype=np.float32),
         "o": np.zeros((B1, NQ1, H1, D1), np.float32), "lse": np.zeros((B1, H1, NQ1), np.float32)}
    r = render(FWD32)
    kern = r.kernel("main")
    with pytest.raises(EmulatorMemoryError) as ei:
        run_sanitized(r.source, r.kernels, kern.name, kern.grid(B1, H1, NQ1, NK1), kern.block, kern.smem_bytes,
                      _forward_args(None, t, NK1 + 1, lambda x: x))
    assert "argument 'k'" in str(ei.value) and "heap-buffer-overflow" in ei.value.report


def _kernel(params: list[tuple[str, str]]) -> KernelInfo:
    return KernelInfo(name="k", role=None, params=tuple(params), block=(1, 1, 1), smem_bytes=0,  # type: ignore[arg-type]
                      rows_per_block=1)


def test_host_buffers_are_the_allocation_from_the_pointer() -> None:
    base = torch.arange(10, dtype=torch.float32)
    view = base[4:]
    kern = _kernel([("const float*", "x"), ("float*", "y"), ("int", "n"), ("float*", "none")])
    x, y, n, none = host_buffers(kern, [("const float*", view.data_ptr()), ("float*", base.data_ptr()), ("int", 3),
                                        ("float*", 0)])
    assert x.nbytes == 6 * 4 and not x.flags.writeable  # from element 4 to the end of base's storage
    assert np.array_equal(x.view(np.float32), np.arange(4, 10, dtype=np.float32))
    assert y.nbytes == 40 and y.flags.writeable and n == 3 and none is None


def test_host_buffers_name_a_foreign_address_and_overlapping_outputs() -> None:
    kern = _kernel([("float*", "a"), ("float*", "b")])
    stray = ctypes.create_string_buffer(64)
    with pytest.raises(EmulatorLaunchError, match="argument 'a'.*no live torch CPU tensor"):
        host_buffers(kern, [("float*", ctypes.addressof(stray)), ("float*", 0)])
    t = torch.zeros(8)
    with pytest.raises(EmulatorLaunchError, match="'a' and 'b' share an allocation"):
        host_buffers(kern, [("float*", t.data_ptr()), ("float*", t[2:].data_ptr())])
