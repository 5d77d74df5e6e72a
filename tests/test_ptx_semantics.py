"""Each scalar PTX instruction form the translator implements, run at the PTX level on hand-written
PTX, against the independent models of tests/ptx_model.py (written from the PTX ISA text): one
module of entries (one g++ build), 256 threads per entry, inputs that mix ordinary values with
zeros of both signs, subnormals, infinities, NaNs, ties and overflow."""
from __future__ import annotations

import math

import numpy as np
import ptx_model as M
import pytest

from fagen.emulator import KernelSig
from fagen.emulator.ptx import build_ptx

N = 256

_HEAD = """
.visible .entry {name}(.param .u64 pa, .param .u64 pb, .param .u64 pc, .param .u64 po)
{{
    .reg .b32 %r<16>;
    .reg .f32 %f<8>;
    .reg .pred %p<4>;
    .reg .b64 %rd<12>;
    .reg .b16 %h<4>;
    mov.u32 %r1, %tid.x;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mad.lo.s32 %r1, %r2, %r3, %r1;
    mul.wide.u32 %rd1, %r1, 4;
    ld.param.u64 %rd2, [pa];
    add.s64 %rd2, %rd2, %rd1;
    ld.global.b32 %r4, [%rd2];
    ld.param.u64 %rd3, [pb];
    add.s64 %rd3, %rd3, %rd1;
    ld.global.b32 %r5, [%rd3];
    ld.param.u64 %rd4, [pc];
    add.s64 %rd4, %rd4, %rd1;
    ld.global.b32 %r6, [%rd4];
    mov.b32 %f1, %r4;
    mov.b32 %f2, %r5;
    mov.b32 %f3, %r6;
{body}
    ld.param.u64 %rd5, [po];
    add.s64 %rd5, %rd5, %rd1;
    st.global.b32 [%rd5], %r7;
    ret;
}}
"""

F_BIN = {  # entry -> (instruction, model)
    "add_rn": ("add.f32", lambda a, b, c: M.arith_f32("add", "rn", a, b)),
    "add_rz": ("add.rz.f32", lambda a, b, c: M.arith_f32("add", "rz", a, b)),
    "add_rm": ("add.rm.f32", lambda a, b, c: M.arith_f32("add", "rm", a, b)),
    "add_rp_ftz": ("add.rp.ftz.f32", lambda a, b, c: M.arith_f32("add", "rp", a, b, flush=True)),
    "sub_rn": ("sub.f32", lambda a, b, c: M.arith_f32("sub", "rn", a, b)),
    "mul_rn": ("mul.rn.f32", lambda a, b, c: M.arith_f32("mul", "rn", a, b)),
    "mul_rz": ("mul.rz.f32", lambda a, b, c: M.arith_f32("mul", "rz", a, b)),
    "copysign": ("copysign.f32", lambda a, b, c: M.copysign(a, b)),
    "div_rn": ("div.rn.f32", lambda a, b, c: M.div_f32(a, b)),
    "max": ("max.f32", lambda a, b, c: M.max_f32(a, b)),
    "min": ("min.f32", lambda a, b, c: M.max_f32(a, b, is_max=False)),
    "max_nan": ("max.NaN.f32", lambda a, b, c: M.max_f32(a, b, nan=True)),
    "min_ftz": ("min.ftz.f32", lambda a, b, c: M.max_f32(a, b, flush=True, is_max=False)),
}
F_FMA = {
    "fma_rn": ("fma.rn.f32", "rn"), "fma_rm": ("fma.rm.f32", "rm"), "fma_rz": ("fma.rz.f32", "rz"),
    "fma_rp": ("fma.rp.f32", "rp"),
}
SETP = ["eq", "ne", "lt", "ge", "equ", "neu", "ltu", "gtu", "num", "nan"]
INT = {  # entry -> (body, model on unsigned 32-bit a, b, c)
    "shl": ("shl.b32 %r7, %r4, %r5;", lambda a, b, c: M.shl(a, b)),
    "shr_u": ("shr.u32 %r7, %r4, %r5;", lambda a, b, c: M.shr(a, b, False)),
    "shr_s": ("shr.s32 %r7, %r4, %r5;", lambda a, b, c: M.shr(a, b, True)),
    "bfe_u": ("bfe.u32 %r7, %r4, %r5, %r6;", lambda a, b, c: M.bfe(a, b, c, False)),
    "bfe_s": ("bfe.s32 %r7, %r4, %r5, %r6;", lambda a, b, c: M.bfe(a, b, c, True)),
    "bfi": ("shr.u32 %r8, %r6, 8;\n    bfi.b32 %r7, %r4, %r5, %r6, %r8;",
            lambda a, b, c: M.bfi(a, b, c, c >> 8)),
    "prmt": ("prmt.b32 %r7, %r4, %r5, %r6;", lambda a, b, c: M.prmt(a, b, c)),
    "lop3_96": ("lop3.b32 %r7, %r4, %r5, %r6, 150;", lambda a, b, c: M.lop3(a, b, c, 0x96)),
    "lop3_e8": ("lop3.b32 %r7, %r4, %r5, %r6, 232;", lambda a, b, c: M.lop3(a, b, c, 0xE8)),
    "shf_l_wrap": ("shf.l.wrap.b32 %r7, %r4, %r5, %r6;", lambda a, b, c: M.shf(a, b, c, True, False)),
    "shf_r_clamp": ("shf.r.clamp.b32 %r7, %r4, %r5, %r6;", lambda a, b, c: M.shf(a, b, c, False, True)),
    "mul_hi_s": ("mul.hi.s32 %r7, %r4, %r5;", lambda a, b, c: ((M.s32(a) * M.s32(b)) >> 32) & M.M32),
    "mul_hi_u": ("mul.hi.u32 %r7, %r4, %r5;", lambda a, b, c: (a * b) >> 32),
    "mad_lo": ("mad.lo.s32 %r7, %r4, %r5, %r6;", lambda a, b, c: (a * b + c) & M.M32),
    "min_s": ("min.s32 %r7, %r4, %r5;", lambda a, b, c: min(M.s32(a), M.s32(b)) & M.M32),
    "max_u": ("max.u32 %r7, %r4, %r5;", lambda a, b, c: max(a, b)),
    "setp_lo": ("setp.lo.u32 %p1, %r4, %r5;\n    selp.u32 %r7, 1, 0, %p1;", lambda a, b, c: int(a < b)),
    "setp_lt_s": ("setp.lt.s32 %p1, %r4, %r5;\n    selp.u32 %r7, 1, 0, %p1;", lambda a, b, c: int(M.s32(a) < M.s32(b))),
    "popc": ("popc.b32 %r7, %r4;", lambda a, b, c: bin(a).count("1")),
    "clz": ("clz.b32 %r7, %r4;", lambda a, b, c: 32 - a.bit_length()),
    "brev": ("brev.b32 %r7, %r4;", lambda a, b, c: int(f"{a:032b}"[::-1], 2)),
    "neg_s": ("neg.s32 %r7, %r4;", lambda a, b, c: (-a) & M.M32),
    "abs_s": ("abs.s32 %r7, %r4;", lambda a, b, c: abs(M.s32(a)) & M.M32),
    "not": ("not.b32 %r7, %r4;", lambda a, b, c: ~a & M.M32),
    "xor_and_or": ("xor.b32 %r8, %r4, %r5;\n    and.b32 %r9, %r8, %r6;\n    or.b32 %r7, %r9, %r5;",
                   lambda a, b, c: ((a ^ b) & c) | b),
    "div_s": ("div.s32 %r7, %r4, %r5;", None),
    "cvt_s64_s32": ("cvt.s64.s32 %rd6, %r4;\n    shr.u64 %rd7, %rd6, 32;\n    cvt.u32.u64 %r7, %rd7;",
                    lambda a, b, c: M.M32 if a >> 31 else 0),
    "mul_wide_s32": ("mul.wide.s32 %rd6, %r4, %r5;\n    shr.s64 %rd7, %rd6, 32;\n    cvt.u32.u64 %r7, %rd7;",
                     lambda a, b, c: ((M.s32(a) * M.s32(b)) >> 32) & M.M32),
}
INT64 = {  # entry -> (body on %rd6 = {b:a}, %rd7 = {a:c}, result in %rd8; model on Python ints)
    "shl_b64": ("and.b32 %r9, %r6, 127;\n    shl.b64 %rd8, %rd6, %r9;", lambda x, y, c: M.shl64(x, c & 127)),
    "shr_s64": ("and.b32 %r9, %r6, 127;\n    shr.s64 %rd8, %rd6, %r9;", lambda x, y, c: M.shr64(x, c & 127, True)),
    "mul_lo_s64": ("mul.lo.s64 %rd8, %rd6, %rd7;", lambda x, y, c: (x * y) & M.M64),
    "min_s64": ("min.s64 %rd8, %rd6, %rd7;", lambda x, y, c: min(M.s64(x), M.s64(y)) & M.M64),
    "max_u64": ("max.u64 %rd8, %rd6, %rd7;", lambda x, y, c: max(x, y)),
    "mad_wide_u32": ("mad.wide.u32 %rd8, %r4, %r5, %rd7;", lambda x, y, c: ((x & M.M32) * (x >> 32) + y) & M.M64),
    "mul_wide_u16": ("cvt.u16.u32 %h1, %r4;\n    cvt.u16.u32 %h2, %r5;\n    mul.wide.u16 %r10, %h1, %h2;\n"
                     "    cvt.u64.u32 %rd8, %r10;", lambda x, y, c: ((x & 0xFFFF) * ((x >> 32) & 0xFFFF))),
    "bfi_b64": ("and.b32 %r9, %r6, 255;\n    shr.u32 %r10, %r6, 8;\n    and.b32 %r10, %r10, 255;\n"
                "    bfi.b64 %rd8, %rd6, %rd7, %r9, %r10;", lambda x, y, c: M.bfi64(x, y, c & 255, (c >> 8) & 255)),
    "neg_s64": ("neg.s64 %rd8, %rd6;", lambda x, y, c: (-x) & M.M64),
    "setp_ge_s64": ("setp.ge.s64 %p1, %rd6, %rd7;\n    selp.u64 %rd8, 1, 0, %p1;", lambda x, y, c: int(M.s64(x) >= M.s64(y))),
}
UNARY_F = {  # entry -> (body from %f1 / %r4 into %r7, model of a's bits)
    "cvt_f16": ("cvt.rn.f16.f32 %h1, %f1;\n    cvt.u32.u16 %r7, %h1;", M.f32_to_f16),
    "cvt_bf16": ("cvt.rn.bf16.f32 %h1, %f1;\n    cvt.u32.u16 %r7, %h1;", M.f32_to_bf16),
    "cvt_f32_f16": ("cvt.u16.u32 %h1, %r4;\n    cvt.f32.f16 %f4, %h1;\n    mov.b32 %r7, %f4;",
                    lambda a: M.bits32(float(np.array([a & 0xFFFF], np.uint16).view(np.float16)[0]))),
    "cvt_sat": ("cvt.sat.f32.f32 %f4, %f1;\n    mov.b32 %r7, %f4;",
                lambda a: 0 if M.is_nan_bits(a) else M.bits32(min(max(M.f32(a), 0.0), 1.0)) if M.f32(a) != 0 else a),
    "cvt_rni": ("cvt.rni.f32.f32 %f4, %f1;\n    mov.b32 %r7, %f4;",
                lambda a: M.CANONICAL_NAN if M.is_nan_bits(a) else M.bits32(float(np.rint(np.float32(M.f32(a)))))),
    "cvt_rzi_s32": ("cvt.rzi.s32.f32 %r7, %f1;",
                    lambda a: 0 if M.is_nan_bits(a) else max(min(int(M.f32(a)) if abs(M.f32(a)) < 2**40 else
                                                                  (2**31 if M.f32(a) > 0 else -2**31), 2**31 - 1),
                                                              -2**31) & M.M32),
    "cvt_rmi_s32": ("cvt.rmi.s32.f32 %r7, %f1;",
                    lambda a: 0 if M.is_nan_bits(a) else max(min(np.floor(M.f32(a)), 2**31 - 1), -2**31).__int__() & M.M32),
    "cvt_f32_s32": ("cvt.rn.f32.s32 %f4, %r4;\n    mov.b32 %r7, %f4;",
                    lambda a: M.round_f32(M.Fraction(M.s32(a)), "rn")),
    "neg_f": ("neg.f32 %f4, %f1;\n    mov.b32 %r7, %f4;", lambda a: a ^ 0x80000000),
    "abs_f": ("abs.f32 %f4, %f1;\n    mov.b32 %r7, %f4;", lambda a: a & 0x7FFFFFFF),
    "rcp_rn": ("rcp.rn.f32 %f4, %f1;\n    mov.b32 %r7, %f4;",
               lambda a: M.CANONICAL_NAN if M.is_nan_bits(a) else (
                   M.round_f32(1 / M.Fraction(M.f32(a)), "rn") if M.f32(a) not in (0.0, math.inf, -math.inf) else
                   (0x7F800000 | (a & 0x80000000)) if M.f32(a) == 0 else (a & 0x80000000))),
}


def _entries() -> dict[str, str]:
    out = {}
    for name, (op, _) in F_BIN.items():
        out[name] = f"    {op} %f4, %f1, %f2;\n    mov.b32 %r7, %f4;"
    for name, (op, _) in F_FMA.items():
        out[name] = f"    {op} %f4, %f1, %f2, %f3;\n    mov.b32 %r7, %f4;"
    for cmp in SETP:
        out[f"setp_{cmp}"] = f"    setp.{cmp}.f32 %p1, %f1, %f2;\n    selp.u32 %r7, 1, 0, %p1;"
    for name, (body, _) in {**INT, **UNARY_F}.items():
        out[name] = "    " + body
    for name, (body, _) in INT64.items():
        pre = "    mov.b64 %rd6, {%r4, %r5};\n    mov.b64 %rd7, {%r6, %r4};\n    " + body
        out[name + "_lo"] = pre + "\n    cvt.u32.u64 %r7, %rd8;"
        out[name + "_hi"] = pre + "\n    shr.u64 %rd9, %rd8, 32;\n    cvt.u32.u64 %r7, %rd9;"
    out["ex2"] = "    ex2.approx.ftz.f32 %f4, %f1;\n    mov.b32 %r7, %f4;"
    out["tanh"] = "    tanh.approx.f32 %f4, %f1;\n    mov.b32 %r7, %f4;"
    for mode in ("up", "down", "bfly", "idx"):
        out[f"shfl_{mode}"] = f"    shfl.sync.{mode}.b32 %r7|%p1, %r4, %r5, %r6, -1;"
        out[f"shflp_{mode}"] = f"    shfl.sync.{mode}.b32 %r8|%p1, %r4, %r5, %r6, -1;\n    selp.u32 %r7, 1, 0, %p1;"
    return out


@pytest.fixture(scope="module")
def mod():
    entries = _entries()
    ptx = ".version 8.0\n.target sm_90\n.address_size 64\n" + "".join(
        _HEAD.format(name=n, body=b) for n, b in entries.items())
    sig = (("const unsigned*", "a"), ("const unsigned*", "b"), ("const unsigned*", "c"), ("unsigned*", "o"))
    return build_ptx(ptx, [KernelSig(n, sig) for n in entries])


def _run(mod, name: str, a, b, c) -> np.ndarray:
    out = np.zeros(N, np.uint32)
    mod.launch(name, 1, N, 0, [np.asarray(a, np.uint32), np.asarray(b, np.uint32), np.asarray(c, np.uint32), out])
    return out


_SPECIAL = [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F800000, 0xFF800000, 0x7FC00000,
            0xFFC00001, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000, 0x3F000000, 0x4B800000, 0x33800000]


def _floats(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(N).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, N).astype(np.float32)
    bits = x.view(np.uint32).copy()
    bits[: len(_SPECIAL)] = _SPECIAL
    bits[len(_SPECIAL): 2 * len(_SPECIAL)] = rng.permutation(_SPECIAL)
    return bits


@pytest.mark.parametrize("name", list(F_BIN) + list(F_FMA))
def test_float_arithmetic(mod, name: str) -> None:
    a, b, c = _floats(1), _floats(2), _floats(3)
    b[40:60] = a[40:60] ^ 0x80000000  # exact cancellations: the sign of zero per rounding mode
    c[60:80] = (-(a[60:80].view(np.float32).astype(np.float64) * b[60:80].view(np.float32))).astype(np.float32).view(np.uint32)
    got = _run(mod, name, a, b, c)
    for i in range(N):
        if name in F_BIN:
            want = F_BIN[name][1](int(a[i]), int(b[i]), int(c[i]))
        else:
            want = M.arith_f32("fma", F_FMA[name][1], int(a[i]), int(b[i]), int(c[i]))
        g = int(got[i])
        if M.is_nan_bits(want):
            assert M.is_nan_bits(g), f"{name}({a[i]:#x}, {b[i]:#x}, {c[i]:#x}): {g:#x}, want NaN"
            if name.startswith(("max", "min", "copysign")):
                assert g == want, f"{name}: canonical NaN expected, got {g:#x}"
        else:
            assert g == want, f"{name}({a[i]:#x}, {b[i]:#x}, {c[i]:#x}) = {g:#x}, model {want:#x}"


@pytest.mark.parametrize("cmp", SETP)
def test_setp_float_comparisons(mod, cmp: str) -> None:
    a, b = _floats(4), _floats(5)
    b[100:140] = a[100:140]
    got = _run(mod, f"setp_{cmp}", a, b, b)
    want = [int(M.setp_f32(cmp, int(x), int(y))) for x, y in zip(a, b)]
    assert got.tolist() == want


def _ints(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    x[:32] = [0, 1, 2, 31, 32, 33, 63, 64, 255, 256, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE, 8, 24,
              0x1F08, 0x0808, 0x2010, 0x3210, 0x7654, 0xBA98, 0x4321, 0x0000FFFF, 7, 9, 16, 40, 0x100, 0x1F1F, 0xFF, 3]
    return x


@pytest.mark.parametrize("name", [n for n in INT if INT[n][1] is not None])
def test_integer_and_bit_instructions(mod, name: str) -> None:
    a, b, c = _ints(6), _ints(7), _ints(8)
    if name.startswith(("shl", "shr", "shf")):
        b = b % 40 if not name.startswith("shf") else b
        c = c % 40 if name.startswith("shf") else c
    if name.startswith("bfe"):
        b, c = b % 40, c % 40
    if name == "bfi":
        c = (c % 40) | ((_ints(9) % 40) << 8)
    got = _run(mod, name, a, b, c)
    want = [INT[name][1](int(x), int(y), int(z)) & M.M32 for x, y, z in zip(a, b, c)]
    bad = [(hex(a[i]), hex(b[i]), hex(c[i]), hex(got[i]), hex(want[i])) for i in range(N) if got[i] != want[i]]
    assert not bad, f"{name}: {bad[:5]}"


def test_integer_division_by_zero_is_defined(mod) -> None:
    a, b = _ints(10), _ints(11)
    b[:8] = 0
    got = _run(mod, "div_s", a, b, b)
    for i in range(N):
        if b[i] == 0:
            assert got[i] == M.M32
        elif not (M.s32(int(a[i])) == -2**31 and M.s32(int(b[i])) == -1):
            q = abs(M.s32(int(a[i]))) // abs(M.s32(int(b[i])))
            q = q if (M.s32(int(a[i])) < 0) == (M.s32(int(b[i])) < 0) else -q
            assert got[i] == q & M.M32


@pytest.mark.parametrize("name", list(UNARY_F))
def test_conversions_and_unary(mod, name: str) -> None:
    a = _ints(12) if name in ("cvt_f32_s32", "cvt_f32_f16") else _floats(13)
    if name in ("cvt_f16", "cvt_bf16"):  # ties and the overflow edge of f16
        a[20:30] = [0x3F801000, 0x3F803000, 0x477FF000, 0x477FEFFF, 0x47800000, 0x33000000, 0x33000001,
                    0x387FC000, 0x38800000, 0x3F808000]
    if name.startswith("cvt_r"):
        a[20:26] = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 3e9], np.float32).view(np.uint32)
    got = _run(mod, name, a, a, a)
    model = UNARY_F[name][1]
    for i in range(N):
        want = model(int(a[i])) & M.M32
        if M.is_nan_bits(want) and name not in ("cvt_f16", "cvt_bf16"):
            assert M.is_nan_bits(int(got[i])), f"{name}({a[i]:#x})"
            continue
        assert got[i] == want, f"{name}({a[i]:#x}) = {got[i]:#x}, model {want:#x}"


def test_ex2_approx_ftz_within_two_ulp(mod) -> None:
    rng = np.random.default_rng(14)
    a = (rng.uniform(-140, 130, N).astype(np.float32)).view(np.uint32)
    a[:6] = [0x00000001, 0x80000001, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000000]
    got = _run(mod, "ex2", a, a, a)
    for x, g in zip(a, got):
        assert M.ex2_within(int(x), int(g)), f"ex2({x:#x}) = {g:#x}"


def test_tanh_approx_within_its_documented_error(mod) -> None:
    """Softcap's tanh (partials/primitives.cuh's fa_tanh_approx) at the PTX level: within 2^-10.987 relative,
    zeros keep their sign, +-inf -> +-1, NaN stays NaN, subnormals are not flushed."""
    rng = np.random.default_rng(16)
    a = np.concatenate([rng.uniform(-12, 12, N // 2), rng.standard_normal(N - N // 2) * 1e-3]).astype(np.float32)
    a = a.view(np.uint32)
    a[:8] = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x80400000, 0x41A00000]
    got = _run(mod, "tanh", a, a, a)
    for x, g in zip(a, got):
        assert M.tanh_within(int(x), int(g)), f"tanh({x:#x}) = {g:#x}"
    assert got[2] == 0x3F800000 and got[3] == 0xBF800000 and got[5] == 0x00000001


@pytest.mark.parametrize("mode", ["up", "down", "bfly", "idx"])
def test_shfl_sync_against_the_isa_pseudo_code(mod, mode: str) -> None:
    rng = np.random.default_rng(15)
    a = rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    # b and c uniform per warp (the forms NVVM emits), with several widths and clamps per warp
    b = np.repeat(rng.integers(0, 32, N // 32), 32).astype(np.uint32)
    widths = [32, 16, 8, 4, 2, 1, 32, 8]
    c = np.repeat([((32 - w) << 8) | (0 if mode == "up" else 31) for w in widths], 32).astype(np.uint32)
    d = _run(mod, f"shfl_{mode}", a, b, c)
    p = _run(mod, f"shflp_{mode}", a, b, c)
    for w in range(N // 32):
        s = slice(32 * w, 32 * w + 32)
        wd, wp = M.shfl(mode, a[s].tolist(), b[s].tolist(), c[s].tolist())
        assert d[s].tolist() == wd and p[s].tolist() == [int(x) for x in wp], f"warp {w}"


_MEM = """
.visible .entry mem(.param .u64 pa, .param .u64 po, .param .u64 pacc, .param .u64 pold)
{
    .reg .b32 %r<8>;
    .reg .f32 %f<12>;
    .reg .b64 %rd<12>;
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd1, %r1, 16;
    ld.param.u64 %rd2, [pa];
    add.s64 %rd3, %rd2, %rd1;
    ld.global.nc.v4.f32 {%f1, %f2, %f3, %f4}, [%rd3];
    ld.global.v2.f32 {%f5, %f6}, [%rd3+8];
    add.f32 %f7, %f1, %f5;
    ld.param.u64 %rd4, [po];
    add.s64 %rd5, %rd4, %rd1;
    st.global.v4.f32 [%rd5], {%f7, %f6, %f2, %f4};
    ld.param.u64 %rd6, [pacc];
    red.relaxed.gpu.global.add.v2.f32 [%rd6], {%f1, %f2};
    atom.global.add.f32 %f8, [%rd6+8], %f3;
    ld.param.u64 %rd7, [pold];
    mul.wide.u32 %rd8, %r1, 4;
    add.s64 %rd9, %rd7, %rd8;
    st.global.f32 [%rd9], %f8;
    ret;
}
"""


def test_vector_loads_stores_and_atomics() -> None:
    """ld / st .v2 / .v4 (lanes in register order), red.add.v2.f32 and atom.add.f32 (returns the old
    value; threads run one at a time, in index order, so the old values are the prefix sums)."""
    ptx = ".version 8.0\n.target sm_90\n.address_size 64\n" + _MEM
    sig = (("const float*", "a"), ("float*", "o"), ("float*", "acc"), ("float*", "old"))
    mod = build_ptx(ptx, [KernelSig("mem", sig)])
    a = (np.arange(4 * 64, dtype=np.float32) % 7).reshape(64, 4)
    o = np.zeros((64, 4), np.float32)
    acc = np.zeros(4, np.float32)
    old = np.zeros(64, np.float32)
    mod.launch("mem", 1, 64, 0, [a, o, acc, old])
    np.testing.assert_array_equal(o, np.stack([a[:, 0] + a[:, 2], a[:, 3], a[:, 1], a[:, 3]], 1))
    np.testing.assert_array_equal(acc[:3], [a[:, 0].sum(), a[:, 1].sum(), a[:, 2].sum()])
    np.testing.assert_array_equal(old, np.concatenate([[0], np.cumsum(a[:-1, 2])]))
    from fagen.emulator import EmulatorKernelError

    with pytest.raises(EmulatorKernelError, match=r"red\.add\.v2\.f32 at .*\.ptx:\d+: address .* is not 8-byte aligned"):
        mod.launch("mem", 1, 64, 0, [a, o, acc[1:], old])


@pytest.mark.parametrize("name", list(INT64))
def test_64_bit_integer_instructions(mod, name: str) -> None:
    a, b, c = _ints(16), _ints(17), _ints(18)
    if name == "bfi_b64":
        c = (c % 80) | ((_ints(19) % 80) << 8)
    lo, hi = _run(mod, name + "_lo", a, b, c), _run(mod, name + "_hi", a, b, c)
    for i in range(N):
        x = int(a[i]) | int(b[i]) << 32          # {%r4, %r5}: low word first
        y = int(c[i]) | int(a[i]) << 32          # {%r6, %r4}
        if name == "mad_wide_u32":
            want = (int(a[i]) * int(b[i]) + y) & M.M64
        elif name == "mul_wide_u16":
            want = (int(a[i]) & 0xFFFF) * (int(b[i]) & 0xFFFF)
        else:
            want = INT64[name][1](x, y, int(c[i])) & M.M64
        got = int(lo[i]) | int(hi[i]) << 32
        assert got == want, f"{name}({x:#x}, {y:#x}, {int(c[i]):#x}) = {got:#x}, model {want:#x}"
