"""One masking rule: templates/partials/masking.cuh (compiled with g++) and fagen/masking.py agree
on every function; tile_counts' closed form equals a per-tile count; the loop bounds are tight."""
from __future__ import annotations

import random
import subprocess

import pytest

from fagen.emulator.toolchain import compiler
from fagen.masking import (TileKind, allowed, floor_sum, kv_block_q_range, q_block_kv_range, tile_counts,
                           tile_kind)
from fagen.renderer import render, templates_dir
from fagen.spec import KernelSpec

BLOCKS = [(16, 16), (16, 48), (32, 16), (64, 128), (128, 64)]
#: (key padding, window, top_left) variants compiled per block and causal flag
VARIANTS = [(False, False, False), (True, False, False), (False, True, False), (False, False, True), (True, True, True)]
CONFIGS = [(br, bc, causal, kp, win, tl) for br, bc in BLOCKS for causal in (False, True) for kp, win, tl in VARIANTS]
SEQLENS = [(1, 1), (1, 5), (5, 1), (16, 16), (17, 15), (15, 17), (33, 100), (100, 33), (64, 64), (129, 257),
           (257, 129), (200, 7), (7, 200), (31, 31), (128, 256), (256, 128)]
WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 5), (20, 0), (7, 40), (100, 3), (0, 17)]
BIG = 2**31 - 1


def _kpm(nk: int, batch: int = 2) -> list[int]:
    return [int((b * 7 + c * 3) % 5 != 0) for b in range(batch) for c in range(nk)]


HARNESS = r"""
#include <cstdio>
#include <cstring>
#include <vector>
#define FA_DEVICE inline
{namespaces}
static std::vector<unsigned char> kpm_for(long long nk) {{
    std::vector<unsigned char> m(2 * nk);
    for (long long b = 0; b < 2; ++b)
        for (long long c = 0; c < nk; ++c) m[b * nk + c] = (b * 7 + c * 3) % 5 != 0;
    return m;
}}
int main() {{
    char op[4];
    long long cfg, a, b, nq, nk, bb, wl, wr;
    while (std::scanf("%3s %lld", op, &cfg) == 2) {{
        switch (cfg) {{
{cases}
        }}
    }}
    return 0;
}}
"""

# K: tile_kind, Q: kv_block_q_range, C: q_block_kv_range, A: allowed (structural + data masks).
CASE = r"""
        case {i}: {{
            using namespace cfg{i};
            if (op[0] == 'K') {{ std::scanf("%lld %lld %lld %lld %lld %lld", &a, &b, &nq, &nk, &wl, &wr);
                std::printf("%d\n", (int)tile_kind((int)a, (int)b, make_mask_params((int)nq, (int)nk, (int)wl, (int)wr))); }}
            else if (op[0] == 'Q') {{ int lo, hi; std::scanf("%lld %lld %lld %lld %lld", &a, &nq, &nk, &wl, &wr);
                kv_block_q_range((int)a, make_mask_params((int)nq, (int)nk, (int)wl, (int)wr), &lo, &hi);
                std::printf("%d %d\n", lo, hi); }}
            else if (op[0] == 'C') {{ int lo, hi; std::scanf("%lld %lld %lld %lld %lld", &a, &nq, &nk, &wl, &wr);
                q_block_kv_range((int)a, make_mask_params((int)nq, (int)nk, (int)wl, (int)wr), &lo, &hi);
                std::printf("%d %d\n", lo, hi); }}
            else {{ std::scanf("%lld %lld %lld %lld %lld %lld %lld", &a, &b, &nq, &nk, &bb, &wl, &wr);
                std::vector<unsigned char> m = HAS_KEY_PADDING ? kpm_for(nk) : std::vector<unsigned char>();
                const DataMask dm = make_data_mask(m.data(), nk, nullptr, 0, 0, 0, 0);
                std::printf("%d\n", (int)allowed((int)bb, 0, (int)a, (int)b, make_mask_params((int)nq, (int)nk, (int)wl, (int)wr), dm)); }}
            break;
        }}"""


@pytest.fixture(scope="module")
def cxx_rule(tmp_path_factory: pytest.TempPathFactory):
    """The C++ masking rule, one namespace per config, behind a query loop."""
    namespaces = "\n".join(
        f"namespace cfg{i} {{\nconstexpr int BLOCK_R = {br}, BLOCK_C = {bc};\n"
        f"constexpr bool IS_CAUSAL = {str(c).lower()}, HAS_KEY_PADDING = {str(kp).lower()};\n"
        f"constexpr bool HAS_WINDOW = {str(win).lower()}, IS_TOP_LEFT = {str(tl).lower()};\n"
        f"constexpr bool HAS_ATTN_MASK = false, IS_VARLEN = false;\n"
        f'#include "masking.cuh"\n}}'
        for i, (br, bc, c, kp, win, tl) in enumerate(CONFIGS))
    src = HARNESS.format(namespaces=namespaces, cases="".join(CASE.format(i=i) for i in range(len(CONFIGS))))
    d = tmp_path_factory.mktemp("masking")
    (d / "harness.cpp").write_text(src)
    cxx, _ = compiler()
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unused-variable", "-Wno-unused-function",
                    f"-I{templates_dir() / 'partials'}", str(d / "harness.cpp"), "-o", str(d / "harness")],
                   check=True, capture_output=True, text=True)

    def run(queries: list[str]) -> list[str]:
        out = subprocess.run([str(d / "harness")], input="\n".join(queries) + "\n", capture_output=True,
                             text=True, check=True).stdout
        lines = out.splitlines()
        assert len(lines) == len(queries)
        return lines

    return run


def _py_answer(q: str) -> str:
    op, cfg, *args = q.split()
    br, bc, causal, kp, win, tl = CONFIGS[int(cfg)]
    ints = list(map(int, args))
    kw = dict(causal=causal, top_left=tl, window=tuple(ints[-2:]) if win else (-1, -1))
    if op == "K":
        row0, col0, nq, nk = ints[:4]
        return str(int(tile_kind(row0, col0, nq, nk, block_r=br, block_c=bc, key_padding=kp, **kw)))
    if op == "Q":
        col0, nq, nk = ints[:3]
        return "%d %d" % kv_block_q_range(col0, nq, nk, block_r=br, block_c=bc, **kw)
    if op == "C":
        row0, nq, nk = ints[:3]
        return "%d %d" % q_block_kv_range(row0, nq, nk, block_r=br, block_c=bc, **kw)
    row, col, nq, nk, b = ints[:5]
    return str(int(allowed(row, col, nq, nk, kpm=_kpm(nk) if kp else None, b=b, **kw)))


def test_cxx_and_python_agree(cxx_rule) -> None:
    rng = random.Random(0)
    queries = []
    for i, (br, bc, causal, kp, win, tl) in enumerate(CONFIGS):
        for nq, nk in SEQLENS:
            for wl, wr in (WINDOWS if win else [(-1, -1)]) + [(rng.randrange(-1, 300), rng.randrange(-1, 300))]:
                w = f"{wl} {wr}"
                for row0 in range(0, nq + br, br):
                    queries.append(f"C {i} {row0} {nq} {nk} {w}")
                    for col0 in range(0, nk + bc, bc):
                        queries.append(f"K {i} {row0} {col0} {nq} {nk} {w}")
                for col0 in range(0, nk + bc, bc):
                    queries.append(f"Q {i} {col0} {nq} {nk} {w}")
                for _ in range(30):
                    queries.append(f"A {i} {rng.randrange(-1, nq + 2)} {rng.randrange(-1, nk + 2)} {nq} {nk} "
                                   f"{rng.randrange(2)} {w}")
    got = cxx_rule(queries)
    bad = [(q, g, _py_answer(q)) for q, g in zip(queries, got) if g != _py_answer(q)]
    assert not bad, f"{len(bad)} disagreements, e.g. {bad[:5]}"


def test_cxx_rule_is_64_bit_at_int32_limits(cxx_rule) -> None:
    """row + Nk - Nq and row0 + BLOCK_R overflow int32 near 2**31: the rule computes them in 64 bits."""
    i = CONFIGS.index((64, 128, True, False, False, False))
    iw = CONFIGS.index((64, 128, True, False, True, False))
    n = BIG
    nw = "-1 -1"
    queries = [
        f"A {i} {n - 2} {n - 2} {n} {n} 0 {nw}",  # on the diagonal: row + Nk overflows int32
        f"A {i} {n - 2} {n - 1} {n} {n} 0 {nw}",  # just above it
        f"A {i} 5 {n - 5} 10 {n} 0 {nw}",  # Nk - Nq ~ 2**31: every key up to row + Nk - Nq
        f"K {i} {n - 10} {n - 200} {n} {n} {nw}",  # row0 + BLOCK_R > INT_MAX
        f"K {i} {(n // 64 - 1) * 64} 0 {n} {n} {nw}",
        f"C {i} {n - 10} {n} {n} {nw}",
        f"C {i} 0 10 {n} {nw}",
        f"Q {i} {n - 100} {n} {n} {nw}",
        f"Q {i} {n - 100} 10 {n} {nw}",
        f"A {iw} {n - 2} {n - 2 - n // 2} {n} {n} 0 {n // 2} 0",  # window left ~ 2**30 at the far end
        f"A {iw} 3 {n - 20} 10 {n} 0 {n - 1} {n - 1}",
        f"C {iw} {n - 10} {n} {n} {n - 1} 5",
        f"Q {iw} {n - 100} 10 {n} 2 2",
        f"K {iw} 0 {n - 200} {n // 2} {n} {n} 0",
    ]
    got = cxx_rule(queries)
    assert got == [_py_answer(q) for q in queries]
    assert got[:3] == ["1", "0", "1"]
    assert got[5] == f"0 {n}" and got[6] == f"0 {n}"


def test_window_semantics_match_flash_attn_docstring() -> None:
    """flash_attn_func: "query at position i will only attend to keys between
    [i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q + window_size[1]] inclusive";
    causal: bottom-right aligned, e.g. seqlen_q = 2, seqlen_k = 5:  1 1 1 1 0 / 1 1 1 1 1;
    seqlen_q = 5, seqlen_k = 2: 0 0 / 0 0 / 0 0 / 1 0 / 1 1 (a row with no key is masked whole)."""
    def grid(nq: int, nk: int, **kw) -> list[str]:
        return ["".join(str(int(allowed(i, j, nq, nk, **kw))) for j in range(nk)) for i in range(nq)]

    assert grid(2, 5, causal=True) == ["11110", "11111"]
    assert grid(5, 2, causal=True) == ["00", "00", "00", "10", "11"]
    # window (1, 1), Nq = 3, Nk = 5: row i sees keys i + 2 - 1 .. i + 2 + 1
    assert grid(3, 5, causal=False, window=(1, 1)) == ["01110", "00111", "00011"]
    # causal + window (1, 3) is window (1, 0)
    assert grid(3, 5, causal=True, window=(1, 3)) == ["01100", "00110", "00011"]
    # one side unbounded
    assert grid(3, 3, causal=False, window=(-1, 0)) == grid(3, 3, causal=True)
    assert grid(3, 3, causal=False, window=(0, -1)) == ["111", "011", "001"]
    # torch SDPA's is_causal (top-left): torch.ones(L, S).tril(diagonal=0)
    assert grid(2, 5, causal=True, top_left=True) == ["10000", "11000"]
    assert grid(5, 2, causal=True, top_left=True) == ["10", "11", "11", "11", "11"]
    with pytest.raises(ValueError, match="window"):
        allowed(0, 0, 1, 1, causal=False, window=(1,))


def _brute_counts(nq: int, nk: int, br: int, bc: int, kp: bool, **kw) -> dict[str, int]:
    kinds = {(r, c): tile_kind(r, c, nq, nk, block_r=br, block_c=bc, key_padding=kp, **kw)
             for r in range(0, nq, br) for c in range(0, nk, bc)}
    visited = [rc for rc, k in kinds.items() if k != TileKind.SKIP]
    return {
        "total": len(kinds),
        "visited": len(visited),
        "skipped": sum(k == TileKind.SKIP for k in kinds.values()),
        "fully_visible": sum(k == TileKind.FULL for k in kinds.values()),
        "rows_visited": sum(min(br, nq - r) for r, _ in visited),
        "cols_visited": sum(min(bc, nk - c) for _, c in visited),
    }


@pytest.mark.parametrize("br,bc", BLOCKS)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_counts_closed_form_matches_per_tile_count(br: int, bc: int, causal: bool) -> None:
    rng = random.Random(br * 1000 + bc + causal)
    cases = SEQLENS + [(0, 5), (5, 0), (0, 0)] + [(rng.randrange(1, 600), rng.randrange(1, 600)) for _ in range(40)]
    for nq, nk in cases:
        for kp, win, tl in VARIANTS:
            windows = ([rng.choice(WINDOWS), (rng.randrange(-1, 200), rng.randrange(-1, 200))] if win
                       else [(-1, -1)])
            for w in windows:
                kw = dict(causal=causal, window=w, top_left=tl)
                want = _brute_counts(nq, nk, br, bc, kp, **kw)
                assert tile_counts(nq, nk, br, bc, causal, kp, window=w, top_left=tl) == want, (nq, nk, kp, w, tl)
    # an attention mask is data: no FULL tile, the same visits
    assert tile_counts(64, 64, 16, 16, causal, False, attn_mask=True)["fully_visible"] == 0
    assert (tile_counts(64, 64, 16, 16, causal, False, attn_mask=True)["visited"]
            == tile_counts(64, 64, 16, 16, causal, False)["visited"])


@pytest.mark.parametrize("br,bc,causal", [(16, 16, True), (32, 16, True), (16, 48, False), (64, 128, True)])
@pytest.mark.parametrize("w,tl", [((-1, -1), False), ((-1, -1), True), ((7, 40), False), ((20, 0), True),
                                  ((0, 0), False), ((100, 3), False)])
def test_loop_bounds_visit_exactly_the_non_skip_tiles(br: int, bc: int, causal: bool, w: tuple, tl: bool) -> None:
    kw = dict(causal=causal, window=w, top_left=tl)
    for nq, nk in SEQLENS:
        kind = {(r, c): tile_kind(r, c, nq, nk, block_r=br, block_c=bc, key_padding=False, **kw)
                for r in range(0, nq, br) for c in range(0, nk, bc)}
        non_skip = {rc for rc, k in kind.items() if k != TileKind.SKIP}
        by_kv = set()
        for c in range(0, nk, bc):
            lo, hi = kv_block_q_range(c, nq, nk, block_r=br, block_c=bc, **kw)
            assert lo % br == 0
            by_kv |= {(r, c) for r in range(lo, hi, br)}
        by_q = set()
        for r in range(0, nq, br):
            lo, hi = q_block_kv_range(r, nq, nk, block_r=br, block_c=bc, **kw)
            assert lo % bc == 0
            by_q |= {(r, c) for c in range(lo, hi, bc)}
        assert by_kv == non_skip == by_q, (nq, nk)
        for (r, c), k in kind.items():
            cells = [allowed(x, y, nq, nk, **kw) for x in range(r, r + br) for y in range(c, c + bc)]
            if k == TileKind.FULL:  # FULL really is free of mask math: every element allowed
                assert all(cells)
            assert any(cells) == (k != TileKind.SKIP)  # SKIP exactly when no element is allowed


def test_tile_counts_is_closed_form_at_huge_lengths() -> None:
    n, b = 2**40, 64
    t = n // b
    square = tile_counts(n, n, b, b, True, False)
    assert square["visited"] == t * (t + 1) // 2 and square["fully_visible"] == t * (t - 1) // 2
    assert tile_counts(n, n, b, b, False, True) == {"total": t * t, "visited": t * t, "skipped": 0,
                                                    "fully_visible": 0, "rows_visited": t * n,
                                                    "cols_visited": t * n}
    # Nq > Nk: the first Nq - Nk rows see no key at all
    assert tile_counts(n, n // 2, b, b, True, False)["visited"] == (t // 2) * (t // 2 + 1) // 2
    # causal sliding window of 2 blocks (aligned): Q block I sees keys [I*b - 2b, I*b + b - 1], i.e. K/V
    # blocks I-2, I-1, I (fewer for I < 2); only block I-1 lies wholly inside every row's band
    win = tile_counts(n, n, b, b, True, False, window=(2 * b, 0))
    assert win["visited"] == 3 * t - 3 and win["fully_visible"] == t - 1
    # top-left with Nq < Nk: the keys past Nq are never seen by a causal row
    assert tile_counts(n // 2, n, b, b, True, False, top_left=True)["visited"] == (t // 2) * (t // 2 + 1) // 2


def test_floor_sum() -> None:
    rng = random.Random(1)
    for _ in range(300):
        n, m, a, b = rng.randrange(0, 40), rng.randrange(1, 30), rng.randrange(0, 50), rng.randrange(0, 50)
        assert floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))
    with pytest.raises(ValueError, match="m >= 1"):
        floor_sum(3, 0, 1, 1)


def test_tile_counts_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="seqlen_q"):
        tile_counts(-1, 5, 16, 16, False, False)
    with pytest.raises(ValueError, match="block_c"):
        tile_counts(5, 5, 16, 0, False, False)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_every_kernel_includes_the_one_rule(direction: str) -> None:
    src = render(KernelSpec(direction=direction, head_dim=64, causal=True)).source
    rule = (templates_dir() / "partials" / "masking.cuh").read_text()
    assert src.count(rule.strip().splitlines()[0]) == 1  # included once, by the header
    assert src.count("FA_DEVICE TileKind tile_kind(int row0, int col0, const MaskParams& mp)") == 1
    body = src.split('extern "C"', 1)[1]
    assert ("kv_block_q_range(" if direction == "bwd" else "q_block_kv_range(") in body  # the inner-loop bounds
    assert "TILE_SKIP" in body or "TILE_FULL" in body


@pytest.fixture()
def family_with(request: pytest.FixtureRequest):
    """Lend a family template features for rendering only (the probe reads no kernel)."""
    from fagen.families import get_family

    saved = []

    def lend(name: str, *features: str) -> None:
        fam = get_family(name)
        saved.append((fam, fam.features))
        object.__setattr__(fam, "features", frozenset(fam.features) | set(features))

    yield lend
    for fam, features in reversed(saved):
        object.__setattr__(fam, "features", features)


PROBE = r"""
// Test probe: the masking rule as the emulator compiles it for a real module (header included).
extern "C" __global__ void fa_probe_masking(const long long* queries, int* out, const unsigned char* kpm, int n) {
    using namespace fa;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const long long* q = queries + 8 * t;  // op, a, b, nq, nk, batch, window left, window right
    const int a = (int)q[1], bb = (int)q[2], nq = (int)q[3], nk = (int)q[4];
    const MaskParams mp = make_mask_params(nq, nk, (int)q[6], (int)q[7]);
    const DataMask dm = make_data_mask(kpm, nk, nullptr, 0, 0, 0, 0);
    int lo = 0, hi = 0;
    if (q[0] == 0) { out[2 * t] = (int)tile_kind(a, bb, mp); }
    else if (q[0] == 1) { kv_block_q_range(a, mp, &lo, &hi); out[2 * t] = lo; out[2 * t + 1] = hi; }
    else if (q[0] == 2) { q_block_kv_range(a, mp, &lo, &hi); out[2 * t] = lo; out[2 * t + 1] = hi; }
    else { out[2 * t] = (int)allowed((int)q[5], 0, a, bb, mp, dm); }
}
"""


@pytest.mark.parametrize("causal,kp,tl", [(True, False, False), (True, True, True), (False, False, True)])
def test_emulator_build_agrees(causal: bool, kp: bool, tl: bool, family_with) -> None:
    """The same rule inside a rendered module with a window compiled in, built by the emulator
    (FAGEN_EMULATOR, its shim)."""
    import numpy as np

    from fagen.emulator import KernelSig, build

    family_with("mma", "window", "top_left")
    spec = KernelSpec(direction="fwd", head_dim=32, causal=causal, key_padding=kp, window=True,
                      causal_align="top_left" if tl else "bottom_right", block_r=32, block_c=16, num_warps=2,
                      impl="mma")
    br, bc = spec.tile.block_r, spec.tile.block_c
    sig = KernelSig("fa_probe_masking", (("const long long*", "queries"), ("int*", "out"),
                                         ("const unsigned char*", "kpm"), ("int", "n")))
    mod = build(render(spec).source + PROBE, [sig])
    nk_max = 80
    kpm = np.array(_kpm(nk_max), dtype=np.uint8)  # [2, 80]: allowed() is probed with key padding only at nk = 80
    rows, want = [], []
    rng = random.Random(3)
    for nq, nk in [(1, 1), (17, 15), (15, 17), (33, 80), (80, 33), (64, 64), (70, 7)]:
        m = _kpm(nk)
        for w in [(-1, -1), (5, 0), (0, 9), (40, 2)]:
            kw = dict(causal=causal, window=w, top_left=tl)
            for r0 in range(0, nq + br, br):
                rows.append((2, r0, 0, nq, nk, 0, *w))
                want.append(q_block_kv_range(r0, nq, nk, block_r=br, block_c=bc, **kw))
                for c0 in range(0, nk + bc, bc):
                    rows.append((0, r0, c0, nq, nk, 0, *w))
                    want.append((int(tile_kind(r0, c0, nq, nk, block_r=br, block_c=bc, key_padding=kp, **kw)), 0))
            for c0 in range(0, nk + bc, bc):
                rows.append((1, c0, 0, nq, nk, 0, *w))
                want.append(kv_block_q_range(c0, nq, nk, block_r=br, block_c=bc, **kw))
            if nk == nk_max or not kp:
                for _ in range(50):
                    r, c, b = rng.randrange(-1, nq + 1), rng.randrange(-1, nk + 1), rng.randrange(2)
                    rows.append((3, r, c, nq, nk, b, *w))
                    want.append((int(allowed(r, c, nq, nk, kpm=m if kp else None, b=b, **kw)), 0))
    queries = np.array(rows, dtype=np.int64)
    out = np.zeros((len(rows), 2), dtype=np.int32)
    mod.launch("fa_probe_masking", -(-len(rows) // 128), 128, 0, [queries, out, kpm, len(rows)])
    got = [tuple(int(x) for x in row) for row in out]
    bad = [(r, g, w) for r, g, w in zip(rows, got, want) if g != tuple(w)]
    assert not bad, bad[:5]


def test_explain_draws_the_window(family_with, tmp_path) -> None:
    """fagen explain takes the runtime window of a window spec: its tile counts, map and CTA ranges
    are the rule's, the page names it, and a window for a spec without one is refused."""
    from fagen.cli import main
    from fagen.explain.facts import explain
    from fagen.explain.page import render_html
    from fagen.errors import InputError

    family_with("mma", "window", "top_left")
    spec = KernelSpec(direction="bwd", head_dim=32, causal=True, window=True, causal_align="top_left", impl="mma",
                      block_r=32, block_c=32, num_warps=2)
    nq, nk, w = 200, 300, (50, 0)
    f = explain(spec, nq, nk, with_resources=False, window=w)
    kw = dict(causal=True, window=w, top_left=True)
    c = tile_counts(nq, nk, 32, 32, True, False, window=w, top_left=True)
    assert f["tiles"] == {k: c[k] for k in ("total", "visited", "skipped", "fully_visible")}
    assert f["window"] == [50, 0] and f["causal_align"] == "top_left"
    for j, (first, end) in enumerate(f["cta_ranges"]):  # Q blocks [first, end) of the K/V block j
        lo, hi = kv_block_q_range(j * 32, nq, nk, block_r=32, block_c=32, **kw)
        assert (first, end) == ((lo // 32, -(-hi // 32)) if hi > lo else (0, 0))
    letters = "".join(run[0] * (run[2] - run[1]) for run in f["tile_map"][3])
    assert letters == "".join("spf"[tile_kind(96, j * 32, nq, nk, block_r=32, block_c=32, key_padding=False, **kw)]
                              for j in range(10))
    html = render_html(f)
    assert "window (50, 0)" in html and "window left = 50 (top-left)" in html
    with pytest.raises(InputError, match="window"):
        explain(spec.replace(window=False), nq, nk, with_resources=False, window=w)
    assert main(["explain", "--head-dim", "32", "--causal", "--window", "--window-size", "50", "0", "--impl", "mma",
                 "--seqlen-q", "64", "--json"]) == 0


SEQ_HARNESS = r"""
#include <cstdio>
#define FA_DEVICE inline
namespace fixed {
constexpr int BLOCK_R = 16, BLOCK_C = 16;
constexpr bool IS_CAUSAL = false, HAS_KEY_PADDING = false, HAS_WINDOW = false, HAS_ATTN_MASK = false;
constexpr bool IS_TOP_LEFT = false, IS_VARLEN = false;
#include "masking.cuh"
}
namespace packed {
constexpr int BLOCK_R = 16, BLOCK_C = 16;
constexpr bool IS_CAUSAL = false, HAS_KEY_PADDING = false, HAS_WINDOW = false, HAS_ATTN_MASK = false;
constexpr bool IS_TOP_LEFT = false, IS_VARLEN = true;
#include "masking.cuh"
}
int main() {
    const int cu_q[4] = {0, 3, 3, 10}, cu_k[4] = {0, 5, 6, 6};
    for (int b = 0; b < 3; ++b) {
        const fixed::SeqInfo f = fixed::fa_seq(b, 7, 9, nullptr, nullptr);
        const packed::SeqInfo p = packed::fa_seq(b, 7, 9, cu_q, cu_k);
        std::printf("%lld %lld %d %d %lld %lld %d %d %lld %lld %lld %lld\n", f.q_tok0, f.k_tok0, f.len_q, f.len_k,
                    p.q_tok0, p.k_tok0, p.len_q, p.len_k,
                    fixed::fa_row_offset(f.q_tok0, b, 2, 1, 1000, 10, 3), packed::fa_row_offset(p.q_tok0, b, 2, 1, 1000, 10, 3),
                    fixed::fa_lse_index(f, b, 1, 2, 2 * 7, 7), packed::fa_lse_index(p, b, 1, 2, 0, 10));
    }
    std::printf("%d %d %d\n", fixed::fa_kv_head(5, 8, 2), fixed::fa_kv_head(3, 8, 8), fixed::fa_kv_head(7, 8, 1));
    return 0;
}
"""


def test_sequence_addressing(tmp_path) -> None:
    """fa_seq / fa_row_offset / fa_lse_index / fa_kv_head: fixed [B, N, H, d] and packed varlen layouts."""
    (tmp_path / "seq.cpp").write_text(SEQ_HARNESS)
    cxx, _ = compiler()
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unused-function",
                    f"-I{templates_dir() / 'partials'}", str(tmp_path / "seq.cpp"), "-o", str(tmp_path / "seq")],
                   check=True, capture_output=True, text=True)
    lines = subprocess.run([str(tmp_path / "seq")], capture_output=True, text=True, check=True).stdout.splitlines()
    cu_q, cu_k = [0, 3, 3, 10], [0, 5, 6, 6]
    for b, line in enumerate(lines[:3]):
        got = list(map(int, line.split()))
        want = [b * 7, b * 9, 7, 9,  # fixed: tokens of batch b, lengths = the seqlen args
                cu_q[b], cu_k[b], cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b],  # varlen: from cu_seqlens
                b * 1000 + 2 * 10 + 1 * 3, (cu_q[b] + 2) * 10 + 1 * 3,  # row 2, head 1 (stride_b ignored when packed)
                b * 14 + 1 * 7 + 2, 1 * 10 + cu_q[b] + 2]  # lse [B, H, Nq] / [H, total_q]
        assert got == want, (b, got, want)
    assert lines[3].split() == ["1", "3", "0"]  # GQA: q head h reads kv head h // (H / H_kv)
