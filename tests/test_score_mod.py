"""templates/partials/score_mod.cuh (compiled with g++) against the score formulas fagen.reference
states: s = softcap * tanh(scale * qk / softcap) - slope * |i + shift - j| + bias[i, j], and the
gradient w.r.t. qk (torch autograd in float64)."""
from __future__ import annotations

import itertools
import math
import random
import subprocess

import pytest
import torch

from fagen.emulator.toolchain import compiler
from fagen.renderer import templates_dir

#: (softcap, alibi, bias, top_left, tanh_approx) compiled per namespace; A = float and double. tanh_approx
#: (SOFTCAP_TANH_APPROX, with softcap only): the argument by 1 / softcap and fa_tanh_approx, here the
#: emulator's exact tanhf (its SFU error is tests/test_ptx_semantics.py's).
CONFIGS = [(*c, ap) for c in itertools.product((False, True), repeat=4) for ap in ((False, True) if c[0] else (False,))]

HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <vector>
#define FA_DEVICE inline
inline float fa_to_float(float x) {{ return x; }}
inline double fa_to_float(double x) {{ return x; }}
inline float fa_tanh_approx(float x) {{ return std::tanh(x); }}
{namespaces}
int main() {{
    long long cfg;
    int row, col, nq, nk;
    double qk, ds, scale, cap, slope, bias;
    while (std::scanf("%lld %d %d %d %d %lf %lf %lf %lf %lf %lf", &cfg, &row, &col, &nq, &nk, &qk, &ds, &scale, &cap,
                      &slope, &bias) == 11) {{
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
            const MaskParams mp = make_mask_params(nq, nk, -1, -1);
            const float slopes[2] = {{0.f, (float)slope}};
            std::vector<T> bias_m(2 * (size_t)nq * nk, (T)0);  // [B = 2, 1, nq, nk]; batch 1 holds the value
            bias_m[(size_t)nq * nk + (size_t)row * nk + col] = (T)bias;
            const ScoreParams sp = make_score_params((float)scale, (float)cap, slopes, 1, bias_m.data(),
                                                     (long long)nq * nk, 0, nk, 1, 1, 0, mp);
            std::printf("%.17g %.17g %.17g %.17g\n", score_fwd<double>(qk, row, col, sp), score_bwd<double>(ds, qk, sp),
                        (double)score_fwd<float>((float)qk, row, col, sp), (double)score_bwd<float>((float)ds, (float)qk, sp));
            break;
        }}"""


@pytest.fixture(scope="module")
def cxx_score(tmp_path_factory: pytest.TempPathFactory):
    namespaces = "\n".join(
        f"namespace cfg{i} {{\nusing T = double;\nconstexpr int BLOCK_R = 16, BLOCK_C = 16;\n"
        f"constexpr bool IS_CAUSAL = false, HAS_KEY_PADDING = false, HAS_WINDOW = false, HAS_ATTN_MASK = false;\n"
        f"constexpr bool IS_VARLEN = false, IS_TOP_LEFT = {str(tl).lower()};\n"
        f"constexpr bool HAS_SOFTCAP = {str(sc).lower()}, HAS_ALIBI = {str(al).lower()}, HAS_BIAS = {str(bi).lower()};\n"
        f"constexpr bool SOFTCAP_TANH_APPROX = {str(ap).lower()};\n"
        f'#include "masking.cuh"\n#include "score_mod.cuh"\n}}'
        for i, (sc, al, bi, tl, ap) in enumerate(CONFIGS))
    src = HARNESS.format(namespaces=namespaces, cases="".join(CASE.format(i=i) for i in range(len(CONFIGS))))
    d = tmp_path_factory.mktemp("score_mod")
    (d / "harness.cpp").write_text(src)
    cxx, _ = compiler()
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unused-variable", "-Wno-unused-function",
                    f"-I{templates_dir() / 'partials'}", str(d / "harness.cpp"), "-o", str(d / "harness")],
                   check=True, capture_output=True, text=True)

    def run(queries: list[str]) -> list[list[float]]:
        out = subprocess.run([str(d / "harness")], input="\n".join(queries) + "\n", capture_output=True, text=True,
                             check=True).stdout.splitlines()
        assert len(out) == len(queries)
        return [[float(x) for x in line.split()] for line in out]

    return run


def _want(cfg: int, row: int, col: int, nq: int, nk: int, qk: float, ds: float, scale: float, cap: float,
          slope: float, bias: float) -> tuple[float, float]:
    sc, al, bi, tl, _ = CONFIGS[cfg]
    shift = 0 if tl else nk - nq
    x = torch.tensor(qk, dtype=torch.float64, requires_grad=True)
    s = x * scale
    if sc:
        s = cap * torch.tanh(s / cap)
    if al:
        s = s - slope * abs(row + shift - col)
    if bi:
        s = s + bias
    s.backward(torch.tensor(ds, dtype=torch.float64))
    return float(s.detach()), float(x.grad)


def test_score_mod_matches_the_reference_formulas(cxx_score) -> None:
    rng = random.Random(0)
    queries, args = [], []
    for cfg in range(len(CONFIGS)):
        for _ in range(40):
            nq, nk = rng.randrange(1, 300), rng.randrange(1, 300)
            a = (cfg, rng.randrange(nq), rng.randrange(nk), nq, nk, rng.uniform(-30, 30), rng.uniform(-2, 2),
                 rng.uniform(0.05, 0.5), rng.uniform(0.5, 20), rng.uniform(0, 1), rng.uniform(-3, 3))
            args.append(a)
            queries.append(" ".join(repr(x) for x in a))
    for a, (s64, g64, s32, g32) in zip(args, cxx_score(queries)):
        s, g = _want(*a)
        assert s64 == pytest.approx(s, rel=1e-6, abs=1e-6), a  # slope, scale, softcap are float parameters
        assert g64 == pytest.approx(g, rel=1e-6, abs=1e-6), a
        assert s32 == pytest.approx(s, rel=1e-4, abs=1e-4), a
        assert g32 == pytest.approx(g, rel=1e-4, abs=1e-4), a


def test_softcap_saturates_without_nan(cxx_score) -> None:
    """Large |qk| with a small softcap: tanh saturates to +-1, the gradient to 0 (never NaN)."""
    for approx in (False, True):
        cfg = CONFIGS.index((True, False, False, False, approx))
        got = cxx_score([f"{cfg} 0 0 1 1 {qk} 1.0 1.0 0.5 0 0" for qk in (1e30, -1e30, 1e4)])
        assert [round(r[0], 6) for r in got] == [0.5, -0.5, 0.5]
        assert all(r[1] == 0.0 and r[3] == 0.0 and not math.isnan(r[2]) for r in got)
