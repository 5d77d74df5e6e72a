// ---------------------------------------------------------------------------
// fagen CPU emulator shim: the CUDA surface a kernel source sees on the host.
//
// Follows runtime.h in the translation unit and precedes the kernel source
// (which defines FAGEN_EMULATOR and includes templates/partials/primitives.cuh).
// cuda_fp16.h / cuda_bf16.h are included here first, in host mode, so their
// host_defines.h macros exist before they are overridden below; the kernel's
// own #includes of them are then no-ops.
// ---------------------------------------------------------------------------
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstring>
#include <type_traits>

// Qualifiers. __shared__ becomes `static`: correct only because blocks run one
// at a time, so one copy per variable serves every block (its contents carry
// over between blocks instead of being undefined). `extern __shared__` arrays
// are not supported: dynamic shared memory is fa_smem().
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __constant__ static
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

// The call site of a barrier, captured at the caller through default
// arguments (fa_sync() forwards its own caller's site).
#define FAGEN_EMU_SITE const char *fagen_emu_file = __builtin_FILE(), int fagen_emu_line = __builtin_LINE()
#define FAGEN_EMU_SITE_ARGS fagen_emu_file, fagen_emu_line

// Racecheck marker (racecheck.h): a no-op that a racecheck report names when
// a thread passed it; put in place of a barrier to see what the barrier orders.
static inline void fagen_emu_race_marker(FAGEN_EMU_SITE) { fagen_emu::race_marker(FAGEN_EMU_SITE_ARGS); }
// Racecheck gate (racecheck.h): ``fagen_emu_race_gate(i) ? barrier : (void)0`` runs the
// barrier unless the module selected gate i (then it is a marker in its place).
static inline bool fagen_emu_race_gate(int gate, FAGEN_EMU_SITE) {
    return fagen_emu::race_gate(gate, FAGEN_EMU_SITE_ARGS);
}

// Built-in variables.
#define threadIdx (fagen_emu_state.cur->tid)
#define blockIdx (fagen_emu_state.block_idx)
#define blockDim (fagen_emu_state.block_dim)
#define gridDim (fagen_emu_state.grid_dim)
constexpr int warpSize = 32;

static inline unsigned char* fagen_emu_dynamic_smem() { return fagen_emu_state.smem; }

// Stops the block with a kernel error (raised in Python as EmulatorKernelError).
#define fagen_emu_fail(...) ::fagen_emu::fail(__VA_ARGS__)
[[noreturn]] static inline void __trap() { fagen_emu_fail("__trap()"); }
[[noreturn]] static inline void __brkpt() { fagen_emu_fail("__brkpt()"); }

// ------------------------------------------------------------- barriers
static inline void __syncthreads(FAGEN_EMU_SITE) { fagen_emu::block_barrier(FAGEN_EMU_SITE_ARGS); }
static inline int __syncthreads_or(int pred, FAGEN_EMU_SITE) {
    return fagen_emu::block_barrier_or(pred, FAGEN_EMU_SITE_ARGS);
}
static inline void __syncwarp(unsigned mask = 0xffffffffu, FAGEN_EMU_SITE) {
    fagen_emu::warp_collective(fagen_emu::kSyncwarp, mask, 0, 0, 32, FAGEN_EMU_SITE_ARGS);
}
// Blocks run sequentially on one OS thread: fences have nothing to order.
static inline void __threadfence_block() { __asm__ __volatile__("" ::: "memory"); }
static inline void __threadfence() { __asm__ __volatile__("" ::: "memory"); }

// ------------------------------------------------------- warp collectives
namespace fagen_emu {
template <typename T>
inline uint64_t to_bits(T v) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shuffle of an unsupported type");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
template <typename T>
inline T shuffle(Collective kind, unsigned mask, T var, int arg, int width, const char* file, int line) {
    return from_bits<T>(warp_collective(kind, mask, to_bits(var), arg, width, file, line));
}
}  // namespace fagen_emu

template <typename T>
static inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize, FAGEN_EMU_SITE) {
    return fagen_emu::shuffle(fagen_emu::kShflIdx, mask, var, src_lane, width, FAGEN_EMU_SITE_ARGS);
}
template <typename T>
static inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, FAGEN_EMU_SITE) {
    return fagen_emu::shuffle(fagen_emu::kShflUp, mask, var, int(delta), width, FAGEN_EMU_SITE_ARGS);
}
template <typename T>
static inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize, FAGEN_EMU_SITE) {
    return fagen_emu::shuffle(fagen_emu::kShflDown, mask, var, int(delta), width, FAGEN_EMU_SITE_ARGS);
}
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize, FAGEN_EMU_SITE) {
    return fagen_emu::shuffle(fagen_emu::kShflXor, mask, var, lane_mask, width, FAGEN_EMU_SITE_ARGS);
}
static inline unsigned __ballot_sync(unsigned mask, int pred, FAGEN_EMU_SITE) {
    return unsigned(fagen_emu::warp_collective(fagen_emu::kBallot, mask, pred != 0, 0, 32, FAGEN_EMU_SITE_ARGS));
}
static inline int __any_sync(unsigned mask, int pred, FAGEN_EMU_SITE) {
    return int(fagen_emu::warp_collective(fagen_emu::kAny, mask, pred != 0, 0, 32, FAGEN_EMU_SITE_ARGS));
}
static inline int __all_sync(unsigned mask, int pred, FAGEN_EMU_SITE) {
    return int(fagen_emu::warp_collective(fagen_emu::kAll, mask, pred != 0, 0, 32, FAGEN_EMU_SITE_ARGS));
}

// ---------------------------------------------------------------- atomics
// One fiber runs at a time and never yields inside these: plain
// read-modify-write is atomic.
// In a racecheck build they are atomics of the happens-before model (never a
// hazard with each other, but with plain accesses of the same bytes).
template <typename T>
FAGEN_EMU_NO_TSAN inline void fagen_emu_atomic_access(T* p, const void* ra) {
#if defined(FAGEN_EMU_RACECHECK)
    fagen_emu::race::thread_access(p, sizeof(T), fagen_emu::race::kAtomic, fagen_emu::race::code_where(ra));
#else
    (void)p, (void)ra;
#endif
}
template <typename T>
FAGEN_EMU_NO_TSAN static inline T fagen_emu_rmw_add(T* p, T v, const void* ra) {
    fagen_emu_atomic_access(p, ra);
    const T old = *p;
    *p = old + v;
    return old;
}
FAGEN_EMU_NO_TSAN static inline float atomicAdd(float* p, float v) { return fagen_emu_rmw_add(p, v, __builtin_return_address(0)); }
FAGEN_EMU_NO_TSAN static inline double atomicAdd(double* p, double v) { return fagen_emu_rmw_add(p, v, __builtin_return_address(0)); }
FAGEN_EMU_NO_TSAN static inline int atomicAdd(int* p, int v) {
    return int(fagen_emu_rmw_add((unsigned*)p, unsigned(v), __builtin_return_address(0)));
}
FAGEN_EMU_NO_TSAN static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return fagen_emu_rmw_add(p, v, __builtin_return_address(0));
}
FAGEN_EMU_NO_TSAN static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return fagen_emu_rmw_add(p, v, __builtin_return_address(0));
}
template <typename T>
FAGEN_EMU_NO_TSAN static inline T atomicExch(T* p, T v) {
    fagen_emu_atomic_access(p, __builtin_return_address(0));
    const T old = *p;
    *p = v;
    return old;
}
template <typename T>
FAGEN_EMU_NO_TSAN static inline T atomicCAS(T* p, T compare, T v) {
    fagen_emu_atomic_access(p, __builtin_return_address(0));
    const T old = *p;
    if (old == compare) *p = v;
    return old;
}
template <typename T>
FAGEN_EMU_NO_TSAN static inline T atomicMax(T* p, T v) {
    fagen_emu_atomic_access(p, __builtin_return_address(0));
    const T old = *p;
    if (v > old) *p = v;
    return old;
}
template <typename T>
FAGEN_EMU_NO_TSAN static inline T atomicMin(T* p, T v) {
    fagen_emu_atomic_access(p, __builtin_return_address(0));
    const T old = *p;
    if (v < old) *p = v;
    return old;
}

// ------------------------------------------------------------ intrinsics
// The fast-math intrinsics are computed exactly (libm): the emulator checks
// logic, not the last ulp of the hardware approximations.
// glibc declares __expf & co. itself (extern "C"), so these are renamed.
#define __expf fagen_emu_expf
#define __exp2f fagen_emu_exp2f
#define __logf fagen_emu_logf
#define __log2f fagen_emu_log2f
#define __sinf fagen_emu_sinf
#define __cosf fagen_emu_cosf
#define __powf fagen_emu_powf
static inline float fagen_emu_expf(float x) { return expf(x); }
static inline float fagen_emu_exp2f(float x) { return exp2f(x); }
static inline float fagen_emu_logf(float x) { return logf(x); }
static inline float fagen_emu_log2f(float x) { return log2f(x); }
static inline float fagen_emu_sinf(float x) { return sinf(x); }
static inline float fagen_emu_cosf(float x) { return cosf(x); }
static inline float fagen_emu_powf(float x, float y) { return powf(x, y); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
static inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((1ull * a * b) >> 32); }
static inline int __mulhi(int a, int b) { return int((1ll * a * b) >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
static inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
static inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
static inline unsigned __float_as_uint(float f) { unsigned x; memcpy(&x, &f, 4); return x; }
template <typename T>
static inline T __ldg(const T* p) { return *p; }

// min/max as CUDA declares them for device code.
#define FAGEN_EMU_MINMAX(T)                                   \
    static inline T min(T a, T b) { return b < a ? b : a; } \
    static inline T max(T a, T b) { return a < b ? b : a; }
FAGEN_EMU_MINMAX(int)
FAGEN_EMU_MINMAX(unsigned)
FAGEN_EMU_MINMAX(long long)
FAGEN_EMU_MINMAX(unsigned long long)
#undef FAGEN_EMU_MINMAX
static inline unsigned min(int a, unsigned b) { return min(unsigned(a), b); }
static inline unsigned min(unsigned a, int b) { return min(a, unsigned(b)); }
static inline unsigned max(int a, unsigned b) { return max(unsigned(a), b); }
static inline unsigned max(unsigned a, int b) { return max(a, unsigned(b)); }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }

// ------------------------------------------------ tensor-core primitives
// Host halves of templates/partials/mma.cuh. mma.sync and ldmatrix are warp
// collectives over warp_exchange: every lane deposits pointers to its
// registers, the last lane to arrive computes the whole warp's result with the
// PTX ISA's fragment layouts and writes every lane's destination registers.
// cp.async is emulated adversarially (see cp_async_16 below).
namespace fagen_emu {

FAGEN_EMU_FAST_BEGIN  // the conversions and the warp collectives (runtime.h)
inline float f16_bits_to_float(unsigned h) {
    // Exponent and mantissa moved into float position and rescaled by 2^112
    // (exact, subnormals included); inf / NaN get float's all-ones exponent.
    const unsigned e = (h & 0x7fffu) << 13;
    float f;
    memcpy(&f, &e, 4);
    f *= 5.192296858534828e33f;  // 2^112
    unsigned bits;
    memcpy(&bits, &f, 4);
    if (e >= (0x7c00u << 13)) bits = e | 0x7f800000u;
    bits |= (h & 0x8000u) << 16;
    memcpy(&f, &bits, 4);
    return f;
}
inline float bf16_bits_to_float(unsigned h) {
    const unsigned bits = (h & 0xffffu) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
template <bool BF16>
inline float mma_elem(unsigned reg, unsigned half) {
    const unsigned h = half ? reg >> 16 : reg & 0xffffu;  // element order: low half first
    return BF16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
}

#if defined(FAGEN_EMU_RACECHECK)
// Set by the lane that completes an ldmatrix, read by ldmatrix_complete.
inline unsigned g_racecheck_warp_base = 0;
inline uint32_t g_racecheck_site = 0;
#endif

[[noreturn]] inline void need_full_warp(const char* what, unsigned arrived) {
    fail("%s needs all 32 lanes of the warp, but lanes 0x%08x are absent (partial warp)", what, ~arrived);
}

struct MmaLane {
    float* d;
    const unsigned* a;
    const unsigned* b;
};

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, with the
// layouts of PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point
// type" (groupID g = lane >> 2, threadID_in_group t = lane % 4):
//   A (16x16): a[r] holds A[g + 8*(r&1)][2t + 8*(r>>1) + {0,1}]
//   B (16x8):  b[r] holds B[2t + 8r + {0,1}][g]
//   C/D (16x8): d[i] is D[g + 8*(i>>1)][2t + (i&1)]
// Products of f16/bf16 values are exact in float; each D element is the sum of
// C and its 16 products in double, rounded to float once. The GPU adds in
// fp32 in a hardware-specific order, so results agree to fp32 accumulation
// error, not bit for bit.
template <bool BF16>
FAGEN_EMU_NO_TSAN void mma_m16n8k16_complete(void* const* payloads, unsigned arrived) {
    if (arrived != 0xffffffffu) need_full_warp("fa_mma_m16n8k16", arrived);
    double A[16][16], B[16][8], D[16][8];  // B[k][n]; D starts as C
    for (unsigned lane = 0; lane < 32; ++lane) {
        const MmaLane& p = *static_cast<const MmaLane*>(payloads[lane]);
        const unsigned g = lane >> 2, t = lane & 3u;
        for (unsigned r = 0; r < 4; ++r) {
            const unsigned row = g + 8 * (r & 1u), col = 2 * t + 8 * (r >> 1);
            A[row][col] = mma_elem<BF16>(p.a[r], 0);
            A[row][col + 1] = mma_elem<BF16>(p.a[r], 1);
        }
        for (unsigned r = 0; r < 2; ++r) {
            const unsigned k = 2 * t + 8 * r;
            B[k][g] = mma_elem<BF16>(p.b[r], 0);
            B[k + 1][g] = mma_elem<BF16>(p.b[r], 1);
        }
        for (unsigned i = 0; i < 4; ++i) D[g + 8 * (i >> 1)][2 * t + (i & 1u)] = p.d[i];
    }
    // Row by row, the 8 columns as 4 two-double vector accumulators (GCC/Clang
    // vector extension: SSE2 on x86-64, scalar code elsewhere), kept in registers.
    typedef double v2d __attribute__((vector_size(16)));
    for (unsigned row = 0; row < 16; ++row) {
        v2d acc0, acc1, acc2, acc3;
        memcpy(&acc0, &D[row][0], 16), memcpy(&acc1, &D[row][2], 16);
        memcpy(&acc2, &D[row][4], 16), memcpy(&acc3, &D[row][6], 16);
        for (unsigned k = 0; k < 16; ++k) {
            const v2d a = {A[row][k], A[row][k]};
            v2d b0, b1, b2, b3;
            memcpy(&b0, &B[k][0], 16), memcpy(&b1, &B[k][2], 16);
            memcpy(&b2, &B[k][4], 16), memcpy(&b3, &B[k][6], 16);
            acc0 += a * b0, acc1 += a * b1, acc2 += a * b2, acc3 += a * b3;
        }
        memcpy(&D[row][0], &acc0, 16), memcpy(&D[row][2], &acc1, 16);
        memcpy(&D[row][4], &acc2, 16), memcpy(&D[row][6], &acc3, 16);
    }
    for (unsigned lane = 0; lane < 32; ++lane) {
        float* d = static_cast<const MmaLane*>(payloads[lane])->d;
        const unsigned g = lane >> 2, t = lane & 3u;
        for (unsigned i = 0; i < 4; ++i) d[i] = float(D[g + 8 * (i >> 1)][2 * t + (i & 1u)]);
    }
}

template <bool BF16>
FAGEN_EMU_NO_TSAN inline void mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, const char* file, int line) {
    MmaLane lane{d, a, b};
    warp_exchange(0xffffffffu, &lane, &mma_m16n8k16_complete<BF16>,
                  BF16 ? "fa_mma_m16n8k16<__nv_bfloat16>" : "fa_mma_m16n8k16<__half>", file, line);
}

struct LdmatrixLane {
    unsigned* r;
    const void* row;
};

// ldmatrix.sync.aligned.m8n8.x{NUM}[.trans].shared.b16 (PTX ISA "Warp-level
// matrix load instruction: ldmatrix"): lanes 8i..8i+7 give the addresses of
// rows 0..7 of matrix i (16 bytes each, 16-byte aligned); lane l receives in
// r[i] the elements (row l>>2, cols 2(l%4), 2(l%4)+1) of matrix i -- of its
// transpose with .trans -- lower column in the low half.
template <int NUM, bool TRANS>
FAGEN_EMU_NO_TSAN void ldmatrix_complete(void* const* payloads, unsigned arrived) {
    static const char* const names[2][5] = {
        {"", "fa_ldmatrix_x1", "fa_ldmatrix_x2", "", "fa_ldmatrix_x4"},
        {"", "fa_ldmatrix_x1_trans", "fa_ldmatrix_x2_trans", "", "fa_ldmatrix_x4_trans"}};
    if (arrived != 0xffffffffu) need_full_warp(names[TRANS][NUM], arrived);
    const unsigned char* rows[32];
    for (unsigned l = 0; l < 8u * NUM; ++l) {
        rows[l] = static_cast<const unsigned char*>(static_cast<const LdmatrixLane*>(payloads[l])->row);
        if (reinterpret_cast<uintptr_t>(rows[l]) & 15u)
            fail("%s: lane %u's row address %p is not 16-byte aligned", names[TRANS][NUM], l,
                 static_cast<const void*>(rows[l]));
    }
    for (unsigned lane = 0; lane < 32; ++lane) {
        unsigned* r = static_cast<const LdmatrixLane*>(payloads[lane])->r;
        const unsigned g = lane >> 2, t = lane & 3u;
        for (unsigned i = 0; i < unsigned(NUM); ++i) {
            uint16_t lo, hi;
            const unsigned char* plo = !TRANS ? rows[8 * i + g] + 2 * (2 * t) : rows[8 * i + 2 * t] + 2 * g;
            const unsigned char* phi = !TRANS ? rows[8 * i + g] + 2 * (2 * t + 1) : rows[8 * i + 2 * t + 1] + 2 * g;
            memcpy(&lo, plo, 2);
            memcpy(&hi, phi, 2);
#if defined(FAGEN_EMU_RACECHECK)
            // The PTX memory model sees each lane read the elements it receives.
            const unsigned me = g_racecheck_warp_base + lane;
            race::access(me, plo, 2, race::kRead, g_racecheck_site);
            race::access(me, phi, 2, race::kRead, g_racecheck_site);
#endif
            r[i] = unsigned(lo) | unsigned(hi) << 16;
        }
    }
}

template <int NUM, bool TRANS>
FAGEN_EMU_NO_TSAN inline void ldmatrix(unsigned* r, const void* row, const char* file, int line) {
    static const char* const name = TRANS ? (NUM == 1 ? "fa_ldmatrix_x1_trans" : NUM == 2 ? "fa_ldmatrix_x2_trans"
                                                                                           : "fa_ldmatrix_x4_trans")
                                          : (NUM == 1 ? "fa_ldmatrix_x1" : NUM == 2 ? "fa_ldmatrix_x2"
                                                                                    : "fa_ldmatrix_x4");
    LdmatrixLane lane{r, row};
#if defined(FAGEN_EMU_RACECHECK)
    g_racecheck_warp_base = g.cur->index & ~31u;  // read by the completing lane (same warp)
    g_racecheck_site = race::site(file, line, name);
#endif
    warp_exchange(0xffffffffu, &lane, &ldmatrix_complete<NUM, TRANS>, name, file, line);
}

// The collectives' completions are instantiated once, in the runtime object (runtime.h's
// FAGEN_EMU_RUNTIME_DEFS), not in every module build.
#if FAGEN_EMU_RUNTIME_DEFS
#define FAGEN_EMU_INSTANTIATE template
#else
#define FAGEN_EMU_INSTANTIATE extern template
#endif
FAGEN_EMU_INSTANTIATE void mma_m16n8k16_complete<false>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void mma_m16n8k16_complete<true>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void ldmatrix_complete<1, false>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void ldmatrix_complete<2, false>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void ldmatrix_complete<4, false>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void ldmatrix_complete<1, true>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void ldmatrix_complete<2, true>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void ldmatrix_complete<4, true>(void* const*, unsigned);

FAGEN_EMU_FAST_END

// cp.async (16 bytes, .cg) with commit / wait groups, emulated adversarially.
// Issuing a copy fills its destination with poison -- the half-word 0x7fff,
// a NaN as fp16 and as bf16, and 0x7fff7fff is a NaN as float -- and queues the
// 16 source bytes (read at issue; zeros when !valid). The data lands only when
// the issuing thread waits for the copy's group, so a thread that reads a tile
// before its wait, or reads another thread's copy before the barrier that
// follows that thread's wait, sees NaN where a GPU would give undefined data.
struct AsyncCopy {
    unsigned char* dst;
    unsigned group;  // index of the commit group the copy belongs to
    unsigned char data[16];
};
struct AsyncQueue {
    AsyncCopy* items;
    unsigned n, cap;
    unsigned commits;  // commit groups closed so far by this thread
    uint64_t block;    // fagen_emu_state.block_serial the queue belongs to
};
inline AsyncQueue* async_queues = nullptr;
inline unsigned async_queue_count = 0;

FAGEN_EMU_NO_TSAN inline AsyncQueue& async_queue() {
    const unsigned i = g.cur->index;
    if (i >= async_queue_count) {
        const unsigned n = g.nthreads > i ? g.nthreads : i + 1;
        void* p = realloc(async_queues, n * sizeof(AsyncQueue));
        if (!p) fail("cp.async: out of host memory");
        async_queues = static_cast<AsyncQueue*>(p);
        memset(async_queues + async_queue_count, 0, (n - async_queue_count) * sizeof(AsyncQueue));
        async_queue_count = n;
    }
    AsyncQueue& q = async_queues[i];
    if (q.block != g.block_serial) {  // a new block: copies of earlier blocks are gone
        q.n = 0;
        q.commits = 0;
        q.block = g.block_serial;
    }
    return q;
}

FAGEN_EMU_NO_TSAN inline void cp_async_16(void* dst, const void* src, bool valid, const char* file, int line) {
    if (reinterpret_cast<uintptr_t>(dst) & 15u)
        fail("fa_cp_async_16 at %s:%d: shared destination %p is not 16-byte aligned", file, line, dst);
    if (valid && (reinterpret_cast<uintptr_t>(src) & 15u))
        fail("fa_cp_async_16 at %s:%d: global source %p is not 16-byte aligned", file, line, src);
    AsyncQueue& q = async_queue();
    if (q.n == q.cap) {
        const unsigned cap = q.cap ? 2 * q.cap : 16;
        void* p = realloc(q.items, cap * sizeof(AsyncCopy));
        if (!p) fail("cp.async: out of host memory");
        q.items = static_cast<AsyncCopy*>(p);
        q.cap = cap;
    }
    AsyncCopy& c = q.items[q.n++];
    c.dst = static_cast<unsigned char*>(dst);
    c.group = q.commits;
    if (valid) memcpy(c.data, src, 16);
    else memset(c.data, 0, 16);
    const uint16_t poison = 0x7fffu;
    for (int k = 0; k < 8; ++k) memcpy(c.dst + 2 * k, &poison, 2);
#if defined(FAGEN_EMU_RACECHECK)
    race::on_cp_async_issue(dst, file, line);
#endif
}

FAGEN_EMU_NO_TSAN inline void cp_async_commit() { ++async_queue().commits; }

// Lands (in issue order) every queued copy of a group older than the `pending`
// most recent committed groups.
FAGEN_EMU_NO_TSAN inline void cp_async_wait(unsigned pending, const char* file, int line,
                                            const char* what = "cp.async.wait_group") {
    AsyncQueue& q = async_queue();
#if defined(FAGEN_EMU_RACECHECK)
    struct Tick {  // the wait is a synchronisation event of the thread, after its copies land
        const char* file; int line; const char* what;
        FAGEN_EMU_NO_TSAN ~Tick() { race::on_cp_async_wait(file, line, what); }
    } tick{file, line, what};
#else
    (void)file, (void)line, (void)what;
#endif
    if (q.commits <= pending) return;
    const unsigned done = q.commits - pending;  // groups [0, done) complete
    unsigned keep = 0;
    for (unsigned k = 0; k < q.n; ++k) {
        AsyncCopy& c = q.items[k];
        if (c.group < done) {
            memcpy(c.dst, c.data, 16);
#if defined(FAGEN_EMU_RACECHECK)
            race::on_cp_async_land(c.dst);
#endif
        } else {
            q.items[keep++] = c;
        }
    }
    q.n = keep;
}

// cp.async.wait_all = cp.async.commit_group + cp.async.wait_group 0.
FAGEN_EMU_NO_TSAN inline void cp_async_wait_all(const char* file, int line) {
    cp_async_commit();
    cp_async_wait(0, file, line, "cp.async.wait_all");
}

}  // namespace fagen_emu
