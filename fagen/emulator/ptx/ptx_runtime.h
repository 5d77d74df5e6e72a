// ---------------------------------------------------------------------------
// fagen CPU emulator, PTX level: the semantic helpers of translated PTX
// (fagen/emulator/ptx/translate.py). Pasted after runtime.h, racecheck.h,
// shim.h and hopper.h: the warp collectives, barriers, mma / ldmatrix /
// cp.async / wgmma / mbarrier / TMA emulation are theirs; this file adds the
// scalar instruction semantics of the PTX ISA (rounding, flushing, NaN rules,
// shift clamping, bit-field instructions), shfl.sync with its exact c-operand
// rules, and the per-thread in-flight register bookkeeping of wgmma (the
// register hazards only the PTX level can see).
// ---------------------------------------------------------------------------
#include <cfenv>
#include <climits>
#include <type_traits>

namespace fagen_emu {
namespace px {

// The PTX file of the module (set by the translated code's static initialiser), for messages.
inline const char* fagen_ptx_file_name = "?.ptx";

// ------------------------------------------------------------ bit moves
// A register of type S read (or written) as type D: the same bits when the sizes match, the
// low bits when D is narrower, extended (sign-extended for a signed S) when D is wider.
template <class D, class S>
inline D bc(S s) {
    if constexpr (std::is_same<D, S>::value) {
        return s;
    } else if constexpr (std::is_same<D, bool>::value) {
        return s != S(0);
    } else if constexpr (std::is_same<S, bool>::value) {
        return D(s ? 1 : 0);
    } else if constexpr (sizeof(D) == sizeof(S)) {
        D d;
        memcpy(&d, &s, sizeof d);
        return d;
    } else if constexpr (std::is_floating_point<S>::value || std::is_floating_point<D>::value) {
        // Through the integer of S's size, then resized (mov between widths never happens for floats
        // in NVVM's output; cvt handles real conversions).
        typedef typename std::conditional<sizeof(S) == 8, uint64_t,
                typename std::conditional<sizeof(S) == 4, uint32_t, uint16_t>::type>::type SI;
        typedef typename std::conditional<sizeof(D) == 8, uint64_t,
                typename std::conditional<sizeof(D) == 4, uint32_t, uint16_t>::type>::type DI;
        SI si;
        memcpy(&si, &s, sizeof si);
        DI di = DI(si);
        D d;
        memcpy(&d, &di, sizeof d);
        return d;
    } else {
        return D(s);  // integer resize: truncation, or extension by S's signedness
    }
}

inline float f32(uint32_t bits) { float f; memcpy(&f, &bits, 4); return f; }
inline double f64(uint64_t bits) { double f; memcpy(&f, &bits, 8); return f; }
inline uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline uint64_t bits(double f) { uint64_t u; memcpy(&u, &f, 8); return u; }

// .ftz: a subnormal input or result becomes a zero of the same sign.
inline float ftz(float x) { return (bits(x) & 0x7f800000u) == 0 ? f32(bits(x) & 0x80000000u) : x; }
inline double ftz(double x) { return x; }  // .ftz applies to .f32 only

constexpr uint32_t kCanonicalNaN = 0x7fffffffu;  // PTX ISA: the canonical NaN of f32 results

// ---------------------------------------------------- directed rounding
// PTX's .rz / .rm / .rp forms of add, sub, mul, fma: the host's rounding mode switched around
// one operation (volatile operands: no constant folding across the mode change).
#define FAGEN_PX_ROUNDED(NAME, EXPR)                                                                 \
    template <class T>                                                                               \
    __attribute__((noinline)) T NAME(T a, T b, T c, int mode) {                                      \
        volatile T va = a, vb = b, vc = c;                                                           \
        (void)vc;                                                                                    \
        const int old = fegetround();                                                                \
        fesetround(mode);                                                                            \
        volatile T r = EXPR;                                                                         \
        fesetround(old);                                                                             \
        return r;                                                                                    \
    }
FAGEN_PX_ROUNDED(add_r, va + vb)
FAGEN_PX_ROUNDED(sub_r, va - vb)
FAGEN_PX_ROUNDED(mul_r, va * vb)
FAGEN_PX_ROUNDED(fma_r, std::fma(va, vb, vc))
FAGEN_PX_ROUNDED(div_r, va / vb)
#undef FAGEN_PX_ROUNDED
inline float fma_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double fma_rn(double a, double b, double c) { return fma(a, b, c); }

// ------------------------------------------------------------- min / max
// PTX ISA min/max .f32: a NaN operand is ignored (the other is returned), two NaNs give the
// canonical NaN; -0 < +0. With .NaN any NaN operand gives the canonical NaN.
template <class T>
inline T fmax_ptx(T a, T b, bool nan_prop) {
    const bool na = a != a, nb = b != b;
    if (na || nb) {
        if (nan_prop || (na && nb)) return sizeof(T) == 4 ? T(f32(kCanonicalNaN)) : T(f64(0x7fffffffffffffffull));
        return na ? b : a;
    }
    if (a == b) return std::signbit(a) ? b : a;
    return a > b ? a : b;
}
template <class T>
inline T fmin_ptx(T a, T b, bool nan_prop) {
    const bool na = a != a, nb = b != b;
    if (na || nb) {
        if (nan_prop || (na && nb)) return sizeof(T) == 4 ? T(f32(kCanonicalNaN)) : T(f64(0x7fffffffffffffffull));
        return na ? b : a;
    }
    if (a == b) return std::signbit(a) ? a : b;
    return a < b ? a : b;
}

// ---------------------------------------------------- approximate math
// ex2.approx / lg2.approx / rcp.approx / rsqrt.approx / sqrt.approx / sin / cos: the GPU's
// MUFU results are within a few ulp (ex2.approx.ftz.f32: 2 ulp over the full range); the
// emulator returns libm's (correctly rounded or nearly). Special values follow the ISA tables.
inline float ex2_approx(float x) { return exp2f(x); }
inline float lg2_approx(float x) { return log2f(x); }

// ------------------------------------------------------------- conversions
// f32 -> f16 bits, IEEE round to nearest even (cvt.rn.f16.f32); overflow to inf, NaN to the
// canonical f16 NaN 0x7fff.
inline uint16_t f32_to_f16_rn(float f) {
    const uint32_t x = bits(f), sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7fffu;
    if (ax >= 0x47800000u) {  // >= 65536: inf (also rounds to inf from >= 65520)
        return uint16_t(sign | 0x7c00u);
    }
    if (ax >= 0x38800000u) {  // normal f16 range (>= 2^-14)
        uint32_t m = ax + 0xfffu + ((ax >> 13) & 1u);  // round to nearest even at bit 13
        m -= 0x38000000u;                                // rebias 127 -> 15
        const uint32_t h = m >> 13;
        return uint16_t(sign | (h >= 0x7c00u ? 0x7c00u : h));
    }
    // subnormal f16 (or zero): value / 2^-24, rounded to nearest even
    if (ax < 0x33000000u) return uint16_t(sign);  // < 2^-25: rounds to 0 (2^-25 exactly: tie to even 0)
    const uint32_t e = ax >> 23, mant = (ax & 0x7fffffu) | 0x800000u;
    const unsigned shift = 126u - e;  // mant * 2^(e-127-23) / 2^-24 = mant >> (126 - e)... (e-150+24)
    const unsigned s = shift;         // 14 + (112 - e) + ... computed so that result = mant >> s
    const uint32_t q = mant >> s, rem = mant & ((1u << s) - 1u), half = 1u << (s - 1u);
    const uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    return uint16_t(sign | r);
}
inline uint16_t f32_to_bf16_rn(float f) {
    const uint32_t x = bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // canonical NaN
    return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float f16_to_f32(uint16_t h) { return f16_bits_to_float(h); }
inline float bf16_to_f32(uint16_t h) { return bf16_bits_to_float(h); }

inline float sat(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }

// Float -> integer: rounded as asked, NaN to 0, saturated to the integer's range (PTX ISA cvt).
template <class I, class F>
inline I f2i(F x, int mode) {
    if (x != x) return I(0);
    F r;
    switch (mode) {
        case 0: r = std::nearbyint(x); break;  // rni (nearest even: the host's default mode)
        case 1: r = std::trunc(x); break;      // rzi
        case 2: r = std::floor(x); break;      // rmi
        default: r = std::ceil(x); break;      // rpi
    }
    if (r <= F(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
    if (r >= F(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
    return I(r);
}
template <class F>
inline F round_int(F x, int mode) {  // cvt.rni/rzi/rmi/rpi.f32.f32
    switch (mode) {
        case 0: return std::nearbyint(x);
        case 1: return std::trunc(x);
        case 2: return std::floor(x);
        default: return std::ceil(x);
    }
}
template <class D, class S>
inline D sat_int(S x) {  // cvt.sat between integer types: clamp to D's range
    typedef long long W;
    if constexpr (std::is_unsigned<S>::value && sizeof(S) == 8) {
        if (x > (unsigned long long)std::numeric_limits<D>::max()) return std::numeric_limits<D>::max();
        return D(x);
    } else {
        const W v = W(x);
        if (v < W(std::numeric_limits<D>::min())) return std::numeric_limits<D>::min();
        if (std::is_unsigned<D>::value || sizeof(D) < 8)
            if (v > W(std::numeric_limits<D>::max())) return std::numeric_limits<D>::max();
        return D(v);
    }
}

// ----------------------------------------------------------- integer ops
// shl / shr: a shift amount beyond the width is clamped to it (PTX ISA), not undefined.
template <class T>
inline T shl(T a, uint32_t n) { return n >= sizeof(T) * 8 ? T(0) : T(a << n); }
template <class T>
inline T shr(T a, uint32_t n) {
    if (n >= sizeof(T) * 8) return std::is_signed<T>::value ? T(a < 0 ? -1 : 0) : T(0);
    return T(a >> n);
}
template <class T>
inline T div_i(T a, T b) {  // PTX leaves x / 0 unspecified: the emulator returns all-ones
    if (b == 0) return T(~T(0));
    if (std::is_signed<T>::value && b == T(-1)) return T(0) - a;  // no INT_MIN / -1 trap
    return a / b;
}
template <class T>
inline T rem_i(T a, T b) {
    if (b == 0) return a;
    if (std::is_signed<T>::value && b == T(-1)) return T(0);
    return a % b;
}
template <class T>
inline T mulhi(T a, T b) {
    if constexpr (sizeof(T) == 4) {
        typedef typename std::conditional<std::is_signed<T>::value, int64_t, uint64_t>::type W;
        return T((W(a) * W(b)) >> 32);
    } else {
        typedef typename std::conditional<std::is_signed<T>::value, __int128, unsigned __int128>::type W;
        return T((W(a) * W(b)) >> 64);
    }
}
// bfe: extract len bits at pos (pos, len taken from their low 8 bits), sign-extended for signed.
template <class T>
inline T bfe(T a, uint32_t pos, uint32_t len) {
    typedef typename std::make_unsigned<T>::type U;
    const unsigned w = sizeof(T) * 8;
    pos &= 0xffu, len &= 0xffu;
    const U ua = U(a);
    // ISA: the sign bit is bit (pos + len - 1), clamped to the msb, of a signed source with len != 0
    const bool sbit = std::is_signed<T>::value && len != 0 && ((ua >> (pos + len - 1 >= w ? w - 1 : pos + len - 1)) & 1u);
    const unsigned eff = pos >= w ? 0u : (len < w - pos ? len : w - pos);  // bits taken from a
    U r = eff == 0 ? U(0) : U(ua >> pos);
    if (eff < w) {
        const U mask = eff ? U((U(1) << eff) - 1u) : U(0);
        r &= mask;
        if (sbit) r |= U(~mask);
    }
    return T(r);
}
// bfi: insert len bits of a into b at pos.
template <class T>
inline T bfi(T a, T b, uint32_t pos, uint32_t len) {
    const unsigned w = sizeof(T) * 8;
    pos &= 0xffu, len &= 0xffu;
    if (len == 0 || pos >= w) return b;
    if (len > w - pos) len = w - pos;
    const T mask = len >= w ? T(~T(0)) : T(((T(1) << len) - 1u) << pos);
    return T((b & ~mask) | (T(a << pos) & mask));
}
// prmt.b32 (default mode): byte i of the result is byte c[4i+2:4i] of {b, a}, sign-replicated
// when c[4i+3] is set.
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t c) {
    const uint64_t x = uint64_t(b) << 32 | a;
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) {
        const uint32_t sel = (c >> (4 * i)) & 0xfu;
        uint32_t byte = uint32_t(x >> (8 * (sel & 7u))) & 0xffu;
        if (sel & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
        r |= byte << (8 * i);
    }
    return r;
}
inline uint32_t lop3(uint32_t a, uint32_t b, uint32_t c, uint32_t lut) {
    uint32_t r = 0;
    for (int i = 0; i < 8; ++i)
        if (lut >> i & 1u) r |= ((i & 4) ? a : ~a) & ((i & 2) ? b : ~b) & ((i & 1) ? c : ~c);
    return r;
}
// shf.{l,r}.{wrap,clamp}.b32 d, a, b, c: funnel shift of {b:a} by c.
inline uint32_t shf(uint32_t a, uint32_t b, uint32_t c, bool left, bool clamp) {
    const uint32_t n = clamp ? (c > 32u ? 32u : c) : (c & 31u);
    const uint64_t x = uint64_t(b) << 32 | a;
    if (left) return uint32_t((x << n) >> 32);
    return uint32_t(x >> n);
}
inline uint32_t brev32(uint32_t x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
template <class T>
inline uint32_t clz(T x) {
    return x == 0 ? sizeof(T) * 8 : (sizeof(T) == 8 ? __builtin_clzll(uint64_t(x)) : __builtin_clz(uint32_t(x)));
}
template <class T>
inline uint32_t popc(T x) { return sizeof(T) == 8 ? __builtin_popcountll(uint64_t(x)) : __builtin_popcount(uint32_t(x)); }

// ----------------------------------------------------------------- setp
// Ordered comparisons are false when either operand is NaN (ne too); the u-forms are true.
template <class T> inline bool isnan_(T x) { if constexpr (std::is_floating_point<T>::value) return x != x; else return false; }

// ------------------------------------------------------ special registers
inline uint32_t laneid() { return g.cur->index & 31u; }
inline uint32_t warpid() { return g.cur->index >> 5; }

// ----------------------------------------------------------- addresses
inline unsigned char* smem(uint64_t shared_addr) { return g.smem + shared_addr; }
inline uint64_t cvta_shared(uint64_t a) { return uint64_t(reinterpret_cast<uintptr_t>(g.smem)) + a; }
inline uint64_t cvta_to_shared(uint64_t a) { return a - uint64_t(reinterpret_cast<uintptr_t>(g.smem)); }
template <class T> inline T ld(const void* p) { T v; memcpy(&v, p, sizeof v); return v; }
template <class T> inline void st(void* p, T v) { memcpy(p, &v, sizeof v); }
inline void* hp(uint64_t a) { return reinterpret_cast<void*>(uintptr_t(a)); }

// --------------------------------------------------------------- shfl.sync
// shfl.sync.{up,down,bfly,idx}.b32 d|p, a, b, c, membermask, exactly as the ISA's pseudo-code:
// segmask = c[12:8], maxLane = (lane & segmask) | (c[4:0] & ~segmask), minLane = lane & segmask.
struct ShflLane {
    uint32_t a, b, c, d;
    bool p;
};
template <int MODE>  // 0 up, 1 down, 2 bfly, 3 idx
void shfl_complete(void* const* payloads, unsigned arrived) {
    uint32_t in[32];
    for (unsigned l = 0; l < 32; ++l) in[l] = payloads[l] ? static_cast<ShflLane*>(payloads[l])->a : ~0u;
    for (unsigned l = 0; l < 32; ++l) {
        if (!payloads[l]) continue;
        ShflLane& s = *static_cast<ShflLane*>(payloads[l]);
        const int lane = int(l), bval = int(s.b & 31u), cval = int(s.c & 31u), segmask = int((s.c >> 8) & 31u);
        const int maxLane = (lane & segmask) | (cval & ~segmask), minLane = lane & segmask;
        int j;
        bool pval;
        switch (MODE) {
            case 0: j = lane - bval; pval = j >= maxLane; break;
            case 1: j = lane + bval; pval = j <= maxLane; break;
            case 2: j = lane ^ bval; pval = j <= maxLane; break;
            default: j = minLane | (bval & ~segmask); pval = j <= maxLane; break;
        }
        if (!pval) j = lane;
        // A source lane outside the collective has no value: all-ones (NaN bits), like the shim.
        s.d = (arrived >> j & 1u) ? in[j] : ~0u;
        s.p = pval;
    }
}
template <int MODE>
inline uint32_t shfl(uint32_t a, uint32_t b, uint32_t c, uint32_t mask, bool* p, const char* name, const char* file,
                     int line) {
    ShflLane lane{a, b, c, 0, false};
    warp_exchange(mask, &lane, &shfl_complete<MODE>, name, file, line);
    if (p) *p = lane.p;
    return lane.d;
}

// ------------------------------------------- .aligned warp collectives
// mma.sync.aligned, ldmatrix.sync.aligned, stmatrix.sync.aligned: every lane of the warp must
// execute the same instruction (the runtime's collectives only compare the operation). Each lane's
// payload starts with the primitive's own payload and carries its PTX line; the completing lane
// checks the lines before running the primitive.
template <class P>
struct Aligned {
    P p;  // first member: the primitive's completion function reads the payload as a P
    int line;
};
template <class P>
inline void check_aligned(void* const* payloads, unsigned arrived, const char* what) {
    int first = -1;
    unsigned first_lane = 0;
    for (unsigned l = 0; l < 32; ++l) {
        if (!(arrived >> l & 1u)) continue;
        const int line = static_cast<const Aligned<P>*>(payloads[l])->line;
        if (first < 0) {
            first = line, first_lane = l;
        } else if (line != first) {
            begin_message("divergent warp collective");
            appendf("warp %u: %s is .aligned, but lane %u executes it at %s:%d and lane %u at %s:%d", g.cur->index >> 5,
                    what, first_lane, fagen_ptx_file_name, first, l, fagen_ptx_file_name, line);
            abort_block(FAGEN_EMU_DEADLOCK);
        }
    }
}
template <bool BF16>
void mma_aligned_complete(void* const* payloads, unsigned arrived) {
    check_aligned<MmaLane>(payloads, arrived, "mma.sync.aligned");
    mma_m16n8k16_complete<BF16>(payloads, arrived);
}
template <bool BF16>
inline void mma(float* d, const float* c, const uint32_t* a, const uint32_t* b, const char* file, int line) {
    float acc[4] = {c[0], c[1], c[2], c[3]};
    Aligned<MmaLane> lane{MmaLane{acc, a, b}, line};
    warp_exchange(0xffffffffu, &lane, &mma_aligned_complete<BF16>,
                  BF16 ? "mma.sync.aligned.m16n8k16 (bf16)" : "mma.sync.aligned.m16n8k16 (f16)", file, line);
    d[0] = acc[0], d[1] = acc[1], d[2] = acc[2], d[3] = acc[3];
}
template <int NUM, bool TRANS>
void ldmatrix_aligned_complete(void* const* payloads, unsigned arrived) {
    check_aligned<LdmatrixLane>(payloads, arrived, "ldmatrix.sync.aligned");
    ldmatrix_complete<NUM, TRANS>(payloads, arrived);
}
template <int NUM, bool TRANS>
inline void ldmatrix(uint32_t* r, const void* row, const char* file, int line) {
    Aligned<LdmatrixLane> lane{LdmatrixLane{r, row}, line};
#if defined(FAGEN_EMU_RACECHECK)
    g_racecheck_warp_base = g.cur->index & ~31u;  // read by the completing lane (same warp)
    g_racecheck_site = race::site(file, line, "ldmatrix.sync.aligned");
#endif
    warp_exchange(0xffffffffu, &lane, &ldmatrix_aligned_complete<NUM, TRANS>, "ldmatrix.sync.aligned", file, line);
}
template <int NUM, bool TRANS>
void stmatrix_aligned_complete(void* const* payloads, unsigned arrived) {
    check_aligned<hopper::StmatrixLane>(payloads, arrived, "stmatrix.sync.aligned");
    hopper::stmatrix_complete<NUM, TRANS>(payloads, arrived);
}
template <int NUM, bool TRANS>
inline void stmatrix(void* row, const uint32_t* r, const char* name, const char* file, int line) {
    hopper::Quiet quiet;
    Aligned<hopper::StmatrixLane> lane{hopper::StmatrixLane{r, static_cast<unsigned char*>(row), name, file, line}, line};
    warp_exchange(0xffffffffu, &lane, &stmatrix_aligned_complete<NUM, TRANS>, name, file, line);
}

// ------------------------------------------------------------ elect.sync
// elect.sync d|p, membermask (PTX ISA 9.7.13.x): one lane of the mask is elected (the ISA leaves which;
// the emulator, as hopper.h's fa_elect_one, the highest, so no kernel may assume lane 0); d = its
// lane id in every participating lane, p = true in it alone. A ballot collective over the mask.
inline bool elect(uint32_t mask, uint32_t* leader, const char* file, int line) {
    hopper::Quiet quiet;
    const unsigned ballot = __ballot_sync(mask, 1, file, line);
    const unsigned l = 31u - unsigned(__builtin_clz(ballot));
    *leader = l;
    return (g.cur->index & 31u) == l;
}

// ---------------------------------------------------- PTX-level hazards
// A hazard only the PTX level can see (the message starts "PTX hazard": fagen.emulator.ptx
// raises it as PtxHazardError).
[[noreturn]] inline void hazard(const char* kernel_file, int line, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
[[noreturn]] inline void hazard(const char* kernel_file, int line, const char* fmt, ...) {
    begin_message("PTX hazard");
    appendf("at %s:%d, warp %u, ", kernel_file, line, g.cur->index >> 5);
    append_thread(g.cur);
    appendf(" (lane %u): ", g.cur->index & 31u);
    const size_t n = strlen(g.msg);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g.msg + n, sizeof g.msg - n, fmt, ap);
    va_end(ap);
    abort_block(FAGEN_EMU_KERNEL_ERROR);
}

// wgmma.fence / commit_group / wait_group are .sync.aligned: every thread of the warpgroup executes
// the same instruction. A warpgroup rendezvous whose signature holds the PTX line: threads at a
// different line (or kind) are a "divergent warpgroup collective" naming both PTX lines.
inline void wg_aligned_noop(void* const*) {}
inline void wg_aligned(unsigned kind, const char* name, const char* file, int line) {
    hopper::warpgroup_collective(nullptr, &wg_aligned_noop, uint64_t(unsigned(line)) << 8 | kind, name, name, file,
                                 line);
}

// The per-thread wgmma register tracking (the commit group each register tuple of a wgmma is in
// flight in, the line of that wgmma, the line of the last access since wgmma.fence) is a local
// struct of each translated entry, sized by the translator (translate.py, _wgmma).

// ------------------------------------------- cp.async destinations (PTX level)
// Every shared-memory access of a translated entry that issues cp.async is checked against the
// cp.async destinations (translate.py emits the calls only in such entries). Per 16 bytes of the
// window: the issuing thread, the cp.async's PTX line, whether the issuer's cp.async.wait_group /
// wait_all has landed it, and the issuer's barrier counts at the landing. A read (or write) of a
// destination still in flight, or a read by another thread before a barrier that follows the
// landing publishes it (bar.sync 0 for every thread; bar.warp.sync for the issuer's warp), is a
// PTX hazard naming both PTX lines. The source level's poison (NaN) shows the same defects as
// wrong values only; its racecheck build reports them as races.
struct CpRec {
    uint16_t issuer1;      // issuing thread + 1 (0: nothing tracked)
    uint8_t landed;        // the issuer's wait has landed it
    int line, wait_line;   // the cp.async's PTX line; the wait that landed it
    uint32_t bars, warps;  // the issuer's block-barrier / bar.warp.sync counts at the landing
};
struct CpTrack {
    uint64_t block = ~uint64_t(0);
    std::vector<CpRec> rec;             // per 16 bytes of the window
    std::vector<uint32_t> bars, warps;  // per thread: block barriers / bar.warp.sync passed
};
#if FAGEN_EMU_RUNTIME_DEFS  // defined in the runtime object (runtime.h)
CpTrack cpt;
#else
extern CpTrack cpt;
#endif
inline CpTrack& cp_track() {
    if (cpt.block != g.block_serial) {
        cpt.rec.assign((g.smem_bytes + 15) / 16, CpRec{});
        cpt.bars.assign(g.nthreads, 0u);
        cpt.warps.assign(g.nthreads, 0u);
        cpt.block = g.block_serial;
    }
    return cpt;
}
inline void cp_passed_block_barrier() { ++cp_track().bars[g.cur->index]; }
inline void cp_passed_syncwarp() { ++cp_track().warps[g.cur->index]; }

// MODE: 0 a read by this thread, 1 a write, 2 a read whose data goes to the other lanes of the
// warp (ldmatrix: the row address's lane is not the only reader).
inline void cp_check(const void* p, size_t bytes, int mode, const char* what, const char* file, int line) {
    const uintptr_t off = reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(g.smem);
    if (off >= g.smem_bytes || bytes == 0) return;
    CpTrack& t = cp_track();
    const unsigned self = g.cur->index;
    const size_t last = std::min<size_t>((off + bytes - 1) / 16, t.rec.size() - 1);
    for (size_t c = off / 16; c <= last; ++c) {
        CpRec& r = t.rec[c];
        if (!r.issuer1) continue;
        const unsigned issuer = r.issuer1 - 1u;
        if (!r.landed)
            hazard(file, line, "%s %s shared offset 0x%zx, the destination of the cp.async at PTX line %d (thread %u) "
                   "still in flight: no cp.async.wait_group / wait_all of its thread has completed its group",
                   what, mode == 1 ? "writes" : "reads", size_t(c * 16), r.line, issuer);
        if (mode == 1) continue;
        if (t.bars[self] > r.bars) {  // a block barrier after the landing: published to every thread
            r.issuer1 = 0;
            continue;
        }
        if (issuer == self && mode == 0) continue;
        if ((issuer >> 5) == (self >> 5) && t.warps[self] > r.warps) continue;
        hazard(file, line, "%s reads shared offset 0x%zx, the destination of the cp.async at PTX line %d (thread %u), "
               "landed by that thread's wait at PTX line %d but not yet published to %s: no barrier (bar.sync) "
               "since that wait",
               what, size_t(c * 16), r.line, issuer, r.wait_line,
               mode == 2 ? "the lanes this ldmatrix delivers it to" : "this thread");
    }
}

// Generic-proxy writes of shared memory (entries with async-proxy reads: wgmma operands, TMA / bulk
// store and reduce sources). Per 2 bytes: the writer, its fence.proxy.async count at the write and
// the PTX line; the async proxy reading a cell whose writer has not passed fence.proxy.async since
// is a PTX hazard.
struct GwCell {
    uint64_t block;  // g.block_serial of the write (older: no write in this block)
    uint32_t epoch;  // the writer's fence.proxy.async count at the write
    uint32_t writer;
    int line;
};
struct GwTrack {
    uint64_t block = ~uint64_t(0);
    std::vector<GwCell> cells;       // per 2 bytes of the window (grown, never cleared)
    std::vector<uint64_t> chunks;    // per 16 bytes: g.block_serial of its last generic write (a fast skip)
    std::vector<uint32_t> fences;    // per thread: fence.proxy.async passed
};
#if FAGEN_EMU_RUNTIME_DEFS  // defined in the runtime object (runtime.h)
GwTrack gwt;
#else
extern GwTrack gwt;
#endif
inline GwTrack& gw_track() {
    if (gwt.block != g.block_serial) {
        if (gwt.cells.size() < (g.smem_bytes + 1) / 2) gwt.cells.resize((g.smem_bytes + 1) / 2, GwCell{~uint64_t(0), 0, 0, 0});
        if (gwt.chunks.size() < (g.smem_bytes + 15) / 16) gwt.chunks.resize((g.smem_bytes + 15) / 16, ~uint64_t(0));
        gwt.fences.assign(g.nthreads, 0u);
        gwt.block = g.block_serial;
    }
    return gwt;
}
inline void gw_fence() { ++gw_track().fences[g.cur->index]; }
inline void gw_note_thread(unsigned t, const void* p, size_t bytes, int line) {
    const uintptr_t off = reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(g.smem);
    if (off >= g.smem_bytes || bytes == 0) return;
    GwTrack& w = gw_track();
    const size_t last = std::min<size_t>((off + bytes - 1) / 2, (g.smem_bytes + 1) / 2 - 1);
    for (size_t i = off / 2; i <= last; ++i) w.cells[i] = GwCell{g.block_serial, w.fences[t], t, line};
    for (size_t c = off / 16; c <= last / 8; ++c) w.chunks[c] = g.block_serial;
}
inline void gw_note(const void* p, size_t bytes, int line) { gw_note_thread(g.cur->index, p, bytes, line); }
inline void gw_check_off(size_t off, size_t bytes, const char* what, const char* file, int line) {
    if (off >= g.smem_bytes || bytes == 0) return;
    GwTrack& w = gw_track();
    const size_t last = std::min<size_t>((off + bytes - 1) / 2, (g.smem_bytes + 1) / 2 - 1);
    for (size_t i = off / 2; i <= last; ++i) {
        if (w.chunks[i / 8] != g.block_serial) {  // no generic write in this 16-byte chunk in this block
            i |= 7u;
            continue;
        }
        const GwCell& c = w.cells[i];
        if (c.block == g.block_serial && w.fences[c.writer] == c.epoch)
            hazard(file, line, "%s reads shared offset 0x%zx through the async proxy, written through the generic "
                   "proxy by thread %u at PTX line %d with no fence.proxy.async by that thread since (PTX ISA: "
                   "the async proxy sees generic-proxy writes only after fence.proxy.async)",
                   what, 2 * i, c.writer, c.line);
    }
}
// The shared operands of a wgmma (descriptor A when `a_desc`, descriptor B), 16 bytes at a time: in
// every canonical layout 8 consecutive K (K-major) or MN (MN-major) elements are one 16-byte aligned
// run, which the swizzle moves as a whole (hopper.h's operand_addr).
inline void gw_check_wgmma(bool a_desc, unsigned long long da, unsigned long long db, int n, int ta, int tb,
                           const char* file, int line) {
    const char* what = "wgmma.mma_async";
    for (int op = a_desc ? 0 : 1; op < 2; ++op) {
        const hopper::Desc d = hopper::decode_desc(op == 0 ? da : db, what, file, line);
        const unsigned rows = op == 0 ? 64u : unsigned(n);
        const bool mn_major = (op == 0 ? ta : tb) != 0;
        if (mn_major) {
            for (unsigned mn = 0; mn < rows; mn += 8)
                for (unsigned k = 0; k < 16; ++k) gw_check_off(hopper::operand_addr(d, true, mn, k), 16, what, file, line);
        } else {
            for (unsigned mn = 0; mn < rows; ++mn)
                for (unsigned k = 0; k < 16; k += 8) gw_check_off(hopper::operand_addr(d, false, mn, k), 16, what, file, line);
        }
    }
}
// A TMA store / reduce: its source is the tensor map's box (elements x element bytes).
inline size_t tma_box_bytes(const FaTensorMap* m) {
    size_t n = m->elem_bytes;
    for (unsigned i = 0; i < m->rank && i < 5; ++i) {
        const unsigned s = m->elem_strides[i] ? m->elem_strides[i] : 1u;
        n *= (m->box[i] + s - 1) / s;
    }
    return n;
}
inline void gw_check_src(const void* p, size_t bytes, const char* what, const char* file, int line) {
    gw_check_off(reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(g.smem), bytes, what, file, line);
}

// cp.async through the tracker: issue (a destination still in flight is a hazard), waits (mark the
// copies they land; with GW the landing is also a generic-proxy write of the issuer).
inline void cp_async(void* dst, const void* src, bool valid, const char* file, int line) {
    cp_check(dst, 16, 1, "cp.async", file, line);
    cp_async_16(dst, src, valid, file, line);
    const uintptr_t off = reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(g.smem);
    if (off < g.smem_bytes) cp_track().rec[off / 16] = CpRec{uint16_t(g.cur->index + 1u), 0, line, 0, 0, 0};
}
template <bool GW>
inline void cp_mark_landing(unsigned done, int line) {  // the copies of groups [0, done) land
    CpTrack& t = cp_track();
    const unsigned self = g.cur->index;
    AsyncQueue& q = async_queue();
    for (unsigned k = 0; k < q.n; ++k) {
        const AsyncCopy& c = q.items[k];
        if (c.group >= done) continue;
        const uintptr_t off = reinterpret_cast<uintptr_t>(c.dst) - reinterpret_cast<uintptr_t>(g.smem);
        if (off >= g.smem_bytes) continue;
        CpRec& r = t.rec[off / 16];
        if (r.issuer1 == self + 1u) r.landed = 1, r.wait_line = line, r.bars = t.bars[self], r.warps = t.warps[self];
        if (GW) gw_note(c.dst, 16, r.line);
    }
}
template <bool GW>
inline void cp_wait(unsigned pending, const char* file, int line) {
    AsyncQueue& q = async_queue();
    if (q.commits > pending) cp_mark_landing<GW>(q.commits - pending, line);
    cp_async_wait(pending, file, line);
}
template <bool GW>
inline void cp_wait_all(const char* file, int line) {
    cp_mark_landing<GW>(~0u, line);  // commit + wait 0: every queued copy
    cp_async_wait_all(file, line);
}

// ------------------------------------------------------ racecheck (PTX level)
// build_ptx(..., racecheck=True) compiles with -DFAGEN_EMU_RACECHECK (no -fsanitize=thread: the
// translator knows every memory instruction) and translate(racecheck=True) reports each load, store
// and atomic of the translated code to racecheck.h with its PTX line as the site (`w` caches the
// site index per instruction). The collectives, cp.async, barriers, mbarrier, TMA and wgmma report
// through the runtime's own events, as at the source level.
#if defined(FAGEN_EMU_RACECHECK)
inline void rc_access(const void* p, size_t bytes, race::Op op, uint32_t& w, const char* file, int line,
                      const char* what) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (!race::T.active) return;
    if (a - reinterpret_cast<uintptr_t>(race::T.smem) < race::T.smem_bytes) {
        if (!w) w = race::site(file, line, what);
        race::thread_access(p, bytes, op, w);
        return;
    }
    if (op != race::kWrite) return;  // global memory: plain stores of two blocks to the same bytes
    if ((a >= race::T.stacks_lo && a < race::T.stacks_hi) || (a >= race::T.image_lo && a < race::T.image_hi)) return;
    if (!w) w = race::site(file, line, what);
    race::global_store(a, unsigned(bytes), w);
}
#endif

// ------------------------------------------------------ bulk groups at exit
// A thread that exits with cp.async.bulk stores / reduces not waited for (its bulk groups not
// drained by cp.async.bulk.wait_group): the CTA's shared memory may be reused before the copy has
// read its source.
inline void bulk_exit(const char* file, int line) {
    hopper::Hopper& h = hopper::state();
    const hopper::ThreadState& ts = h.threads[g.cur->index];
    if (ts.bulk.empty()) return;
    const hopper::BulkOp& b = ts.bulk.front();
    if (b.group < ts.bulk_commits)
        hazard(file, line, "the thread exits with %zu bulk store / reduce(s) not waited for: the one at PTX line %d "
               "is in committed bulk group %u, which no cp.async.bulk.wait_group drained (the CTA's shared memory "
               "may be reused before the copy reads it)",
               ts.bulk.size(), b.line, b.group);
    hazard(file, line, "the thread exits with %zu bulk store / reduce(s) not waited for: the one at PTX line %d was "
           "never committed (cp.async.bulk.commit_group) nor waited for",
           ts.bulk.size(), b.line);
}

}  // namespace px
}  // namespace fagen_emu
