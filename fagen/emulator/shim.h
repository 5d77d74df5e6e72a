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
template <typename T>
static inline T fagen_emu_rmw_add(T* p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
static inline float atomicAdd(float* p, float v) { return fagen_emu_rmw_add(p, v); }
static inline double atomicAdd(double* p, double v) { return fagen_emu_rmw_add(p, v); }
static inline int atomicAdd(int* p, int v) { return int(fagen_emu_rmw_add((unsigned*)p, unsigned(v))); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return fagen_emu_rmw_add(p, v); }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return fagen_emu_rmw_add(p, v);
}
template <typename T>
static inline T atomicExch(T* p, T v) {
    const T old = *p;
    *p = v;
    return old;
}
template <typename T>
static inline T atomicCAS(T* p, T compare, T v) {
    const T old = *p;
    if (old == compare) *p = v;
    return old;
}
template <typename T>
static inline T atomicMax(T* p, T v) {
    const T old = *p;
    if (v > old) *p = v;
    return old;
}
template <typename T>
static inline T atomicMin(T* p, T v) {
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
