"""Tests for fagen.philox: Philox4x32-10 known answers and the dropout keep-mask."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from fagen.philox import drop_threshold, keep_mask, philox4x32_10

# Known-answer vectors of Philox4x32-10 (Random123 kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF,) * 2,
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def _philox_scalar(c: tuple[int, ...], k0: int, k1: int) -> tuple[int, ...]:
    """Plain-int Philox4x32-10, an independent transcription of the CUDA partial."""
    x, y, z, w = c
    for _ in range(10):
        p0, p1 = 0xD2511F53 * x, 0xCD9E8D57 * z
        x, y, z, w = (p1 >> 32) ^ y ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ w ^ k1, p0 & 0xFFFFFFFF
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return x, y, z, w


def _keep_scalar(seed: int, offset: int, bh: int, row: int, col: int, p: float) -> bool:
    r = _philox_scalar(
        (col >> 2, row, bh, offset & 0xFFFFFFFF),
        seed & 0xFFFFFFFF,
        (seed >> 32) ^ (offset >> 32),
    )
    return r[col & 3] >= drop_threshold(p)


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_known_answers(counter, key, expected):
    out = philox4x32_10(np.array(counter, dtype=np.uint32), *key)
    assert out.dtype == np.uint32
    assert tuple(int(x) for x in out) == expected
    assert _philox_scalar(counter, *key) == expected


def test_philox_vectorised_matches_rows():
    counters = np.array([c for c, _, _ in KAT[:1]] * 3, dtype=np.uint32).reshape(3, 1, 4)
    out = philox4x32_10(counters, 0, 0)
    assert out.shape == (3, 1, 4)
    assert (out == np.array(KAT[0][2], dtype=np.uint32)).all()
    rng = np.random.default_rng(0)
    c = rng.integers(0, 2**32, size=(5, 4), dtype=np.uint64)
    k0, k1 = 0xDEADBEEF, 0x01234567
    out = philox4x32_10(c, k0, k1)
    for row, got in zip(c, out):
        assert tuple(int(x) for x in got) == _philox_scalar(tuple(int(x) for x in row), k0, k1)


def test_drop_threshold():
    assert drop_threshold(0.0) == 0
    assert drop_threshold(0.5) == 2**31
    assert drop_threshold(0.25) == 2**30
    assert drop_threshold(0.1) == math.floor(0.1 * 2**32)
    assert drop_threshold(math.nextafter(1.0, 0.0)) == 2**32 - 1
    for bad in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="dropout_p"):
            drop_threshold(bad)


def test_keep_mask_matches_scalar_definition():
    B, H, Nq, Nk, p = 2, 3, 5, 11, 0.3
    seed, offset = 0x123456789ABCDEF0, 0xFEDCBA9876543210
    m = keep_mask(B, H, Nq, Nk, p, seed=seed, offset=offset)
    assert m.shape == (B, H, Nq, Nk) and m.dtype == np.bool_
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                for j in range(Nk):
                    assert m[b, h, i, j] == _keep_scalar(seed, offset, b * H + h, i, j, p)


@pytest.mark.parametrize("p", [0.05, 0.17, 0.5, 0.9])
def test_kept_fraction(p):
    m = keep_mask(2, 2, 257, 300, p, seed=42, offset=7)
    n = m.size
    q = 1.0 - drop_threshold(p) / 2**32
    sigma = math.sqrt(n * q * (1.0 - q))
    assert abs(int(m.sum()) - n * q) <= 5 * sigma


def test_p_zero_keeps_all():
    assert keep_mask(2, 3, 17, 33, 0.0, seed=5, offset=9).all()


def test_independent_of_problem_size():
    big = keep_mask(2, 3, 64, 70, 0.4, seed=11, offset=3)
    for nq, nk in [(1, 1), (7, 5), (64, 3), (13, 70), (33, 66)]:
        small = keep_mask(2, 3, nq, nk, 0.4, seed=11, offset=3)
        np.testing.assert_array_equal(small, big[:, :, :nq, :nk])


def test_depends_on_batch_head_index_via_bh():
    # (b, h) enters only through b*H + h.
    a = keep_mask(2, 3, 8, 8, 0.5, seed=1)
    b = keep_mask(3, 2, 8, 8, 0.5, seed=1)
    np.testing.assert_array_equal(a.reshape(6, 8, 8), b.reshape(6, 8, 8))


@pytest.mark.parametrize(
    "kw",
    [
        dict(seed=1),
        dict(offset=1),
        dict(seed=1 << 32),
        dict(offset=1 << 32),
        dict(seed=2**64 - 1, offset=2**64 - 1),
    ],
)
def test_seed_and_offset_change_mask(kw):
    base = keep_mask(1, 2, 32, 32, 0.5)
    other = keep_mask(1, 2, 32, 32, 0.5, **kw)
    assert (base != other).mean() > 0.3


def test_seed_hi_and_offset_hi_combine_by_xor():
    # key1 = seed_hi ^ offset_hi, so swapping the high words leaves the mask unchanged.
    a = keep_mask(1, 1, 8, 8, 0.5, seed=(5 << 32) | 1, offset=(9 << 32) | 2)
    b = keep_mask(1, 1, 8, 8, 0.5, seed=(9 << 32) | 1, offset=(5 << 32) | 2)
    np.testing.assert_array_equal(a, b)


def test_deterministic_and_fast():
    t0 = time.perf_counter()
    m1 = keep_mask(1, 1, 2048, 2048, 0.2, seed=3, offset=4)
    elapsed = time.perf_counter() - t0
    m2 = keep_mask(1, 1, 2048, 2048, 0.2, seed=3, offset=4)
    np.testing.assert_array_equal(m1, m2)
    assert elapsed < 2.0


@pytest.mark.parametrize(
    "args,kw,name",
    [
        ((1, 1, 4, 4, -0.1), {}, "dropout_p"),
        ((1, 1, 4, 4, 1.0), {}, "dropout_p"),
        ((1, 1, 4, 4, "0.5"), {}, "dropout_p"),
        ((0, 1, 4, 4, 0.5), {}, "batch"),
        ((1, -1, 4, 4, 0.5), {}, "nheads"),
        ((1, 1, 2.0, 4, 0.5), {}, "seqlen_q"),
        ((1, 1, 4, 0, 0.5), {}, "seqlen_k"),
        ((1, 1, 4, 4, 0.5), {"seed": -1}, "seed"),
        ((1, 1, 4, 4, 0.5), {"seed": 2**64}, "seed"),
        ((1, 1, 4, 4, 0.5), {"seed": 1.5}, "seed"),
        ((1, 1, 4, 4, 0.5), {"offset": -1}, "offset"),
        ((1, 1, 4, 4, 0.5), {"offset": 2**64}, "offset"),
        ((1, 1, 4, 4, 0.5), {"offset": None}, "offset"),
    ],
)
def test_validation(args, kw, name):
    with pytest.raises(ValueError, match=name):
        keep_mask(*args, **kw)


def test_numpy_integer_seed_accepted():
    a = keep_mask(1, 1, 4, 8, 0.5, seed=np.uint64(2**63 + 5), offset=np.int64(3))
    b = keep_mask(1, 1, 4, 8, 0.5, seed=2**63 + 5, offset=3)
    np.testing.assert_array_equal(a, b)


def test_philox_counter_validation():
    with pytest.raises(ValueError, match="counter"):
        philox4x32_10(np.zeros((2, 3), dtype=np.uint32), 0, 0)
    with pytest.raises(ValueError, match="counter"):
        philox4x32_10(np.array([-1, 0, 0, 0]), 0, 0)
    with pytest.raises(TypeError, match="counter"):
        philox4x32_10(np.zeros(4, dtype=np.float32), 0, 0)
    with pytest.raises(ValueError, match="key0"):
        philox4x32_10(np.zeros(4, dtype=np.uint32), 2**32, 0)
