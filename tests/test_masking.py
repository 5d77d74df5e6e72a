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
CONFIGS = [(br, bc, causal, kp) for br, bc in BLOCKS for causal in (False, True) for kp in (False, True)]
SEQLENS = [(1, 1), (1, 5), (5, 1), (16, 16), (17, 15), (15, 17), (33, 100), (100, 33), (64, 64), (129, 257),
           (257, 129), (200, 7), (7, 200), (31, 31), (128, 256), (256, 128)]
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
    long long cfg, a, b, nq, nk, bb;
    while (std::scanf("%3s %lld", op, &cfg) == 2) {{
        switch (cfg) {{
{cases}
        }}
    }}
    return 0;
}}
"""

CASE = r"""
        case {i}: {{
            using namespace cfg{i};
            if (op[0] == 'K') {{ std::scanf("%lld %lld %lld %lld", &a, &b, &nq, &nk);
                std::printf("%d\n", (int)tile_kind((int)a, (int)b, (int)nq, (int)nk)); }}
            else if (op[0] == 'Q') {{ int lo, hi; std::scanf("%lld %lld %lld", &a, &nq, &nk);
                kv_block_q_range((int)a, (int)nq, (int)nk, &lo, &hi); std::printf("%d %d\n", lo, hi); }}
            else if (op[0] == 'C') {{ int lo, hi; std::scanf("%lld %lld %lld", &a, &nq, &nk);
                q_block_kv_range((int)a, (int)nq, (int)nk, &lo, &hi); std::printf("%d %d\n", lo, hi); }}
            else {{ std::scanf("%lld %lld %lld %lld %lld", &a, &b, &nq, &nk, &bb);
                std::vector<unsigned char> m = HAS_KEY_PADDING ? kpm_for(nk) : std::vector<unsigned char>();
                std::printf("%d\n", (int)allowed((int)a, (int)b, (int)nq, (int)nk, m.data(), (int)bb)); }}
            break;
        }}"""


@pytest.fixture(scope="module")
def cxx_rule(tmp_path_factory: pytest.TempPathFactory):
    """The C++ masking rule, one namespace per (B_r, B_c, causal, key padding), behind a query loop."""
    namespaces = "\n".join(
        f"namespace cfg{i} {{\nconstexpr int BLOCK_R = {br}, BLOCK_C = {bc};\n"
        f"constexpr bool IS_CAUSAL = {str(c).lower()}, HAS_KEY_PADDING = {str(kp).lower()};\n"
        f"constexpr bool IS_TOP_LEFT = false, HAS_WINDOW = false, HAS_ATTN_MASK = false, IS_VARLEN = false;\n"
        f'#include "masking.cuh"\n}}'
        for i, (br, bc, c, kp) in enumerate(CONFIGS))
    src = HARNESS.format(namespaces=namespaces, cases="".join(CASE.format(i=i) for i in range(len(CONFIGS))))
    d = tmp_path_factory.mktemp("masking")
    (d / "harness.cpp").write_text(src)
    cxx, _ = compiler()
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unused-variable",
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
    br, bc, causal, kp = CONFIGS[int(cfg)]
    if op == "K":
        row0, col0, nq, nk = map(int, args)
        return str(int(tile_kind(row0, col0, nq, nk, block_r=br, block_c=bc, causal=causal, key_padding=kp)))
    if op == "Q":
        col0, nq, nk = map(int, args)
        return "%d %d" % kv_block_q_range(col0, nq, nk, block_r=br, causal=causal)
    if op == "C":
        row0, nq, nk = map(int, args)
        return "%d %d" % q_block_kv_range(row0, nq, nk, block_r=br, causal=causal)
    row, col, nq, nk, b = map(int, args)
    return str(int(allowed(row, col, nq, nk, causal=causal, kpm=_kpm(nk) if kp else None, b=b)))


def test_cxx_and_python_agree(cxx_rule) -> None:
    rng = random.Random(0)
    queries = []
    for i, (br, bc, causal, kp) in enumerate(CONFIGS):
        for nq, nk in SEQLENS:
            for row0 in range(0, nq + br, br):
                queries.append(f"C {i} {row0} {nq} {nk}")
                for col0 in range(0, nk + bc, bc):
                    queries.append(f"K {i} {row0} {col0} {nq} {nk}")
            for col0 in range(0, nk + bc, bc):
                queries.append(f"Q {i} {col0} {nq} {nk}")
            for _ in range(60):
                queries.append(f"A {i} {rng.randrange(-1, nq + 2)} {rng.randrange(-1, nk + 2)} {nq} {nk} "
                               f"{rng.randrange(2)}")
    got = cxx_rule(queries)
    bad = [(q, g, _py_answer(q)) for q, g in zip(queries, got) if g != _py_answer(q)]
    assert not bad, f"{len(bad)} disagreements, e.g. {bad[:5]}"


def test_cxx_rule_is_64_bit_at_int32_limits(cxx_rule) -> None:
    """row + Nk - Nq and row0 + BLOCK_R overflow int32 near 2**31: the rule computes them in 64 bits."""
    i = CONFIGS.index((64, 128, True, False))
    br, bc = 64, 128
    n = BIG
    queries = [
        f"A {i} {n - 2} {n - 2} {n} {n} 0",  # on the diagonal: row + Nk overflows int32
        f"A {i} {n - 2} {n - 1} {n} {n} 0",  # just above it
        f"A {i} 5 {n - 5} 10 {n} 0",  # Nk - Nq ~ 2**31: every key up to row + Nk - Nq
        f"K {i} {n - 10} {n - 200} {n} {n}",  # row0 + BLOCK_R > INT_MAX
        f"K {i} {(n // br - 1) * br} 0 {n} {n}",
        f"C {i} {n - 10} {n} {n}",
        f"C {i} 0 10 {n}",
        f"Q {i} {n - 100} {n} {n}",
        f"Q {i} {n - 100} 10 {n}",
    ]
    got = cxx_rule(queries)
    assert got == [_py_answer(q) for q in queries]
    assert got[:3] == ["1", "0", "1"]
    assert got[5] == f"0 {n}" and got[6] == f"0 {n}"


@pytest.mark.parametrize("br,bc,causal,kp", CONFIGS)
def test_tile_counts_closed_form_matches_per_tile_count(br: int, bc: int, causal: bool, kp: bool) -> None:
    rng = random.Random(br * 1000 + bc)
    cases = SEQLENS + [(0, 5), (5, 0), (0, 0)] + [(rng.randrange(1, 600), rng.randrange(1, 600)) for _ in range(40)]
    for nq, nk in cases:
        kinds = {(r, c): tile_kind(r, c, nq, nk, block_r=br, block_c=bc, causal=causal, key_padding=kp)
                 for r in range(0, nq, br) for c in range(0, nk, bc)}
        visited = [rc for rc, k in kinds.items() if k != TileKind.SKIP]
        want = {
            "total": len(kinds),
            "visited": len(visited),
            "skipped": sum(k == TileKind.SKIP for k in kinds.values()),
            "fully_visible": sum(k == TileKind.FULL for k in kinds.values()),
            "rows_visited": sum(min(br, nq - r) for r, _ in visited),
            "cols_visited": sum(min(bc, nk - c) for _, c in visited),
        }
        assert tile_counts(nq, nk, br, bc, causal, kp) == want, (nq, nk)


@pytest.mark.parametrize("br,bc,causal", [(16, 16, True), (32, 16, True), (16, 48, False), (64, 128, True)])
def test_loop_bounds_visit_exactly_the_non_skip_tiles(br: int, bc: int, causal: bool) -> None:
    for nq, nk in SEQLENS:
        kind = {(r, c): tile_kind(r, c, nq, nk, block_r=br, block_c=bc, causal=causal, key_padding=False)
                for r in range(0, nq, br) for c in range(0, nk, bc)}
        non_skip = {rc for rc, k in kind.items() if k != TileKind.SKIP}
        by_kv = set()
        for c in range(0, nk, bc):
            lo, hi = kv_block_q_range(c, nq, nk, block_r=br, causal=causal)
            assert lo % br == 0
            by_kv |= {(r, c) for r in range(lo, hi, br)}
        by_q = set()
        for r in range(0, nq, br):
            lo, hi = q_block_kv_range(r, nq, nk, block_r=br, causal=causal)
            assert lo % bc == 0
            by_q |= {(r, c) for c in range(lo, hi, bc)}
        assert by_kv == non_skip == by_q, (nq, nk)
        # FULL really is free of mask math: every element allowed
        for (r, c), k in kind.items():
            if k == TileKind.FULL:
                assert all(allowed(x, y, nq, nk, causal=causal) for x in range(r, r + br) for y in range(c, c + bc))


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
    src = render(KernelSpec(direction=direction, head_dim=64, causal=True, impl="simt")).source
    rule = (templates_dir() / "partials" / "masking.cuh").read_text()
    assert rule.strip().splitlines()[0] in src and src.count("FA_DEVICE TileKind tile_kind(") == 1
    loop = "kv_block_q_range(" if direction == "bwd" else "q_block_kv_range("
    assert src.count(loop) == 2  # the definition and the kernel's inner-loop bounds
    assert "TILE_SKIP" in src.split("extern \"C\"", 1)[1]



PROBE = r"""
// Test probe: the masking rule as the emulator compiles it for a real module (header included).
extern "C" __global__ void fa_probe_masking(const long long* queries, int* out, const unsigned char* kpm, int n) {
    using namespace fa;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const long long* q = queries + 6 * t;  // op, a, b, nq, nk, batch
    const int a = (int)q[1], bb = (int)q[2], nq = (int)q[3], nk = (int)q[4];
    int lo = 0, hi = 0;
    if (q[0] == 0) { out[2 * t] = (int)tile_kind(a, bb, nq, nk); }
    else if (q[0] == 1) { kv_block_q_range(a, nq, nk, &lo, &hi); out[2 * t] = lo; out[2 * t + 1] = hi; }
    else if (q[0] == 2) { q_block_kv_range(a, nq, nk, &lo, &hi); out[2 * t] = lo; out[2 * t + 1] = hi; }
    else { out[2 * t] = (int)allowed(a, bb, nq, nk, kpm, (int)q[5]); }
}
"""


@pytest.mark.parametrize("causal,kp", [(True, False), (True, True)])
def test_emulator_build_agrees(causal: bool, kp: bool) -> None:
    """The same rule inside a rendered module, built by the emulator (FAGEN_EMULATOR, its shim)."""
    import numpy as np

    from fagen.emulator import KernelSig, build

    spec = KernelSpec(direction="fwd", head_dim=32, causal=causal, key_padding=kp, block_r=32, block_c=16,
                      impl="simt")
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
        for r0 in range(0, nq + br, br):
            rows.append((2, r0, 0, nq, nk, 0))
            want.append(q_block_kv_range(r0, nq, nk, block_r=br, causal=causal))
            for c0 in range(0, nk + bc, bc):
                rows.append((0, r0, c0, nq, nk, 0))
                want.append((int(tile_kind(r0, c0, nq, nk, block_r=br, block_c=bc, causal=causal, key_padding=kp)), 0))
        for c0 in range(0, nk + bc, bc):
            rows.append((1, c0, 0, nq, nk, 0))
            want.append(kv_block_q_range(c0, nq, nk, block_r=br, causal=causal))
        if nk == nk_max or not kp:
            for _ in range(100):
                r, c, b = rng.randrange(-1, nq + 1), rng.randrange(-1, nk + 1), rng.randrange(2)
                rows.append((3, r, c, nq, nk, b))
                want.append((int(allowed(r, c, nq, nk, causal=causal, kpm=m if kp else None, b=b)), 0))
    queries = np.array(rows, dtype=np.int64)
    out = np.zeros((len(rows), 2), dtype=np.int32)
    mod.launch("fa_probe_masking", -(-len(rows) // 128), 128, 0, [queries, out, kpm, len(rows)])
    got = [tuple(int(x) for x in row) for row in out]
    bad = [(r, g, w) for r, g, w in zip(rows, got, want) if g != tuple(w)]
    assert not bad, bad[:5]
