"""Every spec of the standard matrix plus float32, emulated on CPU, against the float64 reference."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from fagen.families import family_names
from numerics import Case, check, make_inputs

HEAD_DIMS = (32, 64, 96, 128)
DTYPES = ("float16", "bfloat16", "float32")
#: (causal, padding, dropout_p): the standard matrix's variants
VARIANTS = ((False, False, 0.0), (True, False, 0.0), (True, True, 0.17))
#: (batch, heads, seqlen_q, seqlen_k): odd lengths, Nq != Nk both ways
SHAPES = ((1, 1, 1, 1), (2, 2, 17, 17), (1, 2, 100, 37), (2, 1, 37, 100), (1, 1, 257, 257), (2, 2, 64, 129))


@pytest.fixture(params=family_names())
def impl(request: pytest.FixtureRequest) -> str:
    """Every numerics test runs for every kernel family (the tensor-core family has no float32)."""
    return request.param


def _as(case: Case, impl: str) -> Case:
    if impl == "wgmma":
        pytest.skip("wgmma: sm_90a forward only (tests/test_wgmma_family.py)")
    if impl == "mma" and case.dtype == "float32":
        pytest.skip("mma: no float32 (mma.sync takes float16/bfloat16 operands)")
    return dataclasses.replace(case, impl=impl)


def _matrix() -> list[Case]:
    cases = []
    shapes = itertools.cycle(SHAPES)
    for d in HEAD_DIMS:
        for dtype in DTYPES:
            for causal, pad, p in VARIANTS:
                b, h, nq, nk = next(shapes)
                cases.append(Case(b, h, nq, nk, d, dtype, causal, pad, p, seed=d))
    return cases


@pytest.mark.parametrize("case", _matrix(), ids=str)
def test_matrix(case: Case, impl: str) -> None:
    check(_as(case, impl))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}q{}k{}".format(*s))
@pytest.mark.parametrize("causal,pad,p", VARIANTS, ids=["plain", "causal", "causal-pad-dropout"])
def test_every_shape_d64_fp16(shape: tuple, causal: bool, pad: bool, p: float, impl: str) -> None:
    check(_as(Case(*shape, 64, "float16", causal, pad, p, seed=7), impl))


@pytest.mark.parametrize("d", [8, 16, 40, 80, 160, 256])
def test_other_head_dims(d: int, impl: str) -> None:
    check(_as(Case(2, 1, 33, 47, d, "bfloat16", causal=True, padding=True, dropout_p=0.1, seed=d), impl))


@pytest.mark.parametrize("causal", [False, True])
def test_padding_only_and_dropout_only(causal: bool, impl: str) -> None:
    check(_as(Case(2, 2, 40, 40, 32, "float16", causal=causal, padding=True), impl))
    check(_as(Case(2, 2, 40, 50, 32, "float32" if impl == "simt" else "bfloat16", causal=causal, dropout_p=0.5, seed=3), impl))


#: rows that see no key, declared: a batch whose keys are all masked next to one that sees keys
#: (with causal Nq > Nk: the top rows of the live batch see none either); every key of the problem masked.
#: The specs of other tests (no compile of their own)
FULLY_MASKED = (Case(2, 2, 40, 33, 32, "float16", causal=True, padding=True, dropout_p=0.2, seed=5, masked_batch=0),
                Case(2, 1, 33, 47, 32, "float16", padding=True, masked_batch=1),
                Case(1, 2, 17, 17, 32, "float16", causal=True, padding=True, dropout_p=0.3, masked_batch=0))


@pytest.mark.parametrize("case", FULLY_MASKED, ids=str)
def test_fully_masked_rows(case: Case, impl: str) -> None:
    """Rows with no allowed key: exactly zero o and dq, lse -inf; the other rows as usual."""
    import torch

    from numerics import visibility

    _, _, _, _, mask = make_inputs(case)
    vis = visibility(case, mask)
    assert not mask[case.masked_batch].any() and vis["rows"] < 1
    if case.batch > 1:
        assert vis["rows"] > 0  # the other batch sees keys
    if case.causal and case.seqlen_q > case.seqlen_k:  # the live batch's top rows see no key either
        from fagen import reference as R

        alive = R.mask_matrix(case.batch, case.seqlen_q, case.seqlen_k, causal=True, key_padding_mask=mask)
        live = [b for b in range(case.batch) if b != case.masked_batch]
        assert not alive[live, :, 0].any() and alive[live, :, -1].all()
    check(_as(case, impl))


def test_standard_matrix_sees_keys() -> None:
    """Every case of the standard matrix and the every-shape test has rows that see a key (most of
    those causal lets see one: padding keeps key 0) -- none compares an all-masked, all-zero output."""
    from numerics import visibility

    cases = _matrix() + [Case(*s, 64, "float16", c, p, d) for s in SHAPES for c, p, d in VARIANTS]
    for case in cases + _random_cases(24):
        vis = visibility(case, make_inputs(case)[4])
        assert vis["rows"] > 0 and vis["of_causal"] == 1.0, case


def test_the_criteria_cannot_pass_vacuously() -> None:
    """The shared comparisons: an all-zero float64 reference fails unless declared, and the lse
    criterion (a few float32 roundings) rejects a 3e-5 bias that the old 1e-3 bound let through."""
    import torch

    from featref import assert_lse_close, flash_criterion

    zero = torch.zeros(3, 4, dtype=torch.float64)
    with pytest.raises(AssertionError, match="all zero"):
        flash_criterion("o", zero.half(), zero, zero.half(), 1e-3)
    flash_criterion("dq", zero.half(), zero, zero.half(), 1e-3, zero_ok=True)
    with pytest.raises(AssertionError, match="error"):  # a zeroed output against a live reference
        flash_criterion("o", zero.half(), zero + 0.5, (zero + 0.5).half(), 1e-3)

    g = torch.Generator().manual_seed(0)
    lse64 = torch.randn(2, 3, 50, generator=g, dtype=torch.float64) * 3 + 4
    lse64[0, 0, :5] = float("-inf")
    lse32 = lse64.float()  # one rounding: what plain float32 PyTorch gets at best
    assert_lse_close("lse", lse32, lse64, lse32)
    with pytest.raises(AssertionError, match="lse: error"):
        assert_lse_close("lse", lse32 + 3e-5, lse64, lse32)
    with pytest.raises(AssertionError, match="-inf pattern"):
        assert_lse_close("lse", lse32.nan_to_num(neginf=-1e30), lse64, lse32)


@pytest.mark.parametrize("B,Nq,Nk", [(0, 5, 5), (2, 0, 5), (2, 5, 0)])
def test_empty_dimensions(B: int, Nq: int, Nk: int) -> None:
    import torch

    import fagen.functional as F

    q = torch.randn(B, Nq, 2, 32)
    k = torch.randn(B, Nk, 2, 32)
    v = torch.randn(B, Nk, 2, 32)
    o, lse = F.attention_forward(q, k, v, causal=True)
    assert o.shape == q.shape and lse.shape == (B, 2, Nq)
    assert (o == 0).all() and (lse == float("-inf")).all()
    dq, dk, dv = F.attention_backward(torch.randn_like(q), q, k, v, o, lse, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not dq.any() and not dk.any() and not dv.any()


def test_bitwise_deterministic() -> None:
    """Same inputs, same bits: the emulator runs blocks and fibers in a fixed order (atomics included)."""
    import torch

    import fagen.functional as F

    q, k, v, do, mask = make_inputs(Case(2, 2, 45, 61, 32, "bfloat16", True, True, 0.2))
    kw = dict(causal=True, key_padding_mask=mask, dropout_p=0.2, seed=9)
    runs = []
    for _ in range(2):
        o, lse = F.attention_forward(q, k, v, **kw)
        runs.append((o, lse, *F.attention_backward(do, q, k, v, o, lse, **kw)))
    for a, b in zip(*runs):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_arbitrary_strides() -> None:
    """q/k/v from a packed qkv tensor, o and do from wider buffers, batch-strided views: same results."""
    import torch

    import fagen.functional as F

    torch.manual_seed(3)
    B, N, H, d = 2, 29, 3, 32
    qkv = torch.randn(B, N, 3, H, d + 8, dtype=torch.float16)[..., :d]  # head stride d+8, seq stride 3H(d+8)
    q, k, v = qkv.unbind(2)
    do = torch.randn(B, H, N, d, dtype=torch.float16).transpose(1, 2)  # [B, N, H, d] with seq stride d
    kw = dict(causal=True)
    o, lse = F.attention_forward(q, k, v, **kw)
    o_wide = torch.zeros(B, N, H, 2 * d, dtype=torch.float16)[..., :d].copy_(o)
    dq, dk, dv = F.attention_backward(do, q, k, v, o_wide, lse, **kw)
    c = [t.contiguous() for t in (q, k, v, do)]
    o_c, lse_c = F.attention_forward(*c[:3], **kw)
    ref = F.attention_backward(c[3], *c[:3], o_c, lse_c, **kw)
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c)
    for a, b in zip((dq, dk, dv), ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block_r,block_c,num_warps", [(16, 16, 1), (32, 64, 2), (128, 16, 8), (48, 80, 4), (16, 128, 8)])
def test_explicit_tiles_and_warps(block_r: int, block_c: int, num_warps: int) -> None:
    """Every tile / warp count the autotuner may pick computes the same attention (float32: the
    criterion's bound is a few float32 roundings, far below any mis-tiled row or column)."""
    check(Case(2, 2, 70, 53, 64, "float32", causal=True, padding=True, dropout_p=0.25, seed=12, impl="simt",
               tile=(block_r, block_c, num_warps)))


def _random_cases(n: int, seed: int = 2026) -> list[Case]:
    """A seeded sweep over the whole spec space: any head dim, any dtype, any flags, odd shapes."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        d = 8 * rng.randint(1, 32)
        nq, nk = rng.choice([1, 2, 15, 31, 63, 97, 130, 211]), rng.choice([1, 3, 16, 47, 64, 129, 200])
        cases.append(Case(rng.randint(1, 2), rng.randint(1, 3), nq, nk, d, rng.choice(DTYPES),
                          causal=rng.random() < 0.5, padding=rng.random() < 0.5,
                          dropout_p=rng.choice([0.0, 0.0, 0.1, 0.45]), seed=rng.randrange(2**40)))
    return cases


@pytest.mark.parametrize("case", _random_cases(24), ids=str)
def test_random_sweep(case: Case, impl: str) -> None:
    check(_as(case, impl))


@pytest.mark.parametrize("block_r,block_c,num_warps,stages", [(16, 16, 1, 2), (32, 32, 2, 1), (48, 64, 4, 2), (64, 16, 4, 1),
                                                              (16, 48, 8, 2), (128, 128, 8, 2)])
def test_mma_explicit_tiles_and_warps(block_r: int, block_c: int, num_warps: int, stages: int) -> None:
    """Tiles / warp counts / pipeline depths of the mma family, including warps left without rows
    (16 x num_warps > tile): each against the float64 reference like the default tiles."""
    check(Case(2, 2, 70, 53, 64, "bfloat16", causal=True, padding=True, dropout_p=0.25, seed=12, impl="mma",
               tile=(block_r, block_c, num_warps), knobs=(("stages", stages),)))
