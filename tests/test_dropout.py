"""fagen.dropout_keep_mask is, bit for bit, the mask the emulated kernels apply."""
from __future__ import annotations

import pytest
import torch

import fagen.functional as F
from fagen import reference as R
from featref import flash_criterion

EPS32 = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("p,seed,offset", [(0.1, 0, 0), (0.5, 2**40 + 5, 7), (0.83, 123, 2**33 + 1)])
def test_forward_kernel_applies_exactly_the_keep_mask(p: float, seed: int, offset: int) -> None:
    # q = 0 makes P uniform (1/Nk); v = identity (Nk == d) makes O[b, i, h, j] = Z_ij / ((1 - p) Nk)
    B, H, Nq, d = 2, 3, 45, 64
    q = torch.zeros(B, Nq, H, d)
    v = torch.eye(d).expand(B, H, d, d).permute(0, 2, 1, 3).contiguous()
    k = torch.randn(B, d, H, d)
    o, _ = F.attention_forward(q, k, v, dropout_p=p, seed=seed, offset=offset)
    applied = (o > 0).permute(0, 2, 1, 3)  # [B, H, Nq, Nk]
    expected = F.dropout_keep_mask(B, H, Nq, d, p, seed=seed, offset=offset)
    assert torch.equal(applied, expected)
    kept = o[o > 0]
    assert torch.allclose(kept, torch.full_like(kept, 1.0 / ((1 - p) * d)), rtol=1e-6)


def test_backward_replays_the_forward_mask() -> None:
    # dV = (P o Z / (1-p))^T dO with uniform P (q = 0) and dO = identity rows: dV[j, h, i] = Z_ij / ((1-p) N),
    # value for value; dQ against the float64 backward with the same mask; dK = 0 (q = 0)
    B, H, N, d = 1, 2, 64, 64
    p, seed, offset = 0.3, 99, 5
    q = torch.zeros(B, N, H, d)
    k = torch.randn(B, N, H, d)
    v = torch.randn(B, N, H, d)
    o, lse = F.attention_forward(q, k, v, dropout_p=p, seed=seed, offset=offset)
    do = torch.eye(d).expand(B, H, N, d).permute(0, 2, 1, 3).contiguous()
    dq, dk, dv = F.attention_backward(do, q, k, v, o, lse, dropout_p=p, seed=seed, offset=offset)
    keep = F.dropout_keep_mask(B, H, N, N, p, seed=seed, offset=offset)  # [B, H, i, j]
    expected_dv = (keep.double() / ((1 - p) * N)).permute(0, 3, 1, 2)  # [B, j, H, i]
    torch.testing.assert_close(dv.double(), expected_dv, rtol=4 * EPS32, atol=0)
    assert not dk.any()

    rkw = dict(keep_mask=keep, dropout_p=p)
    o64, lse64 = R.attention_forward_ref(q, k, v, **rkw)
    dq64, _, dv64 = R.attention_backward_ref(do, q, k, v, o64, lse64, **rkw)
    torch.testing.assert_close(dv64, expected_dv, rtol=1e-12, atol=0)  # the closed form is the reference's
    qt = q.clone().requires_grad_(True)
    R.attention_ref_torch(qt, k, v, **rkw).backward(do)  # plain float32 PyTorch: flash-attn's criterion
    flash_criterion("dq", dq, dq64, qt.grad, 2e-6 * max(1.0, dq64.abs().max().item()))


def test_mask_statistics_and_tile_independence() -> None:
    m = F.dropout_keep_mask(2, 2, 300, 300, 0.25, seed=1, offset=2)
    frac = m.float().mean().item()
    n = m.numel()
    assert abs(frac - 0.75) < 5 * (0.25 * 0.75 / n) ** 0.5
    # a pure function of (b, h, row, col): a smaller problem is a slice of a larger one
    small = F.dropout_keep_mask(2, 2, 123, 77, 0.25, seed=1, offset=2)
    assert torch.equal(small, m[:, :, :123, :77])
