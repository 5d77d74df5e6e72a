"""Numpy / exact-arithmetic models of scalar PTX instructions, written from the PTX ISA text
(section 9.7, "Instructions"), independent of the emulator's C++ (fagen/emulator/ptx/ptx_runtime.h):
directed rounding through exact rationals, f16 through numpy's own conversion, bf16 by comparing
the two neighbours, integer instructions on Python integers. Used by tests/test_ptx_semantics.py.
(tests/hopper_model.py holds the models of the Hopper matrix instructions.)"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
CANONICAL_NAN = 0x7FFFFFFF


def f32(bits: int) -> float:
    return float(np.array([bits & M32], np.uint32).view(np.float32)[0])


def bits32(x: float) -> int:
    return int(np.array([x], np.float32).view(np.uint32)[0])


def is_nan_bits(b: int) -> bool:
    return (b & 0x7F800000) == 0x7F800000 and (b & 0x7FFFFF) != 0


def ftz(b: int) -> int:
    """ISA: .ftz flushes sign-preserving subnormal inputs / results to zero."""
    return b & 0x80000000 if (b & 0x7F800000) == 0 else b


def _neighbours(v: Fraction) -> tuple[float, float]:
    """The float32 values just below and just above (or equal to) the exact rational v."""
    x = np.float32(float(v))
    if not np.isfinite(x):
        x = np.float32(np.finfo(np.float32).max) * np.float32(np.sign(float(v)))
    lo, hi = x, x
    while Fraction(float(lo)) > v:
        lo = np.nextafter(lo, np.float32(-np.inf))
    while Fraction(float(hi)) < v:
        hi = np.nextafter(hi, np.float32(np.inf))
    while lo != hi and Fraction(float(np.nextafter(lo, np.float32(np.inf)))) <= v:
        lo = np.nextafter(lo, np.float32(np.inf))
    return float(lo), float(hi)


def round_f32(v: Fraction, mode: str, zero_sign: int = 0) -> int:
    """Bits of the exact value v rounded to float32: rn (nearest even), rz, rm, rp; overflow as
    IEEE 754 directs (rz / rm / rp may stop at the largest finite value)."""
    if v == 0:
        return zero_sign
    big = float(np.finfo(np.float32).max)
    if abs(v) > Fraction(big):  # overflow (IEEE 754: rn to inf past the tie point 2^128 - 2^103)
        if mode == "rn":
            up = abs(v) >= Fraction(2) ** 128 - Fraction(2) ** 103
        else:
            up = (mode == "rp" and v > 0) or (mode == "rm" and v < 0)
        return bits32(math.copysign(math.inf if up else big, float(v)))
    lo, hi = _neighbours(v)
    if lo == hi or mode == "rm":
        r = lo
    elif mode == "rp":
        r = hi
    elif mode == "rz":
        r = lo if v > 0 else hi
    else:
        dl, dh = v - Fraction(lo), Fraction(hi) - v
        if dl != dh:
            r = lo if dl < dh else hi
        else:
            r = lo if bits32(lo) % 2 == 0 else hi
    if r == 0:
        return 0x80000000 if v < 0 else 0
    return bits32(r)


def _special(op: str, a: float, b: float, c: float = 0.0) -> float | None:
    """IEEE results for infinite / NaN operands (and exact zero signs), computed by numpy (round to
    nearest even: every rounding mode gives the same value there)."""
    vals = [a, b, c]
    if any(math.isnan(x) or math.isinf(x) for x in vals):
        with np.errstate(all="ignore"):
            fa, fb, fc = np.float32(a), np.float32(b), np.float32(c)
            r = {"add": fa + fb, "sub": fa - fb, "mul": fa * fb, "fma": np.float32(np.float64(fa) * np.float64(fb) + np.float64(fc))}[op]
        return float(r)
    return None


def arith_f32(op: str, mode: str, a_bits: int, b_bits: int, c_bits: int = 0, *, flush: bool = False) -> int:
    """add / sub / mul / fma .f32 with rounding mode rn / rz / rm / rp (ISA 9.7.3)."""
    if flush:
        a_bits, b_bits, c_bits = ftz(a_bits), ftz(b_bits), ftz(c_bits)
    a, b, c = f32(a_bits), f32(b_bits), f32(c_bits)
    sp = _special(op, a, b, c)
    if sp is not None:
        return CANONICAL_NAN if math.isnan(sp) else bits32(sp)
    A, B, C = Fraction(a), Fraction(b), Fraction(c)
    exact = {"add": A + B, "sub": A - B, "mul": A * B, "fma": A * B + C}[op]
    if exact == 0:  # IEEE: exact zero sums are +0 except in rm (-0); products keep the sign
        if op == "mul":
            zs = 0x80000000 if (math.copysign(1, a) * math.copysign(1, b)) < 0 else 0
        else:
            x, y = (a, b) if op in ("add", "sub") else (a * b if a * b != 0 else math.copysign(0.0, math.copysign(1, a) * math.copysign(1, b)), c)
            if op == "sub":
                y = -y
            same = math.copysign(1, x) == math.copysign(1, y) and x == 0 and y == 0
            zs = (0x80000000 if math.copysign(1, x) < 0 else 0) if same else (0x80000000 if mode == "rm" else 0)
        r = zs
    else:
        r = round_f32(exact, mode)
    return ftz(r) if flush else r


def max_f32(a_bits: int, b_bits: int, *, nan: bool = False, flush: bool = False, is_max: bool = True) -> int:
    """max / min .f32 (ISA 9.7.3.10-11): NaN operands are ignored unless both are NaN (then the
    canonical NaN); with .NaN any NaN operand gives the canonical NaN; -0.0 < +0.0."""
    if flush:
        a_bits, b_bits = ftz(a_bits), ftz(b_bits)
    na, nb = is_nan_bits(a_bits), is_nan_bits(b_bits)
    if na or nb:
        if nan or (na and nb):
            return CANONICAL_NAN
        return b_bits if na else a_bits
    a, b = f32(a_bits), f32(b_bits)
    if a == b:  # equal values: zeros of different signs are ordered -0 < +0
        neg_a = a_bits >> 31
        if is_max:
            return b_bits if neg_a else a_bits
        return a_bits if neg_a else b_bits
    return a_bits if (a > b) == is_max else b_bits


def copysign(a_bits: int, b_bits: int) -> int:
    """copysign.f32 d, a, b (ISA 9.7.3.x): "copies the sign bit of a into the value of b"."""
    return (b_bits & 0x7FFFFFFF) | (a_bits & 0x80000000)


def f32_to_f16(a_bits: int) -> int:
    """cvt.rn.f16.f32: IEEE round to nearest even (numpy's conversion); NaN -> canonical 0x7fff."""
    if is_nan_bits(a_bits):
        return 0x7FFF
    with np.errstate(over="ignore"):
        return int(np.array([f32(a_bits)], np.float32).astype(np.float16).view(np.uint16)[0])


def f32_to_bf16(a_bits: int) -> int:
    """cvt.rn.bf16.f32: nearest of the two bf16 neighbours, ties to the even one; NaN -> 0x7fff."""
    if is_nan_bits(a_bits):
        return 0x7FFF
    t = a_bits >> 16
    lo = t << 16
    if lo == a_bits:
        return t
    hi_t = t + 1
    x = Fraction(f32(a_bits)) if (a_bits & 0x7F800000) != 0x7F800000 else None
    vlo = f32(lo)
    vhi = f32((hi_t & 0xFFFF) << 16)
    if x is None:
        return t
    if math.isinf(vhi):  # rounding up overflows: compare against the value 2^128 would have
        dh = Fraction(2) ** 128 - abs(x)
    else:
        dh = abs(Fraction(vhi) - x)
    dl = abs(x - Fraction(vlo))
    if dl < dh or (dl == dh and t % 2 == 0):
        return t
    return hi_t & 0xFFFF


def ex2_within(a_bits: int, got_bits: int, ulps: int = 2) -> bool:
    """ex2.approx.ftz.f32 (ISA 9.7.3.21): 2^a within 2 ulp (max relative error 2^-22.5 or so); ftz:
    subnormal inputs count as 0 (result 1), subnormal results are flushed."""
    a = f32(ftz(a_bits))
    if math.isnan(a):
        return is_nan_bits(got_bits)
    want = 2.0 ** a if a < 128 else math.inf  # 2^128 and above overflow float32
    if want < 2.0 ** -126:
        return got_bits in (0, 0x80000000) or (want >= 2.0 ** -127 and f32(got_bits) == 2.0 ** -126)
    if math.isinf(want):
        return f32(got_bits) == math.inf
    got = f32(got_bits)
    ulp = 2.0 ** (math.floor(math.log2(want)) - 23)
    return abs(got - want) <= ulps * ulp


def tanh_within(a_bits: int, got_bits: int) -> bool:
    """tanh.approx.f32 (ISA, "Floating Point Instructions: tanh"): maximum relative error 2^-10.987
    over the whole range, subnormals supported; tanh(+-0) = +-0, tanh(+-inf) = +-1, NaN in -> NaN."""
    a = f32(a_bits)
    if math.isnan(a):
        return is_nan_bits(got_bits)
    got = f32(got_bits)
    if a == 0.0:
        return got_bits == a_bits  # the sign of zero is kept
    want = math.tanh(a)
    return math.copysign(1.0, got) == math.copysign(1.0, want) and abs(got - want) <= 2.0 ** -10.987 * abs(want)


def setp_f32(cmp: str, a_bits: int, b_bits: int) -> bool:
    """setp .f32 (ISA 9.7.3.x, "Floating Point Comparison Operators"): the ordered comparisons
    (eq ne lt le gt ge) are false when either operand is NaN; equ neu ltu leu gtu geu are true;
    num: neither is NaN; nan: either is."""
    a, b = f32(a_bits), f32(b_bits)
    unordered = math.isnan(a) or math.isnan(b)
    base = cmp.rstrip("u") if cmp not in ("num", "nan") else cmp
    if cmp == "num":
        return not unordered
    if cmp == "nan":
        return unordered
    rel = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[base]
    if cmp.endswith("u"):
        return unordered or rel
    return (not unordered) and rel


def s32(x: int) -> int:
    x &= M32
    return x - (1 << 32) if x >> 31 else x


def div_f32(a_bits: int, b_bits: int) -> int:
    """div.rn.f32: the exact quotient rounded to nearest even; IEEE special cases (x / 0 = +-inf,
    0 / 0 and inf / inf NaN) through numpy."""
    a, b = f32(a_bits), f32(b_bits)
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b) or b == 0:
        with np.errstate(all="ignore"):
            r = float(np.float32(a) / np.float32(b))
        return CANONICAL_NAN if math.isnan(r) else bits32(r)
    if a == 0:
        return (a_bits ^ b_bits) & 0x80000000
    return round_f32(Fraction(a) / Fraction(b), "rn")


def s64(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def shl64(a: int, n: int) -> int:
    return 0 if n >= 64 else (a << n) & M64


def shr64(a: int, n: int, signed: bool) -> int:
    if signed:
        return (s64(a) >> min(n, 63)) & M64
    return 0 if n >= 64 else a >> n


def bfi64(a: int, b: int, pos: int, ln: int) -> int:
    """bfi.b64 (ISA pseudo-code with msb 63)."""
    f = b
    for i in range(ln):
        if pos + i > 63:
            break
        f = (f & ~(1 << (pos + i))) | (((a >> i) & 1) << (pos + i))
    return f & M64


def shl(a: int, n: int) -> int:
    return 0 if n >= 32 else (a << n) & M32


def shr(a: int, n: int, signed: bool) -> int:
    if signed:
        return (s32(a) >> min(n, 31)) & M32
    return 0 if n >= 32 else a >> n


def bfe(a: int, pos: int, ln: int, signed: bool) -> int:
    """ISA bfe pseudo-code: msb = 31 for .u32 / .s32; pos, len from their low 8 bits; the sign bit
    is bit (pos + len - 1) clamped to msb for signed, else 0."""
    msb = 31
    pos &= 0xFF
    ln &= 0xFF
    sbit = 0
    if signed and ln != 0:
        sbit = (a >> min(pos + ln - 1, msb)) & 1
    d = 0
    for i in range(msb + 1):
        d |= (((a >> (pos + i)) & 1) if (i < ln and pos + i <= msb) else sbit) << i
    return d


def bfi(a: int, b: int, pos: int, ln: int) -> int:
    """ISA bfi pseudo-code: f = b; bits [pos, pos + len) of f become the low bits of a."""
    pos &= 0xFF
    ln &= 0xFF
    f = b
    for i in range(ln):
        if pos + i > 31:
            break
        bit = (a >> i) & 1
        f = (f & ~(1 << (pos + i))) | (bit << (pos + i))
    return f & M32


def prmt(a: int, b: int, c: int) -> int:
    """prmt.b32 default mode: bytes b7..b0 = {b, a}; result byte i = byte c[4i+2:4i], its sign
    replicated when c[4i+3] is set."""
    tmp = (b << 32) | a
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (tmp >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """The bit of lut at index (a_i << 2 | b_i << 1 | c_i) for each bit position i (ISA: ta = 0xF0,
    tb = 0xCC, tc = 0xAA)."""
    out = 0
    for i in range(32):
        idx = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def shf(a: int, b: int, n: int, left: bool, clamp: bool) -> int:
    """shf.{l,r}.{wrap,clamp}.b32: shift the 64-bit {b, a} and keep the upper (l) / lower (r) half."""
    n = min(n, 32) if clamp else n & 31
    v = (b << 32) | a
    return ((v << n) >> 32) & M32 if left else (v >> n) & M32


def shfl(mode: str, a: list[int], b: list[int], c: list[int]) -> tuple[list[int], list[bool]]:
    """shfl.sync over one full warp, from the ISA's pseudo-code."""
    d, p = [], []
    for lane in range(32):
        bval, cval, seg = b[lane] & 31, c[lane] & 31, (c[lane] >> 8) & 31
        max_lane = (lane & seg) | (cval & ~seg & 31)
        min_lane = lane & seg
        if mode == "up":
            j = lane - bval
            ok = j >= max_lane
        elif mode == "down":
            j = lane + bval
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ bval
            ok = j <= max_lane
        else:
            j = min_lane | (bval & ~seg & 31)
            ok = j <= max_lane
        if not ok:
            j = lane
        d.append(a[j])
        p.append(ok)
    return d, p
