"""NaN and overflow propagate like torch's attention, forward and backward, on every kernel family.

The semantics (fagen.reference): only allowed (row, key) pairs take part, and they carry NaN as
IEEE arithmetic does -- NaN in q_i poisons row i (o, lse, dq) and the dk, dv of the keys it
attends to; NaN in k_j or v_j poisons every row attending to key j; fp32 scores that overflow
(inf - inf, or a row of -inf) give NaN as torch's softmax does. A row with no allowed key stays
exactly zero with lse = -inf. Each case is judged three ways:

* every element the reference makes NaN is NaN here (nothing is silently zeroed);
* every element NaN here is NaN in plain PyTorch attention on the same inputs (torch's
  ``softmax(scale QK^T + mask) V`` multiplies every pair, so it is NaN wherever we may be);
* finite elements agree with the float64 reference, and fully masked rows are exactly zero.
"""
from __future__ import annotations

import math

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen import reference as R
from fagen.families import family_names

NAN = float("nan")
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TOL = {"float16": 3e-3, "bfloat16": 3e-2, "float32": 1e-4}


def _specs(impl: str, dtype: str, d: int, causal: bool, padding: bool) -> tuple[KernelSpec, KernelSpec]:
    flags = dict(head_dim=d, dtype=dtype, causal=causal, key_padding=padding, impl=impl)
    try:
        return KernelSpec(direction="fwd", **flags), KernelSpec(direction="bwd", **flags)
    except ValueError as e:  # pydantic ValidationError: this family does not implement the combination
        pytest.skip(f"{impl} does not implement {dtype} d={d}: {e}")


def _run(impl: str, q, k, v, do, *, causal: bool, mask=None):
    dtype = {v_: k_ for k_, v_ in DT.items()}[q.dtype]
    fwd, bwd = _specs(impl, dtype, q.shape[-1], causal, mask is not None)
    o, lse = F.run_forward(fwd, q, k, v, key_padding_mask=mask)
    dq, dk, dv = F.run_backward(bwd, do, q, k, v, o, lse, key_padding_mask=mask)
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _torch_plain(q, k, v, do, *, causal: bool, mask=None):
    """Plain PyTorch attention in the input dtype (masked_fill(-inf), softmax, P @ V), autograd."""
    qt, kt, vt = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    B, Nq, _, d = q.shape
    allowed = R.mask_matrix(B, Nq, k.shape[1], causal=causal, key_padding_mask=mask)
    s = torch.einsum("bihd,bjhd->bhij", qt * (1.0 / math.sqrt(d)), kt).masked_fill(~allowed, -math.inf)
    o = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), vt)
    o.backward(do)
    return {"o": o.detach(), "dq": qt.grad, "dk": kt.grad, "dv": vt.grad}


def _reference(q, k, v, do, *, causal: bool, mask=None):
    o, lse = R.attention_forward_ref(q, k, v, causal=causal, key_padding_mask=mask)
    dq, dk, dv = R.attention_backward_ref(do, q, k, v, o, lse, causal=causal, key_padding_mask=mask)
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _judge(ours, ref, plain, dtype: str, *, dead_rows: torch.Tensor | None = None) -> None:
    for name, t in ours.items():
        nan, ref_nan = torch.isnan(t), torch.isnan(ref[name])
        assert nan[ref_nan].all(), f"{name}: {int((ref_nan & ~nan).sum())} elements should be NaN but are not"
        if name == "lse":
            assert torch.equal(nan, ref_nan), f"lse: NaN rows {nan.nonzero().tolist()} != {ref_nan.nonzero().tolist()}"
        else:
            assert not (nan & ~torch.isnan(plain[name])).any(), f"{name}: NaN where plain PyTorch is finite"
        both = ~nan & ~ref_nan
        assert torch.equal(torch.isneginf(t[both]), torch.isneginf(ref[name][both])), f"{name}: -inf pattern"
        fin = both & torch.isfinite(ref[name])
        scale = max(1.0, ref[name][fin].abs().max().item()) if fin.any() else 1.0
        err = (t.double()[fin] - ref[name][fin]).abs().max().item() if fin.any() else 0.0
        assert err <= TOL[dtype] * scale, f"{name}: finite part off by {err:.3g}"
    if dead_rows is not None and dead_rows.any():  # [B, Nq, H]
        for name in ("o", "dq"):
            assert (ours[name][dead_rows] == 0).all(), f"{name}: fully masked rows not exactly zero"
        assert torch.isneginf(ours["lse"].permute(0, 2, 1)[dead_rows]).all(), "lse of fully masked rows"


def _inputs(dtype: str, B=2, Nq=37, Nk=45, H=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = DT[dtype]
    q, do = (torch.randn(B, Nq, H, d, generator=g).to(t) for _ in range(2))
    k, v = (torch.randn(B, Nk, H, d, generator=g).to(t) for _ in range(2))
    return q, k, v, do


# --------------------------------------------------------------------------- NaN in q, k, v
WHERE = {  # tensor, (b, seq, h, x)
    "q": ("q", (1, 20, 1, 3)),
    "k": ("k", (1, 21, 0, 0)),
    "v": ("v", (1, 30, 1, 5)),
    "k-first-key": ("k", (0, 0, 1, 31)),  # every causal row attends to key 0
}


@pytest.mark.parametrize("impl", family_names())
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("where", list(WHERE))
def test_nan_input_poisons_the_rows_that_touch_it(impl: str, dtype: str, causal: bool, where: str) -> None:
    q, k, v, do = _inputs(dtype)
    name, idx = WHERE[where]
    {"q": q, "k": k, "v": v}[name][idx] = NAN
    ours = _run(impl, q, k, v, do, causal=causal)
    ref = _reference(q, k, v, do, causal=causal)
    _judge(ours, ref, _torch_plain(q, k, v, do, causal=causal), dtype)

    b, j, h = idx[:3]
    rows_nan = torch.isnan(ours["o"][b, :, h]).any(-1)
    other = [hh for hh in range(q.shape[2]) if hh != h]
    # the poisoned head of that batch only: other heads and batches keep every row finite
    assert torch.isfinite(ours["o"][:, :, other]).all() and torch.isfinite(ours["o"][1 - b]).all()
    assert torch.isfinite(ours["lse"][1 - b]).all() and torch.isfinite(ours["lse"][b, other]).all()
    if name == "q":
        assert rows_nan.nonzero().flatten().tolist() == [j]
    else:  # a key poisons the rows attending to it (bottom-right causal: i >= j - (Nk - Nq))
        first = max(0, j - (k.shape[1] - q.shape[1])) if causal else 0
        attending = torch.arange(q.shape[1]) >= first
        assert rows_nan[attending].all()
        if name == "k":  # a masked score is -inf whatever k holds: exactly those rows
            assert torch.equal(rows_nan, attending)
        # (a NaN v_j may also reach rows of its tile that do not attend to it, through the tile
        # product's 0 * NaN -- as in plain PyTorch attention, checked against it by _judge)
        assert torch.isnan(ours["dk"][b, j, h]).all()  # through the NaN rows' dS
        assert torch.isnan(ours["dv"][b, j, h]).all() == (name == "k")  # v does not enter P


# --------------------------------------------------------------------------- fully masked rows stay zero
@pytest.mark.parametrize("impl", family_names())
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_fully_masked_rows_stay_zero_whatever_the_padded_keys_hold(impl: str, dtype: str) -> None:
    """Batch 0 has no key (every row fully masked) and NaN everywhere; batch 1 has padded keys
    holding NaN/inf. Masked pairs take no part: batch 0 is exactly zero (lse -inf), batch 1 equals
    the reference, and padded keys get exactly zero dk, dv."""
    q, k, v, do = _inputs(dtype, Nq=33, Nk=50)
    mask = torch.ones(2, 50, dtype=torch.bool)
    mask[0] = False
    mask[1, ::3] = False
    q[0, 5, 0, 0] = NAN
    k[0, 7, 1, :] = NAN
    v[0, 8, 0, 1] = NAN
    k[1, 3, 0, 2] = NAN  # padded keys of batch 1
    v[1, 6, 1, :] = NAN
    v[1, 9, 0, 4] = math.inf
    ours = _run(impl, q, k, v, do, causal=False, mask=mask)
    ref = _reference(q, k, v, do, causal=False, mask=mask)
    dead = torch.zeros(2, 33, 2, dtype=torch.bool)
    dead[0] = True
    _judge(ours, ref, _torch_plain(q, k, v, do, causal=False, mask=mask), dtype, dead_rows=dead)
    for name in ("o", "dq", "dk", "dv"):
        assert torch.isfinite(ours[name]).all(), f"{name}: a masked NaN/inf leaked"
    padded = ~mask  # [B, Nk]
    assert (ours["dk"][padded] == 0).all() and (ours["dv"][padded] == 0).all()


@pytest.mark.parametrize("impl", family_names())
def test_causal_rows_without_keys_stay_zero_next_to_nan(impl: str) -> None:
    """Nq > Nk, causal: the first Nq - Nk rows see no key; NaN in k and v does not reach them."""
    q, k, v, do = _inputs("bfloat16", Nq=50, Nk=20)
    k[0, 0, 0, 0] = NAN
    v[1, 19, 1, 3] = NAN
    q[0, 2, 1, 0] = NAN  # a fully masked row: still zero
    ours = _run(impl, q, k, v, do, causal=True)
    ref = _reference(q, k, v, do, causal=True)
    dead = torch.zeros(2, 50, 2, dtype=torch.bool)
    dead[:, :30] = True
    _judge(ours, ref, _torch_plain(q, k, v, do, causal=True), "bfloat16", dead_rows=dead)
    assert torch.isnan(ours["o"][0, 30:, 0]).all() and torch.isnan(ours["o"][1, 49, 1, 3])


# --------------------------------------------------------------------------- fp32 overflow
@pytest.mark.parametrize("impl", family_names())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_score_overflow_gives_nan_like_torch(impl: str, causal: bool) -> None:
    """Scores beyond float32's range: +inf and -inf in one row (inf - inf), and, causal, a row whose
    only key scores -inf. torch's softmax makes those rows NaN; so do the kernels (never zeros)."""
    B, N, H, d = 1, 40, 2, 32
    g = torch.Generator().manual_seed(5)
    sign = torch.where(torch.arange(N) % 3 == 0, 1.0, -1.0)  # key 0 is +1
    k = (sign[None, :, None, None] * (1 + 0.1 * torch.rand(B, N, H, d, generator=g)))
    v, q, do = torch.randn(B, N, H, d, generator=g), torch.randn(B, N, H, d, generator=g), torch.randn(B, N, H, d, generator=g)
    q[0, 0, 0] = -1e38  # row 0: q.k_0 = -inf (its only key when causal)
    q[0, 10, 1] = 1e38  # row 10: +inf and -inf scores
    ours = _run(impl, q, k, v, do, causal=causal)
    plain = _torch_plain(q, k, v, do, causal=causal)
    rows = torch.isnan(ours["o"]).any(-1)[0]  # [N, H]
    assert torch.equal(rows, torch.isnan(plain["o"]).any(-1)[0]), "NaN rows differ from torch"
    expected = torch.zeros(N, H, dtype=torch.bool)
    expected[10, 1] = True  # +inf and -inf scores
    expected[0, 0] = True  # causal: its one key scores -inf; full: +inf and -inf
    assert torch.equal(rows, expected)
    assert torch.equal(torch.isnan(ours["lse"][0]).T, expected)
    assert torch.equal(torch.isnan(ours["dq"]).any(-1)[0], expected)
    for name in ("o", "lse", "dq"):
        assert torch.isfinite(ours[name][0][~expected] if name != "lse" else ours[name][0].T[~expected]).all()
    for name in ("dk", "dv"):  # keys the NaN rows attend to: NaN; never more than torch
        nan = torch.isnan(ours[name]).any(-1)[0]
        assert nan[: 11 if causal else N, 1].all() and nan[: 1 if causal else N, 0].all()
        assert not (nan & ~torch.isnan(plain[name]).any(-1)[0]).any()
